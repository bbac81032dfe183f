"""PGD adversarial training whose attack back-propagates into the model: locuslab/fast_adversarial at commit
1d94c4ece1a5eec8b2c6746aeeaf906f1be3a75f, CIFAR10/train_pgd.py (``main``), CIFAR10/utils.py at commit
e9ccb1748fe9065a9309c5afd82ce9ff766d78b7 (``clamp``, ``mu``, ``std``, ``upper_limit``, ``lower_limit``).

Each batch's perturbation ``delta`` (drawn per channel with ``uniform_``, clamped into the image range through
``delta.data =``) is a leaf that requires grad; ``attack_iters`` times the loop runs the model on ``X + delta`` and
calls ``backward()`` on the loss: that fills ``delta.grad`` (read, then ``delta.grad.zero_()``) but also adds the
attack's gradients into every parameter's ``.grad``, which the loop leaves there until ``opt.zero_grad()``, just
before the training loss's backward. A ``CyclicLR`` steps after every update.

Changes for a seconds-long test: a pre-activation ResNet with one block (PreActResNet18) over 3x6x6 images, 3
classes, 2 epochs of 2 batches of 4, 3 attack iterations (7); apex's ``amp.scale_loss`` (``O2``, loss scale 1.0)
as a plain ``backward()`` in float32; no CUDA, logging or evaluation.

The port puts the attack in ``training_step``. With the attack's backward limited to the perturbation
(``backward(inputs=[delta])``: ``delta.grad`` the same, no parameter gradient) it trains as the loop. Written as
the source reads (the attack's ``loss.backward()``, and no ``zero_grad``, which the Trainer owns), the attack's
parameter gradients would be added to the training loss's: the guard stops the first step, and the step where an
attack starting later begins (it looks at the gradients at every step, checked or not).
"""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from safeloop import Trainer
from safeloop.errors import DoubleBackwardError

from .harness import checks, compare

CLASSES, BATCH, PER_EPOCH, EPOCHS, ATTACK_ITERS = 3, 4, 2, 2, 3
LR_MIN, LR_MAX, MOMENTUM, WEIGHT_DECAY = 0., 0.2, 0.9, 5e-4

# -- CIFAR10/utils.py ---------------------------------------------------------------------------------------
cifar10_mean = (0.4914, 0.4822, 0.4465)
cifar10_std = (0.2471, 0.2435, 0.2616)

mu = torch.tensor(cifar10_mean).view(3, 1, 1)
std = torch.tensor(cifar10_std).view(3, 1, 1)

upper_limit = ((1 - mu) / std)
lower_limit = ((0 - mu) / std)


def clamp(X, lower_limit, upper_limit):
    return torch.max(torch.min(X, upper_limit), lower_limit)


epsilon = (8 / 255.) / std
alpha = (2 / 255.) / std


class PreActBlock(nn.Module):
    def __init__(self, planes):
        super().__init__()
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv1 = nn.Conv2d(planes, planes, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, padding=1, bias=False)

    def forward(self, x):
        out = F.relu(self.bn1(x))
        out = self.conv1(out)
        out = self.conv2(F.relu(self.bn2(out)))
        return out + x


class PreActResNet(nn.Module):
    """Stands in for ``preact_resnet.PreActResNet18``."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 4, 3, padding=1, bias=False)
        self.layer1 = PreActBlock(4)
        self.bn = nn.BatchNorm2d(4)
        self.linear = nn.Linear(4, CLASSES)

    def forward(self, x):
        out = F.relu(self.bn(self.layer1(self.conv1(x))))
        return self.linear(F.adaptive_avg_pool2d(out, 1).flatten(1))


criterion = nn.CrossEntropyLoss()


# -- CIFAR10/train_pgd.py -----------------------------------------------------------------------------------
def attack(model, X, y, backward):
    """The loop's attack; ``backward``: the source's ``scaled_loss.backward()``, or the port's."""
    delta = torch.zeros_like(X)
    for i in range(len(epsilon)):
        delta[:, i, :, :].uniform_(-epsilon[i][0][0].item(), epsilon[0][0][0].item())
    delta.data = clamp(delta, lower_limit - X, upper_limit - X)
    delta.requires_grad = True
    for _ in range(ATTACK_ITERS):
        output = model(X + delta)
        loss = criterion(output, y)
        backward(loss, delta)
        grad = delta.grad.detach()
        delta.data = clamp(delta + alpha * torch.sign(grad), -epsilon, epsilon)
        delta.data = clamp(delta, lower_limit - X, upper_limit - X)
        delta.grad.zero_()
    return delta.detach()


