"""Evaluation code from public repositories, ported to safeloop and run beside pytorch-lightning: a validation that
needs gradients (pytorch/tutorials' FGSM robust accuracy), an EMA copy validated beside the model
(real-stanford/diffusion_policy), a torchmetrics metric that is no mean over samples (macro F1, logged per batch or
computed over the set after the validation and monitored by EarlyStopping), ``trainer.validate()`` and its
``on_validation_end``, ``predict`` from the best checkpoint, ``batch_idx`` in ``validation_step``, and Monte Carlo
dropout in ``predict_step`` (Lightning's docs).

As in ``test_parity.py``: ``..._matches`` tests compare what a user relies on; a difference the docs do not state is a
test asserting Lightning's behaviour, marked ``xfail(strict=True)`` with the reason.
"""
import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

pl = pytest.importorskip("pytorch_lightning")
torchmetrics = pytest.importorskip("torchmetrics")

import safeloop  # noqa: E402

from .common import assert_same, close, lightning, settings, sgd  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::Warning:pytorch_lightning", "ignore::Warning:lightning_fabric")
EPOCHS, STEPS = 2, 4  # passes of 4 batches: 14 samples in batches of 4, 4, 4, 2


def classes(n=14, batch=4, seed=1) -> DataLoader:
    """Three classes of 6 features; a smaller last batch."""
    gen = torch.Generator().manual_seed(seed)
    return DataLoader(TensorDataset(torch.randn(n, 6, generator=gen), torch.randint(0, 3, (n,), generator=gen)),
                      batch_size=batch)


def classifier(norm=False) -> nn.Module:
    torch.manual_seed(0)
    middle = [nn.BatchNorm1d(8)] if norm else []  # no dropout: Lightning's validation moves its masks (documented)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), *middle, nn.Linear(8, 3))


def ce(model, batch):
    x, y = batch
    return F.cross_entropy(model(x), y)


# -- pytorch/tutorials, beginner_source/fgsm_tutorial.py (commit 03cd4915be50f10014722c35b8b04736c145d199), test():
# the input's gradient for the Fast Gradient Sign attack, taken as written there (``model.zero_grad();
# loss.backward(); data.grad``) or with ``torch.autograd.grad``, which writes no ``.grad``. Reduced: batches instead
# of one image at a time, no skipping of misclassified images, the robust accuracy as a validation metric, a small
# MLP on seeded features instead of MNIST's LeNet.


def fgsm(model, batch, how, epsilon=0.05):
    """The batch's loss and its accuracy under the FGSM attack (``how``: ``"backward"`` as the tutorial, or
    ``"grad"``)."""
    x, y = batch
    with torch.enable_grad():
        x = x.clone().requires_grad_(True)
        loss = F.cross_entropy(model(x), y)
        if how == "backward":
            model.zero_grad()
            loss.backward()
            grad = x.grad
        else:
            (grad,) = torch.autograd.grad(loss, x)
    adversarial = model(torch.clamp(x + epsilon * grad.sign(), -3, 3))
    return loss.detach(), (adversarial.argmax(1) == y).float().mean()


class LitFGSM(pl.LightningModule):
    def __init__(self, how, automatic=True):
        super().__init__()
        self.model, self.how = classifier(), how
        self.automatic_optimization = automatic
        self.val = []

    def training_step(self, batch, batch_idx):
        loss = ce(self.model, batch)
        if not self.automatic_optimization:
            opt = self.optimizers()
            opt.zero_grad()
            self.manual_backward(loss)
            opt.step()
        return loss

    def validation_step(self, batch, batch_idx):
        loss, robust = fgsm(self.model, batch, self.how)
        self.log("val_loss", loss)
        self.log("val_robust", robust)

    def on_validation_epoch_end(self):
        metrics = self.trainer.callback_metrics
        self.val.append((float(metrics["val_loss"]), float(metrics["val_robust"])))

    def configure_optimizers(self):
        return sgd(self.model.parameters(), 0.1)


