"""torchvision's classification recipe with an EMA model: pytorch/vision, references/classification/utils.py
(``ExponentialMovingAverage``) and references/classification/train.py (``train_one_epoch``, ``evaluate``, and in
``main`` the EMA decay adjustment and the warmup-then-cosine ``SequentialLR``), as on its main branch.

``ExponentialMovingAverage`` is an ``AveragedModel`` with ``use_buffers=True``: a deep copy whose parameters
*and* buffers (BatchNorm's running statistics and ``num_batches_tracked``) are averaged under ``no_grad`` through
``p_averaged.detach().copy_(avg_fn(...))``, its ``n_averaged`` counter a buffer too. It is updated every
``model_ema_steps`` batches of an epoch (counted from each epoch's first), and during the warmup epochs its
``n_averaged`` is reset to 0 with ``fill_`` after each update, so that the next update copies the weights again.
The loss uses label smoothing; gradients are clipped by norm; the schedule steps once an epoch; the EMA model is
evaluated after each epoch under ``inference_mode``.

Changes for a seconds-long test: a small conv net with BatchNorm for the ResNet, 3 epochs of 3 batches of 4
2x6x6 images, ``model_ema_steps`` 2 (32), ``lr_warmup_epochs`` 1 (0) so that the reset happens, a decay from the
adjustment formula with ``world_size`` 1; no mixup/cutmix, AMP, distributed runs, logging or checkpoints.

The port updates the EMA model in ``on_step_end`` (``state.batch_in_epoch - 1`` is the loop's ``i``) and
evaluates it in ``on_epoch_end``; the Trainer steps the ``SequentialLR`` once an epoch.
"""
import copy
import warnings

import pytest
import torch
import torch.nn as nn

from safeloop import GraphGuard, Trainer
from safeloop.watch import Watch

from .harness import assert_same, checks, strict

EPOCHS, BATCHES, BATCH_SIZE = 3, 3, 4
LR, MOMENTUM, WEIGHT_DECAY, LABEL_SMOOTHING, CLIP_GRAD_NORM = 0.5, 0.9, 1e-4, 0.1, 1.0
LR_WARMUP_EPOCHS, LR_WARMUP_DECAY, MODEL_EMA_STEPS, MODEL_EMA_DECAY, WORLD_SIZE = 1, 0.01, 2, 0.99998, 1


# -- references/classification/utils.py ---------------------------------------------------------------------
class ExponentialMovingAverage(torch.optim.swa_utils.AveragedModel):
    """Maintains moving averages of model parameters using an exponential decay.
    ``ema_avg = decay * avg_model_param + (1 - decay) * model_param``
    `torch.optim.swa_utils.AveragedModel <https://pytorch.org/docs/stable/optim.html#custom-averaging-strategies>`_
    is used to compute the EMA.
    """

    def __init__(self, model, decay, device="cpu"):
        def ema_avg(avg_model_param, model_param, num_averaged):
            return decay * avg_model_param + (1 - decay) * model_param

        super().__init__(model, device, ema_avg, use_buffers=True)


# -- references/classification/train.py --------------------------------------------------------------------
def train_one_epoch(model, criterion, optimizer, data_loader, device, epoch, model_ema=None):
    model.train()
    for i, (image, target) in enumerate(data_loader):
        image, target = image.to(device), target.to(device)
        output = model(image)
        loss = criterion(output, target)

        optimizer.zero_grad()
        loss.backward()
        nn.utils.clip_grad_norm_(model.parameters(), CLIP_GRAD_NORM)
        optimizer.step()

        if model_ema and i % MODEL_EMA_STEPS == 0:
            model_ema.update_parameters(model)
            if epoch < LR_WARMUP_EPOCHS:
                # Reset ema buffer to keep copying weights during warmup period
                model_ema.n_averaged.fill_(0)


def evaluate(model, criterion, data_loader, device):
    model.eval()
    total = 0.0
    with torch.inference_mode():
        for image, target in data_loader:
            output = model(image.to(device))
            total += criterion(output, target.to(device)).item()
    return total / len(data_loader)


def make_net():
    return nn.Sequential(nn.Conv2d(2, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(inplace=True),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, 3))


