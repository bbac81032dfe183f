"""Timing helpers shared by the benchmarks: interleaved rounds, medians, ratios.

The machines are shared and noisy, so every benchmark runs its systems in one
process, one thread, alternating round by round, and compares medians.
"""
from __future__ import annotations

import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


class Median(float):
    """A median of per-round seconds that keeps its rounds, so that two give a paired ratio."""

    rounds: list[float]


def interleaved(systems: dict[str, Callable[[], float | None]], rounds: int = 15) -> dict[str, Median]:
    """Median seconds per call of each system; the order rotates every round. A system that returns
    a number has timed itself (the part of the call it is compared on), in seconds."""
    names = list(systems)
    times: dict[str, list[float]] = {n: [] for n in names}
    for r in range(rounds):
        order = names[r % len(names):] + names[: r % len(names)]
        for name in order:
            t0 = time.perf_counter()
            took = systems[name]()
            times[name].append(time.perf_counter() - t0 if took is None else took)
    out = {}
    for name, values in times.items():
        out[name] = Median(statistics.median(values))
        out[name].rounds = values
    return out


def median(rounds: list[float]) -> Median:
    """The ``Median`` of per-round seconds measured elsewhere (another process)."""
    value = Median(statistics.median(rounds))
    value.rounds = rounds
    return value


def row(name: str, ours: float, ref: float, target: float | None, unit_per: int = 1) -> dict:
    """One table row: per-step microseconds of both systems and their ratio.

    With per-round timings, the ratio is the median of the rounds' own ratios: the two
    systems of one round ran seconds apart, so the machine's drift cancels out.
    """
    paired = getattr(ours, "rounds", None), getattr(ref, "rounds", None)
    ratio = statistics.median(a / b for a, b in zip(*paired)) if all(paired) else ours / ref
    return {
        "benchmark": name,
        "safeloop_us": ours / unit_per * 1e6,
        "reference_us": ref / unit_per * 1e6,
        "ratio": ratio,
        "target": target,
        "ok": None if target is None else ratio <= target,
    }


def table(rows: list[dict]) -> str:
    lines = ["| benchmark | safeloop µs/step | reference µs/step | ratio | target |",
             "|---|---:|---:|---:|---|"]
    def us(value: float) -> str:
        return "—" if math.isnan(value) else f"{value:.1f}"  # a row that times nothing (a memory ratio)

    for r in rows:
        target = "—" if r["target"] is None else f"≤ {r['target']:.2f}× {'✓' if r['ok'] else '✗'}"
        lines.append(f"| {r['benchmark']} | {us(r['safeloop_us'])} | {us(r['reference_us'])} | "
                     f"{r['ratio']:.3f}× | {target} |")
    return "\n".join(lines)


def on_two_ranks(module: str, *args: str) -> dict:
    """What ``python -m benchmarks.MODULE OUT *args`` wrote to the JSON file OUT, run by
    ``torchrun --nproc-per-node=2`` (gloo, one thread per rank)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "out.json"
        path = str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=path)
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
               "-m", f"benchmarks.{module}", str(out), *args]
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
        if proc.returncode != 0:
            raise RuntimeError(f"{module} workers failed:\n{proc.stdout}\n{proc.stderr}")
        return json.loads(out.read_text())
