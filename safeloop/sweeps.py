"""After a sweep (``python -m safeloop -m optimizer.lr=1e-2,1e-3``): one table of its runs.

A job returns its monitored metric as a float (``Result``), which a sweeper such as Optuna's
optimises; the float also carries the run's final losses and last validation metrics.
``SweepTable`` is a Hydra callback (``hydra.callbacks`` in ``configs/train.yaml``): each job's
metrics are collected as the job ends, and when the sweep ends the table — the overrides that
differ between runs, then the metrics — is printed and written to ``summary.md`` in the sweep
directory. It sees the jobs of Hydra's basic launcher, which runs them in this process.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

from hydra.core.utils import JobReturn, JobStatus
from hydra.experimental.callback import Callback
from omegaconf import DictConfig

from .callbacks import Callback as TrainerCallback
from .callbacks import check_monitor
from .state import TrainState


class Result(float):
    """A run's monitored metric, the float a sweeper optimises; ``metrics`` holds all its final metrics."""

    metrics: dict[str, float]

    @classmethod
    def of(cls, state: TrainState, monitor: str) -> Result:
        """``monitor``'s value among the final losses and the last validation's metrics (a ``ConfigError``
        naming those if it is none of them); without a validation, the final training loss (the sum of the
        losses, when training_step returns several)."""
        history = state.val_history
        metrics = {**state.floats(), **(history[-1][1] if history else {})}
        if history:
            check_monitor("the run", monitor, metrics)
        out = cls(metrics.get(monitor, sum(state.floats().values())))
        out.metrics = metrics
        return out


class MonitorCheck(TrainerCallback):
    """The command line's ``monitor`` (what the run returns to a sweeper), checked at the validation before
    training: a ``val_`` name validation does not report is a ``ConfigError`` then, not once the run is over."""

    def __init__(self, monitor: str):
        self.monitor = monitor

    def on_validation_end(self, trainer, metrics) -> None:
        if trainer.state.step == 0 and self.monitor.startswith("val_"):
            check_monitor("the run", self.monitor, metrics)


class SweepTable(Callback):
    def __init__(self) -> None:
        self.runs: list[tuple[list[str], dict[str, float] | None]] = []

    def on_job_end(self, config: DictConfig, job_return: JobReturn, **kwargs: Any) -> None:
        # a failed job's return_value raises its error: Hydra reports that error itself
        value = job_return.return_value if job_return.status == JobStatus.COMPLETED else None
        self.runs.append((list(job_return.overrides or []), getattr(value, "metrics", None)))
        self.path = Path(config.hydra.sweep.dir).absolute() / "summary.md"  # after every job: a sweep that
        self.path.parent.mkdir(parents=True, exist_ok=True)  # fails (Hydra raises a job's error at its end) has it
        self.path.write_text(table(self.runs) + "\n")

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        if self.runs:
            print(table(self.runs))
            print(f"sweep summary: {self.path}")


def table(runs: list[tuple[list[str], dict[str, float] | None]]) -> str:
    """Markdown: one row per run, the overrides that differ between runs, then each metric."""
    common = set.intersection(*(set(overrides) for overrides, _ in runs))
    metrics = list(dict.fromkeys(k for _, values in runs for k in (values or {})))
    lines = ["| run | overrides | " + " | ".join(metrics) + " |", "|---|---|" + "---:|" * len(metrics)]
    for i, (overrides, values) in enumerate(runs):
        shown = " ".join(o for o in overrides if o not in common) or "(none)"
        cells = ["failed"] * len(metrics) if values is None else \
            [f"{values[k]:.4g}" if k in values else "" for k in metrics]
        lines.append(f"| {i} | {shown} | " + " | ".join(cells) + " |")
    return "\n".join(lines)
