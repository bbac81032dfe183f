"""mmengine's own training loop (written against mmengine-lite 0.10.7, torch 2.13 on CPU): ``OptimWrapper``'s
``update_params`` with gradient accumulation (and the loss scaling of an epoch's tail, computed from the dataloader's
length), gradient clipping and ``optim_context``; ``OptimWrapperDict`` driven by a GAN's own ``train_step``;
``BaseModel.train_step`` with ``parse_losses``; the full ``Runner`` (validation, parameter schedulers, ``EMAHook``,
checkpoints, resuming). Each runs bare, under ``safeloop.watch``'s guard (``Watch``) and with a ``GraphGuard`` put
where mmengine lets a user put one (a registered ``OptimWrapper`` whose ``backward`` goes through the guard, a custom
``Hook``), in every guard mode: parameters, buffers, EMA copies and optimizer state must come out bit for bit equal to
the bare run, with no warning and no error. Then the mistakes users make in mmengine code (in a model's
``forward``, ``train_step`` or ``parse_losses``), each stopped before the update with the tensor named, and the fix
it advises, applied in the mmengine code, quiet and right.
"""
import contextlib
import itertools
import os
import re
import subprocess
import sys
import warnings
from copy import deepcopy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

LIB = pytest.importorskip("mmengine")

from mmengine.evaluator import BaseMetric  # noqa: E402
from mmengine.hooks import Hook  # noqa: E402
from mmengine.model import BaseModel  # noqa: E402
from mmengine.optim import OptimWrapper, OptimWrapperDict  # noqa: E402
from mmengine.registry import HOOKS, METRICS, OPTIM_WRAPPERS, VISUALIZERS  # noqa: E402
from mmengine.runner import Runner  # noqa: E402
from mmengine.visualization import Visualizer  # noqa: E402

from safeloop import GraphGuard  # noqa: E402
from safeloop.errors import (CarriedGraphError, DoubleBackwardError, GraphLeakWarning, GraphReuseError,  # noqa: E402
                             InplaceModificationError, NoGraphError)
from safeloop.watch import Watch  # noqa: E402
from tests.realworld.harness import assert_same, checks, strict  # noqa: E402
from tests.realworld.test_hand_loops_real import three_runs  # noqa: E402

HERE = __file__


@OPTIM_WRAPPERS.register_module(force=True)
class GuardedOptimWrapper(OptimWrapper):
    """An ``OptimWrapper`` whose ``backward`` goes through a ``GraphGuard`` (mmengine's documented way to change
    the backward: override ``backward`` and count ``_inner_count``)."""

    def __init__(self, *args, guard=None, **kwargs):
        super().__init__(*args, **kwargs)
        self.guard = guard

    def backward(self, loss, **kwargs):
        self.guard.backward(loss, **kwargs)
        self._inner_count += 1


def wrap(optimizer, guard, **kwargs):
    """mmengine's ``OptimWrapper``, or the guarded one when a guard is given."""
    return OptimWrapper(optimizer, **kwargs) if guard is None else GuardedOptimWrapper(optimizer, guard=guard,
                                                                                        **kwargs)


def regression(n=5, seed=3):
    gen = torch.Generator().manual_seed(seed)
    return [(torch.randn(6, 4, generator=gen), torch.randn(6, 1, generator=gen)) for _ in range(n)]


def mlp():
    return nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Tanh(), nn.Linear(8, 1))


# -- OptimWrapper: update_params, accumulation, clipping, optim_context ------------------------------------------
def wrapper_build(n=5):
    model = mlp()
    return model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9), regression(n)


def wrapper_train(model, optimizer, loader, epochs=2, guard=None, **kwargs):
    """mmengine's docs (tutorials/optim_wrapper.md): ``optim_wrapper.update_params(loss)`` in a loop of the user's,
    the forward under ``optim_context(model)``; ``initialize_count_status`` so that the last iterations of an epoch
    not filling an accumulation get their loss scaled by what is left."""
    optim_wrapper = wrap(optimizer, guard, **deepcopy(kwargs))  # mmengine pops clip_grad's 'type'
    optim_wrapper.initialize_count_status(model, 0, len(loader) * epochs)
    for epoch in range(epochs):
        for x, y in loader:
            with optim_wrapper.optim_context(model):
                loss = F.mse_loss(model(x), y)
            optim_wrapper.update_params(loss)
    return model, optimizer.state_dict()["state"][0]["momentum_buffer"], optim_wrapper._inner_count


WRAPPER_CASES = {"plain": {},
                 "accumulative_counts=2+clip_grad by value": {"clip_grad": {"type": "value", "clip_value": 0.01},
                                                              "accumulative_counts": 2},
                 "accumulative_counts=3+clip_grad by norm": {"clip_grad": {"max_norm": 0.05},
                                                             "accumulative_counts": 3}}


@pytest.mark.parametrize("case", list(WRAPPER_CASES))
@pytest.mark.parametrize("check", checks())
def test_optim_wrapper_update_params(check, case):
    """``OptimWrapper(optimizer, accumulative_counts=..., clip_grad=...)``, ``optim_context(model)`` and
    ``update_params(loss)``: accumulation over 2 and 3 iterations of a 5-batch loader (the tail of each epoch scaled
    by ``_remainder_counts``), clipping by norm and by value; momentum buffers compared too."""
    kwargs = WRAPPER_CASES[case]
    ref = three_runs(wrapper_build, lambda *a, guard=None: wrapper_train(*a, guard=guard, **kwargs), check)
    assert ref[2] == 10


@pytest.mark.skipif(not torch.cuda.is_available(), reason="mmengine 0.10.7's AmpOptimWrapper asserts a GPU (cuda, "
                    "npu, mlu or musa) in its __init__: it does not run on CPU")
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("check", checks())
def test_amp_optim_wrapper(check, dtype):
    """``AmpOptimWrapper(optimizer=..., dtype=...)``: the forward under its ``optim_context`` (autocast), the loss
    scaled by its ``GradScaler`` before backward, unscaled for ``clip_grad``; bare, watched and guarded runs equal."""
    from mmengine.optim import AmpOptimWrapper

    class GuardedAmpOptimWrapper(AmpOptimWrapper):
        def __init__(self, *args, guard=None, **kwargs):
            super().__init__(*args, **kwargs)
            self.guard = guard

        def backward(self, loss, **kwargs):
            self.guard.backward(self.loss_scaler.scale(loss), **kwargs)
            self._inner_count += 1

    def build():
        model, optimizer, loader = wrapper_build()
        return model.cuda(), optimizer, [(x.cuda(), y.cuda()) for x, y in loader]

    def train(model, optimizer, loader, guard=None):
        kwargs = dict(optimizer=optimizer, dtype=dtype, accumulative_counts=2, clip_grad=dict(max_norm=1.0))
        optim_wrapper = AmpOptimWrapper(**kwargs) if guard is None else GuardedAmpOptimWrapper(guard=guard, **kwargs)
        optim_wrapper.initialize_count_status(model, 0, len(loader) * 2)
        for epoch in range(2):
            for x, y in loader:
                with optim_wrapper.optim_context(model):
                    loss = F.mse_loss(model(x).float(), y)
                optim_wrapper.update_params(loss)
        return model, optim_wrapper.loss_scaler.get_scale()
    three_runs(build, train, check)


