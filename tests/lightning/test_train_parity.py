"""safeloop's Trainer against pytorch-lightning's on the training side, for Lightning code kept as public modules write
it: values passed to ``self.log`` (a learnable parameter, ``lr``), Lightning's hook signatures, attributes, Trainer
arguments, ``automatic_optimization`` and dataloader hooks kept on a port, several loaders in a list, a curriculum
reloading its data each epoch, manual mode's ``zero_grad`` before an update made on some batches only, a stop asked at
an epoch's edge, and public modules ported whole (lightning-bolts' SwAV, the UvA deep energy model tutorial).

As in ``test_parity.py``: each test trains the same tiny seeded model with ``pytorch_lightning.Trainer`` and with
its port to ``safeloop.Trainer``; ``..._matches`` tests compare what a user relies on. A difference the docs do not
state is a test asserting Lightning's behaviour (or the error a port should get), marked ``xfail(strict=True)`` with
the reason, until it is fixed or documented.
"""
import math
import random
import warnings

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

pl = pytest.importorskip("pytorch_lightning")

import safeloop  # noqa: E402

from .common import Lit, Port, adam, assert_same, lightning, loader, net, settings, sgd  # noqa: E402
from .test_parity2 import PlainRecorder, Recorder  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::Warning:pytorch_lightning", "ignore::Warning:lightning_fabric")


# -- a learnable scalar logged from training_step: CLIP's ``logit_scale`` (openai/CLIP, clip/model.py:
# ``self.logit_scale = nn.Parameter(torch.ones([]) * np.log(1 / 0.07))``), which Lightning ports of contrastive models
# log as ``self.log("logit_scale", self.logit_scale)``. Lightning's ``LightningModule.log`` keeps
# ``value.clone().detach()`` (Lightning-AI/pytorch-lightning, src/lightning/pytorch/core/module.py, ``__to_tensor``).


class Scaled(nn.Module):
    """``net()`` with CLIP's learnable logit scale on its output."""

    def __init__(self):
        super().__init__()
        self.net = net()
        self.logit_scale = nn.Parameter(torch.tensor(0.5))

    def forward(self, x):
        return self.net(x) * self.logit_scale.exp()


class LitLogsParameter(Lit):
    def training_step(self, batch, batch_idx):
        self.log("logit_scale", self.model.logit_scale)
        return super().training_step(batch, batch_idx)


class PortLogsParameter(Port):
    def training_step(self, batch):
        self.log("logit_scale", self.model.logit_scale)
        return super().training_step(batch)


def logged_parameter_runs(steps=4):
    """Each step logged (``log_every_n_steps=1`` / ``log_every=1``): each side's logged ``logit_scale`` values, and
    both modules."""
    recorder, plain = Recorder(), PlainRecorder()
    lit = LitLogsParameter(model=Scaled())
    lightning(max_steps=steps, logger=recorder, log_every_n_steps=1).fit(lit, train_dataloaders=loader())
    port = PortLogsParameter(model=Scaled(), train_data=loader(), optimizer=adam,
                             **settings(max_steps=steps, log_every=1, loggers=[plain]))
    port.fit()
    values = [[metrics["logit_scale"] for _, metrics in rows.rows if "logit_scale" in metrics]
              for rows in (recorder, plain)]
    return values, lit, port


def test_a_logged_parameter_trains_the_same():
    """Logging the parameter changes nothing in training: the parameters, bit for bit."""
    _, lit, port = logged_parameter_runs()
    assert_same(lit.model, port.model)


def test_a_parameter_logged_in_training_step_is_the_value_the_step_saw():
    """``self.log("logit_scale", self.model.logit_scale)`` in ``training_step``: Lightning logs 0.5 (the initial
    value) at the first step, then each step's value before its update. safeloop's loggers (and the progress line)
    get each value one update late: the first is already 0.51."""
    (theirs, ours), _, _ = logged_parameter_runs()
    assert theirs[0] == 0.5
    assert ours == theirs


# -- Lightning's hook signatures kept on a port. docs/trainer.md's map: "on_before_backward, on_after_backward | the
# same names"; safeloop's take the loss's name first (``on_before_backward(name, loss)``, ``on_after_backward(name)``),
# and ``on_before_optimizer_step(name, optimizer)``, ``on_validation_end(metrics)``. Lightning's own signatures, as
# Lightning-AI/pytorch-lightning's docs/source-pytorch/common/lightning_module.rst lists them (``on_after_backward``:
# the gradient-norm logging of its debugging docs; ``on_before_optimizer_step(self, optimizer)``: its
# ``grad_norm`` example), are refused only when step 1 calls them: a TypeError ("takes 1 positional argument but 2
# were given") inside a StepError, or bare from the validation before training.

LIGHTNING_SIGNATURES = {
    "on_before_backward": lambda self, loss: None,
    "on_after_backward": lambda self: None,
    "on_before_optimizer_step": lambda self, optimizer: None,
    "on_validation_end": lambda self: None,
}


