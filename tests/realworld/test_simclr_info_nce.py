"""SimCLR as sthalles/SimCLR trains it: commit 1848fc9, simclr.py (``SimCLR.info_nce_loss``, ``SimCLR.train``),
run.py (``main``: Adam, ``CosineAnnealingLR(T_max=len(train_loader))``), models/resnet_simclr.py (the projection
head put in place of the backbone's ``fc``) and utils.py (``accuracy``).

- Two views of each image concatenated into one batch through a backbone with BatchNorm; the InfoNCE logits
  built from the cosine similarity matrix by boolean masks (the diagonal dropped with ``~eye``, positives and
  negatives picked by ``labels.bool()`` and reshaped), the positive in column 0, cross-entropy to zeros.
- ``GradScaler(enabled=fp16_precision)`` around the backward and step, and ``autocast(enabled=...)`` around the
  forward (off: ``--fp16-precision`` is not given; torch.cuda.amp's, written as ``torch.amp``'s for the CPU).
- The schedule stepped once an epoch, and only from the eleventh epoch on (``if epoch_counter >= 10``: a warm-up
  at the base rate), with a ``T_max`` counted in batches; ``accuracy`` (top-1, top-5) and the rate read by
  ``scheduler.get_lr()`` (which warns outside ``step``) every ``log_every_n_steps``.

Changes for a seconds-long test: a two-conv backbone with BatchNorm and global pooling (ResNet-18) whose ``fc``
is replaced by the source's ``Sequential(Linear, ReLU, fc)``, ``out_dim`` 8 (128), 12 epochs (so that the
schedule moves twice) of 2 batches of 4 pairs of 3x8x8 views (the augmentations left out), ``log_every_n_steps``
3 (100), the writer's scalars kept as floats in a list (``SummaryWriter``); no checkpoint file.

The port keeps the schedule out of the Trainer (its stepping is conditional) and steps it in ``on_epoch_end``;
``training_step`` returns the loss and logs the accuracies with ``self.log`` every ``log_every_n_steps``.
"""
from types import SimpleNamespace

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from safeloop import Trainer

from .harness import checks, compare_runs

BATCH, VIEWS, OUT_DIM, EPOCHS, BATCHES, LOG_EVERY = 4, 2, 8, 12, 2, 3
ARGS = SimpleNamespace(batch_size=BATCH, n_views=VIEWS, device=torch.device("cpu"), temperature=0.07,
                       fp16_precision=False, epochs=EPOCHS, log_every_n_steps=LOG_EVERY, lr=3e-4, weight_decay=1e-4)


# -- models/resnet_simclr.py (a tiny backbone for torchvision's resnet18) -----------------------------------
class TinyResNet(nn.Module):
    def __init__(self, num_classes):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8), nn.ReLU(inplace=True),
            nn.Conv2d(8, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8), nn.ReLU(inplace=True),
            nn.AdaptiveAvgPool2d(1), nn.Flatten())
        self.fc = nn.Linear(8, num_classes)

    def forward(self, x):
        return self.fc(self.features(x))


class ResNetSimCLR(nn.Module):

    def __init__(self, out_dim=OUT_DIM):
        super(ResNetSimCLR, self).__init__()
        self.backbone = TinyResNet(num_classes=out_dim)
        dim_mlp = self.backbone.fc.in_features

        # add mlp projection head
        self.backbone.fc = nn.Sequential(nn.Linear(dim_mlp, dim_mlp), nn.ReLU(), self.backbone.fc)

    def forward(self, x):
        return self.backbone(x)


# -- utils.py -----------------------------------------------------------------------------------------------
def accuracy(output, target, topk=(1,)):
    """Computes the accuracy over the k top predictions for the specified values of k"""
    with torch.no_grad():
        maxk = max(topk)
        batch_size = target.size(0)

        _, pred = output.topk(maxk, 1, True, True)
        pred = pred.t()
        correct = pred.eq(target.view(1, -1).expand_as(pred))

        res = []
        for k in topk:
            correct_k = correct[:k].reshape(-1).float().sum(0, keepdim=True)
            res.append(correct_k.mul_(100.0 / batch_size))
        return res


class SummaryWriter:
    """What ``add_scalar`` keeps of a value: a float (tensorboard's ``make_np`` reads the tensor)."""

    def __init__(self):
        self.scalars = []

    def add_scalar(self, tag, scalar_value, global_step=None):
        self.scalars.append((tag, float(scalar_value), global_step))