# -- mmengine docs, examples/train_a_gan.md: a GAN's own train_step over an OptimWrapperDict ---------------------
class Generator(nn.Module):
    def __init__(self, noise_size, img_shape):
        super().__init__()
        self.img_shape = img_shape
        self.noise_size = noise_size

        def block(in_feat, out_feat, normalize=True):
            layers = [nn.Linear(in_feat, out_feat)]
            if normalize:
                layers.append(nn.BatchNorm1d(out_feat, 0.8))
            layers.append(nn.LeakyReLU(0.2, inplace=True))
            return layers

        self.model = nn.Sequential(*block(noise_size, 16, normalize=False), *block(16, 32),
                                   nn.Linear(32, int(torch.tensor(img_shape).prod())), nn.Tanh())

    def forward(self, z):
        img = self.model(z)
        img = img.view(img.size(0), *self.img_shape)
        return img


class Discriminator(nn.Module):
    def __init__(self, img_shape):
        super().__init__()
        self.model = nn.Sequential(nn.Linear(int(torch.tensor(img_shape).prod()), 16), nn.LeakyReLU(0.2, inplace=True),
                                   nn.Linear(16, 1), nn.Sigmoid())

    def forward(self, img):
        img_flat = img.view(img.size(0), -1)
        validity = self.model(img_flat)
        return validity


def set_requires_grad(nets, requires_grad=False):
    if not isinstance(nets, list):
        nets = [nets]
    for net in nets:
        if net is not None:
            for param in net.parameters():
                param.requires_grad = requires_grad


class GAN(BaseModel):
    """The tutorial's GAN; ``mistake`` makes one of the errors users make in it."""

    def __init__(self, generator, discriminator, noise_size, data_preprocessor, mistake=None):
        super().__init__(data_preprocessor=data_preprocessor)
        assert generator.noise_size == noise_size
        self.generator = generator
        self.discriminator = discriminator
        self.noise_size = noise_size
        self.mistake = mistake

    def train_step(self, data, optim_wrapper):
        # Acquiring and preprocessing data
        inputs_dict = self.data_preprocessor(data, True)
        # Training the discriminator
        disc_optimizer_wrapper = optim_wrapper['discriminator']
        with disc_optimizer_wrapper.optim_context(self.discriminator):
            log_vars = self.train_discriminator(inputs_dict, disc_optimizer_wrapper)

        # Training the generator
        set_requires_grad(self.discriminator, False)
        gen_optimizer_wrapper = optim_wrapper['generator']
        with gen_optimizer_wrapper.optim_context(self.generator):
            log_vars_gen = self.train_generator(inputs_dict, gen_optimizer_wrapper)

        set_requires_grad(self.discriminator, True)
        log_vars.update(log_vars_gen)

        return log_vars

    def forward(self, batch_inputs, data_samples=None, mode=None):
        return self.generator(batch_inputs)

    def disc_loss(self, disc_pred_fake, disc_pred_real):
        losses_dict = dict()
        losses_dict['loss_disc_fake'] = F.binary_cross_entropy(disc_pred_fake, 0. * torch.ones_like(disc_pred_fake))
        losses_dict['loss_disc_real'] = F.binary_cross_entropy(disc_pred_real, 1. * torch.ones_like(disc_pred_real))

        loss, log_var = self.parse_losses(losses_dict)
        return loss, log_var

    def gen_loss(self, disc_pred_fake):
        losses_dict = dict()
        losses_dict['loss_gen'] = F.binary_cross_entropy(disc_pred_fake, 1. * torch.ones_like(disc_pred_fake))
        loss, log_var = self.parse_losses(losses_dict)
        return loss, log_var

    def train_discriminator(self, inputs, optimizer_wrapper):
        real_imgs = inputs['inputs']
        z = torch.randn((real_imgs.shape[0], self.noise_size)).type_as(real_imgs)
        if self.mistake == "fake not detached":
            fake_imgs = self.generator(z)  # no torch.no_grad(): G gets D's gradient, then G's own loss reuses it
            self.fake_imgs = fake_imgs
        else:
            with torch.no_grad():
                fake_imgs = self.generator(z)

        disc_pred_fake = self.discriminator(fake_imgs)
        disc_pred_real = self.discriminator(real_imgs)
        if self.mistake == "stale D(G(z))":  # G's loss taken from D(G(z)) made before D's update
            self.disc_pred_fake = self.discriminator(self.generator(z))

        parsed_losses, log_vars = self.disc_loss(disc_pred_fake, disc_pred_real)
        optimizer_wrapper.update_params(parsed_losses)
        return log_vars

    def train_generator(self, inputs, optimizer_wrapper):
        real_imgs = inputs['inputs']
        z = torch.randn(real_imgs.shape[0], self.noise_size).type_as(real_imgs)

        fake_imgs = self.fake_imgs if self.mistake == "fake not detached" else self.generator(z)

        disc_pred_fake = self.disc_pred_fake if self.mistake == "stale D(G(z))" else self.discriminator(fake_imgs)
        parsed_loss, log_vars = self.gen_loss(disc_pred_fake)

        optimizer_wrapper.update_params(parsed_loss)
        return log_vars


def images(n=4, batch=6, seed=7):
    gen = torch.Generator().manual_seed(seed)
    return [{"inputs": (torch.rand(batch, 1, 4, 4, generator=gen) * 255).round()} for _ in range(n)]


def gan_build(mistake=None):
    from mmengine.model import ImgDataPreprocessor
    generator = Generator(8, (1, 4, 4))
    discriminator = Discriminator((1, 4, 4))
    data_preprocessor = ImgDataPreprocessor(mean=([127.5]), std=([127.5]))
    model = GAN(generator, discriminator, 8, data_preprocessor, mistake=mistake)
    opt_g = torch.optim.Adam(generator.parameters(), lr=0.001, betas=(0.5, 0.999))
    opt_d = torch.optim.Adam(discriminator.parameters(), lr=0.001, betas=(0.5, 0.999))
    return model, opt_g, opt_d, images()


def gan_train(model, opt_g, opt_d, loader, epochs=2, guard=None):
    """The tutorial's ``OptimWrapperDict(generator=..., discriminator=...)`` handed to ``model.train_step`` each
    iteration, as mmengine's ``EpochBasedTrainLoop.run_iter`` does."""
    opt_wrapper_dict = OptimWrapperDict(generator=wrap(opt_g, guard), discriminator=wrap(opt_d, guard))
    logs = []
    for epoch in range(epochs):
        model.train()
        for data in loader:
            with guard.step() if guard is not None else contextlib.nullcontext():
                log_vars = model.train_step(data, opt_wrapper_dict)
            logs.append({k: float(v) for k, v in log_vars.items()})
    return model, opt_g.state_dict()["state"][0]["exp_avg"], opt_d.state_dict()["state"][0]["exp_avg_sq"], logs


@pytest.mark.parametrize("check", checks())
def test_gan_train_step_over_an_optim_wrapper_dict(check):
    """mmengine's GAN tutorial: ``BaseModel.train_step`` overridden, ``OptimWrapperDict`` with two
    ``OptimWrapper``s, ``optim_context`` of each network, ``parse_losses`` and ``update_params`` per network,
    the discriminator frozen through ``requires_grad`` for the generator's update; Adam's state compared too."""
    ref = three_runs(gan_build, gan_train, check)
    assert set(ref[3][0]) == {"loss", "loss_disc_fake", "loss_disc_real", "loss_gen"}