class PortFGSM(safeloop.Trainer):
    how = "grad"

    def training_step(self, batch):
        loss = ce(self.model, batch)
        if not self.automatic:
            self.backward(loss)
            self.step()
        return loss

    def validation_step(self, batch):
        loss, robust = fgsm(self.model, batch, self.how)
        return {"loss": loss, "robust": robust}


class PortFGSMManual(PortFGSM):
    automatic = False


def fgsm_runs(how, automatic=True):
    """Lightning (``inference_mode=False``: its validation runs under ``torch.inference_mode()`` otherwise, where no
    gradient can be taken) and the port, validating each epoch: both models and their (val_loss, val_robust)."""
    lit = LitFGSM(how, automatic)
    lightning(max_epochs=EPOCHS, inference_mode=False).fit(lit, train_dataloaders=classes(),
                                                           val_dataloaders=classes(n=10, seed=2))
    port = (PortFGSM if automatic else PortFGSMManual)(
        model=classifier(), train_data=classes(), val_data=classes(n=10, seed=2), optimizer=lambda p: sgd(p, 0.1),
        **settings(max_epochs=EPOCHS, val_every=STEPS))
    port.how = how
    port.fit()
    ours = [(m["val_loss"], m["val_robust"]) for s, m in port.state.val_history if s]  # the one before training aside
    return lit, port, ours


@pytest.mark.parametrize("automatic", [True, False], ids=["automatic", "manual"])
def test_fgsm_robust_accuracy_in_validation_with_autograd_grad_matches(automatic):
    """A validation that needs gradients (docs/trainer.md: validation runs under ``torch.no_grad()``, which
    ``torch.enable_grad()`` lifts): the attack's input gradient taken with ``torch.autograd.grad``. The parameters,
    and each validation's loss and robust accuracy (to 1e-6)."""
    lit, port, ours = fgsm_runs("grad", automatic)
    assert_same(lit.model, port.model)
    assert len(lit.val) == len(ours) == EPOCHS
    assert all(close(a, b) for pair_a, pair_b in zip(lit.val, ours) for a, b in zip(pair_a, pair_b))


def test_fgsm_in_validation_as_written_with_loss_backward_matches():
    """The tutorial's ``model.zero_grad(); loss.backward(); data.grad`` in ``validation_step``: Lightning (and a hand
    loop, whose ``zero_grad`` comes before each training backward) trains as with ``autograd.grad``."""
    lit, port, ours = fgsm_runs("backward")
    assert_same(lit.model, port.model)


def test_fgsm_in_validation_as_written_with_loss_backward_in_manual_mode_matches():
    """As above, in manual mode (Lightning's ``opt.zero_grad(); self.manual_backward(loss); opt.step()``, the port's
    ``self.backward(loss); self.step()``)."""
    lit, port, ours = fgsm_runs("backward", automatic=False)
    assert_same(lit.model, port.model)


# -- real-stanford/diffusion_policy, diffusion_policy/workspace/train_diffusion_unet_lowdim_workspace.py (commit
# 7139ef1860c94bc0a3162cec525806133a3b6003): ``self.ema_model = copy.deepcopy(self.model)`` beside the model, moved
# towards it after each update, and validated after ``policy.eval()``. Reduced: a classifier with BatchNorm
# instead of the diffusion policy, timm's ModelEmaV2 update rule (decay * ema + (1 - decay) * model, every
# floating entry of the state dict), both models' losses as validation metrics. In Lightning the copy is an attribute
# of the LightningModule, which its validation puts in eval mode with the rest; in the port it is kept on the Trainer
# and returned from ``modules()`` (docs/trainer.md: "return an EMA copy or a target network from ``modules()``").


def ema_update(ema: nn.Module, model: nn.Module, decay=0.5) -> None:
    with torch.no_grad():
        for e, m in zip(ema.state_dict().values(), model.state_dict().values()):
            if e.is_floating_point():
                e.copy_(decay * e + (1 - decay) * m)
            else:
                e.copy_(m)


