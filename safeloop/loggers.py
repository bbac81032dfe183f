"""Metric loggers: CSV always available, TensorBoard when installed."""
from __future__ import annotations

import csv
from pathlib import Path

from lightning_utilities.core.imports import RequirementCache

from .errors import ConfigError

HAVE_TENSORBOARD = RequirementCache("tensorboard")


class CSVLogger:
    """Appends ``step,metric,value`` rows to ``metrics.csv`` (long format: any metric, any step)."""

    def __init__(self, run_dir: str | Path):
        self.path = Path(run_dir) / "metrics.csv"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        new = not self.path.exists()
        self._file = open(self.path, "a", newline="")
        self._csv = csv.writer(self._file)
        if new:
            self._csv.writerow(["step", "metric", "value"])

    def log(self, metrics: dict[str, float], step: int) -> None:
        for name, value in metrics.items():
            self._csv.writerow([step, name, f"{value:.6g}"])
        self._file.flush()

    def close(self) -> None:
        self._file.close()


class TensorBoardLogger:
    def __init__(self, run_dir: str | Path):
        if not HAVE_TENSORBOARD:
            raise ConfigError("logger=tensorboard needs the tensorboard package: pip install tensorboard")
        from torch.utils.tensorboard import SummaryWriter
        self.path = Path(run_dir) / "tensorboard"
        self._writer = SummaryWriter(str(self.path))

    def log(self, metrics: dict[str, float], step: int) -> None:
        for name, value in metrics.items():
            self._writer.add_scalar(name, value, step)

    def close(self) -> None:
        self._writer.close()


LOGGERS = {"csv": CSVLogger, "tensorboard": TensorBoardLogger}


def make_loggers(names, run_dir) -> list:
    if run_dir is None:
        return []
    names = [names] if isinstance(names, str) else list(names or [])
    unknown = [n for n in names if n not in LOGGERS]
    if unknown:
        raise ConfigError(f"loggers: unknown logger {unknown[0]!r}: choose from {sorted(LOGGERS)}")
    return [LOGGERS[n](run_dir) for n in names]
