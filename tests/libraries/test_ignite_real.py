"""pytorch-ignite's own training loop (``Engine``, ``create_supervised_trainer``, its handlers and metrics), written
against ignite 0.5.5 as its users write it, run three ways from the same seeds: bare; under
``python -m safeloop.watch``'s guard (``Watch``, in process, this file being the user's script); and with a
``safeloop.GraphGuard`` put in where ignite lets a user put one (a step opened on ``Events.ITERATION_STARTED`` and
closed on ``Events.ITERATION_COMPLETED``, ``guard.check`` in the loss function, ``guard.backward`` in an update
function). Every parameter and buffer (and EMA copies, optimizer state, the outputs ignite records) must come out bit
for bit the same in every guard mode, with no warning the bare run does not emit itself.

Then the mistakes an ignite user makes (a tensor built before ``trainer.run`` reused by every iteration, a DCGAN
update back-propagating a graph twice, a running loss or a hidden state kept with its graph, a loss without a graph,
an in-place change to a saved tensor): each must be stopped before the update it would corrupt, naming the tensor,
and the fix the message advises, written into the same ignite code, must run quiet and right.
"""
import contextlib
import math
import os
import runpy
import subprocess
import sys
from copy import deepcopy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

LIB = pytest.importorskip("ignite")

from ignite.engine import (Engine, Events, create_supervised_evaluator,  # noqa: E402
                           create_supervised_trainer)
from ignite.handlers import (Checkpoint, DiskSaver, EMAHandler, FastaiLRFinder, LRScheduler,  # noqa: E402
                             ModelCheckpoint, PiecewiseLinear, TerminateOnNan, create_lr_scheduler_with_warmup)
from ignite.metrics import Loss, RunningAverage  # noqa: E402

from safeloop import GraphGuard  # noqa: E402
from safeloop.errors import (CarriedGraphError, DoubleBackwardError, GraphLeakWarning,  # noqa: E402
                             GraphReuseError, InplaceModificationError, NoGraphError)
from safeloop.watch import Watch  # noqa: E402
from tests.libraries.compare import same, three_runs  # noqa: E402
from tests.realworld.harness import checks, strict  # noqa: E402

HERE = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


# -- what every case runs -----------------------------------------------------------------------------------------


def watched(train, *args, check="always", **kwargs):
    """``train(*args, **kwargs)`` under ``Watch`` (this file as the script)."""
    with Watch(GraphGuard(check=check), train.__code__.co_filename):
        return train(*args, **kwargs)


def iteration_steps(engine, guard):
    """``guard``'s steps as ignite's iterations: opened on ``ITERATION_STARTED``, closed on ``ITERATION_COMPLETED``."""
    if guard is None:
        return
    steps = contextlib.ExitStack()
    engine.add_event_handler(Events.ITERATION_STARTED, lambda _: steps.enter_context(guard.step()))
    engine.add_event_handler(Events.ITERATION_COMPLETED, lambda _: steps.close())


def checked(loss_fn, guard):
    """``loss_fn`` whose loss goes through ``guard.check`` before ignite's ``loss.backward()``."""
    if guard is None:
        return loss_fn

    def loss(y_pred, y):
        out = loss_fn(y_pred, y)
        guard.check(out)
        return out
    return loss


def snapshots(engine, model, taken):
    """Appends to ``taken`` the model's parameters before training and after each completed iteration (the last
    entry: as the last update that ran left them)."""
    def take(_=None):
        taken.append({name: p.detach().clone() for name, p in model.named_parameters()})
    take()
    engine.add_event_handler(Events.ITERATION_COMPLETED, take)


def regression(n=5, seed=3):
    gen = torch.Generator().manual_seed(seed)
    return [(torch.randn(8, 4, generator=gen), torch.randn(8, 1, generator=gen)) for _ in range(n)]


def net():
    return nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 1))


def build(n=5):
    model = net()
    return model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9), regression(n)


# -- create_supervised_trainer ------------------------------------------------------------------------------------
def supervised(model, optimizer, data, guard=None, epochs=2, **kwargs):
    trainer = create_supervised_trainer(model, optimizer, checked(nn.MSELoss(), guard), **kwargs)
    iteration_steps(trainer, guard)
    outputs = []
    trainer.add_event_handler(Events.ITERATION_COMPLETED, lambda e: outputs.append(e.state.output))
    trainer.run(data, max_epochs=epochs)
    return {"model": model, "optimizer": optimizer.state_dict(), "outputs": outputs,
            "iteration": trainer.state.iteration}


@pytest.mark.parametrize("check", checks())
def test_create_supervised_trainer(check):
    """``ignite.engine.create_supervised_trainer`` (``supervised_training_step``: zero_grad, forward, backward,
    step in ignite's own update) over two epochs, ``state.output`` the loss's ``.item()``."""
    ref = three_runs(build, supervised, check)
    assert ref["iteration"] == 10 and all(isinstance(o, float) for o in ref["outputs"])


def accumulated(model, optimizer, data, guard=None, steps=2):
    return supervised(model, optimizer, data, guard=guard, epochs=3, gradient_accumulation_steps=steps)


@pytest.mark.parametrize("steps", [2, 3])
@pytest.mark.parametrize("check", checks())
def test_create_supervised_trainer_gradient_accumulation_over_epoch_ends(check, steps):
    """``create_supervised_trainer(gradient_accumulation_steps=2 or 3)`` over 5 batches an epoch: ignite counts
    micro-batches by ``state.iteration``, so updates straddle epoch ends (gradients of the last micro-batches of an
    epoch carry into the next)."""
    ref = three_runs(lambda: build(5), lambda *a, guard=None: accumulated(*a, guard=guard, steps=steps), check)
    assert ref["iteration"] == 15


class Heads(nn.Module):
    """A model returning a dict, as torchvision's segmentation models do: ``model_transform`` picks the output."""

    def __init__(self):
        super().__init__()
        self.body = net()
        self.aux = nn.Linear(4, 1)

    def forward(self, x):
        return {"out": self.body(x), "aux": self.aux(x)}


def transformed(model, optimizer, data, guard=None):
    trainer = create_supervised_trainer(
        model, optimizer, checked(nn.SmoothL1Loss(), guard), model_transform=lambda out: out["out"] + 0.4 * out["aux"],
        output_transform=lambda x, y, y_pred, loss: {"loss": loss, "y_pred": y_pred, "y": y})
    iteration_steps(trainer, guard)
    kept = []
    trainer.add_event_handler(Events.ITERATION_COMPLETED,
                              lambda e: kept.append({k: v.detach().clone() for k, v in e.state.output.items()}))
    RunningAverage(output_transform=lambda out: out["loss"]).attach(trainer, "avg")
    trainer.run(data, max_epochs=2)
    return {"model": model, "kept": kept, "avg": trainer.state.metrics["avg"]}


def transformed_build():
    model = Heads()
    return model, torch.optim.Adam(model.parameters(), lr=0.01), regression(4)


@pytest.mark.parametrize("check", checks())
def test_create_supervised_trainer_model_and_output_transforms(check):
    """``create_supervised_trainer(model_transform=..., output_transform=...)``: the output transform returns the
    loss and ``y_pred`` tensors with their graphs (``state.output`` keeps the last iteration's), and
    ``RunningAverage`` averages the loss tensor over iterations."""
    ref = three_runs(transformed_build, transformed, check)
    assert len(ref["kept"]) == 8 and isinstance(ref["avg"], float)


def amp(model, optimizer, data, guard=None):
    return supervised(model, optimizer, data, guard=guard, amp_mode="amp", scaler=False)


@pytest.mark.parametrize("check", checks())
def test_create_supervised_trainer_amp_mode_on_cpu(check):
    """``create_supervised_trainer(amp_mode="amp")`` (``supervised_training_step_amp``): on a machine without CUDA
    ignite's ``autocast("cuda")`` is turned off with torch's warning (the bare run's own, let through), the update
    as without it."""
    three_runs(build, amp, check)


def hooks(guard):
    """(step, backward) of an update function: the guard's, or a null context and ``Tensor.backward``."""
    if guard is None:
        return contextlib.nullcontext, torch.Tensor.backward
    return guard.step, guard.backward


# -- a custom Engine: pytorch/ignite examples/gan/dcgan.py's update, two optimizers ---------------------------------
class Generator(nn.Module):
    def __init__(self, z_dim=3):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(z_dim, 8), nn.BatchNorm1d(8), nn.ReLU(True), nn.Linear(8, 4), nn.Tanh())

    def forward(self, x):
        return self.net(x)


class Discriminator(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 8), nn.LeakyReLU(0.2, inplace=True), nn.Linear(8, 1), nn.Sigmoid())

    def forward(self, x):
        return self.net(x).view(-1)


def gan_build(n=4):
    netG, netD = Generator(), Discriminator()
    gen = torch.Generator().manual_seed(5)
    loader = [(torch.randn(6, 4, generator=gen).tanh(), torch.zeros(6)) for _ in range(n)]
    return netG, netD, loader