@pytest.mark.parametrize("check", checks())
def test_gan_train_step_with_a_guard_given_both_optimizers(check):
    """As above, the ``GraphGuard`` given both optimizers (``GraphGuard(model, {'opt_g': ..., 'opt_d': ...})``)
    and no ``with guard.step()``: a step ends at each optimizer's step, as the docs say for a loop without one;
    the loop keeps the log variables until the next iteration, as the tutorial's does. Quiet, bit for bit."""
    def run(guarded):
        torch.manual_seed(0)
        model, opt_g, opt_d, loader = gan_build()
        guard = GraphGuard(model, {"opt_g": opt_g, "opt_d": opt_d}, check=check) if guarded else None
        opt_wrapper_dict = OptimWrapperDict(generator=wrap(opt_g, guard), discriminator=wrap(opt_d, guard))
        torch.manual_seed(1)
        for epoch in range(2):
            for data in loader:
                log_vars = model.train_step(data, opt_wrapper_dict)
        return model, log_vars
    (ref, _), own = quietly(lambda: run(False))
    with strict(own):
        model, log_vars = run(True)
    assert_same(model, ref)
    assert set(log_vars) == {"loss", "loss_disc_fake", "loss_disc_real", "loss_gen"}


# -- BaseModel.train_step with parse_losses over several losses ------------------------------------------------
class MultiLoss(BaseModel):
    """A model whose ``forward(mode='loss')`` returns several losses (one a list of tensors, as mmdet's heads do per
    feature level) and an accuracy that ``parse_losses`` logs but does not add (no 'loss' in its key)."""

    def __init__(self, mistake=None):
        super().__init__()
        self.backbone = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU())
        self.cls_head = nn.Linear(8, 3)
        self.reg_head = nn.ModuleList([nn.Linear(8, 1), nn.Linear(8, 1)])
        self.mistake = mistake

    def forward(self, inputs, labels, mode="tensor"):
        feats = self.backbone(inputs)
        logits = self.cls_head(feats)
        if mode == "loss":
            targets = labels.float().unsqueeze(1)
            return {"loss_cls": F.cross_entropy(logits, labels),
                    "loss_reg": [F.smooth_l1_loss(head(feats), targets) for head in self.reg_head],
                    "acc": (logits.argmax(1) == labels).float().mean()}
        if mode == "predict":
            return list(zip(logits.argmax(1), labels))
        return logits


def labelled(n=5, seed=4):
    gen = torch.Generator().manual_seed(seed)
    return [(torch.randn(8, 4, generator=gen), torch.randint(3, (8,), generator=gen)) for _ in range(n)]


def multiloss_build(mistake=None):
    model = MultiLoss(mistake)
    return model, torch.optim.AdamW(model.parameters(), lr=0.01), labelled()


def multiloss_train(model, optimizer, loader, epochs=2, guard=None, accumulative_counts=1):
    """The ``train_step`` mmengine's loops call: data preprocessor, ``_run_forward(data, mode='loss')``,
    ``parse_losses``, ``update_params``; the loop keeps the returned log variables as floats."""
    optim_wrapper = wrap(optimizer, guard, accumulative_counts=accumulative_counts)
    optim_wrapper.initialize_count_status(model, 0, len(loader) * epochs)
    history = []
    for epoch in range(epochs):
        for data in loader:
            with guard.step() if guard is not None else contextlib.nullcontext():
                log_vars = model.train_step(list(data), optim_wrapper)
            history.append({k: v.item() for k, v in log_vars.items()})
    return model, optimizer.state_dict()["state"][1]["exp_avg"], history


@pytest.mark.parametrize("accumulate", [2])
@pytest.mark.parametrize("check", checks())
def test_base_model_train_step_parses_several_losses(check, accumulate):
    """``BaseModel.train_step`` (``data_preprocessor``, ``_run_forward``, ``parse_losses``, ``update_params``)
    over a dict of a loss, a list of losses and a logged accuracy, with accumulation (without: the Runner's tests)."""
    ref = three_runs(multiloss_build, lambda *a, guard=None: multiloss_train(*a, guard=guard,
                                                                           accumulative_counts=accumulate), check)
    first = ref[2][0]
    assert list(first) == ["loss", "loss_cls", "loss_reg", "acc"]
    assert first["loss"] == pytest.approx(first["loss_cls"] + first["loss_reg"])


# -- the full Runner: validation, schedulers, EMAHook, checkpoints, resuming ------------------------------------
@METRICS.register_module(force=True)
class TinyAccuracy(BaseMetric):
    """The smallest ``BaseMetric``: ``process`` keeps one int per sample, ``compute_metrics`` averages them."""

    def process(self, data_batch, data_samples):
        self.results.extend(int(pred == label) for pred, label in data_samples)

    def compute_metrics(self, results):
        return {"accuracy": sum(results) / len(results)}


@HOOKS.register_module(force=True)
class GraphGuardHook(Hook):
    """A ``GraphGuard`` driven by a custom mmengine ``Hook``: made at ``before_train`` with the runner's model and
    optimizer, handed to the ``GuardedOptimWrapper`` whose ``backward`` it runs; each iteration is a step opened
    in ``before_train_iter`` and closed in ``after_train_iter`` (no with-block: a hook has none)."""
    priority = "VERY_HIGH"

    def __init__(self, check="auto"):
        self.check = check

    def before_train(self, runner):
        self.guard = GraphGuard(runner.model, runner.optim_wrapper.optimizer, check=self.check)
        runner.optim_wrapper.guard = self.guard

    def before_train_iter(self, runner, batch_idx, data_batch=None):
        self.guard.step().__enter__()

    def after_train_iter(self, runner, batch_idx, data_batch=None, outputs=None):
        self.guard.__exit__(None, None, None)


@VISUALIZERS.register_module(force=True)
class FigurelessVisualizer(Visualizer):
    """mmengine-lite comes without matplotlib: a ``Visualizer`` drawing no figure (the runs log no images)."""

    def _initialize_fig(self, fig_cfg):
        figure = type("Figure", (), {"get_dpi": lambda self: 100})()
        return None, figure, None


RUNS = itertools.count()  # mmengine keeps a logger, message hub and visualizer per name, for the process


@HOOKS.register_module(force=True)
class LossHistoryHook(Hook):
    """A user's hook keeping each iteration's loss for an epoch average; ``detach``: as ``.item()`` (right), or the
    tensor ``outputs['loss']`` itself, with its graph (the mistake)."""

    def __init__(self, detach=True):
        self.detach = detach
        self.history = []

    def after_train_iter(self, runner, batch_idx, data_batch=None, outputs=None):
        self.history.append(outputs["loss"].item() if self.detach else outputs["loss"])

    def after_train_epoch(self, runner):
        self.mean = sum(self.history) / len(self.history)
        self.history = []


def dataset(n=40, seed=4):
    gen = torch.Generator().manual_seed(seed)
    return torch.utils.data.TensorDataset(torch.randn(n, 4, generator=gen), torch.randint(3, (n,), generator=gen))


def make_runner(work_dir, max_epochs=2, guard_check=None, model=MultiLoss, resume=False, load_from=None,
                accumulate=1, multistep=True, ema=True):
    """A Runner as mmengine's tutorials configure it, everything under ``work_dir``; ``guard_check``: with the
    ``GraphGuardHook`` and the guarded optimizer wrapper. ``multistep``: MultiStepLR after the warm-up (resumed
    at epoch 1, mmengine 0.10.7 leaves its milestone unapplied, bare too: the resumed runs go without it)."""
    torch.manual_seed(0)
    loader = dict(dataset=dataset(), sampler=dict(type="DefaultSampler", shuffle=True), batch_size=8,
                  collate_fn=dict(type="default_collate"))
    hooks = [dict(type="EMAHook", momentum=0.1)][:ema]
    if guard_check is not None:
        hooks.append(dict(type="GraphGuardHook", check=guard_check))
    return Runner(
        model=model(), work_dir=str(work_dir), experiment_name=f"run_{next(RUNS)}",
        train_dataloader=loader,
        val_dataloader=torch.utils.data.DataLoader(dataset(16, seed=5), batch_size=8),
        val_evaluator=dict(type="TinyAccuracy"), val_cfg=dict(),
        optim_wrapper=dict(type="OptimWrapper" if guard_check is None else "GuardedOptimWrapper",
                           optimizer=dict(type="SGD", lr=0.05, momentum=0.9), accumulative_counts=accumulate),
        train_cfg=dict(by_epoch=True, max_epochs=max_epochs, val_interval=1),
        param_scheduler=[dict(type="LinearLR", start_factor=0.1, by_epoch=False, begin=0, end=4),
                         *[dict(type="MultiStepLR", by_epoch=True, milestones=[1], gamma=0.5)][:multistep]],
        custom_hooks=hooks, default_hooks=dict(checkpoint=dict(type="CheckpointHook", interval=1)),
        visualizer=dict(type="FigurelessVisualizer", name=f"vis_{next(RUNS)}"),
        randomness=dict(seed=0), log_level="ERROR", resume=resume, load_from=load_from)


