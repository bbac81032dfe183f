# torchvision's segmentation reference: pytorch/vision, references/segmentation/train.py (`criterion`: a cross
# entropy with ignore_index=255 per output of the model's dict, `losses["out"] + 0.5 * losses["aux"]`;
# `train_one_epoch`: autocast, zero_grad, backward, step, the LambdaLR `(1 - x / iters) ** 0.9` stepped every
# iteration, `metric_logger.update(loss=loss.item(), lr=...)`; `evaluate` under torch.no_grad() on `output["out"]`;
# `params_to_optimize`: backbone, classifier, and the aux classifier at ten times the lr). The model is a tiny FCN in
# the manner of torchvision/models/segmentation/_utils.py (`_SimpleSegmentationModel`: the classifier on the last
# features, the aux classifier on an intermediate one, both upsampled bilinearly to the input's size).
from collections import OrderedDict

import torch
import torch.nn.functional as F
from torch import nn

torch.manual_seed(0)
CLASSES, EPOCHS, ITERS = 3, 2, 3


class Backbone(nn.Module):
    def __init__(self):
        super().__init__()
        self.layer3 = nn.Sequential(nn.Conv2d(3, 8, 3, stride=2, padding=1), nn.BatchNorm2d(8), nn.ReLU())
        self.layer4 = nn.Sequential(nn.Conv2d(8, 8, 3, stride=2, padding=1), nn.BatchNorm2d(8), nn.ReLU())

    def forward(self, x):
        aux = self.layer3(x)
        return OrderedDict(aux=aux, out=self.layer4(aux))  # IntermediateLayerGetter's return_layers


class FCN(nn.Module):
    def __init__(self):
        super().__init__()
        self.backbone = Backbone()
        self.classifier = nn.Sequential(nn.Conv2d(8, 4, 3, padding=1, bias=False), nn.BatchNorm2d(4), nn.ReLU(),
                                        nn.Dropout(0.1), nn.Conv2d(4, CLASSES, 1))
        self.aux_classifier = nn.Sequential(nn.Conv2d(8, 4, 3, padding=1, bias=False), nn.BatchNorm2d(4), nn.ReLU(),
                                            nn.Dropout(0.1), nn.Conv2d(4, CLASSES, 1))

    def forward(self, x):
        input_shape = x.shape[-2:]
        features = self.backbone(x)
        result = OrderedDict()
        x = self.classifier(features["out"])
        result["out"] = F.interpolate(x, size=input_shape, mode="bilinear", align_corners=False)
        if self.aux_classifier is not None:
            x = self.aux_classifier(features["aux"])
            result["aux"] = F.interpolate(x, size=input_shape, mode="bilinear", align_corners=False)
        return result


def criterion(inputs, target):
    losses = {}
    for name, x in inputs.items():
        losses[name] = nn.functional.cross_entropy(x, target, ignore_index=255)
    if len(losses) == 1:
        return losses["out"]
    return losses["out"] + 0.5 * losses["aux"]


def evaluate(model, data_loader):
    model.eval()
    confmat = torch.zeros(CLASSES, CLASSES, dtype=torch.int64)
    with torch.no_grad():
        for image, target in data_loader:
            output = model(image)
            output = output["out"]
            k = target.flatten() < CLASSES
            confmat += torch.bincount(CLASSES * target.flatten()[k] + output.argmax(1).flatten()[k],
                                      minlength=CLASSES ** 2).reshape(CLASSES, CLASSES)
    return confmat


def train_one_epoch(model, criterion, optimizer, data_loader, lr_scheduler, epoch, scaler=None):
    model.train()
    for image, target in data_loader:
        with torch.autocast("cpu", enabled=scaler is not None):
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
        print(epoch, repr(loss.item()), repr(optimizer.param_groups[0]["lr"]))


def batch():
    target = torch.randint(0, CLASSES, (2, 16, 16))
    target[:, :2] = 255  # the border pixels VOC marks as ignored
    return torch.rand(2, 3, 16, 16), target


data_loader = [batch() for _ in range(ITERS)]
model = FCN()
params_to_optimize = [
    {"params": [p for p in model.backbone.parameters() if p.requires_grad]},
    {"params": [p for p in model.classifier.parameters() if p.requires_grad]},
]
params = [p for p in model.aux_classifier.parameters() if p.requires_grad]
params_to_optimize.append({"params": params, "lr": 0.01 * 10})
optimizer = torch.optim.SGD(params_to_optimize, lr=0.01, momentum=0.9, weight_decay=1e-4)
iters_per_epoch = len(data_loader)
lr_scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda x: (1 - x / (iters_per_epoch * EPOCHS)) ** 0.9)
for epoch in range(EPOCHS):
    train_one_epoch(model, criterion, optimizer, data_loader, lr_scheduler, epoch)
    print("confmat", evaluate(model, data_loader).tolist())
print("checksum", repr(sum(p.double().sum().item() for p in model.parameters())))
