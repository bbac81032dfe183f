"""A masked loss that returns a constant for a batch with nothing to learn from: neuro-ml/deep_pipe,
dpipe/torch/functional.py at commit a2fbd910f4fa36656bc6279bf6e9bf066e737e12 (``masked_loss``) and
dpipe/torch/model.py at commit 02a609432f1c8ec32126527a24b15dad5e8337e4 (``optimizer_step``, ``train_step``).

``masked_loss`` computes a criterion over the masked voxels only; when a batch's mask is empty (a partially
annotated scan with no labelled voxel in the crop) it returns ``torch.tensor(0., requires_grad=True).to(prediction)``:
a leaf that requires grad (``.to`` to the same dtype and device returns it as it is), with no graph to the model.
``train_step`` back-propagates it like any loss: PyTorch's backward runs (it only sets that leaf's ``.grad``),
no parameter gets a gradient, and Adam skips them all, so the step changes nothing, which is what the code means.

Changes for a seconds-long test: a two-layer convolutional net over 1x4x4 crops, batches of 4, 4 steps, the
second with an empty mask; ``sequence_to_var`` (NumPy to tensors on the model's device) left out, the batches
being tensors; the criterion ``masked_loss`` over ``binary_cross_entropy_with_logits``, with the mask as a second
target (``n_targets=2``); no AMP.

The port returns ``train_step``'s loss from ``training_step``. The guard takes that zero for what it is, a step
with nothing to learn from, as the hand-written loop does, in every mode, under watch and in the port.
"""
from functools import partial
from typing import Callable

import pytest
import torch
from torch.nn import Module, functional
from torch.optim import Optimizer

from safeloop import Trainer

from .harness import checks, compare

STEPS, LR = 4, 1e-2


# -- dpipe/torch/functional.py ------------------------------------------------------------------------------
def masked_loss(mask: torch.Tensor, criterion: Callable, prediction: torch.Tensor, target: torch.Tensor, **kwargs):
    """
    Calculates the ``criterion`` between the masked ``prediction`` and ``target``.
    ``args`` and ``kwargs`` are passed to ``criterion`` as additional arguments.

    If the ``mask`` is empty - returns 0 wrapped in a torch tensor.
    """
    if not mask.any():
        return torch.tensor(0., requires_grad=True).to(prediction)

    return criterion(prediction[mask], target[mask], **kwargs)


# -- dpipe/torch/model.py -----------------------------------------------------------------------------------
def set_params(optimizer, **params):
    for param_group in optimizer.param_groups:
        param_group.update(params)


def optimizer_step(optimizer: Optimizer, loss: torch.Tensor, scaler=None, **params) -> torch.Tensor:
    set_params(optimizer, **params)
    optimizer.zero_grad()
    if scaler is not None:
        raise NotImplementedError("the source's AMP branch is left out: these runs take no GradScaler")
    else:
        loss.backward()
        optimizer.step()

    return loss


def train_step(*inputs, architecture: Module, criterion: Callable, optimizer: Optimizer, n_targets: int = 1,
               loss_key: str = None, scaler=None, **optimizer_params):
    architecture.train()
    if n_targets >= 0:
        n_inputs = len(inputs) - n_targets
    else:
        n_inputs = -n_targets

    assert 0 <= n_inputs <= len(inputs)
    inputs, targets = inputs[:n_inputs], inputs[n_inputs:]

    loss = criterion(architecture(*inputs), *targets)

    optimizer_step(optimizer, loss, scaler=scaler, **optimizer_params)
    return loss.detach().numpy()


def criterion(logits, target, mask):
    return masked_loss(mask, functional.binary_cross_entropy_with_logits, logits, target)


def make_net():
    return torch.nn.Sequential(torch.nn.Conv2d(1, 4, 3, padding=1), torch.nn.ReLU(), torch.nn.Conv2d(4, 1, 1))


def crops(model):
    gen = torch.Generator().manual_seed(2)
    out = []
    for i in range(STEPS):
        x = torch.randn(4, 1, 4, 4, generator=gen)
        target = (torch.rand(4, 1, 4, 4, generator=gen) > 0.5).float()
        mask = torch.rand(4, 1, 4, 4, generator=gen) > (2.0 if i == 1 else 0.5)  # step 2: nothing labelled
        out.append((x, target, mask))
    return out


def dpipe_hand(model, batches):
    optimizer = torch.optim.Adam(model.parameters(), lr=LR)
    for x, target, mask in batches:
        train_step(x, target, mask, architecture=model, criterion=criterion, optimizer=optimizer, n_targets=2)


class MaskedTrainer(Trainer):
    def training_step(self, batch):
        x, target, mask = batch
        return criterion(self.model(x), target, mask)


@pytest.mark.parametrize("check", checks())
def test_masked_loss_with_a_constant_for_an_empty_mask(check):
    compare(make_net, dpipe_hand, MaskedTrainer, crops, check, steps=STEPS,
            optimizer=partial(torch.optim.Adam, lr=LR))


def test_the_empty_step_changes_nothing_by_hand():
    """What the hand-written loop does at the empty step: nothing, as the code means."""
    torch.manual_seed(0)
    model = make_net()
    batches = crops(model)
    optimizer = torch.optim.Adam(model.parameters(), lr=LR)
    x, target, mask = batches[0]
    train_step(x, target, mask, architecture=model, criterion=criterion, optimizer=optimizer, n_targets=2)
    before = [p.clone() for p in model.parameters()]
    x, target, mask = batches[1]
    train_step(x, target, mask, architecture=model, criterion=criterion, optimizer=optimizer, n_targets=2)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert all(p.grad is None for p in model.parameters())
