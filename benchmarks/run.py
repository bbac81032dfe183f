"""Run every benchmark: ``python -m benchmarks.run [--quick] [--only NAME]``.

Each ``benchmarks/bench_*.py`` module has ``run(quick: bool) -> list[dict]`` (rows made
with ``benchmarks.common.row``). Results print as one markdown table of ratios against
plain PyTorch measured in the same process. A full run exits 1 when a row misses its target;
``--quick`` (a smoke run, too few rounds for its ratios to decide anything) names such rows and exits 0. A benchmark
that raises loses its own rows only, and the run exits 1.
"""
from __future__ import annotations

import argparse
import ctypes
import importlib
import json
import os
import pkgutil
import sys
import traceback
from pathlib import Path

import torch

from .common import table


# glibc's malloc gives freed memory back to the system (a large block is its own mmap; the heap's top
# is trimmed), so the next step's activations fault their pages in again: how often depends on the
# process's heap layout, which moved the hand-written GAN step by ±5% from one run to the next.
# Keeping freed memory, for every system alike (and the processes a benchmark starts), removes that.
KEEP_FREED = {"MALLOC_MMAP_THRESHOLD_": 32 << 20, "MALLOC_TRIM_THRESHOLD_": (1 << 31) - 1}


def keep_freed_memory() -> bool:
    """Tell glibc's malloc, here and in child processes, to keep freed memory; False where it is not glibc."""
    os.environ.update({name: str(value) for name, value in KEEP_FREED.items()})
    try:
        libc = ctypes.CDLL("libc.so.6")
        return bool(libc.mallopt(-3, KEEP_FREED["MALLOC_MMAP_THRESHOLD_"])  # M_MMAP_THRESHOLD
                    and libc.mallopt(-1, KEEP_FREED["MALLOC_TRIM_THRESHOLD_"]))  # M_TRIM_THRESHOLD
    except (OSError, AttributeError):
        return False


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="fewer rounds (a smoke run, noisy numbers)")
    parser.add_argument("--only", action="append", help="run only benchmarks whose module name contains this")
    parser.add_argument("--json", type=Path, help="also write the rows to this file")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    if not keep_freed_memory():
        print("not glibc: freed memory goes back to the system as the allocator decides (noisier ratios)",
              file=sys.stderr)
    rows, failed = [], []
    here = Path(__file__).parent
    for info in sorted(pkgutil.iter_modules([str(here)]), key=lambda m: m.name):
        if not info.name.startswith("bench_"):
            continue
        if args.only and not any(o in info.name for o in args.only):
            continue
        module = importlib.import_module(f"benchmarks.{info.name}")
        print(f"running {info.name} ...", file=sys.stderr, flush=True)
        try:
            rows.extend(module.run(args.quick))
        except Exception:  # one benchmark that breaks (on a machine it was not tried on) costs its own rows only
            traceback.print_exc()
            failed.append(info.name)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return report(rows, args.quick, failed)


def report(rows: list[dict], quick: bool, failed: list[str] = ()) -> int:
    """Print the table; the exit code: 1 when a benchmark failed or a row of a full run misses its target, else 0."""
    print(table(rows))
    if failed:
        print(f"failed, no rows: {', '.join(failed)} (tracebacks above)", file=sys.stderr)
    missed = [r["benchmark"] for r in rows if r["ok"] is False]
    if missed and quick:
        print(f"--quick: {len(missed)} row(s) over target ({', '.join(missed)}); a quick run's ratios are noisy, "
              "a full run decides", file=sys.stderr)
    return 1 if failed or (missed and not quick) else 0


if __name__ == "__main__":
    sys.exit(main())