@pytest.mark.parametrize("hook", sorted(LIGHTNING_SIGNATURES))
def test_a_hook_kept_with_lightnings_signature_is_refused_at_start_up(hook):
    """A port that keeps ``def on_after_backward(self):`` (and the like) gets a ConfigError naming the hook and its
    safeloop signature before anything runs, as a ``training_step(self, batch, batch_idx)`` does."""
    port = type("PortHook", (Port,), {hook: LIGHTNING_SIGNATURES[hook]})(
        model=net(), train_data=loader(), val_data=loader(n=4, seed=2), optimizer=adam, **settings(max_steps=2))
    with pytest.raises(safeloop.ConfigError, match=hook):
        port.fit()
    assert port.state.step == 0


# -- several loaders in a list: Lightning's ``trainer.fit(model, train_dataloaders=[a, b])`` (a CombinedLoader: each
# batch is ``[batch_a, batch_b]``) and ``val_dataloaders=[a, b]`` with ``validation_step(batch, batch_idx,
# dataloader_idx=0)`` (Lightning-AI/pytorch-lightning, docs/source-pytorch/data/iterables.rst, "Multiple
# Iterables"). A dict of loaders is refused at construction ("is a dict; give an Iterable"); a list is taken as a
# list of batches, each batch a DataLoader, and the first step or validation dies inside the user's unpacking.


@pytest.mark.parametrize("where", ["train_data", "val_data"])
def test_a_list_of_loaders_is_refused_at_construction(where):
    """``train_data=[loader_a, loader_b]`` or ``val_data=[...]``: a ConfigError naming the setting and saying it
    holds DataLoaders (one iterable of batches is taken), as for a dict of them."""
    data = {"train_data": loader(), "val_data": loader(n=4, seed=2), where: [loader(seed=2), loader(n=4, seed=3)]}
    with pytest.raises(safeloop.ConfigError, match=where):
        Port(model=net(), optimizer=adam, **data, **settings(max_steps=2, val_every=1)).fit()


# -- Lightning-Universe/lightning-bolts, src/pl_bolts/models/self_supervised/swav/swav_module.py (commit
# e5e12667f25be6c1d638c2f679f3086d5aa32e1f), its training side kept as written at tiny sizes: the prototypes
# normalized in place under no_grad at the start of each step (``shared_step``), their gradient dropped in
# ``on_after_backward`` while ``current_epoch < freeze_prototypes_epochs``, ``exclude_from_wt_decay``'s two groups, and
# ``linear_warmup_decay`` (pl_bolts/optimizers/lr_scheduler.py, cosine) as a LambdaLR with ``"interval": "step"``,
# returned as ``[optimizer], [scheduler]``. The loss is SwaV's swapped prediction with ``distributed_sinkhorn``'s
# iterations (swav/loss.py) on one process; two noisy views stand in for the crops.


def linear_warmup_decay(warmup_steps, total_steps):
    def fn(step):
        if step < warmup_steps:
            return float(step) / float(max(1, warmup_steps))
        progress = float(step - warmup_steps) / float(max(1, total_steps - warmup_steps))
        return 0.5 * (1.0 + math.cos(math.pi * progress))
    return fn


class SwavNet(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.backbone = nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 4))
        self.prototypes = nn.Linear(4, 5, bias=False)

    def forward(self, views):
        return [self.prototypes(F.normalize(self.backbone(v), dim=1)) for v in views]


@torch.no_grad()
def sinkhorn(out, epsilon=0.05, iterations=3):
    q = torch.exp(out / epsilon).t()
    q /= q.sum()
    k, b = q.shape
    for _ in range(iterations):
        q /= q.sum(dim=1, keepdim=True)
        q /= k
        q /= q.sum(dim=0, keepdim=True)
        q /= b
    return (q * b).t()


def swav_step(model, batch):
    x, _ = batch
    with torch.no_grad():  # 1. normalize the prototypes, as shared_step does
        w = model.prototypes.weight.data.clone()
        w = F.normalize(w, dim=1, p=2)
        model.prototypes.weight.copy_(w)
    out = model([x + 0.1 * torch.randn_like(x), x + 0.1 * torch.randn_like(x)])
    loss = 0
    for i in range(2):
        q = sinkhorn(out[i].detach())
        loss = loss - (q * F.log_softmax(out[1 - i] / 0.1, dim=1)).sum(1).mean()
    return loss / 2


def exclude_from_wt_decay(named_params, weight_decay, skip_list=("bias", "backbone.1.")):
    params, excluded_params = [], []
    for name, param in named_params:
        (excluded_params if any(layer_name in name for layer_name in skip_list) else params).append(param)
    return [{"params": params, "weight_decay": weight_decay}, {"params": excluded_params, "weight_decay": 0.0}]


def swav_optimizer(model, iters_per_epoch, epochs):
    optimizer = torch.optim.Adam(exclude_from_wt_decay(model.named_parameters(), 1e-3), lr=1e-2, weight_decay=1e-3)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, linear_warmup_decay(iters_per_epoch,
                                                                                 iters_per_epoch * epochs))
    return optimizer, scheduler


