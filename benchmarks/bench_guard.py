"""Cost of the graph-lifecycle guard (targets: ≤ 1.5 µs per node; check=auto ≤ 1.02× of check=off)."""
from __future__ import annotations

import statistics
import time

import torch.nn.functional as F

from safeloop.guard.guard import Guard  # the engine itself: the benchmark times its calls
from safeloop.guard import walk

from .common import interleaved, row
from .workloads import TrainerLoop, batches, encoder, mid_mlp, sgd


def per_node(make, rounds: int) -> tuple[float, float, int, int]:
    """What checking adds per step, and what the walk alone costs, on fresh graphs of one model.

    The check: ``begin_step`` + ``preflight`` + ``end_step`` + ``step_done`` of a ``check=always`` guard minus the
    same calls of a ``check=off`` guard (the same timed windows, so what the timers themselves
    cost cancels), on alternating steps; summed over cycles of 4 checks, since every 4th check
    also runs the secondary checks (consumed graph, leak sentinel). Returns the median per check,
    the median walk alone, the number of nodes the walk visits (AccumulateGrad leaves, which it
    only counts, not included) and the number of those leaves.
    """
    model, batch, shape = make()
    (x, y), = batches(batch, shape, 1)
    guards = {"always": Guard(check="always", warmup=0), "off": Guard(check="off")}
    times: dict[str, list[float]] = {name: [] for name in guards}
    walks, nodes, leaves = [], 0, 0
    for guard in guards.values():
        guard.start_fit()
    for step in range(1, 4 * rounds + 1):
        for name, guard in guards.items():
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
            guard.end_step(step)  # the leak check of the step before, once this step's references are gone
            guard.step_done()
            times[name].append(time.perf_counter() - t0 + check + begin)
            model.zero_grad(set_to_none=True)
        start = walk.sequence_now()
        loss = F.mse_loss(model(x), y)
        t0 = time.perf_counter()
        found = walk.walk(loss.grad_fn, start, step)
        walks.append(time.perf_counter() - t0)
        nodes, leaves = len(found.nodes), len(found.leaves)
        del found, loss
    on, off = times["always"], times["off"]
    cycles = [(sum(on[i:i + 4]) - sum(off[i:i + 4])) / 4 for i in range(0, len(on), 4)]
    return statistics.median(cycles), statistics.median(walks), nodes, leaves


def run(quick: bool) -> list[dict]:
    rows = []
    # rounds of about 0.2 s per system, many of them (see bench_overhead)
    for name, make, steps, rounds in (("mid MLP", mid_mlp, 15, 41),
                                      ("transformer encoder (2×128, seq 64, batch 16)", encoder, 5, 41)):
        cost, walked, nodes, leaves = per_node(make, 5 if quick else 30)
        for what, seconds in (("check (always − off)", cost), ("graph walk alone", walked)):
            per = seconds / nodes * 1e6  # the ratio column is µs per node against the 1.5 µs target
            rows.append({"benchmark": f"guard {what}: {per:.2f} µs per node walked (ratio: per 1.5 µs), {name} "
                                      f"({nodes} nodes walked; its {leaves} AccumulateGrad leaves, only counted, "
                                      "not included)",
                         "safeloop_us": seconds * 1e6, "reference_us": float("nan"), "ratio": per / 1.5,
                         "target": 1.0, "ok": per <= 1.5, "per_node_us": per})
        model, batch, shape = make()
        data = batches(batch, shape, steps)
        opt = sgd(model)  # shared (see workloads.HandLoop)
        systems = {check: TrainerLoop(model, data, opt, guard={"check": check}) for check in ("off", "auto", "always")}
        for fn in systems.values():
            fn()
        t = interleaved(systems, rounds=5 if quick else rounds)
        rows.append(row(f"guard check=auto vs off, {name}", t["auto"], t["off"], 1.02, steps))
        rows.append(row(f"guard check=always vs off, {name}", t["always"], t["off"], None, steps))
    return rows
