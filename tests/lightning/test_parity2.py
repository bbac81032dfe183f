"""safeloop's Trainer against pytorch-lightning's, bit for bit: checkpoints, resuming, evaluation after ``fit``,
clipping by value, manual accumulation, warm-up schedules, logging, iterable data, empty validation data.

As in ``test_parity.py``: each test trains the same tiny seeded model with ``pytorch_lightning.Trainer`` and with
its port to ``safeloop.Trainer``; ``..._matches`` tests compare what a user relies on, ``..._differs_as_documented``
tests assert a difference the docs state, exactly. A difference the docs do not state is a test asserting
Lightning's behaviour, marked ``xfail(strict=True)`` with the reason, until it is fixed or documented.
"""
import copy
import math
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, IterableDataset

pl = pytest.importorskip("pytorch_lightning")

import safeloop  # noqa: E402

from .common import (Lit, LitScored, Port, PortScored, adam, assert_same, close, dataset, lightning,  # noqa: E402
                     loader, max_diff, mse, net, saved_and_resumed, settings, sgd)
from .test_parity import (GAN, LitEarly, LitGAN, LitScaled, LitValidated, PortEarly, PortGAN,  # noqa: E402
                          PortScaled, PortValidated, d_loss_of, g_loss_of, gan_adam, ring)

EPOCHS, STEPS = 2, 7  # passes of 7 batches by default
pytestmark = pytest.mark.filterwarnings("ignore::Warning:pytorch_lightning", "ignore::Warning:lightning_fabric")


# -- checkpoints: which files a run leaves, and the step each holds


def lightning_files(directory) -> dict:
    """``{file name: the global_step it holds}`` of Lightning's checkpoint directory."""
    return {p.name: torch.load(p, weights_only=False)["global_step"] for p in directory.glob("*.ckpt")}


def safeloop_files(directory) -> dict:
    """``{file name: the step it holds}`` of safeloop's checkpoint directory."""
    return {p.name: torch.load(p, weights_only=True)["step"] for p in directory.glob("step-*.pt")}


def checkpointed_runs(tmp_path, model_checkpoint: dict, checkpoint: dict, lr=0.05, epochs=6, every=None):
    """Lightning's run with ``ModelCheckpoint(**model_checkpoint)`` and safeloop's with ``checkpoint``, SGD at
    ``lr``, validation each epoch or ``every`` batches: each directory's ``{file: step}``, and the best's step."""
    cb = pl.callbacks.ModelCheckpoint(dirpath=tmp_path / "lit", filename="{step}", **model_checkpoint)
    validation = {} if every is None else {"val_check_interval": every, "check_val_every_n_epoch": None}
    lit = LitScored(configure=lambda m: sgd(m.parameters(), lr))
    lightning(max_epochs=epochs, enable_checkpointing=True, callbacks=[cb], **validation).fit(
        lit, train_dataloaders=loader(), val_dataloaders=loader(n=6, seed=2))
    port = PortScored(model=net(), train_data=loader(), val_data=loader(n=6, seed=2), optimizer=lambda p: sgd(p, lr),
                      checkpoint={"dir": str(tmp_path / "safeloop"), **checkpoint},
                      **settings(max_epochs=epochs, val_every=every or STEPS))
    port.fit()
    assert_same(lit.model, port.model)
    theirs, ours = lightning_files(tmp_path / "lit"), safeloop_files(tmp_path / "safeloop")
    best = (torch.load(cb.best_model_path, weights_only=False)["global_step"] if cb.best_model_path else None,
            torch.load(port.checkpointer.best, weights_only=True)["step"] if port.checkpointer.best else None)
    return theirs, ours, best


@pytest.mark.parametrize("mode, monitor, every", [("min", "val_loss", None), ("max", "val_score", None),
                                                  ("min", "val_loss", 3)],
                         ids=["min each epoch", "max each epoch", "min every 3 batches"])
def test_best_checkpoints_match(tmp_path, mode, monitor, every):
    """``ModelCheckpoint(monitor, mode, save_top_k=2)`` against ``checkpoint={"monitor", "mode", "keep": 2}``
    (docs/trainer.md's map), validation each epoch or every 3 batches, over a loss that goes up and down: the steps
    of the best two kept (safeloop also keeps its newest: see the test below) and the step of the best."""
    theirs, ours, best = checkpointed_runs(tmp_path, dict(monitor=monitor, mode=mode, save_top_k=2),
                                           {"monitor": monitor, "mode": mode, "keep": 2, "every": None}, every=every)
    newest = max(ours.values())
    assert len(theirs) == 2 and len(ours) == 3 and newest not in theirs.values()
    assert sorted(theirs.values()) == sorted(s for s in ours.values() if s != newest)
    assert best[0] == best[1]


def test_last_checkpoint_with_a_monitor_differs_as_documented(tmp_path):
    """``save_top_k=2, save_last=True`` against ``keep=2``, validation each epoch for 6 epochs: the last validations
    (steps 35 and 42) do not enter the best two. Lightning's ``last.ckpt`` holds step 28, the last that did; safeloop
    keeps step 42, and no file of Lightning's holds step 42."""
    theirs, ours, _ = checkpointed_runs(tmp_path, dict(monitor="val_loss", save_top_k=2, save_last=True),
                                        {"monitor": "val_loss", "keep": 2, "every": None})
    assert theirs == {"step=14.ckpt": 14, "step=28.ckpt": 28, "last.ckpt": 28}
    assert 42 not in theirs.values()
    assert sorted(ours.values()) == [14, 28, 42]  # the best two and the newest


@pytest.mark.parametrize("top_k, keep", [(-1, 100), (1, 1)], ids=["all", "newest"])
def test_checkpoints_every_n_steps_differs_as_documented(tmp_path, top_k, keep):
    """``ModelCheckpoint(every_n_train_steps=3, save_top_k=k)`` (Lightning allows k in -1, 0, 1 without a monitor)
    against ``checkpoint={"every": 3, "keep": K}``, 2 epochs (14 steps): docs/checkpoints.md, "Checkpoints are
    written ... at the end": safeloop also saves step 14, which Lightning does not (every_n_train_steps turns its
    epoch-end saves off), so with one kept Lightning keeps step 12 and safeloop step 14."""
    theirs, ours, _ = checkpointed_runs(tmp_path, dict(every_n_train_steps=3, save_top_k=top_k),
                                        {"every": 3, "keep": keep}, epochs=EPOCHS)
    assert sorted(theirs.values()) == ([3, 6, 9, 12] if top_k == -1 else [12])
    assert sorted(ours.values()) == ([3, 6, 9, 12, 14] if top_k == -1 else [14])


def test_best_checkpoints_every_n_steps_with_a_monitor_differs_as_documented(tmp_path):
    """``ModelCheckpoint(monitor="val_loss", save_top_k=2, every_n_train_steps=3)`` against ``checkpoint={"monitor":
    "val_loss", "keep": 2, "every": 3}``, validation each epoch (best at step 14, then 28): docs/checkpoints.md, "a
    save at every multiple of either. A checkpoint saved at a step without a validation has no metric. It is kept
    only while it is the newest": safeloop keeps steps 14 and 28 (and its newest, 42), the best step 14. Lightning
    saves at multiples of 3 only, each ranked by the last validation's value, which step 14 gave to steps 15 and 18:
    it keeps those, and its best, step 15, holds weights no validation measured."""
    theirs, ours, best = checkpointed_runs(tmp_path, dict(monitor="val_loss", save_top_k=2, every_n_train_steps=3),
                                           {"monitor": "val_loss", "keep": 2, "every": 3})
    assert sorted(theirs.values()) == [15, 18] and best[0] == 15
    assert sorted(ours.values()) == [14, 28, 42] and best[1] == 14


# -- resuming from a checkpoint and training on


def step_lr_alone(model):
    """SGD with momentum and a StepLR (gamma 0.5) given alone: stepped at each epoch's end in both."""
    opt = sgd(model.parameters())
    return {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)}


class LitOrder(Lit):
    """``(global_step, current_epoch, batch_idx, the batch's first value)`` at each ``training_step``."""

    def training_step(self, batch, batch_idx):
        self.seen.append((self.global_step, self.current_epoch, batch_idx, float(batch[0][0, 0])))
        return super().training_step(batch, batch_idx)


class PortOrder(Port):
    seen: list
    configure = staticmethod(step_lr_alone)

    def training_step(self, batch):
        self.seen.append((self.state.step, self.state.epoch, self.state.batch_in_epoch - 1, float(batch[0][0, 0])))
        return super().training_step(batch)


def optimizer_state(optimizer) -> list:
    return [t for state in optimizer.state_dict()["state"].values() for t in state.values()]