FREEZE_PROTOTYPES_EPOCHS, SWAV_EPOCHS = 1, 3


class LitSwav(pl.LightningModule):
    def __init__(self, iters_per_epoch):
        super().__init__()
        self.model, self.iters_per_epoch = SwavNet(), iters_per_epoch

    def on_after_backward(self):
        if self.current_epoch < FREEZE_PROTOTYPES_EPOCHS:
            for name, p in self.model.named_parameters():
                if "prototypes" in name:
                    p.grad = None

    def training_step(self, batch, batch_idx):
        return swav_step(self.model, batch)

    def configure_optimizers(self):
        optimizer, scheduler = swav_optimizer(self.model, self.iters_per_epoch, SWAV_EPOCHS)
        return [optimizer], [{"scheduler": scheduler, "interval": "step", "frequency": 1}]


class PortSwav(safeloop.Trainer):
    """``LitSwav`` ported: ``on_after_backward(name)``, ``self.state.epoch``, the scheduler dict without
    ``frequency`` (refused, docs/trainer.md)."""

    iters_per_epoch = None

    def on_after_backward(self, name):
        if self.state.epoch < FREEZE_PROTOTYPES_EPOCHS:
            for n, p in self.model.named_parameters():
                if "prototypes" in n:
                    p.grad = None

    def training_step(self, batch):
        return swav_step(self.model, batch)

    def configure_optimizers(self):
        optimizer, scheduler = swav_optimizer(self.model, self.iters_per_epoch, SWAV_EPOCHS)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


@pytest.mark.parametrize("accum", [1, 2])
def test_lightning_bolts_swav_training_side_matches(accum):
    """Three epochs (the prototypes frozen in the first), under accumulation ``accum`` (the step schedule over
    updates): every parameter and BatchNorm's running statistics, bit for bit."""
    iters = math.ceil(7 / accum)
    lit = LitSwav(iters)
    torch.manual_seed(5)
    lightning(max_epochs=SWAV_EPOCHS, accumulate_grad_batches=accum).fit(lit, train_dataloaders=loader())
    port = type("Port", (PortSwav,), {"iters_per_epoch": iters})(
        model=SwavNet(), train_data=loader(), **settings(max_epochs=SWAV_EPOCHS, grad_accum=accum))
    torch.manual_seed(5)
    port.fit()
    assert_same(lit.model, port.model)


# -- Lightning's attributes read from a step, kept on a port. docs/trainer.md's map gives safeloop's name for each
# (``self.global_step`` / ``self.current_epoch``: ``self.state.step`` / ``.epoch``; ``self.optimizers()``,
# ``self.lr_schedulers()``: ``self.optimizers``, ``self.schedulers``); ``self.trainer.*`` (lightning-bolts' SwAV:
# ``self.trainer.current_epoch``) and ``self.toggle_optimizer`` (Lightning-AI/tutorials, lightning_examples/basic-gan)
# have none. The StepError of step 1 names safeloop's way, as a Lightning hook name kept on a port is refused at
# start-up naming it.

LIGHTNING_READS = {
    "current_epoch": (lambda self: self.current_epoch, "state.epoch"),
    "global_step": (lambda self: self.global_step, "state.step"),
    "trainer": (lambda self: self.trainer.current_epoch, "state.epoch"),
    "optimizers()": (lambda self: self.optimizers(), r"self\.optimizers\b"),
    "lr_schedulers()": (lambda self: self.lr_schedulers(), r"self\.schedulers"),
    "toggle_optimizer": (lambda self: self.toggle_optimizer(None), r"self\.backward"),
}


@pytest.mark.parametrize("read", sorted(LIGHTNING_READS))
def test_a_lightning_attribute_read_by_a_step_names_safeloops_way(read):
    """The error says which safeloop name the port wants (the map's right column)."""
    reads, instead = LIGHTNING_READS[read]

    class PortReads(Port):
        def training_step(self, batch):
            reads(self)
            return super().training_step(batch)

    port = PortReads(model=net(), train_data=loader(), optimizer=adam, **settings(max_steps=1))
    with pytest.raises(safeloop.SafeloopError, match=instead):
        port.fit()


# -- a curriculum: Lightning's ``train_dataloader()`` reading ``self.current_epoch``, called again at each epoch's
# start under ``Trainer(reload_dataloaders_every_n_epochs=1)`` (Lightning-AI/pytorch-lightning,
# docs/source-pytorch/common/trainer.rst, ``reload_dataloaders_every_n_epochs``), each pass one batch longer, a
# StepLR given alone (each epoch), validation at each epoch's end. Ported (docs/trainer.md: ``train_data`` "may be
# replaced between fits or in on_epoch_start"): ``self.train_data = ...`` in ``on_epoch_start``; passes of changing
# length have no ``val_every``, so the port validates in ``on_epoch_end``.


def curriculum(epoch):
    return loader(n=6 + 2 * epoch)


def step_lr(model):
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    return {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)}