def dcgan(netG, netD, loader, guard=None, epochs=2, batch_size=6, z_dim=3, mistake=None):
    """examples/gan/dcgan.py's ``main``: its ``step`` as the source writes it (``mistake`` changes one line)."""
    bce = nn.BCELoss()
    optimizerG = torch.optim.Adam(netG.parameters(), lr=0.01, betas=(0.5, 0.999))
    optimizerD = torch.optim.Adam(netD.parameters(), lr=0.01, betas=(0.5, 0.999))
    real_labels = torch.ones(batch_size)
    fake_labels = torch.zeros(batch_size)
    fixed_noise = torch.randn(batch_size, z_dim)
    if callable(guard):  # a guard told the optimizers
        guard = guard(netD, {"optimizerD": optimizerD, "optimizerG": optimizerG})
    step_, backward = hooks(guard)

    def get_noise():
        return torch.randn(batch_size, z_dim)

    def step(engine, batch):
        with step_():
            real, _ = batch
            netD.zero_grad()
            output = netD(real)
            errD_real = bce(output, real_labels)
            D_x = output.mean().item()
            backward(errD_real)
            noise = get_noise()
            fake = netG(noise)
            output = netD(fake if mistake == "fake not detached" else fake.detach())
            errD_fake = bce(output, fake_labels)
            D_G_z1 = output.mean().item()
            backward(errD_fake)
            errD = errD_real + errD_fake
            if mistake == "errD backward":
                backward(errD)
            if mistake == "G output before D step":
                output = netD(fake)
            optimizerD.step()
            netG.zero_grad()
            if mistake != "G output before D step":
                output = netD(fake)
            errG = bce(output, real_labels)
            D_G_z2 = output.mean().item()
            backward(errG)
            optimizerG.step()
            return {"errD": errD.item(), "errG": errG.item(), "D_x": D_x, "D_G_z1": D_G_z1, "D_G_z2": D_G_z2}

    trainer = Engine(step)
    for name in ["errD", "errG", "D_x", "D_G_z1", "D_G_z2"]:
        RunningAverage(alpha=0.98, output_transform=lambda x, name=name: x[name]).attach(trainer, name)
    samples = []

    @trainer.on(Events.EPOCH_COMPLETED)
    def save_fake_example(engine):
        fake = netG(fixed_noise)
        samples.append(fake.detach().clone())

    trainer.run(loader, max_epochs=epochs)
    return {"netG": netG, "netD": netD, "metrics": dict(trainer.state.metrics), "samples": samples,
            "optimizerD": optimizerD.state_dict(), "optimizerG": optimizerG.state_dict()}


@pytest.mark.parametrize("check", checks())
def test_custom_engine_dcgan_two_optimizers(check):
    """``ignite.engine.Engine(step)`` with examples/gan/dcgan.py's update: D on real and on ``fake.detach()``, D's
    step, then G through ``netD(fake)``; ``RunningAverage`` over each value of the output dict; an
    ``EPOCH_COMPLETED`` handler running ``netG(fixed_noise)`` with grad on (a graph built between iterations and
    dropped, BatchNorm in train mode)."""
    ref = three_runs(gan_build, dcgan, check)
    assert len(ref["samples"]) == 2 and set(ref["metrics"]) == {"errD", "errG", "D_x", "D_G_z1", "D_G_z2"}


# -- create_supervised_evaluator between iterations -----------------------------------------------------------------
def evaluated(model, optimizer, data, guard=None):
    trainer = create_supervised_trainer(model, optimizer, checked(nn.MSELoss(), guard))
    iteration_steps(trainer, guard)
    evaluator = create_supervised_evaluator(model, metrics={"mse": Loss(nn.MSELoss())})
    val = regression(3, seed=11)
    history = []

    def validate(engine):
        evaluator.run(val)
        history.append((engine.state.iteration, evaluator.state.metrics["mse"]))

    trainer.add_event_handler(Events.EPOCH_COMPLETED, validate)
    trainer.add_event_handler(Events.ITERATION_COMPLETED(every=3), validate)
    trainer.run(data, max_epochs=2)
    return {"model": model, "history": history}


@pytest.mark.parametrize("check", checks())
def test_create_supervised_evaluator_every_epoch_and_every_three_iterations(check):
    """``create_supervised_evaluator(model, metrics={"mse": Loss(...)})`` run by the trainer's
    ``EPOCH_COMPLETED`` and ``ITERATION_COMPLETED(every=3)`` handlers: ``model.eval()`` under ``no_grad`` between
    updates, ignite's update puts ``model.train()`` back."""
    ref = three_runs(build, evaluated, check)
    assert [i for i, _ in ref["history"]] == [3, 5, 6, 9, 10]


# -- ignite.handlers.EMAHandler ------------------------------------------------------------------------------------
def ema(model, optimizer, data, guard=None):
    trainer = create_supervised_trainer(model, optimizer, checked(nn.MSELoss(), guard))
    iteration_steps(trainer, guard)
    ema_handler = EMAHandler(model, momentum=0.01, momentum_warmup=0.1, warmup_iters=4, handle_buffers="update")
    ema_handler.attach(trainer, name="ema_momentum", event=Events.ITERATION_COMPLETED(every=2))
    momenta = []
    trainer.add_event_handler(Events.ITERATION_COMPLETED, lambda e: momenta.append(e.state.ema_momentum))
    trainer.run(data, max_epochs=2)
    return {"model": model, "ema": ema_handler.ema_model, "momenta": momenta}


@pytest.mark.parametrize("check", checks())
def test_ema_handler(check):
    """``ignite.handlers.EMAHandler`` with a momentum warm-up, attached on ``ITERATION_COMPLETED(every=2)``,
    buffers averaged too (``handle_buffers="update"``): the EMA model comes out the same bit for bit."""
    ref = three_runs(build, ema, check)
    assert not torch.equal(ref["ema"][0].weight, ref["model"][0].weight)


# -- param schedulers ------------------------------------------------------------------------------------------------
SCHEDULERS = {
    "LRScheduler(StepLR)": (Events.ITERATION_COMPLETED,
                            lambda opt: LRScheduler(torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5))),
    "PiecewiseLinear": (Events.ITERATION_STARTED,
                        lambda opt: PiecewiseLinear(opt, "lr", milestones_values=[(0, 0.0), (4, 0.1), (10, 0.01)])),
    "create_lr_scheduler_with_warmup": (Events.ITERATION_STARTED, lambda opt: create_lr_scheduler_with_warmup(
        torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=10), warmup_start_value=0.0, warmup_duration=3)),
}


def scheduled(model, optimizer, data, guard=None, kind="PiecewiseLinear"):
    trainer = create_supervised_trainer(model, optimizer, checked(nn.MSELoss(), guard))
    iteration_steps(trainer, guard)
    event, make = SCHEDULERS[kind]
    trainer.add_event_handler(event, make(optimizer))
    lrs = []
    trainer.add_event_handler(Events.ITERATION_COMPLETED, lambda e: lrs.append(optimizer.param_groups[0]["lr"]))
    trainer.run(data, max_epochs=2)
    return {"model": model, "optimizer": optimizer.state_dict(), "lrs": lrs}


@pytest.mark.parametrize("kind", list(SCHEDULERS))
@pytest.mark.parametrize("check", checks())
def test_param_schedulers(check, kind):
    """``ignite.handlers.LRScheduler`` around torch's ``StepLR``, ``PiecewiseLinear`` and
    ``create_lr_scheduler_with_warmup`` (a cosine schedule after a linear warm-up) on the trainer's events."""
    ref = three_runs(build, lambda *a, guard=None: scheduled(*a, guard=guard, kind=kind), check)
    assert len(set(ref["lrs"])) > 2


# -- TerminateOnNan ---------------------------------------------------------------------------------------------------
def nan_build():
    model, optimizer, data = build(5)
    data[2] = (data[2][0], torch.full_like(data[2][1], float("nan")))
    return model, optimizer, data


def terminated(model, optimizer, data, guard=None):
    trainer = create_supervised_trainer(model, optimizer, checked(nn.MSELoss(), guard))
    iteration_steps(trainer, guard)
    trainer.add_event_handler(Events.ITERATION_COMPLETED, TerminateOnNan())
    seen = []
    trainer.add_event_handler(Events.ITERATION_COMPLETED, lambda e: seen.append(e.state.output))
    trainer.run(data, max_epochs=2)
    return {"model": model, "seen": seen, "iteration": trainer.state.iteration}


@pytest.mark.parametrize("check", checks())
def test_terminate_on_nan(check):
    """``ignite.handlers.TerminateOnNan`` stops the run at the iteration whose loss is NaN (a NaN target): the guard
    neither stops it earlier nor changes the NaN update ignite ran."""
    ref = three_runs(nan_build, terminated, check)
    assert ref["iteration"] == 3 and math.isnan(ref["seen"][-1]) and len(ref["seen"]) == 3


# == the mistakes, as ignite users write them ===================================================================
def stopped(build, train, error, match, check="always", **kwargs):
    """``train(*build(), **kwargs)`` under ``Watch``, everything built inside it as a script's ``main()`` builds it,
    raises ``error`` matching ``match``; returns the error and what was built."""
    built = []

    def main():
        torch.manual_seed(0)
        built.extend(build())
        return train(*built, **kwargs)
    with pytest.raises(error, match=match) as caught:
        watched(main, check=check)
    return caught.value, built


