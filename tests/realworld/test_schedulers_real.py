"""Learning-rate schedules as public training loops drive them, each against its hand-written loop (``compare``)
and, where a run can stop inside the schedule, resumed from its checkpoint against the run that never stopped.

- ``CosineAnnealingWarmRestarts`` stepped with a fractional epoch inside the batch loop,
  ``scheduler.step(epoch + i / iters)``: pytorch/pytorch, torch/optim/lr_scheduler.py (the example in
  ``CosineAnnealingWarmRestarts.step``'s docstring). The Trainer steps a scheduler with ``step()`` and no
  argument, so the port keeps it out of ``configure_optimizers``, steps it in ``on_step_end`` with
  ``state.epoch + (state.batch_in_epoch - 1) / len(train_data)`` and saves it in ``on_save_checkpoint``.
- ``ReduceLROnPlateau`` on the validation loss once an epoch: the loop of the scheduler's docstring
  (``train(...); val_loss = validate(...); scheduler.step(val_loss)``, torch/optim/lr_scheduler.py) with
  pytorch/examples' mnist/main.py ``test()`` (summed loss over the set, divided by its size). The port monitors
  ``val_loss`` with ``val_every`` = one pass's steps.
- ``OneCycleLR`` over the updates of an accumulated loop (``steps_per_epoch=len(train_loader) // accum_steps``,
  ``scheduler.step()`` after each ``optimizer.step()``, Adam's betas cycled), the common pattern of the
  scheduler's docstring ("step should be called after a batch has been used for training") with accumulation.
- timm's schedulers, driven by train.py by hand: huggingface/pytorch-image-models, train.py (``train_one_epoch``:
  ``grad_accum_steps`` with the last group of a pass divided by its own size, ``lr_scheduler.step_update(
  num_updates=num_updates, metric=losses_m.avg)`` after each update; ``main``: ``lr_scheduler.step(epoch + 1,
  eval_metrics[eval_metric])`` after each epoch), timm/scheduler/scheduler.py and cosine_lr.py
  (``CosineLRScheduler`` with warmup, ``t_in_epochs`` False for ``--sched-on-updates``), the sizes of
  scheduler_factory.py (``t_initial`` and ``warmup_t`` in updates when on updates). The port calls
  ``step_update(self.state.step)`` in ``on_step_end`` and ``step(epoch + 1, metric)`` in ``on_epoch_end``.
- A ``LambdaLR`` whose ``lr_lambda`` is a callable object holding its schedule as a NumPy array:
  wensi-ai/brs-algo (f46286d), brs_algo/optim/lr_schedule.py (``CosineScheduleFunction``,
  ``generate_cosine_schedule``) and brs_algo/learning/module/diffusion_module.py (``configure_optimizers``: AdamW,
  ``LambdaLR(optimizer=optimizer, lr_lambda=CosineScheduleFunction(...))`` with ``"interval": "step"``; Lightning's
  lists returned as the dict). ``LambdaLR.state_dict()`` holds the callable's ``__dict__``, the array included.
- torchvision's detection recipe: pytorch/vision, references/detection/engine.py (``train_one_epoch``: in epoch
  0 a ``LinearLR`` warmup made at the epoch's start and stepped after every iteration) and
  references/detection/train.py (``MultiStepLR`` over ``--lr-steps``, stepped after each epoch): two schedulers on
  one optimizer, the Trainer stepping the epoch one, the port the warmup.
- ildoonet/pytorch-gradual-warmup-lr, warmup_scheduler/scheduler.py (``GradualWarmupScheduler``, an
  ``_LRScheduler`` that holds the scheduler it hands over to, ``after_scheduler``, and keeps ``state_dict()``'s
  default: its ``__dict__``, that scheduler object included) and warmup_scheduler/run.py (the usage: a
  ``CosineAnnealingLR`` after 5 warmup epochs, one empty ``optim.step()`` and ``scheduler_warmup.step()`` before the
  loop, then once an epoch).
- Lightning's fine-tuning example: Lightning-AI/pytorch-lightning,
  examples/pytorch/domain_templates/computer_vision_fine_tuning.py (``MilestonesFinetuning``: the backbone frozen
  before training, its last layers unfrozen and added to Adam as a new parameter group at the first milestone
  epoch, the rest at the second; ``MultiStepLR`` over the same milestones) with src/lightning/pytorch/callbacks/
  finetuning.py's ``BaseFinetuning`` helpers (2.5.0). Lightning resumes such a run: ``BaseFinetuning`` saves the
  groups it added and puts them back on the optimizer before the optimizer's state is loaded.
- YOLOv5's warmup: ultralytics/yolov5, train.py (v6: three SGD groups, BatchNorm weights, decayed weights and
  biases; a linear ``LambdaLR`` once an epoch; for the first ``nw`` batches the rate and momentum of every group
  interpolated with ``np.interp`` (``numpy.float64`` values) and the accumulation count grown from 1 to
  ``nbs / batch_size``; an update when ``ni - last_opt_step >= accumulate``; ``optimizer.zero_grad()`` at each
  epoch's start, dropping what the last batches accumulated). Changes: ``nw`` is one epoch (not at least 100
  iterations), BatchNorm1d for BatchNorm2d, cross entropy for the detection loss, no AMP, EMA or validation.
  Ported in manual mode, one batch a step; ``last_opt_step`` and ``accumulate`` saved by hand.
- The Annotated Transformer: harvardnlp/annotated-transformer, the_annotated_transformer.py (``rate``: the
  Noam schedule as a ``LambdaLR``; ``run_epoch``: a backward every batch, ``optimizer.step()`` when
  ``i % accum_iter == 0`` (a pass's first batch alone), ``scheduler.step()`` after *every batch*, updates or not;
  no ``zero_grad`` between passes, so a pass's last batches go into the next pass's first update). Ported in manual
  mode, the scheduler kept out of the Trainer's (whose ``"step"`` interval is per update) and stepped in
  ``on_step_end``.
- Resumed ports of other cases: torchvision's warmup-then-cosine ``SequentialLR`` (test_torchvision_ema),
  Hugging Face's linear schedule in manual accumulation (test_finetune), nanoGPT's ``get_lr`` (test_build_nanogpt);
  and a run continued with a longer ``CosineAnnealingLR``, as docs/checkpoints.md continues one.

Sizes are a few batches of 8 samples of 4 features, a two-layer classifier, 2-4 epochs.
"""
import logging
import re
import math
from collections.abc import Iterable

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from safeloop import CheckpointError, ConfigError, ConfigWarning, Trainer

from .harness import assert_same, bn_classifier, checks, compare, fixed, labelled
from . import test_build_nanogpt as gpt, test_finetune as glue, test_torchvision_ema as tv
from .test_resume_ports import straight_and_resumed


def classifier():
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))


# -- CosineAnnealingWarmRestarts, stepped with a fractional epoch -----------------------------------------------
WR_EPOCHS, WR_BATCHES, WR_T0, WR_TMULT, WR_ETA_MIN = 4, 3, 1, 2, 1e-3


def warm_restarts_optimizer(model):
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    return optimizer, torch.optim.lr_scheduler.CosineAnnealingWarmRestarts(optimizer, WR_T0, WR_TMULT, WR_ETA_MIN)


def warm_restarts_hand(net, dataloader):
    criterion = nn.CrossEntropyLoss()
    optimizer, scheduler = warm_restarts_optimizer(net)
    iters = len(dataloader)
    for epoch in range(WR_EPOCHS):
        for i, sample in enumerate(dataloader):
            inputs, labels = sample
            optimizer.zero_grad()
            outputs = net(inputs)
            loss = criterion(outputs, labels)
            loss.backward()
            optimizer.step()
            scheduler.step(epoch + i / iters)


