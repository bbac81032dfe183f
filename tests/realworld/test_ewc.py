"""Elastic weight consolidation (EWC): moskomule/ewc.pytorch at commit 234e64f4452ccafa12b07e0b45b8544bcb2d660a,
utils.py (``EWC``, ``normal_train``, ``ewc_train``) and the order of demo.ipynb (task A trained plainly, then
``EWC`` built from samples of task A, then task B trained with the penalty).

``EWC.__init__`` runs a backward per sample (the model in eval mode, ``model.zero_grad()`` before each) to sum the
squared gradients into the diagonal Fisher, the precision matrices, and keeps the parameters' values as the means:
every later step's loss adds ``importance * ewc.penalty(model)``, a sum over parameters of
``precision * (p - mean) ** 2``. Those backwards run between the two trainings, outside any step and with no
optimizer step after them; their gradients are left on the parameters until ``ewc_train``'s first ``zero_grad``.

Changes for a seconds-long test: a 4-8-3 MLP, batches of 8, 3 steps a task, 4 Fisher samples; ``variable`` does
not move to CUDA; ``epoch_loss += loss.data[0]`` (an ``IndexError`` on a 0-dim tensor since PyTorch 0.5) is
``loss.item()``.

The port is two Trainers, as a user would write it: one fits task A, then ``EWC`` is built from the model, then
a second one, whose ``training_step`` adds the penalty, fits task B.
"""
import copy
import warnings
from copy import deepcopy

import pytest
import torch
import torch.utils.data
from torch import nn
from torch.autograd import Variable
from torch.nn import functional as F

from safeloop import GraphGuard, Trainer
from safeloop.watch import Watch

from .harness import assert_same, checks, labelled, strict

STEPS, IMPORTANCE, LR = 3, 1000.0, 0.1


# -- utils.py ----------------------------------------------------------------------------------------------
def variable(t: torch.Tensor, use_cuda=False, **kwargs):
    if torch.cuda.is_available() and use_cuda:
        t = t.cuda()
    return Variable(t, **kwargs)


class EWC(object):
    def __init__(self, model: nn.Module, dataset: list):

        self.model = model
        self.dataset = dataset

        self.params = {n: p for n, p in self.model.named_parameters() if p.requires_grad}
        self._means = {}
        self._precision_matrices = self._diag_fisher()

        for n, p in deepcopy(self.params).items():
            self._means[n] = variable(p.data)

    def _diag_fisher(self):
        precision_matrices = {}
        for n, p in deepcopy(self.params).items():
            p.data.zero_()
            precision_matrices[n] = variable(p.data)

        self.model.eval()
        for input in self.dataset:
            self.model.zero_grad()
            input = variable(input)
            output = self.model(input).view(1, -1)
            label = output.max(1)[1].view(-1)
            loss = F.nll_loss(F.log_softmax(output, dim=1), label)
            loss.backward()

            for n, p in self.model.named_parameters():
                precision_matrices[n].data += p.grad.data ** 2 / len(self.dataset)

        precision_matrices = {n: p for n, p in precision_matrices.items()}
        return precision_matrices

    def penalty(self, model: nn.Module):
        loss = 0
        for n, p in model.named_parameters():
            _loss = self._precision_matrices[n] * (p - self._means[n]) ** 2
            loss += _loss.sum()
        return loss


def normal_train(model: nn.Module, optimizer: torch.optim, data_loader: torch.utils.data.DataLoader):
    model.train()
    epoch_loss = 0
    for input, target in data_loader:
        input, target = variable(input), variable(target)
        optimizer.zero_grad()
        output = model(input)
        loss = F.cross_entropy(output, target)
        epoch_loss += loss.item()
        loss.backward()
        optimizer.step()
    return epoch_loss / len(data_loader)


def ewc_train(model: nn.Module, optimizer: torch.optim, data_loader: torch.utils.data.DataLoader,
              ewc: EWC, importance: float):
    model.train()
    epoch_loss = 0
    for input, target in data_loader:
        input, target = variable(input), variable(target)
        optimizer.zero_grad()
        output = model(input)
        loss = F.cross_entropy(output, target) + importance * ewc.penalty(model)
        epoch_loss += loss.item()
        loss.backward()
        optimizer.step()
    return epoch_loss / len(data_loader)


# -- demo.ipynb's order, at test size -----------------------------------------------------------------------
def mlp():
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))


def tasks():
    task_a, task_b = labelled(STEPS, seed=4), labelled(STEPS, seed=5)
    old_samples = [x for x in task_a[0][0][:4]]  # single inputs of task A, as demo's ``sample``
    return task_a, task_b, old_samples


def ewc_hand(model, data):
    task_a, task_b, old_samples = data
    optimizer = torch.optim.SGD(params=model.parameters(), lr=LR)
    normal_train(model, optimizer, task_a)
    ewc = EWC(model, old_samples)
    ewc_train(model, optimizer, task_b, ewc, IMPORTANCE)


class EWCTrainer(Trainer):
    ewc: EWC

    def training_step(self, batch):
        input, target = batch
        return F.cross_entropy(self.model(input), target) + IMPORTANCE * self.ewc.penalty(self.model)


@pytest.mark.parametrize("check", checks())
def test_ewc_fisher_between_two_fits_and_penalty_every_step(check):
    torch.manual_seed(0)
    ref = mlp()
    ours, watched, start = copy.deepcopy(ref), copy.deepcopy(ref), copy.deepcopy(ref)
    with warnings.catch_warnings(record=True) as own:
        warnings.simplefilter("always")
        ewc_hand(ref, tasks())
    with strict(own), Watch(GraphGuard(check=check), ewc_hand.__code__.co_filename):  # as harness.compare
        ewc_hand(watched, tasks())
    assert_same(watched, ref)
    task_a, task_b, old_samples = tasks()
    with strict(own):
        optimizer = torch.optim.SGD(params=ours.parameters(), lr=LR)  # one optimizer for both tasks, as the source
        kwargs = dict(device="cpu", progress=False, loggers=(), guard={"check": check}, max_steps=STEPS)
        Trainer(model=ours, train_data=task_a, optimizer=optimizer, loss_fn=F.cross_entropy, **kwargs).fit()
        trainer = EWCTrainer(model=ours, train_data=task_b, optimizer=optimizer, **kwargs)
        trainer.ewc = EWC(ours, old_samples)
        trainer.fit()
    assert trainer.state.step == STEPS
    assert_same(ours, ref)
    assert not torch.equal(ref[0].weight, start[0].weight)
    assert all(p.abs().sum() > 0 for p in trainer.ewc._precision_matrices.values())  # the penalty weighs something
