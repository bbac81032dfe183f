"""safeloop's Trainer against pytorch-lightning's, bit for bit: accumulation with clipping and a per-step schedule,
``max_steps`` with ``max_epochs``, the gradients hooks see (a GradScaler, manual mode), manual clipping and schedules,
the validation at a run's end, best checkpoints (ties, NaN), checkpoints under accumulation, resuming (accumulation,
a best checkpoint, a GradScaler, after an early stop), early stopping's other options, ``self.log``'s keywords,
logged test metrics.

As in ``test_parity.py``: each test trains the same tiny seeded model with ``pytorch_lightning.Trainer`` and with
its port to ``safeloop.Trainer``; ``..._matches`` tests compare what a user relies on, ``..._differs_as_documented``
tests assert a difference the docs state, exactly. A difference the docs do not state is a test asserting
Lightning's behaviour, marked ``xfail(strict=True)`` with the reason, until it is fixed or documented.
"""
import math

import pytest
import torch
import torch.nn.functional as F

pl = pytest.importorskip("pytorch_lightning")

import safeloop  # noqa: E402

from .common import (Lit, Port, adam, assert_same, close, lightning, loader, max_diff, mse, net, settings,  # noqa: E402
                     saved_and_resumed, sgd)
from .test_parity2 import checkpointed_runs, lightning_files, safeloop_files  # noqa: E402

EPOCHS, STEPS = 2, 7  # passes of 7 batches by default
pytestmark = pytest.mark.filterwarnings("ignore::Warning:pytorch_lightning", "ignore::Warning:lightning_fabric")


def lr_of(optimizer) -> float:
    return optimizer.param_groups[0]["lr"]


def warm_up(model):
    """SGD with momentum and a LambdaLR warm-up stepped after every update (``interval: step``)."""
    opt = sgd(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda k: min(1.0, (k + 1) / 4))
    return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


# -- accumulation with clipping and a per-step schedule, a short last window in each pass


class LitGrads(Lit):
    """The gradient norm ``on_after_backward`` and ``on_before_optimizer_step`` see, and the learning rate at
    each update."""

    def on_after_backward(self):
        self.after.append(norm(self.model))

    def on_before_optimizer_step(self, optimizer):
        self.before.append(norm(self.model))
        self.lrs.append(lr_of(optimizer))


class PortGrads(Port):
    after: list
    before: list
    lrs: list

    def on_after_backward(self, name):
        self.after.append(norm(self.model))

    def on_before_optimizer_step(self, name, optimizer):
        self.before.append(norm(self.model))
        self.lrs.append(lr_of(optimizer))


def norm(model) -> torch.Tensor:
    return torch.stack([p.grad.norm() for p in model.parameters() if p.grad is not None]).norm()


def grads_runs(accum, clip, configure=warm_up, **limits):
    lit = LitGrads(configure=configure)
    lit.after, lit.before, lit.lrs = [], [], []
    trainer = lightning(accumulate_grad_batches=accum, gradient_clip_val=clip, **limits)
    trainer.fit(lit, train_dataloaders=loader())
    port = PortGrads(model=net(), train_data=loader(), **settings(grad_accum=accum, grad_clip=clip, **limits))
    port.configure = staticmethod(configure)
    port.after, port.before, port.lrs = [], [], []
    port.fit()
    return trainer, lit, port


@pytest.mark.parametrize("accum, clip", [(1, 0.05), (3, 0.05), (3, None)])
def test_accumulation_clipping_and_a_per_step_warm_up_match(accum, clip):
    """``accumulate_grad_batches=3``, ``gradient_clip_val=0.05`` and a LambdaLR warm-up with ``interval: step``,
    over 2 passes of 7 batches (updates of 3, 3 and a last window of 1 in each pass): the parameters, the number of
    updates, the learning rate of each update, and the gradient norms ``on_after_backward`` (each micro-batch) and
    ``on_before_optimizer_step`` (before clipping) see, bit for bit."""
    trainer, lit, port = grads_runs(accum, clip, max_epochs=EPOCHS)
    updates = EPOCHS * (STEPS if accum == 1 else 3)
    assert trainer.global_step == port.state.step == updates
    assert lit.lrs == port.lrs and len(lit.lrs) == updates
    assert len(lit.after) == len(port.after) == EPOCHS * STEPS
    assert torch.equal(torch.stack(lit.after), torch.stack(port.after))
    assert torch.equal(torch.stack(lit.before), torch.stack(port.before))
    if clip is not None:
        assert max(float(n) for n in port.before) > clip  # the clipping acted
    assert_same(lit.model, port.model)


# -- max_steps and max_epochs together


@pytest.mark.parametrize("max_epochs, max_steps, accum, expected", [
    (2, 10, 1, 10), (1, 100, 1, 7), (3, 5, 3, 5), (2, 100, 3, 6)],
    ids=["steps first", "epochs first", "steps first, accumulating", "epochs first, accumulating"])
def test_max_steps_with_max_epochs_matches(max_epochs, max_steps, accum, expected):
    """Both limits given: training ends at whichever comes first, counted in updates (accumulation: 3 a pass)."""
    trainer, lit, port = grads_runs(accum, None, max_epochs=max_epochs, max_steps=max_steps)
    assert trainer.global_step == port.state.step == expected
    assert lit.lrs == port.lrs
    assert_same(lit.model, port.model)


# -- manual optimization: clip_gradients and a scheduler stepped by hand


class LitManual(Lit):
    """Lightning's manual optimization as its docs show it: ``manual_backward``, ``self.clip_gradients``, the
    optimizer's step and ``zero_grad``, the scheduler from ``self.lr_schedulers()`` stepped by hand each batch."""

    def __init__(self, clip):
        super().__init__(configure=warm_up)
        self.automatic_optimization = False
        self.clip, self.lrs, self.before = clip, [], []

    def training_step(self, batch, batch_idx):
        opt, sch = self.optimizers(), self.lr_schedulers()
        loss = mse(self.model, batch)
        self.manual_backward(loss)
        self.before.append(norm(self.model))
        if self.clip is not None:
            self.clip_gradients(opt, gradient_clip_val=self.clip, gradient_clip_algorithm="norm")
        self.lrs.append(lr_of(opt))
        opt.step()
        opt.zero_grad()
        sch.step()
        return loss


class PortManual(Port):
    """The port: ``self.backward``, ``self.step()`` (which clips by ``grad_clip`` and steps the scheduler)."""

    automatic = False
    configure = staticmethod(warm_up)
    lrs: list
    before: list

    def training_step(self, batch):
        loss = mse(self.model, batch)
        self.backward(loss)
        self.step()
        return loss

    def on_before_optimizer_step(self, name, optimizer):
        self.before.append(norm(self.model))
        self.lrs.append(lr_of(optimizer))