def resumed_runs(tmp_path, at, shuffle=False, epochs=3):
    """For each framework: a run of ``epochs`` that never stopped, and one saved at step ``at`` (Lightning's
    ``every_n_train_steps``, safeloop's ``checkpoint.every``) with ``max_steps=at``, then resumed from that file
    by a new Trainer (``fit(ckpt_path=)`` / ``resume=``) up to ``epochs``."""
    def data():
        return DataLoader(dataset(), batch_size=2, shuffle=shuffle)

    def lit_run(ckpt_path=None, **kwargs):
        lit = LitOrder(configure=step_lr_alone)
        lit.seen = []
        torch.manual_seed(5)
        trainer = lightning(**{"max_epochs": epochs, **kwargs})
        trainer.fit(lit, train_dataloaders=data(), ckpt_path=ckpt_path)
        return lit

    def port_run(**kwargs):
        port = PortOrder(model=net(), train_data=data(), **settings(**{"max_epochs": epochs, **kwargs}))
        port.seen = []
        torch.manual_seed(5)
        port.fit()
        return port

    return saved_and_resumed(tmp_path, at, lit_run, port_run)


def assert_resumed_as_whole(whole, resumed, at):
    """``resumed`` (a safeloop run) holds what ``whole`` does: parameters, optimizer state, learning rate, counters,
    and from step ``at`` on it saw the same batches."""
    assert_same(whole.model, resumed.model)
    opt, opt2 = whole.optimizers["optimizer"], resumed.optimizers["optimizer"]
    assert all(torch.equal(a, b) for a, b in zip(optimizer_state(opt), optimizer_state(opt2)))
    assert opt.param_groups[0]["lr"] == opt2.param_groups[0]["lr"] == 0.05 / 8
    assert (whole.state.step, whole.state.epoch) == (resumed.state.step, resumed.state.epoch) == (21, 3)
    assert whole.seen[at:] == resumed.seen


def test_resume_at_a_pass_end_matches(tmp_path):
    """A checkpoint at the end of the first pass (step 7), resumed by a new Trainer to 3 epochs: in each framework
    the resumed run ends as the one that never stopped (parameters, momentum buffers, learning rate, step and
    epoch, the batches from step 7 on), and the two frameworks' runs are the same, bit for bit."""
    lit, ours = resumed_runs(tmp_path, STEPS)
    assert_resumed_as_whole(ours["whole"], ours["resumed"], STEPS)
    assert_same(lit["whole"].model, lit["resumed"].model)
    assert lit["whole"].seen[STEPS:] == lit["resumed"].seen == ours["resumed"].seen
    assert all(torch.equal(a, b) for a, b in zip(optimizer_state(lit["resumed"].optimizers().optimizer),
                                                   optimizer_state(ours["resumed"].optimizers["optimizer"])))
    assert (lit["resumed"].trainer.global_step, lit["resumed"].trainer.current_epoch) == (21, 3)
    assert lit["resumed"].optimizers().param_groups[0]["lr"] == 0.05 / 8
    assert_same(lit["resumed"].model, ours["resumed"].model)


def test_resume_mid_pass_differs_as_documented(tmp_path):
    """docs/checkpoints.md: "A run resumed at step N is bit-identical to one that never stopped"; a DataLoader's
    interrupted epoch is drawn again and fast-forwarded past the batches consumed. Resumed at step 10 (3 batches
    into the second pass), safeloop's run is its run that never stopped. Lightning's restarts the DataLoader but
    counts on from ``batch_idx`` 3: the pass's first 4 batches are trained as its last 4, the pass ends after 4
    steps, and its run ends elsewhere (the same step, epoch and learning rate)."""
    at = 10
    lit, ours = resumed_runs(tmp_path, at)
    assert_resumed_as_whole(ours["whole"], ours["resumed"], at)
    assert_same(lit["whole"].model, ours["whole"].model)
    whole, resumed = lit["whole"].seen, lit["resumed"].seen
    assert [s[:3] for s in whole[at:]] == [s[:3] for s in resumed]  # the same counters ...
    assert [s[3] for s in resumed[:4]] == [s[3] for s in whole[STEPS:STEPS + 4]]  # ... the pass's first batches
    assert (lit["resumed"].trainer.global_step, lit["resumed"].trainer.current_epoch) == (21, 3)
    assert lit["resumed"].optimizers().param_groups[0]["lr"] == 0.05 / 8
    assert max_diff(lit["whole"].model, lit["resumed"].model) > 0.01


def test_resume_with_a_shuffled_loader_differs_as_documented(tmp_path):
    """docs/checkpoints.md: a checkpoint holds "the RNG states, set again just before the first resumed step".
    Resumed at the end of the first pass of a shuffled DataLoader, safeloop's run draws the orders its run that
    never stopped drew; a Lightning checkpoint holds no RNG state, so its resumed run draws others."""
    lit, ours = resumed_runs(tmp_path, STEPS, shuffle=True)
    assert_resumed_as_whole(ours["whole"], ours["resumed"], STEPS)
    assert_same(lit["whole"].model, ours["whole"].model)
    assert lit["whole"].seen[STEPS:] != lit["resumed"].seen
    assert max_diff(lit["whole"].model, lit["resumed"].model) > 0.01


# -- validate, test and predict after fit


class LitAfter(Lit):
    """Tests and predicts as it validates; counts its ``on_validation_end`` calls."""

    def test_step(self, batch, batch_idx):
        self.log("test_loss", mse(self.model, batch))

    def predict_step(self, batch, batch_idx):
        return self.model(batch[0])

    def on_validation_end(self):
        self.ends += 1


class PortAfter(Port):
    ends = 0

    def on_validation_end(self, metrics):
        self.ends += 1


def modes(model) -> list:
    return [m.training for m in model.modules()]


def fitted(tmp_path, dropout_eval=True, monitor=False):
    """Lightning's run and its port, 6 epochs of SGD at 0.05 (a validation loss that goes up and down), dropout
    0.3 (``dropout_eval``: that layer left in eval mode; otherwise the port is given Lightning's trained weights), a
    checkpoint of the best by ``val_loss`` if ``monitor``."""
    lit = LitAfter(net(dropout=0.3), configure=lambda m: sgd(m.parameters()))
    lit.ends = 0
    model = net(dropout=0.3)
    if dropout_eval:
        lit.model[2].eval()
        model[2].eval()
    callbacks = [pl.callbacks.ModelCheckpoint(dirpath=tmp_path / "lit", monitor="val_loss")] if monitor else []
    trainer = lightning(max_epochs=6, enable_checkpointing=monitor, callbacks=callbacks)
    trainer.fit(lit, train_dataloaders=loader(), val_dataloaders=loader(n=6, seed=2))
    port = PortAfter(model=model, train_data=loader(), val_data=loader(n=6, seed=2), optimizer=sgd,
                     checkpoint={"dir": str(tmp_path / "sl"), "monitor": "val_loss", "keep": 1} if monitor else False,
                     **settings(max_epochs=6, val_every=STEPS))
    port.fit()
    if not dropout_eval:  # Lightning's validations move the generator dropout draws from (test_parity.py's
        port.model.load_state_dict(lit.model.state_dict())  # ..._random_streams_differs_as_documented)
    assert_same(lit.model, port.model)
    return trainer, lit, port


@pytest.mark.parametrize("dropout_eval", [False, True], ids=["all train", "dropout eval"])
def test_validate_test_predict_after_fit_match(tmp_path, dropout_eval):
    """``trainer.validate(model, dataloaders=)``, ``test`` and ``predict`` after ``fit`` against ``trainer.validate()``,
    ``test(data)``, ``predict(data)`` (docs/trainer.md's map): the same weights in both, the metrics (to 1e-6),
    the predictions bit for bit (dropout off), every module's mode after each as before it, and ``validate`` calling
    ``on_validation_end`` once more."""
    trainer, lit, port = fitted(tmp_path, dropout_eval)
    before = modes(lit.model)
    assert before == modes(port.model) and before[3] is not dropout_eval
    val = loader(n=6, seed=2)
    ends = lit.ends, port.ends
    theirs = trainer.validate(lit, dataloaders=val, verbose=False)[0]["val_loss"]
    assert modes(lit.model) == before and lit.ends == ends[0] + 1
    ours = port.validate()["val_loss"]
    assert modes(port.model) == before and port.ends == ends[1] + 1 and port.state.val_history[-1][0] == 6 * STEPS
    assert close(theirs, ours)
    tested = trainer.test(lit, dataloaders=val, verbose=False)[0]["test_loss"]
    assert close(tested, port.test(val)["test_loss"]) and modes(lit.model) == modes(port.model) == before
    predicted = trainer.predict(lit, dataloaders=val)
    ours = port.predict(val)
    assert modes(lit.model) == modes(port.model) == before
    assert len(predicted) == len(ours) == 3 and all(torch.equal(a, b) for a, b in zip(predicted, ours))
    assert_same(lit.model, port.model)