class LitCurriculum(Lit):
    def train_dataloader(self):
        return curriculum(self.current_epoch)

    def on_validation_end(self):
        self.validated.append(self.trainer.global_step)


class PortCurriculum(Port):
    configure = staticmethod(step_lr)

    def on_epoch_start(self):
        self.train_data = curriculum(self.state.epoch)

    def on_epoch_end(self):
        self.validate()

    def on_validation_end(self, metrics):
        self.validated.append(self.state.step)


def lightning_curriculum():
    lit = LitCurriculum(configure=step_lr)
    lit.validated = []
    lightning(max_epochs=3, reload_dataloaders_every_n_epochs=1).fit(lit, val_dataloaders=loader(n=4, seed=2))
    return lit


def test_reload_dataloaders_every_epoch_ported_to_on_epoch_start_matches():
    """Passes of 3, 4 and 5 batches: the steps validated after (safeloop's own before training aside), the
    parameters bit for bit."""
    lit = lightning_curriculum()
    port = PortCurriculum(model=net(), train_data=curriculum(0), val_data=loader(n=4, seed=2), **settings(max_epochs=3))
    port.validated = []
    port.fit()
    assert lit.validated == port.validated[1:] == [3, 7, 12]
    assert_same(lit.model, port.model)


@pytest.mark.parametrize("name", ["train_dataloader", "test_dataloader", "predict_dataloader"])
def test_a_dataloader_hook_kept_on_a_port_is_refused(name):
    """``LitCurriculum.train_dataloader`` kept on the port, ``train_data=`` its first pass: the port trains 9 steps on
    the first pass's 3 batches where Lightning trains 12 on growing passes, without a word. A ConfigError naming the
    hook, as for ``val_dataloader`` ("is Lightning's name, which safeloop never calls: pass val_data=...")."""
    port = type("PortKept", (Port,), {"configure": staticmethod(step_lr),
                                      name: lambda self: curriculum(self.state.epoch)})(
        model=net(), train_data=curriculum(0), **settings(max_epochs=3))
    with pytest.raises(safeloop.ConfigError, match=name):
        port.fit()


# -- Lightning's ``self.automatic_optimization = False`` kept on a manual-mode port (set in ``__init__`` as
# Lightning-AI/pytorch-lightning's examples/pytorch/domain_templates/generative_adversarial_net.py does, or as a class
# attribute), in place of safeloop's ``automatic = False``: refused at start-up naming ``automatic``, as Lightning's
# hook names kept on a port are (run in automatic mode, the port would fail at step 1 on a returned None or a
# consumed graph).


class PortKeepsLightningsFlag(safeloop.Trainer):
    returns = False

    def training_step(self, batch):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.model(x), y)
        self.backward(loss)
        self.step()
        return loss if self.returns else None


class PortFlagInInit(PortKeepsLightningsFlag):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.automatic_optimization = False


@pytest.mark.parametrize("where", ["class", "__init__"])
@pytest.mark.parametrize("returns", [False, True], ids=["returns None", "returns the loss"])
def test_lightnings_automatic_optimization_flag_kept_on_a_port_names_automatic(where, returns):
    """The error names ``automatic = False``; nothing is trained."""
    cls = PortFlagInInit if where == "__init__" else type("PortFlag", (PortKeepsLightningsFlag,),
                                                          {"automatic_optimization": False})
    port = type("Port", (cls,), {"returns": returns})(
        model=net(), train_data=loader(), optimizer=adam, **settings(max_steps=2))
    before = {k: v.clone() for k, v in port.model.state_dict().items()}
    with pytest.raises(safeloop.SafeloopError, match="automatic = False"):
        port.fit()
    assert all(torch.equal(before[k], v) for k, v in port.model.state_dict().items())


# -- ``self.log("lr", optimizer.param_groups[0]["lr"])`` in ``training_step``, common in public LightningModules
# (``self.log("lr", self.trainer.optimizers[0].param_groups[0]["lr"])``), under a warm-up stepped each update: the
# rate the step trained with, as Lightning's ``LearningRateMonitor`` logs it (Lightning-AI/pytorch-lightning,
# src/lightning/pytorch/callbacks/lr_monitor.py, ``on_train_batch_start``). safeloop logs each optimizer's rate as
# ``lr`` itself (docs/trainer.md, Learning-rate schedules), after the update and its scheduler step, and writes it
# over the user's value of the same name.


def warm_up(model):
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    schedule = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: (step + 1) / 4)
    return {"optimizer": opt, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}


class LitLogsLr(Lit):
    def training_step(self, batch, batch_idx):
        self.log("lr", self.optimizers().param_groups[0]["lr"])
        return super().training_step(batch, batch_idx)


class PortLogsLr(Port):
    configure = staticmethod(warm_up)

    def training_step(self, batch):
        (optimizer,) = self.optimizers.values()
        self.log("lr", optimizer.param_groups[0]["lr"])
        return super().training_step(batch)


