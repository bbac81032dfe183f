"""safeloop's Trainer against pytorch-lightning's, bit for bit: what docs/trainer.md's "Coming from Lightning" says.

Each test trains the same tiny seeded model on the same batches with ``pytorch_lightning.Trainer`` (on the CPU:
no logger, checkpoint, progress bar, summary or sanity check) and with its port to ``safeloop.Trainer``, and
compares what a user relies on: every parameter with ``torch.equal``, the learning rate of each update, the hooks'
order and what they receive where the docs say "the same". Each difference docs/trainer.md documents has a test
``test_..._differs_as_documented`` asserting that difference exactly, so that the docs are checked against Lightning
too. Lightning is not a dependency: the module is skipped without it. To run it::

    pip install pytorch-lightning
    python -m pytest tests/lightning -n 0
"""
import math
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import BatchSampler, DataLoader
from torch.utils.data.distributed import DistributedSampler

pl = pytest.importorskip("pytorch_lightning")

import safeloop  # noqa: E402
from safeloop import ConfigError, StepError  # noqa: E402

from .common import (HOOKS, Lit, LitScored, Noisy, Port, PortScored, adam, assert_equal_tensors,  # noqa: E402
                     assert_same, close, dataset, lightning, loader, max_diff, mse, net, settings, sgd)

EPOCHS, STEPS = 2, 7  # passes of 7 batches by default
# Lightning's advice (no val_dataloader, modules in eval mode, fp16 on the CPU) and its deprecations
pytestmark = pytest.mark.filterwarnings("ignore::Warning:pytorch_lightning", "ignore::Warning:lightning_fabric")


class Recorded:
    """Hooks that append their safeloop name to ``self.calls`` (Lightning's under their own names, mapped)."""

    calls: list


def recorded(cls, names):
    """``cls`` whose hooks ``names`` (Lightning's or safeloop's) each append safeloop's name to ``self.calls``."""
    def hook(ours, inherited):
        def fn(self, *args):
            self.calls.append(ours)
            return inherited(self, *args)
        return fn
    return type(cls.__name__, (cls, Recorded), {name: hook(HOOKS.get(name, name), getattr(cls, name))
                                                 for name in names})


# -- one optimizer, automatic optimization


def test_adam_two_epochs_parameters_hook_order_and_losses_match():
    """Two epochs of Adam, validation each epoch (safeloop: ``val_every`` = one pass's steps): the parameters, the
    steps, the losses ``on_before_backward`` receives and every hook's order. safeloop also validates before
    training (docs/trainer.md, Validation), left out of the order compared."""
    class LitAdam(recorded(Lit, HOOKS)):
        def on_before_backward(self, loss):
            super().on_before_backward(loss)
            self.losses.append(loss.detach().clone())

        def on_validation_end(self):
            super().on_validation_end()
            self.val.append(float(self.trainer.callback_metrics["val_loss"]))

    class PortAdam(recorded(Port, HOOKS.values())):
        losses: list
        val: list

        def on_before_backward(self, name, loss):
            super().on_before_backward(name, loss)
            self.losses.append(loss.detach().clone())

        def on_validation_end(self, metrics):
            super().on_validation_end(metrics)
            self.val.append(metrics["val_loss"])

    lit = LitAdam()
    lit.calls, lit.losses, lit.val = [], [], []
    lightning(max_epochs=EPOCHS).fit(lit, train_dataloaders=loader(), val_dataloaders=loader(n=6, seed=2))
    model = net()
    port = PortAdam(model=model, train_data=loader(), val_data=loader(n=6, seed=2), optimizer=adam,
                    **settings(max_epochs=EPOCHS, val_every=STEPS))
    port.calls, port.losses, port.val = [], [], []
    port.fit()

    assert_same(lit.model, model)
    assert lit.trainer.global_step == port.state.step == EPOCHS * STEPS
    assert_equal_tensors(lit.losses, port.losses)
    assert port.calls[:2] == ["on_fit_start", "on_validation_end"]  # the validation before training: safeloop's own
    assert lit.calls == port.calls[:1] + port.calls[2:]
    assert len(lit.val) == len(port.val) - 1 and all(close(a, b) for a, b in zip(lit.val, port.val[1:]))


def test_accumulation_with_a_short_tail_matches():
    """``accumulate_grad_batches=3`` / ``grad_accum=3`` over passes of 7 batches (two updates of 3, a tail of 1),
    two passes: the parameters, the gradients ``on_before_optimizer_step`` sees, the hooks' order, and the loss
    ``on_before_backward`` receives: divided by 3 in both (the tail's too)."""
    names = ["on_train_epoch_start", "on_before_backward", "on_after_backward", "on_before_optimizer_step",
             "on_train_epoch_end"]

    class LitAccum(recorded(Lit, names)):
        def training_step(self, batch, batch_idx):
            loss = super().training_step(batch, batch_idx)
            self.returned.append(loss.detach().clone())
            return loss

        def on_before_backward(self, loss):
            super().on_before_backward(loss)
            self.seen.append(loss.detach().clone())

        def on_before_optimizer_step(self, optimizer):
            super().on_before_optimizer_step(optimizer)
            self.grads.append(self.model[0].weight.grad.clone())

    class PortAccum(recorded(Port, [HOOKS[n] for n in names])):
        seen: list
        returned: list
        grads: list

        def training_step(self, batch):
            loss = super().training_step(batch)
            self.returned.append(loss.detach().clone())
            return loss

        def on_before_backward(self, name, loss):
            super().on_before_backward(name, loss)
            self.seen.append(loss.detach().clone())

        def on_before_optimizer_step(self, name, optimizer):
            super().on_before_optimizer_step(name, optimizer)
            self.grads.append(self.model[0].weight.grad.clone())

    lit = LitAccum(configure=lambda m: sgd(m.parameters()))
    lit.calls, lit.seen, lit.returned, lit.grads = [], [], [], []
    lightning(max_epochs=EPOCHS, accumulate_grad_batches=3).fit(lit, train_dataloaders=loader())
    model = net()
    port = PortAccum(model=model, train_data=loader(), optimizer=sgd, **settings(max_epochs=EPOCHS, grad_accum=3))
    port.calls, port.seen, port.returned, port.grads = [], [], [], []
    port.fit()

    assert_same(lit.model, model)
    assert lit.trainer.global_step == port.state.step == EPOCHS * 3
    assert_equal_tensors(lit.grads, port.grads)
    assert_equal_tensors(lit.returned, port.returned)
    assert len(lit.seen) == len(port.seen) == EPOCHS * STEPS  # the loss back-propagated: divided by 3 in both
    assert_equal_tensors(lit.seen, port.seen)
    assert all(torch.equal(seen, loss / 3) for seen, loss in zip(lit.seen, lit.returned))
    assert lit.calls == port.calls