# -- seed 001: a tensor built before trainer.run, reused by every iteration -------------------------------------------
def prompt_build():
    model, codes = net(), nn.Linear(2, 4)
    optimizer = torch.optim.SGD([*model.parameters(), *codes.parameters()], lr=0.05)
    return model, codes, optimizer, regression(4)


def prompted(model, codes, optimizer, data, guard=None, fixed=False, taken=None):
    """A learned prompt added to the inputs through ``model_fn``: built once before ``trainer.run`` (the mistake) or
    in ``model_fn`` (the fix)."""
    prompt = codes(torch.ones(1, 2))
    if fixed:
        model_fn = lambda model, x: model(x + codes(torch.ones(1, 2)))  # noqa: E731
    else:
        model_fn = lambda model, x: model(x + prompt)  # noqa: E731
    trainer = create_supervised_trainer(model, optimizer, checked(nn.MSELoss(), guard), model_fn=model_fn)
    iteration_steps(trainer, guard)
    if taken is not None:
        snapshots(trainer, model, taken)
    trainer.run(data, max_epochs=2)
    return {"model": model, "codes": codes}


def test_prompt_built_before_run_is_stopped_before_the_second_update():
    """``create_supervised_trainer(model_fn=lambda model, x: model(x + prompt))`` with ``prompt = codes(...)`` made
    once before ``trainer.run``: under watch, stopped before the backward of the first or (ignite's first backward
    preceding every optimizer step, the first iteration is hard to tell from set-up) the second iteration, nothing
    changed by it; ``model_fn`` computing the prompt itself trains quiet and bit for bit as bare."""
    taken = []
    err, (model, *_) = stopped(prompt_build, prompted, taken=taken, error=(GraphReuseError, CarriedGraphError),
                               match=r"step [12], loss 'loss'.*AddmmBackward0")
    assert len(taken) == err.step  # the updates before the stopped one, and the parameters as they left them
    same(dict(model.named_parameters()), taken[-1])
    three_runs(prompt_build, lambda *a, guard=None: prompted(*a, guard=guard, fixed=True), "always")


def test_prompt_built_before_run_is_named_under_watch():
    """As above: the error names ``prompt`` (the closure variable of the user's ``model_fn``) and does not advise
    detaching ignite's model output."""
    err, _ = stopped(prompt_build, prompted, error=(GraphReuseError, CarriedGraphError), match=r"`[\w ]*prompt`")
    assert "output.detach()" not in str(err)


def test_prompt_built_before_run_is_named_by_a_graph_guard():
    """``GraphGuard(model)`` driven from ``ITERATION_STARTED``/``COMPLETED`` handlers, ``guard.check`` in the loss
    function: the prompt built before ``trainer.run`` is named (``prompt``) at the first iteration."""
    torch.manual_seed(0)
    model, codes, optimizer, data = prompt_build()
    with pytest.raises(GraphReuseError, match=r"step 1, .*`[\w ]*prompt`"):
        prompted(model, codes, optimizer, data, guard=GraphGuard(model, check="always"))


class Prompted(nn.Module):
    """The same prompt built in ``__init__`` (``self.prompt = self.embed(...)``), or in ``forward`` (the fix)."""

    def __init__(self, fixed=False):
        super().__init__()
        self.fixed = fixed
        self.embed = nn.Linear(2, 4)
        self.body = net()
        if not fixed:
            self.prompt = self.embed(torch.ones(1, 2))

    def forward(self, x):
        prompt = self.embed(torch.ones(1, 2)) if self.fixed else self.prompt
        return self.body(x + prompt)


def attribute_build(fixed=False):
    model = Prompted(fixed)
    return model, torch.optim.SGD(model.parameters(), lr=0.05), regression(4)


def attribute(model, optimizer, data, guard=None, taken=None):
    trainer = create_supervised_trainer(model, optimizer, checked(nn.MSELoss(), guard))
    iteration_steps(trainer, guard)
    if taken is not None:
        snapshots(trainer, model, taken)
    trainer.run(data, max_epochs=2)
    return {"model": model}


def test_graph_built_in_init_is_named_as_a_model_attribute():
    """``self.prompt = self.embed(...)`` in the model's ``__init__``, trained by ``create_supervised_trainer``:
    watch names ``model.prompt`` before the update of the first or second iteration; a ``GraphGuard(model)`` in the
    iteration events stops the first; computed in ``forward`` it trains quiet, bit for bit as bare."""
    taken = []
    err, (model, *_) = stopped(attribute_build, attribute, taken=taken, error=(CarriedGraphError, GraphReuseError),
                               match=r"step [12], .*held by `model\.prompt`")
    assert len(taken) == err.step
    same(dict(model.named_parameters()), taken[-1])
    torch.manual_seed(0)
    model, optimizer, data = attribute_build()
    start = deepcopy(dict(model.named_parameters()))
    with pytest.raises(GraphReuseError, match=r"step 1, .*`model\.prompt`.*recompute `model\.prompt`"):
        attribute(model, optimizer, data, guard=GraphGuard(model, check="always"))
    same(dict(model.named_parameters()), start)
    three_runs(lambda: attribute_build(fixed=True), attribute, "always")


# -- the DCGAN update's mistakes ---------------------------------------------------------------------------------------
def test_dcgan_fake_not_detached_for_the_discriminator():
    """examples/gan/dcgan.py with ``netD(fake)`` where the source has ``netD(fake.detach())``: D's loss frees G's
    graph, G's backward would fail. Watch and a ``GraphGuard`` in the update name ``fake`` before G's backward and
    its update; the source's ``fake.detach()`` is the fix (``test_custom_engine_dcgan_two_optimizers``)."""
    err, (netG, *_) = stopped(gan_build, dcgan, mistake="fake not detached", error=DoubleBackwardError,
                              match=r"TanhBackward0.*held by `local fake`.*`fake\.detach\(\)`")
    assert netG.net[0].weight.grad is None  # netG.zero_grad() cleared D's pollution; G's backward never ran
    torch.manual_seed(0)
    netG, netD, loader = gan_build()
    start = deepcopy(dict(netG.named_parameters()))
    with pytest.raises(DoubleBackwardError, match=r"held by `local fake`.*To fix: if the earlier loss .* must not "
                                                  r"reach `fake` .*detach it where that loss uses it \(`fake\.detach"):
        dcgan(netG, netD, loader, guard=GraphGuard(check="always"), mistake="fake not detached")
    same(dict(netG.named_parameters()), start)


def test_dcgan_discriminator_loss_summed_and_back_propagated_again():
    """``errD = errD_real + errD_fake; errD.backward()`` after both parts were back-propagated: stopped by watch
    before the second backward, naming the graph of ``errD_real``."""
    stopped(gan_build, dcgan, mistake="errD backward", error=DoubleBackwardError,
            match=r"step 1, .*`(local )?errD_real`")


def test_dcgan_discriminator_loss_summed_and_back_propagated_again_is_advised_away():
    """As above: the message advises deleting the backward of the sum, whose parts already went back, not
    ``retain_graph=True``, which would add D's gradients twice."""
    err, _ = stopped(gan_build, dcgan, mistake="errD backward", error=DoubleBackwardError, match="errD_real")
    fixes = str(err).split("To fix:")[1]
    assert "pass retain_graph=True" not in fixes and "delete" in fixes


def test_dcgan_generator_output_taken_before_the_discriminator_step():
    """``output = netD(fake)`` for G's loss computed before ``optimizerD.step()``: the step writes the D weights
    G's graph saved. Watch names the optimizer step between the loss and its backward; a ``GraphGuard`` told the
    optimizers does too; both before G's backward."""
    stopped(gan_build, dcgan, mistake="G output before D step", error=InplaceModificationError,
            match=r"optimizer .* stepped after this loss was built and before its backward.*recompute the loss after")
    torch.manual_seed(0)
    netG, netD, loader = gan_build()
    start = deepcopy(dict(netG.named_parameters()))
    with pytest.raises(InplaceModificationError, match=r"optimizerD"):
        dcgan(netG, netD, loader, guard=lambda model, opts: GraphGuard(model, opts, check="always"),
              mistake="G output before D step")
    same(dict(netG.named_parameters()), start)


# -- a running loss kept with its graph by a handler --------------------------------------------------------------
def logged(model, optimizer, data, guard=None, fixed=False):
    """A custom update returning the loss TENSOR (the mistake) or its ``.item()`` (the fix); a handler sums
    ``engine.state.output`` into ``engine.state.running_loss`` each epoch, as ignite's own examples log it."""
    step, backward = hooks(guard)

    def update(engine, batch):
        with step():
            model.train()
            optimizer.zero_grad()
            x, y = batch
            loss = F.mse_loss(model(x), y)
            backward(loss)
            optimizer.step()
            return loss.item() if fixed else loss

    trainer = Engine(update)
    epochs = []

    @trainer.on(Events.EPOCH_STARTED)
    def reset(engine):
        engine.state.running_loss = 0.0

    @trainer.on(Events.ITERATION_COMPLETED)
    def accumulate(engine):
        engine.state.running_loss += engine.state.output

    @trainer.on(Events.EPOCH_COMPLETED)
    def log(engine):
        epochs.append(engine.state.running_loss / engine.state.epoch_length)

    trainer.run(data, max_epochs=2)
    return {"model": model, "epochs": epochs}