class WarmRestarts(Trainer):
    def configure_optimizers(self):
        optimizer, self.scheduler = warm_restarts_optimizer(self.model)
        return optimizer

    def training_step(self, batch):
        inputs, labels = batch
        return F.cross_entropy(self.model(inputs), labels)

    def on_step_end(self, losses):
        epoch, i = self.state.epoch, self.state.batch_in_epoch - 1
        self.scheduler.step(epoch + i / len(self.train_data))

    def on_save_checkpoint(self, checkpoint):
        checkpoint["warm_restarts"] = self.scheduler.state_dict()

    def on_load_checkpoint(self, checkpoint):
        self.scheduler.load_state_dict(checkpoint["warm_restarts"])


@pytest.mark.parametrize("check", checks())
def test_cosine_warm_restarts_stepped_with_a_fractional_epoch(check):
    compare(classifier, warm_restarts_hand, WarmRestarts, fixed(labelled(WR_BATCHES)), check,
            steps=WR_EPOCHS * WR_BATCHES)


@pytest.mark.parametrize("stop", [3, 5], ids=["at_an_epoch_end", "mid_epoch"])
@pytest.mark.filterwarnings("error")
def test_cosine_warm_restarts_resumed(tmp_path, stop):
    """Stopped at a pass's end (the restart at epoch 1) and mid-pass (T_cur fractional, T_i doubled)."""
    straight, resumed = straight_and_resumed(tmp_path, classifier, WarmRestarts, fixed(labelled(WR_BATCHES)),
                                             WR_EPOCHS * WR_BATCHES, stop)
    assert_same(resumed.model, straight.model)
    assert resumed.scheduler.state_dict() == straight.scheduler.state_dict()
    assert straight.scheduler.T_i == 4  # restarted at epochs 1 and 3


# -- ReduceLROnPlateau on the validation loss -------------------------------------------------------------------
PL_EPOCHS, PL_BATCHES, PL_VAL_BATCHES, PL_LR = 4, 3, 2, 0.5


def plateau_optimizer(model):
    optimizer = torch.optim.SGD(model.parameters(), lr=PL_LR, momentum=0.9)
    # a relative threshold of 5%: an epoch that lowers the loss less counts as a bad one (patience 0: halve at once)
    return optimizer, torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, "min", factor=0.5, patience=0,
                                                                 threshold=0.05)


def plateau_val():
    return labelled(PL_VAL_BATCHES, seed=7)


def validate(model, test_loader):
    """pytorch/examples, mnist/main.py's ``test()``, the loss only (cross entropy on logits for ``nll_loss``)."""
    model.eval()
    test_loss = 0
    with torch.no_grad():
        for data, target in test_loader:
            output = model(data)
            test_loss += F.cross_entropy(output, target, reduction="sum").item()  # sum up batch loss
    test_loss /= sum(len(target) for _, target in test_loader)
    return test_loss


def plateau_hand(model, train_loader):
    optimizer, scheduler = plateau_optimizer(model)
    for epoch in range(PL_EPOCHS):
        model.train()
        for data, target in train_loader:
            optimizer.zero_grad()
            loss = F.cross_entropy(model(data), target)
            loss.backward()
            optimizer.step()
        val_loss = validate(model, plateau_val())
        scheduler.step(val_loss)
    return optimizer


class Plateau(Trainer):
    def configure_optimizers(self):
        optimizer, scheduler = plateau_optimizer(self.model)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "monitor": "val_loss"}}

    def training_step(self, batch):
        data, target = batch
        return F.cross_entropy(self.model(data), target)


PLATEAU = dict(val_data=plateau_val(), val_every=PL_BATCHES)


def test_the_hand_loop_reduces_the_rate_on_a_plateau():
    torch.manual_seed(0)
    optimizer = plateau_hand(classifier(), labelled(PL_BATCHES))
    assert optimizer.param_groups[0]["lr"] < PL_LR / 2  # reduced more than once: the schedule is exercised


@pytest.mark.parametrize("check", checks())
def test_reduce_on_plateau_on_the_validation_loss(check):
    compare(classifier, plateau_hand, Plateau, fixed(labelled(PL_BATCHES)), check, steps=PL_EPOCHS * PL_BATCHES,
            **PLATEAU)


@pytest.mark.parametrize("stop", [6, 7], ids=["at_an_epoch_end", "mid_epoch"])
@pytest.mark.filterwarnings("error")
def test_reduce_on_plateau_resumed_after_a_reduction(tmp_path, stop):
    """The stopped run has reduced the rate already; the resumed one goes on with its best value and bad epochs. A
    run stopped mid-pass validates at its end (not a scheduled validation): the plateau does not step there."""
    straight, resumed = straight_and_resumed(tmp_path, classifier, Plateau, fixed(labelled(PL_BATCHES)),
                                             PL_EPOCHS * PL_BATCHES, stop, **PLATEAU)
    assert_same(resumed.model, straight.model)
    assert resumed.schedulers["optimizer"].state_dict() == straight.schedulers["optimizer"].state_dict()


def resume_warnings(tmp_path, caplog, trainer, data, steps, stop, **kwargs):
    """The lines ``safeloop`` logs at WARNING while a run stopped at ``stop`` is resumed to ``steps``."""
    straight_and_resumed(tmp_path, classifier, trainer, data, steps, stop, **kwargs)  # the stop, then the resume
    return [r.getMessage() for r in caplog.records if r.name == "safeloop" and r.levelno >= logging.WARNING]


def test_a_plateau_resumed_after_a_reduction_logs_no_changed_hyperparameter(tmp_path, caplog):
    caplog.set_level(logging.WARNING, logger="safeloop")
    said = resume_warnings(tmp_path, caplog, Plateau, fixed(labelled(PL_BATCHES)), PL_EPOCHS * PL_BATCHES, 6,
                           **PLATEAU)
    assert not [line for line in said if line.startswith("resume: optimizer")], said


# -- OneCycleLR over the updates of an accumulated loop ---------------------------------------------------------
OC_EPOCHS, OC_BATCHES, OC_ACCUM, OC_MAX_LR = 3, 4, 2, 0.05


def one_cycle_optimizer(model, train_loader):
    optimizer = torch.optim.AdamW(model.parameters(), lr=OC_MAX_LR, weight_decay=1e-2)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=OC_MAX_LR, epochs=OC_EPOCHS,
                                                    steps_per_epoch=len(train_loader) // OC_ACCUM, pct_start=0.3,
                                                    div_factor=10, final_div_factor=100)
    return optimizer, scheduler


def one_cycle_hand(model, train_loader):
    optimizer, scheduler = one_cycle_optimizer(model, train_loader)
    for epoch in range(OC_EPOCHS):
        model.train()
        optimizer.zero_grad()
        for step, (inputs, labels) in enumerate(train_loader):
            loss = F.cross_entropy(model(inputs), labels) / OC_ACCUM
            loss.backward()
            if (step + 1) % OC_ACCUM == 0:
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()


class OneCycle(Trainer):
    def configure_optimizers(self):
        optimizer, scheduler = one_cycle_optimizer(self.model, self.train_data)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def training_step(self, batch):
        inputs, labels = batch
        return F.cross_entropy(self.model(inputs), labels)


