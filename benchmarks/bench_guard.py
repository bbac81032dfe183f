"""Cost of the graph-lifecycle guard (targets: ≤ 1.5 µs per node; check=auto ≤ 1.02× of check=off)."""
from __future__ import annotations

import statistics
import time

import torch
import torch.nn.functional as F
from torch import nn

from safeloop.guard.guard import Guard  # the engine itself: the benchmark times its calls
from safeloop.guard import walk

from .common import interleaved, row
from .workloads import TrainerLoop, batches, encoder, mid_mlp, sgd


def traverse(root) -> None:
    """The least any walk in Python does: each node's ``next_functions`` read once (what makes the nodes' Python
    wrappers), each node met kept in a set. No test, no list of what was found."""
    seen, stack = {root}, [root]
    while stack:
        for nxt, _ in stack.pop().next_functions:
            if nxt is not None and nxt not in seen:
                seen.add(nxt)
                stack.append(nxt)


def per_node(make, rounds: int) -> tuple[float, float, float, int, int]:
    """What checking adds per step, and what the walk alone costs, on fresh graphs of one model.

    The check: ``begin_step`` + ``preflight`` + ``end_step`` + ``step_done`` of a ``check=always`` guard minus the
    same calls of a ``check=off`` guard (the same timed windows, so what the timers themselves
    cost cancels), on alternating steps; summed over cycles of 4 checks, since every 4th check
    also runs the secondary checks (consumed graph, leak sentinel). Returns the median per check,
    the median walk alone, the median ``traverse`` of the same graph (the steps alternate between the two,
    each after the same backwards: the floor the walk is held against), the number of nodes the walk visits
    (AccumulateGrad leaves, which it only counts, not included) and the number of those leaves.
    """
    model, batch, shape = make()
    (x, y), = batches(batch, shape, 1)
    guards = {"always": Guard(check="always", warmup=0), "off": Guard(check="off")}
    times: dict[str, list[float]] = {name: [] for name in guards}
    walks, floors, nodes, leaves = [], [], 0, 0
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
        if step % 2:
            found = walk.walk(loss.grad_fn, start, step)
            walks.append(time.perf_counter() - t0)
            nodes, leaves = len(found.nodes), len(found.leaves)
            del found
        else:
            traverse(loss.grad_fn)
            floors.append(time.perf_counter() - t0)
        del loss
    on, off = times["always"], times["off"]
    cycles = [(sum(on[i:i + 4]) - sum(off[i:i + 4])) / 4 for i in range(0, len(on), 4)]
    return statistics.median(cycles), statistics.median(walks), statistics.median(floors), nodes, leaves


class _KeptLinear(torch.autograd.Function):
    """A linear layer whose input and weight are kept on ctx as attributes (what the ctx check reads)."""

    @staticmethod
    def forward(ctx, x, weight):
        ctx.x, ctx.weight = x, weight
        return x.mm(weight.t())

    @staticmethod
    def backward(ctx, grad):
        return grad.mm(ctx.weight), grad.t().mm(ctx.x)


class _KeptMLP(nn.Module):
    """The mid MLP's shape (8×512) with every layer an autograd Function keeping its tensors on ctx."""

    def __init__(self, width: int = 512, depth: int = 8):
        super().__init__()
        self.weights = nn.ParameterList(nn.Parameter(torch.randn(width, width) / width ** 0.5) for _ in range(depth))

    def forward(self, x):
        for weight in self.weights:
            x = torch.relu(_KeptLinear.apply(x, weight))
        return x


def kept_mlp():
    return _KeptMLP(), 64, (512,)


def ctx_check(make, rounds: int) -> tuple[float, int]:
    """What the check of tensors kept on an autograd Function's ctx adds to a thorough pre-flight (every warm-up
    step, every 4th check after): the same pre-flight with ``inplace`` on and off, in alternating order, each on a
    fresh graph of one model. Returns the median difference per check and the nodes walked."""
    model, batch, shape = make()
    (x, y), = batches(batch, shape, 1)
    guards = {"on": Guard(check="always", warmup=10 ** 9), "off": Guard(check="always", warmup=10 ** 9,
                                                                       ignore=("inplace",))}
    times: dict[str, list[float]] = {name: [] for name in guards}
    nodes = 0
    for guard in guards.values():
        guard.start_fit()
    for step in range(1, rounds + 1):
        for name in ("on", "off") if step % 2 else ("off", "on"):  # alternating: the order's own effect cancels
            guard = guards[name]
            guard.begin_step(step)
            loss = F.mse_loss(model(x), y)
            t0 = time.perf_counter()
            guard.preflight({"loss": loss}, step)
            times[name].append(time.perf_counter() - t0)
            nodes = len(walk.walk(loss.grad_fn, None, step).nodes)
            del loss
            guard.end_step(step)
            guard.step_done()
    diffs = [a - b for a, b in zip(times["on"], times["off"])]
    return statistics.median(diffs), nodes


def run(quick: bool) -> list[dict]:
    rows = []
    for name, make in (("mid MLP, no autograd Function", mid_mlp),
                       ("8×512 MLP of autograd Functions keeping input and weight on ctx", kept_mlp)):
        cost, nodes = ctx_check(make, 21 if quick else 201)
        per = cost / nodes * 1e6
        rows.append({"benchmark": f"guard ctx check (thorough pre-flight, inplace on − off): {per:.3f} µs per node "
                                  f"walked, {name} ({nodes} nodes walked)",
                     "safeloop_us": cost * 1e6, "reference_us": float("nan"), "ratio": per / 1.5, "target": None,
                     "ok": True, "per_node_us": per})
    # the parameters' fingerprints (check=always only): the Trainer under always, with and without the inplace check
    model, batch, shape = mid_mlp()
    data = batches(batch, shape, 15)
    opt = sgd(model)
    systems = {name: TrainerLoop(model, data, opt, guard={"check": "always", "ignore": ignore})
               for name, ignore in (("prints", []), ("none", ["inplace"]))}
    for fn in systems.values():
        fn()
    t = interleaved(systems, rounds=5 if quick else 41)
    rows.append(row("guard fingerprints of .data writes (check=always, inplace on vs off), mid MLP", t["prints"],
                    t["none"], None, 15))
    # rounds of about 0.2 s per system, many of them (see bench_overhead)
    for name, make, steps, rounds in (("mid MLP", mid_mlp, 15, 41),
                                      ("transformer encoder (2×128, seq 64, batch 16)", encoder, 5, 41)):
        cost, walked, floor, nodes, leaves = per_node(make, 5 if quick else 30)
        for what, seconds in (("check (always − off)", cost), ("graph walk alone", walked)):
            per = seconds / nodes * 1e6  # the ratio column is µs per node against the 1.5 µs target
            rows.append({"benchmark": f"guard {what}: {per:.2f} µs per node walked (ratio: per 1.5 µs), {name} "
                                      f"({nodes} nodes walked; its {leaves} AccumulateGrad leaves, only counted, "
                                      "not included)",
                         "safeloop_us": seconds * 1e6, "reference_us": float("nan"), "ratio": per / 1.5,
                         "target": 1.0, "ok": per <= 1.5, "per_node_us": per})
        per = floor / nodes * 1e6
        rows.append({"benchmark": f"graph traversal floor (each node's next_functions read once, nothing else): "
                                  f"{per:.2f} µs per node walked, {name}, the same graphs (ratio: the walk alone "
                                  "over it)", "safeloop_us": walked * 1e6, "reference_us": floor * 1e6,
                     "ratio": walked / floor, "target": None, "ok": None, "per_node_us": per})
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