def test_batch_hooks_under_accumulation_differs_as_documented():
    """docs/trainer.md: ``on_step_start`` / ``on_step_end`` run once per optimizer update, where Lightning's
    ``on_train_batch_start`` / ``on_train_batch_end`` run once per micro-batch under accumulation."""
    class LitBatches(Lit):
        def on_train_batch_start(self, batch, batch_idx):
            self.calls.append(("start", batch_idx))

        def on_train_batch_end(self, outputs, batch, batch_idx):
            self.calls.append(("end", batch_idx))

    class PortSteps(Port):
        calls: list

        def on_step_start(self):
            self.calls.append(("start", self.state.step))

        def on_step_end(self, losses):
            self.calls.append(("end", self.state.step))

    lit = LitBatches()
    lit.calls = []
    lightning(max_epochs=1, accumulate_grad_batches=3).fit(lit, train_dataloaders=loader())
    port = PortSteps(model=net(), train_data=loader(), optimizer=adam, **settings(max_epochs=1, grad_accum=3))
    port.calls = []
    port.fit()

    assert lit.calls == [(hook, i) for i in range(STEPS) for hook in ("start", "end")]  # 7 micro-batches
    assert port.calls == [("start", 0), ("end", 1), ("start", 1), ("end", 2), ("start", 2), ("end", 3)]  # 3 updates


def decay_groups(model):
    """nanoGPT's decay / no-decay groups: the parameters not in the model's order."""
    params = list(model.parameters())
    return torch.optim.AdamW([{"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
                              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}], lr=1e-2)


def grad_norm(model):
    return float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(p.grad) for p in model.parameters()])))


class LitNorms(Lit):
    def on_before_optimizer_step(self, optimizer):
        self.norms.append(grad_norm(self.model))


class PortNorms(Port):
    norms: list

    def on_before_optimizer_step(self, name, optimizer):
        self.norms.append(grad_norm(self.model))


def clipped_runs(configure, width, clip=0.05):
    lit = LitNorms(net(width=width), configure)
    lit.norms = []
    lightning(max_epochs=EPOCHS, gradient_clip_val=clip).fit(lit, train_dataloaders=loader())
    model = net(width=width)
    port = PortNorms(model=model, train_data=loader(), optimizer=lambda params: configure(model),
                     **settings(max_epochs=EPOCHS, grad_clip=clip))
    port.norms = []
    port.fit()
    return lit, port


def test_gradient_clipping_with_one_parameter_group_matches():
    """``gradient_clip_val`` / ``grad_clip``: the parameters, and the gradients' norm ``on_before_optimizer_step``
    sees, before clipping in both (docs/trainer.md: "after on_before_optimizer_step as in Lightning")."""
    lit, port = clipped_runs(lambda m: adam(m.parameters()), width=8)
    assert_same(lit.model, port.model)
    assert lit.norms == port.norms and min(port.norms) > 0.05


def test_gradient_clipping_with_decay_groups_differs_as_documented():
    """docs/trainer.md: safeloop sums the norm in the model's parameter order, as ``clip_grad_norm_(
    model.parameters())`` in a hand loop; Lightning in the optimizer's group order, so with several groups its last
    bits may differ. Each equals the hand loop clipping in its order, bit for bit; the two differ in the last bits
    (at width 16; at 8 the orders happen to give the same bits)."""
    lit, port = clipped_runs(decay_groups, width=16)

    def hand(order):
        model = net(width=16)
        opt = decay_groups(model)
        for _ in range(EPOCHS):
            for batch in loader():
                mse(model, batch).backward()
                params = list(model.parameters()) if order == "model" else [
                    p for group in opt.param_groups for p in group["params"]]
                torch.nn.utils.clip_grad_norm_(params, 0.05)
                opt.step()
                opt.zero_grad()
        return model

    assert_same(hand("model"), port.model)
    assert_same(hand("groups"), lit.model)
    assert 0 < max_diff(lit.model, port.model) < 1e-6


# -- learning-rate schedules


def step_lr(config):
    """SGD with momentum and StepLR(step_size=1, gamma=0.8), given as Lightning's dict (``config``: the scheduler
    dict's other keys; None: the scheduler alone as ``lr_scheduler``)."""
    def configure(model):
        opt = sgd(model.parameters())
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.8)
        return {"optimizer": opt, "lr_scheduler": sched if config is None else {"scheduler": sched, **config}}
    return configure


class LitLrs(Lit):
    """The learning rate of each update, and the one the epoch-end hook sees."""

    def on_before_optimizer_step(self, optimizer):
        self.lrs.append(optimizer.param_groups[0]["lr"])

    def on_train_epoch_end(self):
        self.epoch_lrs.append(self.optimizers().param_groups[0]["lr"])


class PortLrs(Port):
    lrs: list
    epoch_lrs: list

    def on_before_optimizer_step(self, name, optimizer):
        self.lrs.append(optimizer.param_groups[0]["lr"])

    def on_epoch_end(self):
        self.epoch_lrs.append(self.optimizers["optimizer"].param_groups[0]["lr"])


def scheduled_runs(configure, epochs=3, val_data=None, val_every=None, safeloop_configure=None, **both):
    """One Lightning run (validating each epoch with ``val_data``) and its port (``val_every``), ``both``: the
    accumulation. ``safeloop_configure``: the port's own optimizers and schedulers, where they differ."""
    lit = LitLrs(configure=configure)
    lit.lrs, lit.epoch_lrs = [], []
    lightning(max_epochs=epochs, accumulate_grad_batches=both.get("grad_accum", 1)).fit(
        lit, train_dataloaders=loader(), val_dataloaders=val_data)
    cls = type("PortLrs", (PortLrs,), {"configure": staticmethod(safeloop_configure or configure)})
    port = cls(model=net(), train_data=loader(), val_data=val_data,
               **settings(max_epochs=epochs, val_every=val_every, **both))
    port.lrs, port.epoch_lrs = [], []
    return lit, port


@pytest.mark.parametrize("config, accum", [(None, 1), ({"interval": "step"}, 3), ({"interval": "epoch"}, 3)],
                         ids=["scheduler alone", "interval step", "interval epoch"])
def test_scheduler_dict_steps_as_lightning_steps_it(config, accum):
    """Lightning's ``{"optimizer": opt, "lr_scheduler": ...}``: the scheduler alone and a dict without
    ``interval`` step once per epoch, ``"step"`` after every update (under accumulation: per update, the tail's
    too). The parameters, the learning rate of every update, and the one the epoch-end hook sees: the next
    epoch's in both (docs/trainer.md, Hooks)."""
    lit, port = scheduled_runs(step_lr(config), grad_accum=accum)
    port.fit()
    assert_same(lit.model, port.model)
    assert lit.lrs == port.lrs and len(set(port.lrs)) > 1
    assert lit.epoch_lrs == port.epoch_lrs


@pytest.mark.parametrize("key, value", [("frequency", 2), ("strict", False)])
def test_scheduler_frequency_and_strict_differs_as_documented(key, value):
    """docs/trainer.md: "Lightning's frequency, strict and name keys are not supported (an error at start-up)".
    Lightning trains with them; safeloop raises a ConfigError naming the key before its first step ('name':
    test_parity4.py)."""
    config = {"interval": "epoch", key: value}
    lit, port = scheduled_runs(step_lr(config))
    assert lit.trainer.global_step == 3 * STEPS
    with pytest.raises(ConfigError, match=f"keys .*'{key}'"):
        port.fit()
    assert port.state.step == 0 and port.lrs == []
    assert_same(net(), port.model)