@pytest.mark.parametrize("check", checks())
def test_one_cycle_over_accumulated_updates(check):
    compare(classifier, one_cycle_hand, OneCycle, fixed(labelled(OC_BATCHES)), check,
            steps=OC_EPOCHS * OC_BATCHES // OC_ACCUM, grad_accum=OC_ACCUM)


@pytest.mark.parametrize("stop", [2, 3], ids=["at_an_epoch_end", "mid_epoch"])
@pytest.mark.filterwarnings("error")
def test_one_cycle_over_accumulated_updates_resumed(tmp_path, stop):
    straight, resumed = straight_and_resumed(tmp_path, classifier, OneCycle, fixed(labelled(OC_BATCHES)),
                                             OC_EPOCHS * OC_BATCHES // OC_ACCUM, stop, grad_accum=OC_ACCUM)
    assert_same(resumed.model, straight.model)
    assert resumed.schedulers["optimizer"].state_dict() == straight.schedulers["optimizer"].state_dict()


def test_one_cycle_resumed_logs_no_changed_hyperparameter(tmp_path, caplog):
    caplog.set_level(logging.WARNING, logger="safeloop")
    said = resume_warnings(tmp_path, caplog, OneCycle, fixed(labelled(OC_BATCHES)),
                           OC_EPOCHS * OC_BATCHES // OC_ACCUM, 3, grad_accum=OC_ACCUM)
    assert not [line for line in said if line.startswith("resume: optimizer")], said


# -- timm's schedulers, stepped by the training loop ------------------------------------------------------------
# timm/scheduler/scheduler.py (the noise options left out: noise_range_t None) and cosine_lr.py
class Scheduler:
    def __init__(self, optimizer, param_group_field, t_in_epochs=True, initialize=True):
        self.optimizer = optimizer
        self.param_group_field = param_group_field
        self._initial_param_group_field = f"initial_{param_group_field}"
        if initialize:
            for i, group in enumerate(self.optimizer.param_groups):
                if param_group_field not in group:
                    raise KeyError(f"{param_group_field} missing from param_groups[{i}]")
                group.setdefault(self._initial_param_group_field, group[param_group_field])
        else:
            for i, group in enumerate(self.optimizer.param_groups):
                if self._initial_param_group_field not in group:
                    raise KeyError(f"{self._initial_param_group_field} missing from param_groups[{i}]")
        self.base_values = [group[self._initial_param_group_field] for group in self.optimizer.param_groups]
        self.metric = None  # any point to having this for all?
        self.t_in_epochs = t_in_epochs
        self.update_groups(self.base_values)

    def state_dict(self):
        return {key: value for key, value in self.__dict__.items() if key != 'optimizer'}

    def load_state_dict(self, state_dict):
        self.__dict__.update(state_dict)

    def _get_values(self, t, on_epoch=True):
        proceed = (on_epoch and self.t_in_epochs) or (not on_epoch and not self.t_in_epochs)
        if not proceed:
            return None
        return self._get_lr(t)

    def step(self, epoch, metric=None):
        self.metric = metric
        values = self._get_values(epoch, on_epoch=True)
        if values is not None:
            self.update_groups(values)

    def step_update(self, num_updates, metric=None):
        self.metric = metric
        values = self._get_values(num_updates, on_epoch=False)
        if values is not None:
            self.update_groups(values)

    def update_groups(self, values):
        if not isinstance(values, (list, tuple)):
            values = [values] * len(self.optimizer.param_groups)
        for param_group, value in zip(self.optimizer.param_groups, values):
            if 'lr_scale' in param_group:
                param_group[self.param_group_field] = value * param_group['lr_scale']
            else:
                param_group[self.param_group_field] = value


class CosineLRScheduler(Scheduler):
    def __init__(self, optimizer, t_initial, lr_min=0., cycle_mul=1., cycle_decay=1., cycle_limit=1, warmup_t=0,
                 warmup_lr_init=0, warmup_prefix=False, t_in_epochs=True, k_decay=1.0, initialize=True):
        super().__init__(optimizer, param_group_field="lr", t_in_epochs=t_in_epochs, initialize=initialize)
        assert t_initial > 0
        assert lr_min >= 0
        self.t_initial = t_initial
        self.lr_min = lr_min
        self.cycle_mul = cycle_mul
        self.cycle_decay = cycle_decay
        self.cycle_limit = cycle_limit
        self.warmup_t = warmup_t
        self.warmup_lr_init = warmup_lr_init
        self.warmup_prefix = warmup_prefix
        self.k_decay = k_decay
        if self.warmup_t:
            self.warmup_steps = [(v - warmup_lr_init) / self.warmup_t for v in self.base_values]
            super().update_groups(self.warmup_lr_init)
        else:
            self.warmup_steps = [1 for _ in self.base_values]

    def _get_lr(self, t):
        if t < self.warmup_t:
            lrs = [self.warmup_lr_init + t * s for s in self.warmup_steps]
        else:
            if self.warmup_prefix:
                t = t - self.warmup_t
            if self.cycle_mul != 1:
                i = math.floor(math.log(1 - t / self.t_initial * (1 - self.cycle_mul), self.cycle_mul))
                t_i = self.cycle_mul ** i * self.t_initial
                t_curr = t - (1 - self.cycle_mul ** i) / (1 - self.cycle_mul) * self.t_initial
            else:
                i = t // self.t_initial
                t_i = self.t_initial
                t_curr = t - (self.t_initial * i)
            gamma = self.cycle_decay ** i
            lr_max_values = [v * gamma for v in self.base_values]
            k = self.k_decay
            if i < self.cycle_limit:
                lrs = [self.lr_min + 0.5 * (lr_max - self.lr_min) * (1 + math.cos(math.pi * t_curr ** k / t_i ** k))
                       for lr_max in lr_max_values]
            else:
                lrs = [self.lr_min for _ in self.base_values]
        return lrs


TIMM_EPOCHS, TIMM_BATCHES, TIMM_ACCUM, TIMM_WARMUP_EPOCHS = 3, 5, 2, 1


def timm_updates_per_epoch(loader):
    return (len(loader) + TIMM_ACCUM - 1) // TIMM_ACCUM


def create_scheduler(optimizer, updates_per_epoch, sched_on_updates):
    """scheduler_factory.py's ``create_scheduler_v2`` for ``sched='cosine'``: lengths in updates when on updates."""
    t_initial, warmup_t = TIMM_EPOCHS, TIMM_WARMUP_EPOCHS
    if sched_on_updates:
        t_initial, warmup_t = t_initial * updates_per_epoch, warmup_t * updates_per_epoch
    return CosineLRScheduler(optimizer, t_initial=t_initial, lr_min=1e-4, t_in_epochs=not sched_on_updates,
                             warmup_lr_init=1e-3, warmup_t=warmup_t, warmup_prefix=False)


def timm_optimizer(model, updates_per_epoch, sched_on_updates):
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.05)
    return optimizer, create_scheduler(optimizer, updates_per_epoch, sched_on_updates)


def timm_val():
    return labelled(2, seed=9)


def train_one_epoch(epoch, model, loader, optimizer, loss_fn, lr_scheduler):
    """train.py's ``train_one_epoch``, one process, no AMP, mixup, EMA, clipping or logging."""
    model.train()
    accum_steps = TIMM_ACCUM
    last_accum_steps = len(loader) % accum_steps
    updates_per_epoch = (len(loader) + accum_steps - 1) // accum_steps
    num_updates = epoch * updates_per_epoch
    last_batch_idx = len(loader) - 1
    last_batch_idx_to_accum = len(loader) - last_accum_steps
    optimizer.zero_grad()
    for batch_idx, (input, target) in enumerate(loader):
        last_batch = batch_idx == last_batch_idx
        need_update = last_batch or (batch_idx + 1) % accum_steps == 0
        if batch_idx >= last_batch_idx_to_accum:
            accum_steps = last_accum_steps

        def _forward():
            output = model(input)
            loss = loss_fn(output, target)
            if accum_steps > 1:
                loss /= accum_steps
            return loss

        def _backward(_loss):
            _loss.backward()
            if need_update:
                optimizer.step()

        loss = _forward()
        _backward(loss)
        if not need_update:
            continue
        num_updates += 1
        optimizer.zero_grad()
        if lr_scheduler is not None:
            lr_scheduler.step_update(num_updates=num_updates, metric=None)


def timm_hand(model, loader_train, sched_on_updates):
    optimizer, lr_scheduler = timm_optimizer(model, timm_updates_per_epoch(loader_train), sched_on_updates)
    train_loss_fn = nn.CrossEntropyLoss()
    for epoch in range(TIMM_EPOCHS):
        train_one_epoch(epoch, model, loader_train, optimizer, train_loss_fn, lr_scheduler)
        eval_metrics = {"loss": validate(model, timm_val())}
        if lr_scheduler is not None:
            # step LR for next epoch
            lr_scheduler.step(epoch + 1, eval_metrics["loss"])


class TimmLoop(Trainer):
    """``grad_accum`` divides every loss by 2; timm divides a pass's last group of 1 batch by 1: undone here."""

    sched_on_updates = True

    def configure_optimizers(self):
        optimizer, self.lr_scheduler = timm_optimizer(self.model, timm_updates_per_epoch(self.train_data),
                                                      self.sched_on_updates)
        return optimizer

    def training_step(self, batch):
        input, target = batch
        loss = F.cross_entropy(self.model(input), target)
        left = len(self.train_data) % TIMM_ACCUM
        if left and self.state.batch_in_epoch == len(self.train_data):  # the last group, of `left` batches
            loss = loss * TIMM_ACCUM / left
        return loss

    def on_step_end(self, losses):
        self.lr_scheduler.step_update(num_updates=self.state.step, metric=None)

    def on_epoch_end(self):
        self.lr_scheduler.step(self.state.epoch + 1, validate(self.model, timm_val()))
        self.model.train()


class TimmLoopOnEpochs(TimmLoop):
    sched_on_updates = False


TIMM = {True: TimmLoop, False: TimmLoopOnEpochs}
TIMM_STEPS = TIMM_EPOCHS * (TIMM_BATCHES + TIMM_ACCUM - 1) // TIMM_ACCUM


def shuffled_loader(model):
    """timm's loader shuffles: the 5 batches of ``labelled`` as a shuffled DataLoader of 40 samples."""
    x, y = (torch.cat(t) for t in zip(*labelled(TIMM_BATCHES)))
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=8, shuffle=True)


@pytest.mark.parametrize("loader", [fixed(labelled(TIMM_BATCHES)), shuffled_loader], ids=["list", "shuffled"])
@pytest.mark.parametrize("sched_on_updates", [True, False], ids=["on_updates", "on_epochs"])
@pytest.mark.parametrize("check", checks())
def test_timm_cosine_schedule_stepped_by_the_loop_with_accumulation(check, sched_on_updates, loader):
    compare(classifier, lambda model, loader: timm_hand(model, loader, sched_on_updates), TIMM[sched_on_updates],
            loader, check, steps=TIMM_STEPS, grad_accum=TIMM_ACCUM)


@pytest.mark.parametrize("loader", [fixed(labelled(TIMM_BATCHES)), shuffled_loader], ids=["list", "shuffled"])
@pytest.mark.parametrize("sched_on_updates", [True, False], ids=["on_updates", "on_epochs"])
@pytest.mark.parametrize("stop", [3, 4], ids=["at_an_epoch_end", "mid_epoch"])
@pytest.mark.filterwarnings("error")
def test_timm_cosine_schedule_resumed(tmp_path, stop, sched_on_updates, loader):
    """Nothing of the scheduler saved: timm's schedules are functions of the count the loop passes in. The shuffled
    loader's interrupted pass is drawn again in the same order."""
    straight, resumed = straight_and_resumed(tmp_path, classifier, TIMM[sched_on_updates], loader, TIMM_STEPS, stop,
                                             grad_accum=TIMM_ACCUM)
    assert_same(resumed.model, straight.model)
    lrs = [run.optimizers["optimizer"].param_groups[0]["lr"] for run in (resumed, straight)]
    assert lrs[0] == lrs[1]


class TimmGiven(Trainer):
    """A Lightning port that hands timm's scheduler over as ``lr_scheduler`` (Lightning refuses it at start-up: its
    ``step`` takes the epoch, so ``lr_scheduler_step`` must be overridden)."""

    def configure_optimizers(self):
        optimizer, scheduler = timm_optimizer(self.model, timm_updates_per_epoch(self.train_data), False)
        return {"optimizer": optimizer, "lr_scheduler": scheduler}

    def training_step(self, batch):
        input, target = batch
        return F.cross_entropy(self.model(input), target)


def test_a_scheduler_whose_step_needs_the_epoch_is_refused_before_training():
    torch.manual_seed(0)
    trainer = TimmGiven(model=classifier(), train_data=labelled(TIMM_BATCHES), max_epochs=2, device="cpu",
                        progress=False, loggers=())
    with pytest.raises(ConfigError, match=r"the scheduler of optimizer 'optimizer' is a CosineLRScheduler, whose "
                                          r"step\(\) needs epoch: the Trainer calls step\(\) without arguments. Leave "
                                          r"it out of configure_optimizers and step it yourself in a hook"):
        trainer.fit()
    assert trainer.state.step == 0


# -- torchvision's warmup-then-cosine SequentialLR, stepped once an epoch, resumed --------------------------------
class ClassificationResumable(tv.ClassificationTrainer):
    """test_torchvision_ema's port (pytorch/vision, references/classification/train.py), with the EMA model
    checkpointed as train.py does (``checkpoint["model_ema"]``): returned from ``modules()``."""

    def modules(self):
        return {**super().modules(), "model_ema": self.model_ema}

    def on_fit_start(self):
        self.eval_data = tv.images()


@pytest.mark.parametrize("stop", [3, 4, 8], ids=["at_the_warmup_end", "mid_epoch_after_the_milestone",
                                                  "mid_last_epoch"])
@pytest.mark.filterwarnings("error")
def test_torchvision_warmup_then_cosine_resumed(tmp_path, stop):
    """Stopped where ``SequentialLR`` hands over from ``LinearLR`` to ``CosineAnnealingLR`` (the pass's end steps it
    before the save), within the next pass, and within the last."""
    straight, resumed = straight_and_resumed(tmp_path, tv.make_net, ClassificationResumable, lambda model: tv.images(),
                                             tv.EPOCHS * tv.BATCHES, stop, max_epochs=tv.EPOCHS,
                                             grad_clip=tv.CLIP_GRAD_NORM)
    assert_same(resumed.model, straight.model)
    assert_same(resumed.model_ema, straight.model_ema)
    assert resumed.schedulers["optimizer"].state_dict() == straight.schedulers["optimizer"].state_dict()


# -- Hugging Face's linear warmup-decay LambdaLR per update, resumed between two micro-batches of an update -------
@pytest.mark.parametrize("stop", [2, 4, 7], ids=["first_pass", "before_the_pass_end", "second_pass"])
@pytest.mark.filterwarnings("error")
def test_glue_linear_schedule_resumed_mid_accumulation(tmp_path, stop):
    """test_finetune's port (run_glue_no_trainer.py: updates after batches 0, 2 and 4 of each pass, one micro-batch a
    step in manual mode) stopped with one micro-batch's gradients waiting for the next update: the checkpoint holds
    them, the LambdaLR's count and the dropout RNG."""
    straight, resumed = straight_and_resumed(tmp_path, glue.TinyBertForSequenceClassification, glue.GlueFinetune,
                                             fixed(glue.glue_batches()), glue.MICRO_BATCHES, stop)
    assert_same(resumed.model, straight.model)
    assert resumed.schedulers["optimizer"].state_dict() == straight.schedulers["optimizer"].state_dict()


# -- nanoGPT's get_lr written into param_groups before each accumulated update, resumed ---------------------------
@pytest.mark.parametrize("stop", [1, 3], ids=["in_the_warmup", "in_the_decay"])
def test_build_nanogpt_lr_written_by_hand_resumed(tmp_path, stop):
    """test_build_nanogpt's port (``get_lr(self.state.step)`` assigned in ``on_before_optimizer_step``, bf16 autocast,
    ``grad_accum=2``, clipping): the rate of each resumed update comes from the restored step count."""
    straight, resumed = straight_and_resumed(tmp_path, gpt.make_gpt, gpt.GPTTrainer, lambda model: gpt.MicroBatches(),
                                             gpt.max_steps, stop, precision="bf16",
                                             grad_accum=gpt.GRAD_ACCUM_STEPS, grad_clip=1.0)
    assert_same(resumed.model, straight.model)
    assert [g["lr"] for g in resumed.optimizers["optimizer"].param_groups] == [gpt.get_lr(gpt.max_steps - 1)] * 2


# -- brs-algo's LambdaLR over a NumPy schedule --------------------------------------------------------------------
def generate_cosine_schedule(base_value, final_value, epochs, steps_per_epoch, warmup_epochs=0,
                             warmup_start_value=0) -> np.ndarray:
    warmup_schedule = np.array([])
    warmup_iters = int(warmup_epochs * steps_per_epoch)
    if warmup_epochs > 0:
        warmup_schedule = np.linspace(warmup_start_value, base_value, warmup_iters)

    iters = np.arange(int(epochs * steps_per_epoch) - warmup_iters)
    schedule = np.array([final_value + 0.5 * (base_value - final_value) * (1 + math.cos(math.pi * i / (len(iters))))
                         for i in iters])
    schedule = np.concatenate((warmup_schedule, schedule))
    assert len(schedule) == int(epochs * steps_per_epoch)
    return schedule


class CosineScheduleFunction:
    def __init__(self, base_value, final_value, epochs, steps_per_epoch, warmup_epochs=0, warmup_start_value=0):
        assert warmup_epochs < epochs, f"{warmup_epochs=} must be < {epochs=}"
        self._effective_steps = int(epochs * steps_per_epoch)
        self.schedule = generate_cosine_schedule(base_value=base_value, final_value=final_value, epochs=epochs,
                                                 steps_per_epoch=steps_per_epoch, warmup_epochs=warmup_epochs,
                                                 warmup_start_value=warmup_start_value)
        assert self.schedule.shape == (self._effective_steps,)
        self._final_value = final_value
        self._steps_tensor = torch.tensor(0, dtype=torch.long)  # for register buffer

    def __call__(self, step):
        self._steps_tensor.copy_(torch.tensor(step))
        if step >= self._effective_steps:
            val = self._final_value
        else:
            val = self.schedule[step]
        return val


BRS_LR, BRS_MIN, BRS_WARMUP, BRS_COSINE, BRS_BATCHES = 1e-2, 1e-3, 2, 8, 4


def brs_optimizer(model):
    optimizer = torch.optim.AdamW(model.parameters(), lr=BRS_LR, weight_decay=0.1)
    scheduler_kwargs = dict(base_value=1.0,  # anneal from the original LR value
                            final_value=BRS_MIN / BRS_LR, epochs=BRS_COSINE, warmup_start_value=BRS_MIN / BRS_LR,
                            warmup_epochs=BRS_WARMUP, steps_per_epoch=1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer=optimizer,
                                                  lr_lambda=CosineScheduleFunction(**scheduler_kwargs))
    return optimizer, scheduler


def brs_hand(model, loader):
    """Lightning's automatic optimization of the module: per batch zero_grad, backward, step, then the scheduler."""
    optimizer, scheduler = brs_optimizer(model)
    for epoch in range(BRS_COSINE // BRS_BATCHES):
        for x, y in loader:
            optimizer.zero_grad()
            F.cross_entropy(model(x), y).backward()
            optimizer.step()
            scheduler.step()


class BRSModule(Trainer):
    def configure_optimizers(self):
        optimizer, scheduler = brs_optimizer(self.model)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def training_step(self, batch):
        x, y = batch
        return F.cross_entropy(self.model(x), y)


@pytest.mark.parametrize("check", checks())
def test_lambda_lr_over_a_numpy_schedule(check):
    compare(classifier, brs_hand, BRSModule, fixed(labelled(BRS_BATCHES)), check, steps=BRS_COSINE)


def test_lambda_lr_over_a_numpy_schedule_is_refused_at_its_first_save(tmp_path):
    """The LambdaLR's state holds the callable's NumPy array, which ``torch.load(weights_only=True)`` refuses:
    the save names it (before, every checkpoint was written and none could be read back)."""
    torch.manual_seed(0)
    trainer = BRSModule(model=classifier(), train_data=fixed(labelled(BRS_BATCHES))(None), max_steps=3,
                        device="cpu", progress=False, loggers=(), checkpoint={"dir": str(tmp_path), "every": 2})
    with pytest.raises(CheckpointError, match=r"scheduler 'optimizer''s state_dict\(\)\['lr_lambdas'\]\[0\]\[.*\] "
                                              r"holds a numpy.ndarray, .*a NumPy array kept by an lr_lambda object as "
                                              r"a list"):
        trainer.fit()
    assert trainer.state.step == 2 and not list(tmp_path.rglob("*.pt"))


# -- torchvision's detection recipe: a per-iteration warmup in epoch 0 beside a per-epoch MultiStepLR ---------------
DET_EPOCHS, DET_BATCHES, DET_LR_STEPS, DET_GAMMA = 3, 5, [2], 0.1


def detection_optimizer(model):
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.SGD(params, lr=0.02, momentum=0.9, weight_decay=1e-4)
    return optimizer, torch.optim.lr_scheduler.MultiStepLR(optimizer, milestones=DET_LR_STEPS, gamma=DET_GAMMA)


def warmup(optimizer, data_loader):
    warmup_factor = 1.0 / 1000
    warmup_iters = min(1000, len(data_loader) - 1)
    return torch.optim.lr_scheduler.LinearLR(optimizer, start_factor=warmup_factor, total_iters=warmup_iters)


def detection_train_one_epoch(model, optimizer, data_loader, epoch):
    model.train()
    lr_scheduler = None
    if epoch == 0:
        lr_scheduler = warmup(optimizer, data_loader)
    for images, targets in data_loader:
        losses = F.cross_entropy(model(images), targets)
        optimizer.zero_grad()
        losses.backward()
        optimizer.step()
        if lr_scheduler is not None:
            lr_scheduler.step()


def detection_hand(model, data_loader):
    optimizer, lr_scheduler = detection_optimizer(model)
    for epoch in range(DET_EPOCHS):
        detection_train_one_epoch(model, optimizer, data_loader, epoch)
        lr_scheduler.step()


class Detection(Trainer):
    """The warmup made in ``on_epoch_start`` of epoch 0, as train_one_epoch makes it, and stepped in
    ``on_step_end``."""

    def configure_optimizers(self):
        optimizer, lr_scheduler = detection_optimizer(self.model)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": lr_scheduler, "interval": "epoch"}}

    def training_step(self, batch):
        images, targets = batch
        return F.cross_entropy(self.model(images), targets)

    def on_epoch_start(self):
        self.warmup = warmup(self.optimizers["optimizer"], self.train_data) if self.state.epoch == 0 else None

    def on_step_end(self, losses):
        if self.warmup is not None:
            self.warmup.step()

    def on_save_checkpoint(self, checkpoint):
        checkpoint["warmup"] = self.warmup.state_dict() if self.warmup is not None else None


class DetectionMadeBeforeLoading(Detection):
    """To resume within epoch 0 (whose ``on_epoch_start`` a resumed run does not call again), the warmup is made
    with the optimizer, before any batch as in the source, and dropped after epoch 0. A resumed run so makes it before
    the checkpoint's learning rates are loaded over the ones its constructor scaled; made in ``on_load_checkpoint``,
    which runs after them, it would scale the loaded rate by ``start_factor`` once more."""

    def configure_optimizers(self):
        returned = super().configure_optimizers()
        self.warmup = warmup(returned["optimizer"], self.train_data)
        return returned

    def on_epoch_start(self):
        if self.state.epoch > 0:
            self.warmup = None

    def on_load_checkpoint(self, checkpoint):
        if checkpoint["warmup"] is None:
            self.warmup = None
        else:
            self.warmup.load_state_dict(checkpoint["warmup"])


@pytest.mark.parametrize("port", [Detection, DetectionMadeBeforeLoading], ids=["made_in_on_epoch_start",
                                                                                "made_with_the_optimizer"])
@pytest.mark.parametrize("check", checks())
def test_detection_warmup_per_iteration_beside_a_multistep_schedule(check, port):
    compare(classifier, detection_hand, port, fixed(labelled(DET_BATCHES)), check, steps=DET_EPOCHS * DET_BATCHES)


@pytest.mark.parametrize("stop", [2, 5, 7], ids=["mid_warmup", "at_the_warmup_end", "after_the_warmup"])
@pytest.mark.filterwarnings("error")
def test_detection_warmup_made_with_the_optimizer_resumed(tmp_path, stop):
    straight, resumed = straight_and_resumed(tmp_path, classifier, DetectionMadeBeforeLoading,
                                             fixed(labelled(DET_BATCHES)), DET_EPOCHS * DET_BATCHES, stop)
    assert_same(resumed.model, straight.model)


# -- ildoonet/pytorch-gradual-warmup-lr: a scheduler holding another ---------------------------------------------
class GradualWarmupScheduler(torch.optim.lr_scheduler.LRScheduler):
    """ Gradually warm-up(increasing) learning rate in optimizer.
    Proposed in 'Accurate, Large Minibatch SGD: Training ImageNet in 1 Hour'.
    """

    def __init__(self, optimizer, multiplier, total_epoch, after_scheduler=None):
        self.multiplier = multiplier
        if self.multiplier < 1.:
            raise ValueError('multiplier should be greater thant or equal to 1.')
        self.total_epoch = total_epoch
        self.after_scheduler = after_scheduler
        self.finished = False
        super(GradualWarmupScheduler, self).__init__(optimizer)

    def get_lr(self):
        if self.last_epoch > self.total_epoch:
            if self.after_scheduler:
                if not self.finished:
                    self.after_scheduler.base_lrs = [base_lr * self.multiplier for base_lr in self.base_lrs]
                    self.finished = True
                return self.after_scheduler.get_last_lr()
            return [base_lr * self.multiplier for base_lr in self.base_lrs]

        if self.multiplier == 1.0:
            return [base_lr * (float(self.last_epoch) / self.total_epoch) for base_lr in self.base_lrs]
        else:
            return [base_lr * ((self.multiplier - 1.) * self.last_epoch / self.total_epoch + 1.)
                    for base_lr in self.base_lrs]

    def step(self, epoch=None, metrics=None):
        if self.finished and self.after_scheduler:
            if epoch is None:
                self.after_scheduler.step(None)
            else:
                self.after_scheduler.step(epoch - self.total_epoch)
            self._last_lr = self.after_scheduler.get_last_lr()
        else:
            return super(GradualWarmupScheduler, self).step(epoch)


GW_EPOCHS, GW_WARMUP, GW_BATCHES = 6, 2, 3


def gradual_warmup_optimizer(model):
    optim = torch.optim.SGD(model.parameters(), 0.1)
    # scheduler_warmup is chained with lr_schduler
    lr_schduler = torch.optim.lr_scheduler.CosineAnnealingLR(optim, T_max=GW_EPOCHS - GW_WARMUP, eta_min=0.02)
    scheduler_warmup = GradualWarmupScheduler(optim, multiplier=1, total_epoch=GW_WARMUP, after_scheduler=lr_schduler)
    # this zero gradient update is needed to avoid a warning message, issue #8.
    optim.zero_grad()
    optim.step()
    scheduler_warmup.step()
    return optim, scheduler_warmup


def gradual_warmup_hand(model, loader):
    optim, scheduler_warmup = gradual_warmup_optimizer(model)
    for epoch in range(GW_EPOCHS):
        for x, y in loader:
            optim.zero_grad()
            F.cross_entropy(model(x), y).backward()
            optim.step()
        scheduler_warmup.step()


class GradualWarmup(Trainer):
    def configure_optimizers(self):
        optim, scheduler_warmup = gradual_warmup_optimizer(self.model)
        return {"optimizer": optim, "lr_scheduler": {"scheduler": scheduler_warmup, "interval": "epoch"}}

    def training_step(self, batch):
        x, y = batch
        return F.cross_entropy(self.model(x), y)


@pytest.mark.parametrize("check", checks())
def test_gradual_warmup_handing_over_to_cosine(check):
    compare(classifier, gradual_warmup_hand, GradualWarmup, fixed(labelled(GW_BATCHES)), check,
            steps=GW_EPOCHS * GW_BATCHES)


def test_a_scheduler_state_holding_a_scheduler_object_is_named_when_saved(tmp_path):
    """The save refuses it (no file written): before, every checkpoint was written and none could be read back."""
    torch.manual_seed(0)
    trainer = GradualWarmup(model=classifier(), train_data=labelled(GW_BATCHES), max_steps=2, device="cpu",
                            progress=False, loggers=(), checkpoint={"dir": str(tmp_path)})
    with pytest.raises(CheckpointError, match=r"scheduler 'optimizer''s state_dict\(\)\['after_scheduler'\] holds a "
                                              r"torch.optim.lr_scheduler.CosineAnnealingLR, which a checkpoint cannot "
                                              r"hold .*chain schedulers with SequentialLR"):
        trainer.fit()
    assert not list(tmp_path.rglob("*.pt"))


# -- Lightning's fine-tuning example: parameter groups added at milestones ------------------------------------------
# BaseFinetuning's static helpers (lightning 2.5.0, src/lightning/pytorch/callbacks/finetuning.py)
def flatten_modules(modules):
    if isinstance(modules, nn.ModuleDict):
        modules = modules.values()
    if isinstance(modules, Iterable):
        _flatten_modules = []
        for m in modules:
            _flatten_modules.extend(flatten_modules(m))
        _modules = iter(_flatten_modules)
    else:
        _modules = modules.modules()
    # Capture all leaf modules as well as parent modules that have parameters directly themselves
    return [m for m in _modules if not list(m.children()) or m._parameters]


def filter_params(modules, train_bn=True, requires_grad=True):
    for mod in flatten_modules(modules):
        if isinstance(mod, nn.modules.batchnorm._BatchNorm) and not train_bn:
            continue
        # recursion could yield duplicate parameters for parent modules w/ parameters so disabling it
        for param in mod.parameters(recurse=False):
            if param.requires_grad == requires_grad:
                yield param


def make_trainable(modules):
    for module in flatten_modules(modules):
        if isinstance(module, nn.modules.batchnorm._BatchNorm):
            module.track_running_stats = True
        for param in module.parameters(recurse=False):
            param.requires_grad = True


def freeze(modules, train_bn=True):
    for mod in flatten_modules(modules):
        if isinstance(mod, nn.modules.batchnorm._BatchNorm) and train_bn:
            make_trainable(mod)
        else:
            for param in mod.parameters(recurse=False):
                param.requires_grad = False


def filter_on_optimizer(optimizer, params):
    return [param for param in params
            if not any(torch.equal(p, param) for group in optimizer.param_groups for p in group["params"])]


def unfreeze_and_add_param_group(modules, optimizer, lr=None, initial_denom_lr=10.0, train_bn=True):
    make_trainable(modules)
    params_lr = optimizer.param_groups[0]["lr"] if lr is None else float(lr)
    denom_lr = initial_denom_lr if lr is None else 1.0
    params = filter_params(modules, train_bn=train_bn, requires_grad=True)
    params = filter_on_optimizer(optimizer, params)
    if params:
        optimizer.add_param_group({"params": params, "lr": params_lr / denom_lr})


FT_EPOCHS, FT_BATCHES, FT_MILESTONES = 3, 3, (1, 2)


class TransferNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.feature_extractor = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU())
        self.fc = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 3))

    def forward(self, x):
        return self.fc(self.feature_extractor(x))