@pytest.mark.parametrize("clip", [None, 0.05])
def test_manual_clip_gradients_and_a_scheduler_stepped_by_hand_match(clip):
    """Manual optimization, 2 passes, a LambdaLR warm-up: Lightning's ``self.clip_gradients(opt, 0.05, "norm")`` and
    ``sch.step()`` by hand against ``grad_clip=0.05`` and the scheduler the Trainer steps (docs/trainer.md's map):
    the learning rate of each update, the gradient norm before clipping, the parameters."""
    lit = LitManual(clip)
    trainer = lightning(max_epochs=EPOCHS)
    trainer.fit(lit, train_dataloaders=loader())
    port = PortManual(model=net(), train_data=loader(), **settings(max_epochs=EPOCHS, grad_clip=clip))
    port.lrs, port.before = [], []
    port.fit()
    assert trainer.global_step == port.state.step == EPOCHS * STEPS
    assert lit.lrs == port.lrs and lit.lrs[0] < lit.lrs[-1]
    assert torch.equal(torch.stack(lit.before), torch.stack(port.before))
    assert_same(lit.model, port.model)


# -- the validation at a run's end, and the best checkpoint


class LitValEnd(Lit):
    def on_validation_end(self):
        self.val.append(self.trainer.global_step)


class PortValEnd(Port):
    val: list

    def on_validation_end(self, metrics):
        self.val.append(self.state.step)


def validated_runs(tmp_path, **limits):
    """``check_val_every_n_epoch=2`` against ``val_every`` = two passes' steps, SGD at 0.02 (validation loss 1.236 at
    step 14, 0.9089 at 17, 0.7232 at 21, 1.109 at 28), ``ModelCheckpoint(monitor="val_loss", save_top_k=1)`` against
    ``checkpoint={"monitor": "val_loss", "keep": 1}``: the steps each validated at (safeloop's before training left
    out), and the best checkpoint's step."""
    cb = pl.callbacks.ModelCheckpoint(dirpath=tmp_path / "lit", filename="{step}", monitor="val_loss", save_top_k=1)
    lit = LitValEnd(configure=lambda m: sgd(m.parameters(), 0.02))
    lit.val = []
    trainer = lightning(check_val_every_n_epoch=2, enable_checkpointing=True, callbacks=[cb], **limits)
    trainer.fit(lit, train_dataloaders=loader(), val_dataloaders=loader(n=6, seed=2))
    port = PortValEnd(model=net(), train_data=loader(), val_data=loader(n=6, seed=2),
                      optimizer=lambda p: sgd(p, 0.02),
                      checkpoint={"dir": str(tmp_path / "sl"), "monitor": "val_loss", "keep": 1, "every": None},
                      **settings(val_every=2 * STEPS, **limits))
    port.val = []
    port.fit()
    assert_same(lit.model, port.model)
    best = (torch.load(cb.best_model_path, weights_only=False)["global_step"],
            torch.load(port.checkpointer.best, weights_only=True)["step"])
    return lit.val, port.val[1:], best


@pytest.mark.parametrize("limits", [{"max_epochs": 3}, {"max_steps": 17}], ids=["max_epochs", "max_steps"])
def test_validation_at_the_end_of_a_run_and_the_best_checkpoint_differs_as_documented(tmp_path, limits):
    """Validation every other epoch over 3 epochs (or 17 steps): Lightning validates after step 14 only, and its best
    checkpoint is step 14's (1.236). safeloop validates after step 14 and again at the run's end (step 21: 0.7232, or
    17: 0.9089) and ranks that checkpoint best: a port's ``best`` holds weights Lightning's run never measured."""
    theirs, ours, best = validated_runs(tmp_path, **limits)
    end = 21 if "max_epochs" in limits else 17
    assert theirs == [14] and best[0] == 14
    assert ours == [14, end] and best[1] == end


def test_validation_at_the_end_of_a_run_when_due_matches(tmp_path):
    """Validation every other epoch over 4 epochs: the end of the run is a validation's step in both, no other
    validation is added, and the best checkpoint is the same step (28)."""
    theirs, ours, best = validated_runs(tmp_path, max_epochs=4)
    assert theirs == ours == [14, 28]
    assert best[0] == best[1] == 28


# -- the gradients on_after_backward sees under a GradScaler


class LitScaledGrads(LitGrads):
    def training_step(self, batch, batch_idx):
        return mse(self.model, batch) * 30  # large enough that the first steps overflow


class PortScaledGrads(PortGrads):
    def training_step(self, batch):
        return mse(self.model, batch) * 30


@pytest.mark.parametrize("accum", [1, 2])
def test_gradients_hooks_see_under_a_grad_scaler_match(accum):
    """float16 autocast with a GradScaler (Lightning's ``MixedPrecision("16-mixed", "cpu", GradScaler("cpu"))``,
    safeloop's "16"), accumulating or not: ``on_after_backward`` sees the scaled gradients (summed over the window so
    far), ``on_before_optimizer_step`` the unscaled ones (inf or NaN where they overflowed), as in Lightning."""
    from pytorch_lightning.plugins.precision import MixedPrecision
    plugin = MixedPrecision("16-mixed", "cpu", torch.amp.GradScaler("cpu"))
    lit = LitScaledGrads(configure=lambda m: sgd(m.parameters(), 0.01))
    lit.after, lit.before, lit.lrs = [], [], []
    lightning(max_epochs=EPOCHS, accumulate_grad_batches=accum, plugins=[plugin]).fit(lit, train_dataloaders=loader())
    port = PortScaledGrads(model=net(), train_data=loader(), optimizer=lambda p: sgd(p, 0.01),
                           **settings(max_epochs=EPOCHS, grad_accum=accum, precision="16"))
    port.after, port.before, port.lrs = [], [], []
    port.fit()
    after, before = torch.stack(lit.after), torch.stack(lit.before)
    assert torch.allclose(after, torch.stack(port.after), rtol=0, atol=0, equal_nan=True)
    assert torch.allclose(before, torch.stack(port.before), rtol=0, atol=0, equal_nan=True)
    assert not before.isfinite().all() and before.isfinite().any()  # some updates overflowed, and were skipped
    finite = after.isfinite()
    assert float(after[finite].min()) > 100 * float(before[before.isfinite()].max())  # scaled before the unscale
    assert plugin.scaler.get_scale() == port.scaler.get_scale()
    assert_same(lit.model, port.model)


# -- early stopping: Lightning's options safeloop has not


class LitEarly(Lit):
    def on_validation_end(self):
        self.val.append((self.trainer.global_step, float(self.trainer.callback_metrics["val_loss"])))


class PortEarly(Port):
    val: list

    def on_validation_end(self, metrics):
        self.val.append((self.state.step, metrics["val_loss"]))


