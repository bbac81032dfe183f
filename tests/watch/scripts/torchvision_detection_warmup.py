# torchvision's detection reference: pytorch/vision, references/detection/engine.py (`train_one_epoch`: in epoch 0 a
# LinearLR warm-up made inside the function and stepped every iteration, `losses = sum(loss for loss in
# loss_dict.values())`, `reduce_dict` (one process: the dict itself) summed and `.item()`-ed for the finite check,
# zero_grad, backward, step, `metric_logger.update(loss=losses_reduced, **loss_dict_reduced)`),
# references/detection/utils.py (`MetricLogger.update` stores `v.item()` in `SmoothedValue`s), train.py (SGD with
# momentum and weight decay, a MultiStepLR stepped after each epoch). The model is a tiny two-stage detector in the
# manner of torchvision's Faster R-CNN in train mode: it returns its loss dict, its RPN decodes proposals from
# `pred_bbox_deltas.detach()` (torchvision/models/detection/rpn.py) and its box head scores features at them.
import math
from collections import defaultdict, deque

import torch
import torch.nn.functional as F
from torch import nn

torch.manual_seed(0)
ANCHORS, CLASSES, EPOCHS, ITERS = 6, 3, 2, 4


class SmoothedValue:
    def __init__(self, window_size=20):
        self.deque = deque(maxlen=window_size)
        self.total = 0.0
        self.count = 0

    def update(self, value, n=1):
        self.deque.append(value)
        self.count += n
        self.total += value * n

    @property
    def global_avg(self):
        return self.total / self.count


class MetricLogger:
    def __init__(self):
        self.meters = defaultdict(SmoothedValue)

    def update(self, **kwargs):
        for k, v in kwargs.items():
            if isinstance(v, torch.Tensor):
                v = v.item()
            assert isinstance(v, (float, int))
            self.meters[k].update(v)


class TwoStageDetector(nn.Module):
    def __init__(self):
        super().__init__()
        self.backbone = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU())
        self.rpn_cls_logits = nn.Conv2d(8, ANCHORS, 1)
        self.rpn_bbox_pred = nn.Conv2d(8, ANCHORS * 4, 1)
        self.box_head = nn.Linear(8 + 4, 16)
        self.cls_score = nn.Linear(16, CLASSES + 1)
        self.bbox_pred = nn.Linear(16, 4)
        self.register_buffer("anchors", torch.rand(ANCHORS, 4))

    def forward(self, images, targets):
        features = self.backbone(torch.stack(images))
        objectness = self.rpn_cls_logits(features).mean((2, 3))
        pred_bbox_deltas = self.rpn_bbox_pred(features).mean((2, 3)).view(-1, ANCHORS, 4)
        proposals = self.anchors + pred_bbox_deltas.detach()
        gt = torch.stack([t["boxes"][0] for t in targets])
        matched = ((self.anchors - gt[:, None]).abs().sum(-1) < 1.0).float()
        loss_objectness = F.binary_cross_entropy_with_logits(objectness, matched)
        loss_rpn_box_reg = F.smooth_l1_loss(pred_bbox_deltas, gt[:, None] - self.anchors, beta=1 / 9)
        pooled = features.mean((2, 3))[:, None].expand(-1, ANCHORS, -1)
        box_features = F.relu(self.box_head(torch.cat([pooled, proposals], -1)))
        class_logits, box_regression = self.cls_score(box_features), self.bbox_pred(box_features)
        labels = torch.stack([t["labels"][0] for t in targets])[:, None].expand(-1, ANCHORS)
        loss_classifier = F.cross_entropy(class_logits.flatten(0, 1), labels.flatten())
        loss_box_reg = F.smooth_l1_loss(box_regression, gt[:, None] - proposals, beta=1 / 9, reduction="sum")
        loss_box_reg = loss_box_reg / labels.numel()
        return {"loss_classifier": loss_classifier, "loss_box_reg": loss_box_reg,
                "loss_objectness": loss_objectness, "loss_rpn_box_reg": loss_rpn_box_reg}


def reduce_dict(input_dict, average=True):
    return input_dict  # one process


def train_one_epoch(model, optimizer, data_loader, epoch):
    model.train()
    metric_logger = MetricLogger()
    lr_scheduler = None
    if epoch == 0:
        warmup_factor = 1.0 / 1000
        warmup_iters = min(1000, len(data_loader) - 1)
        lr_scheduler = torch.optim.lr_scheduler.LinearLR(optimizer, start_factor=warmup_factor,
                                                         total_iters=warmup_iters)
    for images, targets in data_loader:
        loss_dict = model(images, targets)
        losses = sum(loss for loss in loss_dict.values())
        loss_dict_reduced = reduce_dict(loss_dict)
        losses_reduced = sum(loss for loss in loss_dict_reduced.values())
        loss_value = losses_reduced.item()
        if not math.isfinite(loss_value):
            raise SystemExit(1)
        optimizer.zero_grad()
        losses.backward()
        optimizer.step()
        if lr_scheduler is not None:
            lr_scheduler.step()
        metric_logger.update(loss=losses_reduced, **loss_dict_reduced)
        metric_logger.update(lr=optimizer.param_groups[0]["lr"])
        print(epoch, repr(loss_value), repr(optimizer.param_groups[0]["lr"]))
    return metric_logger


data_loader = [([torch.rand(3, 8, 8) for _ in range(2)],
                [{"boxes": torch.rand(1, 4), "labels": torch.randint(1, CLASSES + 1, (1,))} for _ in range(2)])
               for _ in range(ITERS)]
model = TwoStageDetector()
params = [p for p in model.parameters() if p.requires_grad]
optimizer = torch.optim.SGD(params, lr=0.02, momentum=0.9, weight_decay=1e-4)
lr_scheduler = torch.optim.lr_scheduler.MultiStepLR(optimizer, milestones=[1], gamma=0.1)
for epoch in range(EPOCHS):
    logger = train_one_epoch(model, optimizer, data_loader, epoch)
    lr_scheduler.step()
    print("epoch", epoch, repr(logger.meters["loss"].global_avg))
print("checksum", repr(sum(p.double().sum().item() for p in model.parameters())))