def transfer_net():
    net = TransferNet()
    freeze(net.feature_extractor, train_bn=False)  # MilestonesFinetuning.freeze_before_training
    return net


def transfer_optimizer(model):
    trainable_parameters = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.Adam(trainable_parameters, lr=1e-2)
    return optimizer, torch.optim.lr_scheduler.MultiStepLR(optimizer, milestones=FT_MILESTONES, gamma=0.1)


def finetune_function(model, epoch, optimizer):
    if epoch == FT_MILESTONES[0]:
        unfreeze_and_add_param_group(modules=model.feature_extractor[-2:], optimizer=optimizer, train_bn=False)
    elif epoch == FT_MILESTONES[1]:
        unfreeze_and_add_param_group(modules=model.feature_extractor[:-2], optimizer=optimizer, train_bn=False)


def transfer_hand(model, loader):
    """Lightning's loop for the example: BaseFinetuning.on_train_epoch_start runs finetune_function, the batches,
    MultiStepLR at the epoch's end."""
    optimizer, scheduler = transfer_optimizer(model)
    for epoch in range(FT_EPOCHS):
        finetune_function(model, epoch, optimizer)
        for x, y in loader:
            optimizer.zero_grad()
            F.cross_entropy(model(x), y).backward()
            optimizer.step()
        scheduler.step()