def test_test_without_a_model_after_fit_differs_as_documented(tmp_path):
    """``ModelCheckpoint(monitor="val_loss")`` / ``checkpoint={"monitor": "val_loss", "keep": 1}``, 6 epochs whose
    best validation is step 14's: Lightning's ``trainer.test(dataloaders=val)`` tests (and leaves in the model)
    step 14's weights; safeloop's ``trainer.test(val)`` tests the last, step 42's."""
    trainer, lit, port = fitted(tmp_path, monitor=True)
    val = loader(n=6, seed=2)
    last = trainer.test(lit, dataloaders=val, verbose=False)[0]["test_loss"]
    best = trainer.test(dataloaders=val, verbose=False)[0]["test_loss"]
    assert torch.load(port.checkpointer.best, weights_only=True)["step"] == 2 * STEPS
    assert not close(best, last)
    assert close(last, port.test(val)["test_loss"])  # the weights as they are


# -- clipping by value, a warm-up under accumulation


class LitGrads(Lit):
    def on_before_optimizer_step(self, optimizer):
        self.grads.append(self.model[0].weight.grad.clone())


class PortClipValue(Port):
    """docs/trainer.md's map: ``gradient_clip_algorithm="value"`` is ``clip_grad_value_`` in
    ``on_before_optimizer_step``."""

    grads: list

    def on_before_optimizer_step(self, name, optimizer):
        self.grads.append(self.model[0].weight.grad.clone())
        torch.nn.utils.clip_grad_value_(self.model.parameters(), 0.02)


@pytest.mark.parametrize("accum", [1, 3])
def test_gradient_clipping_by_value_matches(accum):
    """``gradient_clip_val=0.02, gradient_clip_algorithm="value"`` against the map's ``clip_grad_value_`` in
    ``on_before_optimizer_step``, with and without accumulation: the gradients the hook sees (before clipping in
    both, some above 0.02), the parameters."""
    lit = LitGrads()
    lit.grads = []
    lightning(max_epochs=EPOCHS, gradient_clip_val=0.02, gradient_clip_algorithm="value",
              accumulate_grad_batches=accum).fit(lit, train_dataloaders=loader())
    port = PortClipValue(model=net(), train_data=loader(), optimizer=adam, **settings(max_epochs=EPOCHS,
                                                                                        grad_accum=accum))
    port.grads = []
    port.fit()
    assert len(lit.grads) == len(port.grads) and all(torch.equal(a, b) for a, b in zip(lit.grads, port.grads))
    assert max(float(g.abs().max()) for g in port.grads) > 0.02
    assert_same(lit.model, port.model)


