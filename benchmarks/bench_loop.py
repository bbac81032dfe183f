"""The guard in a hand-written loop: ``GraphGuard`` (``check=auto``) and ``safeloop.watch``'s hooks,
against the same loop bare (targets: mid MLP ≤ 1.02×, tiny MLP ≤ 1.05×).

Every system runs the same steps on one shared model and optimizer. ``GraphGuard`` is given no
optimizer (``with guard.step()`` marks the steps), so that no hook stays on the shared optimizer;
the watch row enters ``safeloop.watch.Watch`` (``Tensor.backward`` replaced, a global optimizer
step hook) around its own rounds only, its loop the bare one, unmodified.
"""
from __future__ import annotations

import torch.nn.functional as F

from safeloop import GraphGuard
from safeloop.watch import Watch

from .common import interleaved, row
from .workloads import HandLoop, batches, mid_mlp, sgd, tiny_mlp


class Guarded(HandLoop):
    def __init__(self, model, data, opt):
        super().__init__(model, data, opt)
        self.guard = GraphGuard(model)

    def __call__(self):
        model, opt, guard = self.model, self.opt, self.guard
        for x, y in self.data:
            with guard.step():
                loss = F.mse_loss(model(x), y)
                guard.backward(loss)
                opt.step()
                opt.zero_grad(set_to_none=True)


class Watched(HandLoop):
    def __init__(self, model, data, opt):
        super().__init__(model, data, opt)
        self.watch = Watch(GraphGuard(), __file__)

    def __call__(self):
        with self.watch:
            super().__call__()


def run(quick: bool) -> list[dict]:
    rows = []
    for name, make, steps, rounds, target in (("tiny MLP (2×64, batch 32)", tiny_mlp, 500, 61, 1.05),
                                              ("mid MLP (8×512, batch 64)", mid_mlp, 15, 41, 1.02)):
        model, batch, dim = make()
        data = batches(batch, dim, steps)
        opt = sgd(model)
        systems = {"bare": HandLoop(model, data, opt), "guard": Guarded(model, data, opt),
                   "watch": Watched(model, data, opt)}
        for fn in systems.values():  # warm up: allocator, the guard's checked warm-up steps
            fn()
        t = interleaved(systems, rounds=5 if quick else rounds)
        rows.append(row(f"GraphGuard (check=auto) in a hand-written loop vs the bare loop, {name}", t["guard"],
                        t["bare"], target, steps))
        rows.append(row(f"python -m safeloop.watch (hooks on, check=auto) vs the bare loop, {name}", t["watch"],
                        t["bare"], None, steps))
    return rows