def ema_of(runner):
    return next(hook for hook in runner.hooks if type(hook).__name__ == "EMAHook").ema_model


def same_runs(ours, ref):
    """Model, EMA copy and optimizer state (momentum buffers, learning rates) bit for bit."""
    assert_same(ours.model, ref.model)
    assert_same(ema_of(ours), ema_of(ref))
    a, b = ours.optim_wrapper.optimizer.state_dict(), ref.optim_wrapper.optimizer.state_dict()
    assert a["param_groups"] == b["param_groups"]
    assert a["state"].keys() == b["state"].keys()
    assert all(torch.equal(a["state"][k]["momentum_buffer"], b["state"][k]["momentum_buffer"]) for k in a["state"])


_BARE = {}  # bare runs, trained once for the tests of every guard mode


def bare_run(key, tmp_path_factory, make):
    """``make(work_dir).train()`` once per session: (the runner, the warnings it gave, its work_dir)."""
    if key not in _BARE:
        work_dir = tmp_path_factory.mktemp(key)
        with warnings.catch_warnings(record=True) as own:
            warnings.simplefilter("always")
            runner = make(work_dir)
            runner.train()
        _BARE[key] = runner, own, work_dir
    return _BARE[key]


def quietly(run):
    """``run()`` with every warning recorded (the bare run's: those the others may emit)."""
    with warnings.catch_warnings(record=True) as own:
        warnings.simplefilter("always")
        result = run()
    return result, own


@pytest.mark.parametrize("check", checks())
def test_runner_trains_validates_and_checkpoints(check, tmp_path, tmp_path_factory):
    """``Runner(model=BaseModel subclass, train_dataloader=dict(...DefaultSampler...), val_dataloader=DataLoader,
    val_evaluator=BaseMetric, optim_wrapper=dict(optimizer=dict(type='SGD')), param_scheduler=[LinearLR warm-up by
    iteration, MultiStepLR by epoch], custom_hooks=[EMAHook], default_hooks=CheckpointHook every epoch).train()``:
    bare, under ``Watch``, and with the ``GraphGuardHook``; model, EMA model and optimizer state bit for bit."""
    def train(name, guard_check=None, watch=None):
        runner = make_runner(tmp_path / name, guard_check=guard_check)
        with watch or contextlib.nullcontext():
            runner.train()
        return runner
    ref, own, work_dir = bare_run("runner", tmp_path_factory, make_runner)
    torch.manual_seed(0)
    start = MultiLoss()
    assert any(not torch.equal(p, q) for p, q in zip(ref.model.parameters(), start.parameters())), "nothing trained"
    assert {"epoch_1.pth", "epoch_2.pth"} <= set(os.listdir(work_dir))
    assert ref.message_hub.get_scalar("val/accuracy") is not None
    with strict(own):
        same_runs(train("watched", watch=Watch(GraphGuard(check=check), HERE)), ref)
    with strict(own):
        guarded = train("guarded", guard_check=check)
    same_runs(guarded, ref)
    assert next(h for h in guarded.hooks if type(h).__name__ == "GraphGuardHook").guard.steps == 10


