"""Gradient surgery for multi-task learning (PCGrad): WeiChengTseng/Pytorch-PCGrad at commit
e987ac603fa1accd386820a985a6dc2fd92dec5b, pcgrad.py (``PCGrad``), main_multi_mnist.py (the loop) and
net/lenet.py (``MultiLeNetR``, ``MultiLeNetO``).

``PCGrad`` wraps Adam. ``pc_backward(losses)`` back-propagates each task's loss on its own through the shared
graph (``zero_grad(set_to_none=True)``, ``obj.backward(retain_graph=True)``), copies every parameter's
gradient out (zeros where a head got none), projects each task's gradient off the others' when they
conflict (in an order shuffled by Python's ``random``), merges them (mean on the parameters both tasks reach,
sum on the rest) and assigns the result to every parameter's ``.grad``; then ``step()``. The networks draw
their own dropout masks with ``torch.bernoulli`` (always, even in eval mode, where they are not applied):
one channel mask in the shared trunk, one per head. Every epoch ends with a validation pass in eval mode.

Changes for a seconds-long test: 2 epochs of 3 batches of 4 random 28x28 images with two labels each
(MultiMNIST: 100 epochs of 256), one validation batch of 4 (100); no CUDA; the logger left out.

The port is manual: ``pc_backward`` as it is, inside ``training_step`` (its own ``backward`` calls write only
gradients it then replaces), then ``self.step()``; ``on_epoch_start`` puts the nets in train mode,
``on_epoch_end`` validates.
"""
import copy
import random
import warnings

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.autograd import Variable

from safeloop import Trainer

from .harness import assert_same, checks, compare

LR, BATCH, PER_EPOCH, EPOCHS = 0.0005, 4, 3, 2
DEVICE = 'cpu'


# -- pcgrad.py ----------------------------------------------------------------------------------------------
class PCGrad():
    def __init__(self, optimizer, reduction='mean'):
        self._optim, self._reduction = optimizer, reduction
        return

    @property
    def optimizer(self):
        return self._optim

    def zero_grad(self):
        return self._optim.zero_grad(set_to_none=True)

    def step(self):
        return self._optim.step()

    def pc_backward(self, objectives):
        grads, shapes, has_grads = self._pack_grad(objectives)
        pc_grad = self._project_conflicting(grads, has_grads)
        pc_grad = self._unflatten_grad(pc_grad, shapes[0])
        self._set_grad(pc_grad)
        return

    def _project_conflicting(self, grads, has_grads, shapes=None):
        shared = torch.stack(has_grads).prod(0).bool()
        pc_grad, num_task = copy.deepcopy(grads), len(grads)
        for g_i in pc_grad:
            random.shuffle(grads)
            for g_j in grads:
                g_i_g_j = torch.dot(g_i, g_j)
                if g_i_g_j < 0:
                    g_i -= (g_i_g_j) * g_j / (g_j.norm()**2)
        merged_grad = torch.zeros_like(grads[0]).to(grads[0].device)
        if self._reduction:
            merged_grad[shared] = torch.stack([g[shared]
                                               for g in pc_grad]).mean(dim=0)
        elif self._reduction == 'sum':
            merged_grad[shared] = torch.stack([g[shared]
                                               for g in pc_grad]).sum(dim=0)
        else:
            exit('invalid reduction method')

        merged_grad[~shared] = torch.stack([g[~shared]
                                            for g in pc_grad]).sum(dim=0)
        return merged_grad

    def _set_grad(self, grads):
        idx = 0
        for group in self._optim.param_groups:
            for p in group['params']:
                # if p.grad is None: continue
                p.grad = grads[idx]
                idx += 1
        return

    def _pack_grad(self, objectives):
        grads, shapes, has_grads = [], [], []
        for obj in objectives:
            self._optim.zero_grad(set_to_none=True)
            obj.backward(retain_graph=True)
            grad, shape, has_grad = self._retrieve_grad()
            grads.append(self._flatten_grad(grad, shape))
            has_grads.append(self._flatten_grad(has_grad, shape))
            shapes.append(shape)
        return grads, shapes, has_grads

    def _unflatten_grad(self, grads, shapes):
        unflatten_grad, idx = [], 0
        for shape in shapes:
            length = np.prod(shape)
            unflatten_grad.append(grads[idx:idx + length].view(shape).clone())
            idx += length
        return unflatten_grad

    def _flatten_grad(self, grads, shapes):
        flatten_grad = torch.cat([g.flatten() for g in grads])
        return flatten_grad

    def _retrieve_grad(self):
        grad, shape, has_grad = [], [], []
        for group in self._optim.param_groups:
            for p in group['params']:
                # if p.grad is None: continue
                # tackle the multi-head scenario
                if p.grad is None:
                    shape.append(p.shape)
                    grad.append(torch.zeros_like(p).to(p.device))
                    has_grad.append(torch.zeros_like(p).to(p.device))
                    continue
                shape.append(p.grad.shape)
                grad.append(p.grad.clone())
                has_grad.append(torch.ones_like(p).to(p.device))
        return grad, shape, has_grad