class Transfer(Trainer):
    def configure_optimizers(self):
        optimizer, scheduler = transfer_optimizer(self.model)
        return {"optimizer": optimizer, "lr_scheduler": scheduler}

    def training_step(self, batch):
        x, y = batch
        return F.cross_entropy(self.model(x), y)

    def on_epoch_start(self):
        finetune_function(self.model, self.state.epoch, self.optimizers["optimizer"])


class TransferGroupsPutBack(Transfer):
    """What ``BaseFinetuning`` does on a restart, before the optimizer's state is loaded: the milestones passed
    unfreeze their layers and add their groups again (the only place a port can: ``load_state_dict`` itself)."""

    def load_state_dict(self, checkpoint, path=None):
        for epoch in range(checkpoint["state"]["epoch"] + 1):
            if epoch < checkpoint["state"]["epoch"] or checkpoint["state"]["batch_in_epoch"]:
                finetune_function(self.model, epoch, self.optimizers["optimizer"])
        super().load_state_dict(checkpoint, path)


@pytest.mark.parametrize("check", checks())
def test_lightning_finetuning_milestones_with_groups_added_mid_run(check):
    compare(transfer_net, transfer_hand, Transfer, fixed(labelled(FT_BATCHES)), check, steps=FT_EPOCHS * FT_BATCHES)