@pytest.mark.parametrize("interval", ["epoch", "step"])
def test_monitor_on_a_scheduler_without_a_metric_differs_as_documented(interval):
    """docs/trainer.md: a ``monitor`` on a scheduler whose ``step()`` takes no metric (StepLR) is an error at
    start-up; Lightning ignores such a monitor: it trains as without it, bit for bit."""
    monitored = step_lr({"interval": interval, "monitor": "val_loss"})
    val = loader(n=4, seed=2)
    lit, port = scheduled_runs(monitored, val_data=val, val_every=STEPS)
    plain, _ = scheduled_runs(step_lr({"interval": interval}))
    assert_same(plain.model, lit.model)
    assert lit.lrs == plain.lrs and len(set(lit.lrs)) > 1
    with pytest.raises(ConfigError, match=r"\(StepLR\) monitors 'val_loss', and its step\(\) takes no metric"):
        port.fit()
    assert port.state.step == 0


def plateau(model):
    """ReduceLROnPlateau on ``val_loss``, Lightning's default interval; its threshold large, so that it reduces at
    most validations (patience 0)."""
    opt = torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9)
    sched = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, factor=0.5, patience=0, threshold=0.2)
    return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "monitor": "val_loss"}}


class LitPlateau(LitLrs):
    def on_validation_end(self):
        self.validated.append((self.trainer.global_step, self.trainer.callback_metrics["val_loss"].clone()))


class PortPlateau(PortLrs):
    validated: list
    configure = staticmethod(plateau)

    def on_validation_end(self, metrics):
        self.validated.append((self.state.step, metrics["val_loss"]))


def plateau_runs(lightning_validation, val_every, epochs=4):
    lit = LitPlateau(configure=plateau)
    lit.lrs, lit.epoch_lrs, lit.validated = [], [], []
    lightning(max_epochs=epochs, **lightning_validation).fit(lit, train_dataloaders=loader(),
                                                              val_dataloaders=loader(n=6, seed=2))
    port = PortPlateau(model=net(), train_data=loader(), val_data=loader(n=6, seed=2),
                       **settings(max_epochs=epochs, val_every=val_every))
    port.lrs, port.epoch_lrs, port.validated = [], [], []
    port.fit()
    return lit, port


def test_plateau_with_validation_each_epoch_matches():
    """ReduceLROnPlateau with ``monitor``, validation every epoch (safeloop: ``val_every`` = one pass's steps, as
    docs/trainer.md says): the steps validated after (safeloop's validation before training aside), the learning
    rate of every update, the parameters."""
    lit, port = plateau_runs({}, STEPS)
    assert [s for s, _ in port.validated] == [0] + [s for s, _ in lit.validated]
    assert lit.lrs == port.lrs and len(set(port.lrs)) > 2
    assert_same(lit.model, port.model)


def plateau_lrs(updates, stepped_after):
    """The learning rate of each of ``updates`` updates under ``plateau``, stepped after update k with the metric
    ``stepped_after[k]``."""
    sched = plateau(nn.Linear(1, 1))["lr_scheduler"]["scheduler"]
    lrs = []
    for k in range(1, updates + 1):
        lrs.append(sched.optimizer.param_groups[0]["lr"])
        if k in stepped_after:
            sched.step(stepped_after[k])
    return lrs


def test_plateau_with_validation_more_often_than_each_epoch_differs_as_documented():
    """docs/trainer.md: "With validation more often than once a pass, the scheduler steps at each one; Lightning's
    steps once per epoch, on the last value." Validation every 3 batches of 7-batch passes (Lightning:
    ``val_check_interval=3, check_val_every_n_epoch=None``; safeloop: ``val_every=3``), 4 passes: each run's
    learning rates are a plateau's stepped as the docs say, with the values that run's validations gave."""
    lit, port = plateau_runs({"val_check_interval": 3, "check_val_every_n_epoch": None}, 3)
    updates = 4 * STEPS
    assert [s for s, _ in lit.validated] == list(range(3, updates + 1, 3))
    last = {end: [value for s, value in lit.validated if s <= end][-1] for end in range(STEPS, updates, STEPS)}
    assert lit.lrs == plateau_lrs(updates, last)
    assert [s for s, _ in port.validated] == [0] + list(range(3, updates + 1, 3)) + [updates]  # before, at the end
    assert port.lrs == plateau_lrs(updates, {s: value for s, value in port.validated if 0 < s < updates})
    assert port.lrs != lit.lrs


# -- early stopping


class LitEarly(LitScored):
    def on_validation_end(self):
        self.val.append((self.trainer.global_step, float(self.trainer.callback_metrics[self.monitor])))


class PortEarly(PortScored):
    val: list
    monitor: str

    def on_validation_end(self, metrics):
        self.val.append((self.state.step, metrics[self.monitor]))


@pytest.mark.parametrize("val_every, lr, rule", [
    (STEPS, 0.1, dict(patience=2)),
    (3, 0.2, dict(patience=3)),
    (3, 0.02, dict(patience=2, min_delta=0.05)),
    (3, 0.02, dict(patience=2, min_delta=0.05, monitor="val_score", mode="max"))],
    ids=["each epoch", "every 3 batches, mid-epoch", "min_delta", "mode max"])
def test_early_stopping_matches(val_every, lr, rule):
    """``EarlyStopping`` (docs/trainer.md: "the same names and rule"), validation each epoch or every 3 batches
    (``val_check_interval=3, check_val_every_n_epoch=None``), stopping mid-epoch too: the step training stopped
    after, each validation's step and value (to 1e-6: the means' float32 / float64 sums), the parameters."""
    rule = {"monitor": "val_loss", "mode": "min", "min_delta": 0.0, **rule}
    every = {} if val_every == STEPS else {"val_check_interval": val_every, "check_val_every_n_epoch": None}
    lit = LitEarly(configure=lambda m: sgd(m.parameters(), lr))
    lit.val, lit.monitor = [], rule["monitor"]
    trainer = lightning(max_epochs=10, callbacks=[pl.callbacks.EarlyStopping(**rule)], **every)
    trainer.fit(lit, train_dataloaders=loader(), val_dataloaders=loader(n=6, seed=2))
    port = PortEarly(model=net(), train_data=loader(), val_data=loader(n=6, seed=2),
                     optimizer=lambda p: sgd(p, lr), callbacks=[safeloop.EarlyStopping(**rule)],
                     **settings(max_epochs=10, val_every=val_every))
    port.val, port.monitor = [], rule["monitor"]
    port.fit()

    assert trainer.global_step == port.state.step < 10 * STEPS
    assert [s for s, _ in lit.val] == [s for s, _ in port.val[1:]]  # safeloop's validation before training aside
    assert all(close(a, b) for (_, a), (_, b) in zip(lit.val, port.val[1:]))
    assert_same(lit.model, port.model)


# -- two optimizers, manual optimization


class GAN(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.g = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 2))
        self.d = nn.Sequential(nn.Linear(2, 16), nn.LeakyReLU(0.2), nn.Linear(16, 1))

    def sample(self, n):
        return self.g(torch.randn(n, 4))


def ring() -> DataLoader:
    """40 points around a ring of 8 modes, in batches of 8: passes of 5 steps."""
    gen = torch.Generator().manual_seed(1)
    angle = torch.randint(0, 8, (40,), generator=gen) * (2 * math.pi / 8)
    points = torch.stack([angle.cos(), angle.sin()], 1) * 2 + 0.05 * torch.randn(40, 2, generator=gen)
    return DataLoader(torch.utils.data.TensorDataset(points), batch_size=8)


def gan_adam(params):
    return torch.optim.Adam(params, lr=1e-3, betas=(0.5, 0.999))


