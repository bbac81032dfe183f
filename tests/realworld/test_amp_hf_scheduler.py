"""A schedule that does not move when the GradScaler skips an update, as Hugging Face's Trainer steps it:
huggingface/transformers, src/transformers/trainer.py at v4.26.0
(https://github.com/huggingface/transformers/blob/v4.26.0/src/transformers/trainer.py, ``_inner_training_loop``):
``scaler.unscale_(optimizer)`` and ``clip_grad_norm_(model.parameters(), args.max_grad_norm)``, then
``scale_before = self.scaler.get_scale()``, ``scaler.step``, ``scaler.update()``, ``optimizer_was_run =
scale_before <= scale_after`` and ``if optimizer_was_run: self.lr_scheduler.step()``, ``model.zero_grad()``; the
schedule is ``get_linear_schedule_with_warmup`` (src/transformers/optimization.py: a ``LambdaLR`` of
``lr_lambda``). Later versions keep the rule through Accelerate (``optimizer_was_run = not
self.accelerator.optimizer_step_was_skipped``).

Changes for a seconds-long test: an MLP on random regression batches (8 of 8), AdamW, 2 warm-up steps of 8; the
first batch and the fifth drawn 1000 times wider, so that their updates overflow and are skipped; the CPU:
``torch.autocast("cpu", dtype=torch.float16)`` and ``torch.amp.GradScaler("cpu")``; no accumulation, logging,
evaluation or saving.

The Trainer steps a scheduler it holds after every update it attempts, the skipped ones included (as timm's and
nanoGPT's loops step theirs, ``test_amp_timm``): Hugging Face's rule is ported by keeping the schedule out of
``configure_optimizers`` and stepping it in ``on_step_end`` when the scale did not drop.
"""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.optim.lr_scheduler import LambdaLR

from safeloop import Trainer

from .harness import checks, compare_runs

STEPS, WARMUP, MAX_GRAD_NORM = 8, 2, 1.0
WIDE = (0, 4)


def get_linear_schedule_with_warmup(optimizer, num_warmup_steps, num_training_steps, last_epoch=-1):
    def lr_lambda(current_step: int):
        if current_step < num_warmup_steps:
            return float(current_step) / float(max(1, num_warmup_steps))
        return max(
            0.0, float(num_training_steps - current_step) / float(max(1, num_training_steps - num_warmup_steps))
        )

    return LambdaLR(optimizer, lr_lambda, last_epoch)


def make_model():
    return nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 2))


def make_optimizer(params):
    return torch.optim.AdamW(params, lr=5e-2)


class Batches(list):
    def __init__(self):
        gen = torch.Generator().manual_seed(23)
        super().__init__((torch.randn(8, 4, generator=gen) * (1000 if i in WIDE else 1),
                          torch.randn(8, 2, generator=gen)) for i in range(STEPS))
        self.lrs = []


def hf_hand(model, loader):
    optimizer = make_optimizer(model.parameters())
    lr_scheduler = get_linear_schedule_with_warmup(optimizer, WARMUP, STEPS)
    scaler = torch.amp.GradScaler("cpu")
    model.zero_grad()
    for inputs, labels in loader:
        with torch.autocast("cpu", dtype=torch.float16):
            loss = F.mse_loss(model(inputs), labels)
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        nn.utils.clip_grad_norm_(model.parameters(), MAX_GRAD_NORM)
        optimizer_was_run = True
        scale_before = scaler.get_scale()
        scaler.step(optimizer)
        scaler.update()
        scale_after = scaler.get_scale()
        optimizer_was_run = scale_before <= scale_after
        if optimizer_was_run:
            lr_scheduler.step()
        model.zero_grad()
        loader.lrs.append(optimizer.param_groups[0]["lr"])


class HFPort(Trainer):
    def configure_optimizers(self):
        optimizer = make_optimizer(self.model.parameters())
        self.lr_scheduler = get_linear_schedule_with_warmup(optimizer, WARMUP, STEPS)
        return optimizer

    def training_step(self, batch):
        inputs, labels = batch
        return F.mse_loss(self.model(inputs), labels)

    def on_step_start(self):
        self.scale_before = self.scaler.get_scale()

    def on_step_end(self, losses):
        if self.scale_before <= self.scaler.get_scale():
            self.lr_scheduler.step()
        self.train_data.lrs.append(self.optimizers["optimizer"].param_groups[0]["lr"])


class HFPortWithTheTrainersScheduler(HFPort):
    def configure_optimizers(self):
        optimizer = make_optimizer(self.model.parameters())
        return {"optimizer": optimizer, "lr_scheduler": {
            "scheduler": get_linear_schedule_with_warmup(optimizer, WARMUP, STEPS), "interval": "step"}}

    def on_step_end(self, losses):
        self.train_data.lrs.append(self.optimizers["optimizer"].param_groups[0]["lr"])


@pytest.mark.parametrize("check", checks())
def test_hf_schedule_held_while_the_scaler_skips(check):
    runs = compare_runs(make_model, hf_hand, HFPort, Batches, check, steps=STEPS, precision="16-mixed",
                        grad_clip=MAX_GRAD_NORM)
    hand, watched, port = (run.lrs for run in runs)
    assert watched == hand and port == hand
    assert hand[0] == 0.0 and hand[1] > 0.0, "the first update was not skipped: the schedule would have moved"


def test_the_trainers_scheduler_steps_on_the_skipped_updates_too():
    torch.manual_seed(0)
    model = make_model()
    data = Batches()
    trainer = HFPortWithTheTrainersScheduler(model=model, train_data=data, max_steps=STEPS, device="cpu",
                                             progress=False, loggers=(), precision="16-mixed",
                                             grad_clip=MAX_GRAD_NORM)
    with pytest.warns(UserWarning, match=r"Detected call of `lr_scheduler.step\(\)` before `optimizer.step\(\)`"):
        trainer.fit()
    assert data.lrs[0] > 0.0  # moved on the skipped first update