@pytest.mark.parametrize("check", checks())
def test_runner_resumed_equals_an_uninterrupted_run_under_watch(check, tmp_path, tmp_path_factory, monkeypatch):
    """``Runner(resume=True, load_from=epoch_1.pth)`` after a run stopped at epoch 1 (``max_epochs=1``): trained on
    under ``Watch`` to epoch 2, the model, EMA model and optimizer state equal an uninterrupted bare run's."""
    # mmengine 0.10.7 pickles its HistoryBuffer into checkpoints, which torch >= 2.6's torch.load refuses by default
    monkeypatch.setenv("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "1")
    whole, own, _ = bare_run("whole", tmp_path_factory, lambda work_dir: make_runner(work_dir, multistep=False))
    _, _, first = bare_run("first", tmp_path_factory, lambda work_dir: make_runner(work_dir, max_epochs=1,
                                                                                   multistep=False))
    with strict(own):
        warnings.filterwarnings("ignore", message="Environment variable TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD")
        resumed = make_runner(tmp_path / "resumed", resume=True, load_from=str(first / "epoch_1.pth"),
                              multistep=False)
        with Watch(GraphGuard(check=check), HERE):
            resumed.train()
    assert resumed.iter == whole.iter == 10
    same_runs(resumed, whole)


class Faces(torch.utils.data.Dataset):
    """The GAN tutorial's dataset, small: a dict with one 1x4x4 image in 0..255 per sample."""

    def __init__(self, n=18, seed=7):
        self.images = (torch.rand(n, 1, 4, 4, generator=torch.Generator().manual_seed(seed)) * 255).round()

    def __len__(self):
        return len(self.images)

    def __getitem__(self, i):
        return {"inputs": self.images[i]}


def gan_runner(work_dir):
    """The GAN tutorial's ``Runner(model, work_dir, train_dataloader, train_cfg, optim_wrapper=OptimWrapperDict)``."""
    torch.manual_seed(0)
    model, opt_g, opt_d, _ = gan_build()
    return Runner(model, work_dir=str(work_dir), experiment_name=f"run_{next(RUNS)}",
                  train_dataloader=dict(dataset=Faces(), sampler=dict(type="DefaultSampler", shuffle=True),
                                        batch_size=6, collate_fn=dict(type="default_collate")),
                  train_cfg=dict(by_epoch=True, max_epochs=2),
                  optim_wrapper=OptimWrapperDict(generator=OptimWrapper(opt_g), discriminator=OptimWrapper(opt_d)),
                  visualizer=dict(type="FigurelessVisualizer", name=f"vis_{next(RUNS)}"), randomness=dict(seed=0),
                  log_level="ERROR", default_hooks=dict(checkpoint=dict(type="CheckpointHook", interval=1)))


@pytest.mark.parametrize("check", checks())
def test_runner_trains_the_gan_tutorials_model_under_watch(check, tmp_path, tmp_path_factory):
    """The GAN tutorial's model trained by ``Runner`` with an ``OptimWrapperDict`` (two Adams), checkpoints every
    epoch: under ``Watch`` bit for bit the bare run's generator, discriminator and Adam states, quiet (the Runner's
    loop drops the log variables of each iteration, unlike a loop of the user's keeping them: see
    ``test_gan_train_step_over_an_optim_wrapper_dict``)."""
    ref, own, _ = bare_run("gan", tmp_path_factory, gan_runner)
    with strict(own):
        runner = gan_runner(tmp_path / "watched")
        with Watch(GraphGuard(check=check), HERE):
            runner.train()
    assert_same(runner.model, ref.model)
    for name in ("generator", "discriminator"):
        a, b = (r.optim_wrapper[name].optimizer.state_dict()["state"] for r in (runner, ref))
        assert a.keys() == b.keys() and len(a) > 0
        assert all(torch.equal(a[k]["exp_avg_sq"], b[k]["exp_avg_sq"]) for k in a)


def iter_runner(work_dir, guard_check=None):
    """An ``IterBasedTrainLoop`` Runner: ``InfiniteSampler``, validation every 3 iterations (mid-epoch), checkpoints
    every 3 iterations, ``AdamW`` with ``accumulative_counts=3`` and ``clip_grad``, LinearLR then CosineAnnealingLR by
    iteration, ``EMAHook``."""
    torch.manual_seed(0)
    return Runner(
        model=MultiLoss(), work_dir=str(work_dir), experiment_name=f"run_{next(RUNS)}",
        train_dataloader=dict(dataset=dataset(), sampler=dict(type="InfiniteSampler", shuffle=True), batch_size=8,
                              collate_fn=dict(type="default_collate")),
        val_dataloader=torch.utils.data.DataLoader(dataset(16, seed=5), batch_size=8),
        val_evaluator=dict(type="TinyAccuracy"), val_cfg=dict(),
        optim_wrapper=dict(type="OptimWrapper" if guard_check is None else "GuardedOptimWrapper",
                           optimizer=dict(type="AdamW", lr=0.01), accumulative_counts=3, clip_grad=dict(max_norm=0.5)),
        train_cfg=dict(by_epoch=False, max_iters=8, val_interval=3),
        param_scheduler=[dict(type="LinearLR", start_factor=0.1, by_epoch=False, begin=0, end=4),
                         dict(type="CosineAnnealingLR", by_epoch=False, begin=4, T_max=4)],
        custom_hooks=[dict(type="EMAHook", momentum=0.1),
                      *([dict(type="GraphGuardHook", check=guard_check)] if guard_check else [])],
        visualizer=dict(type="FigurelessVisualizer", name=f"vis_{next(RUNS)}"), randomness=dict(seed=0),
        log_level="ERROR", default_hooks=dict(checkpoint=dict(type="CheckpointHook", interval=3, by_epoch=False)))


@pytest.mark.parametrize("check", checks())
def test_iteration_based_runner_validating_and_saving_between_iterations(check, tmp_path, tmp_path_factory):
    """``train_cfg=dict(by_epoch=False, max_iters=8, val_interval=3)``: validation and checkpoints between
    iterations, inside an accumulation window of 3 (the last one cut short at iteration 8), schedulers by iteration,
    EMA; under ``Watch`` and with the ``GraphGuardHook``, the model, EMA model and AdamW state bit for bit."""
    # its warnings: mmengine's own (its schedulers step every iteration, the optimizer every third)
    ref, own, work_dir = bare_run("iter", tmp_path_factory, iter_runner)
    assert {"iter_3.pth", "iter_6.pth", "iter_8.pth"} <= set(os.listdir(work_dir))
    runs = []
    for name, guard_check, watch in (("watched", None, Watch(GraphGuard(check=check), HERE)),
                                     ("guarded", check, contextlib.nullcontext())):
        with strict(own):
            runs.append(iter_runner(tmp_path / name, guard_check))
            with watch:
                runs[-1].train()
    for runner in runs:
        assert_same(runner.model, ref.model)
        assert_same(ema_of(runner), ema_of(ref))
        a, b = (r.optim_wrapper.optimizer.state_dict()["state"] for r in (runner, ref))
        assert all(torch.equal(a[k]["exp_avg"], b[k]["exp_avg"]) for k in b) and len(a) == len(b) > 0


# -- python -m safeloop.watch on an unmodified mmengine script --------------------------------------------------
SCRIPT = '''
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F
from mmengine.model import BaseModel
from mmengine.registry import VISUALIZERS
from mmengine.runner import Runner
from mmengine.visualization import Visualizer


@VISUALIZERS.register_module(force=True)
class FigurelessVisualizer(Visualizer):
    def _initialize_fig(self, fig_cfg):
        return None, type("Figure", (), {"get_dpi": lambda self: 100})(), None


class Net(BaseModel):
    def __init__(self, detach):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 3))
        self.memory = None
        self.detach = detach

    def forward(self, inputs, labels, mode="tensor"):
        logits = self.body(inputs)
        if self.memory is not None:  # the last batch's mean logits mixed into this batch's
            logits = logits + 0.1 * self.memory
        self.memory = logits.mean(0, keepdim=True)
        if self.detach:
            self.memory = self.memory.detach()
        if mode == "loss":
            return {"loss_cls": F.cross_entropy(logits, labels), "loss_l2": 1e-3 * logits.pow(2).mean()}
        return logits


def build(detach, work_dir):
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(4)
    data = torch.utils.data.TensorDataset(torch.randn(24, 4, generator=gen), torch.randint(3, (24,), generator=gen))
    return Runner(model=Net(detach), work_dir=work_dir, train_dataloader=dict(
                      dataset=data, sampler=dict(type="DefaultSampler", shuffle=True), batch_size=8,
                      collate_fn=dict(type="default_collate")),
                  optim_wrapper=dict(optimizer=dict(type="AdamW", lr=0.01), accumulative_counts=2,
                                     clip_grad=dict(max_norm=1.0)),
                  train_cfg=dict(by_epoch=True, max_epochs=2),
                  param_scheduler=[dict(type="LinearLR", start_factor=0.1, by_epoch=False, begin=0, end=3)],
                  visualizer=dict(type="FigurelessVisualizer"), randomness=dict(seed=0), log_level="ERROR",
                  default_hooks=dict(checkpoint=dict(type="CheckpointHook", interval=1)))


runner = build(True, "detached")
runner.train()
print("checksum", repr(sum(float(p.double().sum()) for p in runner.model.state_dict().values())))
if "--then-without-detach" in sys.argv:
    runner = build(False, "kept")
    runner.train()
    print("trained without detach")
'''


_SCRIPT_RUNS = {}  # the two runs of SCRIPT, made once for the tests that read them


def script_runs(tmp_path_factory):
    """SCRIPT run bare, and by ``python -m safeloop.watch --check always train.py --then-without-detach``, each in
    a fresh process, side by side (the bare run in this one would depend on what ran in it before): (the bare run's
    stdout and warnings, the watched run's return code, stdout and stderr)."""
    if not _SCRIPT_RUNS:
        tmp_path = tmp_path_factory.mktemp("script")
        script = tmp_path / "train.py"
        script.write_text(SCRIPT)
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.path.dirname(os.path.dirname(os.path.dirname(HERE))),
                                                            os.environ.get("PYTHONPATH", "")])}
        (tmp_path / "bare").mkdir()
        runs = [subprocess.Popen([sys.executable, *how, str(script), *more], cwd=cwd, env=env, stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, text=True)
                for how, more, cwd in ((["-m", "safeloop.watch", "--check", "always"], ["--then-without-detach"],
                                        tmp_path), ([], [], tmp_path / "bare"))]
        (out, err), (bare, bare_err) = (run.communicate(timeout=180) for run in runs)
        _SCRIPT_RUNS.update(bare=bare, own=set(re.findall(r"\w+Warning: (.*)", bare_err)), code=runs[0].returncode,
                            out=out, err=err, where=str(tmp_path))
    return _SCRIPT_RUNS