def test_running_loss_kept_with_its_graph_in_engine_state():
    """``engine.state.running_loss += engine.state.output`` with an update returning the loss tensor: every
    iteration's graph piles up in ``engine.state``. Watch and a ``GraphGuard`` in the update warn
    (``GraphLeakWarning``, advising ``loss.item()``); returning ``loss.item()`` runs quiet and right."""
    for guard in (None, GraphGuard(check="always")):
        torch.manual_seed(0)
        with pytest.warns(GraphLeakWarning, match=r"steps 1 and 2.*(\.item\(\)|detach)"):
            if guard is None:
                watched(logged, *build(4))
            else:
                logged(*build(4), guard=guard)
    ref = three_runs(lambda: build(4), lambda *a, guard=None: logged(*a, guard=guard, fixed=True), "always")
    assert len(ref["epochs"]) == 2


def test_running_loss_kept_with_its_graph_is_named():
    """As above: the warning names ``engine.state.running_loss``, the holder of both steps' graphs."""
    torch.manual_seed(0)
    with pytest.warns(GraphLeakWarning, match=r"running_loss"):
        watched(logged, *build(4))


# -- a hidden state carried across iterations in engine.state (truncated BPTT without detach) ------------------------
def rnn_build():
    rnn, head = nn.GRU(3, 5, batch_first=True), nn.Linear(5, 1)
    gen = torch.Generator().manual_seed(2)
    chunks = [(torch.randn(2, 4, 3, generator=gen), torch.randn(2, 4, 1, generator=gen)) for _ in range(4)]
    return rnn, head, torch.optim.SGD([*rnn.parameters(), *head.parameters()], lr=0.1), chunks


def tbptt(rnn, head, optimizer, chunks, guard=None, fixed=False):
    """A sequence cut in chunks, the GRU's hidden state carried in ``engine.state.hidden`` from chunk to chunk;
    ``fixed``: detached at the end of each iteration (what ignite's ``create_supervised_tbptt_trainer`` does)."""
    step, backward = hooks(guard)

    def update(engine, batch):
        with step():
            x, y = batch
            out, engine.state.hidden = rnn(x, engine.state.hidden)
            loss = F.mse_loss(head(out), y)
            optimizer.zero_grad()
            backward(loss)
            optimizer.step()
            if fixed:
                engine.state.hidden = engine.state.hidden.detach()
            return loss.item()

    trainer = Engine(update)

    @trainer.on(Events.STARTED)
    def init(engine):
        engine.state.hidden = None

    trainer.run(chunks, max_epochs=1)
    return {"rnn": rnn, "head": head}


def test_hidden_state_carried_in_engine_state():
    """``out, engine.state.hidden = rnn(x, engine.state.hidden)`` without a detach: watch and a ``GraphGuard`` stop
    the second iteration before its backward (``CarriedGraphError``), nothing of it applied; detached at the end
    of each iteration it trains quiet and bit for bit as bare."""
    for guard in (None, GraphGuard(check="always")):
        torch.manual_seed(0)
        rnn, head, optimizer, chunks = rnn_build()
        start = deepcopy(dict(rnn.named_parameters()))
        with pytest.raises(CarriedGraphError, match=r"step 2, .*created during an earlier step.*truncated BPTT"):
            if guard is None:
                watched(tbptt, rnn, head, optimizer, chunks)
            else:
                tbptt(rnn, head, optimizer, chunks, guard=guard)
        assert any(not torch.equal(p, start[n]) for n, p in rnn.named_parameters())  # the first update ran
    three_runs(rnn_build, lambda *a, guard=None: tbptt(*a, guard=guard, fixed=True), "always")


def test_hidden_state_carried_in_engine_state_is_named():
    """As above: the error names ``engine.state.hidden`` and advises detaching it."""
    torch.manual_seed(0)
    with pytest.raises(CarriedGraphError, match=r"held by `[\w ]*engine\.state\.hidden`"):
        watched(tbptt, *rnn_build())


# -- a loss without a graph ----------------------------------------------------------------------------------------
def graphless(model, optimizer, data, guard=None, how="no_grad"):
    """``create_supervised_trainer`` with a loss function that computes under ``torch.no_grad()``, round-trips
    through ``.item()``, or a model frozen whole (``requires_grad_(False)`` on every parameter)."""
    if how == "no_grad":
        def loss_fn(y_pred, y):
            with torch.no_grad():
                return F.mse_loss(y_pred, y)
    elif how == "item":
        def loss_fn(y_pred, y):
            return torch.tensor(F.mse_loss(y_pred, y).item(), requires_grad=True)
    else:
        model.requires_grad_(False)
        loss_fn = nn.MSELoss()
    guard = guard(model) if guard is not None else None
    trainer = create_supervised_trainer(model, optimizer, checked(loss_fn, guard))
    iteration_steps(trainer, guard)
    trainer.run(data, max_epochs=1)
    return {"model": model}


NO_GRAPH = {"no_grad": r"computed under no_grad", "item": r"torch\.tensor\(loss\.item\(\), requires_grad=True\)",
            "frozen": r"every parameter of the model has requires_grad=False"}


@pytest.mark.parametrize("how", list(NO_GRAPH))
def test_loss_without_a_graph_under_watch(how):
    """``create_supervised_trainer``'s ``loss.backward()`` on a loss with no graph: watch raises ``NoGraphError``
    at the first iteration saying why, before anything is written."""
    stopped(lambda: build(3), graphless, how=how, error=NoGraphError, match=r"step 1, .*" + NO_GRAPH[how])


@pytest.mark.parametrize("how", [
    "no_grad", "frozen",
    "item"])
def test_loss_without_a_graph_under_a_graph_guard(how):
    """The same with ``GraphGuard(model)``'s ``check`` in the loss function (ignite runs the backward): the same
    ``NoGraphError`` at the first iteration."""
    torch.manual_seed(0)
    model, optimizer, data = build(3)
    start = deepcopy(dict(model.named_parameters()))
    with pytest.raises(NoGraphError, match=r"step 1, .*" + NO_GRAPH[how]):
        graphless(model, optimizer, data, guard=lambda model: GraphGuard(model, check="always"), how=how)
    same(dict(model.named_parameters()), start)


# -- an in-place change to a tensor autograd saved ------------------------------------------------------------------
class Gated(nn.Module):
    """``h = sigmoid(fc(x)); h += skip(x)`` (sigmoid saved its output for backward; the mistake) or ``h = h + ...``."""

    def __init__(self, fixed=False):
        super().__init__()
        self.fixed = fixed
        self.fc, self.skip, self.out = nn.Linear(4, 8), nn.Linear(4, 8), nn.Linear(8, 1)

    def forward(self, x):
        h = torch.sigmoid(self.fc(x))
        if self.fixed:
            h = h + self.skip(x)
        else:
            h += self.skip(x)
        return self.out(h)


def gated_build(fixed=False):
    model = Gated(fixed)
    return model, torch.optim.SGD(model.parameters(), lr=0.1), regression(3)


def gated(model, optimizer, data, guard=None):
    guard = guard(model) if callable(guard) else guard
    trainer = create_supervised_trainer(model, optimizer, checked(nn.MSELoss(), guard))
    iteration_steps(trainer, guard)
    trainer.run(data, max_epochs=2)
    return {"model": model}


def test_saved_tensor_changed_in_place_in_forward():
    """A model whose ``forward`` adds in place to sigmoid's saved output, trained by ``create_supervised_trainer``:
    watch turns PyTorch's error into an ``InplaceModificationError`` naming sigmoid's output and the out-of-place
    fix, before the update; written ``h = h + ...`` it trains quiet and bit for bit as bare."""
    err, (model, *_) = stopped(gated_build, gated, error=InplaceModificationError,
                               match=r"step 1, .*the output of Sigmoid.*x = x \+ 1")
    assert model.fc.weight.grad is None or not model.fc.weight.grad.any()
    three_runs(lambda: gated_build(fixed=True), gated, "always")


def test_saved_tensor_changed_in_place_in_forward_under_a_graph_guard():
    """As above with ``GraphGuard(model)``'s ``check`` in the loss function: an ``InplaceModificationError`` before
    ignite's backward (the saved tensor's version has moved: readable without running anything)."""
    torch.manual_seed(0)
    with pytest.raises(InplaceModificationError, match=r"Sigmoid"):
        gated(*gated_build(), guard=lambda model: GraphGuard(model, check="always"))


