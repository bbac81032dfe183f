"""Iterative magnitude pruning with ``torch.nn.utils.prune`` and rewinding: VITA-Group/PrAC-LTH at commit
e6ad894c205d136444ba644d7028564bd7990a24, main_imp.py (``main``'s pruning states, ``train``) and utils/pruner.py
(``pruning_model``, ``prune_model_custom``, ``remove_prune``, ``extract_mask``, ``check_sparsity``).

Each pruning state trains every epoch with SGD (momentum, weight decay) and a ``MultiStepLR`` stepped per epoch,
then ``prune.global_unstructured`` takes the 20% smallest convolution weights by L1 over all layers at once: each
Conv2d's ``weight`` parameter becomes ``weight_orig`` and a ``weight_mask`` buffer, and a forward pre-hook sets
``weight = weight_orig * weight_mask`` (a plain attribute, made with a graph at prune time, then anew before every
forward). The masks are copied out of the ``state_dict``, ``prune.remove`` makes ``weight`` a parameter again, the
initial ``state_dict`` (taken before training, ``prune_type='lt'``) is loaded, and ``prune.CustomFromMask`` puts
the masks back; then a new SGD over the new parameters (``weight_orig``) and a new ``MultiStepLR`` stepped
``rewind_epoch`` times before training (learning rate rewinding).

Changes for a seconds-long test: two 3x3 convolutions and a linear head over 1x4x4 inputs, batches of 8,
2 batches an epoch, 2 epochs a state, 3 pruning states, ``decreasing_lr='1'``, ``rewind_epoch=1``; ``.cuda()``,
the printing, plotting, checkpoint files, validation and test passes (under ``no_grad``, no BatchNorm: nothing
trained changes) and the resume branch left out.

The port is one Trainer per pruning state (``max_epochs``), as a user would write it, since each state has an
optimizer over other parameters; the pruning between states is the source's code.
"""
import copy
import warnings
from copy import deepcopy
from functools import partial

import pytest
import torch
import torch.nn as nn
import torch.nn.utils.prune as prune

from safeloop import GraphGuard, Trainer
from safeloop.watch import Watch

from .harness import assert_same, checks, strict

LR, MOMENTUM, WEIGHT_DECAY = 0.05, 0.9, 1e-4
EPOCHS, PRUNING_TIMES, RATE, REWIND_EPOCH, DECREASING_LR = 2, 3, 0.2, 1, "1"


# -- utils/pruner.py ----------------------------------------------------------------------------------------
def pruning_model(model, px):

    parameters_to_prune =[]
    for name,m in model.named_modules():
        if isinstance(m, nn.Conv2d):
            parameters_to_prune.append((m,'weight'))

    parameters_to_prune = tuple(parameters_to_prune)
    prune.global_unstructured(
        parameters_to_prune,
        pruning_method=prune.L1Unstructured,
        amount=px,
    )


def prune_model_custom(model, mask_dict):

    for name,m in model.named_modules():
        if isinstance(m, nn.Conv2d):
            prune.CustomFromMask.apply(m, 'weight', mask=mask_dict[name+'.weight_mask'])


def remove_prune(model):

    for name,m in model.named_modules():
        if isinstance(m, nn.Conv2d):
            prune.remove(m,'weight')


def extract_mask(model_dict):

    new_dict = {}

    for key in model_dict.keys():
        if 'mask' in key:
            new_dict[key] = copy.deepcopy(model_dict[key])

    return new_dict


def check_sparsity(model):

    sum_list = 0
    zero_sum = 0

    for name,m in model.named_modules():
        if isinstance(m, nn.Conv2d):
            sum_list = sum_list+float(m.weight.nelement())
            zero_sum = zero_sum+float(torch.sum(m.weight == 0))

    return 100*(1-zero_sum/sum_list)


# -- main_imp.py --------------------------------------------------------------------------------------------
def train(train_loader, model, criterion, optimizer, epoch):
    model.train()
    for i, (image, target) in enumerate(train_loader):
        output_clean = model(image)
        loss = criterion(output_clean, target)

        optimizer.zero_grad()
        loss.backward()
        optimizer.step()


def make_optimizer(model):
    return torch.optim.SGD(model.parameters(), LR, momentum=MOMENTUM, weight_decay=WEIGHT_DECAY)


