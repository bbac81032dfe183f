"""Metric loggers: CSV always available, TensorBoard when installed."""
from __future__ import annotations

import csv
import os
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

    def resume(self, step: int) -> None:
        """A run resumed at ``step`` goes on from there: the rows logged after it (by the run that was
        stopped, between its checkpoint and its end) are dropped, so that every (step, metric) is written
        once. The file is replaced atomically: a kill meanwhile leaves the old one or the new one."""
        self._file.close()
        with open(self.path, newline="") as f:
            rows = [row for row in csv.reader(f) if row and (not row[0].isdigit() or int(row[0]) <= step)]
        tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
        with open(tmp, "w", newline="") as f:
            csv.writer(f).writerows(rows)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.path)
        self._file = open(self.path, "a", newline="")
        self._csv = csv.writer(self._file)

    def close(self) -> None:
        self._file.close()


class TensorBoardLogger:
    """Scalars under ``run_dir/tensorboard``. The event file is opened at the first write, so that a
    resumed run's writer can purge what the stopped run logged after the checkpoint (``purge_step``)."""

    def __init__(self, run_dir: str | Path):
        if not HAVE_TENSORBOARD:
            raise ConfigError("logger=tensorboard needs the tensorboard package: pip install tensorboard")
        self.path = Path(run_dir) / "tensorboard"
        self._writer = None
        self._purge_step: int | None = None

    def resume(self, step: int) -> None:
        self._purge_step = step + 1  # TensorBoard drops the earlier events from this step on

    def log(self, metrics: dict[str, float], step: int) -> None:
        if self._writer is None:
            from torch.utils.tensorboard import SummaryWriter
            self._writer = SummaryWriter(str(self.path), purge_step=self._purge_step)
        for name, value in metrics.items():
            self._writer.add_scalar(name, value, step)
        self._writer.flush()  # on disk at every log point, as metrics.csv: a killed run keeps what it logged

    def close(self) -> None:
        if self._writer is not None:
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