def d_loss_of(gan, real, fake):
    d_real, d_fake = gan.d(real), gan.d(fake.detach())
    return (F.binary_cross_entropy_with_logits(d_real, torch.ones_like(d_real))
            + F.binary_cross_entropy_with_logits(d_fake, torch.zeros_like(d_fake)))


def g_loss_of(gan, fake):
    d_fake = gan.d(fake)
    return F.binary_cross_entropy_with_logits(d_fake, torch.ones_like(d_fake))


class LitGAN(pl.LightningModule):
    """The README's GAN step in Lightning's manual optimization; ``scheduled``: a StepLR on D, stepped by hand at
    each epoch's end, as Lightning's docs show (Lightning steps no scheduler in manual mode)."""

    def __init__(self, scheduled=False):
        super().__init__()
        self.automatic_optimization = False
        self.gan, self.scheduled, self.calls, self.lrs = GAN(), scheduled, [], []

    def configure_optimizers(self):
        d, g = gan_adam(self.gan.d.parameters()), gan_adam(self.gan.g.parameters())
        if not self.scheduled:
            return [d, g]
        return [{"optimizer": d, "lr_scheduler": torch.optim.lr_scheduler.StepLR(d, step_size=1, gamma=0.5)},
                {"optimizer": g}]

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
        self.manual_backward(g_loss_of(self.gan, fake))
        opt_g.step()
        opt_g.zero_grad()
        self.untoggle_optimizer(opt_g)
        self.lrs.append(opt_d.param_groups[0]["lr"])

    def on_train_epoch_end(self):
        if self.scheduled:
            self.lr_schedulers().step()

    def on_before_backward(self, loss):
        self.calls.append("before_backward")

    def on_after_backward(self):
        self.calls.append("after_backward")

    def on_before_optimizer_step(self, optimizer):
        self.calls.append(f"before_optimizer_step {'d' if optimizer is self.optimizers()[0].optimizer else 'g'}")


class PortGAN(safeloop.Trainer):
    """``LitGAN`` ported. ``scheduled``: ``"epoch"`` (the scheduler dict with ``interval: "epoch"``), ``"alone"``
    (the scheduler as Lightning takes it), ``"by hand too"`` (and stepped in ``on_epoch_end``, as Lightning's)."""

    automatic = False
    scheduled = None
    calls: list
    lrs: list

    def configure_optimizers(self):
        d, g = gan_adam(self.model.d.parameters()), gan_adam(self.model.g.parameters())
        if not self.scheduled:
            return {"d": d, "g": g}
        sched = torch.optim.lr_scheduler.StepLR(d, step_size=1, gamma=0.5)
        return {"d": {"optimizer": d, "lr_scheduler": sched if self.scheduled == "alone" else
                      {"scheduler": sched, "interval": "epoch"}}, "g": g}

    def training_step(self, batch):
        (real,) = batch
        gan = self.model
        fake = gan.sample(len(real))
        d_loss = d_loss_of(gan, real, fake)
        self.backward(d_loss, optimizer="d")
        self.step("d")
        g_loss = g_loss_of(gan, fake)
        self.backward(g_loss, optimizer="g")
        self.step("g")
        self.lrs.append(self.optimizers["d"].param_groups[0]["lr"])
        return {"d": d_loss, "g": g_loss}

    def on_epoch_end(self):
        if self.scheduled == "by hand too":
            self.schedulers["d"].step()

    def on_before_backward(self, name, loss):
        self.calls.append("before_backward")

    def on_after_backward(self, name):
        self.calls.append("after_backward")

    def on_before_optimizer_step(self, name, optimizer):
        self.calls.append(f"before_optimizer_step {name}")


def gan_runs(scheduled=None, lightning_steps=None, safeloop_steps=None, epochs=EPOCHS):
    lit = LitGAN(bool(scheduled))
    trainer = lightning(max_epochs=epochs, max_steps=lightning_steps or -1)
    torch.manual_seed(3)
    trainer.fit(lit, train_dataloaders=ring())
    port = type("PortGAN", (PortGAN,), {"scheduled": scheduled})(
        model=GAN(), train_data=ring(), **settings(max_epochs=epochs, max_steps=safeloop_steps))
    port.calls, port.lrs = [], []
    torch.manual_seed(3)
    return lit, port


def test_gan_manual_optimization_matches():
    """Two optimizers in manual mode (``toggle_optimizer``, ``manual_backward``, ``step``, ``zero_grad`` against
    ``self.backward(loss, optimizer=...)``, ``self.step(name)``), 2 epochs: G's and D's parameters, the hooks'
    order."""
    lit, port = gan_runs()
    port.fit()
    assert_same(lit.gan, port.model)
    assert lit.calls == port.calls == ["before_backward", "after_backward", "before_optimizer_step d",
                                       "before_backward", "after_backward", "before_optimizer_step g"] * 10


def test_gan_max_steps_differs_as_documented():
    """docs/trainer.md: in manual mode Lightning's ``global_step`` counts optimizer steps, so a GAN's
    ``max_steps=2N`` there is ``max_steps=N`` here: the same batches, the same parameters."""
    lit, port = gan_runs(lightning_steps=6, safeloop_steps=3, epochs=None)
    port.fit()
    assert lit.trainer.global_step == 6 and port.state.step == 3
    assert len(lit.lrs) == len(port.lrs) == 3
    assert_same(lit.gan, port.model)


@pytest.mark.parametrize("scheduled", ["epoch", "alone"])
def test_gan_scheduler_stepped_by_the_trainer_matches_lightning_stepped_by_hand(scheduled):
    """docs/trainer.md: the Trainer steps the schedulers it knows in manual mode too. Lightning's StepLR on D,
    stepped by hand in ``on_train_epoch_end``, against the port's given with ``interval: "epoch"`` or alone (the
    default interval, epoch) and not stepped by hand: D's learning rate at each step, the parameters."""
    lit, port = gan_runs(scheduled)
    port.fit()
    assert lit.lrs == port.lrs == [1e-3] * 5 + [5e-4] * 5
    assert_same(lit.gan, port.model)


def test_gan_scheduler_stepped_by_user_code_too_differs_as_documented():
    """docs/trainer.md: a scheduler the Trainer knows and the user's code steps too (Lightning's manual
    optimization calls ``sch.step()`` itself) would move twice: the Trainer's next step of it stops the run with a
    StepError. It comes at the second epoch's first step, which is undone: the run holds Lightning's first epoch."""
    lit, _ = gan_runs(True, epochs=1)
    _, port = gan_runs("by hand too")
    with pytest.raises(StepError, match=r"step 6: the scheduler of optimizer 'd' \(StepLR\) was stepped outside"):
        port.fit()
    assert port.state.step == 5
    assert_same(lit.gan, port.model)


# -- validation, test, predict, precision


class LitEval(Lit):
    def training_step(self, batch, batch_idx):
        out = self.model(batch[0])
        self.dtypes.add(out.dtype)
        return F.mse_loss(out, batch[1])

    def test_step(self, batch, batch_idx):
        loss = mse(self.model, batch)
        self.log("test_loss", loss)
        self.log("test_per_batch", loss, batch_size=1)  # each batch counted once

    def predict_step(self, batch, batch_idx):
        return self.model(batch[0])

    def on_validation_end(self):
        self.val.append(float(self.trainer.callback_metrics["val_loss"]))


