"""Cost of the graph-lifecycle guard (issue targets: ≤ 1.5 µs per node; check=auto ≤ 1.02× of check=off)."""
from __future__ import annotations

import copy
import statistics
import time

import torch.nn.functional as F

from safeloop import Guard
from safeloop.guard import walk

from .common import interleaved, row
from .workloads import TrainerLoop, batches, encoder, mid_mlp


def per_node(make, rounds: int) -> tuple[float, float, int]:
    """Median seconds of one full check of a fresh graph (counter read, pre-flight, leak check),
    median seconds of the walk alone on another fresh graph, and the graph's node count."""
    model, batch, shape = make()
    (x, y), = batches(batch, shape, 1)
    guard = Guard(check="always")
    guard.start_fit()
    full, walks, nodes = [], [], 0
    for step in range(1, rounds + 1):
        t0 = time.perf_counter()
        guard.begin_step(step)
        begin = time.perf_counter() - t0
        loss = F.mse_loss(model(x), y)
        t0 = time.perf_counter()
        guard.preflight({"loss": loss}, step)
        check = time.perf_counter() - t0
        loss.backward()
        del loss
        t0 = time.perf_counter()
        guard.end_step(step)  # the leak check, once the step's references are gone
        full.append(time.perf_counter() - t0 + check + begin)
        loss = F.mse_loss(model(x), y)
        t0 = time.perf_counter()
        found = walk.walk(loss.grad_fn, guard.start_seq, step)
        walks.append(time.perf_counter() - t0)
        nodes = len(found.nodes) + found.leaves
        del found, loss
    return statistics.median(full), statistics.median(walks), nodes


def run(quick: bool) -> list[dict]:
    rows = []
    for name, make, steps in (("mid MLP", mid_mlp, 20), ("transformer encoder (2×128, seq 64, batch 16)", encoder, 10)):
        cost, walked, nodes = per_node(make, 10 if quick else 40)
        for what, seconds in (("full check", cost), ("graph walk alone", walked)):
            per = seconds / nodes * 1e6  # the ratio column is µs per node against the 1.5 µs target
            rows.append({"benchmark": f"guard {what}, µs per node: {name} ({nodes} nodes)",
                         "safeloop_us": seconds * 1e6, "reference_us": float("nan"), "ratio": per / 1.5,
                         "target": 1.0, "ok": per <= 1.5, "per_node_us": per})
        model, batch, shape = make()
        data = batches(batch, shape, steps)
        systems = {check: TrainerLoop(copy.deepcopy(model), data, guard={"check": check})
                   for check in ("off", "auto", "always")}
        for fn in systems.values():
            fn()
        t = interleaved(systems, rounds=5 if quick else 15)
        rows.append(row(f"guard check=auto vs off, {name}", t["auto"], t["off"], 1.02, steps))
        rows.append(row(f"guard check=always vs off, {name}", t["always"], t["off"], None, steps))
    return rows
