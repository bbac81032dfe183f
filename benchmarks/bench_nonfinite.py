"""Per-step cost of the non-finite check (``on_nonfinite=error``) against ``off``, same Trainer otherwise.

The check is one fused NaN/Inf test over the step's losses and gradients and one host
sync; reported, no target.
"""
from __future__ import annotations

import torch

from .common import interleaved, row
from .workloads import TrainerLoop, batches, mid_mlp, sgd, tiny_mlp


def run(quick: bool) -> list[dict]:
    torch.set_num_threads(1)
    rows = []
    for name, make, steps in (("mid MLP (8×512, batch 64)", mid_mlp, 20),
                              ("tiny MLP (2×64, batch 32)", tiny_mlp, 300)):
        model, batch, dim = make()
        data = batches(batch, dim, steps)
        opt = sgd(model)  # shared (see workloads.HandLoop)
        systems = {policy: TrainerLoop(model, data, opt, on_nonfinite=policy) for policy in ("error", "off")}
        for fn in systems.values():  # warm up: allocator, guard warm-up steps, first-call costs
            fn()
        t = interleaved(systems, rounds=5 if quick else 21)
        rows.append(row(f"non-finite check (error vs off), {name}", t["error"], t["off"], None, steps))
    return rows