def make_ema(model):
    adjust = WORLD_SIZE * BATCH_SIZE * MODEL_EMA_STEPS / EPOCHS
    alpha = 1.0 - MODEL_EMA_DECAY
    alpha = min(1.0, alpha * adjust)
    return ExponentialMovingAverage(model, device=torch.device("cpu"), decay=1.0 - alpha)


def make_optimizer_and_scheduler(model):
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM, weight_decay=WEIGHT_DECAY)
    main_lr_scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=EPOCHS - LR_WARMUP_EPOCHS)
    warmup_lr_scheduler = torch.optim.lr_scheduler.LinearLR(optimizer, start_factor=LR_WARMUP_DECAY,
                                                            total_iters=LR_WARMUP_EPOCHS)
    lr_scheduler = torch.optim.lr_scheduler.SequentialLR(
        optimizer, schedulers=[warmup_lr_scheduler, main_lr_scheduler], milestones=[LR_WARMUP_EPOCHS])
    return optimizer, lr_scheduler


def classification_hand(model, data_loader):
    device = torch.device("cpu")
    criterion = nn.CrossEntropyLoss(label_smoothing=LABEL_SMOOTHING)
    optimizer, lr_scheduler = make_optimizer_and_scheduler(model)
    model_ema = make_ema(model)
    for epoch in range(0, EPOCHS):
        train_one_epoch(model, criterion, optimizer, data_loader, device, epoch, model_ema)
        lr_scheduler.step()
        evaluate(model_ema, criterion, data_loader, device=device)
    return model_ema


class ClassificationTrainer(Trainer):
    def configure_optimizers(self):
        self.criterion = nn.CrossEntropyLoss(label_smoothing=LABEL_SMOOTHING)
        self.model_ema = make_ema(self.model)
        optimizer, lr_scheduler = make_optimizer_and_scheduler(self.model)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": lr_scheduler, "interval": "epoch"}}

    def training_step(self, batch):
        image, target = batch
        return self.criterion(self.model(image), target)

    def on_step_end(self, losses):
        i, epoch = self.state.batch_in_epoch - 1, self.state.epoch
        if i % MODEL_EMA_STEPS == 0:
            self.model_ema.update_parameters(self.model)
            if epoch < LR_WARMUP_EPOCHS:
                self.model_ema.n_averaged.fill_(0)

    def on_epoch_end(self):
        self.log("ema_loss", evaluate(self.model_ema, self.criterion, self.eval_data, torch.device("cpu")))
        self.model.train()


def images():
    gen = torch.Generator().manual_seed(4)
    return [(torch.randn(BATCH_SIZE, 2, 6, 6, generator=gen), torch.randint(3, (BATCH_SIZE,), generator=gen))
            for _ in range(BATCHES)]


@pytest.mark.parametrize("check", checks())
def test_classification_recipe_with_an_ema_over_parameters_and_buffers(check):
    torch.manual_seed(0)
    ref = make_net()
    ours, watched, start = copy.deepcopy(ref), copy.deepcopy(ref), copy.deepcopy(ref)
    with warnings.catch_warnings(record=True) as own:
        warnings.simplefilter("always")
        ref_ema = classification_hand(ref, images())
    with strict(own), Watch(GraphGuard(check=check), classification_hand.__code__.co_filename):
        watched_ema = classification_hand(watched, images())
    assert_same(watched, ref)
    assert_same(watched_ema, ref_ema)
    with strict(own):
        trainer = ClassificationTrainer(model=ours, train_data=images(), max_epochs=EPOCHS, device="cpu",
                                        progress=False, loggers=(), guard={"check": check},
                                        grad_clip=CLIP_GRAD_NORM)
        trainer.eval_data = images()
        trainer.fit()
    assert trainer.state.step == EPOCHS * BATCHES
    assert_same(ours, ref)
    assert_same(trainer.model_ema, ref_ema)
    assert not torch.equal(ref[0].weight, start[0].weight)
    assert int(ref_ema.n_averaged) == 4  # reset to 0 in the warmup epoch, then batches 0 and 2 of two epochs
    assert not torch.equal(ref_ema.module[1].running_mean, ref[1].running_mean)  # the buffers averaged, not copied