def test_early_stopping_on_a_non_finite_metric_differs_as_documented():
    """SGD at 5.0 diverges: validation loss 4.1e21 after step 7, NaN from step 14 on. docs/trainer.md, Early stopping:
    "Not there: ... check_finite (a NaN here counts as no improvement)". Lightning's default ``check_finite=True``
    stops after the first non-finite validation (step 14); safeloop goes on for ``patience`` (3) validations without
    improvement (steps 14, 21, 28), training on NaN weights."""
    rule = {"monitor": "val_loss", "patience": 3}
    lit = LitEarly(configure=lambda m: sgd(m.parameters(), 5.0))
    lit.val = []
    trainer = lightning(max_epochs=20, callbacks=[pl.callbacks.EarlyStopping(**rule)])
    trainer.fit(lit, train_dataloaders=loader(), val_dataloaders=loader(n=6, seed=2))
    port = PortEarly(model=net(), train_data=loader(), val_data=loader(n=6, seed=2), optimizer=lambda p: sgd(p, 5.0),
                     callbacks=[safeloop.EarlyStopping(**rule)], **settings(max_epochs=20, val_every=STEPS))
    port.val = []
    port.fit()
    assert [s for s, _ in lit.val] == [7, 14] and trainer.global_step == 14
    assert [s for s, _ in port.val[1:]] == [7, 14, 21, 28] and port.state.step == 28
    assert close(lit.val[0][1], port.val[1][1]) and lit.val[0][1] > 1e20
    assert math.isnan(lit.val[1][1]) and all(math.isnan(v) for _, v in port.val[2:])


@pytest.mark.parametrize("option", [{"stopping_threshold": 0.5}, {"divergence_threshold": 10.0},
                                    {"check_finite": False}, {"check_on_train_epoch_end": True}, {"strict": False}])
def test_early_stopping_options_not_there_differ_as_documented(option):
    """docs/trainer.md, Early stopping: "Not there: Lightning's ``stopping_threshold``, ``divergence_threshold``,
    ``check_finite``, ``check_on_train_epoch_end`` and ``strict=False``": each is refused when the callback is made
    (Lightning's accepts it), not ignored."""
    pl.callbacks.EarlyStopping(monitor="val_loss", **option)
    with pytest.raises(TypeError, match=next(iter(option))):
        safeloop.EarlyStopping(monitor="val_loss", **option)


def test_early_stopping_patience_zero_differs_loudly():
    """Lightning's ``patience=0`` stops after the first validation without improvement; safeloop refuses it when the
    callback is made. Loud, and not in the docs."""
    pl.callbacks.EarlyStopping(monitor="val_loss", patience=0)
    with pytest.raises(safeloop.ConfigError, match=r"patience=0\): give a positive integer"):
        safeloop.EarlyStopping(monitor="val_loss", patience=0)


# -- self.log: Lightning's keywords, and metrics logged in test_step


class LitTested(Lit):
    """``test_step`` that only logs (Lightning's usual): the loss and the mean absolute error."""

    def test_step(self, batch, batch_idx):
        x, y = batch
        out = self.model(x)
        self.log("test_loss", F.mse_loss(out, y))
        self.log("test_mae", (out - y).abs().mean())


class PortTested(Port):
    def test_step(self, batch):
        x, y = batch
        out = self.model(x)
        self.log("test_loss", F.mse_loss(out, y))
        self.log("test_mae", (out - y).abs().mean())


def test_metrics_logged_in_test_step_match():
    """After 2 epochs, ``trainer.test`` over 7 samples in batches of 2 (the last of 1) with a ``test_step`` that only
    logs: the names (as given) and each one's mean over the samples (to 1e-6: the float32 / float64 sums).
    Lightning returns them in a list, one dict per DataLoader; safeloop the dict (docs/trainer.md's map)."""
    lit = LitTested()
    trainer = lightning(max_epochs=EPOCHS)
    trainer.fit(lit, train_dataloaders=loader())
    port = PortTested(model=net(), train_data=loader(), optimizer=adam, **settings(max_epochs=EPOCHS))
    port.fit()
    assert_same(lit.model, port.model)
    data = loader(n=7, seed=3)
    [theirs] = trainer.test(lit, dataloaders=data, verbose=False)
    ours = port.test(data)
    assert sorted(theirs) == sorted(ours) == ["test_loss", "test_mae"]
    assert all(close(theirs[k], ours[k]) for k in theirs)
    x, y = data.dataset.tensors
    with torch.no_grad():
        assert math.isclose(ours["test_mae"], float((port.model(x) - y).abs().mean()), rel_tol=1e-6)


class LitStepEpoch(Lit):
    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        self.log("train_loss", loss, on_step=True, on_epoch=True, prog_bar=True)
        return loss


class PortStepEpoch(Port):
    def training_step(self, batch):
        loss = super().training_step(batch)
        self.log("train_loss", loss, on_step=True, on_epoch=True, prog_bar=True)
        return loss


class Recorder(pl.loggers.logger.Logger):
    """A Lightning logger keeping each ``log_metrics`` call."""

    def __init__(self):
        super().__init__()
        self.rows = []

    name, version = "recorder", 0

    @property
    def experiment(self):
        return None

    def log_metrics(self, metrics, step=None):
        self.rows.append((step, dict(metrics)))

    def log_hyperparams(self, params, *args, **kwargs):
        pass  # no hyperparameters in these tests


def test_log_with_on_step_and_on_epoch_differs_loudly():
    """``self.log("train_loss", loss, on_step=True, on_epoch=True, prog_bar=True)`` in ``training_step``, Lightning's
    most common call: Lightning's loggers get ``train_loss_step`` at each log point and ``train_loss_epoch`` (the
    pass's mean) at each epoch's end. safeloop's ``log(name, value)`` takes ``prog_bar`` only: the port's first step
    stops with a ConfigError saying what safeloop does instead (docs/trainer.md's map)."""
    recorder = Recorder()
    lightning(max_epochs=EPOCHS, logger=recorder, log_every_n_steps=3).fit(LitStepEpoch(), train_dataloaders=loader())
    names = {name for _, metrics in recorder.rows for name in metrics}
    assert {"train_loss_step", "train_loss_epoch"} <= names and "train_loss" not in names
    epochs = [m["train_loss_epoch"] for _, m in recorder.rows if "train_loss_epoch" in m]
    assert len(epochs) == EPOCHS
    port = PortStepEpoch(model=net(), train_data=loader(), optimizer=adam,
                         **settings(max_epochs=EPOCHS))
    with pytest.raises(safeloop.ConfigError, match=r"self\.log\(\.\.\., on_step=True\): safeloop's self\.log\(name, "
                       r"value\) takes no on_step: from training_step or a step.s hooks the value is written every "
                       r"log_every"):
        port.fit()
    assert port.state.step == 0


