"""A gradient penalty under float16 autocast with a GradScaler: pytorch/pytorch at commit
af616bb641d3825cc8216e583f2918912cc77103, docs/source/notes/amp_examples.rst ("Gradient penalty"): the gradients
for the penalty taken by ``torch.autograd.grad(outputs=scaler.scale(loss), inputs=model.parameters(),
create_graph=True)``, unscaled by ordinary division (``inv_scale = 1. / scaler.get_scale()``: no optimizer owns
them, so not ``scaler.unscale_``), their norm added to the loss under ``autocast``, then
``scaler.scale(loss).backward()``, ``scaler.step`` and ``scaler.update()``.

Changes for a seconds-long test: an MLP of width 16 with ``Tanh`` (twice differentiable), ``mse_loss`` for
``loss_fn``, SGD, 6 random batches of 8, one epoch; the CPU: ``autocast(device_type='cpu', dtype=torch.float16)``
and ``torch.amp.GradScaler("cpu")``.

The port: automatic mode under ``precision="16-mixed"``; ``training_step`` takes the penalty's gradients through
``self.scaler`` (the Trainer's GradScaler, the one that scales the returned loss) inside the step's autocast region
and returns ``loss + grad_norm``, which the Trainer scales and back-propagates.
"""
import pytest
import torch
import torch.nn.functional as F

from safeloop import Trainer

from .harness import batches, checks, compare, fixed

loss_fn = F.mse_loss
BATCHES = 6


def make_model():
    return torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2))


def penalty_hand(model, data):
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu")
    for input, target in data:
        optimizer.zero_grad()
        with torch.autocast(device_type='cpu', dtype=torch.float16):
            output = model(input)
            loss = loss_fn(output, target)

        # Scales the loss for autograd.grad's backward pass, producing scaled_grad_params
        scaled_grad_params = torch.autograd.grad(outputs=scaler.scale(loss),
                                                 inputs=model.parameters(),
                                                 create_graph=True)

        # Creates unscaled grad_params before computing the penalty. scaled_grad_params are
        # not owned by any optimizer, so ordinary division is used instead of scaler.unscale_:
        inv_scale = 1. / scaler.get_scale()
        grad_params = [p * inv_scale for p in scaled_grad_params]

        # Computes the penalty term and adds it to the loss
        with torch.autocast(device_type='cpu', dtype=torch.float16):
            grad_norm = 0
            for grad in grad_params:
                grad_norm += grad.pow(2).sum()
            grad_norm = grad_norm.sqrt()
            loss = loss + grad_norm

        # Applies scaling to the backward call as usual.
        # Accumulates leaf gradients that are correctly scaled.
        scaler.scale(loss).backward()

        # step() and update() proceed as usual.
        scaler.step(optimizer)
        scaler.update()


class PenaltyPort(Trainer):
    def configure_optimizers(self):
        return torch.optim.SGD(self.model.parameters(), lr=0.01)

    def training_step(self, batch):
        input, target = batch
        output = self.model(input)
        loss = loss_fn(output, target)
        scaled_grad_params = torch.autograd.grad(outputs=self.scaler.scale(loss),
                                                 inputs=list(self.model.parameters()),
                                                 create_graph=True)
        inv_scale = 1. / self.scaler.get_scale()
        grad_params = [p * inv_scale for p in scaled_grad_params]
        grad_norm = 0
        for grad in grad_params:
            grad_norm += grad.pow(2).sum()
        grad_norm = grad_norm.sqrt()
        return loss + grad_norm


@pytest.mark.parametrize("check", checks())
def test_gradient_penalty_through_the_scaled_loss(check):
    compare(make_model, penalty_hand, PenaltyPort, fixed(batches(BATCHES, (8, 4), (8, 2), seed=3)), check,
            steps=BATCHES, precision="16-mixed")
