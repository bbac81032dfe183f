"""Run every benchmark: ``python -m benchmarks.run [--quick] [--only NAME]``.

Each ``benchmarks/bench_*.py`` module has ``run(quick: bool) -> list[dict]`` (rows made
with ``benchmarks.common.row``). Results print as one markdown table of ratios against
plain PyTorch measured in the same process.
"""
from __future__ import annotations

import argparse
import importlib
import json
import pkgutil
import sys
from pathlib import Path

import torch

from .common import table


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="fewer rounds (a smoke run, noisy numbers)")
    parser.add_argument("--only", action="append", help="run only benchmarks whose module name contains this")
    parser.add_argument("--json", type=Path, help="also write the rows to this file")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    rows = []
    here = Path(__file__).parent
    for info in sorted(pkgutil.iter_modules([str(here)]), key=lambda m: m.name):
        if not info.name.startswith("bench_"):
            continue
        if args.only and not any(o in info.name for o in args.only):
            continue
        module = importlib.import_module(f"benchmarks.{info.name}")
        print(f"running {info.name} ...", file=sys.stderr, flush=True)
        rows.extend(module.run(args.quick))
    print(table(rows))
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return 0 if all(r["ok"] is not False for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
