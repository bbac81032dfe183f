"""Learned task weights for a multi-task loss: Mikoto10032/AutomaticWeightedLoss
(40b15304762d2ca41e4ea90ceb0517c23cd4fe12), ``AutomaticWeightedLoss.py`` (verbatim) and the README's complete
example (Liebel and Koerner's form of Kendall et al.'s uncertainty weighting).

The weights are a ``Parameter`` of a loss module that is no part of the model (``awl``), trained by the model's
optimizer in a parameter group of its own (``{'params': awl.parameters(), 'weight_decay': 0}``). The weighted sum
starts as the Python int ``loss_sum = 0`` and adds ``0.5 / params[i] ** 2 * loss_i + log(1 + params[i] ** 2)``; one
backward, one Adam step.

The README leaves ``Model``, the two losses and the data out: here a shared trunk with a regression and a
classification head (MSE and cross-entropy), 3 epochs of 2 fixed batches; the model's group given a weight decay
(the README's default, 0, would make the second group's ``weight_decay: 0`` change nothing).

The port keeps ``awl`` on the Trainer, made in ``configure_optimizers`` with the optimizer, as a Lightning port keeps
it on its module; ``modules()`` returns it so that checkpoints hold it. A second case resumes the port midway.
"""

import pytest
import torch
import torch.nn as nn
from torch import optim

from safeloop import Trainer

from .harness import assert_same, checks, compare
from .test_resume_ports import straight_and_resumed


# -- AutomaticWeightedLoss.py -------------------------------------------------------------------------------------
class AutomaticWeightedLoss(nn.Module):
    """automatically weighted multi-task loss

    Params：
        num: int，the number of loss
        x: multi-task loss
    Examples：
        loss1=1
        loss2=2
        awl = AutomaticWeightedLoss(2)
        loss_sum = awl(loss1, loss2)
    """
    def __init__(self, num=2):
        super(AutomaticWeightedLoss, self).__init__()
        params = torch.ones(num, requires_grad=True)
        self.params = torch.nn.Parameter(params)

    def forward(self, *x):
        loss_sum = 0
        for i, loss in enumerate(x):
            loss_sum += 0.5 / (self.params[i] ** 2) * loss + torch.log(1 + self.params[i] ** 2)
        return loss_sum


# -- README.md, "A complete example" ------------------------------------------------------------------------------
EPOCHS, LR, WD = 3, 0.05, 1e-2


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.trunk = nn.Sequential(nn.Linear(4, 8), nn.ReLU())
        self.head1, self.head2 = nn.Linear(8, 1), nn.Linear(8, 3)

    def forward(self, x):
        h = self.trunk(x)
        return self.head1(h).squeeze(1), self.head2(h)


loss_1, loss_2 = nn.MSELoss(), nn.CrossEntropyLoss()


def make_optimizer(model, awl):
    return optim.Adam([
        {'params': model.parameters()},
        {'params': awl.parameters(), 'weight_decay': 0}
    ], lr=LR, weight_decay=WD)


class Data:
    """The batches (data, label1, label2); ``awl`` is where a run leaves its loss module."""

    def __init__(self):
        gen = torch.Generator().manual_seed(3)
        self.batches = [(torch.randn(8, 4, generator=gen), torch.randn(8, generator=gen),
                         torch.randint(3, (8,), generator=gen)) for _ in range(2)]
        self.awl = None

    def __iter__(self):
        return iter(self.batches)

    def __len__(self):
        return len(self.batches)


def awl_hand(model, data_loader):
    awl = AutomaticWeightedLoss(2)  # we have 2 losses
    optimizer = make_optimizer(model, awl)

    for i in range(EPOCHS):
        for data, label1, label2 in data_loader:
            # forward
            pred1, pred2 = model(data)
            # calculate losses
            loss1 = loss_1(pred1, label1)
            loss2 = loss_2(pred2, label2)
            # weigh losses
            loss_sum = awl(loss1, loss2)
            # backward
            optimizer.zero_grad()
            loss_sum.backward()
            optimizer.step()
    data_loader.awl = awl


class AWLTrainer(Trainer):
    def configure_optimizers(self):
        self.awl = AutomaticWeightedLoss(2)
        return make_optimizer(self.model, self.awl)

    def training_step(self, batch):
        data, label1, label2 = batch
        pred1, pred2 = self.model(data)
        return self.awl(loss_1(pred1, label1), loss_2(pred2, label2))

    def modules(self):
        return {**super().modules(), "awl": self.awl}

    def on_fit_end(self):
        self.train_data.awl = self.awl


@pytest.mark.parametrize("check", checks())
def test_uncertainty_weighted_losses_with_the_weights_in_a_loss_module(check):
    runs = []

    def data(model):
        runs.append(Data())
        return runs[-1]
    compare(Model, awl_hand, AWLTrainer, data, check, steps=EPOCHS * 2)
    hand, watched, port = (run.awl for run in runs)
    assert_same(watched, hand)
    assert_same(port, hand)
    assert not torch.equal(hand.params, torch.ones(2)), "the task weights were not trained"


class UnsavedAWLTrainer(AWLTrainer):
    """``awl`` kept on the Trainer only: its parameter is one the optimizer trains outside the modules."""

    def modules(self):
        return super(AWLTrainer, self).modules()


@pytest.mark.filterwarnings("error")
@pytest.mark.parametrize("port", [AWLTrainer, UnsavedAWLTrainer])
def test_uncertainty_weighting_resumed_midway(tmp_path, port):
    straight, resumed = straight_and_resumed(tmp_path, Model, port, lambda model: Data(), EPOCHS * 2, 3)
    assert_same(resumed.model, straight.model)
    assert_same(resumed.awl, straight.awl)