# -- net/lenet.py -------------------------------------------------------------------------------------------
class MultiLeNetR(nn.Module):
    def __init__(self):
        super(MultiLeNetR, self).__init__()
        self._conv1 = nn.Conv2d(1, 10, kernel_size=5)
        self._conv2 = nn.Conv2d(10, 20, kernel_size=5)
        self._conv2_drop = nn.Dropout2d()
        self._fc = nn.Linear(320, 50)

    def dropout2dwithmask(self, x, mask):
        channel_size = x.shape[1]
        if mask is None:
            mask = Variable(
                torch.bernoulli(torch.ones(1, channel_size, 1, 1) *
                                0.5).to(x.device))
        mask = mask.expand(x.shape)
        return mask

    def forward(self, x, mask):
        x = F.relu(F.max_pool2d(self._conv1(x), 2))
        x = self._conv2(x)
        mask = self.dropout2dwithmask(x, mask)
        if self.training:
            x = x * mask
        x = F.relu(F.max_pool2d(x, 2))
        x = x.view(-1, 320)
        x = F.relu(self._fc(x))
        return x, mask


class MultiLeNetO(nn.Module):
    def __init__(self):
        super(MultiLeNetO, self).__init__()
        self._fc1, self._fc2 = nn.Linear(50, 50), nn.Linear(50, 10)
        return

    def forward(self, x, mask):
        x = F.relu(self._fc1(x))
        if mask is None:
            mask = Variable(
                torch.bernoulli(x.data.new(x.data.size()).fill_(0.5)))
        if self.training:
            x = x * mask
        x = self._fc2(x)
        return F.log_softmax(x, dim=1), mask


# -- main_multi_mnist.py ------------------------------------------------------------------------------------
def make_nets():
    return nn.ModuleDict({
        'rep': MultiLeNetR().to(DEVICE),
        'L': MultiLeNetO().to(DEVICE),
        'R': MultiLeNetO().to(DEVICE)
    })


def make_optimizer(nets):
    param = [p for v in nets.values() for p in list(v.parameters())]
    return torch.optim.Adam(param, lr=LR)


def task_losses(nets, batch):
    mask = None
    img, label_l, label_r = batch
    rep, mask = nets['rep'](img, mask)
    out_l, mask_l = nets['L'](rep, None)
    out_r, mask_r = nets['R'](rep, None)
    return [F.nll_loss(out_l, label_l), F.nll_loss(out_r, label_r)]


def validate(nets, val_loader):
    """The epoch's validation (its losses and accuracies only printed: left out, the forwards kept)."""
    for net in nets.values():
        net.eval()
    for batch in val_loader:
        task_losses(nets, batch)


def pcgrad_hand(nets, data):
    optimizer = make_optimizer(nets)
    optimizer = PCGrad(optimizer)
    for ep in range(EPOCHS):
        for net in nets.values():
            net.train()
        for batch in data:
            optimizer.zero_grad()
            losses = task_losses(nets, batch)
            optimizer.pc_backward(losses)
            # sum(losses).backward()
            optimizer.step()
        validate(nets, data.val)


class PCGradTrainer(Trainer):
    automatic = False

    def configure_optimizers(self):
        optimizer = make_optimizer(self.model)
        self.pcgrad = PCGrad(optimizer)
        return optimizer

    def on_epoch_start(self):
        for net in self.model.values():
            net.train()

    def training_step(self, batch):
        losses = task_losses(self.model, batch)
        self.pcgrad.pc_backward(losses)
        self.step()
        return {"L": losses[0], "R": losses[1]}

    def on_epoch_end(self):
        validate(self.model, self.train_data.val)


class MultiMNIST(list):
    """Fresh for each run: Python's ``random`` (PCGrad's shuffles) seeded with it."""

    def __init__(self):
        random.seed(0)
        gen = torch.Generator().manual_seed(22)

        def batch():
            return (torch.randn(BATCH, 1, 28, 28, generator=gen), torch.randint(10, (BATCH,), generator=gen),
                    torch.randint(10, (BATCH,), generator=gen))
        super().__init__(batch() for _ in range(PER_EPOCH))
        self.val = [batch()]


@pytest.mark.parametrize("check", checks())
def test_pcgrad_with_per_task_backwards_and_projected_gradients(check):
    compare(make_nets, pcgrad_hand, PCGradTrainer, lambda model: MultiMNIST(), check, steps=EPOCHS * PER_EPOCH)


@pytest.mark.parametrize("check", checks())
def test_pcgrad_port_alone(check):
    """The port against the hand loop without ``watch``."""
    torch.manual_seed(0)
    ref = make_nets()
    ours = copy.deepcopy(ref)
    torch.manual_seed(1)
    pcgrad_hand(ref, MultiMNIST())
    torch.manual_seed(1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        PCGradTrainer(model=ours, train_data=MultiMNIST(), max_steps=EPOCHS * PER_EPOCH, device="cpu",
                      progress=False, loggers=(), guard={"check": check}).fit()
    assert_same(ours, ref)
