"""Several models, losses and optimizers with one GradScaler: pytorch/pytorch at commit
af616bb641d3825cc8216e583f2918912cc77103, docs/source/notes/amp_examples.rst ("Working with Multiple Models, Losses,
and Optimizers"): two models, two losses that each mix both outputs (``2 * output0 + 3 * output1`` and
``3 * output0 - 5 * output1``), ``scaler.scale(loss0).backward(retain_graph=True)`` and
``scaler.scale(loss1).backward()``, ``scaler.unscale_(optimizer0)`` alone (to inspect its gradients), then
``scaler.step`` for each optimizer and one ``scaler.update()``. If either optimizer's gradients hold an inf or a
NaN, the scaler skips that optimizer's step only, and the scale halves.

Changes for a seconds-long test: ``model0`` and ``model1`` two-layer MLPs of width 8 on 4 features, ``mse_loss``
for ``loss_fn``, SGD for both optimizers (momentum on one), 6 random batches of 8, the first drawn 1000 times wider
(so that its gradients overflow at the initial scale); the CPU: ``autocast(device_type='cpu', dtype=torch.float16)``
and ``torch.amp.GradScaler("cpu")``; ``optimizer0.zero_grad()`` and ``optimizer1.zero_grad()`` at the top of the
loop, as the example writes them.

The port: manual mode under ``precision="16-mixed"``. ``self.backward`` routes a loss into one optimizer's
parameters, so each loss is back-propagated once per optimizer (the first three retaining the graph); each
parameter sums the two losses' gradients in the same order as the example's two backwards. The Trainer unscales
every optimizer before its step (the example unscales ``optimizer0`` by hand and lets ``scaler.step`` unscale
``optimizer1``: the same gradients) and updates the scaler once per step.
"""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from safeloop import Trainer

from .harness import checks, compare_runs

BATCHES = 6


def mlp():
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))


class Models(nn.Module):
    def __init__(self):
        super().__init__()
        self.model0, self.model1 = mlp(), mlp()


loss_fn = F.mse_loss


class Data(list):
    def __init__(self):
        gen = torch.Generator().manual_seed(17)
        super().__init__((torch.randn(8, 4, generator=gen) * (1000 if i == 0 else 1), torch.randn(8, 2, generator=gen))
                         for i in range(BATCHES))
        self.scales = []


def make_optimizers(models):
    return (torch.optim.SGD(models.model0.parameters(), lr=0.05, momentum=0.9),
            torch.optim.SGD(models.model1.parameters(), lr=0.05))


def amp_examples_hand(models, data):
    model0, model1 = models.model0, models.model1
    optimizer0, optimizer1 = make_optimizers(models)
    scaler = torch.amp.GradScaler("cpu")
    for input, target in data:
        optimizer0.zero_grad()
        optimizer1.zero_grad()
        with torch.autocast(device_type='cpu', dtype=torch.float16):
            output0 = model0(input)
            output1 = model1(input)
            loss0 = loss_fn(2 * output0 + 3 * output1, target)
            loss1 = loss_fn(3 * output0 - 5 * output1, target)

        # (retain_graph here is unrelated to amp, it's present because in this
        # example, both backward() calls share some sections of graph.)
        scaler.scale(loss0).backward(retain_graph=True)
        scaler.scale(loss1).backward()

        # You can choose which optimizers receive explicit unscaling, if you
        # want to inspect or modify the gradients of the params they own.
        scaler.unscale_(optimizer0)

        scaler.step(optimizer0)
        scaler.step(optimizer1)

        scaler.update()
        data.scales.append(scaler.get_scale())


class TwoModels(Trainer):
    automatic = False

    def configure_optimizers(self):
        optimizer0, optimizer1 = make_optimizers(self.model)
        return {"0": optimizer0, "1": optimizer1}

    def training_step(self, batch):
        input, target = batch
        output0 = self.model.model0(input)
        output1 = self.model.model1(input)
        loss0 = loss_fn(2 * output0 + 3 * output1, target)
        loss1 = loss_fn(3 * output0 - 5 * output1, target)
        self.backward(loss0, optimizer="0", retain_graph=True)
        self.backward(loss0, optimizer="1", retain_graph=True)
        self.backward(loss1, optimizer="0", retain_graph=True)
        self.backward(loss1, optimizer="1")
        self.step("0")
        self.step("1")
        return {"loss0": loss0, "loss1": loss1}

    def on_step_end(self, losses):
        self.train_data.scales.append(self.scaler.get_scale())


@pytest.mark.parametrize("check", checks())
def test_two_models_two_losses_two_optimizers_one_scaler(check):
    runs = compare_runs(Models, amp_examples_hand, TwoModels, Data, check, steps=BATCHES, precision="16-mixed")
    hand, watched, port = (run.scales for run in runs)
    assert watched == hand and port == hand
    assert hand[0] == 2.0 ** 15, hand