def warm_up(model):
    """AdamW with a linear warm-up over 4 updates (LambdaLR), stepped after every update."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda k: min(1.0, (k + 1) / 4))
    return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


class LitWarm(Lit):
    def on_before_optimizer_step(self, optimizer):
        self.lrs.append(optimizer.param_groups[0]["lr"])


class PortWarm(Port):
    lrs: list
    configure = staticmethod(warm_up)

    def on_before_optimizer_step(self, name, optimizer):
        self.lrs.append(optimizer.param_groups[0]["lr"])


@pytest.mark.parametrize("limit", [{"max_epochs": 2}, {"max_steps": 5}], ids=["max_epochs", "max_steps"])
def test_warm_up_per_update_under_accumulation_matches(limit):
    """LambdaLR with ``interval: "step"`` under ``accumulate_grad_batches=3`` / ``grad_accum=3`` (3 updates a pass,
    the last a tail of one): the scheduler steps once per update in both (``last_epoch`` at the end), the learning
    rate of every update, the parameters."""
    lit = LitWarm(configure=warm_up)
    lit.lrs = []
    lightning(accumulate_grad_batches=3, **limit).fit(lit, train_dataloaders=loader())
    port = PortWarm(model=net(), train_data=loader(), **settings(grad_accum=3, **limit))
    port.lrs = []
    port.fit()
    updates = 6 if "max_epochs" in limit else 5
    assert lit.lrs == port.lrs == [1e-2 * min(1.0, (k + 1) / 4) for k in range(updates)]
    assert lit.lr_schedulers().last_epoch == port.schedulers["optimizer"].last_epoch == updates
    assert_same(lit.model, port.model)


# -- manual optimization: two optimizers, one accumulating by hand


class LitAccumGAN(pl.LightningModule):
    """Lightning's manual optimization: D updated every batch, G's loss halved and G updated every second batch
    (``(batch_idx + 1) % 2 == 0``), its gradient carried over otherwise (across a pass's end too)."""

    def __init__(self):
        super().__init__()
        self.automatic_optimization = False
        self.gan, self.g_updates = GAN(), []

    def configure_optimizers(self):
        return [gan_adam(self.gan.d.parameters()), gan_adam(self.gan.g.parameters())]

    def training_step(self, batch, batch_idx):
        opt_d, opt_g = self.optimizers()
        (real,) = batch
        fake = self.gan.sample(len(real))
        self.toggle_optimizer(opt_d)
        self.manual_backward(d_loss_of(self.gan, real, fake))
        opt_d.step()
        opt_d.zero_grad()
        self.untoggle_optimizer(opt_d)
        self.toggle_optimizer(opt_g)
        self.manual_backward(g_loss_of(self.gan, fake) / 2)
        if (batch_idx + 1) % 2 == 0:
            opt_g.step()
            opt_g.zero_grad()
            self.g_updates.append((self.current_epoch, batch_idx))
        self.untoggle_optimizer(opt_g)


class PortAccumGAN(safeloop.Trainer):
    automatic = False
    g_updates: list

    def configure_optimizers(self):
        return {"d": gan_adam(self.model.d.parameters()), "g": gan_adam(self.model.g.parameters())}

    def training_step(self, batch):
        (real,) = batch
        fake = self.model.sample(len(real))
        d_loss = d_loss_of(self.model, real, fake)
        self.backward(d_loss, optimizer="d")
        self.step("d")
        g_loss = g_loss_of(self.model, fake) / 2
        self.backward(g_loss, optimizer="g")
        if self.state.batch_in_epoch % 2 == 0:
            self.step("g")
            self.g_updates.append((self.state.epoch, self.state.batch_in_epoch - 1))
        return {"d": d_loss, "g": g_loss}


def test_manual_accumulation_by_hand_with_two_optimizers_matches():
    """The two above, 3 passes of 5 batches: G updated after batches 1 and 3 of each pass, its fifth batch's
    gradient carried into the next pass's first update in both; G's and D's parameters, bit for bit."""
    lit = LitAccumGAN()
    trainer = lightning(max_epochs=3)
    torch.manual_seed(3)
    trainer.fit(lit, train_dataloaders=ring())
    port = PortAccumGAN(model=GAN(), train_data=ring(), **settings(max_epochs=3))
    port.g_updates = []
    torch.manual_seed(3)
    port.fit()
    assert lit.g_updates == port.g_updates == [(epoch, i) for epoch in range(3) for i in (1, 3)]
    assert trainer.global_step == 15 + 6 and port.state.step == 15  # optimizer steps / steps: docs/trainer.md's map
    assert_same(lit.gan, port.model)


# -- self.log in training_step: what the loggers get, at which step


class Recorder(pl.loggers.Logger):
    """A Lightning logger keeping ``(step, metrics)`` of each call."""

    def __init__(self):
        super().__init__()
        self.rows = []

    @property
    def name(self):
        return "recorder"

    @property
    def version(self):
        return 0

    def log_hyperparams(self, *args, **kwargs):
        """Nothing to keep: only the metrics and their steps are compared."""

    def log_metrics(self, metrics, step=None):
        self.rows.append((step, dict(metrics)))


class PlainRecorder:
    """safeloop's logger protocol: ``log_metrics(metrics, step)``."""

    def __init__(self):
        self.rows = []

    def log_metrics(self, metrics, step):
        self.rows.append((step, dict(metrics)))


class LitLogs(Lit):
    def training_step(self, batch, batch_idx):
        self.log("index", float(batch_idx))
        return super().training_step(batch, batch_idx)


class PortLogs(Port):
    def training_step(self, batch):
        self.log("index", float(self.state.batch_in_epoch - 1))
        return super().training_step(batch)


def logged_runs(accum):
    """``self.log("index", batch_idx)`` in ``training_step``, ``log_every_n_steps=3`` / ``log_every=3``, 2 passes of
    7 batches under accumulation ``accum``, validation each epoch: each logger's ``[(step, name, value)]``."""
    recorder = Recorder()
    lightning(max_epochs=EPOCHS, logger=recorder, log_every_n_steps=3, accumulate_grad_batches=accum).fit(
        LitLogs(), train_dataloaders=loader(), val_dataloaders=loader(n=4, seed=2))
    plain = PlainRecorder()
    updates = math.ceil(STEPS / accum)
    PortLogs(model=net(), train_data=loader(), val_data=loader(n=4, seed=2), optimizer=adam,
             **settings(max_epochs=EPOCHS, log_every=3, grad_accum=accum, val_every=updates, loggers=[plain])).fit()

    def rows(recorded, name):
        return [(step, metrics[name]) for step, metrics in recorded.rows if name in metrics]
    return {name: (rows(recorder, name), rows(plain, name)) for name in ("index", "val_loss")}, EPOCHS * updates


@pytest.mark.parametrize("accum", [1, 2])
def test_values_logged_in_training_step_match(accum):
    """The value each logger gets at each log point: the log step's (under accumulation, its last micro-batch's), at
    every third update in both; safeloop also logs the run's last step (docs/trainer.md, Loggers: "every log_every
    steps and at the run's last step"). The validation means, to 1e-6, with safeloop's before training."""
    logged, end = logged_runs(accum)
    theirs, ours = logged["index"]
    assert [v for _, v in theirs] == [v for s, v in ours if s != end] and len(theirs) == end // 3
    assert ours[-1][0] == end and end % 3
    theirs, ours = logged["val_loss"]
    assert ours[0][0] == 0 and len(theirs) == len(ours) - 1 == EPOCHS
    assert all(close(a, b) for (_, a), (_, b) in zip(theirs, ours[1:]))


@pytest.mark.parametrize("accum", [1, 2])
def test_steps_metrics_are_logged_at_differs_as_documented(accum):
    """The step each logger is given with ``self.log``'s value and with the validation metrics: Lightning's update 3
    is logged at step 2 (the validation after update 7 at step 6), safeloop's at step 3 (7): one later."""
    logged, end = logged_runs(accum)
    theirs, ours = logged["index"]
    assert theirs[0][0] == 2
    assert [s + 1 for s, _ in theirs] == [s for s, _ in ours if s != end]
    theirs, ours = logged["val_loss"]
    assert [s + 1 for s, _ in theirs] == [s for s, _ in ours[1:]]


class LitEpochLogs(Lit):
    def on_train_epoch_end(self):
        self.log("epoch_mark", float(self.current_epoch))


class PortEpochLogs(Port):
    def on_epoch_end(self):
        self.log("epoch_mark", float(self.state.epoch))


def test_values_logged_at_each_epoch_end_reach_the_loggers():
    """``self.log("epoch_mark", epoch)`` in ``on_train_epoch_end`` / ``on_epoch_end``, ``log_every_n_steps=1`` /
    ``log_every=1`` (so that no value is overwritten before a log point), 3 epochs: Lightning's logger gets 0, 1, 2
    (at steps 6, 13, 20); safeloop's gets 0 and 1 (at steps 8 and 15), and never 2."""
    recorder = Recorder()
    lightning(max_epochs=3, logger=recorder, log_every_n_steps=1).fit(LitEpochLogs(), train_dataloaders=loader())
    plain = PlainRecorder()
    PortEpochLogs(model=net(), train_data=loader(), optimizer=adam,
                  **settings(max_epochs=3, log_every=1, loggers=[plain])).fit()
    theirs = [m["epoch_mark"] for _, m in recorder.rows if "epoch_mark" in m]
    ours = [m["epoch_mark"] for _, m in plain.rows if "epoch_mark" in m]
    assert theirs == [0.0, 1.0, 2.0]
    assert ours == theirs


# -- max_epochs over an IterableDataset (no length)


class Stream(IterableDataset):
    """``dataset()``'s 14 samples, one by one: passes of 7 batches of 2, whose number no ``len`` tells."""

    def __iter__(self):
        yield from dataset()


class LitStream(Lit):
    def on_before_optimizer_step(self, optimizer):
        self.events.append(("update", self.trainer.global_step, optimizer.param_groups[0]["lr"]))

    def on_train_epoch_end(self):
        self.events.append(("epoch_end", self.trainer.global_step, self.optimizers().param_groups[0]["lr"]))

    def on_validation_end(self):
        self.events.append(("validation", self.trainer.global_step))


class PortStream(Port):
    events: list
    configure = staticmethod(step_lr_alone)

    def on_before_optimizer_step(self, name, optimizer):
        self.events.append(("update", self.state.step, optimizer.param_groups[0]["lr"]))

    def on_epoch_end(self):
        self.events.append(("epoch_end", self.state.step, self.optimizers["optimizer"].param_groups[0]["lr"]))

    def on_validation_end(self, metrics):
        self.events.append(("validation", self.state.step))


@pytest.mark.parametrize("accum", [1, 3])
def test_max_epochs_over_an_iterable_dataset_matches(accum):
    """``max_epochs=3`` over a DataLoader of an IterableDataset, a StepLR given alone (each epoch), validation each
    epoch (safeloop: ``val_every`` = one pass's updates), with and without accumulation (3: a tail of one at each
    pass's end, which neither knows before the pass runs out): every update's learning rate, each epoch's end and
    validation in order with its step, the step and epoch counters, the parameters (safeloop's validation before
    training aside)."""
    updates = math.ceil(STEPS / accum)
    lit = LitStream(configure=step_lr_alone)
    lit.events = []
    trainer = lightning(max_epochs=3, accumulate_grad_batches=accum)
    trainer.fit(lit, train_dataloaders=DataLoader(Stream(), batch_size=2), val_dataloaders=loader(n=4, seed=2))
    port = PortStream(model=net(), train_data=DataLoader(Stream(), batch_size=2), val_data=loader(n=4, seed=2),
                      **settings(max_epochs=3, val_every=updates, grad_accum=accum))
    port.events = []
    port.fit()
    assert port.events[0] == ("validation", 0)
    assert lit.events == port.events[1:]
    assert [e[1] for e in lit.events if e[0] == "epoch_end"] == [updates, 2 * updates, 3 * updates]
    assert (trainer.global_step, trainer.current_epoch) == (port.state.step, port.state.epoch) == (3 * updates, 3)
    assert_same(lit.model, port.model)


# -- on_load_checkpoint: before or after the checkpoint is loaded


class LitEdits(Lit):
    """Adds its own entry to each checkpoint; on loading, notes the bias the model holds then and zeroes the saved
    first bias in the checkpoint (an edit of an old checkpoint, as a hook that renames or converts entries does)."""

    def on_save_checkpoint(self, checkpoint):
        checkpoint["mine"] = torch.tensor(3.0)

    def on_load_checkpoint(self, checkpoint):
        self.seen = (float(checkpoint["mine"]), self.model[0].bias.detach().clone())
        checkpoint["state_dict"]["model.0.bias"].zero_()

    def on_train_start(self):
        self.started = self.model[0].bias.detach().clone()


class PortEdits(Port):
    seen = started = None

    def on_save_checkpoint(self, checkpoint):
        checkpoint["mine"] = torch.tensor(3.0)

    def on_load_checkpoint(self, checkpoint):
        self.seen = (float(checkpoint["mine"]), self.model[0].bias.detach().clone())
        checkpoint["modules"]["model"]["0.bias"].zero_()

    def on_fit_start(self):
        self.started = self.model[0].bias.detach().clone()


def test_on_load_checkpoint_edits_differs_as_documented(tmp_path):
    """Saved at step 7, resumed: both hooks get their own entry back. Lightning's runs while the model still holds
    its initial weights, and the zeroed bias is what training starts from; safeloop's runs once the trained weights
    are loaded (docs/trainer.md), and its edit of the dict changes nothing: training starts from the saved bias."""
    saver = pl.callbacks.ModelCheckpoint(dirpath=tmp_path / "lit", every_n_train_steps=STEPS, save_top_k=-1,
                                         filename="{step}")
    lightning(max_steps=STEPS, enable_checkpointing=True, callbacks=[saver]).fit(LitEdits(),
                                                                                 train_dataloaders=loader())
    lit = LitEdits()
    lightning(max_steps=STEPS + 1).fit(lit, train_dataloaders=loader(), ckpt_path=tmp_path / "lit" / "step=7.ckpt")
    PortEdits(model=net(), train_data=loader(), optimizer=adam, checkpoint={"dir": str(tmp_path / "sl"), "every": 7},
              **settings(max_steps=STEPS)).fit()
    port = PortEdits(model=net(), train_data=loader(), optimizer=adam,
                     **settings(max_steps=STEPS + 1, resume=str(tmp_path / "sl")))
    port.fit()
    assert lit.seen[0] == port.seen[0] == 3.0
    assert torch.equal(lit.seen[1], net()[0].bias) and torch.equal(lit.started, torch.zeros(8))
    saved = torch.load(tmp_path / "sl" / "step-000000007.pt")["modules"]["model"]["0.bias"]
    assert torch.equal(port.started, saved) and not torch.equal(saved, torch.zeros(8))


# -- empty data


def test_empty_validation_data_differs_loudly():
    """A ``val_data`` of no batches: Lightning trains, skipping every validation (with a warning); safeloop stops
    before training with a ConfigError naming it. Not silent, and not in the docs."""
    lit = Lit()
    trainer = lightning(max_epochs=EPOCHS)
    trainer.fit(lit, train_dataloaders=loader(), val_dataloaders=loader(n=0, seed=2))
    assert trainer.global_step == EPOCHS * STEPS
    port = Port(model=net(), train_data=loader(), val_data=loader(n=0, seed=2), optimizer=adam,
                **settings(max_epochs=EPOCHS, val_every=STEPS))
    with pytest.raises(safeloop.ConfigError, match="val_data yielded no batches"):
        port.fit()
    assert port.state.step == 0
    assert_same(net(), port.model)


def test_empty_training_data_differs_loudly():
    """A ``train_data`` of no batches: Lightning's fit ends at once ("No training batches"); safeloop's is a
    ConfigError naming it. Not silent, and not in the docs."""
    trainer = lightning(max_epochs=EPOCHS)
    trainer.fit(Lit(), train_dataloaders=loader(n=0))
    assert trainer.global_step == 0
    with pytest.raises(safeloop.ConfigError, match="train_data yielded no batches"):
        Port(model=net(), train_data=loader(n=0), optimizer=adam, **settings(max_epochs=EPOCHS)).fit()


# -- early stopping: validation every other epoch, a resumed run


def test_early_stopping_validating_every_other_epoch_matches():
    """``check_val_every_n_epoch=2`` / ``val_every`` = two passes' steps, ``patience=2``: ``patience`` counts
    validations in both; the step training stopped after, each validation's step and value, the parameters."""
    rule = {"monitor": "val_loss", "mode": "min", "patience": 2}
    lit = LitEarly(configure=lambda m: sgd(m.parameters(), 0.1))
    lit.val, lit.monitor = [], "val_loss"
    trainer = lightning(max_epochs=20, check_val_every_n_epoch=2, callbacks=[pl.callbacks.EarlyStopping(**rule)])
    trainer.fit(lit, train_dataloaders=loader(), val_dataloaders=loader(n=6, seed=2))
    port = PortEarly(model=net(), train_data=loader(), val_data=loader(n=6, seed=2),
                     optimizer=lambda p: sgd(p, 0.1), callbacks=[safeloop.EarlyStopping(**rule)],
                     **settings(max_epochs=20, val_every=2 * STEPS))
    port.val, port.monitor = [], "val_loss"
    port.fit()
    assert trainer.global_step == port.state.step < 20 * STEPS
    assert [s for s, _ in lit.val] == [s for s, _ in port.val[1:]] and len(lit.val) >= 3
    assert all(close(a, b) for (_, a), (_, b) in zip(lit.val, port.val[1:]))
    assert_same(lit.model, port.model)


def test_early_stopping_resumed_mid_count_matches(tmp_path):
    """``patience=3``, validation each epoch, SGD at 0.02: the best at step 21, then none better, a stop after step 42.
    Saved at step 28 (one validation without improvement counted), resumed by a new Trainer and callback: each
    framework stops after step 42 as its run that never stopped, with the same parameters (Lightning keeps the
    callback's state in its checkpoint, safeloop too)."""
    rule = {"monitor": "val_loss", "mode": "min", "patience": 3}

    def lit_run(**kwargs):
        lit = LitEarly(configure=lambda m: sgd(m.parameters(), 0.02))
        lit.val, lit.monitor = [], "val_loss"
        ckpt_path = kwargs.pop("ckpt_path", None)
        callbacks = [pl.callbacks.EarlyStopping(**rule)] + kwargs.pop("callbacks", [])  # the checkpoint's moved last
        trainer = lightning(**{"max_epochs": 20, "callbacks": callbacks, **kwargs})
        trainer.fit(lit, train_dataloaders=loader(), val_dataloaders=loader(n=6, seed=2), ckpt_path=ckpt_path)
        return trainer, lit

    def port_run(**kwargs):
        port = PortEarly(model=net(), train_data=loader(), val_data=loader(n=6, seed=2),
                         optimizer=lambda p: sgd(p, 0.02), callbacks=[safeloop.EarlyStopping(**rule)],
                         **settings(**{"max_epochs": 20, "val_every": STEPS, **kwargs}))
        port.val, port.monitor = [], "val_loss"
        port.fit()
        return port

    at = 4 * STEPS
    whole, lit = lit_run()
    saver = pl.callbacks.ModelCheckpoint(dirpath=tmp_path / "lit", every_n_epochs=1, save_top_k=-1, filename="{step}")
    lit_run(max_steps=at, enable_checkpointing=True, callbacks=[saver])
    resumed, lit2 = lit_run(ckpt_path=tmp_path / "lit" / f"step={at}.ckpt")
    ours = port_run()
    port_run(max_steps=at, checkpoint={"dir": str(tmp_path / "sl"), "every": at})
    ours2 = port_run(resume=str(tmp_path / "sl"))
    assert whole.global_step == resumed.global_step == ours.state.step == ours2.state.step == 6 * STEPS
    assert_same(lit.model, lit2.model)
    assert_same(ours.model, ours2.model)
    assert_same(lit.model, ours2.model)


# -- a plateau given alone, its monitor beside it


def plateau_alone(model):
    """Lightning's ``{"optimizer": opt, "lr_scheduler": plateau, "monitor": "val_loss"}`` (docs/trainer.md's map:
    "monitor" beside a plateau given alone); patience 0 and a large threshold, so that it reduces often."""
    opt = torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9)
    sched = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, factor=0.5, patience=0, threshold=0.2)
    return {"optimizer": opt, "lr_scheduler": sched, "monitor": "val_loss"}