def test_a_learning_rate_logged_as_lr_is_the_value_logged():
    """``log_every_n_steps=1`` / ``log_every=1``, 4 steps of a warm-up 0.0125, 0.025, 0.0375, 0.05: Lightning's logger
    gets those; safeloop's gets 0.025, 0.0375, 0.05, 0.0625 under the user's name. The training is the same."""
    recorder, plain = Recorder(), PlainRecorder()
    lit = LitLogsLr(configure=warm_up)
    lightning(max_steps=4, logger=recorder, log_every_n_steps=1).fit(lit, train_dataloaders=loader())
    port = PortLogsLr(model=net(), train_data=loader(), **settings(max_steps=4, log_every=1, loggers=[plain]))
    port.fit()
    assert_same(lit.model, port.model)
    theirs, ours = ([metrics["lr"] for _, metrics in rows.rows if "lr" in metrics] for rows in (recorder, plain))
    assert theirs == pytest.approx([0.0125, 0.025, 0.0375, 0.05])
    assert ours == pytest.approx(theirs)


# -- manual mode, an update made on some batches only: Lightning's manual step as its docs write it
# (Lightning-AI/pytorch-lightning, docs/source-pytorch/model/manual_optimization.rst: ``opt.zero_grad()``,
# ``self.manual_backward(loss)``, ``opt.step()``; "It is good practice to call optimizer.zero_grad() before
# self.manual_backward(loss)"), with the step taken only on hard batches (GAN code that trains D only while it is not
# too strong does the same). docs/trainer.md's map: "optimizer.step() and zero_grad() in manual mode | self.step(name)
# (the gradients it applied are cleared at the next self.backward or step ...)", and a zero_grad() that drops what no
# update applied stays.


class LitSometimes(Lit):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        opt = self.optimizers()
        loss = self.model_loss(batch)
        opt.zero_grad()
        self.manual_backward(loss)
        if loss.item() > 0.5:
            opt.step()

    def model_loss(self, batch):
        x, y = batch
        return F.mse_loss(self.model(x), y)


class PortSometimes(safeloop.Trainer):
    automatic = False
    keeps_zero_grad = False

    def training_step(self, batch):
        x, y = batch
        loss = F.mse_loss(self.model(x), y)
        if self.keeps_zero_grad:
            self.optimizers["optimizer"].zero_grad()
        self.backward(loss)
        if loss.item() > 0.5:
            self.step()
        return loss


def sometimes_runs(keeps_zero_grad):
    sgd = lambda params: torch.optim.SGD(params, lr=0.05, momentum=0.9)  # noqa: E731
    lit = LitSometimes(configure=lambda model: sgd(model.parameters()))
    lightning(max_epochs=2).fit(lit, train_dataloaders=loader())
    port = type("Port", (PortSometimes,), {"keeps_zero_grad": keeps_zero_grad})(
        model=net(), train_data=loader(), optimizer=sgd, **settings(max_epochs=2))
    port.fit()
    return lit, port


def test_manual_zero_grad_kept_before_a_backward_no_step_may_apply_matches():
    """The port keeping ``zero_grad()`` (the optimizer's own) before ``self.backward``, as docs/trainer.md's map says
    for a step that updates on some batches only: bit for bit. (Without it, the gradients no update applied are
    kept for the next one: manual accumulation.)"""
    lit, port = sometimes_runs(keeps_zero_grad=True)
    assert_same(lit.model, port.model)


# -- Lightning's Trainer arguments given to safeloop's Trainer, as a port of ``pl.Trainer(...)`` writes them (the
# lightning-hydra-template's configs/trainer/default.yaml holds ``check_val_every_n_epoch``, ``accelerator``,
# ``devices``, ``min_epochs``; its callbacks, ``gradient_clip_val`` and ``accumulate_grad_batches``). Each is a
# ConfigError listing every safeloop setting, with a "did you mean" only where the names are alike
# (``log_every_n_steps``: log_every), where docs/trainer.md's map gives the translation of each.

LIGHTNING_ARGUMENTS = {
    "accumulate_grad_batches": (2, "grad_accum"),
    "gradient_clip_val": (1.0, "grad_clip"),
    "gradient_clip_algorithm": ("value", "clip_grad_value_"),
    "check_val_every_n_epoch": (1, "val_every"),
    "val_check_interval": (3, "val_every"),
    "limit_train_batches": (3, "islice"),
    "detect_anomaly": (True, "trace"),
    "enable_progress_bar": (False, "progress"),
    "default_root_dir": ("runs", "run_dir"),
    "min_epochs": (1, "no minimum"),
    "min_steps": (10, "no minimum"),
    "num_sanity_val_steps": (0, "a whole validation runs before the first step"),
    "limit_test_batches": (2, "islice"),
    "fast_dev_run": (True, "max_steps=N"),
    "profiler": ("simple", "profile=N"),
}


