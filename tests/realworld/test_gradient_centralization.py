"""Gradient centralization inside a custom optimizer: Yonghongwei/Gradient-Centralization at commit
57f57295f07799a242c99cae0ecb14a588354f18, algorithm-GC/algorithm/Centralization.py (``centralized_gradient``) and
algorithm-GC/algorithm/Adam.py (``AdamW``).

``AdamW.step`` (under ``torch.no_grad``) takes ``grad = p.grad`` and, with ``gc_loc=True`` (its default), centralizes
it *in place* (``x.add_(-x.mean(dim=...))`` on every gradient of more than one dimension): the parameters'
``.grad`` tensors are changed by the optimizer itself, after the backward that made them, before the moments read
them; biases keep theirs. Decoupled weight decay through ``.add(p.data, alpha=...)``; ``p.add_`` for the update.
The loop is the plain one of algorithm-GC/cifar/main.py: ``zero_grad``, forward, cross-entropy, ``backward``,
``step``; here with clipping by norm before the step, the usual companion, so that the Trainer's clip
(``grad_clip``) runs on the gradients the optimizer then edits.

Changes for a seconds-long test: a small conv net with BatchNorm over 3x6x6 images, 3 classes, batches of 4,
5 steps; ``use_gc=True``.

The port is the default ``training_step`` with the source's optimizer and ``grad_clip``; a second test runs it
with ``on_nonfinite="error"`` too (the finite check reads the gradients before the optimizer centralizes them).
"""
import math
from functools import partial

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.optim.optimizer import Optimizer

from safeloop import Trainer

from .harness import checks, compare, fixed

CLASSES, BATCH, STEPS, LR, CLIP = 3, 4, 5, 1e-2, 1.0


# -- algorithm-GC/algorithm/Centralization.py ------------------------------------------------------------------
def centralized_gradient(x, use_gc=True, gc_conv_only=False):
    if use_gc:
        if gc_conv_only:
            if len(list(x.size())) > 3:
                x.add_(-x.mean(dim=tuple(range(1, len(list(x.size())))), keepdim=True))
        else:
            if len(list(x.size())) > 1:
                x.add_(-x.mean(dim=tuple(range(1, len(list(x.size())))), keepdim=True))
    return x


# -- algorithm-GC/algorithm/Adam.py ----------------------------------------------------------------------------
class AdamW(Optimizer):
    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8,
                 weight_decay=1e-2, amsgrad=False, use_gc=False, gc_conv_only=False, gc_loc=True):
        if not 0.0 <= lr:
            raise ValueError("Invalid learning rate: {}".format(lr))
        if not 0.0 <= eps:
            raise ValueError("Invalid epsilon value: {}".format(eps))
        if not 0.0 <= betas[0] < 1.0:
            raise ValueError("Invalid beta parameter at index 0: {}".format(betas[0]))
        if not 0.0 <= betas[1] < 1.0:
            raise ValueError("Invalid beta parameter at index 1: {}".format(betas[1]))
        if not 0.0 <= weight_decay:
            raise ValueError("Invalid weight_decay value: {}".format(weight_decay))
        defaults = dict(lr=lr, betas=betas, eps=eps,
                        weight_decay=weight_decay, amsgrad=amsgrad)
        super(AdamW, self).__init__(params, defaults)
        self.gc_loc = gc_loc
        self.use_gc = use_gc
        self.gc_conv_only = gc_conv_only

    def __setstate__(self, state):
        super(AdamW, self).__setstate__(state)
        for group in self.param_groups:
            group.setdefault('amsgrad', False)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()

        for group in self.param_groups:
            for p in group['params']:
                if p.grad is None:
                    continue

                # Perform optimization step
                grad = p.grad
                if grad.is_sparse:
                    raise RuntimeError('AdamW does not support sparse gradients')
                amsgrad = group['amsgrad']

                state = self.state[p]

                # State initialization
                if len(state) == 0:
                    state['step'] = 0
                    # Exponential moving average of gradient values
                    state['exp_avg'] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    # Exponential moving average of squared gradient values
                    state['exp_avg_sq'] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    if amsgrad:
                        # Maintains max of all exp. moving avg. of sq. grad. values
                        state['max_exp_avg_sq'] = torch.zeros_like(p, memory_format=torch.preserve_format)

                exp_avg, exp_avg_sq = state['exp_avg'], state['exp_avg_sq']
                if amsgrad:
                    max_exp_avg_sq = state['max_exp_avg_sq']
                beta1, beta2 = group['betas']

                state['step'] += 1
                bias_correction1 = 1 - beta1 ** state['step']
                bias_correction2 = 1 - beta2 ** state['step']
                if self.gc_loc:
                    grad = centralized_gradient(grad, use_gc=self.use_gc, gc_conv_only=self.gc_conv_only)

                # Decay the first and second moment running average coefficient
                exp_avg.mul_(beta1).add_(grad, alpha=1 - beta1)
                exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
                if amsgrad:
                    # Maintains the maximum of all 2nd moment running avg. till now
                    torch.max(max_exp_avg_sq, exp_avg_sq, out=max_exp_avg_sq)
                    # Use the max. for normalizing running avg. of gradient
                    denom = (max_exp_avg_sq.sqrt() / math.sqrt(bias_correction2)).add_(group['eps'])
                else:
                    denom = (exp_avg_sq.sqrt() / math.sqrt(bias_correction2)).add_(group['eps'])

                step_size = group['lr'] / bias_correction1

                # GC operation and stepweight decay
                G_grad = (exp_avg / denom).add(p.data, alpha=group['weight_decay'])
                if self.gc_loc == False:  # noqa: E712 (the source's)
                    G_grad = centralized_gradient(G_grad, use_gc=self.use_gc, gc_conv_only=self.gc_conv_only)

                p.add_(G_grad, alpha=-step_size)

        return loss


def make_net():
    return nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(), nn.Linear(64, CLASSES))


def gc_hand(model, batches):
    optimizer = AdamW(model.parameters(), lr=LR, use_gc=True)
    model.train()
    for inputs, targets in batches:
        optimizer.zero_grad()
        outputs = model(inputs)
        loss = F.cross_entropy(outputs, targets)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        optimizer.step()
    gc_hand.centred = [p.grad.mean(dim=tuple(range(1, p.dim()))).abs().max() for p in model.parameters()
                       if p.dim() > 1]


def images(seed=6):
    gen = torch.Generator().manual_seed(seed)
    return [(torch.randn(BATCH, 3, 6, 6, generator=gen), torch.randint(CLASSES, (BATCH,), generator=gen))
            for _ in range(STEPS)]


class GCTrainer(Trainer):
    def training_step(self, batch):
        inputs, targets = batch
        return F.cross_entropy(self.model(inputs), targets)


@pytest.mark.parametrize("check", checks())
def test_gradient_centralization_edits_grads_in_place_inside_the_optimizer(check):
    compare(make_net, gc_hand, GCTrainer, fixed(images()), check, steps=STEPS,
            optimizer=partial(AdamW, lr=LR, use_gc=True), grad_clip=CLIP)
    assert all(m < 1e-6 for m in gc_hand.centred)  # the optimizer left the weights' gradients centred


@pytest.mark.parametrize("check", checks())
def test_gradient_centralization_with_a_non_finite_policy(check):
    compare(make_net, gc_hand, GCTrainer, fixed(images()), check, steps=STEPS,
            optimizer=partial(AdamW, lr=LR, use_gc=True), grad_clip=CLIP, on_nonfinite="error")