class PortEval(Port):
    per_batch = False
    dtypes: set

    def training_step(self, batch):
        out = self.model(batch[0])
        self.dtypes.add(out.dtype)
        return F.mse_loss(out, batch[1])

    def test_step(self, batch):
        loss = mse(self.model, batch)
        return ({"per_batch": loss}, 1) if self.per_batch else loss  # (losses, n): self.log(..., batch_size=n)


def evaluated(precision="32-true", epochs=1, safeloop_precision=None):
    """One Lightning run and its port, each trained for ``epochs``, then validated, tested and predicting on 7
    samples in batches of 3, 3 and 1; returns both and what each gave."""
    val = loader(n=7, batch=3, seed=2)
    lit = LitEval()
    lit.val, lit.dtypes = [], set()
    trainer = lightning(max_epochs=epochs, precision=precision)
    trainer.fit(lit, train_dataloaders=loader(), val_dataloaders=val)
    tested = trainer.test(lit, dataloaders=val, verbose=False)[0]
    predicted = trainer.predict(lit, dataloaders=val)
    port = PortEval(model=net(), train_data=loader(), val_data=val, optimizer=adam,
                    **settings(max_epochs=epochs, val_every=STEPS, precision=safeloop_precision or precision))
    port.dtypes = set()
    port.fit()
    ours = {"val": [m["val_loss"] for s, m in port.state.val_history if s], "test": port.test(val)["test_loss"],
            "predicted": port.predict(val)}
    port.per_batch = True
    ours["per_batch"] = port.test(val)["test_per_batch"]
    theirs = {"val": lit.val, "test": tested["test_loss"], "per_batch": tested["test_per_batch"],
              "predicted": predicted}
    return lit, port, theirs, ours


def test_predictions_and_metrics_over_uneven_batches_match():
    """One epoch of Adam, then validation, ``test`` and ``predict`` over batches of 3, 3 and 1 (the mean over
    samples and the mean of batch means differ): the parameters, each batch's predictions bit for bit, the
    metrics to 1e-6, ``batch_size=1`` against ``(losses, 1)`` too (docs/trainer.md's map)."""
    lit, port, theirs, ours = evaluated()
    assert_same(lit.model, port.model)
    assert_equal_tensors(theirs["predicted"], ours["predicted"])
    assert all(close(theirs[k], ours[k]) for k in ("test", "per_batch")) and close(theirs["val"][0], ours["val"][0])


def test_validation_and_test_means_differs_as_documented():
    """docs/trainer.md: each metric is the mean over samples, "The sums are kept in float64 (Lightning's in
    float32), so a mean can differ from Lightning's in its last float32 bits": Lightning's is the float32 sum of
    each batch's loss times its samples over their count, safeloop's the same sum in float64; here they differ."""
    _, port, theirs, ours = evaluated()
    with torch.no_grad():
        losses = [mse(port.model, batch) for batch in loader(n=7, batch=3, seed=2)]
    sizes = [3, 3, 1]

    def float32_mean(counts):
        total = torch.tensor(0.0)
        for loss, n in zip(losses, counts):
            total = total + loss * n
        return float(total / sum(counts))

    def float64_mean(counts):
        return sum(float(loss) * n for loss, n in zip(losses, counts)) / sum(counts)

    assert theirs["test"] == theirs["val"][0] == float32_mean(sizes)
    assert ours["test"] == ours["val"][0] == float64_mean(sizes)
    assert theirs["per_batch"] == float32_mean([1, 1, 1]) and ours["per_batch"] == float64_mean([1, 1, 1])
    assert theirs["test"] != ours["test"] and close(theirs["test"], ours["test"])


@pytest.mark.parametrize("precision", ["bf16-mixed", "bf16-true"])
def test_bf16_precisions_match(precision):
    """Lightning's precision names, accepted as they are (docs/trainer.md: "the same names"): the forward's dtype
    in training, the parameters after 2 epochs, the validation and test metrics (to 1e-6), the predictions' dtype
    and values."""
    lit, port, theirs, ours = evaluated(precision, epochs=EPOCHS)
    assert lit.dtypes == port.dtypes == {torch.bfloat16}
    assert_same(lit.model, port.model)
    assert len(theirs["val"]) == len(ours["val"]) == EPOCHS and all(map(close, theirs["val"], ours["val"]))
    assert close(theirs["test"], ours["test"])
    assert [p.dtype for p in theirs["predicted"]] == [p.dtype for p in ours["predicted"]] == [torch.bfloat16] * 3
    assert_equal_tensors(theirs["predicted"], ours["predicted"])


class LitScaled(Lit):
    """The loss times 1e3, so that float16's first steps overflow and are skipped; the forward's output dtype, the
    loss ``on_before_backward`` receives (scaled), the gradients ``on_before_optimizer_step`` sees (unscaled)."""

    def training_step(self, batch, batch_idx):
        out = self.model(batch[0])
        self.dtypes.append(out.dtype)
        return F.mse_loss(out, batch[1]) * 1e3

    def on_before_backward(self, loss):
        self.losses.append(loss.detach().clone())

    def on_before_optimizer_step(self, optimizer):
        self.grads.append(self.model[0].weight.grad.clone())


class PortScaled(Port):
    dtypes: list
    losses: list
    grads: list

    def training_step(self, batch):
        out = self.model(batch[0])
        self.dtypes.append(out.dtype)
        return F.mse_loss(out, batch[1]) * 1e3

    def on_before_backward(self, name, loss):
        self.losses.append(loss.detach().clone())

    def on_before_optimizer_step(self, name, optimizer):
        self.grads.append(self.model[0].weight.grad.clone())


def scaled_runs(lightning_precision, safeloop_precision):
    """``lightning_precision``: Lightning's name, or ``"16-mixed with a scaler"``: float16 autocast and a CPU
    GradScaler forced on Lightning (``MixedPrecision("16-mixed", "cpu", GradScaler("cpu"))``)."""
    lit = LitScaled()
    lit.dtypes, lit.losses, lit.grads = [], [], []
    plugin = None
    if lightning_precision == "16-mixed with a scaler":
        from pytorch_lightning.plugins.precision import MixedPrecision
        plugin = MixedPrecision("16-mixed", "cpu", torch.amp.GradScaler("cpu"))
        trainer = lightning(max_epochs=EPOCHS, plugins=[plugin])
    else:
        trainer = lightning(max_epochs=EPOCHS, precision=lightning_precision)
    trainer.fit(lit, train_dataloaders=loader())
    port = PortScaled(model=net(), train_data=loader(), optimizer=adam,
                      **settings(max_epochs=EPOCHS, precision=safeloop_precision))
    port.dtypes, port.losses, port.grads = [], [], []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the scaler's skipped first update makes torch warn about the order
        port.fit()
    return lit, port, plugin


def test_float16_with_a_grad_scaler_matches():
    """float16 autocast with a GradScaler (Lightning's "16-mixed" on CUDA, forced on the CPU; safeloop's "16"), the
    loss large enough that the first steps overflow: the parameters, the scaled loss ``on_before_backward``
    receives (docs/trainer.md: "scaled under precision=16", as Lightning's), the unscaled gradients
    ``on_before_optimizer_step`` sees (NaN and inf where they overflowed), the final loss scale."""
    lit, port, plugin = scaled_runs("16-mixed with a scaler", "16")
    assert_same(lit.model, port.model)
    assert_equal_tensors(lit.losses, port.losses)
    assert len(lit.grads) == len(port.grads) and all(
        torch.allclose(a, b, rtol=0, atol=0, equal_nan=True) for a, b in zip(lit.grads, port.grads))
    assert not all(g.isfinite().all() for g in port.grads)  # some steps overflowed and were skipped
    assert plugin.scaler.get_scale() == port.scaler.get_scale() < 2.0 ** 16
    assert set(lit.dtypes) == set(port.dtypes) == {torch.float16}


