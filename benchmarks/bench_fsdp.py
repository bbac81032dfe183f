"""2-process CPU sharded training (FSDP2): memory each rank holds, and step time against a hand-written FSDP2 loop.

``run`` launches ``torchrun --nproc-per-node=2`` on this module. Each rank builds the same wide MLP
(4 Linear layers of width 1024: 4.2 M parameters, Adam), and three systems train it on the rank's
own batches (16 per rank, gloo, one thread): the Trainer with ``strategy=ddp``, the Trainer with
``strategy=fsdp``, and the loop a user writes with FSDP2 (``fully_shard`` on each Linear and the root,
as ``safeloop.fsdp.shard`` does). They run interleaved round by round; rank zero writes the medians.

Memory counts the bytes of the tensors a rank holds between steps: its parameters (its shards under
FSDP2) and its optimizer state (Adam's two moments; its step counters). Gradients are freed after
every step in all three, and activations are the same in all three, so neither is counted.
"""
from __future__ import annotations

import copy
import json
import sys
import time
import warnings
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F

from safeloop import Trainer, fsdp
from safeloop.models import MLP

from .common import interleaved, median, on_two_ranks, row
from .workloads import batches

WIDTH, DEPTH, BATCH = 1024, 4, 16


def held_bytes(optimizer: torch.optim.Optimizer) -> int:
    """This rank's bytes of ``optimizer``'s parameters and state (shards under FSDP2)."""
    params = [p for g in optimizer.param_groups for p in g["params"]]
    state = [v for p in params for v in optimizer.state.get(p, {}).values() if torch.is_tensor(v)]
    return sum(fsdp.local(t).nbytes for t in params + state)


class FitTimed(Trainer):
    def on_fit_start(self) -> None:
        self.started = time.perf_counter()


class TrainerSteps:
    """``len(data)`` more steps of one long-lived Trainer per call, timed from ``on_fit_start``."""

    def __init__(self, model, data, strategy: str):
        self.steps = len(data)
        self.trainer = FitTimed(model=model, train_data=data, optimizer=partial(torch.optim.Adam, lr=1e-4),
                                max_steps=self.steps, device="cpu", progress=False, loggers=(), strategy=strategy)
        self.trainer.max_steps = 0

    def __call__(self) -> float:
        self.trainer.max_steps += self.steps
        self.trainer.fit()
        return time.perf_counter() - self.trainer.started


class HandFSDP:
    """The loop a user writes with FSDP2, on the CPU (FSDP2's default mesh is CUDA's wherever there is a GPU)."""

    def __init__(self, model, data):
        fsdp.shard(model, device=torch.device("cpu"))
        self.model, self.data = model, data
        self.opt = torch.optim.Adam(model.parameters(), lr=1e-4)

    def __call__(self):
        for x, y in self.data:
            loss = F.mse_loss(self.model(x), y)
            loss.backward()
            self.opt.step()
            self.opt.zero_grad(set_to_none=True)


def worker(out: Path, rounds: int, steps: int) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = MLP(WIDTH, WIDTH, WIDTH, DEPTH)
    data = batches(BATCH, WIDTH, steps, seed=rank)  # each rank its own shard
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "train_data is a list, not a DataLoader": sharded above
        systems = {"ddp": TrainerSteps(copy.deepcopy(model), data, "ddp"),
                   "fsdp": TrainerSteps(copy.deepcopy(model), data, "fsdp"),
                   "hand": HandFSDP(copy.deepcopy(model), data)}
        for fn in systems.values():  # warm up: optimizer state, allocator, the guard's checked first steps
            fn()
        t = interleaved(systems, rounds=rounds)
    memory = {name: held_bytes(system.trainer.optimizers["optimizer"] if name != "hand" else system.opt)
              for name, system in systems.items()}
    if rank == 0:
        out.write_text(json.dumps({"times": {name: value.rounds for name, value in t.items()}, "memory": memory}))
    del systems
    dist.destroy_process_group()


def run(quick: bool) -> list[dict]:
    rounds, steps = (3, 20) if quick else (11, 20)  # 20 steps a call: fit()'s own start and end weigh little
    found = on_two_ranks("bench_fsdp", str(rounds), str(steps))
    t = {name: median(rounds) for name, rounds in found["times"].items()}
    memory = found["memory"]
    mib = {name: value / 2**20 for name, value in memory.items()}
    return [
        {"benchmark": f"2-process FSDP2: parameters + Adam state held per rank, strategy=fsdp vs ddp "
                      f"({mib['fsdp']:.1f} vs {mib['ddp']:.1f} MiB; wide MLP {DEPTH}×{WIDTH})",
         "safeloop_us": float("nan"), "reference_us": float("nan"), "ratio": memory["fsdp"] / memory["ddp"],
         "target": 0.55, "ok": memory["fsdp"] / memory["ddp"] <= 0.55},
        row(f"2-process CPU FSDP2 (gloo): Trainer strategy=fsdp vs hand FSDP2 loop, wide MLP ({DEPTH}×{WIDTH}, "
            f"batch {BATCH}/rank, Adam)", t["fsdp"], t["hand"], 1.05, steps),
        row("2-process CPU: Trainer strategy=fsdp vs strategy=ddp, same model", t["fsdp"], t["ddp"], None, steps),
    ]


if __name__ == "__main__":
    worker(Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]))