class LitEpochMean(Lit):
    """``self.log("train_mae", mae, on_step=False, on_epoch=True)``: Lightning's loggers get the pass's mean."""

    def training_step(self, batch, batch_idx):
        x, y = batch
        out = self.model(x)
        self.log("train_mae", F.l1_loss(out, y), on_step=False, on_epoch=True)
        return F.mse_loss(out, y)


class PortEpochMean(Port):
    """The refusal's advice: each batch's value times its samples added up, ``self.log``-ged in ``on_epoch_end``."""

    def on_epoch_start(self):
        self.total = [0.0, 0]

    def training_step(self, batch):
        x, y = batch
        out = self.model(x)
        self.total[0] += float(F.l1_loss(out, y)) * len(x)
        self.total[1] += len(x)
        return F.mse_loss(out, y)

    def on_epoch_end(self):
        self.log("train_mae", self.total[0] / self.total[1])


@pytest.mark.parametrize("grad_accum", [1, 3])
def test_a_training_value_logged_on_epoch_ported_as_the_refusal_says_matches(grad_accum):
    """14 samples in batches of 4, 4, 4 and 2, 3 epochs, with and without accumulation: the pass's mean that
    Lightning's loggers get (each batch weighed by its samples) is what the port logs at each pass's end, to float32's
    precision (Lightning adds up in float32), and the parameters are the same."""
    recorder = Recorder()
    lit = LitEpochMean()
    lightning(max_epochs=3, logger=recorder, accumulate_grad_batches=grad_accum).fit(
        lit, train_dataloaders=loader(batch=4))
    rows = []
    port = PortEpochMean(model=net(), train_data=loader(batch=4), optimizer=adam,
                         **settings(max_epochs=3, grad_accum=grad_accum,
                                    loggers=[type("Rows", (), {"log_metrics": lambda _, m, step: rows.append(m)})()]))
    port.fit()
    theirs = [m["train_mae"] for _, m in recorder.rows if "train_mae" in m]
    ours = [m["train_mae"] for m in rows if "train_mae" in m]
    assert len(theirs) == len(ours) == 3 and all(close(a, b) for a, b in zip(theirs, ours))
    assert_same(lit.model, port.model)


# -- best checkpoints on tied values


def test_best_checkpoints_on_tied_values_match(tmp_path):
    """SGD at lr 0 over 4 epochs: every validation gives the same ``val_loss``. ``save_top_k=2`` against ``keep=2``:
    of equal values the older ranks first in both (docs/checkpoints.md), so steps 7 and 14 are kept (safeloop also
    keeps its newest, 28) and the best is step 7."""
    theirs, ours, best = checkpointed_runs(tmp_path, dict(monitor="val_loss", save_top_k=2),
                                           {"monitor": "val_loss", "keep": 2, "every": None}, lr=0.0, epochs=4)
    assert sorted(theirs.values()) == [7, 14]
    assert sorted(ours.values()) == [7, 14, 28]
    assert best == (7, 7)


ACCURACIES = [0.75, 0.75, 0.8]  # by epoch: a tie at the bottom of the best two, then a better one


class LitTied(Lit):
    def validation_step(self, batch, batch_idx):
        self.log("val_acc", ACCURACIES[self.current_epoch])


class PortTied(Port):
    def validation_step(self, batch):
        return {"acc": torch.tensor(ACCURACIES[self.state.epoch])}


def test_best_checkpoints_when_a_better_value_follows_a_tie_differ_as_documented(tmp_path):
    """Accuracies 0.75, 0.75, 0.8 (a small validation set gives ties), ``save_top_k=2, mode="max"`` against ``keep=2``
    (docs/trainer.md, Coming from Lightning): Lightning lets no tie in, but when 0.8 comes in it deletes the older of
    the two tied (its ``max`` over the top K takes the first), keeping steps 14 and 21. safeloop ranks the older of
    equal values first throughout: it keeps steps 7 and 21. The best is step 21 in both."""
    cb = pl.callbacks.ModelCheckpoint(dirpath=tmp_path / "lit", filename="{step}", monitor="val_acc", mode="max",
                                      save_top_k=2)
    lightning(max_epochs=3, enable_checkpointing=True, callbacks=[cb]).fit(
        LitTied(configure=lambda m: sgd(m.parameters(), 0.0)), train_dataloaders=loader(),
        val_dataloaders=loader(n=6, seed=2))
    port = PortTied(model=net(), train_data=loader(), val_data=loader(n=6, seed=2), optimizer=lambda p: sgd(p, 0.0),
                    checkpoint={"dir": str(tmp_path / "safeloop"), "monitor": "val_acc", "mode": "max", "keep": 2,
                                "every": None}, **settings(max_epochs=3, val_every=STEPS))
    port.fit()
    assert sorted(lightning_files(tmp_path / "lit").values()) == [14, 21]
    assert sorted(safeloop_files(tmp_path / "safeloop").values()) == [7, 21]
    assert torch.load(cb.best_model_path, weights_only=False)["global_step"] == 21
    assert port.checkpointer.best.name == "step-000000021.pt"


# -- resuming under accumulation


class LitSeen(Lit):
    def training_step(self, batch, batch_idx):
        self.seen.append((self.global_step, float(batch[0][0, 0])))
        return super().training_step(batch, batch_idx)


class PortSeen(Port):
    seen: list
    configure = staticmethod(warm_up)

    def training_step(self, batch):
        self.seen.append((self.state.step, float(batch[0][0, 0])))
        return super().training_step(batch)


def accumulated_resumes(tmp_path, at, epochs=3):
    """``accumulate_grad_batches=3`` / ``grad_accum=3`` (3 updates a pass: 3, 3 and 1 batches), a per-step warm-up:
    in each framework a run of ``epochs`` that never stopped, and one saved at update ``at`` with ``max_steps=at``,
    then resumed from that file by a new Trainer up to ``epochs``."""
    def lit_run(ckpt_path=None, **kwargs):
        lit = LitSeen(configure=warm_up)
        lit.seen = []
        trainer = lightning(**{"max_epochs": epochs, "accumulate_grad_batches": 3, **kwargs})
        trainer.fit(lit, train_dataloaders=loader(), ckpt_path=ckpt_path)
        return lit

    def port_run(**kwargs):
        port = PortSeen(model=net(), train_data=loader(),
                        **settings(**{"max_epochs": epochs, "grad_accum": 3, **kwargs}))
        port.seen = []
        port.fit()
        return port

    return saved_and_resumed(tmp_path, at, lit_run, port_run)