@pytest.mark.filterwarnings("error")
def test_lightning_finetuning_milestones_resumed_after_a_milestone_says_to_add_the_groups_before_loading(tmp_path):
    """The checkpoint's Adam has the groups added at the milestones, the resumed run's the one configure_optimizers
    made, and on_load_checkpoint runs after the loading: the error says how to add them back first (the test below
    does so and resumes bit for bit)."""
    with pytest.raises(CheckpointError, match=r"parameters per group: \[4, 2\] saved, \[4\] now\): its last groups "
                                              r"were added during the run \(add_param_group.*override "
                                              r"load_state_dict\(self, checkpoint, path=None\) to add them"):
        straight_and_resumed(tmp_path, transfer_net, Transfer, fixed(labelled(FT_BATCHES)), FT_EPOCHS * FT_BATCHES, 5)


@pytest.mark.parametrize("stop", [3, 5, 7], ids=["at_the_first_milestone", "after_it", "after_the_second"])
@pytest.mark.filterwarnings("error")
def test_lightning_finetuning_milestones_resumed_with_the_groups_put_back_before_loading(tmp_path, stop):
    straight, resumed = straight_and_resumed(tmp_path, transfer_net, TransferGroupsPutBack,
                                             fixed(labelled(FT_BATCHES)), FT_EPOCHS * FT_BATCHES, stop)
    assert_same(resumed.model, straight.model)
    assert [len(g["params"]) for g in resumed.optimizers["optimizer"].param_groups] == [4, 2, 2]


