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
import logging
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

from .common import (HOOKS, Lit, Noisy, Port, adam, assert_equal_tensors, assert_same, close, dataset,  # noqa: E402
                     lightning, loader, max_diff, mse, net, settings, sgd)

EPOCHS, STEPS = 2, 7  # passes of 7 batches by default


@pytest.fixture(autouse=True)
def _quiet(one_thread):
    """Lightning's info lines ("GPU available", tips) and its advice (few workers, inferred batch sizes) off; one
    thread, so that both sides run the same kernels."""
    names = ("pytorch_lightning", "lightning_fabric", "lightning.pytorch", "lightning.fabric")
    levels = {name: logging.getLogger(name).level for name in names}
    for name in names:
        logging.getLogger(name).setLevel(logging.ERROR)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", module=r"(pytorch_)?lightning")
        warnings.filterwarnings("ignore", category=pl.utilities.warnings.PossibleUserWarning)
        warnings.filterwarnings("ignore", message=".*(does not have many workers|infer the `batch_size`).*")
        yield
    for name, level in levels.items():
        logging.getLogger(name).setLevel(level)


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
    # divided by 3 in both: Lightning's loss / 3 and safeloop's loss * (1 / 3) may round a float32 step apart
    assert len(lit.seen) == len(port.seen) == EPOCHS * STEPS
    assert all(torch.equal(a, b) or torch.equal(torch.nextafter(a, b), b) for a, b in zip(lit.seen, port.seen))
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
    """docs/trainer.md: "Lightning's frequency and strict keys are not supported (an error at start-up)". Lightning
    trains with them; safeloop raises a ConfigError naming the key before its first step."""
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


class LitEarly(Lit):
    def validation_step(self, batch, batch_idx):
        loss = mse(self.model, batch)
        self.log("val_loss", loss)
        self.log("val_score", -loss)

    def on_validation_end(self):
        self.val.append((self.trainer.global_step, float(self.trainer.callback_metrics[self.monitor])))


class PortEarly(Port):
    val: list
    monitor: str

    def validation_step(self, batch):
        loss = mse(self.model, batch)
        return {"loss": loss, "score": -loss}

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
