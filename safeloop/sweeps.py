"""After a sweep (``python -m safeloop -m optimizer.lr=1e-2,1e-3``): one table of its runs.

``SweepTable`` is a Hydra callback (``hydra.callbacks`` in ``configs/train.yaml``): each job's
return value (its final losses and last validation metrics) is collected as the job ends, and
when the sweep ends the table — the overrides that differ between runs, then the metrics — is
printed and written to ``summary.md`` in the sweep directory. It sees the jobs of Hydra's basic
launcher, which runs them in this process.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

from hydra.core.utils import JobReturn, JobStatus
from hydra.experimental.callback import Callback
from omegaconf import DictConfig


class SweepTable(Callback):
    def __init__(self) -> None:
        self.runs: list[tuple[list[str], dict[str, float] | None]] = []

    def on_job_end(self, config: DictConfig, job_return: JobReturn, **kwargs: Any) -> None:
        # a failed job's return_value raises its error: Hydra reports that error itself
        value = job_return.return_value if job_return.status == JobStatus.COMPLETED else None
        self.runs.append((list(job_return.overrides or []), value if isinstance(value, dict) else None))

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        if not self.runs:
            return
        text = table(self.runs)
        print(text)
        path = Path(config.hydra.sweep.dir).absolute() / "summary.md"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text + "\n")
        print(f"sweep summary: {path}")


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
