"""Stochastic weight averaging as PyTorch documents it: pytorch/pytorch, docs/source/optim.rst
("Putting it all together: SWA", torch.optim.swa_utils). An ``AveragedModel`` (a deep copy of the
model, averaged under ``no_grad`` with its ``n_averaged`` buffer) collects the weights at the end of
each epoch after ``swa_start``, when ``SWALR`` takes the optimizer over from ``CosineAnnealingLR``;
``update_bn`` then recomputes the averaged model's BatchNorm statistics over the training data."""
import copy
import warnings

import pytest
import torch
from torch import nn
from torch.optim.lr_scheduler import CosineAnnealingLR
from torch.optim.swa_utils import SWALR, AveragedModel, update_bn

from safeloop import GraphGuard, Trainer
from safeloop.watch import Watch

from .harness import assert_same, bn_classifier, checks, labelled, strict

# SWA_LR differs from where the cosine stands at swa_start (0.05), so that SWALR's steps change the updates
EPOCHS, SWA_START, LR, SWA_LR = 4, 1, 0.1, 0.02
loss_fn = nn.CrossEntropyLoss()


def swa_opt(params):
    return torch.optim.SGD(params, lr=LR, momentum=0.9)


def swa_hand(model, loader):
    """The documented loop, verbatim but for the sizes; returns the SWA model and the last learning rate."""
    optimizer = swa_opt(model.parameters())
    swa_model = AveragedModel(model)
    scheduler = CosineAnnealingLR(optimizer, T_max=EPOCHS)
    swa_start = SWA_START
    swa_scheduler = SWALR(optimizer, swa_lr=SWA_LR)
    for epoch in range(EPOCHS):
        for input, target in loader:
            optimizer.zero_grad()
            loss_fn(model(input), target).backward()
            optimizer.step()
        if epoch > swa_start:
            swa_model.update_parameters(model)
            swa_scheduler.step()
        else:
            scheduler.step()
    update_bn(loader, swa_model)
    return swa_model, optimizer.param_groups[0]["lr"]


class SWA(Trainer):
    """safeloop steps one scheduler per optimizer, every epoch without condition: it cannot hand the
    optimizer from one scheduler to another. So neither is given to it; ``on_epoch_end`` runs the
    documented switch itself, and the schedulers are saved with the checkpoint by hand."""

    def configure_optimizers(self):
        # here, after setup() placed the model, so that the copy lives on its device and exists
        # before a resumed checkpoint is loaded into modules()
        optimizer = swa_opt(self.model.parameters())
        self.swa_model = AveragedModel(self.model)
        self.scheduler = CosineAnnealingLR(optimizer, T_max=EPOCHS)
        self.swa_scheduler = SWALR(optimizer, swa_lr=SWA_LR)
        return optimizer

    def training_step(self, batch):
        input, target = batch
        return loss_fn(self.model(input), target)

    def on_epoch_end(self):  # state.epoch is the epoch that ended, as `epoch` in the documented loop
        if self.state.epoch > SWA_START:
            self.swa_model.update_parameters(self.model)
            self.swa_scheduler.step()
        else:
            self.scheduler.step()

    def on_fit_end(self):
        update_bn(self.train_data, self.swa_model)

    def modules(self):
        return {**super().modules(), "swa_model": self.swa_model}

    def on_save_checkpoint(self, checkpoint):
        checkpoint["swa"] = {"scheduler": self.scheduler.state_dict(),
                             "swa_scheduler": self.swa_scheduler.state_dict()}

    def on_load_checkpoint(self, checkpoint):
        self.scheduler.load_state_dict(checkpoint["swa"]["scheduler"])
        self.swa_scheduler.load_state_dict(checkpoint["swa"]["swa_scheduler"])


@pytest.mark.parametrize("check", checks())
def test_stochastic_weight_averaging(check):
    loader = labelled(3)  # 3 batches an epoch
    torch.manual_seed(0)
    ref = bn_classifier()
    ours, watched, start = copy.deepcopy(ref), copy.deepcopy(ref), copy.deepcopy(ref)
    with warnings.catch_warnings(record=True) as own:
        warnings.simplefilter("always")
        ref_swa, ref_lr = swa_hand(ref, loader)
    with strict(own), Watch(GraphGuard(check=check), swa_hand.__code__.co_filename):  # as harness.compare
        watched_swa, _ = swa_hand(watched, loader)
    assert_same(watched, ref)
    assert_same(watched_swa, ref_swa)
    with strict(own):  # the port warns nothing the hand loop does not
        trainer = SWA(model=ours, train_data=loader, max_epochs=EPOCHS, device="cpu", progress=False, loggers=(),
                      guard={"check": check})
        trainer.fit()
        saved = trainer.state_dict()
    assert trainer.state.step == EPOCHS * len(loader)
    assert_same(ours, ref)
    assert_same(trainer.swa_model, ref_swa)
    assert trainer.optimizers["optimizer"].param_groups[0]["lr"] == ref_lr  # the last epoch's SWALR step too
    assert int(ref_swa.n_averaged) == EPOCHS - 1 - SWA_START  # averaged more than once: a mean, not a copy
    assert not torch.equal(ref_swa.module[1].running_mean, ref[1].running_mean)  # update_bn recomputed them
    assert not torch.equal(ref[0].weight, start[0].weight)  # trained: the comparison proves something
    assert torch.equal(saved["modules"]["swa_model"]["n_averaged"], ref_swa.n_averaged)
    # the checkpoint holds the averaged model and SWALR as they ended (its step at construction, then one an epoch)
    assert saved["swa"]["swa_scheduler"]["_step_count"] == ref_swa.n_averaged + 1
