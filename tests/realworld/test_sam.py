"""Sharpness-aware minimization: davda54/sam at commit 3c3afdbd71cff2462ec91c734b3d1170bd0f3707, sam.py (``SAM``),
example/train.py, example/utility/bypass_bn.py, example/utility/step_lr.py, example/model/smooth_cross_entropy.py
and README.md (the closure-based usage).

``SAM`` is an ``Optimizer`` that wraps a base optimizer built on its own ``param_groups``. The example's loop
back-propagates the loss, then ``first_step`` (under ``no_grad``) keeps each weight (``old_p = p.data.clone()``),
moves it in place to ``w + e(w)`` along the gradient scaled by the global gradient norm (adaptive: by ``|w|``), and
clears the gradients; a second forward-backward at the moved weights (BatchNorm's momentum set to 0 by
``disable_running_stats`` so that running statistics move once) gives the gradient that ``second_step`` hands to
the base SGD after putting the weights back by rebinding ``p.data``. ``step(closure)`` is the same: it asserts a
closure was given (``closure=None`` by default), then runs ``first_step``, the closure, ``second_step``. Label
smoothing through ``kl_div``; the lr set per batch from the epoch (``StepLR.__call__``).

Changes for a seconds-long test: a conv-BatchNorm-ReLU-pool-linear net (WideResNet 16-8) over 3x6x6 images, 3
classes, 2 epochs of 2 batches of 4, ``total_epochs`` 2 (200), the default ``rho`` (2.0) and ``adaptive=True``; no
Cutout, logging or evaluation.

The example's loop is ported in manual mode: ``self.backward`` for the first pass, ``self.step(closure=...)``
for SAM's two steps around the second (the Trainer's closure back-propagates it and readies its gradients). The
README's closure usage is ported to the automatic step: the loss returned, the Trainer supplies the closure (SAM's
``step(closure=None)`` asserts one; ``first_step`` and ``second_step`` tell the Trainer it is a two-phase optimizer).
"""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.modules.batchnorm import _BatchNorm

from safeloop import Trainer

from .harness import checks, compare

CLASSES, BATCH, PER_EPOCH, EPOCHS = 3, 4, 2, 2
LEARNING_RATE, MOMENTUM, RHO, WEIGHT_DECAY, LABEL_SMOOTHING = 0.1, 0.9, 2.0, 0.0005, 0.1


# -- sam.py -------------------------------------------------------------------------------------------------
class SAM(torch.optim.Optimizer):
    def __init__(self, params, base_optimizer, rho=0.05, adaptive=False, **kwargs):
        assert rho >= 0.0, f"Invalid rho, should be non-negative: {rho}"

        defaults = dict(rho=rho, adaptive=adaptive, **kwargs)
        super(SAM, self).__init__(params, defaults)

        self.base_optimizer = base_optimizer(self.param_groups, **kwargs)
        self.param_groups = self.base_optimizer.param_groups
        self.defaults.update(self.base_optimizer.defaults)

    @torch.no_grad()
    def first_step(self, zero_grad=False):
        grad_norm = self._grad_norm()
        for group in self.param_groups:
            scale = group["rho"] / (grad_norm + 1e-12)

            for p in group["params"]:
                if p.grad is None: continue  # noqa: E701 (the source's)
                self.state[p]["old_p"] = p.data.clone()
                e_w = (torch.pow(p, 2) if group["adaptive"] else 1.0) * p.grad * scale.to(p)
                p.add_(e_w)  # climb to the local maximum "w + e(w)"

        if zero_grad: self.zero_grad()  # noqa: E701

    @torch.no_grad()
    def second_step(self, zero_grad=False):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None: continue  # noqa: E701
                p.data = self.state[p]["old_p"]  # get back to "w" from "w + e(w)"

        self.base_optimizer.step()  # do the actual "sharpness-aware" update

        if zero_grad: self.zero_grad()  # noqa: E701

    @torch.no_grad()
    def step(self, closure=None):
        assert closure is not None, "Sharpness Aware Minimization requires closure, but it was not provided"
        closure = torch.enable_grad()(closure)  # the closure should do a full forward-backward pass

        self.first_step(zero_grad=True)
        closure()
        self.second_step()

    def _grad_norm(self):
        # put everything on the same device, in case of model parallelism
        shared_device = self.param_groups[0]["params"][0].device
        norm = torch.norm(
                    torch.stack([
                        ((torch.abs(p) if group["adaptive"] else 1.0) * p.grad).norm(p=2).to(shared_device)
                        for group in self.param_groups for p in group["params"]
                        if p.grad is not None
                    ]),
                    p=2
               )
        return norm

    def load_state_dict(self, state_dict):
        super().load_state_dict(state_dict)
        self.base_optimizer.param_groups = self.param_groups


# -- example/utility/bypass_bn.py ---------------------------------------------------------------------------
def disable_running_stats(model):
    def _disable(module):
        if isinstance(module, _BatchNorm):
            module.backup_momentum = module.momentum
            module.momentum = 0

    model.apply(_disable)


