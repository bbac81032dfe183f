"""Metric loggers. A logger is any object with ``log_metrics(metrics: dict, step: int)``; by name: csv (always
available), tensorboard, wandb and mlflow (when installed). Each by name also has ``resume(step)`` and ``close()``."""
from __future__ import annotations

import csv
import io
import os
import time
import uuid
from contextlib import suppress
from pathlib import Path

from lightning_utilities.core.imports import RequirementCache

from .errors import ConfigError, SafeloopError

HAVE_TENSORBOARD = RequirementCache("tensorboard")
HAVE_WANDB = RequirementCache(module="wandb")
HAVE_MLFLOW = RequirementCache(module="mlflow")
INSTALL = {"tensorboard": (HAVE_TENSORBOARD, "pip install tensorboard"),
           "wandb": (HAVE_WANDB, "pip install 'safeloop[wandb]'"),
           "mlflow": (HAVE_MLFLOW, "pip install 'safeloop[mlflow]'")}


class CSVLogger:
    """Appends ``step,metric,value`` rows to ``metrics.csv`` (long format: any metric, any step)."""

    def __init__(self, run_dir: str | Path):
        self.path = Path(run_dir) / "metrics.csv"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        new = not self.path.exists()
        self._file = open(self.path, "ab", buffering=0)  # unbuffered: a failed write leaves nothing to write later
        if new:
            self._append([["step", "metric", "value"]])

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        self._append([step, name, f"{value:.6g}"] for name, value in metrics.items())

    def _append(self, rows) -> None:
        """Write ``rows`` whole or not at all: a write the system refuses (a full disk) is cut back to where the file
        ended, and said with the file's name."""
        if self._file.closed:  # fit() closed it: a validate() or test() after it writes on
            self._file = open(self.path, "ab", buffering=0)
        text = io.StringIO(newline="")
        csv.writer(text).writerows(rows)
        data = memoryview(text.getvalue().encode())
        end = os.fstat(self._file.fileno()).st_size
        try:
            while data:
                data = data[self._file.write(data):]
        except OSError as err:
            with suppress(OSError):  # a device, not a regular file: nothing of it to cut back
                os.ftruncate(self._file.fileno(), end)  # no partial row
            raise SafeloopError(f"metrics could not be written to {self.path} ({err.strerror or err}); the rows "
                                "written before are intact. Free some space, or give the run another directory "
                                "(run_dir=..., on the command line hydra.run.dir=PATH)") from err

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
        self._file = open(self.path, "ab", buffering=0)

    def close(self) -> None:
        self._file.close()


class TensorBoardLogger:
    """Scalars under ``run_dir/tensorboard``. The event file is opened at the first write, so that a
    resumed run's writer can purge what the stopped run logged after the checkpoint (``purge_step``)."""

    def __init__(self, run_dir: str | Path):
        self.path = Path(run_dir) / "tensorboard"
        self._writer = None
        self._purge_step: int | None = None

    def resume(self, step: int) -> None:
        self._purge_step = step + 1  # TensorBoard drops the earlier events from this step on

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        if self._writer is None:
            from torch.utils.tensorboard import SummaryWriter
            if self._purge_step is not None:
                self._wait_for_a_later_name()
            self._writer = SummaryWriter(str(self.path), purge_step=self._purge_step)
            self._purge_step = None  # (once: a writer opened again after close(), by a later validate(), purges none)
        for name, value in metrics.items():
            self._writer.add_scalar(name, value, step)
        self._writer.flush()  # on disk at every log point, as metrics.csv: a killed run keeps what it logged

    def _wait_for_a_later_name(self) -> None:
        """TensorBoard reads a directory's event files in name order, and a name starts with the second the file
        was made (then host and pid): a run resumed within its stopped run's second could sort first, and the
        purge would drop the wrong events. Waits (2 s at most) until the new file sorts after every one there."""
        stamps = [p.name.split(".")[3] for p in self.path.glob("events.out.tfevents.*")]
        wait = max((int(s) for s in stamps if s.isdigit()), default=0) + 1 - time.time()
        if 0 < wait <= 2:
            time.sleep(wait)

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None


def _kept_id(path: Path, make) -> str:
    """The id in ``path``, or ``make()``'s, written there: a run resumed in the same run directory finds it."""
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(make())
    return path.read_text().strip()


