"""On a CUDA GPU (no rows without one): the Trainer's step against the hand-written loop, and the host syncs
each makes per step. Path: automatic mode, one loss, Adam, the guard on ``check=auto``; batches already on
the GPU. Each round ends with ``torch.cuda.synchronize()``, so a round's time includes the GPU's work.

Small models on a GPU are bound by the host's kernel launches: there the Trainer's Python per step is
what a ratio shows (no target); larger ones hide it behind the GPU's work (target 1.02×).
"""
from __future__ import annotations

import sys
import warnings

import torch

from .common import interleaved, row
from .workloads import HandLoop, TrainerLoop, batches, encoder, mid_mlp


def on_gpu(make):
    model, batch, dim = make()
    return model.cuda(), batch, dim


def wide_mlp():
    from safeloop.models import MLP
    return MLP(in_dim=2048, hidden=4096, out_dim=2048, depth=8), 512, 2048


def synced(fn):
    def call():
        fn()
        torch.cuda.synchronize()
    return call


def syncs(fn) -> int:
    """Host syncs ``fn`` makes, as torch.cuda's sync debug mode counts them."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sum("synchroniz" in str(w.message) for w in caught)


def run(quick: bool) -> list[dict]:
    if not torch.cuda.is_available():
        return []
    rows = []
    for name, make, steps, rounds, target in (("mid MLP (8×512, batch 64)", mid_mlp, 50, 31, None),
                                              ("transformer encoder (2×128, seq 64, batch 16)", encoder, 20, 31, None),
                                              ("wide MLP (8×4096, batch 512)", wide_mlp, 20, 31, 1.02)):
        model, batch, dim = on_gpu(make)
        data = [(x.cuda(), y.cuda()) for x, y in batches(batch, dim, steps)]
        opt = torch.optim.Adam(model.parameters(), lr=1e-4)
        hand, ours = HandLoop(model, data, opt), TrainerLoop(model, data, opt, device="cuda", log_every=10 ** 6)
        systems = {"hand": synced(hand), "safeloop": synced(ours)}
        for fn in systems.values():  # warm up: allocator, cuBLAS handles, the guard's checked warm-up steps
            fn()
        t = interleaved(systems, rounds=5 if quick else rounds)
        rows.append(row(f"CUDA: Trainer vs hand loop, {name} ({torch.cuda.get_device_name()})",
                        t["safeloop"], t["hand"], target, steps))
        print(f"CUDA {name}: host syncs in one round of {steps} steps: Trainer {syncs(ours)} (one fit(), its "
              f"start and end included), hand loop {syncs(hand)}", file=sys.stderr)
    return rows
