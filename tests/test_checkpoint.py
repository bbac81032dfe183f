"""Checkpoints: exact resume in a new process, kills at random moments, safe loading, what they hold."""
import copy
import csv
import logging
import os
import random
import re
import signal
import subprocess
import sys
import time
import warnings
import zipfile
from functools import partial
from pathlib import Path

import numpy as np
import pytest
import torch
from omegaconf import DictConfig

from safeloop import (Callback, CheckpointError, ConfigError, ConfigWarning, SafeloopError, StepError, Trainer,
                      checkpoint)
from safeloop.checkpoint import FORMAT, Checkpointer, atomic_save, load
from safeloop.config import compose, train
from safeloop.recipes.gan import GAN, GANTrainer, ring

from .checkpoint_job import make
from .conftest import ROOT, subprocess_env


def params(trainer_or_state) -> list[torch.Tensor]:
    if isinstance(trainer_or_state, Trainer):
        return [p.detach().clone() for p in trainer_or_state.model.parameters()]
    return list(trainer_or_state["modules"]["model"].values())


def test_resumed_in_a_new_process_is_bit_identical_to_a_run_that_never_stopped(tmp_path, one_thread):
    n = 18  # mid-epoch: 13 batches an epoch, so step 18 is 5 batches into the second one
    straight = make(tmp_path / "straight", 2 * n)
    straight.fit()
    first = make(tmp_path / "interrupted", n)
    first.fit()
    assert (first.state.epoch, first.state.batch_in_epoch) == (1, 5)
    assert not torch.equal(params(first)[0], params(straight)[0])

    done = subprocess.run([sys.executable, "-m", "tests.checkpoint_job", str(tmp_path / "interrupted"), str(2 * n),
                           "auto"], cwd=ROOT, env=subprocess_env(), capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    resumed = load(tmp_path / "interrupted" / f"step-{2 * n:09d}.pt")
    assert all(torch.equal(a, b) for a, b in zip(params(resumed), params(straight)))
    assert resumed["optimizers"]["optimizer"]["state"][0]["step"] == 2 * n
    assert resumed["schedulers"]["optimizer"]["last_epoch"] == 2 * n


def test_shuffle_seeded_from_the_global_rng_resumes_in_the_same_order(tmp_path, one_thread):
    """No generator on the DataLoader: each epoch's order comes from the global RNG at the epoch's start."""
    straight = make(tmp_path / "a", 30, own_generator=False, grad_accum=2)
    straight.fit()
    # 13 batches a pass: 7 steps (the last with one batch), so step 15 ends 2 batches into the third pass
    assert make(tmp_path / "b", 15, own_generator=False, grad_accum=2).fit().batch_in_epoch == 2
    resumed = make(tmp_path / "b", 30, resume="auto", own_generator=False, grad_accum=2)
    resumed.fit()
    assert all(torch.equal(a, b) for a, b in zip(params(resumed), params(straight)))
    assert resumed.state.val_history == straight.state.val_history


def test_resumed_after_the_last_batch_of_an_epoch_it_goes_on_as_a_run_that_never_stopped(tmp_path, one_thread):
    """13 batches an epoch: the checkpoint of step 13, the run's end, is written after the first pass ended (as
    Lightning ends a pass with the run); the shuffle of the next epoch draws from the loader's generator as it stood
    after the first epoch's draws (kept in the checkpoint for the pass to come)."""
    straight = make(tmp_path / "a", 26)
    straight.fit()
    make(tmp_path / "b", 13).fit()
    resumed = make(tmp_path / "b", 26, resume="auto")
    resumed.fit()
    assert all(torch.equal(a, b) for a, b in zip(params(resumed), params(straight)))
    assert (resumed.state.epoch, resumed.state.batch_in_epoch) == (2, 0)  # its last pass ended with the run


class Batches(Trainer):
    """Keeps every batch it trains on."""

    def training_step(self, batch):
        self.batches.append(batch)
        return super().training_step(batch)


class GANBatches(GANTrainer):
    """The GAN recipe (manual mode, two optimizers), keeping every batch it trains on."""

    def training_step(self, batch):
        self.batches.append(batch)
        return super().training_step(batch)

    def on_fit_end(self) -> None:
        """No coverage report at the end of every fit() call."""


def list_run(mode: str, data: list) -> Trainer:
    torch.manual_seed(0)
    if mode == "automatic":
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Dropout(0.3), torch.nn.Linear(16, 1))
        return Batches(model, data, partial(torch.optim.Adam, lr=1e-2), max_steps=1, device="cpu", progress=False,
                       loggers=())
    return GANBatches(GAN(noise_dim=4, hidden=16), data, partial(torch.optim.Adam, lr=1e-2), max_steps=1,
                      device="cpu", progress=False, loggers=())


@pytest.mark.parametrize("mode", ["automatic", "manual, two optimizers"])
def test_a_run_on_a_list_trained_in_several_fit_calls_is_the_run_trained_in_one(mode, one_thread, monkeypatch):
    """A list of batches: a fit() that starts mid-epoch steps past the batches consumed, drawing from no RNG
    (nothing to re-draw: the global RNG states are neither saved nor put back)."""
    gen = torch.Generator().manual_seed(0)
    if mode == "automatic":
        data = [(torch.randn(4, 8, generator=gen), torch.randn(4, 1, generator=gen)) for _ in range(10)]
    else:
        data = list(ring(n=80, batch_size=8).train)
    saved = []
    rng_state = checkpoint.position.rng_state
    monkeypatch.setattr(checkpoint.position, "rng_state", lambda: (saved.append(1), rng_state())[1])
    runs = []
    for chunks in ((20,), (4, 4, 6, 3, 3)):  # stops mid-epoch, after an epoch's last batch, mid-epoch
        trainer = list_run(mode, data)
        trainer.batches, trainer.max_steps = [], 0
        for n in chunks:
            trainer.max_steps += n
            trainer.fit()
        runs.append(trainer)
    one, several = runs
    assert [id(b) for b in several.batches] == [id(b) for b in one.batches] == [id(b) for b in data + data]
    assert all(torch.equal(a, b) for a, b in zip(params(several), params(one)))
    assert not saved


class Counted(torch.utils.data.TensorDataset):
    """Counts the samples read."""

    reads = 0

    def __getitem__(self, i):
        self.reads += 1
        return super().__getitem__(i)


def loader_run(seed: int, grad_accum: int = 1, **kwargs) -> Trainer:
    """Dropout, and a DataLoader whose shuffle is drawn from the global RNG: 13 batches a pass (the last of 8)."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Dropout(0.3), torch.nn.Linear(16, 1))
    gen = torch.Generator().manual_seed(1)
    data = Counted(torch.randn(200, 8, generator=gen), torch.randn(200, 1, generator=gen))
    loader = torch.utils.data.DataLoader(data, batch_size=16, shuffle=True)
    trainer = Trainer(model, loader, partial(torch.optim.Adam, lr=1e-2), max_steps=1, device="cpu", progress=False,
                      loggers=(), grad_accum=grad_accum, **kwargs)
    trainer.max_steps = 0
    return trainer


@pytest.mark.parametrize("grad_accum", [1, 2])
def test_a_dataloader_run_trained_in_several_fit_calls_reads_each_batch_once_and_is_the_run_trained_in_one(
        grad_accum, one_thread):
    """A later fit() goes on with the batches where the last one stopped: nothing is loaded again."""
    runs = []
    for chunks in ((20,), (5, 1, 7, 7)):  # stops mid-epoch; with grad_accum=1 also right after a pass's last batch
        trainer = loader_run(0, grad_accum)
        for n in chunks:
            trainer.max_steps += n
            trainer.fit()
        runs.append(trainer)
    one, several = runs
    # 20 batches: a pass of 200 samples and 7 batches; grad_accum=2 (7 steps a pass): two passes and 12 batches
    reads = 200 + 7 * 16 if grad_accum == 1 else 2 * 200 + 12 * 16
    assert several.train_data.dataset.reads == one.train_data.dataset.reads == reads
    assert all(torch.equal(a, b) for a, b in zip(params(several), params(one)))


def test_a_checkpoint_loaded_between_two_fits_sets_where_the_data_goes_on(tmp_path, one_thread):
    """Another run's checkpoint of the same step: the next fit() takes that run's position and order, not
    the iterator where this Trainer's last fit() stopped."""
    other = loader_run(1, checkpoint={"dir": str(tmp_path), "every": 100})
    for other.max_steps in (8, 12):  # saves at the end of each fit
        other.fit()
    trainer = loader_run(0)
    trainer.max_steps = 8
    trainer.fit()
    trainer.load_state_dict(checkpoint.load(tmp_path / f"step-{8:09d}.pt"))
    trainer.max_steps = 12
    trainer.fit()
    assert all(torch.equal(a, b) for a, b in zip(params(trainer), params(other)))