# -- Checkpoint / ModelCheckpoint: saving mid-run, a resumed run ------------------------------------------------------
def checkpointed(model, optimizer, data, guard=None, folder="ckpt", stop_at=None, resume=None, epochs=4):
    """``Checkpoint`` of the model, optimizer, LR scheduler and trainer on every epoch end, ``ModelCheckpoint`` of the
    model every 3 iterations; ``stop_at``: the run is cut at that epoch's end (``trainer.terminate()``);
    ``resume``: a checkpoint file loaded (``Checkpoint.load_objects``) before ``trainer.run``."""
    trainer = create_supervised_trainer(model, optimizer, checked(nn.MSELoss(), guard))
    iteration_steps(trainer, guard)
    scheduler = LRScheduler(torch.optim.lr_scheduler.StepLR(optimizer, step_size=4, gamma=0.5))
    trainer.add_event_handler(Events.ITERATION_COMPLETED, scheduler)
    to_save = {"model": model, "optimizer": optimizer, "trainer": trainer, "lr_scheduler": scheduler}
    trainer.add_event_handler(Events.EPOCH_COMPLETED,
                              Checkpoint(to_save, DiskSaver(folder, require_empty=False), n_saved=None))
    trainer.add_event_handler(Events.ITERATION_COMPLETED(every=3),
                              ModelCheckpoint(folder, "weights", n_saved=2, require_empty=False), {"model": model})
    if stop_at is not None:
        trainer.add_event_handler(Events.EPOCH_COMPLETED(once=stop_at), lambda e: e.terminate())
    if resume is not None:
        Checkpoint.load_objects(to_load=to_save, checkpoint=torch.load(resume, weights_only=False))
    trainer.run(data, max_epochs=epochs)
    return {"model": model, "optimizer": optimizer.state_dict(), "iteration": trainer.state.iteration,
            "epoch": trainer.state.epoch}


@pytest.mark.parametrize("check", checks())
def test_checkpoint_saved_mid_run_and_resumed_under_watch(check, tmp_path):
    """``ignite.handlers.Checkpoint`` (model, optimizer, ``LRScheduler``, ``Engine.state_dict``) and
    ``ModelCheckpoint`` saving while the trainer runs; a run cut after epoch 2 and resumed from its checkpoint
    (``Checkpoint.load_objects``, ``trainer.run`` going on from epoch 2) under watch, and with a ``GraphGuard``,
    ends bit for bit where an uninterrupted bare run ends; so does an uninterrupted run under watch."""
    ref = three_runs(build, lambda *a, guard=None: checkpointed(*a, guard=guard, folder=str(tmp_path / "whole")),
                     check)
    assert ref["iteration"] == 20
    for guard in (None, "guard"):
        folder = tmp_path / f"cut-{guard}"
        with strict([]), Watch(GraphGuard(check=check), checkpointed.__code__.co_filename) if guard is None \
                else contextlib.nullcontext():
            torch.manual_seed(0)
            model, optimizer, data = build()
            torch.manual_seed(1)
            cut = checkpointed(model, optimizer, data, guard=guard and GraphGuard(check=check), folder=str(folder),
                               stop_at=2)
            assert cut["epoch"] == 2 and cut["iteration"] == 10
            saved = sorted(folder.glob("checkpoint_*.pt"))
            assert [p.name for p in saved] == ["checkpoint_10.pt", "checkpoint_5.pt"]
            assert len(list(folder.glob("weights_*.pt"))) == 2
            torch.manual_seed(0)
            model, optimizer, data = build()
            resumed = checkpointed(model, optimizer, data, guard=guard and GraphGuard(check=check),
                                   folder=str(folder), resume=folder / "checkpoint_10.pt")
        same(resumed, ref)


# -- python -m safeloop.watch script.py, in a subprocess -------------------------------------------------------------
SCRIPT = '''
import hashlib
import sys

import torch
import torch.nn as nn
from ignite.engine import Events, create_supervised_evaluator, create_supervised_trainer
from ignite.handlers import Checkpoint, DiskSaver, EMAHandler, PiecewiseLinear
from ignite.metrics import Loss, RunningAverage

torch.manual_seed(0)
gen = torch.Generator().manual_seed(3)
data = [(torch.randn(8, 4, generator=gen), torch.randn(8, 1, generator=gen)) for _ in range(5)]
model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 1))
optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
trainer = create_supervised_trainer(model, optimizer, nn.MSELoss(), gradient_accumulation_steps=2)
evaluator = create_supervised_evaluator(model, metrics={"mse": Loss(nn.MSELoss())})
trainer.add_event_handler(Events.ITERATION_STARTED,
                          PiecewiseLinear(optimizer, "lr", milestones_values=[(0, 0.0), (4, 0.1), (15, 0.01)]))
ema = EMAHandler(model, momentum=0.01)
ema.attach(trainer, name="ema_momentum", event=Events.ITERATION_COMPLETED)
RunningAverage(output_transform=lambda loss: loss).attach(trainer, "loss")
to_save = {"model": model, "optimizer": optimizer, "trainer": trainer}
trainer.add_event_handler(Events.EPOCH_COMPLETED, Checkpoint(to_save, DiskSaver(sys.argv[1], require_empty=False)))


@trainer.on(Events.ITERATION_COMPLETED(every=4))
def validate(engine):
    evaluator.run(data[:2])


trainer.run(data, max_epochs=3)
digest = hashlib.sha256()
for module in (model, ema.ema_model):
    for name, t in module.state_dict().items():
        digest.update(name.encode() + t.detach().numpy().tobytes())
print("state", digest.hexdigest(), trainer.state.iteration, round(trainer.state.metrics["loss"], 6))
'''


def run_script(path, *watch, folder):
    env = {**os.environ, "PYTHONPATH": HERE, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, *(["-m", "safeloop.watch", *watch] if watch else []), str(path), str(folder)]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)


def test_python_m_safeloop_watch_runs_an_ignite_script_unchanged(tmp_path, capsys, monkeypatch):
    """``python -m safeloop.watch --check always script.py`` on a script using ``create_supervised_trainer``
    (accumulating over 2 iterations), ``create_supervised_evaluator``, ``PiecewiseLinear``, ``EMAHandler``,
    ``RunningAverage`` and ``Checkpoint``: it prints the same digest of the model and EMA weights as the script run
    bare (here, by ``runpy`` as ``python script.py`` runs it), and writes no warning or error to stderr."""
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    monkeypatch.setattr(sys, "argv", [str(script), str(tmp_path / "bare")])
    runpy.run_path(str(script), run_name="__main__")
    bare = capsys.readouterr().out
    ours = run_script(script, "--check", "always", folder=tmp_path / "always")
    assert ours.returncode == 0, ours.stderr
    assert ours.stdout == bare and bare.startswith("state ")
    assert "Warning" not in ours.stderr and "safeloop" not in ours.stderr
    assert (tmp_path / "always" / "checkpoint_15.pt").exists()


# -- more of ignite's pieces: a guard ended by the optimizer, an evaluator with grad on, clipping, the LR finder ------
def accumulated_checked(model, optimizer, data, guard=None, steps=2):
    """``create_supervised_trainer(gradient_accumulation_steps=steps)`` with ``guard.check`` in the loss function and
    no step marks: a ``GraphGuard(model, optimizer)`` ends its steps at the optimizer's."""
    trainer = create_supervised_trainer(model, optimizer, checked(nn.MSELoss(), guard),
                                        gradient_accumulation_steps=steps)
    trainer.run(data, max_epochs=3)
    return {"model": model, "optimizer": optimizer.state_dict()}


@pytest.mark.parametrize("steps", [2, 3])
@pytest.mark.parametrize("check", checks())
def test_graph_guard_ended_by_the_optimizer_over_accumulated_iterations(check, steps):
    """``GraphGuard(model, optimizer)`` (a step ends at each ``optimizer.step()``) checking in the loss function of
    ``create_supervised_trainer(gradient_accumulation_steps=2 or 3)``: several iterations' backwards in one step,
    the last micro-batches of an epoch updating with the next epoch's first ones."""
    three_runs(build, lambda *a, guard=None: accumulated_checked(*a, guard=guard, steps=steps), check,
               guard_for=lambda check, model, optimizer, data: GraphGuard(model, optimizer, check=check))


def evaluated_every_three(trainer, model, data, eval_step):
    """``trainer.run(data, max_epochs=3)`` with an evaluation ``Engine(eval_step)`` over two batches every three
    iterations (its ``Loss`` metric kept): the model and the scores."""
    evaluator = Engine(eval_step)
    Loss(nn.MSELoss()).attach(evaluator, "mse")
    scores = []

    @trainer.on(Events.ITERATION_COMPLETED(every=3))
    def evaluate(engine):
        evaluator.run(data[:2])
        scores.append(evaluator.state.metrics["mse"])

    trainer.run(data, max_epochs=3)
    return {"model": model, "scores": scores}


def evaluated_with_grad(model, optimizer, data, guard=None):
    """A hand-written evaluation ``Engine`` without ``torch.no_grad()`` (its forwards build graphs that are dropped),
    run every 3 iterations of a trainer accumulating over 2: between two micro-batches of one update."""
    trainer = create_supervised_trainer(model, optimizer, checked(nn.MSELoss(), guard), gradient_accumulation_steps=2)
    iteration_steps(trainer, guard)

    def eval_step(engine, batch):
        model.eval()
        x, y = batch
        return model(x), y

    return evaluated_every_three(trainer, model, data, eval_step)


@pytest.mark.parametrize("check", checks())
def test_evaluator_with_grad_on_between_micro_batches(check):
    """An evaluation ``Engine`` whose step forgets ``torch.no_grad()``, run by ``ITERATION_COMPLETED(every=3)`` while
    ``create_supervised_trainer`` accumulates gradients over 2 iterations: its graphs are no step's; nothing is
    said and nothing changes."""
    ref = three_runs(build, evaluated_with_grad, check)
    assert len(ref["scores"]) == 5


