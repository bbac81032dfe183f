"""Metric loggers: a run killed and resumed in the same run directory reads as one run."""
import csv
import re
import runpy
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

import safeloop
from safeloop import loggers
from safeloop.checkpoint import Checkpointer
from safeloop.errors import ConfigError, SafeloopError

from .conftest import subprocess_env

JOB = textwrap.dedent("""
    import sys
    import time
    import torch
    import safeloop


    class Paced(safeloop.Trainer):  # 10 ms a step: the test's kill lands within a step of when it decides
        def on_step_end(self, losses):
            time.sleep(0.01)


    torch.manual_seed(0)
    data = [(x, x.sum(1, keepdim=True)) for x in torch.randn(8, 4, 3)]
    Paced(model=torch.nn.Linear(3, 1), train_data=data, val_data=data[:2], max_steps=int(sys.argv[2]),
                     log_every=1, val_every=3, checkpoint={"every": 5}, resume="auto", run_dir=sys.argv[1],
                     loggers=sys.argv[3].split(","), optimizer=lambda p: torch.optim.SGD(p, lr=0.01), device="cpu",
                     progress=False).fit()
""")


def rows(path) -> list[tuple[int, str]]:
    """``(step, metric)`` of every complete row (a running writer may be half-way through one)."""
    if not path.exists():
        return []
    with open(path, newline="") as f:
        return [(int(row["step"]), row["metric"]) for row in csv.DictReader(f)
                if row["step"].isdigit() and row["value"]]


def last_step(path) -> int:
    return max((step for step, _ in rows(path)), default=0)