# -- YOLOv5: warmup of rate, momentum and accumulation per batch, a LambdaLR per epoch ------------------------------
YOLO_HYP = {"lr0": 0.01, "lrf": 0.01, "momentum": 0.937, "weight_decay": 5e-4, "warmup_epochs": 1.0,
            "warmup_momentum": 0.8, "warmup_bias_lr": 0.1}
YOLO_EPOCHS, YOLO_NB, YOLO_BATCH, YOLO_NBS = 3, 4, 8, 32


def yolo_optimizer(model, hyp=YOLO_HYP, epochs=YOLO_EPOCHS):
    g0, g1, g2 = [], [], []  # optimizer parameter groups
    for v in model.modules():
        if hasattr(v, 'bias') and isinstance(v.bias, nn.Parameter):  # bias
            g2.append(v.bias)
        if isinstance(v, nn.BatchNorm1d):  # weight (no decay)
            g0.append(v.weight)
        elif hasattr(v, 'weight') and isinstance(v.weight, nn.Parameter):  # weight (with decay)
            g1.append(v.weight)
    optimizer = torch.optim.SGD(g0, lr=hyp['lr0'], momentum=hyp['momentum'], nesterov=True)
    optimizer.add_param_group({'params': g1, 'weight_decay': hyp['weight_decay']})  # add g1 with weight_decay
    optimizer.add_param_group({'params': g2})  # add g2 (biases)
    lf = lambda x: (1 - x / epochs) * (1.0 - hyp['lrf']) + hyp['lrf']  # linear  # noqa: E731
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda=lf)
    return optimizer, scheduler, lf


def yolo_warmup(optimizer, ni, nw, epoch, lf, hyp=YOLO_HYP):
    """The ``if ni <= nw:`` block: the accumulation count it sets, the groups' rate and momentum."""
    xi = [0, nw]  # x interp
    accumulate = max(1, np.interp(ni, xi, [1, YOLO_NBS / YOLO_BATCH]).round())
    for j, x in enumerate(optimizer.param_groups):
        # bias lr falls from 0.1 to lr0, all other lrs rise from 0.0 to lr0
        x['lr'] = np.interp(ni, xi, [hyp['warmup_bias_lr'] if j == 2 else 0.0, x['initial_lr'] * lf(epoch)])
        if 'momentum' in x:
            x['momentum'] = np.interp(ni, xi, [hyp['warmup_momentum'], hyp['momentum']])
    return accumulate


def compute_loss(pred, targets):
    return F.cross_entropy(pred, targets) * len(targets)  # loss scaled by batch_size


def yolo_hand(model, train_loader, epochs=YOLO_EPOCHS, hyp=YOLO_HYP):
    optimizer, scheduler, lf = yolo_optimizer(model)
    accumulate = max(round(YOLO_NBS / YOLO_BATCH), 1)  # accumulate loss before optimizing
    nb = len(train_loader)  # number of batches
    nw = round(hyp['warmup_epochs'] * nb)  # number of warmup iterations
    last_opt_step = -1
    scheduler.last_epoch = 0 - 1  # do not move
    for epoch in range(0, epochs):
        model.train()
        optimizer.zero_grad()
        for i, (imgs, targets) in enumerate(train_loader):
            ni = i + nb * epoch  # number integrated batches (since train start)
            # Warmup
            if ni <= nw:
                accumulate = yolo_warmup(optimizer, ni, nw, epoch, lf)
            # Forward
            pred = model(imgs)  # forward
            loss = compute_loss(pred, targets)  # loss scaled by batch_size
            # Backward
            loss.backward()
            # Optimize
            if ni - last_opt_step >= accumulate:
                optimizer.step()
                optimizer.zero_grad()
                last_opt_step = ni
        # Scheduler
        scheduler.step()


class YOLO(Trainer):
    automatic = False

    def configure_optimizers(self):
        optimizer, scheduler, self.lf = yolo_optimizer(self.model)
        self.accumulate, self.last_opt_step = max(round(YOLO_NBS / YOLO_BATCH), 1), -1
        scheduler.last_epoch = 0 - 1  # do not move (the first step() gives lf(0) again: one epoch behind)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "epoch"}}

    def on_epoch_start(self):
        self.optimizers["optimizer"].zero_grad()

    def training_step(self, batch):
        imgs, targets = batch
        nb, epoch = len(self.train_data), self.state.epoch
        ni = self.state.batch_in_epoch - 1 + nb * epoch
        nw = round(YOLO_HYP['warmup_epochs'] * nb)
        if ni <= nw:
            self.accumulate = yolo_warmup(self.optimizers["optimizer"], ni, nw, epoch, self.lf)
        loss = compute_loss(self.model(imgs), targets)
        self.backward(loss)
        if ni - self.last_opt_step >= self.accumulate:
            self.step()
            self.last_opt_step = ni
        return loss

    def on_save_checkpoint(self, checkpoint):
        checkpoint["yolo"] = {"accumulate": float(self.accumulate), "last_opt_step": self.last_opt_step}

    def on_load_checkpoint(self, checkpoint):
        self.accumulate, self.last_opt_step = checkpoint["yolo"]["accumulate"], checkpoint["yolo"]["last_opt_step"]


