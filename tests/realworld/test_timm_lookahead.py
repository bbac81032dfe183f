"""timm's Lookahead optimizer wrapper: huggingface/pytorch-image-models (timm 1.0.31), timm/optim/lookahead.py
(``Lookahead``), with the end of train.py's ``train_one_epoch`` (``optimizer.sync_lookahead()`` after each epoch).

``Lookahead`` subclasses ``Optimizer`` without calling its ``__init__``: it shares the base AdamW's
``param_groups`` and ``defaults`` (adding its own keys to both) and sets the step-hook dicts itself. So its
``step`` is wrapped by PyTorch's step hooks (once ``zero_grad`` has patched the class), and the base optimizer's
``step`` inside it is wrapped too: the global pre- and post-step hooks run nested. Every ``k`` steps, under
``no_grad``, each parameter's slow copy (kept in the *base* optimizer's state, beside Adam's moments) moves toward
it and the parameter is overwritten with it (``fast_p.copy_(slow)``); ``sync_lookahead`` does that once more at
each epoch's end, outside any step.

Changes for a seconds-long test: a BatchNorm classifier, 2 epochs of 4 batches, ``k`` 3 (6); AdamW in timm's two
weight-decay groups (no decay on 1-D parameters: ``param_groups_weight_decay`` without its fallback lists);
train.py's loop reduced to its forward, ``zero_grad``, backward and step (no AMP, EMA, schedulers or logging).

The port gives the Trainer the Lookahead and calls ``sync_lookahead`` in ``on_epoch_end``, where the last update's
gradients are still there, as in the hand-written loop (``update_slow`` skips a parameter whose ``.grad`` is None).
"""
from collections import OrderedDict, defaultdict
from typing import Callable, Dict

import pytest
import torch
from torch import nn
from torch.optim.optimizer import Optimizer

from safeloop import Trainer

from .harness import bn_classifier, checks, compare, fixed, labelled

EPOCHS, BATCHES, LR, WEIGHT_DECAY, ALPHA, K = 2, 4, 1e-2, 0.05, 0.5, 3


# -- timm/optim/lookahead.py --------------------------------------------------------------------------------
class Lookahead(Optimizer):
    def __init__(self, base_optimizer, alpha=0.5, k=6):
        # NOTE super().__init__() not called on purpose
        self._optimizer_step_pre_hooks: Dict[int, Callable] = OrderedDict()
        self._optimizer_step_post_hooks: Dict[int, Callable] = OrderedDict()
        if not 0.0 <= alpha <= 1.0:
            raise ValueError(f'Invalid slow update rate: {alpha}')
        if not 1 <= k:
            raise ValueError(f'Invalid lookahead steps: {k}')
        defaults = dict(lookahead_alpha=alpha, lookahead_k=k, lookahead_step=0)
        self._base_optimizer = base_optimizer
        self.param_groups = base_optimizer.param_groups
        self.defaults = base_optimizer.defaults
        self.defaults.update(defaults)
        self.state = defaultdict(dict)
        # manually add our defaults to the param groups
        for name, default in defaults.items():
            for group in self._base_optimizer.param_groups:
                group.setdefault(name, default)

    @property
    def is_second_order(self):
        return getattr(self._base_optimizer, 'is_second_order', False)

    @torch.no_grad()
    def update_slow(self, group):
        for fast_p in group["params"]:
            if fast_p.grad is None:
                continue
            param_state = self._base_optimizer.state[fast_p]
            if 'lookahead_slow_buff' not in param_state:
                param_state['lookahead_slow_buff'] = torch.empty_like(fast_p)
                param_state['lookahead_slow_buff'].copy_(fast_p)
            slow = param_state['lookahead_slow_buff']
            slow.add_(fast_p - slow, alpha=group['lookahead_alpha'])
            fast_p.copy_(slow)

    def sync_lookahead(self):
        for group in self._base_optimizer.param_groups:
            self.update_slow(group)

    @torch.no_grad()
    def step(self, closure=None):
        loss = self._base_optimizer.step(closure)
        for group in self._base_optimizer.param_groups:
            group['lookahead_step'] += 1
            if group['lookahead_step'] % group['lookahead_k'] == 0:
                self.update_slow(group)
        return loss

    def state_dict(self):
        return self._base_optimizer.state_dict()

    def load_state_dict(self, state_dict):
        self._base_optimizer.load_state_dict(state_dict)
        self.param_groups = self._base_optimizer.param_groups
        # state_dict may be from a base optimizer w/o lookahead, ensure lookahead group keys are present
        for name in ('lookahead_alpha', 'lookahead_k', 'lookahead_step'):
            for group in self.param_groups:
                group.setdefault(name, self.defaults[name])


# -- timm/optim/_param_groups.py (param_groups_weight_decay, reduced) and create_optimizer_v2('lookahead_adamw')
def param_groups_weight_decay(model, weight_decay=1e-5):
    decay, no_decay = [], []
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        if param.ndim <= 1 or name.endswith(".bias"):
            no_decay.append(param)
        else:
            decay.append(param)
    return [{'params': no_decay, 'weight_decay': 0.}, {'params': decay, 'weight_decay': weight_decay}]


def lookahead_adamw(model):
    base = torch.optim.AdamW(param_groups_weight_decay(model, WEIGHT_DECAY), lr=LR)
    return Lookahead(base, alpha=ALPHA, k=K)


# -- train.py (train_one_epoch, reduced) --------------------------------------------------------------------
def timm_hand(model, loader):
    optimizer = lookahead_adamw(model)
    loss_fn = nn.CrossEntropyLoss()
    for epoch in range(EPOCHS):
        model.train()
        for batch_idx, (input, target) in enumerate(loader):
            output = model(input)
            loss = loss_fn(output, target)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        if hasattr(optimizer, 'sync_lookahead'):
            optimizer.sync_lookahead()


class LookaheadTrainer(Trainer):
    def configure_optimizers(self):
        return lookahead_adamw(self.model)

    def training_step(self, batch):
        input, target = batch
        return nn.functional.cross_entropy(self.model(input), target)

    def on_epoch_end(self):
        optimizer = self.optimizers["optimizer"]
        if hasattr(optimizer, 'sync_lookahead'):
            optimizer.sync_lookahead()


@pytest.mark.parametrize("check", checks())
def test_timm_lookahead_with_nested_optimizer_steps_and_an_epoch_end_sync(check):
    compare(bn_classifier, timm_hand, LookaheadTrainer, fixed(labelled(BATCHES)), check, steps=EPOCHS * BATCHES)
