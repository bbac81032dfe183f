"""torchvision's semantic segmentation recipe: pytorch/vision, references/segmentation/train.py as on its main
branch (``criterion``, ``train_one_epoch``, ``evaluate`` and, in ``main``, the parameter groups and the
``SequentialLR`` of a per-iteration ``LinearLR`` warm-up and ``PolynomialLR``), and
torchvision/models/segmentation/_utils.py (``_SimpleSegmentationModel.forward``).

The model returns a dict of an ``out`` and an ``aux`` map, each upsampled by ``F.interpolate(mode="bilinear")``
from its own head over the backbone's features; ``criterion`` sums ``out + 0.5 * aux`` of two cross-entropies
that ignore the pixels labelled 255. SGD over three parameter groups: the backbone, the classifier, and the
auxiliary classifier at ten times the rate. The schedule is stepped after every iteration: a linear warm-up over
the first epoch's iterations, then a polynomial decay (power 0.9) over the rest. Each epoch ends with an
evaluation under ``inference_mode``.

Changes for a seconds-long test: a two-conv backbone with BatchNorm (ResNet with an ``IntermediateLayerGetter``)
whose ``layer3`` and ``layer4`` outputs feed the two heads (conv, BatchNorm, ReLU, dropout, 1x1 conv: the FCN
head), 3 classes, 3 epochs of 3 batches of 2 3x8x8 images, ``lr_warmup_epochs`` 1; no AMP (``--amp`` is off
by default: the deprecated ``torch.cuda.amp.autocast(enabled=False)`` written as ``torch.autocast(device.type,
enabled=False)``), no distributed run, no confusion matrix, logging or checkpoints.

The ports: ``training_step`` returns ``criterion``'s sum, the ``SequentialLR`` with ``interval: step``; or
``training_step`` returns the two losses by name, weighted by ``loss_weights={"aux": 0.5}`` under
``multi_loss="sum"``.
"""
from collections import OrderedDict

import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.optim.lr_scheduler import PolynomialLR

from safeloop import Trainer

from .harness import checks, compare, fixed

EPOCHS, BATCHES, BATCH_SIZE, CLASSES = 3, 3, 2, 3
LR, MOMENTUM, WEIGHT_DECAY, LR_WARMUP_EPOCHS, LR_WARMUP_DECAY = 0.02, 0.9, 1e-4, 1, 0.01