@pytest.mark.parametrize("names", ["csv", "csv,tensorboard"])
def test_a_run_killed_and_resumed_logs_each_step_once(tmp_path, names, monkeypatch):
    if "tensorboard" in names and not loggers.HAVE_TENSORBOARD:
        pytest.skip("tensorboard is not installed (an optional logger)")
    script, run_dir = tmp_path / "job.py", tmp_path / "run"
    script.write_text(JOB)
    ckpt = Checkpointer(run_dir / "checkpoints")
    proc = subprocess.Popen([sys.executable, str(script), str(run_dir), "1000000", names], env=subprocess_env(),
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:  # SIGKILL once a checkpoint is written and two steps after it are logged (the next is 5 steps on)
        end = time.monotonic() + 60
        while not (ckpt.saved() and last_step(run_dir / "metrics.csv") > int(ckpt.saved()[-1].stem[5:]) + 1):
            assert proc.poll() is None, proc.stderr.read()
            assert time.monotonic() < end, "the training process made no progress"
            time.sleep(0.005)
    finally:
        proc.kill()
        proc.communicate()
    saved = int(ckpt.saved()[-1].stem[5:])
    assert last_step(run_dir / "metrics.csv") > saved  # rows the resumed run will write again

    monkeypatch.setattr(sys, "argv", [str(script), str(run_dir), str(saved + 7), names])
    runpy.run_path(str(script), run_name="__main__")  # the same job resumed, here
    logged = rows(run_dir / "metrics.csv")
    assert len(logged) == len(set(logged)), "a (step, metric) row written twice"
    losses = [step for step, metric in logged if metric == "loss"]
    assert losses == list(range(1, saved + 8))  # one run: every step once, in order
    if "tensorboard" in names:
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
        events = EventAccumulator(str(run_dir / "tensorboard")).Reload()
        assert [e.step for e in events.Scalars("loss")] == losses


@pytest.mark.skipif(not loggers.HAVE_TENSORBOARD, reason="tensorboard is not installed (an optional logger)")
def test_a_run_resumed_within_its_stopped_runs_second_reads_as_one_run_in_tensorboard(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    stopped = loggers.TensorBoardLogger(tmp_path)
    for step in range(1, 8):
        stopped.log_metrics({"loss": step}, step)
    stopped.close()
    # TensorBoard reads event files in name order: "events.out.tfevents.<second>.<host>.<pid>...". Named as a
    # process with a larger pid would name it a second from now, the stopped run's file sorts after any made now
    old, = (tmp_path / "tensorboard").glob("events.out.tfevents.*")
    parts = old.name.split(".")
    parts[3], parts[5] = f"{int(time.time()) + 1:010d}", "99999999"
    old.rename(old.with_name(".".join(parts)))
    resumed = loggers.TensorBoardLogger(tmp_path)
    resumed.resume(4)
    for step in range(5, 10):
        resumed.log_metrics({"loss": 10 * step}, step)
    resumed.close()
    events = EventAccumulator(str(tmp_path / "tensorboard")).Reload().Scalars("loss")
    assert [(e.step, e.value) for e in events] == [(1, 1), (2, 2), (3, 3), (4, 4)] + [(s, 10 * s) for s in range(5, 10)]


def test_resume_rewrites_metrics_csv_keeping_the_rows_up_to_the_resumed_step(tmp_path):
    logger = loggers.CSVLogger(tmp_path)
    for step in (1, 2, 3):
        logger.log_metrics({"loss": step / 10, "lr": 0.1}, step)
    logger.resume(2)
    logger.log_metrics({"loss": 0.25}, 3)
    logger.close()
    assert (tmp_path / "metrics.csv").read_text().splitlines() == [
        "step,metric,value", "1,loss,0.1", "1,lr,0.1", "2,loss,0.2", "2,lr,0.1", "3,loss,0.25"]
    assert [p.name for p in tmp_path.iterdir()] == ["metrics.csv"]  # no temporary file left


class Rows:
    """A logger object: only ``log_metrics``."""

    def __init__(self):
        self.rows = []

    def log_metrics(self, metrics, step):
        self.rows += [(str(step), name, f"{value:.6g}") for name, value in metrics.items()]


class Logs(safeloop.Trainer):
    def training_step(self, batch):
        x, y = batch
        out = self.model(x)
        self.log("mae", (out - y).abs().mean())
        return torch.nn.functional.mse_loss(out, y)


def fit_logging_to(loggers_, run_dir, **kwargs):
    torch.manual_seed(0)
    data = [(x, x.sum(1, keepdim=True)) for x in torch.randn(4, 4, 3)]
    Logs(model=torch.nn.Linear(3, 1), train_data=data, val_data=data[:1], max_steps=4, log_every=1, val_every=2,
         loggers=loggers_, run_dir=run_dir, optimizer=lambda p: torch.optim.SGD(p, lr=0.01), device="cpu",
         progress=False, checkpoint=False, **kwargs).fit()


def test_a_logger_object_receives_the_rows_of_metrics_csv_self_log_values_included(tmp_path):
    given, unnamed = Rows(), Rows()
    fit_logging_to(["csv", given], tmp_path)
    with open(tmp_path / "metrics.csv", newline="") as f:
        written = [tuple(row) for row in csv.reader(f)][1:]
    assert given.rows == written
    assert {metric for _, metric, _ in written} == {"loss", "mae", "lr", "val_loss"}
    fit_logging_to([unnamed], None)  # no run directory: no file, the object still logs
    assert unnamed.rows == written


def test_a_run_ended_by_max_epochs_logs_its_last_step_as_one_ended_by_max_steps_does():
    given, data = Rows(), [(torch.ones(2, 3), torch.ones(2, 1))] * 3
    safeloop.Trainer(model=torch.nn.Linear(3, 1), train_data=data, max_epochs=2, log_every=4, loggers=[given],
                     optimizer=lambda p: torch.optim.SGD(p, lr=0.01), device="cpu", progress=False).fit()
    assert [step for step, metric, _ in given.rows if metric == "loss"] == ["4", "6"]
    unsized = Rows()  # without a length, the pass's end is found after the last step: logged as any other step
    safeloop.Trainer(model=torch.nn.Linear(3, 1), train_data=(x for x in data), max_epochs=1, log_every=2,
                     loggers=[unsized], optimizer=lambda p: torch.optim.SGD(p, lr=0.01), device="cpu",
                     progress=False).fit()
    assert [step for step, metric, _ in unsized.rows if metric == "loss"] == ["2"]


def test_what_every_pass_end_logs_reaches_the_loggers_the_last_ones_included():
    class PerEpoch(safeloop.Trainer):
        def on_epoch_end(self):
            self.log("epoch_metric", float(self.state.epoch))

    given, data = Rows(), [(torch.ones(2, 3), torch.ones(2, 1))] * 3
    PerEpoch(model=torch.nn.Linear(3, 1), train_data=data, max_epochs=3, log_every=1, loggers=[given],
             optimizer=lambda p: torch.optim.SGD(p, lr=0.01), device="cpu", progress=False).fit()
    assert [(step, value) for step, metric, value in given.rows if metric == "epoch_metric"] == [
        ("3", "0"), ("6", "1"), ("9", "2")]  # at each pass's end (its last step), as Lightning logs an epoch's


def test_bad_loggers_are_refused_at_start_up_all_at_once(monkeypatch):
    monkeypatch.setitem(loggers.INSTALL, "wandb", (False, loggers.INSTALL["wandb"][1]))  # as where it is not installed
    with pytest.raises(ConfigError) as info:
        fit_logging_to(["wandb", "tb", object()], None)
    assert re.search(re.escape("loggers[0]='wandb' needs the wandb package: pip install 'safeloop[wandb]'"),
                     str(info.value))
    assert "loggers[1]='tb' is no logger: choose from ['csv', 'mlflow', 'tensorboard', 'wandb']" in str(info.value)
    assert "loggers[2] is 'object', which has no log_metrics method" in str(info.value)


@pytest.mark.skipif(not loggers.HAVE_MLFLOW, reason="mlflow is not installed (pip install 'safeloop[mlflow]')")
def test_mlflow_resumed_goes_on_in_the_same_run_logging_each_step_once(tmp_path, monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    logger = loggers.MLflowLogger(tmp_path)
    for step in (1, 2, 3):  # the stopped run: its checkpoint at step 2
        logger.log_metrics({"loss": step / 10}, step)
    logger.close()
    logger = loggers.MLflowLogger(tmp_path)
    logger.resume(2)
    logger.log_metrics({"loss": 0.35}, 3)  # logged already: skipped
    logger.log_metrics({"loss": 0.4}, 4)
    logger.close()
    history = logger._client.get_metric_history(logger.id, "loss")
    assert [(m.step, m.value) for m in history] == [(1, 0.1), (2, 0.2), (3, 0.3), (4, 0.4)]
    assert (tmp_path / "mlflow.db").exists()


@pytest.mark.skipif(not loggers.HAVE_WANDB, reason="wandb is not installed (pip install 'safeloop[wandb]')")
def test_wandb_offline_logs_in_the_run_directory_and_a_resumed_run_keeps_its_id(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")  # never the network
    monkeypatch.setenv("WANDB_SILENT", "true")
    fit_logging_to(["wandb"], tmp_path)
    fit_logging_to(["wandb"], tmp_path)
    run_id = (tmp_path / "wandb_id").read_text()
    offline = sorted((tmp_path / "wandb").glob("offline-run-*"))
    assert len(offline) == 2 and all(d.name.endswith(run_id) for d in offline)
    assert all(list(d.glob("*.wandb")) for d in offline)


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full (every write to it fails: a full disk)")
def test_a_full_disk_while_logging_is_an_error_naming_metrics_csv_and_what_to_do(tmp_path):
    (tmp_path / "metrics.csv").symlink_to("/dev/full")
    data = [(torch.randn(4, 2), torch.randn(4, 1))] * 3
    trainer = safeloop.Trainer(model=torch.nn.Linear(2, 1), train_data=data, max_steps=3, log_every=1,
                               optimizer=lambda p: torch.optim.SGD(p, lr=0.1), run_dir=tmp_path, device="cpu",
                               progress=False, checkpoint=False)
    with pytest.raises(SafeloopError, match=re.escape(f"metrics could not be written to {tmp_path / 'metrics.csv'} "
                                                      "(No space left on device); the rows written before are intact. "
                                                      "Free some space")):
        trainer.fit()



def test_lightnings_self_log_options_are_taken_where_safeloop_does_the_same_and_refused_naming_its_way_otherwise():
    """``prog_bar`` and ``logger=True`` change nothing (every value reaches the loggers and the progress line);
    ``on_step``, ``on_epoch``, ``sync_dist`` and ``batch_size`` would mean something safeloop does not do: refused at
    the first step, before any update, each with what safeloop does."""
    class Logs(safeloop.Trainer):
        options: dict = {}

        def training_step(self, batch):
            x, y = batch
            loss = torch.nn.functional.mse_loss(self.model(x), y)
            self.log("train_loss", loss, **self.options)
            return loss

    def fit(**options):
        torch.manual_seed(0)
        given, model = Rows(), torch.nn.Linear(3, 1)
        trainer = type("L", (Logs,), {"options": options})(
            model=model, train_data=[(torch.ones(2, 3), torch.ones(2, 1))] * 2, max_steps=2, log_every=1,
            loggers=[given], optimizer=lambda p: torch.optim.SGD(p, lr=0.01), device="cpu", progress=False)
        trainer.fit()
        return [value for _, metric, value in given.rows if metric == "train_loss"]

    assert fit(prog_bar=True, logger=True) == fit()
    with pytest.raises(ConfigError) as caught:
        fit(on_step=True, on_epoch=True, prog_bar=True, sync_dist=True)
    assert caught.value.problems == [
        "self.log(..., on_step=True): safeloop's self.log(name, value) takes no on_step: from training_step or a "
        "step's hooks the value is written every log_every steps (Lightning's on_step), from on_epoch_end at the "
        "pass's end; from validation_step or test_step it is the pass's mean over the samples (Lightning's on_epoch). "
        "For a training value's mean over a pass, add it up yourself and self.log it in on_epoch_end: Lightning's "
        "mean of a logged tensor weighs each batch by its samples (value * len(x)), a torchmetrics MeanMetric each "
        "update alike",
        "self.log(..., on_epoch=True): safeloop's self.log(name, value) takes no on_epoch: from training_step or a "
        "step's hooks the value is written every log_every steps (Lightning's on_step), from on_epoch_end at the "
        "pass's end; from validation_step or test_step it is the pass's mean over the samples (Lightning's on_epoch). "
        "For a training value's mean over a pass, add it up yourself and self.log it in on_epoch_end: Lightning's "
        "mean of a logged tensor weighs each batch by its samples (value * len(x)), a torchmetrics MeanMetric each "
        "update alike",
        "self.log(..., sync_dist=True): safeloop's self.log(name, value) takes no sync_dist: a validation or test "
        "value is the mean over every rank's samples already; a training value is rank zero's (all_reduce it "
        "yourself first for the ranks' mean)"]
    with pytest.raises(ConfigError, match=re.escape("self.log(..., reduce_fx='max'): safeloop's self.log(name, value) "
                                                    "takes no reduce_fx: it has no such option")):
        fit(reduce_fx="max")

    class Metric(torch.nn.Module):  # what a torchmetrics Metric is to self.log: a module, not a number
        pass

    with pytest.raises(ConfigError, match=re.escape("self.log('acc', <Metric>): safeloop logs a number or a "
                                                    "one-element tensor. For a torchmetrics Metric")):
        safeloop.Trainer(model=torch.nn.Linear(3, 1), train_data=[(torch.ones(2, 3), torch.ones(2, 1))],
                         optimizer=lambda p: torch.optim.SGD(p, lr=0.01), device="cpu", progress=False,
                         loggers=(), max_steps=1).log("acc", Metric())
