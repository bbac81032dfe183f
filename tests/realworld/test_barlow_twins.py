"""Barlow Twins: facebookresearch/barlowtwins at commit 8e8d284ca0bc02f88b92328e53f9b901e86b4a3c, main.py
(``main_worker``, ``adjust_learning_rate``, ``off_diagonal``, ``BarlowTwins``, ``LARS``).

Two views through one backbone and projector (Linear without bias, BatchNorm1d, in-place ReLU), each
embedding through an affine-free BatchNorm1d, then their cross-correlation ``c = bn(z1).T @ bn(z2)`` divided
*in place* (``c.div_``); the loss is ``torch.diagonal(c).add_(-1).pow_(2).sum()`` (two in-place ops on a view
of ``c``'s diagonal, so ``c`` itself changes) plus ``lambd`` times ``off_diagonal(c).pow_(2).sum()``, where
``off_diagonal`` takes ``c.flatten()[:-1].view(n - 1, n + 1)[:, 1:].flatten()``. All of it under float16
autocast with a ``GradScaler`` (``scaler.step`` on a custom optimizer): LARS, its own ``@torch.no_grad()``
``step`` with ``torch.where`` trust ratios and a momentum buffer, in two groups (weights; biases and norm
gains, excluded from weight decay and adaptation by ``ndim == 1``), the learning rate of each group assigned
every step (linear warmup, then cosine).

Changes for a seconds-long test: a two-convolution backbone with global pooling (ResNet-50), a 32-32-32
projector (8192-8192-8192), 2 views of 8 random 8x8 images (ImageNet crops of 224 from torchvision
transforms), 2 epochs of 4 batches, a warmup of 1 epoch (10); single process (no SyncBatchNorm, DDP or
``all_reduce`` of ``c``); CPU: ``torch.autocast("cpu", dtype=torch.float16)`` and
``torch.amp.GradScaler("cpu")`` for their CUDA forms; no checkpoint or stats file.

The port is automatic: ``precision="16"``, the learning rates assigned in ``training_step``.
"""
import math

import pytest
import torch
import torch.nn as nn
from torch import optim

from safeloop import Trainer

from .harness import checks, compare

EPOCHS, PER_EPOCH, BATCH, PROJECTOR, LAMBD, WEIGHT_DECAY = 2, 4, 8, '32-32-32', 0.0051, 1.5e-6
LEARNING_RATE_WEIGHTS, LEARNING_RATE_BIASES, WARMUP_EPOCHS = 0.2, 0.0048, 1


class Args:
    batch_size, projector, lambd, epochs = BATCH, PROJECTOR, LAMBD, EPOCHS
    weight_decay, learning_rate_weights = WEIGHT_DECAY, LEARNING_RATE_WEIGHTS
    learning_rate_biases = LEARNING_RATE_BIASES


def adjust_learning_rate(args, optimizer, loader, step):
    max_steps = args.epochs * len(loader)
    warmup_steps = WARMUP_EPOCHS * len(loader)
    base_lr = args.batch_size / 256
    if step < warmup_steps:
        lr = base_lr * step / warmup_steps
    else:
        step -= warmup_steps
        max_steps -= warmup_steps
        q = 0.5 * (1 + math.cos(math.pi * step / max_steps))
        end_lr = base_lr * 0.001
        lr = base_lr * q + end_lr * (1 - q)
    optimizer.param_groups[0]['lr'] = lr * args.learning_rate_weights
    optimizer.param_groups[1]['lr'] = lr * args.learning_rate_biases


def off_diagonal(x):
    # return a flattened view of the off-diagonal elements of a square matrix
    n, m = x.shape
    assert n == m
    return x.flatten()[:-1].view(n - 1, n + 1)[:, 1:].flatten()


def resnet():
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8), nn.ReLU(inplace=True),
                         nn.Conv2d(8, 16, 3, stride=2, padding=1, bias=False), nn.BatchNorm2d(16),
                         nn.ReLU(inplace=True), nn.AdaptiveAvgPool2d(1), nn.Flatten())