@pytest.mark.parametrize("name", sorted(LIGHTNING_ARGUMENTS))
def test_a_lightning_trainer_argument_is_refused_naming_safeloops_way(name):
    """The error says the name is Lightning's and gives safeloop's way (as for a Lightning hook kept on a port)."""
    value, instead = LIGHTNING_ARGUMENTS[name]
    with pytest.raises(safeloop.ConfigError) as refused:
        Port(model=net(), train_data=loader(), optimizer=adam, **settings(max_steps=1), **{name: value})
    assert "Lightning" in str(refused.value) and instead in str(refused.value)


@pytest.mark.parametrize("every, lightnings", [({}, (14, 14)), ({"val_check_interval": 3}, (6, 7))],
                         ids=["each epoch", "every 3 batches"])
def test_min_epochs_one_is_refused_naming_no_maximum_and_changes_nothing_with_validation_each_epoch(every, lightnings):
    """The lightning-hydra-template's ``min_epochs=1`` with ``EarlyStopping("val_loss", patience=1)``, SGD at 0.3:
    Lightning stops after step 14 with it as without it where validation runs at each epoch's end; every 3 batches,
    it puts off the stop asked after step 6 to the first epoch's end. safeloop refuses it naming no maximum (the
    closest name, ``max_epochs``, would train one epoch), and without it stops where Lightning does without it."""
    def lit_run(**kwargs):
        validation = {"check_val_every_n_epoch": None, **every} if every else {}
        trainer = lightning(max_epochs=10, callbacks=[pl.callbacks.EarlyStopping("val_loss", patience=1)],
                            **validation, **kwargs)
        trainer.fit(Lit(configure=lambda m: sgd(m.parameters(), 0.3)), train_dataloaders=loader(),
                    val_dataloaders=loader(n=6, seed=2))
        return trainer.global_step

    def port(**kwargs):
        return Port(model=net(), train_data=loader(), val_data=loader(n=6, seed=2), optimizer=lambda p: sgd(p, 0.3),
                    callbacks=[safeloop.EarlyStopping("val_loss", patience=1)],
                    **settings(max_epochs=10, val_every=every.get("val_check_interval", 7), **kwargs))

    assert (lit_run(), lit_run(min_epochs=1)) == lightnings
    with pytest.raises(safeloop.ConfigError, match="min_epochs': that is Lightning's; here: no minimum") as refused:
        port(min_epochs=1)
    assert "did you mean" not in str(refused.value)
    assert port().fit().step == lightnings[0]


# -- Lightning-AI/tutorials, course_UvA-DL/07-deep-energy-based-generative-models/Deep_Energy_Models.py (commit
# 753defcec34a8e9fe7f9e34f37cce47fef468ff7): ``CNNModel``, ``Sampler`` and ``DeepEnergyModel``'s training side as
# written (``hidden_features=4``, 5 MCMC steps for 60, ``.to(device)`` dropped on the CPU), trained with the tutorial's
# ``gradient_clip_val=0.1``. Each step runs Langevin dynamics inside ``training_step``: the parameters'
# ``requires_grad`` turned off, ``backward()`` of the model's output into the input images, the parameters turned on
# again; the sampled images kept in a buffer (``Sampler.examples``) drawn from with ``random`` and NumPy. The
# validation (``torch.rand_like`` in ``validation_step``) is left out: validation leaves training's random streams
# here, not in Lightning (docs/trainer.md, Validation).


class CNNModel(nn.Module):
    def __init__(self, hidden_features=32, out_dim=1, **kwargs):
        super().__init__()
        c_hid1 = hidden_features // 2
        c_hid2 = hidden_features
        c_hid3 = hidden_features * 2
        self.cnn_layers = nn.Sequential(
            nn.Conv2d(1, c_hid1, kernel_size=5, stride=2, padding=4), nn.SiLU(),
            nn.Conv2d(c_hid1, c_hid2, kernel_size=3, stride=2, padding=1), nn.SiLU(),
            nn.Conv2d(c_hid2, c_hid3, kernel_size=3, stride=2, padding=1), nn.SiLU(),
            nn.Conv2d(c_hid3, c_hid3, kernel_size=3, stride=2, padding=1), nn.SiLU(),
            nn.Flatten(), nn.Linear(c_hid3 * 4, c_hid3), nn.SiLU(), nn.Linear(c_hid3, out_dim))

    def forward(self, x):
        return self.cnn_layers(x).squeeze(dim=-1)