class WandbLogger:
    """A Weights & Biases run, its files under ``run_dir/wandb``, started at the first write. Its id is kept in
    ``run_dir/wandb_id``: a run resumed in the same run directory goes on in the same wandb run (``resume="allow"``).
    The ``WANDB_*`` variables apply (``WANDB_MODE=offline``: nothing leaves the machine; ``WANDB_PROJECT``)."""

    def __init__(self, run_dir: str | Path):
        self.dir = Path(run_dir)
        self.id = _kept_id(self.dir / "wandb_id", lambda: uuid.uuid4().hex[:8])
        self._run = None

    def resume(self, step: int) -> None:
        """Nothing to do: online, the resumed wandb run goes on from its last step, and wandb ignores (with a
        warning) the values of a lower step. Offline, see docs/trainer.md#loggers."""

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        if self._run is None:
            import wandb
            self._run = wandb.init(dir=self.dir, id=self.id, resume="allow")
        self._run.log(dict(metrics), step=step)

    def close(self) -> None:
        if self._run is not None:
            self._run.finish()
            self._run = None  # a later write (validate() after fit) resumes the same run (its id)


class MLflowLogger:
    """An MLflow run in ``run_dir/mlflow.db`` (MLflow's SQLite store: recent MLflow refuses a new file store;
    ``MLFLOW_TRACKING_URI`` names another), in the experiment ``MLFLOW_EXPERIMENT_NAME`` (default safeloop).
    Its id is kept in ``run_dir/mlflow_id``: a run resumed in the same run directory goes on in the same MLflow
    run. MLflow keeps every value logged at a step (a metric's history), so a resumed run skips the steps the
    stopped one logged: each keeps its first value."""

    def __init__(self, run_dir: str | Path):
        from mlflow.tracking import MlflowClient
        self.dir = Path(run_dir)
        store = os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{self.dir.resolve()}/mlflow.db"
        self._client = MlflowClient(store)
        self.id = _kept_id(self.dir / "mlflow_id", self._new_run)
        self._logged: dict[str, int] = {}  # after a resume: each metric's last step in the run

    def _new_run(self) -> str:
        name = os.environ.get("MLFLOW_EXPERIMENT_NAME", "safeloop")
        experiment = self._client.get_experiment_by_name(name)
        return self._client.create_run(experiment.experiment_id if experiment else
                                       self._client.create_experiment(name)).info.run_id

    def resume(self, step: int) -> None:
        history = self._client.get_metric_history
        self._logged = {name: max(m.step for m in history(self.id, name))
                        for name in self._client.get_run(self.id).data.metrics}

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        from mlflow.entities import Metric
        now = int(time.time() * 1000)
        new = [Metric(name, float(value), now, step) for name, value in metrics.items()
               if step > self._logged.get(name, -1)]
        if new:
            self._client.log_batch(self.id, metrics=new)

    def close(self) -> None:
        self._client.set_terminated(self.id)


class GivenLogger:
    """A logger object of the user's: its ``log_metrics``, and its ``resume(step)`` if it has one. Never closed:
    whoever made it owns it (and the next ``fit`` logs to it again)."""

    def __init__(self, logger):
        self.logger = logger

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        self.logger.log_metrics(metrics, step)

    def resume(self, step: int) -> None:
        if callable(getattr(self.logger, "resume", None)):
            self.logger.resume(step)

    def close(self) -> None:
        """Nothing: the user's logger is theirs to close."""


LOGGERS = {"csv": CSVLogger, "tensorboard": TensorBoardLogger, "wandb": WandbLogger, "mlflow": MLflowLogger}


def problems(loggers) -> list[str]:
    """What is wrong with ``loggers`` (names and logger objects), every problem at once."""
    out = []
    for i, logger in enumerate([loggers] if isinstance(loggers, str) else loggers):
        if isinstance(logger, str) and logger not in LOGGERS:
            out.append(f"loggers[{i}]={logger!r} is no logger: choose from {sorted(LOGGERS)}, or give an object "
                       "with a log_metrics(metrics: dict, step: int) method")
        elif isinstance(logger, str) and logger in INSTALL and not INSTALL[logger][0]:
            out.append(f"loggers[{i}]={logger!r} needs the {logger} package: {INSTALL[logger][1]}")
        elif not isinstance(logger, str) and not callable(getattr(logger, "log_metrics", None)):
            out.append(f"loggers[{i}] is {type(logger).__name__!r}, which has no log_metrics method: give a logger "
                       f"name ({', '.join(LOGGERS)}) or an object with a log_metrics(metrics: dict, step: int) method")
    return out


def make_loggers(loggers, run_dir) -> list:
    """The loggers ``loggers`` lists: a name's made in ``run_dir`` (none without one), an object taken as it is."""
    found = problems(loggers or [])
    if found:
        raise ConfigError(found)
    loggers = [loggers] if isinstance(loggers, str) else list(loggers or [])
    return [GivenLogger(logger) if not isinstance(logger, str) else LOGGERS[logger](run_dir) for logger in loggers
            if not isinstance(logger, str) or run_dir is not None]