def test_python_m_safeloop_watch_runs_an_mmengine_runner_script(tmp_path_factory):
    """``python -m safeloop.watch train.py`` on a script training with mmengine's ``Runner`` (``AdamW`` through
    ``OptimWrapper`` with ``accumulative_counts=2`` and ``clip_grad``, a warm-up scheduler, checkpoints) whose model
    keeps the last batch's mean logits as ``self.memory``: detached, the same checksum of the trained state as the
    script run bare, with no warning but the bare run's (mmengine's own); then trained again without
    ``.detach()``, stopped before that training ends with an error naming ``runner.model.memory``."""
    runs = script_runs(tmp_path_factory)
    checksum = re.search(r"checksum \S+", runs["bare"])
    assert checksum, runs["bare"]
    assert runs["code"] == 1, runs["err"][-3000:]
    assert runs["out"].count(checksum.group(0)) == 1 and "trained without detach" not in runs["out"], runs["out"]
    before = runs["err"].split("Traceback")[0]  # the detached run's stderr
    # (the second training's Runner, made in the first one's second, finds mmengine's instances of that name: its own
    # warning, which the bare run, training once, cannot show)
    shown = {w for w in re.findall(r"\w+Warning: (.*)", before) if "should not accept any other arguments" not in w}
    assert shown <= runs["own"] and "safeloop" not in before.replace(runs["where"], ""), before
    assert re.search(r"safeloop\.errors\.\w+Error: .*held by `(self|runner\.model)\.memory`", runs["err"]), runs["err"]


@pytest.mark.xfail(strict=True, raises=AssertionError, reason="a DoubleBackwardError advising retain_graph=True "
                   "on the first backward: the memory is carried between two micro-batches of one accumulation "
                   "window, which watch takes for one step; from the graph alone it is not told apart from heads "
                   "on one trunk computed after the first head's backward, where retain_graph=True is right and a "
                   "detach would cut the trunk off the later losses")
def test_python_m_safeloop_watch_advises_to_detach_the_memory(tmp_path_factory):
    """As above: the second training (gradient accumulation over 2 iterations, the guard already past optimizer
    steps) is stopped with a ``CarriedGraphError`` advising ``runner.model.memory = runner.model.memory.detach()``
    (a fresh process training only that model says so at step 2)."""
    err = script_runs(tmp_path_factory)["err"]
    assert re.search(r"CarriedGraphError: graph carried over from an earlier step \(step \d+, .*held by "
                     r"`(self|runner\.model)\.memory`.*`(self|runner\.model)\.memory = (self|runner\.model)\.memory"
                     r"\.detach\(\)`",
                     err), err[-3000:]


# -- the mistakes, as mmengine users write them ----------------------------------------------------------------
class Classifier(BaseModel):
    """A classifier over class embeddings (a CLIP-style head), with one of the mistakes users make in a model's
    ``__init__``, ``forward`` or ``train_step``; ``fixed``: with the fix the guard advises."""

    def __init__(self, mistake=None, fixed=False):
        super().__init__()
        self.backbone = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 8))
        self.embed = nn.Embedding(3, 8)
        self.mistake, self.fixed = mistake, fixed
        if mistake == "prior" and not fixed:
            self.class_embeds = self.embed(torch.arange(3))  # computed once, reused by every forward
        self.memory = None
        self.running_loss = 0.0

    def forward(self, inputs, labels, mode="tensor"):
        feats = self.backbone(inputs)
        if self.mistake == "memory":  # the last batch's mean feature mixed into this batch's
            if self.memory is not None:
                feats = feats + 0.1 * self.memory
            self.memory = feats.mean(0, keepdim=True).detach() if self.fixed else feats.mean(0, keepdim=True)
        if self.mistake == "inplace":
            gate = torch.sigmoid(feats)
            if self.fixed:
                gate = gate * 2
            else:
                gate.mul_(2)
            feats = feats * gate
        class_embeds = self.class_embeds if self.mistake == "prior" and not self.fixed else self.embed(
            torch.arange(3))
        logits = feats @ class_embeds.t()
        if mode == "loss":
            losses = {"loss_cls": F.cross_entropy(logits, labels), "loss_l2": 1e-3 * feats.pow(2).mean()}
            if self.mistake == "running":  # a running loss kept on the model for logging
                self.running_loss = self.running_loss + (losses["loss_cls"].item() if self.fixed else
                                                         losses["loss_cls"])
            return losses
        if mode == "predict":
            return list(zip(logits.argmax(1), labels))
        return logits

    def train_step(self, data, optim_wrapper):
        if self.mistake not in ("backward", "no_grad", "two updates"):
            return super().train_step(data, optim_wrapper)
        with optim_wrapper.optim_context(self):
            data = self.data_preprocessor(data, True)
            if self.mistake == "no_grad" and not self.fixed:
                with torch.no_grad():  # as in val_step
                    losses = self._run_forward(data, mode='loss')
            else:
                losses = self._run_forward(data, mode='loss')
        parsed_losses, log_vars = self.parse_losses(losses)
        if self.mistake == "backward" and not self.fixed:
            parsed_losses.backward()
        if self.mistake == "two updates" and not self.fixed:
            optim_wrapper.update_params(losses["loss_cls"])
            optim_wrapper.update_params(losses["loss_l2"])
        else:
            optim_wrapper.update_params(parsed_losses)
        return log_vars


def classifier_build(mistake=None, fixed=False):
    model = Classifier(mistake, fixed)
    return model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), labelled(4)


def classifier_train(model, optimizer, loader, epochs=2, guard=None):
    """mmengine's ``EpochBasedTrainLoop.run_iter`` as a user's loop: ``model.train_step(data, optim_wrapper)``."""
    optim_wrapper = wrap(optimizer, guard)
    for epoch in range(epochs):
        for data in loader:
            with guard.step() if guard is not None else contextlib.nullcontext():
                log_vars = model.train_step(list(data), optim_wrapper)
    return model, float(log_vars["loss"])


class Snapshot:
    """The model's state after its optimizer's last step (or before training): an error raised before an update
    leaves the parameters there, and (``grads``) no gradient written."""

    def __init__(self, model, optimizer):
        self.model, self.state = model, deepcopy(model.state_dict())
        optimizer.register_step_post_hook(lambda *_: setattr(self, "state", deepcopy(model.state_dict())))

    def untouched(self, grads=True):
        now = self.model.state_dict()
        assert all(torch.equal(now[k], self.state[k]) for k in now), "an update ran"
        if grads:
            written = [n for n, p in self.model.named_parameters() if p.grad is not None and p.grad.any()]
            assert not written, f"gradients written before the error: {written}"


def attempt(mistake, how, check="always"):
    """Train the classifier with ``mistake`` in the user's loop, under ``Watch`` (``how='watch'``) or with a
    ``GraphGuard`` in the guarded optimizer wrapper (``how='guard'``); returns the snapshot to look at after."""
    torch.manual_seed(0)
    model, optimizer, loader = classifier_build(mistake)
    snapshot = Snapshot(model, optimizer)
    try:
        if how == "watch":
            with Watch(GraphGuard(check=check), HERE):
                classifier_train(model, optimizer, loader)
        else:
            classifier_train(model, optimizer, loader, guard=GraphGuard(model, check=check))
    finally:
        attempt.snapshot = snapshot


def runner_attempt(mistake, tmp_path, check="always", guard_hook=False, **kwargs):
    """The Runner training the classifier with ``mistake``, under ``Watch`` or with the ``GraphGuardHook``."""
    runner = make_runner(tmp_path / f"run{next(RUNS)}", model=lambda: Classifier(mistake), max_epochs=1,
                         guard_check=check if guard_hook else None, **kwargs)
    if guard_hook:
        runner.train()
    else:
        with Watch(GraphGuard(check=check), HERE):
            runner.train()


def fix_runs_quiet(mistake, check="always"):
    """The fix applied in the model (``fixed=True``): bare, watched and guarded runs agree, quiet."""
    three_runs(lambda: classifier_build(mistake, fixed=True), classifier_train, check)