def test_resume_under_accumulation_at_a_pass_end_matches(tmp_path):
    """Saved after update 3, the end of the first pass (its last window of one batch), resumed to 3 epochs: each
    framework's resumed run ends as its run that never stopped (the batches from there on, the learning rate, the
    parameters), and the two frameworks' are the same, bit for bit."""
    lit, ours = accumulated_resumes(tmp_path, 3)
    assert_same(lit["whole"].model, ours["whole"].model)
    assert lit["whole"].seen == ours["whole"].seen and len(ours["whole"].seen) == 3 * STEPS
    assert ours["resumed"].seen == ours["whole"].seen[STEPS:]
    assert lit["resumed"].seen == lit["whole"].seen[STEPS:]
    assert lit["resumed"].trainer.global_step == ours["resumed"].state.step == 9
    assert lr_of(lit["resumed"].optimizers()) == lr_of(ours["resumed"].optimizers["optimizer"])
    assert_same(lit["resumed"].model, ours["resumed"].model)
    assert_same(ours["whole"].model, ours["resumed"].model)


# -- resuming from a checkpoint saved at a validation at a pass's end


def step_lr(model):
    opt = sgd(model.parameters())
    return {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)}


def test_resume_from_a_best_checkpoint_at_a_pass_end_matches(tmp_path):
    """A StepLR stepped at each epoch's end, validation each epoch: the checkpoint Lightning's
    ``ModelCheckpoint(monitor="val_loss", save_top_k=-1)`` saves at the first epoch's validation (step 7), and
    safeloop's ``checkpoint={"monitor": "val_loss"}`` at its validation after step 7, each resumed by a new Trainer
    to 3 epochs: each ends as its run that never stopped (the epoch's scheduler step neither lost nor repeated), and
    the two frameworks' runs are the same, bit for bit."""
    def lit_run(ckpt_path=None, **kwargs):
        lit = LitSeen(configure=step_lr)
        lit.seen = []
        trainer = lightning(max_epochs=3, **kwargs)
        trainer.fit(lit, train_dataloaders=loader(), val_dataloaders=loader(n=6, seed=2), ckpt_path=ckpt_path)
        return lit

    def port_run(**kwargs):
        port = PortSeen(model=net(), train_data=loader(), val_data=loader(n=6, seed=2),
                        **settings(max_epochs=3, val_every=STEPS, **kwargs))
        port.configure = staticmethod(step_lr)
        port.seen = []
        port.fit()
        return port

    saver = pl.callbacks.ModelCheckpoint(dirpath=tmp_path / "lit", monitor="val_loss", save_top_k=-1, filename="{step}")
    whole, _ = lit_run(), lit_run(enable_checkpointing=True, callbacks=[saver])
    resumed = lit_run(ckpt_path=tmp_path / "lit" / "step=7.ckpt")
    ours_whole = port_run()
    port_run(checkpoint={"dir": str(tmp_path / "sl"), "monitor": "val_loss", "keep": 5, "every": None})
    ours = port_run(resume=str(tmp_path / "sl" / "step-000000007.pt"))
    assert_same(whole.model, ours_whole.model)
    assert resumed.seen == whole.seen[STEPS:] and ours.seen == ours_whole.seen[STEPS:]
    assert lr_of(resumed.optimizers()) == lr_of(ours.optimizers["optimizer"]) == 0.05 / 8
    assert resumed.trainer.global_step == ours.state.step == 3 * STEPS
    assert_same(whole.model, resumed.model)
    assert_same(ours_whole.model, ours.model)
    assert_same(resumed.model, ours.model)


# -- clipping in bfloat16, hooks in manual mode with two backwards, epoch-end checkpoints


@pytest.mark.parametrize("precision, accum", [("bf16-true", 1), ("bf16-true", 3), ("bf16-mixed", 3)])
def test_gradient_clipping_in_bfloat16_matches(precision, accum):
    """``gradient_clip_val=0.05`` / ``grad_clip=0.05`` under bf16 parameters (the norm taken over bfloat16 gradients)
    or bf16 autocast, accumulating or not, SGD at 0.1 over 2 passes: the parameters, bit for bit."""
    lit = Lit(configure=lambda m: sgd(m.parameters(), 0.1))
    lightning(max_epochs=EPOCHS, precision=precision, gradient_clip_val=0.05, accumulate_grad_batches=accum).fit(
        lit, train_dataloaders=loader())
    port = Port(model=net(), train_data=loader(), optimizer=lambda p: sgd(p, 0.1),
                **settings(max_epochs=EPOCHS, precision=precision, grad_clip=0.05, grad_accum=accum))
    port.fit()
    assert next(port.model.parameters()).dtype == (torch.bfloat16 if precision == "bf16-true" else torch.float32)
    assert_same(lit.model, port.model)


class LitTwoBackwards(Lit):
    """Manual optimization, two ``manual_backward`` calls before one step: what each hook sees, in order."""

    def __init__(self):
        super().__init__(configure=lambda m: sgd(m.parameters()))
        self.automatic_optimization = False
        self.calls = []

    def training_step(self, batch, batch_idx):
        opt = self.optimizers()
        self.manual_backward(mse(self.model, batch) * 0.5)
        self.manual_backward(mse(self.model, batch) * 0.5)
        opt.step()
        opt.zero_grad()

    def on_before_backward(self, loss):
        self.calls.append(("on_before_backward", float(loss.detach())))

    def on_after_backward(self):
        self.calls.append(("on_after_backward", float(norm(self.model))))

    def on_before_optimizer_step(self, optimizer):
        self.calls.append(("on_before_optimizer_step", float(norm(self.model))))


class PortTwoBackwards(Port):
    automatic = False
    calls: list

    def training_step(self, batch):
        loss = mse(self.model, batch) * 0.5
        self.backward(loss)
        self.backward(mse(self.model, batch) * 0.5)
        self.step()
        return loss

    def on_before_backward(self, name, loss):
        self.calls.append(("on_before_backward", float(loss.detach())))

    def on_after_backward(self, name):
        self.calls.append(("on_after_backward", float(norm(self.model))))

    def on_before_optimizer_step(self, name, optimizer):
        self.calls.append(("on_before_optimizer_step", float(norm(self.model))))


def test_hooks_in_manual_mode_with_two_backwards_match():
    """Manual mode, two backwards into one optimizer then a step, one pass: each backward calls
    ``on_before_backward`` (its loss) and ``on_after_backward`` (the gradient summed so far) in both, the step
    ``on_before_optimizer_step`` once; the values, the order and the parameters, bit for bit."""
    lit = LitTwoBackwards()
    lightning(max_epochs=1).fit(lit, train_dataloaders=loader())
    port = PortTwoBackwards(model=net(), train_data=loader(), optimizer=sgd, **settings(max_epochs=1))
    port.calls = []
    port.fit()
    assert lit.calls == port.calls and len(port.calls) == 5 * STEPS
    assert_same(lit.model, port.model)


