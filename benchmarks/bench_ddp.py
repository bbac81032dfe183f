"""2-process CPU data-parallel step time: the Trainer under torchrun against a hand-written DDP loop.

``run`` launches ``torchrun --nproc-per-node=2`` on this module; each rank holds both systems on
the same model (mid MLP, 8 Linear layers of width 512, batch 64 per rank, gloo, one thread),
times them interleaved round by round, and rank zero writes the medians to a JSON file.
The hand loop wraps the model in ``DistributedDataParallel``; so does the Trainer, around its
``training_step`` (the usual run; see safeloop/distributed.py).
"""
from __future__ import annotations

import copy
import json
import sys
import warnings
from pathlib import Path

import torch

from .common import interleaved, median, on_two_ranks, row
from .workloads import HandLoop, TrainerLoop, batches, mid_mlp


def hand_ddp(model, data) -> HandLoop:
    """The loop a user writes with ``DistributedDataParallel``: the hand loop over the wrapped model
    (gradients zeroed right after the step, as the Trainer does)."""
    return HandLoop(torch.nn.parallel.DistributedDataParallel(model), data)


def worker(out: Path, rounds: int, steps: int) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo")  # the Trainer joins this group (and leaves it to us to destroy)
    rank = dist.get_rank()
    model, batch, dim = mid_mlp()
    data = batches(batch, dim, steps, seed=rank)  # each rank its own shard
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "train_data is a list, not a DataLoader": sharded above
        systems = {"ddp": hand_ddp(copy.deepcopy(model), data), "safeloop": TrainerLoop(copy.deepcopy(model), data)}
        for fn in systems.values():  # warm up: buckets, allocator, the guard's checked first steps
            fn()
        t = interleaved(systems, rounds=rounds)
    if rank == 0:
        out.write_text(json.dumps({name: value.rounds for name, value in t.items()}))
    # the hand loop's DistributedDataParallel goes before the group: one that outlived it hung a rank at exit
    del systems
    dist.destroy_process_group()


def run(quick: bool) -> list[dict]:
    # calls of about 0.4 s: short, as the shared machine's load changes by the second, yet long enough that the
    # first steps after a new DDP wrapper (rebuilt at every fit(): see TrainerSteps) weigh little
    rounds, steps = (5, 20) if quick else (41, 20)
    t = {name: median(rounds) for name, rounds in on_two_ranks("bench_ddp", str(rounds), str(steps)).items()}
    return [row("2-process CPU DDP (gloo) vs hand DDP loop, mid MLP (8×512, batch 64/rank)",
                t["safeloop"], t["ddp"], 1.05, steps)]


if __name__ == "__main__":
    worker(Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]))