def test_plateau_given_alone_with_its_monitor_matches():
    """4 epochs, validation each epoch: the learning rate of every update and the parameters."""
    lit = LitWarm(configure=plateau_alone)
    lit.lrs = []
    lightning(max_epochs=4).fit(lit, train_dataloaders=loader(), val_dataloaders=loader(n=6, seed=2))
    port = type("PortPlateau", (PortWarm,), {"configure": staticmethod(plateau_alone)})(
        model=net(), train_data=loader(), val_data=loader(n=6, seed=2), **settings(max_epochs=4, val_every=STEPS))
    port.lrs = []
    port.fit()
    assert lit.lrs == port.lrs and len(set(port.lrs)) > 2
    assert_same(lit.model, port.model)


def test_best_checkpoints_across_a_resume_match(tmp_path):
    """``ModelCheckpoint(monitor="val_loss", save_top_k=2)`` / ``checkpoint={"monitor": "val_loss", "keep": 2}``,
    6 epochs, stopped after 3 and resumed (Lightning from a second ModelCheckpoint's file of each epoch, safeloop
    with ``resume="auto"``): the best two kept are those of the run that never stopped (steps 14 and 28), in
    both, and so is the best (docs/checkpoints.md: "The ranking survives a resume")."""
    def lit_run(max_steps=-1, ckpt_path=None):
        best = pl.callbacks.ModelCheckpoint(dirpath=tmp_path / "lit", filename="{step}", monitor="val_loss",
                                            save_top_k=2)
        each = pl.callbacks.ModelCheckpoint(dirpath=tmp_path / "each", filename="{step}", save_top_k=-1)
        lightning(max_epochs=6, max_steps=max_steps, enable_checkpointing=True, callbacks=[best, each]).fit(
            LitScored(configure=lambda m: sgd(m.parameters())), train_dataloaders=loader(),
            val_dataloaders=loader(n=6, seed=2), ckpt_path=ckpt_path)
        return best

    def port_run(**kwargs):
        port = PortScored(model=net(), train_data=loader(), val_data=loader(n=6, seed=2), optimizer=sgd,
                          checkpoint={"dir": str(tmp_path / "sl"), "monitor": "val_loss", "keep": 2, "every": None},
                          **settings(max_epochs=6, val_every=STEPS, **kwargs))
        port.fit()
        return port

    lit_run(max_steps=3 * STEPS)
    best = lit_run(ckpt_path=tmp_path / "each" / f"step={3 * STEPS}.ckpt")
    port_run(max_steps=3 * STEPS)
    port = port_run(resume="auto")
    assert sorted(lightning_files(tmp_path / "lit").values()) == [2 * STEPS, 4 * STEPS]
    assert sorted(safeloop_files(tmp_path / "sl").values()) == [2 * STEPS, 4 * STEPS, 6 * STEPS]  # and the newest
    assert torch.load(best.best_model_path, weights_only=False)["global_step"] == 2 * STEPS
    assert torch.load(port.checkpointer.best, weights_only=True)["step"] == 2 * STEPS


# -- a second fit() of the same Trainer


class LitConfigured(Lit):
    """Counts its ``configure_optimizers`` calls; optimizes only the parameters that require gradients then."""

    configured = 0

    def configure_optimizers(self):
        self.configured += 1
        return adam(p for p in self.model.parameters() if p.requires_grad)


class PortConfigured(Port):
    configured = 0

    def configure_optimizers(self):
        self.configured += 1
        return adam(p for p in self.model.parameters() if p.requires_grad)