def test_checkpoints_at_each_epoch_end_match(tmp_path):
    """Lightning's default ``ModelCheckpoint`` saving at each epoch's end (``save_top_k=-1``: all kept) against
    ``checkpoint={"every": 7, "keep": 100}`` (one pass's steps), 3 epochs: the same steps saved."""
    theirs, ours, _ = checkpointed_runs(tmp_path, dict(save_top_k=-1), {"every": STEPS, "keep": 100}, epochs=3)
    assert sorted(theirs.values()) == sorted(ours.values()) == [7, 14, 21]


@pytest.mark.parametrize("lightning_setting, safeloop_setting", [
    ({"max_steps": -1, "max_epochs": EPOCHS}, {"max_steps": -1, "max_epochs": EPOCHS}),
    ({"max_epochs": -1, "max_steps": 5}, {"max_epochs": -1, "max_steps": 5}),
    ({"max_epochs": EPOCHS, "gradient_clip_val": 0}, {"max_epochs": EPOCHS, "grad_clip": 0})],
    ids=["max_steps=-1", "max_epochs=-1", "clip 0"])
def test_lightnings_no_limit_values_differ_loudly(lightning_setting, safeloop_setting):
    """Lightning's values for "no limit": ``max_steps=-1``, ``max_epochs=-1``, ``gradient_clip_val=0`` (no clipping).
    Lightning trains; safeloop refuses each when the Trainer is made, naming the setting (its "no limit" is leaving
    the setting out). Loud, and not in the docs' map."""
    lit = Lit()
    trainer = lightning(**lightning_setting)
    trainer.fit(lit, train_dataloaders=loader())
    assert trainer.global_step == (5 if lightning_setting.get("max_steps", -1) == 5 else EPOCHS * STEPS)
    name = next(k for k, v in safeloop_setting.items() if v in (-1, 0))
    with pytest.raises(safeloop.ConfigError, match=f"{name} must be a positive"):
        Port(model=net(), train_data=loader(), optimizer=adam, **settings(**safeloop_setting))


# -- manual clipping under a GradScaler


class LitManualScaled(Lit):
    """Manual optimization as Lightning's docs show clipping there: ``manual_backward``, ``self.clip_gradients``,
    ``opt.step()``; the gradient norm after the clip is kept."""

    def __init__(self):
        super().__init__(configure=lambda m: sgd(m.parameters()))
        self.automatic_optimization = False
        self.clipped = []

    def training_step(self, batch, batch_idx):
        opt = self.optimizers()
        self.manual_backward(mse(self.model, batch))
        self.clip_gradients(opt, gradient_clip_val=1.0, gradient_clip_algorithm="norm")
        self.clipped.append(norm(self.model))
        opt.step()
        opt.zero_grad()


class PortManualScaled(Port):
    automatic = False

    def training_step(self, batch):
        loss = mse(self.model, batch)
        self.backward(loss)
        self.step()
        return loss


def test_manual_clipping_under_a_grad_scaler_differs_as_documented():
    """Manual mode, float16 autocast with a GradScaler (Lightning's ``MixedPrecision("16-mixed", "cpu",
    GradScaler("cpu"))``, safeloop's "16"), 2 passes of SGD at 0.05: Lightning's ``self.clip_gradients(opt, 1.0)``
    before ``opt.step()`` clips the gradients still multiplied by the loss scale (2**16, then 2**15, ...) to norm
    1.0, so each update is about 1/16384 of the clipped one: its weights move 3.2e-5 in all. safeloop's
    ``grad_clip=1.0`` clips the unscaled gradients, and its weights move 0.19 (0.21 unclipped)."""
    from pytorch_lightning.plugins.precision import MixedPrecision
    plugin = MixedPrecision("16-mixed", "cpu", torch.amp.GradScaler("cpu"))
    lit = LitManualScaled()
    lightning(max_epochs=EPOCHS, plugins=[plugin]).fit(lit, train_dataloaders=loader())
    port = PortManualScaled(model=net(), train_data=loader(), optimizer=sgd,
                            **settings(max_epochs=EPOCHS, precision="16", grad_clip=1.0))
    port.fit()
    finite = [float(n) for n in lit.clipped if n.isfinite()]
    assert all(math.isclose(n, 1.0, rel_tol=1e-6) for n in finite) and plugin.scaler.get_scale() > 1000
    assert max_diff(lit.model, net()) < 1e-4
    assert max_diff(port.model, net()) > 0.1  # the unscaled gradients clipped to norm 1.0


class LitManualHook(LitManual):
    def on_before_optimizer_step(self, optimizer):
        self.hook.append(norm(self.model))


class PortManualHook(PortManual):
    hook: list

    def on_before_optimizer_step(self, name, optimizer):
        super().on_before_optimizer_step(name, optimizer)
        self.hook.append(norm(self.model))


def test_manual_mode_on_before_optimizer_step_sees_unclipped_gradients_differs_as_documented():
    """Manual mode, ``self.clip_gradients(opt, 0.05)`` then ``opt.step()`` against ``grad_clip=0.05`` and
    ``self.step()``, 2 passes: the parameters match (the test above); the gradient norm ``on_before_optimizer_step``
    sees is 0.05 (clipped) at every step in Lightning, the unclipped norm (1.24 at the first) in safeloop."""
    lit = LitManualHook(0.05)
    lit.hook = []
    lightning(max_epochs=EPOCHS).fit(lit, train_dataloaders=loader())
    port = PortManualHook(model=net(), train_data=loader(), **settings(max_epochs=EPOCHS, grad_clip=0.05))
    port.lrs, port.before, port.hook = [], [], []
    port.fit()
    assert_same(lit.model, port.model)
    assert all(math.isclose(float(n), 0.05, rel_tol=1e-5) for n in lit.hook)
    assert len(port.hook) == len(lit.hook) and all(float(n) > 0.05 for n in port.hook)  # before grad_clip
    assert math.isclose(float(port.hook[0]), 1.24, rel_tol=0.01)


# -- manual mode: two updates in one step, a plateau stepped by hand


class LitTwoUpdates(Lit):
    """Two updates of one optimizer per batch, the warm-up stepped by hand after each."""

    def __init__(self):
        super().__init__(configure=warm_up)
        self.automatic_optimization = False
        self.lrs = []

    def training_step(self, batch, batch_idx):
        opt, sch = self.optimizers(), self.lr_schedulers()
        for _ in range(2):
            self.manual_backward(mse(self.model, batch))
            self.lrs.append(lr_of(opt))
            opt.step()
            opt.zero_grad()
            sch.step()


class PortTwoUpdates(Port):
    automatic = False
    configure = staticmethod(warm_up)
    lrs: list

    def training_step(self, batch):
        for _ in range(2):
            loss = mse(self.model, batch)
            self.backward(loss)
            self.step()
        return loss

    def on_before_optimizer_step(self, name, optimizer):
        self.lrs.append(lr_of(optimizer))