# seed 001: a tensor computed once (in __init__) and reused by every step
@pytest.mark.parametrize("check", ["auto", "always"])
def test_class_embeddings_computed_in_init_are_stopped_at_the_first_step(check, tmp_path):
    """A ``BaseModel`` whose ``__init__`` computes ``self.class_embeds = self.embed(...)`` and whose ``forward``
    reuses it: with a ``GraphGuard`` in the optimizer wrapper, stopped at step 1 before its backward, naming
    ``model.class_embeds``. The advised fix, computing it in ``forward``, runs quiet."""
    with pytest.raises(GraphReuseError, match=r"step 1, .*held by `model\.class_embeds`.*To fix: recompute "
                                              r"`model\.class_embeds` inside the loop"):
        attempt("prior", "guard", check)
    attempt.snapshot.untouched()
    fix_runs_quiet("prior", check)


def test_class_embeddings_computed_in_init_are_named_under_watch(tmp_path):
    """As above, the user's loop calling ``model.train_step(data, optim_wrapper)`` under ``Watch``: the graph built
    in ``__init__`` is named ``model.class_embeds`` (``self.class_embeds`` in the model's method that runs the step)
    at step 1, with the fix to recompute it; the Runner under
    ``Watch`` (no EMAHook: its deepcopy of the model refuses the non-leaf tensor, bare too) names it too."""
    with pytest.raises(GraphReuseError) as caught:
        attempt("prior", "watch")
    assert re.search(r"step 1, .*held by `(self|model)\.class_embeds`.*recompute `(self|model)\.class_embeds`",
                     str(caught.value)), str(caught.value)
    attempt.snapshot.untouched()
    with pytest.raises(GraphReuseError) as caught:
        runner_attempt("prior", tmp_path, ema=False)
    assert re.search(r"held by `([\w.]*model|self)\.class_embeds`.*recompute `([\w.]*model|self)\.class_embeds`",
                     str(caught.value)), str(caught.value)


# a state carried from the last step with its graph: a memory of the last batch kept on the model
def test_memory_kept_with_its_graph_is_named_under_watch_in_the_runner(tmp_path):
    """A ``forward`` mixing in ``self.memory`` (the last batch's mean feature) and storing this batch's without
    ``.detach()``, trained by mmengine's ``Runner`` under an in-process ``Watch``: a ``CarriedGraphError`` at step 2,
    before its backward, naming ``runner.model.memory`` (or ``self.memory``, in the model's method that runs the
    step) and advising to detach it."""
    with pytest.raises(CarriedGraphError, match=r"step 2, .*held by `(self|runner\.model)\.memory`.*To fix: detach the "
                                                r"carried state at the end of each step"):
        runner_attempt("memory", tmp_path)


def test_memory_detached_as_advised_trains_the_runner_quietly_under_watch(tmp_path):
    """The advised fix, ``self.memory = feats.mean(0, keepdim=True).detach()``: the Runner (EMAHook, schedulers,
    validation) under ``Watch`` trains bit for bit as the bare Runner, quiet."""
    bare, own = quietly(lambda: make_runner(tmp_path / "bare", model=lambda: Classifier("memory", fixed=True)))
    bare.train()
    with strict(own):
        runner = make_runner(tmp_path / "watched", model=lambda: Classifier("memory", fixed=True))
        with Watch(GraphGuard(check="always"), HERE):
            runner.train()
    same_runs(runner, bare)


def test_memory_kept_with_its_graph_is_advised_a_detach_by_graph_guard(tmp_path):
    """As above with a ``GraphGuard``: in the guarded optimizer wrapper of the user's loop, and driven by the
    ``GraphGuardHook`` in the Runner: the advice is to detach the memory, as for an RNN's hidden state."""
    with pytest.raises(CarriedGraphError) as caught:
        attempt("memory", "guard")
    attempt.snapshot.untouched()
    assert "`model.memory = model.memory.detach()`" in str(caught.value), str(caught.value)
    with pytest.raises(CarriedGraphError) as caught:
        runner_attempt("memory", tmp_path, guard_hook=True)
    assert "`model.memory = model.memory.detach()`" in str(caught.value), str(caught.value)


def test_memory_kept_with_its_graph_is_named_under_watch_in_the_users_loop():
    """The user's loop calling ``model.train_step`` under ``Watch``: a ``CarriedGraphError`` naming
    ``model.memory`` (or ``self.memory``, in the model's method that runs the step) with the detach fix, before the
    second step's backward."""
    with pytest.raises(CarriedGraphError, match=r"held by `(self|model)\.memory`.*`(self|model)\.memory = "
                                                r"(self|model)\.memory\.detach"):
        attempt("memory", "watch")
    attempt.snapshot.untouched()


# seed 003/004: an in-place change to a tensor autograd saved
INPLACE = (r"step 1, .*\(\[torch\.FloatTensor \[8, 8\]\], the output of Sigmoid\) was changed in place.*"
           r"To fix: use the out-of-place form")


def test_in_place_gate_on_a_saved_sigmoid_is_explained_under_watch(tmp_path):
    """``gate = torch.sigmoid(feats); gate.mul_(2)`` in a ``forward``: sigmoid saved its output for backward. Under
    ``Watch``, in the user's loop and in the Runner: an ``InplaceModificationError`` naming the sigmoid's output and
    the out-of-place fix, before any update; the fix (``gate = gate * 2``) runs quiet and right."""
    with pytest.raises(InplaceModificationError, match=INPLACE):
        attempt("inplace", "watch")
    attempt.snapshot.untouched(grads=False)
    with pytest.raises(InplaceModificationError, match=INPLACE):
        runner_attempt("inplace", tmp_path)
    fix_runs_quiet("inplace")


def test_in_place_gate_on_a_saved_sigmoid_is_explained_by_graph_guard():
    """As above with a ``GraphGuard`` in the optimizer wrapper, while a caller keeps a deep copy of the model's
    ``state_dict()`` (as loops keeping their best weights do): the error names the sigmoid's output, not the copy."""
    with pytest.raises(InplaceModificationError, match=INPLACE):
        attempt("inplace", "guard")
    attempt.snapshot.untouched(grads=False)


# seed 003/004: a loss without a graph (the forward run under torch.no_grad, as val_step does)
@pytest.mark.parametrize("how", ["watch", "guard"])
def test_loss_computed_under_no_grad_in_train_step(how, tmp_path):
    """A ``train_step`` running ``_run_forward(data, mode='loss')`` under ``torch.no_grad()`` (copied from a
    ``val_step``): ``parse_losses`` sums losses without a graph; a ``NoGraphError`` saying so, at step 1 before
    backward, with a ``GraphGuard`` and under ``Watch`` (the Runner too); the fix (grad enabled) runs quiet."""
    with pytest.raises(NoGraphError, match=r"step 1, .*computed under no_grad.*To fix: make sure the loss is "
                                           r"computed from the model's output inside the loop, with grad enabled"):
        attempt("no_grad", how)
    attempt.snapshot.untouched()
    if how == "watch":
        with pytest.raises(NoGraphError, match=r"no autograd graph"):
            runner_attempt("no_grad", tmp_path)
    else:
        fix_runs_quiet("no_grad")


# seed 001: a running loss kept with its graph
def test_running_loss_kept_on_the_model_is_named(tmp_path):
    """``self.running_loss = self.running_loss + losses['loss_cls']`` in a ``forward``: every step's graph kept
    alive. With a ``GraphGuard`` in the optimizer wrapper and with the ``GraphGuardHook`` in the Runner: a
    ``GraphLeakWarning`` naming ``model.running_loss`` and advising ``.item()``; with ``.item()`` it runs quiet."""
    with pytest.warns(GraphLeakWarning, match=r"held by `model\.running_loss`.*Store loss\.item\(\)"):
        attempt("running", "guard")
    with pytest.warns(GraphLeakWarning, match=r"held by `model\.running_loss`"):
        runner_attempt("running", tmp_path, guard_hook=True)
    fix_runs_quiet("running")