class Sampler:
    def __init__(self, model, img_shape, sample_size, max_len=8192):
        super().__init__()
        self.model = model
        self.img_shape = img_shape
        self.sample_size = sample_size
        self.max_len = max_len
        self.examples = [(torch.rand((1,) + img_shape) * 2 - 1) for _ in range(self.sample_size)]

    def sample_new_exmps(self, steps=60, step_size=10):
        n_new = np.random.binomial(self.sample_size, 0.05)
        rand_imgs = torch.rand((n_new,) + self.img_shape) * 2 - 1
        old_imgs = torch.cat(random.choices(self.examples, k=self.sample_size - n_new), dim=0)
        inp_imgs = torch.cat([rand_imgs, old_imgs], dim=0).detach()
        inp_imgs = Sampler.generate_samples(self.model, inp_imgs, steps=steps, step_size=step_size)
        self.examples = list(inp_imgs.to(torch.device("cpu")).chunk(self.sample_size, dim=0)) + self.examples
        self.examples = self.examples[: self.max_len]
        return inp_imgs

    @staticmethod
    def generate_samples(model, inp_imgs, steps=60, step_size=10):
        is_training = model.training
        model.eval()
        for p in model.parameters():
            p.requires_grad = False
        inp_imgs.requires_grad = True
        had_gradients_enabled = torch.is_grad_enabled()
        torch.set_grad_enabled(True)
        noise = torch.randn(inp_imgs.shape, device=inp_imgs.device)
        for _ in range(steps):
            noise.normal_(0, 0.005)
            inp_imgs.data.add_(noise.data)
            inp_imgs.data.clamp_(min=-1.0, max=1.0)
            out_imgs = -model(inp_imgs)
            out_imgs.sum().backward()
            inp_imgs.grad.data.clamp_(-0.03, 0.03)
            inp_imgs.data.add_(-step_size * inp_imgs.grad.data)
            inp_imgs.grad.detach_()
            inp_imgs.grad.zero_()
            inp_imgs.data.clamp_(min=-1.0, max=1.0)
        for p in model.parameters():
            p.requires_grad = True
        model.train(is_training)
        torch.set_grad_enabled(had_gradients_enabled)
        return inp_imgs


ENERGY_IMG, ENERGY_BATCH = (1, 28, 28), 4


def energy_loss(cnn, sampler, batch, alpha=0.1):
    real_imgs, _ = batch
    small_noise = torch.randn_like(real_imgs) * 0.005
    real_imgs.add_(small_noise).clamp_(min=-1.0, max=1.0)
    fake_imgs = sampler.sample_new_exmps(steps=5, step_size=10)
    inp_imgs = torch.cat([real_imgs, fake_imgs], dim=0)
    real_out, fake_out = cnn(inp_imgs).chunk(2, dim=0)
    reg_loss = alpha * (real_out**2 + fake_out**2).mean()
    cdiv_loss = fake_out.mean() - real_out.mean()
    return reg_loss + cdiv_loss


def energy_optimizer(params, lr=1e-4, beta1=0.0):
    optimizer = torch.optim.Adam(params, lr=lr, betas=(beta1, 0.999))
    return optimizer, torch.optim.lr_scheduler.StepLR(optimizer, 1, gamma=0.97)


class DeepEnergyModel(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.cnn = CNNModel(hidden_features=4)
        self.sampler = Sampler(self.cnn, img_shape=ENERGY_IMG, sample_size=ENERGY_BATCH)

    def configure_optimizers(self):
        optimizer, scheduler = energy_optimizer(self.parameters())
        return [optimizer], [scheduler]

    def training_step(self, batch, batch_idx):
        loss = energy_loss(self.cnn, self.sampler, batch)
        self.log("loss", loss)
        return loss


class PortEnergy(safeloop.Trainer):
    """``DeepEnergyModel`` ported: the sampler kept on the Trainer, ``[optimizer], [scheduler]`` as Lightning's dict."""

    def configure_optimizers(self):
        optimizer, scheduler = energy_optimizer(self.model.parameters())
        return {"optimizer": optimizer, "lr_scheduler": scheduler}

    def training_step(self, batch):
        loss = energy_loss(self.model, self.sampler, batch)
        self.log("loss", loss)
        return loss


def mnist_like():
    gen = torch.Generator().manual_seed(1)
    return DataLoader(TensorDataset(torch.rand(12, *ENERGY_IMG, generator=gen) * 2 - 1, torch.zeros(12)),
                      batch_size=ENERGY_BATCH)


def test_lightning_tutorial_deep_energy_model_matches():
    """Two epochs of 3 batches after ``seed_everything``: the CNN's parameters bit for bit, and the sampler's buffer,
    without a guard warning (the MCMC's backward inside ``training_step`` is into the images only)."""
    pl.seed_everything(7, verbose=False)
    lit = DeepEnergyModel()
    lightning(max_epochs=2, gradient_clip_val=0.1).fit(lit, train_dataloaders=mnist_like())
    safeloop.seed_everything(7)
    port = PortEnergy(model=CNNModel(hidden_features=4), train_data=mnist_like(),
                      **settings(max_epochs=2, grad_clip=0.1, guard={"check": "always"}))
    port.sampler = Sampler(port.model, img_shape=ENERGY_IMG, sample_size=ENERGY_BATCH)
    with warnings.catch_warnings():
        warnings.simplefilter("error", safeloop.GraphLifecycleWarning)
        port.fit()
    assert_same(lit.cnn, port.model)
    assert len(lit.sampler.examples) == len(port.sampler.examples) == 7 * ENERGY_BATCH
    assert all(torch.equal(a, b) for a, b in zip(lit.sampler.examples, port.sampler.examples))


# -- a stop asked at an epoch's edge: Lightning's ``Timer`` callback sets ``trainer.should_stop = True`` in
# ``on_train_epoch_end`` when its time is up (Lightning-AI/pytorch-lightning, src/lightning/pytorch/callbacks/timer.py,
# ``interval="epoch"``), as do callbacks that stop once a training metric is reached. Ported (docs/trainer.md's map:
# ``trainer.should_stop = True`` is ``trainer.request_stop(reason)``; a safeloop callback's ``on_epoch_end``), or set
# in ``on_train_epoch_start`` / ``on_epoch_start``. Lightning trains no batch after the request; safeloop runs the next
# pass's ``on_epoch_start`` and trains its first step, then stops.


class LitEpochStopper(pl.Callback):
    def __init__(self, hook):
        self.hook = hook

    def on_train_epoch_start(self, trainer, pl_module):
        if self.hook == "start" and trainer.current_epoch == 1:
            trainer.should_stop = True

    def on_train_epoch_end(self, trainer, pl_module):
        if self.hook == "end" and trainer.current_epoch == 0:
            trainer.should_stop = True


class EpochStopper(safeloop.Callback):
    def __init__(self, hook):
        self.hook = hook

    def on_epoch_start(self, trainer):
        if self.hook == "start" and trainer.state.epoch == 1:
            trainer.request_stop("time is up")

    def on_epoch_end(self, trainer):
        if self.hook == "end" and trainer.state.epoch == 0:
            trainer.request_stop("time is up")


@pytest.mark.parametrize("hook", ["end", "start"])
def test_a_stop_asked_at_an_epochs_edge_trains_no_further_step(hook):
    """Passes of 7 batches, a stop asked at the end of the first pass (or the start of the second): Lightning stops
    after step 7; so should the port, with the same parameters."""
    lit = Lit()
    trainer = lightning(max_epochs=3, callbacks=[LitEpochStopper(hook)])
    trainer.fit(lit, train_dataloaders=loader())
    assert trainer.global_step == 7
    port = Port(model=net(), train_data=loader(), optimizer=adam, callbacks=[EpochStopper(hook)],
                **settings(max_epochs=3))
    port.fit()
    assert port.state.step == 7
    assert_same(lit.model, port.model)


def plateau(model):
    opt = torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9)
    return {"optimizer": opt, "lr_scheduler": {"scheduler": torch.optim.lr_scheduler.ReduceLROnPlateau(
        opt, patience=0, factor=0.5), "monitor": "val_loss"}}