# -- simclr.py, run.py --------------------------------------------------------------------------------------
class SimCLR(object):

    def __init__(self, *args, **kwargs):
        self.args = kwargs['args']
        self.model = kwargs['model'].to(self.args.device)
        self.optimizer = kwargs['optimizer']
        self.scheduler = kwargs['scheduler']
        self.writer = SummaryWriter()
        self.criterion = torch.nn.CrossEntropyLoss().to(self.args.device)

    def info_nce_loss(self, features):

        labels = torch.cat([torch.arange(self.args.batch_size) for i in range(self.args.n_views)], dim=0)
        labels = (labels.unsqueeze(0) == labels.unsqueeze(1)).float()
        labels = labels.to(self.args.device)

        features = F.normalize(features, dim=1)

        similarity_matrix = torch.matmul(features, features.T)

        # discard the main diagonal from both: labels and similarities matrix
        mask = torch.eye(labels.shape[0], dtype=torch.bool).to(self.args.device)
        labels = labels[~mask].view(labels.shape[0], -1)
        similarity_matrix = similarity_matrix[~mask].view(similarity_matrix.shape[0], -1)

        # select and combine multiple positives
        positives = similarity_matrix[labels.bool()].view(labels.shape[0], -1)

        # select only the negatives the negatives
        negatives = similarity_matrix[~labels.bool()].view(similarity_matrix.shape[0], -1)

        logits = torch.cat([positives, negatives], dim=1)
        labels = torch.zeros(logits.shape[0], dtype=torch.long).to(self.args.device)

        logits = logits / self.args.temperature
        return logits, labels

    def train(self, train_loader):

        scaler = torch.amp.GradScaler("cpu", enabled=self.args.fp16_precision)

        n_iter = 0

        for epoch_counter in range(self.args.epochs):
            for images, _ in train_loader:
                images = torch.cat(images, dim=0)

                images = images.to(self.args.device)

                with torch.autocast(self.args.device.type, enabled=self.args.fp16_precision):
                    features = self.model(images)
                    logits, labels = self.info_nce_loss(features)
                    loss = self.criterion(logits, labels)

                self.optimizer.zero_grad()

                scaler.scale(loss).backward()

                scaler.step(self.optimizer)
                scaler.update()

                if n_iter % self.args.log_every_n_steps == 0:
                    top1, top5 = accuracy(logits, labels, topk=(1, 5))
                    self.writer.add_scalar('loss', loss, global_step=n_iter)
                    self.writer.add_scalar('acc/top1', top1[0], global_step=n_iter)
                    self.writer.add_scalar('acc/top5', top5[0], global_step=n_iter)
                    self.writer.add_scalar('learning_rate', self.scheduler.get_lr()[0], global_step=n_iter)

                n_iter += 1

            # warmup for the first 10 epochs
            if epoch_counter >= 10:
                self.scheduler.step()


def make_optimizer_and_scheduler(model, train_loader):
    optimizer = torch.optim.Adam(model.parameters(), ARGS.lr, weight_decay=ARGS.weight_decay)

    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=len(train_loader), eta_min=0,
                                                           last_epoch=-1)
    return optimizer, scheduler


def simclr_hand(model, train_loader):
    optimizer, scheduler = make_optimizer_and_scheduler(model, train_loader)
    simclr = SimCLR(model=model, optimizer=optimizer, scheduler=scheduler, args=ARGS)
    simclr.train(train_loader)
    train_loader.rates = [group["lr"] for group in optimizer.param_groups]


class SimCLRTrainer(Trainer):
    def configure_optimizers(self):
        optimizer, self.scheduler = make_optimizer_and_scheduler(self.model, self.train_data)
        self.simclr = SimCLR(model=self.model, optimizer=optimizer, scheduler=self.scheduler, args=ARGS)
        return optimizer

    def training_step(self, batch):
        images, _ = batch
        logits, labels = self.simclr.info_nce_loss(self.model(torch.cat(images, dim=0)))
        if self.state.step % ARGS.log_every_n_steps == 0:
            top1, top5 = accuracy(logits, labels, topk=(1, 5))
            self.log("acc/top1", top1[0])
            self.log("acc/top5", top5[0])
        return self.simclr.criterion(logits, labels)

    def on_epoch_end(self):
        # warmup for the first 10 epochs
        if self.state.epoch >= 10:
            self.scheduler.step()

    def on_fit_end(self):
        self.train_data.rates = [group["lr"] for group in self.scheduler.optimizer.param_groups]


class Loader(list):
    """The batches, and the rates the run ends with."""


def views():
    gen = torch.Generator().manual_seed(4)
    return Loader(([torch.randn(BATCH, 3, 8, 8, generator=gen) for _ in range(VIEWS)], torch.zeros(BATCH))
                  for _ in range(BATCHES))


@pytest.mark.parametrize("check", checks())
def test_simclr_info_nce_with_the_schedule_held_for_ten_epochs(check):
    hand, watched, port = compare_runs(ResNetSimCLR, simclr_hand, SimCLRTrainer, views, check,
                                       steps=EPOCHS * BATCHES)
    assert hand.rates == watched.rates == port.rates
    assert hand.rates[0] < ARGS.lr  # moved twice, from epoch 10 on
