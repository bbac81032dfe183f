"""Trainer per-step overhead against a hand-written PyTorch loop doing the same work (targets: tiny MLP
≤ 1.05×, mid MLP and transformer encoder ≤ 1.02×). Path: automatic mode, one loss, one optimizer, the guard
on ``check=auto`` (its warm-up steps run before timing). The Trainer is timed from ``on_fit_start``: what
``fit()`` does before its first step, once per run, has its own row."""
from __future__ import annotations

from .common import interleaved, row
from .workloads import HandLoop, TrainerLoop, batches, encoder, mid_mlp, sgd, tiny_mlp


def run(quick: bool) -> list[dict]:
    rows = []
    # Rounds of about 0.2 s per system, many of them: the two systems of a round run within a
    # second of each other, so the paired ratios see the same machine load, and each call is long
    # enough that its first step (cold caches after the other system ran) weighs little.
    for name, make, steps, rounds, target in (("tiny MLP (2×64, batch 32)", tiny_mlp, 500, 61, 1.05),
                                              ("mid MLP (8×512, batch 64)", mid_mlp, 15, 41, 1.02),
                                              ("transformer encoder (2×128, seq 64, batch 16)", encoder, 5, 41, 1.02)):
        model, batch, dim = make()
        data = batches(batch, dim, steps)
        opt = sgd(model)  # shared (see workloads.HandLoop)
        systems = {"hand": HandLoop(model, data, opt), "safeloop": TrainerLoop(model, data, opt)}
        for fn in systems.values():  # warm up: allocator, guard warm-up steps, first-call costs
            fn()
        t = interleaved(systems, rounds=5 if quick else rounds)
        rows.append(row(f"Trainer vs hand loop, {name}", t["safeloop"], t["hand"], target, steps))
        if make is tiny_mlp:
            setup, hand_step = systems["safeloop"].setup, t["hand"] / steps
            rows.append({"benchmark": f"Trainer.fit() before its first step (once per fit; not in the rows of steps), "
                                      f"{name} (ratio: in hand-written steps)", "safeloop_us": setup * 1e6,
                         "reference_us": hand_step * 1e6, "ratio": setup / hand_step, "target": None, "ok": None})
    return rows