def test_manual_mode_with_two_updates_in_a_step_matches():
    """Manual mode, two backward-and-step pairs on one optimizer in each ``training_step``, a per-update warm-up: the
    learning rate of each update and the parameters match; Lightning's ``global_step`` counts 14 optimizer steps,
    safeloop's ``state.step`` 7 steps (docs/trainer.md's map, ``self.global_step``)."""
    lit = LitTwoUpdates()
    trainer = lightning(max_epochs=1)
    trainer.fit(lit, train_dataloaders=loader())
    port = PortTwoUpdates(model=net(), train_data=loader(), **settings(max_epochs=1))
    port.lrs = []
    port.fit()
    assert lit.lrs == port.lrs and len(port.lrs) == 2 * STEPS
    assert (trainer.global_step, port.state.step) == (2 * STEPS, STEPS)
    assert_same(lit.model, port.model)


def plateau(model):
    opt = sgd(model.parameters(), 0.05)
    return {"optimizer": opt, "lr_scheduler": {"scheduler": torch.optim.lr_scheduler.ReduceLROnPlateau(
        opt, factor=0.5, patience=0), "monitor": "val_loss"}}


class LitManualPlateau(Lit):
    """Manual mode, a ReduceLROnPlateau stepped by hand on ``val_loss`` at each epoch's end (Lightning's docs)."""

    def __init__(self):
        super().__init__(configure=plateau)
        self.automatic_optimization = False
        self.lrs = []

    def training_step(self, batch, batch_idx):
        opt = self.optimizers()
        self.manual_backward(mse(self.model, batch))
        self.lrs.append(lr_of(opt))
        opt.step()
        opt.zero_grad()

    def on_train_epoch_end(self):
        self.lr_schedulers().step(self.trainer.callback_metrics["val_loss"])


class PortManualPlateau(PortManual):
    configure = staticmethod(plateau)


def test_manual_mode_plateau_stepped_by_hand_matches_the_trainers():
    """Lightning's manual mode steps no scheduler: its docs step a plateau by hand in ``on_train_epoch_end`` with
    ``callback_metrics["val_loss"]`` (the epoch's validation has run by then). safeloop steps the plateau given with
    its monitor after each validation (``val_every`` = one pass's steps), 4 passes: the learning rate of each update
    (halved after the third validation's higher loss) and the parameters, bit for bit."""
    lit = LitManualPlateau()
    lightning(max_epochs=4).fit(lit, train_dataloaders=loader(), val_dataloaders=loader(n=6, seed=2))
    port = PortManualPlateau(model=net(), train_data=loader(), val_data=loader(n=6, seed=2),
                             **settings(max_epochs=4, val_every=STEPS))
    port.lrs, port.before = [], []
    port.fit()
    assert lit.lrs == port.lrs and port.lrs[-1] == 0.025 and port.lrs[3 * STEPS - 1] == 0.05
    assert_same(lit.model, port.model)


# -- a run stopped early, resumed


def test_resume_after_an_early_stop_differs_as_documented(tmp_path):
    """``EarlyStopping(patience=2)``, validation each epoch, SGD at 0.1: both runs stop after step 21. Resumed from
    the last checkpoint with the same settings (Lightning's ``save_last=True`` and ``fit(ckpt_path=last.ckpt)``,
    safeloop's ``resume="auto"``), Lightning's trains one more epoch, finds no improvement at its validation and
    stops after step 28; safeloop's trains nothing (step 21)."""
    rule = {"monitor": "val_loss", "patience": 2}

    def lit_run(ckpt_path=None):
        lit = Lit(configure=lambda m: sgd(m.parameters(), 0.1))
        saver = pl.callbacks.ModelCheckpoint(dirpath=tmp_path / "lit", save_last=True, filename="{step}")
        trainer = lightning(max_epochs=20, enable_checkpointing=True,
                            callbacks=[pl.callbacks.EarlyStopping(**rule), saver])
        trainer.fit(lit, train_dataloaders=loader(), val_dataloaders=loader(n=6, seed=2), ckpt_path=ckpt_path)
        return trainer, lit

    def port_run(**kwargs):
        port = Port(model=net(), train_data=loader(), val_data=loader(n=6, seed=2), optimizer=lambda p: sgd(p, 0.1),
                    callbacks=[safeloop.EarlyStopping(**rule)], checkpoint={"dir": str(tmp_path / "sl")},
                    **settings(max_epochs=20, val_every=STEPS, **kwargs))
        port.fit()
        return port

    first, lit = lit_run()
    again, resumed = lit_run(tmp_path / "lit" / "last.ckpt")
    ours = port_run()
    ours_again = port_run(resume="auto")
    assert first.global_step == ours.state.step == 3 * STEPS
    assert_same(lit.model, ours.model)
    assert again.global_step == 4 * STEPS
    assert ours_again.state.step == 3 * STEPS  # trains nothing
    assert_same(lit.model, ours_again.model)


def test_a_later_fit_after_an_early_stop_differs_as_documented():
    """``EarlyStopping(patience=1)``, validation each epoch, SGD at 0.3: both stop after step 14. A second ``fit`` of
    the same Trainer with ``max_epochs`` raised to 20: Lightning's trains one more epoch and stops after step 21 (no
    improvement at its validation); safeloop's trains nothing (docs/trainer.md, Early stopping)."""
    lit = Lit(configure=lambda m: sgd(m.parameters(), 0.3))
    trainer = lightning(max_epochs=10, callbacks=[pl.callbacks.EarlyStopping("val_loss", patience=1)])
    trainer.fit(lit, train_dataloaders=loader(), val_dataloaders=loader(n=6, seed=2))
    port = Port(model=net(), train_data=loader(), val_data=loader(n=6, seed=2), optimizer=lambda p: sgd(p, 0.3),
                callbacks=[safeloop.EarlyStopping("val_loss", patience=1)], **settings(max_epochs=10, val_every=STEPS))
    port.fit()
    assert trainer.global_step == port.state.step == 2 * STEPS
    assert_same(lit.model, port.model)
    trainer.fit_loop.max_epochs = port.max_epochs = 20
    trainer.fit(lit, train_dataloaders=loader(), val_dataloaders=loader(n=6, seed=2))
    port.fit()
    assert trainer.global_step == 3 * STEPS and port.state.step == 2 * STEPS


def gap(loss, step):
    """The loss, NaN at the validations after steps 14 and 28."""
    return loss * (math.nan if step % 14 == 0 else 1.0)


class LitGap(Lit):
    def validation_step(self, batch, batch_idx):
        self.log("val_gap", gap(mse(self.model, batch), self.global_step))