@pytest.mark.parametrize("unfreeze", [False, True], ids=["go on", "unfreeze the first layer"])
def test_a_second_fit_keeps_the_optimizers_differs_as_documented(unfreeze):
    """One epoch, then ``max_epochs`` raised to 2 (``trainer.fit_loop.max_epochs`` / ``trainer.max_epochs``) and
    ``fit()`` again on the same Trainer; with ``unfreeze``, the first layer frozen in the first fit and unfrozen
    before the second. Lightning's second fit counts on (step 14, epoch 2) with optimizers configured anew;
    safeloop's with the first fit's (docs/trainer.md), naming an unfrozen layer no optimizer holds."""
    lit = LitConfigured()
    port = PortConfigured(model=net(), train_data=loader(), **settings(max_epochs=1))
    for model in (lit.model, port.model):
        model[0].requires_grad_(not unfreeze)
    trainer = lightning(max_epochs=1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Lightning's: a module with frozen parameters
        trainer.fit(lit, train_dataloaders=loader())
    port.fit()
    assert_same(lit.model, port.model)
    frozen = port.model[0].weight.detach().clone()
    for model in (lit.model, port.model):
        model[0].requires_grad_(True)
    trainer.fit_loop.max_epochs = port.max_epochs = 2
    trainer.fit(lit, train_dataloaders=loader())
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        port.fit()
    assert (trainer.global_step, trainer.current_epoch) == (port.state.step, port.state.epoch) == (14, 2)
    assert not unfreeze or not torch.equal(lit.model[0].weight, frozen)
    assert (lit.configured, port.configured) == (2, 1)
    named = [w for w in seen if issubclass(w.category, safeloop.ConfigWarning) and "`model.0.weight`" in str(w.message)]
    assert len(named) == unfreeze
    assert torch.equal(port.model[0].weight, frozen) == unfreeze  # unfrozen, in no optimizer: not trained
    assert max_diff(lit.model, port.model) > 0  # Lightning's Adam starts again


# -- clipping under float16 with a GradScaler


def test_gradient_clipping_under_a_grad_scaler_matches():
    """float16 autocast with a GradScaler (Lightning's "16-mixed" forced on the CPU, safeloop's "16"), the loss large
    enough that the first steps overflow, and ``gradient_clip_val`` / ``grad_clip`` 0.05: the gradients are
    unscaled before the hook sees them and before clipping in both; the hook's gradients (NaN and inf where they
    overflowed), the parameters, the final scale."""
    from pytorch_lightning.plugins.precision import MixedPrecision

    lit = LitScaled()
    lit.dtypes, lit.losses, lit.grads = [], [], []
    plugin = MixedPrecision("16-mixed", "cpu", torch.amp.GradScaler("cpu"))
    lightning(max_epochs=EPOCHS, plugins=[plugin], gradient_clip_val=0.05).fit(lit, train_dataloaders=loader())
    port = PortScaled(model=net(), train_data=loader(), optimizer=adam,
                      **settings(max_epochs=EPOCHS, precision="16", grad_clip=0.05))
    port.dtypes, port.losses, port.grads = [], [], []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the scaler's skipped first update makes torch warn about the order
        port.fit()
    assert len(lit.grads) == len(port.grads) and all(
        torch.allclose(a, b, rtol=0, atol=0, equal_nan=True) for a, b in zip(lit.grads, port.grads))
    assert not all(g.isfinite().all() for g in port.grads)
    assert max(float(g.abs().max()) for g in port.grads if g.isfinite().all()) > 0.05
    assert plugin.scaler.get_scale() == port.scaler.get_scale() < 2.0 ** 16
    assert_same(lit.model, port.model)


def test_validate_outside_fit_does_not_count_for_early_stopping():
    """``patience=3``, SGD at 0.02 (the best at step 21), 5 epochs: each run ends with 2 validations counted without
    improvement. Then two ``validate()`` calls (the same weights: no improvement), ``max_epochs`` raised to 8 and
    ``fit()`` again: Lightning's count is still 2, its next validation (step 42) is the third, and it stops there."""
    rule = {"monitor": "val_loss", "mode": "min", "patience": 3}
    lit = LitEarly(configure=lambda m: sgd(m.parameters(), 0.02))
    lit.val, lit.monitor = [], "val_loss"
    theirs = pl.callbacks.EarlyStopping(**rule)
    trainer = lightning(max_epochs=5, callbacks=[theirs])
    trainer.fit(lit, train_dataloaders=loader(), val_dataloaders=loader(n=6, seed=2))
    ours = safeloop.EarlyStopping(**rule)
    port = PortEarly(model=net(), train_data=loader(), val_data=loader(n=6, seed=2), optimizer=lambda p: sgd(p, 0.02),
                     callbacks=[ours], **settings(max_epochs=5, val_every=STEPS))
    port.val, port.monitor = [], "val_loss"
    port.fit()
    assert theirs.wait_count == ours.wait == 2 and trainer.global_step == port.state.step == 5 * STEPS
    for _ in range(2):
        trainer.validate(lit, dataloaders=loader(n=6, seed=2), verbose=False)
        port.validate()
    assert theirs.wait_count == 2
    trainer.fit_loop.max_epochs = port.max_epochs = 8
    trainer.fit(lit, train_dataloaders=loader(), val_dataloaders=loader(n=6, seed=2))
    port.fit()
    assert trainer.global_step == 6 * STEPS and theirs.wait_count == 3
    assert ours.wait == 3
    assert port.state.step == 6 * STEPS  # (the parameters differ anyway: a second fit's optimizers, see below)


# -- Lightning's hook names that safeloop never calls


class LitEverywhere(Lit):
    """Tests and predicts too."""

    def test_step(self, batch, batch_idx):
        self.log("test_loss", mse(self.model, batch))

    def predict_step(self, batch, batch_idx):
        return self.model(batch[0])


def lightning_hook(base, name, calls):
    """``base``'s hook ``name``, also appending ``name`` to ``calls``; ``val_dataloader`` gives the validation data."""
    inherited = getattr(base, name)

    def hook(self, *args, **kwargs):
        calls.append(name)
        return loader(n=4, seed=2) if name == "val_dataloader" else inherited(self, *args, **kwargs)
    return hook


def calls_in_lightning(name, callback: bool) -> list:
    """The calls of Lightning's hook ``name`` (on the module, or on a callback) over fit, test and predict."""
    calls = []
    if callback:
        lit, cbs = LitEverywhere(), [type("Hooked", (pl.Callback,), {name: lightning_hook(pl.Callback, name, calls)})()]
    else:
        lit, cbs = type("Hooked", (LitEverywhere,), {name: lightning_hook(LitEverywhere, name, calls)})(), []
    trainer = lightning(max_steps=2, callbacks=cbs, enable_checkpointing=name == "state_dict")
    trainer.fit(lit, train_dataloaders=loader(n=4),
                val_dataloaders=None if name == "val_dataloader" else loader(n=4, seed=2))
    trainer.test(lit, dataloaders=loader(n=4, seed=2), verbose=False)
    trainer.predict(lit, dataloaders=loader(n=4, seed=2))
    return calls


MODULE_NAMES = ["on_before_batch_transfer", "transfer_batch_to_device", "on_after_batch_transfer",
                "on_validation_start", "on_validation_epoch_start", "on_validation_batch_start",
                "on_validation_batch_end", "on_validation_model_eval", "on_validation_model_train", "on_test_start",
                "on_test_epoch_end", "on_test_end", "on_predict_start", "on_predict_batch_end", "on_predict_end",
                "prepare_data", "teardown", "configure_model", "val_dataloader"]
CALLBACK_NAMES = ["on_validation_start", "on_validation_epoch_start", "on_validation_batch_end", "on_test_epoch_end",
                  "on_predict_end", "setup", "teardown", "state_dict"]


@pytest.mark.parametrize("where, name", [("module", n) for n in MODULE_NAMES]
                         + [("callback", n) for n in CALLBACK_NAMES])
def test_lightning_hook_names_are_called_or_refused(tmp_path, where, name):
    """Each hook Lightning calls in a fit with validation, a test and a predict (asserted first), kept under its
    Lightning name on the port (the Trainer subclass or a callback): safeloop either calls it or refuses it with a
    ConfigError naming it, as the docs promise; none of these is either."""
    assert name in calls_in_lightning(name, where == "callback")
    calls = []

    def hook(self, *args, **kwargs):
        calls.append(name)
        return args[-1] if args else None
    callbacks = [type("Hooked", (safeloop.Callback,), {name: hook})()] if where == "callback" else []
    cls = type("Hooked", (Port,), {name: hook}) if where == "module" else Port
    try:
        port = cls(model=net(), train_data=loader(n=4), val_data=loader(n=4, seed=2), optimizer=adam,
                   callbacks=callbacks, checkpoint={"dir": str(tmp_path), "every": 1},
                   **settings(max_steps=2, val_every=1))
        port.fit()
        port.test(loader(n=4, seed=2))
        port.predict(loader(n=4, seed=2))
    except safeloop.ConfigError as err:
        assert name in str(err)
        return
    assert name in calls


class LitScaledInput(Lit):
    def on_after_batch_transfer(self, batch, dataloader_idx):
        x, y = batch
        return 2 * x, y  # a transform on the device (normalization, a GPU augmentation)


class PortScaledInput(Port):
    def on_after_batch_transfer(self, batch, dataloader_idx):
        x, y = batch
        return 2 * x, y


def test_on_after_batch_transfer_kept_on_a_port_is_refused():
    """A batch transform in ``on_after_batch_transfer`` (its input doubled): Lightning trains on the transformed
    batches; kept on the port, it is a ConfigError before the first step, saying where the transform goes."""
    lit = LitScaledInput()
    lightning(max_epochs=EPOCHS).fit(lit, train_dataloaders=loader())
    port = PortScaledInput(model=net(), train_data=loader(), optimizer=adam, **settings(max_epochs=EPOCHS))
    with pytest.raises(safeloop.ConfigError, match=r"PortScaledInput\.on_after_batch_transfer is Lightning's name, "
                                                   r"which safeloop never calls: change the batch in training_step"):
        port.fit()
    assert port.state.step == 0


# -- val_check_interval with Lightning's default check_val_every_n_epoch


def test_val_check_interval_within_each_epoch_differs_as_documented():
    """``val_check_interval=3`` (``check_val_every_n_epoch`` left at 1) against ``val_every=3``, 3 passes of 7
    batches: Lightning's count starts again at each epoch, safeloop's goes on across passes (docs/trainer.md's map)."""
    lit = LitValidated()
    lit.validated = []
    lightning(max_epochs=3, val_check_interval=3).fit(lit, train_dataloaders=loader(),
                                                      val_dataloaders=loader(n=4, seed=2))
    port = PortValidated(model=net(), train_data=loader(), val_data=loader(n=4, seed=2), optimizer=adam,
                         **settings(max_epochs=3, val_every=3))
    port.validated = []
    port.fit()
    assert lit.validated == [3, 6, 10, 13, 17, 20]
    assert port.validated == [0, 3, 6, 9, 12, 15, 18, 21]


class LitSkips(Lit):
    def training_step(self, batch, batch_idx):
        return None if batch_idx == 2 else super().training_step(batch, batch_idx)


class PortSkips(Port):
    def training_step(self, batch):
        return None if self.state.batch_in_epoch == 3 else super().training_step(batch)


def test_training_step_returning_none_differs_loudly():
    """Lightning's automatic optimization skips the update of a batch whose ``training_step`` returns None (its
    docs: "return None to skip to the next batch"); safeloop stops at that step with a StepError asking for the
    loss. Not silent, and not in docs/trainer.md's map."""
    trainer = lightning(max_epochs=1)
    trainer.fit(LitSkips(), train_dataloaders=loader())
    assert trainer.global_step == STEPS
    port = PortSkips(model=net(), train_data=loader(), optimizer=adam, **settings(max_epochs=1))
    with pytest.raises(safeloop.StepError, match="step 3: training_step returned None"):
        port.fit()
    assert port.state.step == 2


# -- what on_validation_end sees


class LitMetrics(Lit):
    def training_step(self, batch, batch_idx):
        self.log("index", float(batch_idx))
        return super().training_step(batch, batch_idx)

    def validation_step(self, batch, batch_idx):
        loss = mse(self.model, batch)
        self.log("val_loss", loss)
        self.log("val_mae", F.l1_loss(self.model(batch[0]), batch[1]))


class LitMetricsCallback(pl.Callback):
    def __init__(self):
        self.seen = []

    def on_validation_end(self, trainer, pl_module):
        self.seen.append({k: float(v) for k, v in trainer.callback_metrics.items()})


class PortMetrics(Port):
    def training_step(self, batch):
        self.log("index", float(self.state.batch_in_epoch - 1))
        return super().training_step(batch)

    def validation_step(self, batch):
        self.log("val_mae", F.l1_loss(self.model(batch[0]), batch[1]))
        return mse(self.model, batch)


class PortMetricsCallback(safeloop.Callback):
    def __init__(self):
        self.seen = []

    def on_validation_end(self, trainer, metrics):
        self.seen.append(dict(metrics))


def test_metrics_on_validation_end_match():
    """A callback's ``on_validation_end``: Lightning's ``trainer.callback_metrics`` against safeloop's ``metrics``
    (docs/trainer.md's map), validation every 3 batches over 2 epochs, a returned loss and a ``self.log`` in
    ``validation_step``: the same validation metrics, their means to 1e-6 (safeloop's validation before training
    aside). Lightning's also hold what ``training_step`` logged; safeloop's hold the validation's only (docs/trainer.md,
    Validation: the pass's metrics)."""
    theirs = LitMetricsCallback()
    lightning(max_epochs=EPOCHS, val_check_interval=3, check_val_every_n_epoch=None, callbacks=[theirs]).fit(
        LitMetrics(), train_dataloaders=loader(), val_dataloaders=loader(n=5, batch=2, seed=2))
    ours = PortMetricsCallback()
    PortMetrics(model=net(), train_data=loader(), val_data=loader(n=5, batch=2, seed=2), optimizer=adam,
                callbacks=[ours], **settings(max_epochs=EPOCHS, val_every=3)).fit()
    ours.seen = ours.seen[1:-1]  # before training; at the end (step 14)
    assert len(theirs.seen) == len(ours.seen) == 4
    assert all(set(t) == {"index", "val_loss", "val_mae"} and set(o) == {"val_loss", "val_mae"}
               for t, o in zip(theirs.seen, ours.seen))
    assert all(close(t[k], o[k]) for t, o in zip(theirs.seen, ours.seen) for k in o)


# -- the samples a batch counts for in a validation mean


def with_a_scalar_first(samples):
    """A collate giving ``(a 0-dim tensor, x, y)``: a scalar ahead of the per-sample tensors (a weight, a count)."""
    x, y = torch.utils.data.default_collate(samples)
    return torch.tensor(1.0), x, y


class LitScalarFirst(Lit):
    def validation_step(self, batch, batch_idx):
        self.log("val_loss", mse(self.model, batch[1:]))

    def on_validation_end(self):
        self.val.append(float(self.trainer.callback_metrics["val_loss"]))


class PortScalarFirst(Port):
    def validation_step(self, batch):
        return mse(self.model, batch[1:])


def test_validation_mean_with_a_scalar_first_in_the_batch_differs_as_documented():
    """Validation batches ``(scalar, x, y)`` of 3, 3 and 1 samples, one epoch: Lightning weighs each batch once (the
    mean of the batch means: 0.8394, with its warning of an ambiguous batch size); safeloop each sample once
    (1.0381), without a word."""
    val = DataLoader(dataset(7, seed=2), batch_size=3, collate_fn=with_a_scalar_first)
    lit = LitScalarFirst()
    lit.val = []
    lightning(max_epochs=1).fit(lit, train_dataloaders=loader(), val_dataloaders=val)
    port = PortScalarFirst(model=net(), train_data=loader(), val_data=val, optimizer=adam,
                           **settings(max_epochs=1, val_every=STEPS))
    port.fit()
    assert_same(lit.model, port.model)
    with torch.no_grad():
        means = [float(mse(port.model, batch[1:])) for batch in val]
    assert close(lit.val[0], sum(means) / 3)
    assert close(port.state.val_history[-1][1]["val_loss"], (3 * means[0] + 3 * means[1] + means[2]) / 7)


# -- float16 with a GradScaler in manual optimization, two optimizers


def test_gan_float16_with_a_grad_scaler_differs_as_documented():
    """The GAN of ``test_parity.py`` in manual optimization, float16 autocast with a GradScaler (Lightning's
    "16-mixed" forced on the CPU, safeloop's "16"), 2 epochs (10 steps, 20 optimizer steps): the scaler's state
    (its growth tracker: 20 in Lightning, 10 here) and the parameters (D's differ by up to 1.2e-6: D, applied to the
    real and the fake batch, has its gradients summed in float16 through autocast's cached weights here; see the
    next test)."""
    from pytorch_lightning.plugins.precision import MixedPrecision

    plugin = MixedPrecision("16-mixed", "cpu", torch.amp.GradScaler("cpu"))
    lit = LitGAN()
    trainer = lightning(max_epochs=EPOCHS, plugins=[plugin])
    torch.manual_seed(3)
    trainer.fit(lit, train_dataloaders=ring())
    port = PortGAN(model=GAN(), train_data=ring(), **settings(max_epochs=EPOCHS, precision="16"))
    port.calls, port.lrs = [], []
    torch.manual_seed(3)
    port.fit()
    assert plugin.scaler.get_scale() == port.scaler.get_scale() == 2.0 ** 16
    assert (plugin.scaler.state_dict()["_growth_tracker"], port.scaler.state_dict()["_growth_tracker"]) == (20, 10)
    assert 0 < max_diff(lit.gan, port.model) < 1e-5


class Twice(nn.Module):
    """One linear layer applied twice (weights used twice in a forward: an RNN's steps, tied embeddings, a
    discriminator on real and fake)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.inner, self.head = nn.Linear(6, 6), nn.Linear(6, 1)

    def forward(self, x):
        return self.head(torch.tanh(self.inner(torch.tanh(self.inner(x)))))


def test_bf16_mixed_with_a_weight_used_twice_differs_as_documented():
    """``precision="bf16-mixed"``, a layer applied twice in the forward, 2 epochs of Adam: the parameters (they
    differ in the last bits: each weight's gradient is rounded to bfloat16 once more here)."""
    lit = Lit(Twice())
    lightning(max_epochs=EPOCHS, precision="bf16-mixed").fit(lit, train_dataloaders=loader())
    port = Port(model=Twice(), train_data=loader(), optimizer=adam, **settings(max_epochs=EPOCHS,
                                                                               precision="bf16-mixed"))
    port.fit()
    assert 0 < max_diff(lit.model, port.model) < 1e-3  # the last bits


# -- stopping from a callback


def test_should_stop_matches():
    """docs/trainer.md's map: ``trainer.should_stop = True`` is ``trainer.request_stop(reason)``. A callback that
    sets it after step 3: Lightning stops there; a safeloop callback that keeps the assignment too, as one that
    calls ``request_stop``."""
    class LitStopper(pl.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if trainer.global_step == 3:
                trainer.should_stop = True

    class Kept(safeloop.Callback):
        def on_step_end(self, trainer, losses):
            if trainer.state.step == 3:
                trainer.should_stop = True

    class Ported(safeloop.Callback):
        def on_step_end(self, trainer, losses):
            if trainer.state.step == 3:
                trainer.request_stop("asked")

    trainer = lightning(max_epochs=EPOCHS, callbacks=[LitStopper()])
    trainer.fit(Lit(), train_dataloaders=loader())
    assert trainer.global_step == 3
    steps = []
    for callback in (Kept(), Ported()):
        port = Port(model=net(), train_data=loader(), optimizer=adam, callbacks=[callback],
                    **settings(max_epochs=EPOCHS))
        port.fit()
        steps.append(port.state.step)
    assert steps == [3, 3]


# -- bf16-true: tensors a step makes


class LitMade(Lit):
    def training_step(self, batch, batch_idx):
        x, y = batch
        out = self.model(x)
        self.dtypes.add(torch.zeros(1).dtype)
        return F.mse_loss(out, y) + 0.1 * (out - torch.full((len(x), 1), 0.5)).pow(2).mean()


class PortMade(Port):
    dtypes: set

    def training_step(self, batch):
        x, y = batch
        out = self.model(x)
        self.dtypes.add(torch.zeros(1).dtype)
        return F.mse_loss(out, y) + 0.1 * (out - torch.full((len(x), 1), 0.5)).pow(2).mean()


def test_tensors_made_in_a_bf16_true_step_differs_as_documented():
    """docs/trainer.md (Precision): under ``"bf16-true"`` "Tensors a step makes itself are float32 unless it says
    dtype=". Lightning's step runs with bfloat16 as the default dtype (its HalfPrecision.forward_context): a target
    made with ``torch.full`` is bfloat16 there, float32 here, where its loss term is computed in float32, and the
    parameters differ (by 0.002 after 2 epochs). The docs do not say that Lightning's are bfloat16. (The term is
    written out: torch 2.11's ``mse_loss`` of a bfloat16 and a float32 tensor fails in its backward.)"""
    lit = LitMade()
    lit.dtypes = set()
    lightning(max_epochs=EPOCHS, precision="bf16-true").fit(lit, train_dataloaders=loader())
    port = PortMade(model=net(), train_data=loader(), optimizer=adam, **settings(max_epochs=EPOCHS,
                                                                                  precision="bf16-true"))
    port.dtypes = set()
    port.fit()
    assert lit.dtypes == {torch.bfloat16} and port.dtypes == {torch.float32}
    assert max_diff(lit.model, port.model) > 1e-3


# -- early stopping with nothing to check it


@pytest.mark.parametrize("validation", ["no val_data", "no val_every"])
def test_early_stopping_without_validation_during_training_is_refused(validation):
    """``EarlyStopping(monitor="val_loss", patience=1)``, SGD at 0.1, 10 epochs. Lightning without validation data
    stops at its first epoch's end with a RuntimeError (the metric is not available); with it, it validates each
    epoch and stops after step 14. safeloop with ``val_data`` and no ``val_every``, or with no ``val_data``, trains
    all 70 steps."""
    def lit_run(**data):
        trainer = lightning(max_epochs=10, callbacks=[pl.callbacks.EarlyStopping(monitor="val_loss", patience=1)])
        trainer.fit(Lit(configure=lambda m: sgd(m.parameters(), 0.1)), train_dataloaders=loader(), **data)
        return trainer

    if validation == "no val_data":
        with pytest.raises(RuntimeError, match="Early stopping conditioned on metric `val_loss` which is not"):
            lit_run()
    else:
        assert lit_run(val_dataloaders=loader(n=6, seed=2)).global_step == 2 * STEPS
    val = {} if validation == "no val_data" else {"val_data": loader(n=6, seed=2)}
    port = Port(model=net(), train_data=loader(), optimizer=lambda p: sgd(p, 0.1),
                callbacks=[safeloop.EarlyStopping(monitor="val_loss", patience=1)], **val, **settings(max_epochs=10))
    with pytest.raises(safeloop.ConfigError, match="EarlyStopping"):
        port.fit()


def test_max_steps_at_the_end_of_an_iterable_pass_differs_as_documented():
    """docs/trainer.md (Hooks): where ``max_steps`` ends a run right after a pass's last batch, the pass ends with the
    run "when train_data's length is known ... Otherwise it ends when training goes on". ``max_steps=7`` over an
    IterableDataset of 7 batches: Lightning, which looks one batch ahead, ends the epoch (its StepLR steps, its
    epoch-end hook runs); safeloop's run ends without it, and a second ``fit()`` to step 8 ends the pass first."""
    lit = LitStream(configure=step_lr_alone)
    lit.events = []
    trainer = lightning(max_steps=STEPS)
    trainer.fit(lit, train_dataloaders=DataLoader(Stream(), batch_size=2))
    port = PortStream(model=net(), train_data=DataLoader(Stream(), batch_size=2), **settings(max_steps=STEPS))
    port.events = []
    port.fit()
    assert lit.events[-1] == ("epoch_end", STEPS, 0.025) and trainer.current_epoch == 1
    assert port.events[-1] == ("update", STEPS - 1, 0.05) and port.state.epoch == 0  # (the step before it)
    assert_same(lit.model, port.model)
    port.max_steps = STEPS + 1
    port.fit()
    assert port.events[-2:] == [("epoch_end", STEPS, 0.025), ("update", STEPS, 0.025)]


# -- a module kept beside the model: what a checkpoint holds


def ema_update(ema, model):
    with torch.no_grad():
        for average, p in zip(ema.parameters(), model.parameters()):
            average.lerp_(p, 0.1)


class LitEma(Lit):
    def __init__(self):
        super().__init__()
        self.ema = copy.deepcopy(self.model).requires_grad_(False)

    def on_train_batch_end(self, outputs, batch, batch_idx):
        ema_update(self.ema, self.model)


class PortEma(Port):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.ema = copy.deepcopy(self.model).requires_grad_(False)

    def on_step_end(self, losses):
        ema_update(self.ema, self.model)


class PortEmaSaved(PortEma):
    def modules(self):
        return {**super().modules(), "ema": self.ema}


def test_a_module_kept_beside_the_model_in_a_checkpoint_differs_as_documented(tmp_path):
    """Lightning saves every submodule: an EMA kept on the LightningModule resumes as it was. safeloop's checkpoints
    hold ``modules()``: an EMA kept on the Trainer is named at the save and resumes from its first values; returned
    from ``modules()``, it resumes as Lightning's (docs/trainer.md, "Also different")."""
    straight = LitEma()
    lightning(max_epochs=EPOCHS).fit(straight, train_dataloaders=loader())
    half, trainer = LitEma(), lightning(max_epochs=1)
    trainer.fit(half, train_dataloaders=loader())
    trainer.save_checkpoint(tmp_path / "half.ckpt")
    resumed = LitEma()
    lightning(max_epochs=EPOCHS).fit(resumed, train_dataloaders=loader(), ckpt_path=tmp_path / "half.ckpt")
    assert_same(straight.ema, resumed.ema)

    def port(cls, steps, directory, **kwargs):
        trainer = cls(model=net(), train_data=loader(), optimizer=adam, checkpoint={"dir": str(tmp_path / directory)},
                      **settings(max_steps=steps, **kwargs))
        trainer.fit()
        return trainer

    assert_same(straight.ema, port(PortEma, 2 * STEPS, "straight").ema)
    unsaved = r"trainer\.ema \(Sequential\) changed during this fit, and checkpoints do not hold it"
    with pytest.warns(safeloop.ConfigWarning, match=unsaved):
        port(PortEma, STEPS, "kept")
    with pytest.warns(safeloop.ConfigWarning, match=unsaved):
        restarted = port(PortEma, 2 * STEPS, "kept", resume="auto")
    assert not torch.equal(restarted.ema[0].weight, straight.ema[0].weight)
    assert_same(straight.model, restarted.model)  # the model resumes as it was
    port(PortEmaSaved, STEPS, "saved")
    assert_same(straight.ema, port(PortEmaSaved, 2 * STEPS, "saved", resume="auto").ema)