def as_written(loss, delta):
    loss.backward()


def into_delta(loss, delta):
    loss.backward(inputs=[delta])


def make_optimizer(params):
    return torch.optim.SGD(params, lr=LR_MAX, momentum=MOMENTUM, weight_decay=WEIGHT_DECAY)


def make_scheduler(opt):
    lr_steps = EPOCHS * PER_EPOCH
    return torch.optim.lr_scheduler.CyclicLR(opt, base_lr=LR_MIN, max_lr=LR_MAX, step_size_up=lr_steps / 2,
                                             step_size_down=lr_steps / 2)


def pgd_hand(model, train_loader):
    model.train()
    opt = make_optimizer(model.parameters())
    scheduler = make_scheduler(opt)
    for epoch in range(EPOCHS):
        for i, (X, y) in enumerate(train_loader):
            delta = attack(model, X, y, as_written)
            output = model(X + delta)
            loss = criterion(output, y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            scheduler.step()


class PGDTrainer(Trainer):
    backward_of_the_attack = staticmethod(as_written)

    def training_step(self, batch):
        X, y = batch
        delta = attack(self.model, X, y, self.backward_of_the_attack)
        return criterion(self.model(X + delta), y)


class PGDIntoDeltaTrainer(PGDTrainer):
    backward_of_the_attack = staticmethod(into_delta)


def cifar(model):
    gen = torch.Generator().manual_seed(13)
    return [(((torch.rand(BATCH, 3, 6, 6, generator=gen) - mu) / std), torch.randint(CLASSES, (BATCH,), generator=gen))
            for _ in range(PER_EPOCH)]


def run(port, check):
    compare(PreActResNet, pgd_hand, port, cifar, check, steps=EPOCHS * PER_EPOCH, optimizer=make_optimizer,
            scheduler={"scheduler": make_scheduler, "interval": "step"})


@pytest.mark.parametrize("check", checks())
def test_pgd_training_with_the_attack_backward_limited_to_the_perturbation(check):
    run(PGDIntoDeltaTrainer, check)


@pytest.mark.parametrize("check", ["auto", "always"])
def test_pgd_training_ported_as_written_is_stopped_at_its_first_step(check):
    """The attack's ``backward()`` in ``training_step`` leaves the parameters' ``.grad`` filled: the Trainer's
    backward would add the training loss's gradient to them. The guard stops the first step, as it should."""
    torch.manual_seed(0)
    model = PreActResNet()
    before = {k: v.clone() for k, v in model.named_parameters()}
    with pytest.raises(DoubleBackwardError, match=r"\(step 1, loss 'loss'\): gradients were already present"):
        PGDTrainer(model=model, train_data=cifar(model), max_steps=EPOCHS * PER_EPOCH, device="cpu", progress=False,
                   loggers=(), optimizer=make_optimizer, guard={"check": check}).fit()
    assert all(torch.equal(v, before[k]) for k, v in model.named_parameters())  # the step was abandoned


class LateAttack(PGDTrainer):
    """The attack from the 13th step on (a schedule that trains on clean images first)."""

    def training_step(self, batch):
        if self.state.step + 1 < 13:
            X, y = batch
            return criterion(self.model(X), y)
        return super().training_step(batch)


def test_pgd_training_ported_as_written_with_a_late_attack_is_stopped_too():
    torch.manual_seed(0)
    model = PreActResNet()
    data = [batch for _ in range(6) for batch in cifar(model)]
    with pytest.raises(DoubleBackwardError, match=r"\(step 13, loss 'loss'\): gradients were already") as caught:
        LateAttack(model=model, train_data=data, max_steps=24, device="cpu", progress=False, loggers=(),
                   optimizer=make_optimizer, guard={"check": "auto"}).fit()
    assert "torch.autograd.grad(loss, [x]) or loss.backward(inputs=[x])" in caught.value.fixes[-1]