class PortGap(Port):
    def validation_step(self, batch):
        self.log("val_gap", gap(mse(self.model, batch), self.state.step))


def test_best_checkpoints_with_nan_values_match(tmp_path):
    """A metric that is NaN at some validations: ``val_gap``, the loss (1.65 at step 7, 2.63 at 21) but NaN at steps
    14 and 28, SGD at 0.05, 4 epochs. ``ModelCheckpoint(monitor="val_gap", save_top_k=2)`` against
    ``checkpoint={"monitor": "val_gap", "keep": 2}``: a NaN ranks last in both (Lightning reads it as the worst
    value), so steps 7 and 21 are kept (safeloop also keeps its newest, 28) and the best is step 7."""
    cb = pl.callbacks.ModelCheckpoint(dirpath=tmp_path / "lit", filename="{step}", monitor="val_gap", save_top_k=2)
    lit = LitGap(configure=lambda m: sgd(m.parameters()))
    lightning(max_epochs=4, enable_checkpointing=True, callbacks=[cb]).fit(
        lit, train_dataloaders=loader(), val_dataloaders=loader(n=6, seed=2))
    port = PortGap(model=net(), train_data=loader(), val_data=loader(n=6, seed=2), optimizer=sgd,
                   checkpoint={"dir": str(tmp_path / "sl"), "monitor": "val_gap", "keep": 2, "every": None},
                   **settings(max_epochs=4, val_every=STEPS))
    port.fit()
    assert_same(lit.model, port.model)
    gaps = [m["val_gap"] for _, m in port.state.val_history[1:]]
    assert [math.isnan(g) for g in gaps] == [False, True, False, True]
    assert sorted(lightning_files(tmp_path / "lit").values()) == [7, 21]
    assert sorted(safeloop_files(tmp_path / "sl").values()) == [7, 21, 28]
    best = torch.load(cb.best_model_path, weights_only=False)["global_step"]
    assert best == torch.load(port.checkpointer.best, weights_only=True)["step"] == 7


# -- resuming under a GradScaler


def test_resume_under_a_grad_scaler_at_a_pass_end_matches(tmp_path):
    """float16 autocast with a GradScaler (Lightning's forced on the CPU, safeloop's "16"), the loss large enough that
    the first updates overflow: saved after step 7 (scale 1024 then), resumed to 3 epochs by a new Trainer. Each
    resumed run ends as its run that never stopped (the loss scale 128, the parameters), and the frameworks' runs are
    the same, bit for bit."""
    from pytorch_lightning.plugins.precision import MixedPrecision

    def lit_run(ckpt_path=None, **kwargs):
        plugin = MixedPrecision("16-mixed", "cpu", torch.amp.GradScaler("cpu"))
        lit = LitScaledGrads(configure=lambda m: sgd(m.parameters(), 0.01))
        lit.after, lit.before, lit.lrs = [], [], []
        lightning(**{"max_epochs": 3, "plugins": [plugin], **kwargs}).fit(
            lit, train_dataloaders=loader(), ckpt_path=ckpt_path)
        return lit, plugin.scaler.get_scale()

    def port_run(**kwargs):
        port = PortScaledGrads(model=net(), train_data=loader(), optimizer=lambda p: sgd(p, 0.01),
                               **settings(**{"max_epochs": 3, "precision": "16", **kwargs}))
        port.after, port.before, port.lrs = [], [], []
        port.fit()
        return port, port.scaler.get_scale()

    saver = pl.callbacks.ModelCheckpoint(dirpath=tmp_path / "lit", every_n_train_steps=STEPS, save_top_k=-1,
                                         filename="{step}")
    (whole, whole_scale), (_, first_scale) = lit_run(), lit_run(max_steps=STEPS, enable_checkpointing=True,
                                                                callbacks=[saver])
    resumed, resumed_scale = lit_run(tmp_path / "lit" / f"step={STEPS}.ckpt")
    ours_whole, ours_whole_scale = port_run()
    port_run(max_steps=STEPS, checkpoint={"dir": str(tmp_path / "sl"), "every": STEPS})
    ours, ours_scale = port_run(resume=str(tmp_path / "sl" / f"step-{STEPS:09d}.pt"))
    assert first_scale == 1024 and whole_scale == resumed_scale == ours_whole_scale == ours_scale == 128
    assert_same(whole.model, resumed.model)
    assert_same(ours_whole.model, ours.model)
    assert_same(resumed.model, ours.model)


def test_checkpoints_every_n_updates_under_accumulation_match(tmp_path):
    """``ModelCheckpoint(every_n_train_steps=2, save_top_k=-1)`` against ``checkpoint={"every": 2, "keep": 100}``
    under ``accumulate_grad_batches=3`` (3 updates a pass), 3 epochs: both count updates, and save after updates 2,
    4, 6 and 8, each file holding the same weights; safeloop also saves its last step, 9 (docs/checkpoints.md: "at
    the end"; test_parity2's ``..._every_n_steps_differs_as_documented``)."""
    cb = pl.callbacks.ModelCheckpoint(dirpath=tmp_path / "lit", every_n_train_steps=2, save_top_k=-1, filename="{step}")
    lit = Lit()
    lightning(max_epochs=3, accumulate_grad_batches=3, enable_checkpointing=True, callbacks=[cb]).fit(
        lit, train_dataloaders=loader())
    port = Port(model=net(), train_data=loader(), optimizer=adam,
                checkpoint={"dir": str(tmp_path / "sl"), "every": 2, "keep": 100},
                **settings(max_epochs=3, grad_accum=3))
    port.fit()
    assert_same(lit.model, port.model)
    assert sorted(lightning_files(tmp_path / "lit").values()) == [2, 4, 6, 8]
    assert sorted(safeloop_files(tmp_path / "sl").values()) == [2, 4, 6, 8, 9]
    for step in (2, 4, 6, 8):
        theirs = torch.load(tmp_path / "lit" / f"step={step}.ckpt", weights_only=False)["state_dict"]
        ours = torch.load(tmp_path / "sl" / f"step-{step:09d}.pt", weights_only=True)["modules"]["model"]
        assert all(torch.equal(theirs[f"model.{name}"], value) for name, value in ours.items())


def test_every_hook_of_lightnings_callback_is_a_safeloop_hook_or_refused_naming_safeloops_way():
    """A port's callback may define any of Lightning's ``Callback`` hooks: each is one safeloop calls, or a
    ConfigError naming what does its work here; none is silently never called."""
    import inspect

    from safeloop.callbacks import HOOKS, LIGHTNING_NAMES
    names = [n for n, _ in inspect.getmembers(pl.Callback, inspect.isfunction) if not n.startswith("_")]
    assert len(names) > 30
    assert [n for n in names if n not in HOOKS and n not in LIGHTNING_NAMES] == []