def clipped(model, optimizer, data, guard=None):
    """A custom update with ``clip_grad_norm_`` between backward and step (ignite 0.5.5's
    ``supervised_training_step`` has no clipping argument: its users write the update)."""
    step, backward = hooks(guard)

    def update(engine, batch):
        with step():
            model.train()
            optimizer.zero_grad()
            x, y = batch
            loss = F.mse_loss(model(x), y)
            backward(loss)
            norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), 0.1))
            optimizer.step()
            return loss.item()

    norms = []
    Engine(update).run(data, max_epochs=2)
    return {"model": model, "norms": norms}


@pytest.mark.parametrize("check", checks())
def test_custom_update_with_gradient_clipping(check):
    """``Engine(update)`` with ``torch.nn.utils.clip_grad_norm_`` after the backward: the same clipped update."""
    ref = three_runs(build, clipped, check)
    assert all(n > 0.1 for n in ref["norms"])


def lr_found(model, optimizer, data, guard=None):
    """``ignite.handlers.FastaiLRFinder``: a range test run by the trainer (its own handlers stepping the LR), the
    model and optimizer put back from its copies, then the real run."""
    trainer = create_supervised_trainer(model, optimizer, checked(nn.MSELoss(), guard))
    iteration_steps(trainer, guard)
    finder = FastaiLRFinder()
    with finder.attach(trainer, {"model": model, "optimizer": optimizer}, num_iter=4, end_lr=1.0) as finding:
        finding.run(data)
    history = finder.get_results()
    trainer.run(data, max_epochs=2)
    return {"model": model, "lr": history["lr"], "loss": history["loss"], "optimizer": optimizer.state_dict()}


@pytest.mark.parametrize("check", checks())
def test_fastai_lr_finder_then_training(check):
    """``FastaiLRFinder.attach(trainer, to_save)`` runs 4 iterations with a growing LR, restores the model and the
    optimizer (``load_state_dict`` between two runs of the same trainer), then the trainer trains."""
    ref = three_runs(build, lr_found, check)
    assert len(ref["lr"]) > 3 and ref["lr"] == sorted(ref["lr"])


def test_dcgan_generator_output_before_the_discriminator_step_without_optimizers_given():
    """``GraphGuard()`` in the DCGAN update, not told the optimizers: the in-place error does not claim that no
    optimizer stepped (it cannot know; watch, which sees every optimizer step, names the step)."""
    torch.manual_seed(0)
    with pytest.raises(InplaceModificationError) as caught:
        dcgan(*gan_build(), guard=GraphGuard(check="always"), mistake="G output before D step")
    assert "no optimizer step in between" not in str(caught.value)


def adversarial_eval(model, optimizer, data, guard=None):
    """An FGSM robustness evaluator (``torch.autograd.grad`` of the loss on the inputs, in the evaluator's step) run
    every 3 iterations of a trainer accumulating over 2."""
    trainer = create_supervised_trainer(model, optimizer, checked(nn.MSELoss(), guard), gradient_accumulation_steps=2)
    iteration_steps(trainer, guard)

    def eval_step(engine, batch):
        model.eval()
        x, y = batch
        x = x.clone().requires_grad_(True)
        grad, = torch.autograd.grad(F.mse_loss(model(x), y), x)
        with torch.no_grad():
            return model(x + 0.1 * grad.sign()), y

    return evaluated_every_three(trainer, model, data, eval_step)


@pytest.mark.parametrize("check", checks())
def test_adversarial_evaluator_taking_input_gradients_between_micro_batches(check):
    """An evaluation ``Engine`` whose step calls ``torch.autograd.grad(loss, x)`` (FGSM), between two micro-batches of
    ``create_supervised_trainer(gradient_accumulation_steps=2)``: under watch that call goes through the guard too; it
    writes no ``.grad`` and ends no step; the accumulated gradients and the update are the bare run's."""
    ref = three_runs(build, adversarial_eval, check)
    assert len(ref["scores"]) == 5


def best_kept(model, optimizer, data, guard=None):
    """Every 2 iterations the model is copied whole (``copy.deepcopy`` and ``torch.save(model)`` / ``torch.load``) and
    the copies evaluated by ``create_supervised_evaluator``, as a keep-the-best handler does."""
    trainer = create_supervised_trainer(model, optimizer, checked(nn.MSELoss(), guard))
    iteration_steps(trainer, guard)
    scores = []

    @trainer.on(Events.ITERATION_COMPLETED(every=2))
    def keep(engine):
        path = f"model_{engine.state.iteration}.pt"
        torch.save(model, path)
        for copy in (deepcopy(model), torch.load(path, weights_only=False)):
            evaluator = create_supervised_evaluator(copy, metrics={"mse": Loss(nn.MSELoss())})
            evaluator.run(data[:2])
            scores.append(evaluator.state.metrics["mse"])

    trainer.run(data, max_epochs=2)
    last = torch.load("model_10.pt", weights_only=False)
    return {"model": model, "scores": scores, "pickled hooks": [len(m._forward_hooks) + len(m._forward_pre_hooks)
                                                                for m in last.modules()]}


@pytest.mark.parametrize("check", checks())
def test_model_copied_and_pickled_whole_mid_run(check):
    """``deepcopy(model)`` and ``torch.save(model, path)`` of the trained module while ignite trains it (under
    ``check="always"`` the guard has put its fingerprint hooks on it by then): the copies evaluate as bare, the
    pickle loads the same module, and training is unchanged."""
    ref = three_runs(build, best_kept, check)
    assert len(ref["scores"]) == 10 and not any(ref["pickled hooks"])


class Seq(nn.Module):
    """An LSTM tagger returning ``(y_pred, hidden)`` as ``create_supervised_tbptt_trainer`` expects."""

    def __init__(self):
        super().__init__()
        self.rnn, self.head = nn.LSTM(3, 5), nn.Linear(5, 1)

    def forward(self, x, hidden=None):
        out, hidden = self.rnn(x, hidden)
        return self.head(out), hidden


def seq_build():
    model = Seq()
    gen = torch.Generator().manual_seed(2)
    data = [(torch.randn(8, 2, 3, generator=gen), torch.randn(8, 2, 1, generator=gen)) for _ in range(3)]
    return model, torch.optim.Adam(model.parameters(), lr=0.01), data


def tbptt_trainer(model, optimizer, data, guard=None):
    """``ignite.contrib.engines.create_supervised_tbptt_trainer``: each batch cut in chunks of 3 time steps, one
    backward and one optimizer step per chunk, the hidden state detached between chunks; the guard's steps are
    ignite's ``Tbptt_Events.TIME_ITERATION_STARTED`` / ``COMPLETED``."""
    from ignite.contrib.engines import Tbptt_Events, create_supervised_tbptt_trainer
    trainer = create_supervised_tbptt_trainer(model, optimizer, checked(nn.MSELoss(), guard), tbtt_step=3)
    if guard is not None:
        steps = contextlib.ExitStack()
        trainer.add_event_handler(Tbptt_Events.TIME_ITERATION_STARTED, lambda _: steps.enter_context(guard.step()))
        trainer.add_event_handler(Tbptt_Events.TIME_ITERATION_COMPLETED, lambda _: steps.close())
    outputs = []
    trainer.add_event_handler(Events.ITERATION_COMPLETED, lambda e: outputs.append(e.state.output))
    trainer.run(data, max_epochs=2)
    return {"model": model, "optimizer": optimizer.state_dict(), "outputs": outputs}


@pytest.mark.parametrize("check", checks())
def test_create_supervised_tbptt_trainer(check):
    """``create_supervised_tbptt_trainer``: three backwards and three updates inside each ignite iteration, the LSTM
    state carried (detached by ignite) from chunk to chunk."""
    ref = three_runs(seq_build, tbptt_trainer, check)
    assert len(ref["outputs"]) == 6


def probed(model, optimizer, data, guard=None):
    """A linear probe trained on the encoder's frozen features by a loop of its own (three passes, its own optimizer)
    in an ``EPOCH_COMPLETED`` handler, while ``create_supervised_trainer`` accumulates over 2 iterations (the epoch
    ends between two micro-batches of one update)."""
    trainer = create_supervised_trainer(model, optimizer, checked(nn.MSELoss(), guard), gradient_accumulation_steps=2)
    iteration_steps(trainer, guard)
    head = nn.Linear(8, 3)
    probe_optimizer = torch.optim.SGD(head.parameters(), lr=0.1)
    labels = [torch.randint(3, (8,)) for _ in data]

    @trainer.on(Events.EPOCH_COMPLETED)
    def linear_probe(engine):
        model.eval()
        for _ in range(3):
            for (x, _), label in zip(data, labels):
                with torch.no_grad():
                    features = model[:3](x)
                loss = F.cross_entropy(head(features), label)
                probe_optimizer.zero_grad()
                loss.backward()
                probe_optimizer.step()

    trainer.run(data, max_epochs=3)
    return {"model": model, "head": head, "optimizer": optimizer.state_dict()}


@pytest.mark.parametrize("check", checks())
def test_linear_probe_loop_in_an_epoch_handler(check):
    """A second training loop (its own backward call site, more steps per epoch than the trainer's) run inside an
    ignite handler: under watch its steps and the trainer's interleave; nothing is said and both train as bare."""
    ref = three_runs(build, probed, check)
    assert ref["head"].weight.grad is not None