def yolo_data():
    return fixed(labelled(YOLO_NB))


@pytest.mark.parametrize("check", checks())
def test_yolov5_warmup_of_rate_momentum_and_accumulation(check):
    compare(bn_classifier, yolo_hand, YOLO, yolo_data(), check, steps=YOLO_EPOCHS * YOLO_NB)


@pytest.mark.parametrize("stop", [2, 4, 5, 7], ids=["mid_warmup_pending", "at_a_pass_end_pending",
                                                  "after_the_warmup_pending", "mid_pass"])
@pytest.mark.filterwarnings("error")
def test_yolov5_warmup_resumed(tmp_path, stop):
    """Stopped with a batch's gradients pending (the update waits for ``accumulate``), including at a pass's end,
    where the next pass's ``zero_grad`` drops them in both runs."""
    straight, resumed = straight_and_resumed(tmp_path, bn_classifier, YOLO, yolo_data(), YOLO_EPOCHS * YOLO_NB, stop)
    assert_same(resumed.model, straight.model)
    assert [g["momentum"] for g in resumed.optimizers["optimizer"].param_groups] == [YOLO_HYP["momentum"]] * 3


# -- a run continued past its checkpoint with a longer schedule -----------------------------------------------------
class CosineOverTheRun(Trainer):
    """``CosineAnnealingLR(T_max=<the run's steps>)``, continued as docs/checkpoints.md shows
    (``trainer.resume=ckpt/exp1 trainer.max_steps=2000``: "a new run from there")."""

    momentum = 0.9

    def configure_optimizers(self):
        optimizer = torch.optim.SGD(self.model.parameters(), lr=0.1, momentum=self.momentum)
        scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=self.settings.max_steps)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def training_step(self, batch):
        x, y = batch
        return F.cross_entropy(self.model(x), y)


class CosineOverTheRunOtherMomentum(CosineOverTheRun):
    momentum = 0.8


def continued(tmp_path, second):
    for trainer, steps, resume in ((CosineOverTheRun, 4, None), (second, 8, str(tmp_path))):
        torch.manual_seed(0)
        run = trainer(model=classifier(), train_data=labelled(4), max_steps=steps, device="cpu", progress=False,
                      loggers=(), checkpoint={"dir": str(tmp_path)} if resume is None else False, resume=resume)
        run.fit()
    return run


def test_a_changed_optimizer_setting_is_logged_when_a_run_is_continued(tmp_path, caplog):
    caplog.set_level(logging.WARNING, logger="safeloop")
    continued(tmp_path, CosineOverTheRunOtherMomentum)
    assert any("momentum 0.9 (this run: 0.8)" in r.getMessage() for r in caplog.records)


def test_a_changed_scheduler_setting_is_logged_when_a_run_is_continued(tmp_path, caplog):
    """T_max stays the stopped run's 4 (the rate climbs back to 0.1 over steps 5-8), as an optimizer's setting
    stays the checkpoint's; both are logged."""
    caplog.set_level(logging.WARNING, logger="safeloop")
    run = continued(tmp_path, CosineOverTheRun)
    assert run.schedulers["optimizer"].T_max == 4  # the checkpoint's, as a hand loop's load_state_dict gives it
    assert any(re.search(r"resume: scheduler 'optimizer' of .* was made with T_max 4 \(this run: 8\): "
                         r"the checkpoint's values are used", r.getMessage()) for r in caplog.records), \
        [r.getMessage() for r in caplog.records]


# -- The Annotated Transformer: the Noam schedule stepped every batch, updates every accum_iter batches --------------
AT_D_MODEL, AT_WARMUP, AT_ACCUM, AT_EPOCHS, AT_BATCHES = 8, 3, 2, 2, 4


def rate(step, model_size, factor, warmup):
    """
    we have to default the step to 1 for LambdaLR function
    to avoid zero raising to negative power.
    """
    if step == 0:
        step = 1
    return factor * (
        model_size ** (-0.5) * min(step ** (-0.5), step * warmup ** (-1.5))
    )


def annotated_optimizer(model):
    optimizer = torch.optim.Adam(model.parameters(), lr=1.0, betas=(0.9, 0.98), eps=1e-9)
    lr_scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer=optimizer, lr_lambda=lambda step: rate(step, AT_D_MODEL, factor=1, warmup=AT_WARMUP))
    return optimizer, lr_scheduler


def run_epoch(data_iter, model, optimizer, scheduler, accum_iter=1):
    """``run_epoch`` in "train" mode, its statistics left out; cross entropy for ``SimpleLossCompute``."""
    for i, (x, y) in enumerate(data_iter):
        loss_node = F.cross_entropy(model(x), y)
        loss_node.backward()
        if i % accum_iter == 0:
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        scheduler.step()


def annotated_hand(model, train_dataloader):
    optimizer, lr_scheduler = annotated_optimizer(model)
    for epoch in range(AT_EPOCHS):
        model.train()
        run_epoch(train_dataloader, model, optimizer, lr_scheduler, accum_iter=AT_ACCUM)


class Annotated(Trainer):
    automatic = False

    def configure_optimizers(self):
        optimizer, self.lr_scheduler = annotated_optimizer(self.model)
        return optimizer

    def training_step(self, batch):
        x, y = batch
        loss_node = F.cross_entropy(self.model(x), y)
        self.backward(loss_node)
        if (self.state.batch_in_epoch - 1) % AT_ACCUM == 0:
            self.step()
        return loss_node

    def on_step_end(self, losses):
        self.lr_scheduler.step()

    def on_save_checkpoint(self, checkpoint):
        checkpoint["lr_scheduler"] = self.lr_scheduler.state_dict()

    def on_load_checkpoint(self, checkpoint):
        self.lr_scheduler.load_state_dict(checkpoint["lr_scheduler"])


@pytest.mark.parametrize("check", checks())
def test_annotated_transformer_noam_schedule_stepped_every_batch(check):
    compare(classifier, annotated_hand, Annotated, fixed(labelled(AT_BATCHES)), check, steps=AT_EPOCHS * AT_BATCHES)


@pytest.mark.parametrize("stop", [2, 4, 5], ids=["pending", "pending_at_a_pass_end", "after_a_carried_update"])
@pytest.mark.filterwarnings("error")
def test_annotated_transformer_noam_schedule_resumed(tmp_path, stop):
    """Stopped with a batch's gradients waiting, among them a pass's last batch, whose gradients the next pass's
    first update takes."""
    straight, resumed = straight_and_resumed(tmp_path, classifier, Annotated, fixed(labelled(AT_BATCHES)),
                                             AT_EPOCHS * AT_BATCHES, stop)
    assert_same(resumed.model, straight.model)
    assert resumed.lr_scheduler.state_dict() == straight.lr_scheduler.state_dict()


class AnnotatedUnsaved(Annotated):
    """The port without its two checkpoint hooks: the LambdaLR stepped in ``on_step_end`` is in no checkpoint."""

    on_save_checkpoint = Trainer.on_save_checkpoint
    on_load_checkpoint = Trainer.on_load_checkpoint


def test_a_scheduler_kept_on_the_trainer_and_left_out_of_checkpoints_is_named(tmp_path):
    """Stepped in a hook (the docs' way for one the Trainer does not step) and in no checkpoint, it is named at the
    save, as a module or tensor changed during the fit is: the run resumed from it would restart the schedule."""
    with pytest.warns(ConfigWarning, match=r"trainer.lr_scheduler \(LambdaLR\) stepped during this fit, and checkpoints "
                                           r"do not hold its state"):
        straight_and_resumed(tmp_path, classifier, AnnotatedUnsaved, fixed(labelled(AT_BATCHES)),
                             AT_EPOCHS * AT_BATCHES, 4)