class LitEMA(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.model = classifier(norm=True)
        self.ema_model = copy.deepcopy(self.model).requires_grad_(False)
        self.val = []

    def training_step(self, batch, batch_idx):
        return ce(self.model, batch)

    def on_train_batch_end(self, outputs, batch, batch_idx):
        ema_update(self.ema_model, self.model)

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", ce(self.model, batch))
        self.log("val_ema", ce(self.ema_model, batch))

    def on_validation_epoch_end(self):
        self.val.append(float(self.trainer.callback_metrics["val_ema"]))

    def configure_optimizers(self):
        return sgd(self.model.parameters(), 0.1)


class PortEMA(safeloop.Trainer):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.ema_model = copy.deepcopy(self.model).requires_grad_(False)

    def modules(self):
        return {"model": self.model, "ema_model": self.ema_model}

    def training_step(self, batch):
        return ce(self.model, batch)

    def on_step_end(self, losses):
        ema_update(self.ema_model, self.model)

    def validation_step(self, batch):
        return {"loss": ce(self.model, batch), "ema": ce(self.ema_model, batch)}


def test_ema_copy_validated_beside_the_model_matches():
    """Validation each epoch: the EMA copy's loss at each validation (to 1e-6), and its BatchNorm statistics after
    the fit (moved by the EMA updates only, in both)."""
    lit = LitEMA()
    lightning(max_epochs=EPOCHS).fit(lit, train_dataloaders=classes(), val_dataloaders=classes(n=10, seed=2))
    port = PortEMA(model=classifier(norm=True), train_data=classes(), val_data=classes(n=10, seed=2),
                   optimizer=lambda p: sgd(p, 0.1), **settings(max_epochs=EPOCHS, val_every=STEPS))
    port.fit()
    assert_same(lit.model, port.model)
    ours = [m["val_ema"] for s, m in port.state.val_history if s]
    assert len(lit.val) == len(ours) == EPOCHS
    assert all(close(a, b) for a, b in zip(lit.val, ours)), (lit.val, ours)
    assert_same(lit.ema_model, port.ema_model)


# -- torchmetrics in validation, as Lightning's docs log it (``self.log(name, metric_object)``, computed over the
# epoch) and as safeloop's refusal says to port it (``self.log(name, metric(preds, target))``: the batch's value,
# averaged over the samples). The two agree for a metric that is a mean over samples (accuracy: test_parity4.py);
# macro F1 is not one.


class LitF1(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.model = classifier()
        self.f1 = torchmetrics.F1Score(task="multiclass", num_classes=3, average="macro")
        self.val = []

    def training_step(self, batch, batch_idx):
        return ce(self.model, batch)

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.f1(self.model(x), y)
        self.log("val_f1", self.f1)

    def on_validation_epoch_end(self):
        self.val.append(float(self.trainer.callback_metrics["val_f1"]))

    def configure_optimizers(self):
        return sgd(self.model.parameters(), 0.1)


class PortF1(safeloop.Trainer):
    """Ported as ``logged_value``'s ConfigError says: "log what it returns for the batch"."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.f1 = torchmetrics.F1Score(task="multiclass", num_classes=3, average="macro")

    def training_step(self, batch):
        return ce(self.model, batch)

    def validation_step(self, batch):
        x, y = batch
        self.log("val_f1", self.f1(self.model(x), y))


def test_macro_f1_ported_as_the_refusal_says_matches():
    """Macro F1 over the validation set (Lightning: the Metric's epoch value), validation each epoch, against the port
    the ConfigError gives for a metric that is no mean over samples: ``update`` in ``validation_step``, ``compute``
    into ``metrics`` in ``on_validation_end``. (``PortF1``, the batch's value averaged over the samples, is the port
    for a mean such as accuracy: for macro F1 it is another number.)"""
    lit = LitF1()
    lightning(max_epochs=EPOCHS).fit(lit, train_dataloaders=classes(), val_dataloaders=classes(n=10, seed=2))
    port = PortF1Epoch(model=classifier(), train_data=classes(), val_data=classes(n=10, seed=2),
                       optimizer=lambda p: sgd(p, 0.1), **settings(max_epochs=EPOCHS, val_every=STEPS))
    port.fit()
    assert_same(lit.model, port.model)
    ours = [m["val_f1"] for s, m in port.state.val_history if s]
    assert len(ours) == EPOCHS and all(close(a, b) for a, b in zip(lit.val, ours)), (lit.val, ours)
    batch_means = PortF1(model=classifier(), train_data=classes(), val_data=classes(n=10, seed=2),
                         optimizer=lambda p: sgd(p, 0.1), **settings(max_epochs=EPOCHS, val_every=STEPS))
    batch_means.fit()
    assert not all(close(a, m["val_f1"]) for a, (s, m) in zip(lit.val, batch_means.state.val_history[1:]))


# -- trainer.validate() before any fit, and its on_validation_end (docs/trainer.md, Hooks: "on_validation_end(metrics):
# after each validation"; Validation: "trainer.validate() runs one validation")


class LitSeen(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.model = classifier()
        self.seen = []

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", ce(self.model, batch))

    def on_validation_end(self):
        self.seen.append(float(self.trainer.callback_metrics["val_loss"]))


class PortSeen(safeloop.Trainer):
    seen: list

    def validation_step(self, batch):
        return ce(self.model, batch)

    def on_validation_end(self, metrics):
        self.seen.append(metrics["val_loss"])


class Recorder(safeloop.Callback):
    def __init__(self):
        self.seen = []

    def on_validation_end(self, trainer, metrics):
        self.seen.append(metrics["val_loss"])


def test_on_validation_end_of_a_validate_before_fit_matches():
    """``trainer.validate(model, dataloaders)`` before any fit (evaluating a loaded model): Lightning calls
    ``on_validation_end``; so should safeloop's ``trainer.validate()``, the Trainer's hook and a callback's."""
    lit = LitSeen()
    lightning().validate(lit, dataloaders=classes(n=10, seed=2), verbose=False)
    callback = Recorder()
    port = PortSeen(model=classifier(), train_data=classes(), val_data=classes(n=10, seed=2),
                    optimizer=lambda p: sgd(p, 0.1), callbacks=[callback], **settings(max_steps=1))
    port.seen = []
    metrics = port.validate()
    assert len(lit.seen) == 1 and close(lit.seen[0], metrics["val_loss"])
    assert port.seen == callback.seen == [metrics["val_loss"]]


# -- predict from the best checkpoint: Lightning's ``trainer.predict(model, dataloaders, ckpt_path="best")``, and
# safeloop's way (docs/checkpoints.md: "A checkpoint is trainer.state_dict() ... also work by hand, after
# trainer.setup()"; docs/trainer.md: ``trainer.checkpointer.best``)


class LitPredict(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.model = classifier(norm=True)

    def training_step(self, batch, batch_idx):
        return ce(self.model, batch)

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", ce(self.model, batch))

    def predict_step(self, batch, batch_idx):
        return self.model(batch[0])

    def configure_optimizers(self):
        return sgd(self.model.parameters(), 0.5)


class PortPredict(safeloop.Trainer):
    def training_step(self, batch):
        return ce(self.model, batch)

    def validation_step(self, batch):
        return ce(self.model, batch)


def test_predict_from_the_best_checkpoint_after_fit_matches(tmp_path):
    """``ModelCheckpoint(monitor="val_loss", save_top_k=1)`` and ``predict(ckpt_path="best")`` against
    ``checkpoint={"monitor": "val_loss", "keep": 1}``, then a new Trainer loading ``checkpointer.best`` and
    predicting; 4 epochs at a learning rate where the loss goes up again. The best step, and each batch's
    predictions (eval mode: BatchNorm's running statistics) bit for bit, in order, a smaller last batch
    included."""
    cb = pl.callbacks.ModelCheckpoint(dirpath=tmp_path / "lit", filename="{step}", monitor="val_loss", save_top_k=1)
    lit = LitPredict()
    trainer = lightning(max_epochs=4, enable_checkpointing=True, callbacks=[cb])
    trainer.fit(lit, train_dataloaders=classes(), val_dataloaders=classes(n=10, seed=2))
    final = copy.deepcopy(lit.model)
    theirs = trainer.predict(lit, dataloaders=classes(n=10, seed=3), ckpt_path="best")

    run = dict(train_data=classes(), val_data=classes(n=10, seed=2), optimizer=lambda p: sgd(p, 0.5),
               **settings(max_epochs=4, val_every=STEPS))
    port = PortPredict(model=classifier(norm=True), checkpoint={"dir": str(tmp_path / "sl"), "monitor": "val_loss",
                                                                "keep": 1}, **run)
    port.fit()
    assert_same(final, port.model)
    best = torch.load(port.checkpointer.best, weights_only=True)
    assert best["step"] == torch.load(cb.best_model_path, weights_only=False)["global_step"]
    fresh = PortPredict(model=classifier(norm=True), checkpoint=False, **run)
    fresh.setup()
    fresh.load_state_dict(best)
    ours = fresh.predict(classes(n=10, seed=3))
    assert [len(p) for p in ours] == [4, 4, 2]
    assert len(theirs) == len(ours) and all(torch.equal(a, b) for a, b in zip(theirs, ours))
    assert all(m.training for m in fresh.model.modules())  # train mode given back


# -- batch_idx in validation_step (Lightning's examples log sample images when ``batch_idx == 0``): the ConfigError
# for a ``validation_step(batch, batch_idx)`` kept from Lightning says to drop it and keep a count of one's own


class LitIdx(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.model = classifier()
        self.idx = []

    def training_step(self, batch, batch_idx):
        return ce(self.model, batch)

    def validation_step(self, batch, batch_idx):
        self.idx.append(batch_idx)
        self.log("val_loss", ce(self.model, batch))

    def configure_optimizers(self):
        return sgd(self.model.parameters(), 0.1)


class PortIdxKept(safeloop.Trainer):
    def training_step(self, batch):
        return ce(self.model, batch)

    def validation_step(self, batch, batch_idx):
        return ce(self.model, batch)


class PortIdx(PortIdxKept):
    """Ported as the message says: a count of its own, back to 0 when a validation ends."""

    idx: list
    count = 0

    def validation_step(self, batch):
        self.idx.append(self.count)
        self.count += 1
        return ce(self.model, batch)

    def on_validation_end(self, metrics):
        self.count = 0


def test_batch_idx_in_validation_step_is_refused_saying_nothing_counts_evaluation_batches():
    """Validation each epoch over 3 batches: Lightning's ``batch_idx`` is 0, 1, 2 at each. The refusal of
    ``validation_step(batch, batch_idx)`` does not send the port to ``self.state.batch_in_epoch``, which counts the
    training pass's batches and stays put during a validation."""
    run = dict(model=classifier(), train_data=classes(), val_data=classes(n=10, seed=2),
               optimizer=lambda p: sgd(p, 0.1), **settings(max_epochs=EPOCHS, val_every=STEPS))
    with pytest.raises(safeloop.ConfigError, match=r"drop batch_idx \(Lightning's batch_idx: nothing counts an "
                                                   r"evaluation's batches: keep a count of your own"):
        PortIdxKept(**run).fit()
    lit = LitIdx()
    lightning(max_epochs=EPOCHS).fit(lit, train_dataloaders=classes(), val_dataloaders=classes(n=10, seed=2))
    port = PortIdx(**{**run, "model": classifier()})
    port.idx = []
    port.fit()
    assert lit.idx == [0, 1, 2] * EPOCHS
    assert port.idx[3:] == lit.idx  # (the port validates before training too)


# -- the same macro F1 computed over the whole validation set, Lightning's other documented way: ``update`` in
# ``validation_step``, ``self.log(name, metric.compute())`` and ``reset()`` in ``on_validation_epoch_end``, monitored by
# EarlyStopping. Ported to ``on_validation_end(metrics)`` (docs/trainer.md's map), the value logged there is written
# with the next step's losses, and is no validation metric.


class LitF1Epoch(LitF1):
    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.f1.update(self.model(x), y)
        self.log("val_loss", ce(self.model, batch))

    def on_validation_epoch_end(self):
        self.log("val_f1", self.f1.compute())
        self.f1.reset()
        self.val.append(float(self.trainer.callback_metrics["val_f1"]))


class PortF1Epoch(PortF1):
    def validation_step(self, batch):
        x, y = batch
        self.f1.update(self.model(x), y)
        return ce(self.model, batch)

    def on_validation_end(self, metrics):
        metrics["val_f1"] = float(self.f1.compute())
        self.f1.reset()


def test_epoch_level_metric_logged_after_validation_monitored_by_early_stopping_matches():
    """``EarlyStopping(monitor="val_f1", mode="max", patience=1)``, validation each epoch, 4 epochs: the step
    training stopped after and each validation's F1."""
    rule = dict(monitor="val_f1", mode="max", patience=1)
    lit = LitF1Epoch()
    trainer = lightning(max_epochs=4, callbacks=[pl.callbacks.EarlyStopping(**rule)])
    trainer.fit(lit, train_dataloaders=classes(), val_dataloaders=classes(n=10, seed=2))
    port = PortF1Epoch(model=classifier(), train_data=classes(), val_data=classes(n=10, seed=2),
                       optimizer=lambda p: sgd(p, 0.1), callbacks=[safeloop.EarlyStopping(**rule)],
                       **settings(max_epochs=4, val_every=STEPS))
    port.fit()
    assert port.state.step == trainer.global_step
    assert all(close(a, m["val_f1"]) for a, (s, m) in zip(lit.val, port.state.val_history[1:]))


# -- Lightning-AI/pytorch-lightning, docs/source-pytorch/deploy/production_basic.rst (commit
# d10e0054f01f5fa92e5d102d55b53f29e6600853), ``LitMCdropoutModel``: Monte Carlo dropout in ``predict_step``,
# ``self.dropout.train()`` then the mean of ``mc_iteration`` passes, as written there (its model a small MLP). Then the
# same sampled over calls: one pass per ``predict`` call, ``predict`` called 4 times without training between.


class LitMCdropoutModel(pl.LightningModule):
    def __init__(self, model, mc_iteration):
        super().__init__()
        self.model = model
        self.dropout = nn.Dropout()
        self.mc_iteration = mc_iteration

    def predict_step(self, batch, batch_idx):
        # enable Monte Carlo Dropout
        self.dropout.train()

        # take average of `self.mc_iteration` iterations
        pred = torch.vstack([self.dropout(self.model(batch[0])).unsqueeze(0) for _ in range(self.mc_iteration)]).mean(
            dim=0)
        return pred


class PortMCdropout(safeloop.Trainer):
    mc_iteration = 5

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.dropout = nn.Dropout()

    def predict_step(self, batch):
        self.dropout.train()
        return torch.vstack([self.dropout(self.model(batch[0])).unsqueeze(0) for _ in range(self.mc_iteration)]).mean(
            dim=0)


def mc_predictions(mc_iteration, calls):
    """``calls`` predictions of each framework, each from the same seed at the first call."""
    data = classes(n=10, seed=3)
    lit, trainer = LitMCdropoutModel(classifier(), mc_iteration), lightning()
    port = type("Port", (PortMCdropout,), {"mc_iteration": mc_iteration})(
        model=classifier(), train_data=classes(), optimizer=lambda p: sgd(p), **settings(max_steps=1))
    torch.manual_seed(7)
    theirs = [torch.cat(trainer.predict(lit, dataloaders=data)) for _ in range(calls)]
    torch.manual_seed(7)
    ours = [torch.cat(port.predict(data)) for _ in range(calls)]
    return theirs, ours


def test_monte_carlo_dropout_predict_step_matches():
    """The documented ``LitMCdropoutModel`` with ``mc_iteration=5``: the predictions bit for bit."""
    (theirs,), (ours,) = mc_predictions(5, calls=1)
    assert torch.equal(theirs, ours)


def test_monte_carlo_dropout_over_repeated_predict_calls_matches():
    """One pass per call, 4 calls: Lightning's samples differ from call to call; so should the port's. The first
    call's are bit for bit Lightning's."""
    theirs, ours = mc_predictions(1, calls=4)
    assert torch.equal(theirs[0], ours[0])
    assert not torch.equal(theirs[0], theirs[1])
    assert not torch.equal(ours[0], ours[1])
