"""TRADES adversarial training: yaodongyu/TRADES at commit 9d308f1cd6079b2b437587dd779788030b193440, trades.py
(``trades_loss``), and train_trades_mnist.py at commit d9fd5ee8ecaf56ec38d2413968ee83396adbaefe (``train``,
``adjust_learning_rate``, ``main``).

``trades_loss`` puts the model in eval mode, builds the adversarial example by steps of ``torch.autograd.grad``
of a KL divergence with respect to the input only (``l_inf``: under ``enable_grad``, the target
``F.softmax(model(x_natural))`` recomputed with its graph each time), or (``l_2``) by an inner SGD over a
perturbation ``delta`` whose ``loss.backward()`` also fills the model's ``.grad``, renormalized by hand and
projected through ``delta.data``; then ``model.train()``, the *training* optimizer's ``zero_grad()`` from inside
the loss function, and a loss of three forwards (natural cross-entropy plus the KL term, ``size_average=False``
divided by the batch size). ``train`` back-propagates it and steps; the lr is set per epoch.

Changes for a seconds-long test: a small CNN with BatchNorm and dropout (the source's ``SmallCNN`` has dropout,
its CIFAR ``WideResNet`` BatchNorm) over 1x6x6 images, 3 classes, batches of 4, 2 epochs of 2 batches, 3
perturbation steps (40), the lr decays at epoch 2 (55); ``.cuda()`` dropped; no evaluation or checkpoints.

The port returns ``trades_loss(...)`` from ``training_step`` with the Trainer's optimizer and sets the lr in
``on_epoch_start``.
"""
from functools import partial

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.optim as optim
from torch.autograd import Variable

from safeloop import Trainer

from .harness import checks, compare

CLASSES, BATCH, PER_EPOCH, EPOCHS = 3, 4, 2, 2
LR, MOMENTUM, EPSILON, NUM_STEPS, STEP_SIZE, BETA = 0.01, 0.9, 0.3, 3, 0.01, 1.0


