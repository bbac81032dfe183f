"""``curves.png``: the run's losses (train and validation) and learning rates, from ``metrics.csv``.

Drawn at the end of a run when matplotlib is installed (an optional dependency: ``pip install
matplotlib``); never on a display (the Agg backend).
"""
from __future__ import annotations

import csv
import logging
from collections import defaultdict
from pathlib import Path

from lightning_utilities.core.imports import RequirementCache

HAVE_MATPLOTLIB = RequirementCache("matplotlib")
log = logging.getLogger("safeloop")


def read(path: Path) -> dict[str, list[tuple[int, float]]]:
    """``metric -> [(step, value), ...]`` from a long-format ``metrics.csv``."""
    series: dict[str, list[tuple[int, float]]] = defaultdict(list)
    with open(path, newline="") as f:
        for row in csv.DictReader(f):
            series[row["metric"]].append((int(row["step"]), float(row["value"])))
    return dict(series)


def draw(run_dir: Path) -> Path | None:
    """Draw ``run_dir/curves.png`` from ``run_dir/metrics.csv``; returns its path, or None when there is
    nothing to draw."""
    metrics = Path(run_dir) / "metrics.csv"
    series = read(metrics) if metrics.exists() else {}
    losses = {k: v for k, v in series.items() if not k.startswith("lr") and k != "skipped"}
    rates = {k: v for k, v in series.items() if k.startswith("lr")}
    if not losses:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2 if rates else 1, figsize=(11 if rates else 6, 4), squeeze=False)
    for name, points in sorted(losses.items()):
        steps, values = zip(*points)
        axes[0][0].plot(steps, values, marker="o" if name.startswith("val_") else None, markersize=3, label=name)
    axes[0][0].set(xlabel="step", ylabel="loss", title="losses")
    if all(v > 0 for points in losses.values() for _, v in points):
        axes[0][0].set_yscale("log")
    axes[0][0].legend()
    if rates:
        for name, points in sorted(rates.items()):
            axes[0][1].plot(*zip(*points), label=name)
        axes[0][1].set(xlabel="step", ylabel="learning rate", title="learning rate")
        axes[0][1].legend()
    fig.tight_layout()
    path = Path(run_dir) / "curves.png"
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def draw_logged(run_dir: Path | None) -> None:
    """``curves.png`` at the end of a run that logged metrics, when matplotlib is there to draw it;
    a picture that fails is a warning, never a failed run."""
    if run_dir is None or not (run_dir / "metrics.csv").exists():  # a logger object's run may have no run_dir
        return
    if not HAVE_MATPLOTLIB:
        log.info("no loss curves: pip install matplotlib to have them drawn to %s", run_dir / "curves.png")
        return
    try:  # metrics.csv is flushed at every write
        path = draw(run_dir)
    except Exception as err:  # noqa: BLE001 - a picture never fails a finished run
        log.warning("loss curves not drawn: %s: %s", type(err).__name__, err)
        return
    if path is not None:
        log.info("loss curves: %s", path)