class BarlowTwins(nn.Module):
    def __init__(self, args):
        super().__init__()
        self.args = args
        self.backbone = resnet()

        # projector
        sizes = [16] + list(map(int, args.projector.split('-')))
        layers = []
        for i in range(len(sizes) - 2):
            layers.append(nn.Linear(sizes[i], sizes[i + 1], bias=False))
            layers.append(nn.BatchNorm1d(sizes[i + 1]))
            layers.append(nn.ReLU(inplace=True))
        layers.append(nn.Linear(sizes[-2], sizes[-1], bias=False))
        self.projector = nn.Sequential(*layers)

        # normalization layer for the representations z1 and z2
        self.bn = nn.BatchNorm1d(sizes[-1], affine=False)

    def forward(self, y1, y2):
        z1 = self.projector(self.backbone(y1))
        z2 = self.projector(self.backbone(y2))

        # empirical cross-correlation matrix
        c = self.bn(z1).T @ self.bn(z2)

        # sum the cross-correlation matrix between all gpus
        c.div_(self.args.batch_size)

        on_diag = torch.diagonal(c).add_(-1).pow_(2).sum()
        off_diag = off_diagonal(c).pow_(2).sum()
        loss = on_diag + self.args.lambd * off_diag
        return loss


class LARS(optim.Optimizer):
    def __init__(self, params, lr, weight_decay=0, momentum=0.9, eta=0.001,
                 weight_decay_filter=False, lars_adaptation_filter=False):
        defaults = dict(lr=lr, weight_decay=weight_decay, momentum=momentum,
                        eta=eta, weight_decay_filter=weight_decay_filter,
                        lars_adaptation_filter=lars_adaptation_filter)
        super().__init__(params, defaults)

    def exclude_bias_and_norm(self, p):
        return p.ndim == 1

    @torch.no_grad()
    def step(self):
        for g in self.param_groups:
            for p in g['params']:
                dp = p.grad

                if dp is None:
                    continue

                if not g['weight_decay_filter'] or not self.exclude_bias_and_norm(p):
                    dp = dp.add(p, alpha=g['weight_decay'])

                if not g['lars_adaptation_filter'] or not self.exclude_bias_and_norm(p):
                    param_norm = torch.norm(p)
                    update_norm = torch.norm(dp)
                    one = torch.ones_like(param_norm)
                    q = torch.where(param_norm > 0.,
                                    torch.where(update_norm > 0,
                                                (g['eta'] * param_norm / update_norm), one), one)
                    dp = dp.mul(q)

                param_state = self.state[p]
                if 'mu' not in param_state:
                    param_state['mu'] = torch.zeros_like(p)
                mu = param_state['mu']
                mu.mul_(g['momentum']).add_(dp)

                p.add_(mu, alpha=-g['lr'])


def make_optimizer(model, args):
    param_weights = []
    param_biases = []
    for param in model.parameters():
        if param.ndim == 1:
            param_biases.append(param)
        else:
            param_weights.append(param)
    parameters = [{'params': param_weights}, {'params': param_biases}]
    return LARS(parameters, lr=0, weight_decay=args.weight_decay,
                weight_decay_filter=True,
                lars_adaptation_filter=True)


def barlow_hand(model, loader):
    args = Args()
    optimizer = make_optimizer(model, args)
    scaler = torch.amp.GradScaler("cpu")  # torch.cuda.amp.GradScaler()
    for epoch in range(0, args.epochs):
        for step, ((y1, y2), _) in enumerate(loader, start=epoch * len(loader)):
            adjust_learning_rate(args, optimizer, loader, step)
            optimizer.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16):  # torch.cuda.amp.autocast()
                loss = model.forward(y1, y2)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()


class BarlowTwinsTrainer(Trainer):
    def configure_optimizers(self):
        self.args, self.global_step = Args(), -1
        self.lars = make_optimizer(self.model, self.args)
        return self.lars

    def training_step(self, batch):
        (y1, y2), _ = batch
        self.global_step += 1
        adjust_learning_rate(self.args, self.lars, self.train_data, self.global_step)
        return self.model.forward(y1, y2)


def make_model():
    return BarlowTwins(Args())


def views():
    gen = torch.Generator().manual_seed(11)
    return [((torch.randn(BATCH, 3, 8, 8, generator=gen), torch.randn(BATCH, 3, 8, 8, generator=gen)),
             torch.zeros(BATCH)) for _ in range(PER_EPOCH)]


@pytest.mark.parametrize("check", checks())
def test_barlow_twins_with_in_place_ops_on_the_correlation_and_lars(check):
    compare(make_model, barlow_hand, BarlowTwinsTrainer, lambda model: views(), check, steps=EPOCHS * PER_EPOCH,
            max_epochs=EPOCHS, precision="16")