# -- torchvision/models/segmentation/_utils.py, fcn.py (FCNHead), with a tiny backbone ----------------------
class Backbone(nn.Module):
    def __init__(self):
        super().__init__()
        self.layer3 = nn.Sequential(nn.Conv2d(3, 6, 3, stride=2, padding=1), nn.BatchNorm2d(6), nn.ReLU(inplace=True))
        self.layer4 = nn.Sequential(nn.Conv2d(6, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(inplace=True))

    def forward(self, x):
        out = OrderedDict()
        out["aux"] = x = self.layer3(x)
        out["out"] = self.layer4(x)
        return out


class FCNHead(nn.Sequential):
    def __init__(self, in_channels: int, channels: int) -> None:
        inter_channels = in_channels // 4
        layers = [
            nn.Conv2d(in_channels, inter_channels, 3, padding=1, bias=False),
            nn.BatchNorm2d(inter_channels),
            nn.ReLU(),
            nn.Dropout(0.1),
            nn.Conv2d(inter_channels, channels, 1),
        ]

        super().__init__(*layers)


class _SimpleSegmentationModel(nn.Module):
    __constants__ = ["aux_classifier"]

    def __init__(self, backbone, classifier, aux_classifier=None):
        super().__init__()
        self.backbone = backbone
        self.classifier = classifier
        self.aux_classifier = aux_classifier

    def forward(self, x):
        input_shape = x.shape[-2:]
        # contract: features is a dict of tensors
        features = self.backbone(x)

        result = OrderedDict()
        x = features["out"]
        x = self.classifier(x)
        x = F.interpolate(x, size=input_shape, mode="bilinear", align_corners=False)
        result["out"] = x

        if self.aux_classifier is not None:
            x = features["aux"]
            x = self.aux_classifier(x)
            x = F.interpolate(x, size=input_shape, mode="bilinear", align_corners=False)
            result["aux"] = x

        return result


def make_model():
    return _SimpleSegmentationModel(Backbone(), FCNHead(8, CLASSES), FCNHead(6, CLASSES))


# -- references/segmentation/train.py -----------------------------------------------------------------------
def criterion(inputs, target):
    losses = {}
    for name, x in inputs.items():
        losses[name] = nn.functional.cross_entropy(x, target, ignore_index=255)

    if len(losses) == 1:
        return losses["out"]

    return losses["out"] + 0.5 * losses["aux"]


def evaluate(model, data_loader, device):
    model.eval()
    total = 0.0
    with torch.inference_mode():
        for image, target in data_loader:
            image, target = image.to(device), target.to(device)
            output = model(image)
            output = output["out"]
            total += (output.argmax(1) == target).sum().item()
    return total


def train_one_epoch(model, criterion, optimizer, data_loader, lr_scheduler, device, epoch, print_freq, scaler=None):
    model.train()
    for image, target in data_loader:
        image, target = image.to(device), target.to(device)
        with torch.autocast(device.type, enabled=scaler is not None):
            output = model(image)
            loss = criterion(output, target)

        optimizer.zero_grad()
        if scaler is not None:
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
        else:
            loss.backward()
            optimizer.step()

        lr_scheduler.step()


def make_optimizer_and_scheduler(model_without_ddp, iters_per_epoch):
    params_to_optimize = [
        {"params": [p for p in model_without_ddp.backbone.parameters() if p.requires_grad]},
        {"params": [p for p in model_without_ddp.classifier.parameters() if p.requires_grad]},
    ]
    params = [p for p in model_without_ddp.aux_classifier.parameters() if p.requires_grad]
    params_to_optimize.append({"params": params, "lr": LR * 10})
    optimizer = torch.optim.SGD(params_to_optimize, lr=LR, momentum=MOMENTUM, weight_decay=WEIGHT_DECAY)

    main_lr_scheduler = PolynomialLR(
        optimizer, total_iters=iters_per_epoch * (EPOCHS - LR_WARMUP_EPOCHS), power=0.9
    )
    warmup_iters = iters_per_epoch * LR_WARMUP_EPOCHS
    warmup_lr_scheduler = torch.optim.lr_scheduler.LinearLR(
        optimizer, start_factor=LR_WARMUP_DECAY, total_iters=warmup_iters
    )
    lr_scheduler = torch.optim.lr_scheduler.SequentialLR(
        optimizer, schedulers=[warmup_lr_scheduler, main_lr_scheduler], milestones=[warmup_iters]
    )
    return optimizer, lr_scheduler


def segmentation_hand(model, data_loader):
    device = torch.device("cpu")
    optimizer, lr_scheduler = make_optimizer_and_scheduler(model, len(data_loader))
    for epoch in range(0, EPOCHS):
        train_one_epoch(model, criterion, optimizer, data_loader, lr_scheduler, device, epoch, 10, None)
        evaluate(model, data_loader, device=device)


class SegmentationTrainer(Trainer):
    def configure_optimizers(self):
        optimizer, lr_scheduler = make_optimizer_and_scheduler(self.model, len(self.train_data))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": lr_scheduler, "interval": "step"}}

    def training_step(self, batch):
        image, target = batch
        return criterion(self.model(image), target)

    def on_epoch_end(self):
        evaluate(self.model, self.train_data, torch.device("cpu"))
        self.model.train()


class SegmentationLossesByName(SegmentationTrainer):
    def training_step(self, batch):
        image, target = batch
        return {name: F.cross_entropy(x, target, ignore_index=255) for name, x in self.model(image).items()}


def scenes():
    """Images and label maps, a quarter of whose pixels are 255 (ignored)."""
    gen = torch.Generator().manual_seed(4)
    out = []
    for _ in range(BATCHES):
        image = torch.randn(BATCH_SIZE, 3, 8, 8, generator=gen)
        target = torch.randint(CLASSES, (BATCH_SIZE, 8, 8), generator=gen)
        target[torch.rand(BATCH_SIZE, 8, 8, generator=gen) < 0.25] = 255
        out.append((image, target))
    return out


@pytest.mark.parametrize("check", checks())
def test_segmentation_with_an_aux_loss_and_a_per_iteration_warmup_then_poly_schedule(check):
    compare(make_model, segmentation_hand, SegmentationTrainer, fixed(scenes()), check, steps=EPOCHS * BATCHES)


@pytest.mark.parametrize("check", checks())
def test_segmentation_aux_loss_as_a_weighted_loss_summed_by_the_trainer(check):
    compare(make_model, segmentation_hand, SegmentationLossesByName, fixed(scenes()), check,
            steps=EPOCHS * BATCHES, multi_loss="sum", loss_weights={"aux": 0.5})