def amp_scaled(model, optimizer, data, guard=None):
    return supervised(model, optimizer, data, guard=guard, amp_mode="amp", scaler=True,
                      gradient_accumulation_steps=2)


@pytest.mark.parametrize("check", checks())
def test_create_supervised_trainer_amp_mode_with_grad_scaler_on_cpu(check):
    """``create_supervised_trainer(amp_mode="amp", scaler=True, gradient_accumulation_steps=2)``: ignite's
    ``GradScaler`` (disabled with torch's warning where CUDA is missing), ``scaler.scale(loss).backward()``,
    ``scaler.step(optimizer)``, ``scaler.update()``."""
    three_runs(build, amp_scaled, check)


def test_graph_built_in_init_is_said_to_be_built_before_training_under_watch():
    """``self.prompt = self.embed(...)`` in ``__init__``, the model built in the script's ``main()`` before
    ``trainer.run``: watch says it was built before training (``GraphReuseError``) as ``GraphGuard(model)`` does."""
    stopped(attribute_build, attribute, error=GraphReuseError,
            match=r"built before the step.*held by `model\.prompt`.*recompute `model\.prompt`")


def averaged(model, optimizer, data, guard=None):
    """A custom update returning the loss TENSOR (its graph with it), averaged by ``RunningAverage`` over
    ``engine.state.output`` (a float in ``state.metrics``) and kept, replaced every iteration, in
    ``engine.state.last_loss``."""
    step, backward = hooks(guard)

    def update(engine, batch):
        with step():
            model.train()
            optimizer.zero_grad()
            x, y = batch
            loss = F.mse_loss(model(x), y)
            backward(loss)
            optimizer.step()
            return loss

    trainer = Engine(update)
    RunningAverage(output_transform=lambda loss: loss, alpha=0.9).attach(trainer, "loss")
    trainer.add_event_handler(Events.ITERATION_COMPLETED, lambda e: setattr(e.state, "last_loss", e.state.output))
    trainer.run(data, max_epochs=3)
    return {"model": model, "average": trainer.state.metrics["loss"], "last": trainer.state.last_loss.detach()}


@pytest.mark.parametrize("check", checks())
def test_running_average_over_a_loss_tensor_output(check):
    """``RunningAverage(output_transform=lambda loss: loss)`` over an update that returns the loss tensor: ignite
    detaches it before averaging and ``state.output`` holds one iteration's graph at a time (as does a handler
    keeping the last one): no ``GraphLeakWarning``, the same average."""
    ref = three_runs(build, averaged, check)
    assert isinstance(ref["average"], float)


# -- seed 002/004: a loss function that runs its own backward, under ignite's ------------------------------------------
def self_backward(model, optimizer, data, guard=None, taken=None):
    """``create_supervised_trainer`` with a loss function copied from a hand-written loop, backward and all: ignite's
    update then calls ``loss.backward()`` a second time."""
    def loss_fn(y_pred, y):
        loss = F.mse_loss(y_pred, y)
        loss.backward()
        return loss
    trainer = create_supervised_trainer(model, optimizer, loss_fn)
    if taken is not None:
        snapshots(trainer, model, taken)
    trainer.run(data, max_epochs=1)
    return {"model": model}


def test_loss_function_with_its_own_backward():
    """The loss function's own ``loss.backward()`` then ignite's: watch raises ``DoubleBackwardError`` before
    ignite's backward and its ``optimizer.step()``, naming the loss and the line of the loss function's backward."""
    taken = []
    _, (model, *_) = stopped(lambda: build(3), self_backward, taken=taken, error=DoubleBackwardError,
                             match=r"step 1, .*this loss \(MseLossBackward0, held by `local loss`\) was already "
                                   r"back-propagated .* at test_ignite_real\.py:\d+")
    same(dict(model.named_parameters()), taken[0])


def test_loss_function_with_its_own_backward_is_advised_to_drop_it():
    """As above: the fix points at the backward the user wrote (the loss function's), not at ignite's."""
    err, _ = stopped(lambda: build(3), self_backward, error=DoubleBackwardError, match="already back-propagated")
    assert "delete the second backward" not in str(err)


# -- bfloat16 autocast on CPU: a region spanning optimizer steps ------------------------------------------------------
def bf16_build():
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    return model, torch.optim.SGD(model.parameters(), lr=0.1), regression(4)


def bf16(model, optimizer, data, guard=None, how="around run", taken=None):
    """``create_supervised_trainer`` in bfloat16 autocast on CPU. ``how``: "around run", one region around
    ``trainer.run`` (the mistake: autocast keeps its casts of the weights until the outermost region exits);
    "per forward", a region entered by ``model_fn`` for each forward, as ignite's ``supervised_training_step_amp``
    does; "disabled outer", the same inside ``torch.autocast("cpu", enabled=False)`` around ``trainer.run`` (a
    region all the same: the casts are kept again)."""
    def model_fn(model, x):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return model(x)
    trainer = create_supervised_trainer(model, optimizer, checked(lambda p, y: F.mse_loss(p.float(), y), guard),
                                        **({} if how == "around run" else {"model_fn": model_fn}))
    iteration_steps(trainer, guard)
    if taken is not None:
        snapshots(trainer, model, taken)
    outputs = []
    trainer.add_event_handler(Events.ITERATION_COMPLETED, lambda e: outputs.append(e.state.output))
    with contextlib.nullcontext() if how == "per forward" else \
            torch.autocast("cpu", dtype=torch.bfloat16, enabled=how == "around run"):
        trainer.run(data, max_epochs=2)
    return {"model": model, "outputs": outputs}


def test_autocast_region_around_trainer_run():
    """``with torch.autocast("cpu", dtype=torch.bfloat16): trainer.run(...)``: every forward reuses the first
    iteration's bfloat16 casts of the weights (bare, the second epoch's losses repeat the first's). Watch raises
    ``CarriedGraphError`` naming the cast and ``torch.clear_autocast_cache()``; autocast entered in ``model_fn``
    trains quiet and bit for bit as bare."""
    torch.manual_seed(0)
    ref = bf16(*bf16_build())
    assert ref["outputs"][:4] == ref["outputs"][4:]  # the mistake's effect: the forward never sees an update
    stopped(bf16_build, bf16, error=CarriedGraphError,
            match=r"ToCopyBackward0, a low-precision copy of a weight that torch\.autocast made.*"
                  r"torch\.clear_autocast_cache\(\)")
    fixed = three_runs(bf16_build, lambda *a, guard=None: bf16(*a, guard=guard, how="per forward"), "always")
    assert fixed["outputs"][:4] != fixed["outputs"][4:]


def test_autocast_per_forward_inside_a_disabled_outer_region():
    """``model_fn`` entering bfloat16 autocast for each forward, ``trainer.run`` inside
    ``torch.autocast("cpu", enabled=False)``: the disabled region still keeps the casts (bare, the losses of the
    second epoch repeat the first's). Watch names the low-precision copy of the weight and
    ``torch.clear_autocast_cache()``, and does not advise detaching the model's output."""
    torch.manual_seed(0)
    ref = bf16(*bf16_build(), how="disabled outer")
    assert ref["outputs"][:4] == ref["outputs"][4:]
    err, _ = stopped(bf16_build, bf16, how="disabled outer", error=CarriedGraphError,
                     match=r"ToCopyBackward0.*clear_autocast_cache")
    assert "output.detach()" not in str(err)


def test_autocast_region_around_trainer_run_is_stopped_before_the_second_update():
    """As above: the second iteration reaches the casts the first made before an optimizer step changed the weights;
    it is stopped there, before its update."""
    taken = []
    err, (model, *_) = stopped(bf16_build, bf16, taken=taken, error=CarriedGraphError, match="ToCopyBackward0")
    assert err.step == 2
    same(dict(model.named_parameters()), taken[1])


def test_autocast_region_around_trainer_run_message_reads_right():
    """As above: the message's fixes read as one list ("...; or call torch.clear_autocast_cache() ...")."""
    err, _ = stopped(bf16_build, bf16, error=CarriedGraphError, match="ToCopyBackward0")
    assert "or or " not in str(err)


def bf16_gan(netG, netD, loader, guard=None, whole=True):
    """The DCGAN update in bfloat16 autocast: ``whole``, one region around the whole update (the mistake: G's loss
    goes through ``netD``'s casts made before ``optimizerD.step()``); else a region per forward."""
    bce = nn.BCEWithLogitsLoss()
    optimizerG = torch.optim.Adam(netG.parameters(), lr=0.01)
    optimizerD = torch.optim.Adam(netD.parameters(), lr=0.01)
    step_, backward = hooks(guard)

    def autocast(on):  # (a region turned off inside the outer one would compute the forward in float32)
        return torch.autocast("cpu", dtype=torch.bfloat16) if on else contextlib.nullcontext()

    def step(engine, batch):
        real, _ = batch
        with step_(), autocast(whole):
            netD.zero_grad()
            with autocast(not whole):
                errD_real = bce(netD.net[:3](real).view(-1).float(), torch.ones(6))
            backward(errD_real)
            with autocast(not whole):
                fake = netG(torch.randn(6, 3))
                errD_fake = bce(netD.net[:3](fake.detach()).view(-1).float(), torch.zeros(6))
            backward(errD_fake)
            optimizerD.step()
            netG.zero_grad()
            with autocast(not whole):
                errG = bce(netD.net[:3](fake).view(-1).float(), torch.ones(6))
            backward(errG)
            optimizerG.step()
            return errG.item()

    Engine(step).run(loader, max_epochs=2)
    return {"netG": netG, "netD": netD}