class SmallCNN(nn.Module):
    """Stands in for ``models.small_cnn.SmallCNN``."""

    def __init__(self):
        super().__init__()
        self.features = nn.Sequential(nn.Conv2d(1, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.MaxPool2d(2))
        self.classifier = nn.Sequential(nn.Linear(16, 8), nn.ReLU(), nn.Dropout(0.5), nn.Linear(8, CLASSES))

    def forward(self, x):
        return self.classifier(self.features(x).view(-1, 16))


# -- trades.py ----------------------------------------------------------------------------------------------
def trades_loss(model,
                x_natural,
                y,
                optimizer,
                step_size=0.003,
                epsilon=0.031,
                perturb_steps=10,
                beta=1.0,
                distance='l_inf'):
    # define KL-loss
    criterion_kl = nn.KLDivLoss(size_average=False)
    model.eval()
    batch_size = len(x_natural)
    # generate adversarial example
    x_adv = x_natural.detach() + 0.001 * torch.randn(x_natural.shape).detach()
    if distance == 'l_inf':
        for _ in range(perturb_steps):
            x_adv.requires_grad_()
            with torch.enable_grad():
                loss_kl = criterion_kl(F.log_softmax(model(x_adv), dim=1),
                                       F.softmax(model(x_natural), dim=1))
            grad = torch.autograd.grad(loss_kl, [x_adv])[0]
            x_adv = x_adv.detach() + step_size * torch.sign(grad.detach())
            x_adv = torch.min(torch.max(x_adv, x_natural - epsilon), x_natural + epsilon)
            x_adv = torch.clamp(x_adv, 0.0, 1.0)
    elif distance == 'l_2':
        delta = 0.001 * torch.randn(x_natural.shape).detach()
        delta = Variable(delta.data, requires_grad=True)

        # Setup optimizers
        optimizer_delta = optim.SGD([delta], lr=epsilon / perturb_steps * 2)

        for _ in range(perturb_steps):
            adv = x_natural + delta

            # optimize
            optimizer_delta.zero_grad()
            with torch.enable_grad():
                loss = (-1) * criterion_kl(F.log_softmax(model(adv), dim=1),
                                           F.softmax(model(x_natural), dim=1))
            loss.backward()
            # renorming gradient
            grad_norms = delta.grad.view(batch_size, -1).norm(p=2, dim=1)
            delta.grad.div_(grad_norms.view(-1, 1, 1, 1))
            # avoid nan or inf if gradient is 0
            if (grad_norms == 0).any():
                delta.grad[grad_norms == 0] = torch.randn_like(delta.grad[grad_norms == 0])
            optimizer_delta.step()

            # projection
            delta.data.add_(x_natural)
            delta.data.clamp_(0, 1).sub_(x_natural)
            delta.data.renorm_(p=2, dim=0, maxnorm=epsilon)
        x_adv = Variable(x_natural + delta, requires_grad=False)
    else:
        x_adv = torch.clamp(x_adv, 0.0, 1.0)
    model.train()

    x_adv = Variable(torch.clamp(x_adv, 0.0, 1.0), requires_grad=False)
    # zero gradient
    optimizer.zero_grad()
    # calculate robust loss
    logits = model(x_natural)
    loss_natural = F.cross_entropy(logits, y)
    loss_robust = (1.0 / batch_size) * criterion_kl(F.log_softmax(model(x_adv), dim=1),
                                                    F.softmax(model(x_natural), dim=1))
    loss = loss_natural + beta * loss_robust
    return loss


# -- train_trades_mnist.py ----------------------------------------------------------------------------------
def adjust_learning_rate(optimizer, epoch):
    """decrease the learning rate"""
    lr = LR
    if epoch >= 2:  # 55
        lr = LR * 0.1
    for param_group in optimizer.param_groups:
        param_group['lr'] = lr


def train(model, train_loader, optimizer, epoch, distance):
    model.train()
    for batch_idx, (data, target) in enumerate(train_loader):
        optimizer.zero_grad()

        # calculate robust loss
        loss = trades_loss(model=model, x_natural=data, y=target, optimizer=optimizer, step_size=STEP_SIZE,
                           epsilon=EPSILON, perturb_steps=NUM_STEPS, beta=BETA, distance=distance)

        loss.backward()
        optimizer.step()


def make_optimizer(model):
    return optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)


def hand(distance):
    def trades_hand(model, train_loader):
        optimizer = make_optimizer(model)
        for epoch in range(1, EPOCHS + 1):
            adjust_learning_rate(optimizer, epoch)
            train(model, train_loader, optimizer, epoch, distance)
    return trades_hand


class TradesTrainer(Trainer):
    distance = 'l_inf'

    def on_epoch_start(self):
        adjust_learning_rate(self.optimizers["optimizer"], self.state.epoch + 1)
        self.model.train()

    def training_step(self, batch):
        data, target = batch
        return trades_loss(model=self.model, x_natural=data, y=target, optimizer=self.optimizers["optimizer"],
                           step_size=STEP_SIZE, epsilon=EPSILON, perturb_steps=NUM_STEPS, beta=BETA,
                           distance=self.distance)


class TradesL2Trainer(TradesTrainer):
    distance = 'l_2'


def mnist(model):
    gen = torch.Generator().manual_seed(5)
    return [(torch.rand(BATCH, 1, 6, 6, generator=gen), torch.randint(CLASSES, (BATCH,), generator=gen))
            for _ in range(PER_EPOCH)]


@pytest.mark.parametrize("check", checks())
def test_trades_with_an_input_gradient_attack_in_eval_mode(check):
    compare(SmallCNN, hand('l_inf'), TradesTrainer, mnist, check, steps=EPOCHS * PER_EPOCH,
            optimizer=partial(optim.SGD, lr=LR, momentum=MOMENTUM))


@pytest.mark.parametrize("check", checks())
def test_trades_l2_with_an_inner_backward_into_the_model_and_zero_grad_inside_the_loss(check):
    compare(SmallCNN, hand('l_2'), TradesL2Trainer, mnist, check, steps=EPOCHS * PER_EPOCH,
            optimizer=partial(optim.SGD, lr=LR, momentum=MOMENTUM))