def test_running_loss_kept_on_the_model_is_named_under_watch():
    """As above, the user's loop calling ``model.train_step`` under ``Watch``: the warning names
    ``model.running_loss``."""
    with pytest.warns(GraphLeakWarning) as caught:
        attempt("running", "watch")
    assert any(re.search(r"`(self|model)\.running_loss`", str(w.message)) for w in caught), \
        [str(w.message) for w in caught]


# seed 000/002: backward twice through one graph
def test_backward_in_train_step_before_update_params_is_stopped_by_graph_guard():
    """A ``train_step`` calling ``parsed_losses.backward()`` and then ``optim_wrapper.update_params(parsed_losses)``
    (which runs the backward itself): with a ``GraphGuard`` in the optimizer wrapper, a ``DoubleBackwardError`` at
    step 1 before the second backward, advising to delete it; deleted, it runs quiet and right."""
    with pytest.raises(DoubleBackwardError, match=r"step 1, .*To fix: call backward once on each loss: delete the "
                                                  r"second backward"):
        attempt("backward", "guard")
    attempt.snapshot.untouched(grads=False)  # the user's own backward wrote them
    fix_runs_quiet("backward")


def test_backward_in_train_step_before_update_params_is_advised_away_under_watch():
    """As above under ``Watch``: a ``DoubleBackwardError`` at step 1 whose fix is to delete the second backward (not
    ``retain_graph=True``, which would add the same gradient twice)."""
    with pytest.raises(DoubleBackwardError) as caught:
        attempt("backward", "watch")
    attempt.snapshot.untouched(grads=False)
    assert "retain_graph=True to the backward" not in str(caught.value), str(caught.value)
    assert re.search(r"delete the second backward|back-propagate it once: delete", str(caught.value)), \
        str(caught.value)


def test_one_update_per_loss_over_one_backbone_is_stopped_by_graph_guard():
    """``optim_wrapper.update_params(losses['loss_cls'])`` then ``update_params(losses['loss_l2'])`` over one
    backbone: with a ``GraphGuard`` (a step per iteration) a ``DoubleBackwardError`` before the second backward,
    naming the parameters the first update changed and saying ``retain_graph=True`` cannot help; the fix (one
    ``update_params`` of ``parse_losses``' sum) runs quiet."""
    with pytest.raises(DoubleBackwardError, match=r"`model\.backbone\.\d\.(weight|bias)`.*were changed in place.*"
                                                  r"retain_graph=True cannot help.*To fix: compute the loss again"):
        attempt("two updates", "guard")
    fix_runs_quiet("two updates")


def test_one_update_per_loss_over_one_backbone_is_explained_under_watch():
    """As above under ``Watch``: the error names the update between the two backwards and that ``retain_graph=True``
    cannot help."""
    with pytest.raises(DoubleBackwardError) as caught:
        attempt("two updates", "watch")
    assert "retain_graph=True cannot help" in str(caught.value), str(caught.value)


# GAN mistakes in the tutorial's train_step
def gan_attempt(mistake, how, optimizers=True):
    torch.manual_seed(0)
    model, opt_g, opt_d, loader = gan_build(mistake)
    if how == "watch":
        with Watch(GraphGuard(check="always"), HERE):
            gan_train(model, opt_g, opt_d, loader)
    else:
        gan_train(model, opt_g, opt_d, loader, guard=GraphGuard(
            model, {"opt_g": opt_g, "opt_d": opt_d} if optimizers else None, check="always"))


@pytest.mark.parametrize("how", ["watch", "guard"])
def test_gan_generator_loss_from_a_prediction_made_before_the_discriminators_update(how):
    """The GAN's ``train_discriminator`` also keeps ``self.disc_pred_fake = D(G(z))`` and ``train_generator`` takes
    G's loss from it, after D's ``update_params`` stepped D's Adam: an ``InplaceModificationError`` naming the
    discriminator's optimizer and the fix, a fresh D(fake) after its step (the tutorial's own code, trained quiet
    in ``test_gan_train_step_over_an_optim_wrapper_dict``)."""
    with pytest.raises(InplaceModificationError, match=r"optimizer 'opt_d' stepped after this loss was built and "
                                                       r"before its backward.*generator loss from a fresh D\(fake\)"):
        gan_attempt("stale D(G(z))", how)


def test_gan_stale_prediction_with_a_guard_not_given_the_optimizers():
    """As above with ``GraphGuard(model)`` (no optimizers): the message does not claim there was no optimizer step."""
    with pytest.raises(InplaceModificationError) as caught:
        gan_attempt("stale D(G(z))", "guard", optimizers=False)
    assert "with no optimizer step in between" not in str(caught.value), str(caught.value)


def test_gan_fake_made_with_its_graph_for_the_discriminator_is_advised_a_detach():
    """The tutorial's ``with torch.no_grad():`` around ``self.generator(z)`` for D's loss left out, the fake kept as
    ``self.fake_imgs`` and reused for G's loss: with a ``GraphGuard`` (given both optimizers), a
    ``DoubleBackwardError`` naming ``model.fake_imgs`` whose first fix is to detach it for D (not
    ``retain_graph=True``)."""
    with pytest.raises(DoubleBackwardError, match=r"held by `model\.fake_imgs`") as caught:
        gan_attempt("fake not detached", "guard")
    fixes = str(caught.value).split("To fix:")[1]
    assert "detach" in fixes.split(";")[0], fixes


# seed 001 in a handler: a user's Hook keeping every iteration's loss tensor
def history_runner(work_dir, detach, guard_check=None):
    runner = make_runner(work_dir, max_epochs=1, ema=False, guard_check=guard_check)
    runner.register_hook(LossHistoryHook(detach), priority="LOW")
    return runner


def test_loss_history_hook_keeping_the_loss_tensors_warns(tmp_path):
    """``LossHistoryHook.after_train_iter`` appending ``outputs['loss']`` (the tensor ``parse_losses`` returns, with
    its graph): under ``Watch`` and with the ``GraphGuardHook``, a ``GraphLeakWarning`` advising ``.item()``; with
    ``.item()`` at the append, the Runner under ``Watch`` trains as the bare one, quiet, with the same average."""
    with pytest.warns(GraphLeakWarning, match=r"steps 1 and 2.*Store loss\.item\(\) or loss\.detach\(\)"):
        with Watch(GraphGuard(check="always"), HERE):
            history_runner(tmp_path / "watched", detach=False).train()
    with pytest.warns(GraphLeakWarning, match=r"Store loss\.item\(\)"):
        history_runner(tmp_path / "guarded", detach=False, guard_check="always").train()
    ref, own = quietly(lambda: history_runner(tmp_path / "bare", detach=True))
    ref.train()
    with strict(own):
        runner = history_runner(tmp_path / "fixed", detach=True)
        with Watch(GraphGuard(check="always"), HERE):
            runner.train()
    assert_same(runner.model, ref.model)
    means = [next(h for h in r.hooks if isinstance(h, LossHistoryHook)).mean for r in (runner, ref)]
    assert means[0] == means[1] and means[0] > 0


def test_loss_history_hook_keeping_the_loss_tensors_is_named(tmp_path):
    """As above: the warning names the hook's list (``history``), where the fix goes."""
    with pytest.warns(GraphLeakWarning) as caught:
        with Watch(GraphGuard(check="always"), HERE):
            history_runner(tmp_path / "watched", detach=False).train()
    assert any("history" in str(w.message) for w in caught), [str(w.message) for w in caught]
