"""Three losses on a shared trunk: time against the hand-written step, ``sum`` vs sequential,
and peak memory of auto-retain against retain-on-every-backward-but-the-last.

``multi_loss=sum`` is held to what it replaces: a ``training_step`` that adds the losses itself
(what ``sum`` costs on top of that, ≤ 1.01×); its ratio to the hand-written loop is shown too.

The workload is ``recipes/multi_loss.py``'s model (wider), with its losses in the order
``reg, cls, recon``: ``reg`` and ``cls`` share one trunk pass, ``recon`` runs the trunk on an
unlabelled batch. Raw PyTorch's rule retains on ``reg`` and ``cls``; the guard proves ``cls``
shares nothing with ``recon`` but parameters, so ``cls``'s backward frees the labelled pass
before ``recon``'s backward runs.

Peak memory is measured, not estimated: one step runs under ``torch.profiler`` with
``profile_memory=True``, and the peak is the largest running sum of the allocator's
allocation and free events (bytes above what was allocated when the step started).
"""
from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

from safeloop.recipes.multi_loss import MultiLossTrainer, MultiTask, tasks

from .common import interleaved, row
from .workloads import TrainerLoop


def three_losses(model, batch):
    x, y_reg, y_cls, x_u = batch
    out_reg, out_cls = model(x)
    recon = F.mse_loss(model.recon(model.trunk(x_u)), x_u)
    return {"reg": F.mse_loss(out_reg, y_reg), "cls": F.cross_entropy(out_cls, y_cls), "recon": recon}


class Ordered(MultiLossTrainer):
    def training_step(self, batch):
        return three_losses(self.model, batch)

    def on_fit_end(self) -> None:
        """The recipe prints a report; a benchmark must not."""


class HandLoop:
    """What a user writes by hand: retain_graph=True on every backward but the last."""

    def __init__(self, model, data, opt):
        self.model, self.data, self.opt = model, data, opt

    def __call__(self):
        for batch in self.data:
            reg, cls, recon = three_losses(self.model, batch).values()
            reg.backward(retain_graph=True)
            cls.backward(retain_graph=True)
            recon.backward()
            self.opt.step()
            self.opt.zero_grad(set_to_none=True)  # once a step, as the Trainer (at the next step's start)


class HandSum(HandLoop):
    """The same losses added by hand and back-propagated once."""

    def __call__(self):
        for batch in self.data:
            reg, cls, recon = three_losses(self.model, batch).values()
            (reg + cls + recon).backward()
            self.opt.step()
            self.opt.zero_grad(set_to_none=True)


class ReturnsTheSum(Ordered):
    """The same losses added in ``training_step``: the Trainer gets one loss tensor."""

    def training_step(self, batch):
        reg, cls, recon = three_losses(self.model, batch).values()
        return reg + cls + recon


def trainer_loop(model, data, opt=None, cls=Ordered, **kwargs) -> TrainerLoop:
    """``len(data)`` more steps of one long-lived Trainer per call (Adam unless ``opt``)."""
    return TrainerLoop(model, data, opt or (lambda p: torch.optim.Adam(p, lr=1e-3)), cls=cls, **kwargs)


def peak_step_bytes(loop: TrainerLoop) -> int:
    """Peak bytes allocated above the start of one Trainer step, from the profiler's allocator events."""
    loop.trainer.train_data = loop.trainer.train_data[:1]
    loop.steps = 1
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        loop()
    events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events()
                    if e.name() == "[memory]")
    live = peak = 0
    for _, nbytes in events:
        live += nbytes
        peak = max(peak, live)
    return peak


def run(quick: bool) -> list[dict]:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = MultiTask(in_dim=64, hidden=256, classes=8)
    steps = 10 if quick else 40  # rounds of about 0.2 s per system (see bench_overhead)
    data = list(tasks(n_train=128 * steps, n_val=128, in_dim=64, classes=8, batch_size=128).train)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)  # one model and optimizer for all (see workloads.HandLoop)
    systems = {
        "hand": HandLoop(model, data, opt),
        "hand sum": HandSum(model, data, opt),
        "sequential": trainer_loop(model, data, opt),
        "sum": trainer_loop(model, data, opt, multi_loss="sum"),
        "returned sum": trainer_loop(model, data, opt, cls=ReturnsTheSum),
    }
    for fn in systems.values():  # warm up: allocator, first calls, the guard's checked warm-up steps
        fn()
    t = interleaved(systems, rounds=5 if quick else 41)

    # Memory: the guard walks the step (auto retain) vs a step it does not walk (all but the last).
    peaks = {}
    for check in ("always", "off"):
        loop = trainer_loop(copy.deepcopy(model), list(data), guard={"check": check})
        loop()  # optimizer state and parameter gradients exist from here on, as in training
        peaks[check] = sorted(peak_step_bytes(loop) for _ in range(3))[1]  # the median of three runs
    return [
        row("3 losses, shared trunk: sequential + auto retain vs hand-written", t["sequential"], t["hand"], 1.02,
            steps),
        row("3 losses: multi_loss=sum vs training_step returning their sum", t["sum"], t["returned sum"], 1.01,
            steps),
        row("3 losses: multi_loss=sum vs their sum in a hand-written loop", t["sum"], t["hand sum"], None, steps),
        row("3 losses: multi_loss=sum vs sequential", t["sum"], t["sequential"], None, steps),
        {"benchmark": f"3 losses: peak step memory, auto retain vs all-but-last "
                      f"({peaks['always'] / 2**20:.2f} vs {peaks['off'] / 2**20:.2f} MiB)",
         "safeloop_us": float("nan"), "reference_us": float("nan"), "ratio": peaks["always"] / peaks["off"],
         "target": 1.0, "ok": peaks["always"] <= peaks["off"]},
    ]