def test_autocast_regions_per_forward_in_a_gan_update():
    """The DCGAN update with a bfloat16 autocast region around each forward (as ignite's CycleGAN AMP notebook
    enters one per phase): quiet, bit for bit as bare, in every guard mode."""
    for check in ("auto", "always", "off"):
        three_runs(gan_build, lambda *a, guard=None: bf16_gan(*a, guard=guard, whole=False), check)


def test_autocast_region_around_a_gan_update_spanning_the_discriminator_step():
    """The whole DCGAN update in one bfloat16 autocast region: watch raises before G's backward, naming the
    low-precision copy of ``netD``'s weight made before ``optimizerD.step()``."""
    stopped(gan_build, bf16_gan, error=CarriedGraphError, match=r"ToCopyBackward0.*clear_autocast_cache")


def dropout_build():
    model = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Dropout(0.3), nn.Linear(16, 1))
    return model, torch.optim.Adam(model.parameters(), lr=0.01), regression(5)


def deterministic(model, optimizer, data, guard=None):
    """``create_supervised_trainer(deterministic=True)``: ignite's ``DeterministicEngine`` seeds the RNG from the
    iteration, so dropout's masks depend only on the seed and the iteration."""
    trainer = create_supervised_trainer(model, optimizer, checked(nn.MSELoss(), guard), deterministic=True)
    iteration_steps(trainer, guard)
    outputs = []
    trainer.add_event_handler(Events.ITERATION_COMPLETED, lambda e: outputs.append(e.state.output))
    trainer.run(data, max_epochs=2)
    return {"model": model, "outputs": outputs, "rng": torch.get_rng_state()}


@pytest.mark.parametrize("check", checks())
def test_deterministic_engine_with_dropout(check):
    """``DeterministicEngine`` and a dropout model: the guard draws no random number (the RNG state after the run is
    the bare run's), and the masks, losses and weights are the same bit for bit."""
    ref = three_runs(dropout_build, deterministic, check)
    assert len(ref["outputs"]) == 10


def mean_teacher(model, optimizer, data, guard=None):
    """A mean teacher: ``EMAHandler``'s ``ema_model`` (its parameters detached) gives the consistency target in the
    update, and is averaged by the handler after each iteration."""
    ema = EMAHandler(model, momentum=0.1)
    teacher = ema.ema_model
    step, backward = hooks(guard)

    def update(engine, batch):
        with step():
            model.train()
            optimizer.zero_grad()
            x, y = batch
            pred = model(x)
            loss = F.mse_loss(pred, y) + 0.5 * F.mse_loss(pred, teacher(x + 0.1 * torch.randn_like(x)))
            backward(loss)
            optimizer.step()
            return loss.item()

    trainer = Engine(update)
    ema.attach(trainer, name="ema_momentum", event=Events.ITERATION_COMPLETED)
    trainer.run(data, max_epochs=2)
    return {"model": model, "teacher": teacher}


@pytest.mark.parametrize("check", checks())
def test_ema_handler_model_as_a_mean_teacher(check):
    """``EMAHandler(model).ema_model`` used as the teacher inside the update: its forward in the step, its in-place
    average after it; the student and the teacher come out the same bit for bit."""
    ref = three_runs(build, mean_teacher, check)
    assert not any(p.requires_grad for p in ref["teacher"].parameters())


def mid_epoch(model, optimizer, data, guard=None, folder="ckpt", stop_at=None, resume=None):
    """``create_supervised_trainer(deterministic=True, gradient_accumulation_steps=2)`` with a ``Checkpoint`` every 3
    iterations; ``stop_at``: cut at that iteration; ``resume``: a checkpoint loaded before ``trainer.run``."""
    trainer = create_supervised_trainer(model, optimizer, checked(nn.MSELoss(), guard), deterministic=True,
                                        gradient_accumulation_steps=2)
    iteration_steps(trainer, guard)
    to_save = {"model": model, "optimizer": optimizer, "trainer": trainer}
    trainer.add_event_handler(Events.ITERATION_COMPLETED(every=3),
                              Checkpoint(to_save, DiskSaver(folder, require_empty=False), n_saved=None))
    if stop_at is not None:
        trainer.add_event_handler(Events.ITERATION_COMPLETED(once=stop_at), lambda e: e.terminate())
    if resume is not None:
        Checkpoint.load_objects(to_load=to_save, checkpoint=torch.load(resume, weights_only=False))
    trainer.run(data, max_epochs=3)
    return {"model": model, "optimizer": optimizer.state_dict(), "iteration": trainer.state.iteration}


@pytest.mark.parametrize("check", checks())
def test_checkpoint_mid_epoch_resumed_by_a_deterministic_engine(check, tmp_path):
    """``DeterministicEngine`` resumed from a ``Checkpoint`` saved at iteration 6 (in the middle of the second epoch,
    at an update's end), under watch and with a ``GraphGuard``: the resumed run skips to iteration 7 and ends bit for
    bit where the uninterrupted bare run ends."""
    torch.manual_seed(0)
    ref = mid_epoch(*build(), folder=str(tmp_path / "whole"))
    for guarded in (False, True):
        folder = tmp_path / f"cut-{guarded}"
        with strict([]), contextlib.nullcontext() if guarded else \
                Watch(GraphGuard(check=check), mid_epoch.__code__.co_filename):
            torch.manual_seed(0)
            mid_epoch(*build(), guard=GraphGuard(check=check) if guarded else None, folder=str(folder), stop_at=6)
            torch.manual_seed(0)
            resumed = mid_epoch(*build(), guard=GraphGuard(check=check) if guarded else None, folder=str(folder),
                                resume=folder / "checkpoint_6.pt")
        same(resumed, ref)
    assert ref["iteration"] == 15


# -- k-fold: the last loss of each fold kept with its graph --------------------------------------------------------
def folds(models, data, guard=None, fixed=False):
    """Cross-validation: one model, optimizer and ``Engine`` per fold, the update returning the loss tensor; after
    each ``trainer.run`` the fold's last ``state.output`` is appended to ``results`` (``.item()``: the fix)."""
    step, backward = hooks(guard)
    results = []
    for fold in range(3):
        model = models[fold]
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05)

        def update(engine, batch, model=model, optimizer=optimizer):
            with step():
                model.train()
                optimizer.zero_grad()
                x, y = batch
                loss = F.mse_loss(model(x), y)
                backward(loss)
                optimizer.step()
                return loss

        trainer = Engine(update)
        trainer.run(data[:fold] + data[fold + 1:], max_epochs=2)
        results.append(trainer.state.output.item() if fixed else trainer.state.output)
    return {"models": models, "results": [r.item() if isinstance(r, torch.Tensor) else r for r in results]}


def folds_build():
    return nn.ModuleList([net() for _ in range(3)]), regression(6)


def test_fold_losses_kept_with_their_graphs():
    """``results.append(trainer.state.output)`` after each fold's ``trainer.run``, the output a loss tensor: the list
    keeps a graph per fold. Watch and a ``GraphGuard`` warn ``GraphLeakWarning``; ``.item()`` runs quiet and right."""
    for guard in (None, GraphGuard(check="always")):
        torch.manual_seed(0)
        with pytest.warns(GraphLeakWarning, match=r"kept alive after its step.*(\.item\(\)|detach)"):
            if guard is None:
                watched(folds, *folds_build())
            else:
                folds(*folds_build(), guard=guard)
    three_runs(folds_build, lambda *a, guard=None: folds(*a, guard=guard, fixed=True), "always")


def test_fold_losses_kept_with_their_graphs_are_named():
    """As above: the warning names ``results``."""
    torch.manual_seed(0)
    with pytest.warns(GraphLeakWarning, match=r"`[\w ]*results"):
        watched(folds, *folds_build())


def windowed(model, optimizer, data, guard=None, k=3):
    """A custom update summing the losses of ``k`` iterations in ``engine.state.window`` (graphs and all) and
    back-propagating their mean every ``k``-th iteration: one update's graph spans three ignite iterations."""
    backward = guard.backward if guard is not None else torch.Tensor.backward

    def update(engine, batch):
        model.train()
        x, y = batch
        loss = F.mse_loss(model(x), y)
        engine.state.window = loss if engine.state.iteration % k == 1 else engine.state.window + loss
        if engine.state.iteration % k == 0:
            optimizer.zero_grad()
            backward(engine.state.window / k)
            optimizer.step()
            engine.state.window = None
        return loss.item()

    Engine(update).run(data, max_epochs=2)
    return {"model": model, "optimizer": optimizer.state_dict()}


@pytest.mark.parametrize("check", checks())
def test_losses_summed_over_iterations_then_one_backward(check):
    """The graph of one update built over three iterations in ``engine.state`` (``window + loss``), then one
    backward: under watch and with a ``GraphGuard(model, optimizer)`` (steps ending at the optimizer's), quiet and
    bit for bit as bare."""
    three_runs(lambda: build(6), windowed, check,
               guard_for=lambda check, model, optimizer, data: GraphGuard(model, optimizer, check=check))