def run_cli(run_dir: Path, *overrides: str) -> subprocess.Popen:
    args = [sys.executable, "-m", "safeloop", f"hydra.run.dir={run_dir}", f"checkpoint.dir={run_dir / 'ckpt'}",
            "checkpoint.every=2", "checkpoint.keep=3", "trainer.resume=auto", "trainer.device=cpu",
            "trainer.val_every=null", "trainer.log_every=1", "trainer.progress=false", "model.hidden=256", *overrides]
    return subprocess.Popen(args, cwd=run_dir.parent, env=subprocess_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def last_logged_step(run_dir: Path) -> int:
    """The last step metrics.csv holds; 0 while the writer has not finished its header line."""
    with open(run_dir / "metrics.csv") as f:
        return max((int(row["step"]) for row in csv.DictReader(f) if (row.get("step") or "").isdigit()), default=0)


def wait_for(condition, proc: subprocess.Popen, timeout: float = 60, poll: float = 0.005):
    end = time.monotonic() + timeout
    while not condition():
        assert proc.poll() is None, proc.stdout.read()
        assert time.monotonic() < end, "the training process made no progress"
        time.sleep(poll)


def test_killed_at_random_moments_it_resumes_from_the_newest_complete_checkpoint(tmp_path):
    rng = random.Random(0)
    run_dir = tmp_path / "run"
    ckpt = Checkpointer(run_dir / "ckpt")
    newest = 0
    for kill in ("at random", "mid-save"):  # then SIGTERM, below
        proc = run_cli(run_dir, "trainer.max_steps=100000")
        if kill == "mid-save":  # the moment this process has a save half-written
            wait_for(lambda: any(ckpt.dir.glob(f".step-*.{proc.pid}.tmp")), proc)
        else:
            wait_for(lambda: ckpt.saved() and int(ckpt.saved()[-1].stem[5:]) > newest, proc)
            time.sleep(rng.uniform(0, 0.2))
        proc.kill()
        output = proc.communicate()[0]
        if newest:
            assert f"resumed from {ckpt.path(newest)}" in output
        saved = ckpt.saved()
        for path in saved:  # every file under a checkpoint's name is complete
            load(path)
        newest = int(saved[-1].stem[5:])
        assert last_logged_step(run_dir) - newest <= 2  # at most one interval lost
        assert len(saved) <= 3 + 1  # old ones are deleted only after the new one is complete

    # SIGTERM: finish the step, save, exit 143 with nothing lost
    proc = run_cli(run_dir, "trainer.max_steps=100000")
    wait_for(lambda: int(ckpt.saved()[-1].stem[5:]) > newest + 2, proc)
    proc.send_signal(signal.SIGTERM)
    output = proc.communicate(timeout=60)[0]
    assert proc.returncode == 128 + signal.SIGTERM, output
    assert f"resumed from {ckpt.path(newest)}" in output
    assert "SIGTERM received" in output
    assert f"To continue, run the same command with trainer.resume=auto checkpoint.dir={ckpt.dir}" in output
    newest = int(ckpt.saved()[-1].stem[5:])
    assert newest == last_logged_step(run_dir)
    assert not list(ckpt.dir.glob(".step-*"))  # a killed save's temporary file was cleaned up


class Interrupt(Callback):
    def __init__(self, at: int, signum: int):
        self.at, self.signum = at, signum

    def on_step_end(self, trainer, losses):
        if trainer.state.step == self.at:
            os.kill(os.getpid(), self.signum)


class InterruptedInStep(Trainer):
    """Sends itself ``signum`` during step 3; no hooks, and with the guard off: an unchecked step."""

    signum = signal.SIGTERM

    def training_step(self, batch):
        if self.state.step + 1 == 3:
            os.kill(os.getpid(), self.signum)
        return super().training_step(batch)


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
@pytest.mark.parametrize("where", ["callback", "unchecked step"])
def test_a_signal_finishes_the_step_saves_and_stops(tmp_path, signum, where):
    before = signal.getsignal(signum)
    if where == "callback":
        trainer = make(tmp_path, 50, callbacks=[Interrupt(3, signum)])
    else:
        cls = type("Interrupted", (InterruptedInStep,), {"signum": signum})
        trainer = make(tmp_path, 50, cls=cls, guard={"check": "off"})
    state = trainer.fit()
    assert (state.step, trainer.stop_signal) == (3, signum)
    assert [p.name for p in Checkpointer(tmp_path).saved()] == ["step-000000003.pt"]
    assert signal.getsignal(signum) is before


def test_keeps_the_newest_and_resumes_where_it_stopped(tmp_path):
    make(tmp_path, 30, checkpoint={"dir": str(tmp_path), "every": 4, "keep": 2}).fit()
    assert [p.name for p in Checkpointer(tmp_path).saved()] == ["step-000000028.pt", "step-000000030.pt"]
    trainer = make(tmp_path, 30, resume="auto")
    trainer.fit()  # already at max_steps: nothing to train, nothing written
    assert trainer.state.step == 30
    assert sorted(p.name for p in tmp_path.iterdir()) == [".lock", "step-000000028.pt", "step-000000030.pt"]
    from_dir = make(tmp_path / "elsewhere", 32, resume=tmp_path)  # a directory: its newest checkpoint
    from_dir.fit()
    assert from_dir.state.step == 32 and Checkpointer(tmp_path / "elsewhere").saved()[-1].name == "step-000000032.pt"


class ScriptedVal(Trainer):
    """Validates every 2 steps; the validation at step s reports ``val_loss`` = ``values[s // 2 - 1]`` (100 before
    training)."""

    def __init__(self, values, **kwargs):
        data = [(torch.randn(4, 2), torch.randn(4, 1)) for _ in range(3)]
        super().__init__(model=torch.nn.Linear(2, 1), train_data=data, val_data=data[:1], val_every=2,
                         optimizer=lambda p: torch.optim.SGD(p, lr=0.01), progress=False, loggers=[], **kwargs)
        self.values, self.trained = values, 0

    def validation_step(self, batch):
        step = self.state.step
        return torch.tensor(float(self.values[step // 2 - 1]) if step else 100.0)

    def on_step_end(self, losses):
        self.trained += 1


@pytest.mark.parametrize("mode", ["min", "max"])
def test_with_a_monitor_the_k_best_and_the_newest_are_kept_and_best_txt_names_the_best(tmp_path, mode):
    values = [5, 3, 4, 1, 6, 2, 7, 0.5, 8, 9]  # steps 2, 4, ..., 20
    by_step = {2 * (i + 1): v for i, v in enumerate(values)}

    def expected(last: int) -> list[str]:
        ranked = sorted((s for s in by_step if s <= last), key=by_step.get, reverse=mode == "max")
        return sorted(f"step-{s:09d}.pt" for s in {*ranked[:3], last}), f"step-{ranked[0]:09d}.pt\n"

    ckpt = {"dir": str(tmp_path), "every": 3, "keep": 3, "monitor": "val_loss", "mode": mode}
    ScriptedVal(values, max_steps=10, checkpoint=ckpt).fit()  # saves at every validation, and at 3 and 9
    names, best = expected(10)
    assert sorted(p.name for p in tmp_path.glob("*.pt")) == names and (tmp_path / "best.txt").read_text() == best
    resumed = ScriptedVal(values, max_steps=20, checkpoint=ckpt, resume="auto")
    resumed.fit()
    assert resumed.trained == 10  # from the newest (step 10), not from the best
    names, best = expected(20)
    assert sorted(p.name for p in tmp_path.glob("*.pt")) == names and (tmp_path / "best.txt").read_text() == best
    assert resumed.checkpointer.best == tmp_path / best.strip()
    # a Trainer made to evaluate the finished run (Lightning's checkpoint_callback.best_model_path), before any fit
    assert ScriptedVal(values, max_steps=20, checkpoint=ckpt).checkpointer.best == tmp_path / best.strip()
    assert names == (["step-000000008.pt", "step-000000012.pt", "step-000000016.pt", "step-000000020.pt"]
                     if mode == "min" else ["step-000000014.pt", "step-000000018.pt", "step-000000020.pt"])


def test_a_run_resumed_to_rank_by_a_metric_its_validation_reports_from_now_on_goes_on(tmp_path):
    """Trained with ``monitor="val_loss"``, then ``val_acc`` added to the validation and the run resumed ranking by
    it: the checkpoint's last validation has no ``val_acc``, which is no mistake (it was a ConfigError saying that
    validation does not report it). The checkpoints since rank by it; a name it does not report is still refused at
    the first validation."""
    ScriptedVal([5, 3, 4], max_steps=6, checkpoint={"dir": str(tmp_path), "monitor": "val_loss", "every": None}).fit()

    class WithAccuracy(ScriptedVal):
        def validation_step(self, batch):
            return {"loss": super().validation_step(batch), "acc": torch.tensor(self.state.step / 100)}

    ckpt = {"dir": str(tmp_path), "monitor": "val_acc", "mode": "max", "keep": 1, "every": None}
    resumed = WithAccuracy([5, 3, 4, 2, 1, 0], max_steps=12, checkpoint=ckpt, resume="auto")
    resumed.fit()
    assert resumed.trained == 6 and (tmp_path / "best.txt").read_text() == "step-000000012.pt\n"
    typo = WithAccuracy([5] * 9, max_steps=14, checkpoint={**ckpt, "monitor": "val_acc1"}, resume="auto")
    with pytest.raises(ConfigError, match=re.escape("checkpoint monitors 'val_acc1', which validation does not report: "
                                                    "it reports val_loss, val_acc")):
        typo.fit()
    assert typo.trained == 2 and len(list(tmp_path.glob("step-*.pt"))) == 1


class EpochValidation(Trainer):
    """Validates at each pass's end, in ``on_epoch_end`` (a port of Lightning's validation every epoch, which
    EarlyStopping counts), passes of 3 batches: ``val_loss`` is ``values[step]``. SIGTERM after step ``stop_at``."""

    def __init__(self, values, stop_at=None, **kwargs):
        torch.manual_seed(0)
        data = [(torch.randn(4, 2), torch.randn(4, 1)) for _ in range(3)]
        super().__init__(model=torch.nn.Linear(2, 1), train_data=data, val_data=data[:1], val_every=100,
                         optimizer=lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9), progress=False, loggers=[],
                         **kwargs)
        self.values, self.stop_at = values, stop_at

    def validation_step(self, batch):
        return torch.tensor(self.values.get(self.state.step, 100.0))

    def on_epoch_end(self):
        self.validate()

    def on_step_end(self, losses):
        if self.state.step == self.stop_at:
            os.kill(os.getpid(), signal.SIGTERM)


def test_with_a_monitor_a_validation_a_hook_runs_during_the_steps_is_saved_and_ranked_too(tmp_path):
    """docs/checkpoints.md: "A checkpoint is also saved after every validation during training", so after one that
    ``on_epoch_end`` runs too, once the pass has ended. Before, only ``val_every``'s were: the best pass (step 3) had no
    checkpoint, and best.txt named the best of the others. Stopped and resumed, the run keeps the same files."""
    values = {3: 1.0, 6: 5.0, 9: 4.0, 12: 3.0, 15: 6.0}
    ckpt = {"monitor": "val_loss", "keep": 2, "every": None}
    straight = EpochValidation(values, max_steps=15, checkpoint={"dir": str(tmp_path / "a"), **ckpt})
    straight.fit()
    assert sorted(p.name for p in (tmp_path / "a").glob("*.pt")) == [
        "step-000000003.pt", "step-000000012.pt", "step-000000015.pt"]
    assert (tmp_path / "a" / "best.txt").read_text() == "step-000000003.pt\n"
    assert load(tmp_path / "a" / "step-000000003.pt")["state"]["epoch"] == 1  # saved once the pass had ended
    for stop in (3, 4, 7):
        where = tmp_path / f"stopped-{stop}"
        EpochValidation(values, stop_at=stop, max_steps=15, checkpoint={"dir": str(where), **ckpt}).fit()
        resumed = EpochValidation(values, max_steps=15, checkpoint={"dir": str(where), **ckpt}, resume="auto")
        resumed.fit()
        assert sorted(p.name for p in where.glob("*.pt")) == sorted(p.name for p in (tmp_path / "a").glob("*.pt"))
        assert (where / "best.txt").read_text() == "step-000000003.pt\n"
        assert all(torch.equal(a, b) for a, b in zip(params(resumed), params(straight)))
        assert resumed.state.val_history == straight.state.val_history


def test_the_last_checkpoint_holds_the_validation_that_ends_the_run_though_its_step_was_saved_before_it(tmp_path):
    # steps 1-3, saved every 3 steps: step 3's save comes first, then the end of fit validates (val_every=2 skips 3)
    trainer = ScriptedVal([5], max_steps=3, checkpoint={"dir": str(tmp_path), "every": 3, "monitor": "val_loss"})
    trainer.validation_step = lambda batch: torch.tensor(float(trainer.state.step))
    writes = []
    trainer.on_save_checkpoint = lambda checkpoint: writes.append(checkpoint["state"]["step"])
    trainer.fit()
    assert writes == [2, 3]  # step 3 written once, after the validation that ends the run
    saved = load(tmp_path / "step-000000003.pt")
    assert [step for step, _ in saved["state"]["val_history"]] == [0, 2, 3]
    assert saved["state"]["val_history"][-1][1] == {"val_loss": 3.0}
    assert (tmp_path / "best.txt").read_text() == "step-000000002.pt\n"  # scored with its step's validation too


def test_a_run_ended_by_max_epochs_writes_its_last_checkpoint_once_after_its_pass_and_validation_end(tmp_path):
    # one pass of 3 batches: step 3 is a periodic save and the run's last step; the end of fit validates it
    trainer = ScriptedVal([5, 3], max_epochs=1, checkpoint={"dir": str(tmp_path), "every": 3})
    writes = []
    trainer.on_save_checkpoint = lambda checkpoint: writes.append(
        (checkpoint["state"]["step"], checkpoint["state"]["epoch"], len(checkpoint["state"]["val_history"])))
    trainer.fit()
    assert writes == [(3, 1, 3)]  # once: after the pass ended (epoch 1) and step 3 was validated (at 0, 2, 3)
    resumed = ScriptedVal([5, 3], max_epochs=1, checkpoint={"dir": str(tmp_path), "every": 3}, resume="auto")
    resumed.fit()
    assert resumed.trained == 0 and resumed.state.step == 3


def test_a_checkpoint_monitor_that_cannot_be_read_is_a_config_error_before_training(tmp_path):
    with pytest.raises(ConfigError, match=re.escape("checkpoint.monitor='val_loss' ranks checkpoints by a validation "
                                                    "metric, and there is no val_data")):
        Trainer(model=torch.nn.Linear(2, 1), train_data=[(torch.ones(1, 2), torch.ones(1, 1))], optimizer=torch.optim.SGD,
                max_steps=4, checkpoint={"dir": str(tmp_path), "monitor": "val_loss"})
    # without val_every (a port of ModelCheckpoint(monitor=...), which Lightning's validation every epoch feeds): the
    # validation at the end alone would rank, and the best be the last, as EarlyStopping and a plateau refuse it
    with pytest.raises(ConfigError, match=re.escape("checkpoint.monitor='val_loss' ranks checkpoints by a validation "
                                                    "metric, and no validation runs during training (val_every is not "
                                                    "set: only at its end), so the best would always be the last")):
        data = [(torch.ones(1, 2), torch.ones(1, 1))]
        Trainer(model=torch.nn.Linear(2, 1), train_data=data, val_data=data, optimizer=torch.optim.SGD, max_steps=4,
                checkpoint={"dir": str(tmp_path), "monitor": "val_loss"})
    with pytest.raises(ConfigError, match=re.escape("checkpoint.mode='lowest' is not one of min, max")):
        ScriptedVal([1], max_steps=4, checkpoint={"dir": str(tmp_path), "monitor": "val_loss", "mode": "lowest"})
    trainer = ScriptedVal([1], max_steps=4, checkpoint={"dir": str(tmp_path), "monitor": "val_acc"})
    with pytest.raises(ConfigError, match=re.escape("checkpoint monitors 'val_acc', which validation does not report: "
                                                    "it reports val_loss; give monitor=<one of those>")):
        trainer.fit()
    assert trainer.trained == 0 and not list(tmp_path.glob("*.pt"))


def test_truncated_checkpoint_is_named_and_auto_falls_back_to_the_previous(tmp_path, caplog):
    make(tmp_path, 21).fit()  # saves at 7, 14, 21
    newest = tmp_path / "step-000000021.pt"
    newest.write_bytes(newest.read_bytes()[:1000])
    with pytest.raises(CheckpointError, match=r"checkpoint .*step-000000021\.pt is truncated or corrupt"):
        make(tmp_path, 30, resume=newest).fit()
    trainer = make(tmp_path, 22, resume="auto")
    with caplog.at_level(logging.INFO, logger="safeloop"):
        trainer.fit()
    assert "step-000000021.pt is truncated or corrupt" in caplog.text
    assert "falling back to the previous checkpoint" in caplog.text
    assert "resumed from" in caplog.text and "step-000000014.pt: step 14" in caplog.text
    assert trainer.state.step == 22


class Payload:
    def __reduce__(self):
        return (os.system, ("echo owned",))


def test_a_checkpoint_carrying_pickled_objects_is_refused(tmp_path):
    path = tmp_path / "step-000000001.pt"
    torch.save({"format": 1, "modules": {}, "extra": Payload()}, path)
    with pytest.raises(CheckpointError, match=r"step-000000001\.pt was refused: it holds a pickled Python object "
                                              r"\((posix|nt)\.system\)"):
        make(tmp_path / "run", 5, resume=path).fit()


def test_a_checkpoint_from_a_different_model_names_the_keys(tmp_path):
    make(tmp_path, 7).fit()
    trainer = make(tmp_path, 10, resume="auto")
    trainer.model = torch.nn.Sequential(torch.nn.Linear(8, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
    with pytest.raises(CheckpointError, match=r"step-000000007\.pt was saved from a different model: model keys "
                                              r"missing from the checkpoint: 2\.weight, 2\.bias; checkpoint keys not "
                                              r"in model: 3\.weight, 3\.bias; model shapes differ \(checkpoint vs now\): "
                                              r"0\.weight \(32, 8\) vs \(64, 8\), 0\.bias \(32,\) vs \(64,\)"):
        trainer.fit()


def test_atomic_save_never_leaves_a_partial_file(tmp_path):
    path = tmp_path / "step-000000005.pt"
    atomic_save({"format": FORMAT, "x": torch.ones(3)}, path)

    class Fails:
        def __reduce__(self):
            raise RuntimeError("disk full")

    with pytest.raises(RuntimeError, match="disk full"):
        atomic_save({"format": FORMAT, "x": torch.zeros(10_000), "y": Fails()}, path)
    assert torch.equal(torch.load(path, weights_only=True)["x"], torch.ones(3))
    assert [p.name for p in tmp_path.iterdir()] == [path.name]


def test_the_config_is_stored_as_plain_containers(tmp_path):
    cfg = compose([f"checkpoint.dir={tmp_path}", "trainer.max_steps=3", "trainer.val_every=null",
                   "trainer.progress=false", "trainer.device=cpu"])
    train(cfg)
    saved = load(tmp_path / "step-000000003.pt")  # weights_only=True
    assert type(saved["config"]) is dict and not isinstance(saved["config"], DictConfig)
    assert saved["config"]["model"]["hidden"] == 64 and saved["config"]["checkpoint"]["every"] == 1000


def test_a_checkpoint_of_another_format_is_named(tmp_path):
    path = tmp_path / "step-000000001.pt"
    torch.save({"format": 1, "modules": {}}, path)
    with pytest.raises(CheckpointError, match=rf"step-000000001\.pt has format 1 and this safeloop reads format "
                                              rf"{FORMAT}: resume it with the safeloop version that wrote it"):
        make(tmp_path / "run", 5, resume=path).fit()


def test_state_dict_and_load_state_dict_carry_a_run_over_to_another_trainer(tmp_path):
    straight = make(tmp_path, 30, checkpoint=False)
    straight.fit()
    first = make(tmp_path, 15, checkpoint=False)
    first.fit()
    saved = first.state_dict()  # the global RNG states as they are now, at the end of step 15
    second = make(tmp_path, 30, checkpoint=False)
    with pytest.raises(SafeloopError, match=re.escape("Trainer.load_state_dict() needs the optimizers: call "
                                                      "trainer.setup() first (fit() does)")):
        second.load_state_dict(saved)
    second.setup()
    second.load_state_dict(saved)
    second.fit()  # the loaded RNG states are set before step 16: dropout draws what it drew in the straight run
    assert all(torch.equal(a, b) for a, b in zip(params(second), params(straight)))
    assert second.state.val_history == straight.state.val_history


def test_a_checkpoint_holds_the_modules_that_modules_names_and_no_other(tmp_path):
    trainer = make(tmp_path, 7)
    trainer.spare = torch.nn.Linear(2, 2)  # an attribute that modules() does not name
    trainer.fit()
    assert list(load(tmp_path / "step-000000007.pt")["modules"]) == ["model"]
    assert Trainer(train_data=[1], max_steps=1).modules() == {}  # no model, nothing named


class EmaTrainer(Trainer):
    """Keeps an exponential moving average of the model outside ``model``, and counts its updates."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.ema, self.updates = copy.deepcopy(self.model).requires_grad_(False), 0

    def modules(self):
        return {**super().modules(), "ema": self.ema}

    def on_step_end(self, losses):
        with torch.no_grad():
            for average, p in zip(self.ema.parameters(), self.model.parameters()):
                average.lerp_(p, 0.1)
        self.updates += 1

    def on_save_checkpoint(self, checkpoint):
        checkpoint["ema"] = {"updates": self.updates}

    def on_load_checkpoint(self, checkpoint):
        self.updates = checkpoint["ema"]["updates"]


class Counter(Callback):
    """Counts steps across resumes (the count travels in the checkpoint) and records its hooks."""

    def __init__(self):
        self.steps, self.calls = 0, []

    def on_fit_start(self, trainer):
        self.calls.append("fit start")

    def on_step_end(self, trainer, losses):
        self.steps += 1
        self.calls.append(f"step {trainer.state.step}")

    def on_save_checkpoint(self, trainer, checkpoint):
        checkpoint["counter"] = {"steps": torch.tensor(self.steps)}
        self.calls.append(f"save {trainer.state.step}")

    def on_load_checkpoint(self, trainer, checkpoint):
        self.steps = int(checkpoint["counter"]["steps"])
        self.calls.append(f"load {trainer.state.step}")


def test_modules_and_the_checkpoint_hooks_of_a_subclass_and_a_callback_round_trip(tmp_path):
    straight = make(tmp_path / "a", 20, cls=EmaTrainer)
    straight.fit()
    make(tmp_path / "b", 10, cls=EmaTrainer, callbacks=[Counter()]).fit()  # saves at 7 and 10
    saved = load(tmp_path / "b" / "step-000000010.pt")
    assert list(saved["modules"]) == ["model", "ema"]
    assert saved["ema"] == {"updates": 10} and saved["counter"] == {"steps": torch.tensor(10)}

    counter = Counter()
    resumed = make(tmp_path / "b", 20, resume="auto", cls=EmaTrainer, callbacks=[counter])
    resumed.fit()
    assert resumed.updates == counter.steps == 20
    assert all(torch.equal(a, b) for a, b in zip(resumed.ema.parameters(), straight.ema.parameters()))
    # on_load_checkpoint before on_fit_start; on_save_checkpoint after the step's on_step_end (saves at 14, 20)
    assert counter.calls == ["load 10", "fit start", *[f"step {s}" for s in range(11, 15)], "save 14",
                             *[f"step {s}" for s in range(15, 21)], "save 20"]

    with pytest.raises(CheckpointError, match=re.escape("step-000000020.pt was saved from a different model: the "
                                                        "Trainer has no module 'ema' (see Trainer.modules())")):
        make(tmp_path / "b", 30, resume="auto").fit()


class Outside(Trainer):
    """A head and a learned output scale kept on the Trainer, outside ``model`` (as a Lightning port keeps a second
    network or SAC's ``log_alpha``), trained by the optimizer with the model."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.head, self.log_scale = torch.nn.Linear(1, 1), torch.zeros(1, requires_grad=True)

    def configure_optimizers(self):
        return torch.optim.Adam([*self.model.parameters(), *self.head.parameters(), self.log_scale], lr=1e-2)

    def training_step(self, batch):
        x, y = batch
        return torch.nn.functional.mse_loss(self.head(self.model(x)) * self.log_scale.exp(), y)


def test_tensors_an_optimizer_trains_outside_the_modules_are_saved_and_resumed(tmp_path, caplog):
    """Neither the head nor ``log_scale`` is in ``modules()``: checkpoints hold them by optimizer, group and
    place, and a resumed run goes on as one that never stopped (it used to restart them from their first values)."""
    straight = make(tmp_path / "a", 20, cls=Outside)
    straight.fit()
    make(tmp_path / "b", 10, cls=Outside).fit()
    saved = load(tmp_path / "b" / "step-000000010.pt")
    assert list(saved["modules"]["outside_modules"]) == ["optimizer:0:4", "optimizer:0:5", "optimizer:0:6"]
    resumed = make(tmp_path / "b", 20, resume="auto", cls=Outside)
    resumed.fit()
    for ours, theirs in [(resumed.model, straight.model), (resumed.head, straight.head)]:
        assert all(torch.equal(a, b) for a, b in zip(ours.parameters(), theirs.parameters()))
    assert torch.equal(resumed.log_scale, straight.log_scale) and resumed.log_scale.item() != 0

    del saved["modules"]["outside_modules"]  # as an earlier safeloop saved it: resumed with a word
    other = make(tmp_path / "c", 20, cls=Outside)
    other.setup()
    with caplog.at_level(logging.WARNING, logger="safeloop"):
        other.load_state_dict(saved)
    assert ("the checkpoint holds no parameters trained outside Trainer.modules() (optimizer:0:4, optimizer:0:5, "
            "optimizer:0:6): an earlier safeloop did not save them") in caplog.text
    assert all(torch.equal(a, b) for a, b in zip(other.model.parameters(), saved["modules"]["model"].values()))


class KeptOnTheTrainer(Trainer):
    """An EMA copy (updated every step), a frozen teacher (never changed), a queue (a tensor written in place) and the
    last loss (replaced every step) kept on the Trainer, none in ``modules()``; ``save_ema``: the EMA's state and the
    queue saved by ``on_save_checkpoint``."""

    save_ema = False

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.ema, self.teacher = copy.deepcopy(self.model), copy.deepcopy(self.model).requires_grad_(False)
        self.queue, self.last = torch.zeros(3), None  # a queue written in place; the last output, replaced

    def on_step_end(self, losses):
        with torch.no_grad():
            for average, p in zip(self.ema.parameters(), self.model.parameters()):
                average.lerp_(p, 0.1)
        self.queue.add_(1.0)
        self.last = losses["loss"].detach()

    def on_save_checkpoint(self, checkpoint):
        if self.save_ema:
            checkpoint["ema"], checkpoint["queue"] = self.ema.state_dict(), self.queue


def test_a_module_kept_on_the_trainer_that_training_changed_and_no_checkpoint_holds_is_named(tmp_path):
    """Lightning saves every submodule of a LightningModule; a port keeping its EMA on the Trainer would resume
    it from its first values. The save says so, naming it; the teacher, never changed, is not named."""
    with pytest.warns(ConfigWarning) as caught:
        make(tmp_path / "a", 7, cls=KeptOnTheTrainer).fit()  # saves at step 7
    assert [str(w.message) for w in caught] == [
        "trainer.ema (Sequential) changed during this fit, and checkpoints do not hold it: a run resumed from one "
        "would start it from its first values. Return it from modules() ({**super().modules(), 'ema': self.ema}), or "
        "save its state_dict() in on_save_checkpoint",
        "trainer.queue (Tensor) changed during this fit, and checkpoints do not hold it: a run resumed from one "
        "would start it from its first values. Save it in on_save_checkpoint (checkpoint['queue'] = self.queue) and "
        "put it back in on_load_checkpoint"]
    assert caught[0].filename == __file__  # at the user's line: fit()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        saved = type("SavesIt", (KeptOnTheTrainer,), {"save_ema": True})
        make(tmp_path / "b", 7, cls=saved).fit()
        held = type("HeldByModules", (KeptOnTheTrainer,), {
            "modules": lambda self: {"model": self.model, "ema": self.ema},
            "on_save_checkpoint": lambda self, checkpoint: checkpoint.update(queue=self.queue)})
        make(tmp_path / "c", 7, cls=held).fit()


class Shuffled:
    """An iterable of its own that shuffles at each ``iter`` with ``draw``: Python's ``random``, NumPy's or torch's."""

    def __init__(self, draw):
        gen = torch.Generator().manual_seed(0)
        self.x, self.y, self.draw = torch.randn(8, 4, generator=gen), torch.randn(8, 1, generator=gen), draw

    def __iter__(self):
        order = self.draw()
        for i in range(0, 8, 2):
            yield self.x[order[i:i + 2]], self.y[order[i:i + 2]]


def python_shuffle():
    order = list(range(8))
    random.shuffle(order)
    return order


@pytest.mark.parametrize("draw", [python_shuffle, lambda: np.random.permutation(8), lambda: torch.randperm(8)],
                         ids=["random", "numpy", "torch"])
def test_an_iterable_shuffling_with_any_global_rng_resumes_mid_epoch_as_a_run_that_never_stopped(tmp_path, draw):
    """The interrupted epoch is drawn again from every global RNG state it started with: Python's and NumPy's too."""
    def run(directory, steps, resume=None):
        torch.manual_seed(0)
        random.seed(0)
        np.random.seed(0)
        trainer = Trainer(model=torch.nn.Linear(4, 1), train_data=Shuffled(draw), max_steps=steps, device="cpu",
                          optimizer=lambda p: torch.optim.SGD(p, lr=0.1), progress=False, loggers=(),
                          checkpoint={"dir": str(tmp_path / directory)}, resume=resume)
        trainer.fit()
        return trainer.model

    straight = run("a", 8)
    run("b", 2)  # mid-way through the first pass of 4 steps
    assert all(torch.equal(a, b) for a, b in zip(run("b", 8, resume="auto").parameters(), straight.parameters()))


class SetAtPassStart(Trainer):
    """A scale set in ``on_epoch_start`` (as facebookresearch/mae's port sets its per-pass counter), not saved."""

    def on_epoch_start(self):
        self.scale = 1.0 + self.state.epoch

    def training_step(self, batch):
        x, y = batch
        return torch.nn.functional.mse_loss(self.model(x) * self.scale, y)


def test_an_attribute_set_at_a_pass_start_missing_after_a_resume_mid_pass_is_explained(tmp_path):
    data = [(torch.randn(2, 3), torch.randn(2, 1)) for _ in range(4)]

    def make(steps, resume=None):
        return SetAtPassStart(model=torch.nn.Linear(3, 1), train_data=data, max_steps=steps, device="cpu",
                              optimizer=lambda p: torch.optim.SGD(p, lr=0.1), progress=False, loggers=(),
                              checkpoint={"dir": str(tmp_path)}, resume=resume)

    make(2).fit()
    with pytest.raises(StepError, match=re.escape(
            "AttributeError: 'SetAtPassStart' object has no attribute 'scale'. This fit began 2 batches into pass 0 (a "
            "resume mid-pass): on_epoch_start ran when the pass began, before the checkpoint, and not again; if it "
            "sets `scale`, save it in on_save_checkpoint and put it back in on_load_checkpoint")):
        make(8, resume="auto").fit()
    for old in tmp_path.glob("step-*.pt"):  # a new run from scratch, in the same directory
        old.unlink()
    make(4).fit()  # one whole pass: its checkpoint of step 4 is at the pass's end
    assert make(8, resume="auto").fit().step == 8  # resumed there, the next pass starts: on_epoch_start runs


class Note:
    """Not a tensor or a plain container: torch.load(weights_only=True) refuses it."""


def test_a_hook_that_puts_an_object_into_the_checkpoint_is_stopped_at_the_save(tmp_path):
    class Stores(Callback):
        def on_save_checkpoint(self, trainer, checkpoint):
            checkpoint["mine"] = {"fine": [torch.ones(2), 3, "x", None], "bad": Note()}

    with pytest.raises(CheckpointError, match=re.escape(
            f"on_save_checkpoint put a {__name__}.Note at checkpoint['mine']['bad']: a checkpoint holds only "
            "tensors, numbers, strings, and lists, tuples and dicts of them, so that it loads with "
            "torch.load(weights_only=True)")):
        make(tmp_path, 10, callbacks=[Stores()]).fit()
    assert [p.name for p in tmp_path.iterdir()] == [".lock"]  # stopped at the first save (step 7), nothing written


class Numbered:
    """Batches numbered 0, 1, ... n-1 each epoch, keeping its own position (as torchdata's StatefulDataLoader)."""

    def __init__(self, n: int = 5):
        self.n, self.batch, self.loaded = n, 0, []

    def __iter__(self):
        while self.batch < self.n:
            self.batch += 1
            yield torch.full((4, 8), float(self.batch - 1)), torch.zeros(4, 1)
        self.batch = 0

    def state_dict(self):
        return {"batch": self.batch}

    def load_state_dict(self, state):
        self.loaded.append(state)
        self.batch = state["batch"]


class Seen(Trainer):
    """Records the number of every batch it trains on."""

    def training_step(self, batch):
        self.seen = getattr(self, "seen", []) + [int(batch[0][0, 0])]
        return super().training_step(batch)


def test_a_stateful_data_iterable_is_saved_and_goes_on_from_its_own_position(tmp_path):
    def run(directory, steps, data, resume=None) -> Seen:
        trainer = Seen(torch.nn.Linear(8, 1), data, partial(torch.optim.SGD, lr=0.1), max_steps=steps, resume=resume,
                       checkpoint={"dir": str(directory)}, device="cpu", progress=False, loggers=())
        trainer.fit()
        return trainer

    straight = run(tmp_path / "a", 12, Numbered())
    first = run(tmp_path / "b", 7, Numbered())
    assert load(tmp_path / "b" / "step-000000007.pt")["data"]["iterable"] == {"batch": 2}
    data = Numbered()
    resumed = run(tmp_path / "b", 12, data, resume="auto")
    assert data.loaded == [{"batch": 2}]
    # it gives batches 2, 3, 4, then a new epoch; the Trainer skips none of them
    assert first.seen + resumed.seen == straight.seen == [0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 0, 1]
    assert (resumed.state.epoch, resumed.state.batch_in_epoch) == (straight.state.epoch, straight.state.batch_in_epoch)


class RestartsUnlessLoaded(Numbered):
    """As torchdata's StatefulDataLoader: a new iterator starts the epoch again unless a state was loaded."""

    def __init__(self, n: int = 5):
        super().__init__(n)
        self.next_state = None

    def __iter__(self):
        self.batch, self.next_state = (self.next_state or {"batch": 0})["batch"], None
        return super().__iter__()

    def load_state_dict(self, state):
        super().load_state_dict(state)
        self.next_state = state


def test_a_stateful_data_iterable_trained_in_several_fit_calls_goes_on_where_the_last_stopped():
    runs = []
    for chunks in ((7,), (3, 4)):
        trainer = Seen(torch.nn.Linear(8, 1), RestartsUnlessLoaded(), partial(torch.optim.SGD, lr=0.1), max_steps=1,
                       device="cpu", progress=False, loggers=())
        trainer.max_steps = 0
        for n in chunks:
            trainer.max_steps += n
            trainer.fit()
        runs.append(trainer)
    assert runs[1].seen == runs[0].seen == [0, 1, 2, 3, 4, 0, 1]


class Refusing(Numbered):
    def load_state_dict(self, state):
        raise ValueError("this loader's dataset changed since the checkpoint")


def test_a_data_iterable_that_refuses_its_state_leaves_the_model_and_optimizer_as_they_were(tmp_path):
    Seen(torch.nn.Linear(8, 1), Numbered(), partial(torch.optim.Adam, lr=0.1), max_steps=7,
         checkpoint={"dir": str(tmp_path)}, device="cpu", progress=False, loggers=()).fit()
    trainer = Seen(torch.nn.Linear(8, 1), Refusing(), partial(torch.optim.Adam, lr=0.1), max_steps=12,
                   device="cpu", progress=False, loggers=())
    trainer.setup()
    before = copy.deepcopy(trainer.model.state_dict())
    with pytest.raises(ValueError, match="dataset changed since the checkpoint"):
        trainer.load_state_dict(load(tmp_path / "step-000000007.pt"))
    assert all(torch.equal(a, b) for a, b in zip(trainer.model.state_dict().values(), before.values()))
    assert trainer.optimizers["optimizer"].state == {}  # no Adam state loaded
    assert trainer.state.step == 0


# -- a checkpoint that cannot be trusted -------------------------------------------------------
def first_tensor_at(path: Path) -> int:
    """Where the bytes of the checkpoint's first tensor start (after its zip entry's local header)."""
    entry = next(i for i in zipfile.ZipFile(path).infolist() if re.search(r"/data/\d+$", i.filename))
    header = path.read_bytes()[entry.header_offset:entry.header_offset + 30]
    return entry.header_offset + 30 + int.from_bytes(header[26:28], "little") + int.from_bytes(header[28:30], "little")


def tiny_checkpoint(directory: Path) -> Path:
    """A checkpoint of a 1x1 linear model (20 KB, most of it the RNG states)."""
    torch.manual_seed(0)
    Trainer(torch.nn.Linear(1, 1), [(torch.ones(2, 1), torch.zeros(2, 1))], torch.optim.SGD, max_steps=1,
            checkpoint={"dir": str(directory)}, progress=False, loggers=(), device="cpu").fit()
    return directory / "step-000000001.pt"


def zip_structure(path: Path) -> set[int]:
    """The offsets of the bytes that are no entry's data: headers, the zip's directory and end record, the seal."""
    data = set()
    for entry in zipfile.ZipFile(path).infolist():
        header = path.read_bytes()[entry.header_offset:entry.header_offset + 30]
        start = entry.header_offset + 30 + int.from_bytes(header[26:28], "little") + \
            int.from_bytes(header[28:30], "little")
        data.update(range(start, start + entry.compress_size))
    return set(range(path.stat().st_size)) - data


def test_a_flipped_bit_anywhere_is_refused_naming_the_file(tmp_path):
    """The file carries the SHA-256 of all its bytes: every bit of the zip's headers, directory, end record
    and seal flipped one at a time (where a flip used to load other values, or fail in zlib), and one bit of
    every other byte, is a CheckpointError naming the file. Nothing loads."""
    path = tiny_checkpoint(tmp_path)
    good = path.read_bytes()
    structure = zip_structure(path)
    assert torch.load(path, weights_only=True)["step"] == 1  # still opens as torch.save wrote it
    flips = [(i, bit) for i in range(len(good)) for bit in (range(8) if i in structure else [i % 8])]
    with open(path, "r+b") as f:
        for i, bit in flips:
            f.seek(i)
            f.write(bytes([good[i] ^ 1 << bit]))
            f.flush()
            with pytest.raises(CheckpointError, match=rf"^checkpoint {re.escape(str(path))} is (truncated or )?corrupt"):
                load(path)
            f.seek(i)
            f.write(good[i:i + 1])
    assert len(flips) > len(good) + 7 * 1000  # (about 21 KB, 1.9 KB of it structure: about 34,000 flips)
    with pytest.raises(CheckpointError, match=rf"{re.escape(str(path))} is corrupt: it does not match the checksum "
                                              r"saved with it \(a bit changed on disk or in a copy\)"):
        path.write_bytes(good[:100] + bytes([good[100] ^ 1]) + good[101:])
        load(path)


def directory_record(path: Path, name: str) -> int:
    """Where the zip's central directory describes entry ``name`` (46 bytes of fields, then the name)."""
    data = path.read_bytes()
    return data.index(name.encode(), data.index(b"PK\x01\x02")) - 46


def test_a_damaged_checkpoint_is_passed_over_by_resume_auto(tmp_path, caplog):
    make(tmp_path, 21).fit()  # saves at 7, 14, 21
    newest = tmp_path / "step-000000021.pt"
    damaged = bytearray(newest.read_bytes())
    damaged[first_tensor_at(newest)] ^= 1  # one bit of a weight
    newest.write_bytes(damaged)
    with pytest.raises(CheckpointError, match=r"step-000000021\.pt is corrupt"):
        make(tmp_path / "other", 30, resume=newest).fit()
    trainer = make(tmp_path, 22, resume="auto")
    with caplog.at_level(logging.INFO, logger="safeloop"):
        trainer.fit()
    assert "step-000000021.pt is corrupt" in caplog.text and "falling back to the previous checkpoint" in caplog.text
    assert "step-000000014.pt: step 14" in caplog.text and trainer.state.step == 22


def test_resume_auto_falls_back_past_a_newest_file_whose_zip_directory_is_damaged(tmp_path, caplog):
    make(tmp_path, 21).fit()  # saves at 7, 14, 21
    newest = tmp_path / "step-000000021.pt"
    damaged = bytearray(newest.read_bytes())
    damaged[directory_record(newest, "archive/data/0") + 10] ^= 8  # its compression: stored -> deflated
    newest.write_bytes(damaged)
    trainer = make(tmp_path, 22, resume="auto")
    with caplog.at_level(logging.INFO, logger="safeloop"):
        trainer.fit()  # not zlib's "Error -3 while decompressing data"
    assert "step-000000021.pt is corrupt: it does not match the checksum saved with it" in caplog.text
    assert "step-000000014.pt: step 14" in caplog.text and trainer.state.step == 22


def test_a_damaged_checkpoint_does_not_count_toward_keep(tmp_path):
    make(tmp_path, 14, checkpoint={"dir": str(tmp_path), "every": 7, "keep": 2}).fit()  # saves at 7, 14
    newest = tmp_path / "step-000000014.pt"
    newest.write_bytes(newest.read_bytes()[:-1])
    make(tmp_path, 10, resume="auto", checkpoint={"dir": str(tmp_path), "every": 7, "keep": 2}).fit()  # from 7
    good = [p.name for p in Checkpointer(tmp_path).saved() if p != newest and load(p)]
    assert good == ["step-000000007.pt", "step-000000010.pt"]  # two, as keep=2 says; the damaged one is left


def test_a_restart_prunes_the_checkpoints_a_kill_between_save_and_pruning_left(tmp_path):
    make(tmp_path, 8, checkpoint={"dir": str(tmp_path), "every": 2, "keep": 4}).fit()  # as kills would leave them
    trainer = make(tmp_path, 8, resume="auto", checkpoint={"dir": str(tmp_path), "every": 2, "keep": 2})
    trainer.fit()  # resumed at max_steps: nothing to train or save
    assert [p.name for p in Checkpointer(tmp_path).saved()] == ["step-000000006.pt", "step-000000008.pt"]


@pytest.mark.parametrize("change, message", [
    (lambda c: c.pop("modules"), r"'modules' is missing"),
    (lambda c: (c.pop("rng"), c.pop("optimizers")), r"'optimizers' is missing; 'rng' is missing"),
    (lambda c: c["state"].update(step="7"), r"state\['step'\] is a str \('7'\)"),
    (lambda c: c["state"].update(lr=0.1), r"state\['lr'\] is not a TrainState field \(they are step, epoch, "),
    (lambda c: c["optimizers"].update(optimizer=[1, 2]), r"optimizers\['optimizer'\] is a list \(\[1, 2\]\), not a "
                                                         r"state dict"),
    (lambda c: c["rng"].update(torch=None), r"rng\['torch'\] is a NoneType"),
    (lambda c: c.update(gradients={"model.0.weight": [0.5]}), r"gradients\['model.0.weight'\] is a list \(\[0.5\]\), "
                                                              r"not a tensor"),
    (lambda c: c.update(rank_gradients={"model.0.weight": 0.5}), r"rank_gradients is a dict \(.*\), not a list"),
    (lambda c: c.update(rank_gradients=[{}, {"model.0.weight": 0.5}]), r"rank_gradients\[1\]\['model.0.weight'\] is "
                                                                      r"a float \(0.5\), not a tensor"),
    (lambda c: c.update(rank_rng=[c["rng"], {**c["rng"], "torch": None}]), r"rank_rng\[1\]\['torch'\] is a NoneType"),
    (lambda c: c.update(rank_rng=[c["rng"], 7]), r"rank_rng\[1\] is an int \(7\), not a dict"),
    (lambda c: c.update(rank_data={"epoch_start": None}), r"rank_data is a dict \(.*\), not a list"),
    (lambda c: c.update(rank_data=[c["data"], 7]), r"rank_data\[1\] is an int \(7\), not a dict"),
    (lambda c: c.update(rank_data=[c["data"], {"iterable": None}]), r"rank_data\[1\]\['epoch_start'\] is missing"),
])
def test_a_checkpoint_of_the_wrong_structure_says_what_is_wrong(tmp_path, change, message):
    make(tmp_path, 7).fit()
    path = tmp_path / "step-000000007.pt"
    checkpoint = torch.load(path, weights_only=True)
    change(checkpoint)
    torch.save(checkpoint, path)
    with pytest.raises(CheckpointError, match=r"checkpoint \S+step-000000007\.pt cannot be used: .*" + message
                       + r".*It was not written by safeloop's Trainer\.state_dict\(\), or was changed since"):
        make(tmp_path / "run", 10, resume=path).fit()


class AccumulatesOverSteps(Trainer):
    """Manual mode, one update every 4 steps: gradients live from one step to the next."""

    automatic = False

    def training_step(self, batch):
        loss = self.validation_step(batch) / 4
        self.backward(loss)
        if self.state.step % 4 == 3:
            self.step()
        return loss

    def validation_step(self, batch):
        x, y = batch
        return torch.nn.functional.mse_loss(self.model(x), y)


def test_gradients_carried_from_step_to_step_are_saved_and_resumed_bit_identically(tmp_path, one_thread):
    straight = make(tmp_path / "a", 24, cls=AccumulatesOverSteps)
    straight.fit()
    make(tmp_path / "b", 14, cls=AccumulatesOverSteps).fit()  # checkpoints at 7 and 14: both mid-accumulation
    saved = load(tmp_path / "b" / "step-000000014.pt")["gradients"]
    assert sorted(saved) == sorted(f"model.{name}" for name, _ in straight.model.named_parameters())
    resumed = make(tmp_path / "b", 24, cls=AccumulatesOverSteps, resume="auto")
    resumed.fit()
    assert all(torch.equal(a, b) for a, b in zip(params(resumed), params(straight)))
    make(tmp_path / "c", 7).fit()
    assert load(tmp_path / "c" / "step-000000007.pt")["gradients"] == {}  # an automatic step leaves none


def test_each_rank_resumes_its_own_data_state_when_the_ranks_are_as_many():
    """``rank_data`` (under torchrun, each rank's data state: a transform's own generator seeded per rank): a rank
    takes its own on as many ranks, and rank zero's (``data``) on another number, in one process, or from a
    checkpoint written before ``rank_data`` was saved; as ``rank_rng``."""
    from types import SimpleNamespace

    from safeloop.checkpoint.contents import data_for, rng_for

    zero, one = {"epoch_start": {"generators": [0]}}, {"epoch_start": {"generators": [1]}}
    checkpoint = {"data": zero, "rank_data": [zero, one], "rng": "zero's", "rank_rng": ["zero's", "one's"]}
    second_of_two, second_of_three = SimpleNamespace(rank=1, world=2), SimpleNamespace(rank=1, world=3)
    assert data_for(checkpoint, second_of_two) is one and rng_for(checkpoint, second_of_two) == "one's"
    assert data_for(checkpoint, second_of_three) is zero and rng_for(checkpoint, second_of_three) == "zero's"
    assert data_for(checkpoint, None) is zero
    assert data_for({"data": zero}, second_of_two) is zero  # an earlier safeloop's checkpoint


def test_gradients_for_another_model_are_named(tmp_path):
    make(tmp_path, 7, cls=AccumulatesOverSteps).fit()
    path = tmp_path / "step-000000007.pt"
    checkpoint = torch.load(path, weights_only=True)
    checkpoint["gradients"]["model.0.weight"] = torch.zeros(3, 8)
    checkpoint["gradients"]["model.9.bias"] = torch.zeros(1)
    checkpoint["rank_gradients"] = [{}, {"model.0.bias": torch.zeros(2)}]  # as torchrun writes them, per rank
    torch.save(checkpoint, path)
    with pytest.raises(CheckpointError, match=re.escape(
            "step-000000007.pt was saved from a different model: gradients['model.9.bias'] names no parameter of "
            "the Trainer's modules; gradients['model.0.weight'] has shape (3, 8) and the parameter (32, 8); "
            "rank_gradients[1]['model.0.bias'] has shape (2,) and the parameter (32,). Resume "
            "with the model configuration it was saved with")):
        make(tmp_path / "run", 10, cls=AccumulatesOverSteps, resume=path).fit()


def test_an_optimizer_over_other_parameters_is_refused_before_anything_is_loaded(tmp_path):
    make(tmp_path, 7).fit()
    trainer = make(tmp_path / "run", 10, resume=tmp_path / "step-000000007.pt")
    trainer.configure_optimizers = lambda: torch.optim.Adam(trainer.model[0].parameters(), lr=1e-2)
    before = [p.detach().clone() for p in trainer.model.parameters()]
    with pytest.raises(CheckpointError, match=re.escape(
            "step-000000007.pt: optimizer 'optimizer' does not fit this run's (parameters per group: [4] saved, [2] "
            "now): resume with the same configure_optimizers")):
        trainer.fit()
    assert all(torch.equal(a, b) for a, b in zip(before, trainer.model.parameters()))
    assert not trainer.optimizers["optimizer"].state and trainer.state.step == 0


def test_random_bytes_are_named_as_corrupt_not_as_a_pickle(tmp_path):
    path = tmp_path / "step-000000003.pt"
    path.write_bytes(random.Random(0).randbytes(5000))
    with pytest.raises(CheckpointError, match=r"step-000000003\.pt is truncated or corrupt and cannot be read \(not a "
                                              r"complete zip archive, as torch\.save writes"):
        make(tmp_path / "run", 5, resume=path).fit()


def test_another_optimizer_class_is_refused_by_name_and_differing_settings_are_logged(tmp_path, caplog):
    make(tmp_path, 7).fit()  # Adam, lr=1e-2
    path = tmp_path / "step-000000007.pt"
    for cls in (torch.optim.SGD, torch.optim.AdamW):
        resumed = Trainer(torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Dropout(0.2), torch.nn.ReLU(),
                                              torch.nn.Linear(32, 1)), [(torch.zeros(2, 8), torch.zeros(2, 1))],
                          partial(cls, lr=1e-2), max_steps=10, resume=path, device="cpu", progress=False, loggers=())
        with pytest.raises(CheckpointError, match=rf"step-000000007\.pt: optimizer 'optimizer' was saved from "
                                                  rf"torch\.optim\.Adam and this run's is torch\.optim\.{cls.__name__}: "
                                                  "an optimizer's state does not carry over to another class"):
            resumed.fit()
    older = torch.load(path, weights_only=True)  # a checkpoint that does not record the class: told by its settings
    del older["optimizer_classes"]
    torch.save(older, tmp_path / "older.pt")
    with pytest.raises(CheckpointError, match=r"was saved from an optimizer with the settings amsgrad, betas, .* and "
                                              r"this run's is torch\.optim\.SGD"):
        sgd = make(tmp_path / "b", 10, resume=tmp_path / "older.pt", checkpoint=False)
        sgd._optimizer = partial(torch.optim.SGD, lr=0.1)
        sgd.fit()

    trainer = make(tmp_path, 10, resume=path)
    trainer._optimizer = partial(torch.optim.Adam, lr=1e-3, weight_decay=0.1)
    with caplog.at_level(logging.WARNING, logger="safeloop"):
        trainer.fit()
    assert re.search(r"resume: optimizer 'optimizer' of checkpoint \S+step-000000007\.pt was configured with lr 0\.01 "
                     r"\(this run: 0\.001\), weight_decay 0 \(this run: 0\.1\), initial_lr 0\.01 \(this run: 0\.001\): "
                     r"the checkpoint's values are used", caplog.text)
    assert trainer.optimizers["optimizer"].param_groups[0]["weight_decay"] == 0


# -- two runs, failed writes, dead writers ----------------------------------------------------
def job(directory: Path, steps: int, resume: str | None = None, limit: str = "") -> subprocess.Popen:
    """``tests.checkpoint_job`` in a new process (``limit``: a shell command run first, e.g. ``ulimit -f 16``)."""
    command = f"{limit + '; ' if limit else ''}exec {sys.executable} -m tests.checkpoint_job {directory} {steps}" \
              + (f" {resume}" if resume else "")
    return subprocess.Popen(["bash", "-c", command], cwd=ROOT, env=subprocess_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def test_a_second_run_on_the_same_checkpoint_or_run_directory_is_refused_naming_the_holder(tmp_path):
    run_dir = tmp_path / "run"
    other = subprocess.Popen(  # saves in tmp_path, logs every step to run_dir/metrics.csv
        [sys.executable, "-c", "import sys, torch; from tests.checkpoint_job import make; torch.set_num_threads(1); "
         "make(sys.argv[1], 10**6, run_dir=sys.argv[2], loggers=('csv',), log_every=1).fit()", str(tmp_path),
         str(run_dir)],
        cwd=ROOT, env=subprocess_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    holder = rf"\(process {other.pid} on \S+, since [\d-]+ [\d:]+\)"
    try:
        wait_for(lambda: Checkpointer(tmp_path).saved(), other)
        second = make(tmp_path, 100, resume="auto")
        with pytest.raises(CheckpointError, match=rf"checkpoint directory {re.escape(str(tmp_path))} is in use by "
                                                  rf"another run {holder}: two runs saving there would overwrite"):
            second.fit()
        assert second.state.step == 0  # refused before training
        # its own checkpoint directory, the same run directory: metrics.csv would get both runs' rows
        third = make(tmp_path / "elsewhere", 100, run_dir=run_dir, loggers=("csv",), log_every=1)
        with pytest.raises(SafeloopError, match=rf"^run directory {re.escape(str(run_dir))} is in use by another run "
                                                rf"{holder}: two runs writing there would interleave their "
                                                r"metrics\.csv\. Give this run its own run directory \(run_dir=\.\.\., "
                                                r"or hydra\.run\.dir=\.\.\. on the command line\), or wait until "
                                                r"that run ends"):
            third.fit()
        assert third.state.step == 0
        seen = Checkpointer(tmp_path).saved()[-1]
        wait_for(lambda: Checkpointer(tmp_path).saved()[-1] != seen, other)  # the other run goes on saving
    finally:
        other.send_signal(signal.SIGTERM)
        output = other.communicate(timeout=60)[0]
    assert other.returncode == 0, output
    for path in Checkpointer(tmp_path).saved():
        load(path)
    with open(run_dir / "metrics.csv") as f:
        steps = [int(row["step"]) for row in csv.DictReader(f) if row["metric"] == "loss"]
    assert steps == list(range(1, len(steps) + 1))  # one run's rows
    make(tmp_path, 1, resume="auto", run_dir=run_dir).fit()  # both are free once that run has ended


def test_temporary_files_of_dead_writers_are_removed_at_start_up_and_live_ones_kept(tmp_path):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        tmp_path.mkdir(exist_ok=True)
        of_dead = tmp_path / f".step-000000005.pt.{int(dead.stdout)}.tmp"
        of_live = tmp_path / f".step-000000006.pt.{live.pid}.tmp"
        for path in (of_dead, of_live):
            path.write_bytes(b"x" * 10_000)
        make(tmp_path, 3).fit()
        assert not of_dead.exists() and of_live.exists()
    finally:
        live.kill()
        live.wait()


def test_a_checkpoint_too_large_for_ulimit_is_named_and_the_older_ones_are_intact(tmp_path):
    make(tmp_path, 7).fit()
    before = (tmp_path / "step-000000007.pt").read_bytes()
    limited = job(tmp_path, 14, "auto", limit="ulimit -f 16")  # 16 KiB: the start-up check passes, a save does not
    output = limited.communicate(timeout=120)[0]
    assert limited.returncode == 1
    assert re.search(rf"CheckpointError: checkpoint {re.escape(str(tmp_path))}/step-000000014\.pt could not be saved: "
                     r"the file is larger than this process may write \(a file-size limit such as ulimit -f.*\)"
                     r".* \[File too large\]\. The checkpoints saved before it are intact", output), output
    assert "unexpected pos" not in output
    assert (tmp_path / "step-000000007.pt").read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == [".lock", "step-000000007.pt"]  # no temporary file left


def test_a_directory_this_user_cannot_write_is_refused_at_start_up(tmp_path):
    directory = tmp_path / "ckpt"
    directory.mkdir()
    directory.chmod(0o555)
    try:
        try:  # root (and CAP_DAC_OVERRIDE) writes whatever the mode says: then there is nothing to test
            (directory / "probe").touch()
            (directory / "probe").unlink()
            pytest.skip("this user writes into a read-only (0o555) directory: it runs as root")
        except PermissionError:
            pass
        trainer = make(directory, 10)
        with pytest.raises(CheckpointError, match=rf"checkpoint directory {re.escape(str(directory))} cannot be used: "
                                                  r"permission denied: set checkpoint\.dir to a directory this user "
                                                  r"can write \[Permission denied\]"):
            trainer.fit()
        assert trainer.state.step == 0  # found before training, not at the first save
    finally:
        directory.chmod(0o755)


def in_own_mount(tmp_path: Path, script: str) -> subprocess.CompletedProcess:
    """``script`` (bash) in a private mount namespace, where it may mount a small tmpfs at ``$DIR``:
    a real file system that fills up or turns read-only, touching nothing outside the test."""
    if subprocess.run(["unshare", "-rm", "true"], capture_output=True).returncode != 0:
        pytest.skip("unshare -rm (a private mount namespace) is not permitted here")
    (tmp_path / "mnt").mkdir()
    make(tmp_path / "first", 7).fit()  # the run's first part, whose checkpoint the script copies in: $FIRST
    train = f'train() {{ {sys.executable} -m tests.checkpoint_job "$DIR" "$@"; }}'
    return subprocess.run(["unshare", "-rm", "bash", "-c",
                           f"DIR='{tmp_path / 'mnt'}'; FIRST='{tmp_path / 'first' / 'step-000000007.pt'}'; {train}; "
                           f"{script}"], cwd=ROOT, env=subprocess_env(), capture_output=True, text=True, timeout=180)


def test_a_full_disk_is_named_and_the_older_checkpoints_are_intact(tmp_path):
    done = in_own_mount(tmp_path, """
        set -e
        mount -t tmpfs -o size=256k tmpfs $DIR
        cp $FIRST $DIR/
        # fill the disk but 8 KiB: the start-up check (4 KiB) passes, the next checkpoint (33 KB) does not fit
        dd if=/dev/zero of=$DIR/filler bs=1k count=$(( $(df -k --output=avail $DIR | tail -1) - 8 )) 2>/dev/null
        set +e
        train 14 auto 2>&1
        echo "exit $?"
        ls -a $DIR
        cp $DIR/step-000000007.pt $DIR/../after.pt
    """)
    out = done.stdout
    assert re.search(r"CheckpointError: checkpoint \S+/step-000000014\.pt could not be saved: no space left on the "
                     r"device: free some, or set checkpoint\.dir to a disk with room .*\[No space left on device\]\. "
                     "The checkpoints saved before it are intact", out), out + done.stderr
    assert "exit 1" in out and "resumed from" in out
    assert ".step-" not in out  # no temporary file left
    assert (tmp_path / "after.pt").read_bytes() == (tmp_path / "first" / "step-000000007.pt").read_bytes()


def test_a_read_only_file_system_is_refused_at_start_up(tmp_path):
    done = in_own_mount(tmp_path, """
        set -e
        mount -t tmpfs -o size=1m tmpfs $DIR
        cp $FIRST $DIR/
        mount -o remount,ro $DIR
        set +e
        train 14 auto 2>&1
        echo "exit $?"
    """)
    out = done.stdout
    assert re.search(r"CheckpointError: checkpoint directory \S+/mnt cannot be used: the file system is read-only: "
                     r"set checkpoint\.dir to a writable directory \[Read-only file system\]", out), out + done.stderr
    assert "exit 1" in out and "resumed from" not in out  # refused before loading or training anything


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_second_signal_during_the_stop_save_stops_at_once_with_the_signal_exit_code(tmp_path, signum):
    run_dir, ckpt = tmp_path / "run", Checkpointer(tmp_path / "run" / "ckpt")
    args = [sys.executable, "-m", "safeloop", f"hydra.run.dir={run_dir}", f"checkpoint.dir={ckpt.dir}",
            "checkpoint.every=100000", "trainer.max_steps=100000", "trainer.device=cpu", "trainer.val_every=null",
            "trainer.log_every=1", "trainer.progress=false", "model.hidden=1024", "model.depth=7"]  # a 75 MB save
    proc = subprocess.Popen(args, cwd=tmp_path, env=subprocess_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        wait_for(lambda: (run_dir / "metrics.csv").exists() and last_logged_step(run_dir) >= 1, proc, timeout=120)
        proc.send_signal(signum)
        # while torch.save writes the stop-save (1 MB of 75 written), where a signal used to come out as a writer error
        wait_for(lambda: any(p.stat().st_size > 2**20 for p in ckpt.dir.glob(f".step-*.{proc.pid}.tmp")), proc,
                 poll=0.0005)
        proc.send_signal(signum)
        output = proc.communicate(timeout=60)[0]
    finally:
        if proc.poll() is None:  # a failed wait: never leave the run training
            proc.kill()
            proc.wait()
    assert proc.returncode == 128 + signum, output
    assert f"{signal.Signals(signum).name} received a second time: stopped at once, without saving" in output
    assert "Traceback" not in output and "enforce fail" not in output
    assert not list(ckpt.dir.glob(".step-*"))  # the abandoned save left no temporary file
    for path in ckpt.saved():  # and nothing partial under a checkpoint's name
        load(path)


def test_the_final_checkpoint_holds_the_final_validation(tmp_path):
    trainer = make(tmp_path / "ckpt", 12)  # validation every 5 steps, checkpoints every 7: neither at step 12
    trainer.fit()
    saved = load(Checkpointer(tmp_path / "ckpt").saved()[-1])
    assert saved["state"]["step"] == 12
    assert [s for s, _ in saved["state"]["val_history"]] == [0, 5, 10, 12]
    assert saved["state"]["val_history"][-1] == trainer.state.val_history[-1]