def test_16_mixed_on_the_cpu_differs_as_documented():
    """docs/trainer.md: "``"16-mixed"`` on the CPU is float16 with a GradScaler here; Lightning switches it to
    ``"bf16-mixed"`` there". Lightning's "16-mixed" on the CPU trains as safeloop's "bf16-mixed", bit for bit;
    safeloop's "16-mixed" as Lightning's float16 with a GradScaler (the test above)."""
    lit, port, _ = scaled_runs("16-mixed", "bf16-mixed")
    assert_same(lit.model, port.model)
    assert set(lit.dtypes) == set(port.dtypes) == {torch.bfloat16}
    forced, ours, _ = scaled_runs("16-mixed with a scaler", "16-mixed")
    assert_same(forced.model, ours.model)
    assert set(ours.dtypes) == {torch.float16}


# -- seeding


def unseeded_net():
    """No seed of its own: the weights come from whatever seeded the generator last."""
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Dropout(0.3), nn.Linear(8, 1))


class LitSeen(Lit):
    """The batches ``training_step`` sees."""

    def training_step(self, batch, batch_idx):
        self.seen.append(batch[0].clone())
        return super().training_step(batch, batch_idx)


class PortSeen(Port):
    seen: list

    def training_step(self, batch):
        self.seen.append(batch[0].clone())
        return super().training_step(batch)


def seeded_runs(train_loader, validate=False, workers=False, epochs=EPOCHS):
    """``seed_everything(7, workers=workers)`` (Lightning's, then safeloop's), the model built after it, trained on
    ``train_loader()`` with dropout 0.3; with validation each epoch if ``validate``."""
    val = loader(n=6, seed=2) if validate else None
    pl.seed_everything(7, workers=workers, verbose=False)
    lit = LitSeen(unseeded_net())
    lit.seen = []
    lightning(max_epochs=epochs).fit(lit, train_dataloaders=train_loader(), val_dataloaders=val)
    safeloop.seed_everything(7, workers=workers)
    port = PortSeen(model=unseeded_net(), train_data=train_loader(), val_data=val, optimizer=adam,
                    **settings(max_epochs=epochs, val_every=STEPS if validate else None))
    port.seen = []
    port.fit()
    return lit, port


def shuffled():
    return DataLoader(dataset(), batch_size=2, shuffle=True)


def test_seed_everything_dropout_and_shuffling_match():
    """``seed_everything(7)``, the model built after it, dropout, a shuffled DataLoader without a generator of its
    own, 2 epochs: the initial weights, the batches ``training_step`` sees, the parameters."""
    lit, port = seeded_runs(shuffled)
    pl.seed_everything(7, verbose=False)
    first = unseeded_net()
    safeloop.seed_everything(7)
    assert_same(first, unseeded_net())
    assert_equal_tensors(lit.seen, port.seen)
    assert_same(lit.model, port.model)


def test_validation_leaves_the_random_streams_differs_as_documented():
    """docs/trainer.md (Validation): iterating a DataLoader draws a seed from the global torch generator;
    safeloop puts the generators back after each validation, so a run with ``val_data`` trains exactly as the
    same run without it. Lightning's does not: from the epoch after its first validation on, its batches and
    dropout differ from its run without validation, which safeloop's run with validation matches bit for bit."""
    lit, port = seeded_runs(shuffled, validate=True)
    plain, _ = seeded_runs(shuffled)
    assert_equal_tensors(plain.seen, port.seen)
    assert_same(plain.model, port.model)
    assert_equal_tensors(lit.seen[:STEPS], port.seen[:STEPS])
    assert not any(torch.equal(a, b) for a, b in zip(lit.seen[STEPS:], port.seen[STEPS:]))


def with_workers(worker_init_fn=None):
    """2 workers, each drawing a random augmentation."""
    return lambda: DataLoader(Noisy(), batch_size=2, shuffle=True, num_workers=2, worker_init_fn=worker_init_fn)


def test_seed_everything_with_dataloader_workers_matches():
    """``seed_everything(7)`` without ``workers=True``: torch's own worker seeds in both; the augmented batches
    and the parameters."""
    lit, port = seeded_runs(with_workers(), epochs=1)
    assert len(lit.seen) == 4
    assert_equal_tensors(lit.seen, port.seen)
    assert_same(lit.model, port.model)


def test_seed_everything_workers_true_differs_as_documented():
    """docs/trainer.md: ``seed_everything(42, workers=True)``: "each worker of each rank its own seed ...; not
    Lightning's numbers": safeloop gives its loaders ``safeloop.seed_worker``, Lightning its
    ``pl_worker_init_function``, and each run's batches are those of its function; a loader's own
    ``worker_init_fn`` is kept, so Lightning's given to safeloop's loader gives Lightning's batches."""
    from lightning_fabric.utilities.seed import pl_worker_init_function

    lit, port = seeded_runs(with_workers(), workers=True, epochs=1)
    assert not any(torch.equal(a, b) for a, b in zip(lit.seen, port.seen))
    _, ours = seeded_runs(with_workers(safeloop.seed_worker), workers=True, epochs=1)
    assert_equal_tensors(ours.seen, port.seen)
    _, theirs = seeded_runs(with_workers(pl_worker_init_function), workers=True, epochs=1)
    assert_equal_tensors(lit.seen, theirs.seen)
    assert_same(lit.model, theirs.model)


# -- when runs end: max_steps, a stop asked for; the counters


def epoch_step_lr(model):
    opt = sgd(model.parameters())
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "epoch"}}


class LitEvents(Lit):
    def on_train_epoch_end(self):
        self.events.append(("epoch_end", self.trainer.global_step, self.optimizers().param_groups[0]["lr"]))

    def on_validation_end(self):
        self.events.append(("validation", self.trainer.global_step))


class PortEvents(Port):
    events: list
    configure = staticmethod(epoch_step_lr)

    def on_epoch_end(self):
        self.events.append(("epoch_end", self.state.step, self.optimizers["optimizer"].param_groups[0]["lr"]))

    def on_validation_end(self, metrics):
        self.events.append(("validation", self.state.step))


def max_steps_runs(max_steps):
    """``max_steps`` over 7-batch passes, validation each epoch, a StepLR with ``interval: "epoch"``."""
    lit = LitEvents(configure=epoch_step_lr)
    lit.events = []
    lightning(max_steps=max_steps).fit(lit, train_dataloaders=loader(), val_dataloaders=loader(n=6, seed=2))
    port = PortEvents(model=net(), train_data=loader(), val_data=loader(n=6, seed=2),
                      **settings(max_steps=max_steps, val_every=STEPS))
    port.events = []
    port.fit()
    return lit, port


def lr(run):
    """The learning rate a run (a LightningModule, a safeloop Trainer) ended with: what a checkpoint would hold."""
    optimizer = run.optimizers() if isinstance(run, pl.LightningModule) else run.optimizers["optimizer"]
    return optimizer.param_groups[0]["lr"]