def make_scheduler(optimizer, rewind=0):
    scheduler = torch.optim.lr_scheduler.MultiStepLR(optimizer, milestones=decreasing_lr(), gamma=0.1)
    for _ in range(rewind):
        scheduler.step()
    return scheduler


def decreasing_lr():
    return list(map(int, DECREASING_LR.split(',')))


def prune_and_rewind(model, initalization):
    """The end of a pruning state in ``main``: prune, keep the masks, rewind the weights, put the masks back."""
    pruning_model(model, RATE)
    check_sparsity(model)
    current_mask = extract_mask(model.state_dict())
    remove_prune(model)
    model.load_state_dict(initalization)
    prune_model_custom(model, current_mask)


def imp_hand(model, train_loader, trained):
    criterion = nn.CrossEntropyLoss()
    initalization = deepcopy(model.state_dict())
    optimizer = make_optimizer(model)
    scheduler = torch.optim.lr_scheduler.MultiStepLR(optimizer, milestones=decreasing_lr(), gamma=0.1)
    for state in range(0, PRUNING_TIMES):
        check_sparsity(model)
        for epoch in range(0, EPOCHS):
            train(train_loader, model, criterion, optimizer, epoch)
            scheduler.step()
        trained.append(deepcopy(model.state_dict()))  # for the comparison: the last state ends rewound
        check_sparsity(model)
        prune_and_rewind(model, initalization)
        optimizer = make_optimizer(model)
        scheduler = torch.optim.lr_scheduler.MultiStepLR(optimizer, milestones=decreasing_lr(), gamma=0.1)
        if REWIND_EPOCH:
            # learning rate rewinding
            for _ in range(REWIND_EPOCH):
                scheduler.step()


def convnet():
    return nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), nn.ReLU(), nn.Conv2d(4, 4, 3, padding=1), nn.ReLU(),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, 3))


def images():
    gen = torch.Generator().manual_seed(4)
    return [(torch.randn(8, 1, 4, 4, generator=gen), torch.randint(3, (8,), generator=gen)) for _ in range(2)]


class ClassifierTrainer(Trainer):
    def training_step(self, batch):
        image, target = batch
        return nn.CrossEntropyLoss()(self.model(image), target)


def imp_port(model, train_loader, trained, check):
    initalization = deepcopy(model.state_dict())
    for state in range(0, PRUNING_TIMES):
        check_sparsity(model)
        rewound = partial(make_scheduler, rewind=REWIND_EPOCH if state else 0)  # a new state's rewinding
        trainer = ClassifierTrainer(model=model, train_data=train_loader, optimizer=make_optimizer(model),
                                    scheduler={"scheduler": rewound, "interval": "epoch"},
                                    max_epochs=EPOCHS, device="cpu", progress=False, loggers=(), guard={"check": check})
        trainer.fit()
        assert trainer.state.step == EPOCHS * len(train_loader)
        trained.append(deepcopy(model.state_dict()))
        check_sparsity(model)
        prune_and_rewind(model, initalization)


@pytest.mark.parametrize("check", checks())
def test_iterative_magnitude_pruning_with_prune_hooks_and_rewinding(check):
    torch.manual_seed(0)
    ref = convnet()
    ours, watched, start = copy.deepcopy(ref), copy.deepcopy(ref), copy.deepcopy(ref)
    by_hand, under_watch, ported = [], [], []
    torch.manual_seed(1)
    with warnings.catch_warnings(record=True) as own:
        warnings.simplefilter("always")
        imp_hand(ref, images(), by_hand)
    torch.manual_seed(1)
    with strict(own), Watch(GraphGuard(check=check), imp_hand.__code__.co_filename):  # as harness.compare
        imp_hand(watched, images(), under_watch)
    assert_same(watched, ref)
    torch.manual_seed(1)
    with strict(own):
        imp_port(ours, images(), ported, check)
    assert_same(ours, ref)
    for states in (under_watch, ported):  # each pruning state's trained weights, before its rewind
        assert len(states) == len(by_hand) == PRUNING_TIMES
        for got, want in zip(states, by_hand):
            assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    assert not torch.equal(by_hand[-1]["6.weight"], start[6].weight)
    assert "0.weight_orig" in by_hand[-1] and 0 < check_sparsity(ref) < 100