def enable_running_stats(model):
    def _enable(module):
        if isinstance(module, _BatchNorm) and hasattr(module, "backup_momentum"):
            module.momentum = module.backup_momentum

    model.apply(_enable)


# -- example/utility/step_lr.py -----------------------------------------------------------------------------
class StepLR:
    def __init__(self, optimizer, learning_rate: float, total_epochs: int):
        self.optimizer = optimizer
        self.total_epochs = total_epochs
        self.base = learning_rate

    def __call__(self, epoch):
        if epoch < self.total_epochs * 3/10:
            lr = self.base
        elif epoch < self.total_epochs * 6/10:
            lr = self.base * 0.2
        elif epoch < self.total_epochs * 8/10:
            lr = self.base * 0.2 ** 2
        else:
            lr = self.base * 0.2 ** 3

        for param_group in self.optimizer.param_groups:
            param_group["lr"] = lr

    def lr(self) -> float:
        return self.optimizer.param_groups[0]["lr"]


# -- example/model/smooth_cross_entropy.py ------------------------------------------------------------------
def smooth_crossentropy(pred, gold, smoothing=0.1):
    n_class = pred.size(1)

    one_hot = torch.full_like(pred, fill_value=smoothing / (n_class - 1))
    one_hot.scatter_(dim=1, index=gold.unsqueeze(1), value=1.0 - smoothing)
    log_prob = F.log_softmax(pred, dim=1)

    return F.kl_div(input=log_prob, target=one_hot, reduction='none').sum(-1)


def make_net():
    """Stands in for ``WideResNet(16, 8, ...)``."""
    return nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
                         nn.Flatten(), nn.Linear(4, CLASSES))


def make_optimizer(params):
    base_optimizer = torch.optim.SGD
    return SAM(params, base_optimizer, rho=RHO, adaptive=True, lr=LEARNING_RATE, momentum=MOMENTUM,
               weight_decay=WEIGHT_DECAY)


# -- example/train.py ---------------------------------------------------------------------------------------
def sam_hand(model, train):
    optimizer = make_optimizer(model.parameters())
    scheduler = StepLR(optimizer, LEARNING_RATE, EPOCHS)

    for epoch in range(EPOCHS):
        model.train()

        for batch in train:
            inputs, targets = batch

            # first forward-backward step
            enable_running_stats(model)
            predictions = model(inputs)
            loss = smooth_crossentropy(predictions, targets, smoothing=LABEL_SMOOTHING)
            loss.mean().backward()
            optimizer.first_step(zero_grad=True)

            # second forward-backward step
            disable_running_stats(model)
            smooth_crossentropy(model(inputs), targets, smoothing=LABEL_SMOOTHING).mean().backward()
            optimizer.second_step(zero_grad=True)

            with torch.no_grad():
                scheduler(epoch)


class SAMTrainer(Trainer):
    automatic = False

    def configure_optimizers(self):
        optimizer = make_optimizer(self.model.parameters())
        self.scheduler = StepLR(optimizer, LEARNING_RATE, EPOCHS)
        return optimizer

    def on_epoch_start(self):
        self.model.train()

    def training_step(self, batch):
        inputs, targets = batch
        enable_running_stats(self.model)
        loss = smooth_crossentropy(self.model(inputs), targets, smoothing=LABEL_SMOOTHING)
        self.backward(loss.mean())

        def closure():
            disable_running_stats(self.model)
            second = smooth_crossentropy(self.model(inputs), targets, smoothing=LABEL_SMOOTHING).mean()
            self.backward(second)
            return second
        self.step(closure=closure)
        return loss.mean()

    def on_step_end(self, losses):
        self.scheduler(self.state.epoch)


# -- README.md: the closure-based usage ---------------------------------------------------------------------
def loss_function(output, prediction):
    return F.cross_entropy(prediction, output)


def readme_hand(model, data):
    optimizer = make_optimizer(model.parameters())
    for input, output in data:
        def closure():
            loss = loss_function(output, model(input))
            loss.backward()
            return loss

        loss = loss_function(output, model(input))
        loss.backward()
        optimizer.step(closure)
        optimizer.zero_grad()


class ReadmeTrainer(Trainer):
    def training_step(self, batch):
        input, output = batch
        return loss_function(output, self.model(input))


def cifar(model):
    gen = torch.Generator().manual_seed(15)
    return [(torch.randn(BATCH, 3, 6, 6, generator=gen), torch.randint(CLASSES, (BATCH,), generator=gen))
            for _ in range(PER_EPOCH)]


@pytest.mark.parametrize("check", checks())
def test_sam_example_with_two_passes_and_batchnorm_statistics_bypassed(check):
    compare(make_net, sam_hand, SAMTrainer, cifar, check, steps=EPOCHS * PER_EPOCH, optimizer=make_optimizer)


@pytest.mark.parametrize("check", checks())
def test_sam_readme_closure_usage_in_the_automatic_step(check):
    compare(make_net, readme_hand, ReadmeTrainer, cifar, check, steps=PER_EPOCH, optimizer=make_optimizer)