def test_max_steps_mid_pass_differs_as_documented():
    """docs/trainer.md: a run that ``max_steps`` ends mid-pass calls no ``on_epoch_end`` and its epoch schedulers do
    not step: the next ``fit()`` goes on in that pass; Lightning ends the pass there (its epoch-end hook runs; its
    epoch scheduler does not step either). And safeloop validates at the end of the run too (Validation). 10 steps
    of 7-batch passes: the same parameters and learning rate."""
    lit, port = max_steps_runs(10)
    assert_same(lit.model, port.model)
    assert lr(lit) == lr(port) == 0.025
    assert lit.events == [("validation", 7), ("epoch_end", 7, 0.025), ("epoch_end", 10, 0.025)]
    assert port.events == [("validation", 0), ("validation", 7), ("epoch_end", 7, 0.025), ("validation", 10)]
    assert (lit.trainer.current_epoch, port.state.epoch) == (2, 1)


def test_max_steps_at_a_pass_end_ends_the_pass_as_lightning_does():
    """A run that ``max_steps`` ends right after a pass's last batch ends that pass too: its epoch schedulers step and
    ``on_epoch_end`` runs after the last validation, as Lightning's; going on to 8 steps (a second ``fit()``),
    safeloop's run is Lightning's run of 8 steps, bit for bit."""
    lit, port = max_steps_runs(STEPS)
    assert_same(lit.model, port.model)
    assert lit.events == [("validation", 7), ("epoch_end", 7, 0.025)] and lr(lit) == 0.025
    assert port.events == [("validation", 0), ("validation", 7), ("epoch_end", 7, 0.025)] and lr(port) == 0.025
    port.max_steps = 8
    port.fit()
    assert port.events[3:] == [("validation", 8)]
    longer, _ = max_steps_runs(8)
    assert_same(longer.model, port.model)


ACCUM = 2


class LitCounters(Lit):
    """(hook, global_step, current_epoch) in each hook; ``training_step`` at each update's first micro-batch,
    ``on_train_batch_end`` at its last (safeloop's run once per update: docs/trainer.md)."""

    def note(self, hook):
        self.seen.append((hook, self.global_step, self.current_epoch))

    def training_step(self, batch, batch_idx):
        if batch_idx % ACCUM == 0:
            self.note("training_step")
        return super().training_step(batch, batch_idx)

    def on_train_epoch_start(self):
        self.note("epoch_start")

    def on_before_optimizer_step(self, optimizer):
        self.note("before_optimizer_step")

    def on_train_batch_end(self, outputs, batch, batch_idx):
        if (batch_idx + 1) % ACCUM == 0 or self.trainer.is_last_batch:
            self.note("step_end")
            if self.global_step == self.stop_at:
                self.trainer.should_stop = True

    def on_train_epoch_end(self):
        self.note("epoch_end")

    def on_validation_end(self):
        self.note("validation_end")


class PortCounters(Port):
    seen: list
    stop_at: int | None

    def note(self, hook):
        if not (hook == "training_step" and self.seen and self.seen[-1] == (hook, self.state.step, self.state.epoch)):
            self.seen.append((hook, self.state.step, self.state.epoch))  # once per update, as Lightning's above

    def training_step(self, batch):
        self.note("training_step")
        return super().training_step(batch)

    def on_epoch_start(self):
        self.note("epoch_start")

    def on_before_optimizer_step(self, name, optimizer):
        self.note("before_optimizer_step")

    def on_step_end(self, losses):
        self.note("step_end")
        if self.state.step == self.stop_at:
            self.request_stop("asked")

    def on_epoch_end(self):
        self.note("epoch_end")

    def on_validation_end(self, metrics):
        self.note("validation_end")


def counted_runs(stop_at=None):
    """2 passes of 5 batches, ``accumulate_grad_batches=2`` (3 updates a pass, the last a tail of one), validation
    each epoch (``val_every=3``); a stop asked for after step ``stop_at``."""
    lit = LitCounters(configure=lambda m: sgd(m.parameters()))
    lit.seen, lit.stop_at = [], stop_at
    trainer = lightning(max_epochs=2, accumulate_grad_batches=ACCUM)
    trainer.fit(lit, train_dataloaders=loader(n=10), val_dataloaders=loader(n=4, seed=2))
    port = PortCounters(model=net(), train_data=loader(n=10), val_data=loader(n=4, seed=2), optimizer=sgd,
                        **settings(max_epochs=2, grad_accum=ACCUM, val_every=3))
    port.seen, port.stop_at = [], stop_at
    port.fit()
    assert port.seen[0] == ("validation_end", 0, 0)  # before training: safeloop's own
    return lit, port, port.seen[1:]


def test_step_and_epoch_counters_match():
    """``self.global_step`` / ``self.current_epoch`` against ``self.state.step`` / ``self.state.epoch``
    (docs/trainer.md's map) as each hook and ``training_step`` read them, under accumulation with a short tail and
    validation each epoch, and after ``fit``; the parameters."""
    lit, port, ours = counted_runs()
    assert lit.seen == ours
    assert (lit.trainer.global_step, lit.trainer.current_epoch) == (port.state.step, port.state.epoch) == (6, 2)
    assert_same(lit.model, port.model)


def test_a_stop_asked_mid_pass_differs_as_documented():
    """docs/trainer.md: a run that a stop ends mid-pass (``trainer.should_stop = True`` /
    ``self.request_stop(reason)``) calls no ``on_epoch_end``, and the pass is not counted; Lightning ends the pass
    there. Asked after step 4, the first of the second pass: the rest the same, the parameters too."""
    lit, port, ours = counted_runs(stop_at=4)
    assert lit.seen[-1] == ("epoch_end", 4, 1)
    assert lit.seen[:-1] == ours and ours[-1] == ("validation_end", 4, 1)
    assert (lit.trainer.global_step, lit.trainer.current_epoch) == (4, 2)
    assert (port.state.step, port.state.epoch) == (4, 1)
    assert_same(lit.model, port.model)


# -- callbacks, samplers, validation intervals, modes, closures