class LitCurriculumPlateau(LitCurriculum):
    def on_train_epoch_start(self):
        self.rates.append(self.optimizers().param_groups[0]["lr"])


class PortCurriculumPlateau(PortCurriculum):
    configure = staticmethod(plateau)

    def on_epoch_start(self):
        super().on_epoch_start()
        self.rates.append(self.optimizers["optimizer"].param_groups[0]["lr"])


def test_a_plateau_on_validations_run_in_on_epoch_end_matches():
    """The curriculum (passes of 3 to 7 batches) with a ``ReduceLROnPlateau`` on ``val_loss``, Lightning's stepped at
    each epoch's end on that epoch's validation; the port validates in ``on_epoch_end`` (no ``val_every`` is a pass's
    steps), and its plateau steps after each of those validations: each epoch's rate, the parameters, bit for bit."""
    lit = LitCurriculumPlateau(configure=plateau)
    lit.validated, lit.rates = [], []
    lightning(max_epochs=5, reload_dataloaders_every_n_epochs=1).fit(lit, val_dataloaders=loader(n=4, seed=2))
    port = PortCurriculumPlateau(model=net(), train_data=curriculum(0), val_data=loader(n=4, seed=2),
                                 **settings(max_epochs=5, val_every=1000))
    port.validated, port.rates = [], []
    port.fit()
    assert port.rates == lit.rates and len(set(lit.rates)) > 2
    assert_same(lit.model, port.model)


class PortValidatesAtEpochEnd(Port):
    def on_epoch_end(self):
        self.validate()


def test_early_stopping_on_a_validation_at_each_epochs_end_trains_no_further_step():
    """Lightning's ``EarlyStopping("val_loss", patience=1)`` with validation each epoch stops after step 14 (two
    passes, the second no better); the port validating in ``on_epoch_end`` (passes of changing or unknown length have
    no ``val_every``) should stop there too, with the same parameters. It stops after step 15."""
    sgd = lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9)  # noqa: E731
    lit = Lit(configure=lambda model: sgd(model.parameters()))
    trainer = lightning(max_epochs=4, callbacks=[pl.callbacks.EarlyStopping("val_loss", patience=1)])
    trainer.fit(lit, train_dataloaders=loader(), val_dataloaders=loader(n=4, seed=2))
    assert trainer.global_step == 14
    port = PortValidatesAtEpochEnd(model=net(), train_data=loader(), val_data=loader(n=4, seed=2), optimizer=sgd,
                                   callbacks=[safeloop.EarlyStopping(monitor="val_loss", patience=1)],
                                   **settings(max_epochs=4, val_every=1000))
    port.fit()
    assert port.state.step == 14
    assert_same(lit.model, port.model)
