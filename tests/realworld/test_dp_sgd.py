"""Differentially private SGD with per-sample gradients from function transforms: pytorch/functorch,
examples/dp_cifar10/cifar10_transforms.py (``train`` and ``clip_and_accumulate_and_add_noise``).

No ``loss.backward()`` anywhere: ``vmap(grad_and_value(...))`` gives one gradient per sample, each is
clipped to a norm, they are summed, Gaussian noise is added, and the result is assigned to
``param.grad`` by hand before ``optimizer.step()``. The source's ResNet-18 has its BatchNorm turned
into GroupNorm (DP forbids statistics over the batch); here a tiny conv net with GroupNorm."""
import numpy as np
import pytest
import torch
import torch.nn as nn
from torch.func import functional_call, grad_and_value, vmap

from safeloop import Trainer

from .harness import batches, checks, compare, fixed

# -c and --sigma: the source's defaults are 1.0 and 1.0; this net's per-sample gradient norms lie
# around 1.5-1.8, so a bound among them clips some samples and leaves others as they are
MAX_PER_SAMPLE_GRAD_NORM, SIGMA = 1.65, 1.0


def conv_net():
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.GroupNorm(2, 8), nn.ReLU(),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 10))


def images_and_targets(n):
    gen = torch.Generator().manual_seed(5)
    return [(x, torch.randint(10, (8,), generator=gen)) for x in batches(n, (8, 3, 8, 8))]


def adam(params):
    return torch.optim.Adam(params, lr=0.001)  # the source's default --optim and --lr


def accuracy(preds, labels):
    return (preds == labels).mean()


def compute_norms(sample_grads):
    batch_size = sample_grads[0].shape[0]
    norms = [sample_grad.view(batch_size, -1).norm(2, dim=-1) for sample_grad in sample_grads]
    norms = torch.stack(norms, dim=0).norm(2, dim=0)
    return norms


def clip_and_accumulate_and_add_noise(model, max_per_sample_grad_norm=1.0, noise_multiplier=1.0):
    sample_grads = tuple(param.grad_sample for param in model.parameters())

    # step 0: compute the norms
    sample_norms = compute_norms(sample_grads)

    # step 1: compute clipping factors
    clip_factor = max_per_sample_grad_norm / (sample_norms + 1e-6)
    clip_factor = clip_factor.clamp(max=1.0)

    # step 2: clip
    grads = tuple(torch.einsum('i,i...', clip_factor, sample_grad) for sample_grad in sample_grads)

    # step 3: add gaussian noise (torch's global RNG: both loops draw the same noise)
    stddev = max_per_sample_grad_norm * noise_multiplier
    noises = tuple(torch.normal(0, stddev, grad_param.shape, device=grad_param.device) for grad_param in grads)
    grads = tuple(noise + grad_param for noise, grad_param in zip(noises, grads))

    # step 4: assign the new grads, delete the sample grads
    for param, param_grad in zip(model.parameters(), grads):
        param.grad = param_grad
        del param.grad_sample


def private_gradients(model, images, target):
    """``train``'s steps 1 and 2: per-sample gradients, then clipped, summed and noised onto ``p.grad``.

    The source's ``func_model, weights = make_functional(model)`` (functorch, deprecated since
    PyTorch 2.0) is written as the torch.func migration guide replaces it: ``functional_call`` over
    ``dict(model.named_parameters())``. The weights stay tracked by ordinary autograd, as with
    make_functional's default, so the loss comes back with a graph, here down to the model's own
    parameters (make_functional's led to copies of them), that nothing ever back-propagates."""
    criterion = nn.CrossEntropyLoss()
    weights = dict(model.named_parameters())

    def compute_loss_and_output(weights, image, target):
        images = image.unsqueeze(0)
        targets = target.unsqueeze(0)
        output = functional_call(model, weights, (images,))
        loss = criterion(output, targets)
        return loss, output.squeeze(0)

    grads_loss_output = grad_and_value(compute_loss_and_output, has_aux=True)
    sample_grads, (sample_loss, output) = vmap(grads_loss_output, (None, 0, 0))(weights, images, target)
    loss = sample_loss.mean()

    for grad_sample, weight in zip(sample_grads.values(), model.parameters()):
        weight.grad_sample = grad_sample.detach()

    clip_and_accumulate_and_add_noise(model, MAX_PER_SAMPLE_GRAD_NORM, SIGMA)

    preds = np.argmax(output.detach().cpu().numpy(), axis=1)
    labels = target.detach().cpu().numpy()
    return loss, accuracy(preds, labels)


def dp_hand(model, data):
    optimizer = adam(model.parameters())
    model.train()
    losses, top1_acc = [], []
    for images, target in data:  # n_accumulation_steps=1: a step after every batch
        loss, acc1 = private_gradients(model, images, target)
        losses.append(loss.item())
        top1_acc.append(acc1)
        optimizer.step()
        optimizer.zero_grad()


class DPSGD(Trainer):
    """Manual mode: the gradients are put on the parameters by hand, with no backward at all, and
    ``self.step()`` steps the optimizer and clears them. The loss is returned only to be logged."""

    automatic = False

    def training_step(self, batch):
        loss, acc1 = private_gradients(self.model, *batch)
        self.step()
        return loss


@pytest.mark.parametrize("check", checks())
def test_dp_sgd_with_per_sample_gradients(check):
    compare(conv_net, dp_hand, DPSGD, fixed(images_and_targets(5)), check, steps=5, optimizer=adam)


# The non-finite check and the undo snapshot look at gradients no self.backward made: they must
# neither stop this finite run nor change its update.
@pytest.mark.parametrize("policy", [{"on_nonfinite": "error"}, {"undo": "full"}], ids=["nonfinite_error", "undo_full"])
@pytest.mark.parametrize("check", checks())
def test_dp_sgd_with_per_sample_gradients_under_policy(check, policy):
    compare(conv_net, dp_hand, DPSGD, fixed(images_and_targets(5)), check, steps=5, optimizer=adam, **policy)