def test_callback_hooks_run_after_the_trainers_differs_as_documented():
    """docs/trainer.md: "The Trainer's own hook runs first, then the callbacks' (Lightning calls most callback hooks
    first)". One epoch of 3 batches, validation at its end, one callback: for each hook of the map, who ran it first.
    (safeloop's validation before training left out.)"""
    calls = []

    def hooks(who, names):
        def hook(ours):
            return lambda self, *args: calls.append((who, ours))
        return {name: hook(HOOKS.get(name, name)) for name in names}

    LitHooks = type("LitHooks", (Lit,), hooks("module", HOOKS))
    LitCallback = type("LitCallback", (pl.Callback,), hooks("callback", HOOKS))
    lightning(max_epochs=1, callbacks=[LitCallback()]).fit(
        LitHooks(configure=lambda m: sgd(m.parameters(), 0.1)), train_dataloaders=loader(n=6),
        val_dataloaders=loader(n=4, seed=2))
    theirs, calls[:] = list(calls), []
    PortHooks = type("PortHooks", (Port,), hooks("module", HOOKS.values()))
    PortCallback = type("PortCallback", (safeloop.Callback,), hooks("callback", HOOKS.values()))
    PortHooks(model=net(), train_data=loader(n=6), val_data=loader(n=4, seed=2), callbacks=[PortCallback()],
              optimizer=lambda p: sgd(p, 0.1), **settings(max_epochs=1, val_every=3)).fit()
    ours = calls[:2] + calls[4:]
    assert calls[2:4] == [("module", "on_validation_end"), ("callback", "on_validation_end")]  # before training
    assert [hook for _, hook in theirs] == [hook for _, hook in ours]
    assert [who for who, _ in theirs] == ["callback", "module"] * (len(theirs) // 2)
    assert [who for who, _ in ours] == ["module", "callback"] * (len(ours) // 2)
    assert {hook for _, hook in ours} == set(HOOKS.values())


def epoch_sampled(kind):
    """A sampler whose order depends on the epoch (``set_epoch``), given as ``sampler=`` or inside a
    ``batch_sampler=``."""
    ds = dataset()
    sampler = DistributedSampler(ds, num_replicas=1, rank=0, shuffle=True, seed=0)
    if kind == "sampler":
        return DataLoader(ds, batch_size=2, sampler=sampler)
    return DataLoader(ds, batch_sampler=BatchSampler(sampler, batch_size=2, drop_last=False))


@pytest.mark.parametrize("kind", ["sampler", "batch_sampler"])
def test_set_epoch_reaches_the_sampler_matches(kind):
    """Lightning calls ``set_epoch`` on a loader's sampler and on its batch sampler's; so does safeloop: 3 epochs,
    the batches ``training_step`` sees (a new order each epoch) and the parameters."""
    lit = LitSeen()
    lit.seen = []
    lightning(max_epochs=3).fit(lit, train_dataloaders=epoch_sampled(kind))
    port = PortSeen(model=net(), train_data=epoch_sampled(kind), optimizer=adam, **settings(max_epochs=3))
    port.seen = []
    port.fit()
    assert_equal_tensors(lit.seen, port.seen)
    assert not torch.equal(torch.cat(port.seen[:STEPS]), torch.cat(port.seen[STEPS:2 * STEPS]))
    assert_same(lit.model, port.model)


class LitValidated(Lit):
    def on_validation_end(self):
        self.validated.append(self.trainer.global_step)


class PortValidated(Port):
    validated: list

    def on_validation_end(self, metrics):
        self.validated.append(self.state.step)


def validated_runs(lightning_validation, val_every):
    """``accumulate_grad_batches=2`` over 2 passes of 7 batches (4 updates each, the last a tail of one): the steps
    validation ran after in each."""
    lit = LitValidated(configure=lambda m: sgd(m.parameters()))
    lit.validated = []
    lightning(max_epochs=EPOCHS, accumulate_grad_batches=2, **lightning_validation).fit(
        lit, train_dataloaders=loader(), val_dataloaders=loader(n=4, seed=2))
    port = PortValidated(model=net(), train_data=loader(), val_data=loader(n=4, seed=2), optimizer=sgd,
                         **settings(max_epochs=EPOCHS, grad_accum=2, val_every=val_every))
    port.validated = []
    port.fit()
    return lit.validated, port.validated


@pytest.mark.parametrize("lightning_validation, val_every", [
    ({}, 4), ({"val_check_interval": 4, "check_val_every_n_epoch": None}, 2), ({"check_val_every_n_epoch": 2}, 8)],
    ids=["each epoch", "val_check_interval", "every other epoch"])
def test_validation_intervals_match(lightning_validation, val_every):
    """When validation runs under accumulation (docs/trainer.md: each epoch is ``val_every`` = one pass's steps;
    ``val_check_interval=N`` batches is ``val_every=N / grad_accum``): the steps validated after, besides safeloop's
    own before training and at the end of the run (Validation)."""
    theirs, ours = validated_runs(lightning_validation, val_every)
    end = EPOCHS * 4
    assert ours == [0] + theirs + ([end] if end not in theirs else [])


def test_val_every_counts_optimizer_steps_differs_as_documented():
    """docs/trainer.md: ``val_check_interval=N`` counts batches, ``val_every=N`` optimizer steps: under
    ``grad_accum=2``, Lightning's ``val_check_interval=4`` is ``val_every=2``, not ``val_every=4``."""
    theirs, ours = validated_runs({"val_check_interval": 4, "check_val_every_n_epoch": None}, 4)
    assert theirs == [2, 4, 6]
    assert ours == [0, 4, 8]


class LitModes(Lit):
    def training_step(self, batch, batch_idx):
        self.modes.append((self.model.training, self.model[2].training))
        return super().training_step(batch, batch_idx)

    def test_step(self, batch, batch_idx):
        self.log("test_loss", mse(self.model, batch))


class PortModes(Port):
    modes: list

    def training_step(self, batch):
        self.modes.append((self.model.training, self.model[2].training))
        return super().training_step(batch)


def set_modes(model, how):
    model.train()
    if how == "all eval":
        model.eval()
    elif how == "dropout eval":
        model[2].eval()


@pytest.mark.parametrize("how", ["all train", "all eval", "dropout eval"])
def test_train_and_eval_modes_match(how):
    """docs/trainer.md: the Trainer leaves modes as it finds them, as Lightning's does: a model left in eval mode
    before ``fit``, one whose dropout alone is (across validations); (model, dropout) in each ``training_step``,
    and every module's mode after ``test``."""
    lit = LitModes(net(dropout=0.3), configure=lambda m: sgd(m.parameters(), 0.1))
    lit.modes = []
    set_modes(lit.model, how)
    if how == "all eval":
        lit.eval()
    trainer = lightning(max_epochs=2)
    trainer.fit(lit, train_dataloaders=loader(n=4), val_dataloaders=loader(n=4, seed=2))
    set_modes(lit.model, how)
    trainer.test(lit, dataloaders=loader(n=4, seed=2), verbose=False)

    model = net(dropout=0.3)
    set_modes(model, how)
    port = PortModes(model=model, train_data=loader(n=4), val_data=loader(n=4, seed=2),
                     optimizer=lambda p: sgd(p, 0.1), **settings(max_epochs=2, val_every=2))
    port.modes = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", safeloop.ConfigWarning)  # a model in eval mode: said once, as meant
        port.fit()
    set_modes(model, how)
    port.test(loader(n=4, seed=2))
    assert lit.modes == port.modes and len(port.modes) == 4
    assert [m.training for m in lit.model.modules()] == [m.training for m in model.modules()]


@pytest.mark.parametrize("clip", [None, 0.05])
def test_lbfgs_closure_matches(clip):
    """L-BFGS in automatic optimization: Lightning calls ``optimizer.step(closure)``; safeloop gives it a closure
    too, the step's own forward and backward serving as its first evaluation (docs/trainer.md, Closures). One
    epoch, with and without clipping: the parameters, and how many times ``training_step`` ran."""
    def lbfgs(params):
        return torch.optim.LBFGS(params, lr=0.5, max_iter=4, history_size=5)

    class LitCount(Lit):
        def training_step(self, batch, batch_idx):
            self.count += 1
            return super().training_step(batch, batch_idx)

    class PortCount(Port):
        count = 0

        def training_step(self, batch):
            self.count += 1
            return super().training_step(batch)

    lit = LitCount(configure=lambda m: lbfgs(m.parameters()))
    lit.count = 0
    lightning(max_epochs=1, gradient_clip_val=clip).fit(lit, train_dataloaders=loader())
    port = PortCount(model=net(), train_data=loader(), optimizer=lbfgs, **settings(max_epochs=1, grad_clip=clip))
    port.fit()
    assert_same(lit.model, port.model)
    assert lit.count == port.count > STEPS
