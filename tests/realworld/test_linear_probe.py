"""MoCo's linear classification protocol: facebookresearch/moco at commit 132aea9da9bb995a411c915c0420be3db62052f3
(the last that has it), main_lincls.py (``main_worker``, ``train``, ``validate``, ``sanity_check``,
``adjust_learning_rate``, ``accuracy``).

A pre-trained encoder is frozen and a linear classifier trained on its features. Every parameter but
``fc.weight`` and ``fc.bias`` gets ``requires_grad = False``; the ``fc`` is re-initialized through ``.data``; the
pre-trained MoCo checkpoint's ``module.encoder_q.*`` keys are renamed and loaded with ``strict=False`` (only
the ``fc`` missing); the SGD (lr 30, momentum) holds the two ``fc`` tensors only. ``train`` puts the whole
model in eval mode on purpose, every epoch, as its docstring says: "BatchNorm in train mode may revise
running mean/std (even if it receives no gradient), which are part of the model parameters too". After the
first epoch ``sanity_check`` asserts that every tensor of the state dict but the ``fc``'s equals the
pre-trained checkpoint's, BatchNorm's running statistics included. The learning rate is divided by 10 at the
``--schedule`` milestones by assigning ``param_group["lr"]``; ``validate`` runs after every epoch.

Changes for a seconds-long test: a small ResNet (a 3x3 stem, BatchNorm, one basic block, average pooling,
``fc``; the source's ``torchvision.models.resnet50``) with 3 classes, 8x8 images, 2 epochs of 3 batches of
4 (100 of 256), a milestone at epoch 1 (60 and 80), one validation batch; the "pre-trained" checkpoint is
the state dict of a seeded encoder with a MoCo ``fc`` of another size, under the prefix the source strips,
held in memory (``torch.load`` of a file in the source); no CUDA, DataParallel or distributed training; the
meters' prints, timing and checkpoint files are left out.

The port calls ``adjust_learning_rate`` and ``model.eval()`` in ``on_epoch_start`` (the Trainer keeps the
mode it is given), and ``validate`` and the sanity check in ``on_epoch_end``.
"""
import copy
from types import SimpleNamespace

import pytest
import torch
import torch.nn as nn

from safeloop import Trainer

from .harness import checks, compare

args = SimpleNamespace(lr=30.0, schedule=[1], momentum=0.9, weight_decay=0.0, epochs=2, start_epoch=0)
CLASSES, SIZE, BATCH, PER_EPOCH, MOCO_DIM = 3, 8, 4, 3, 16


class BasicBlock(nn.Module):
    """torchvision's ``BasicBlock`` (no downsampling)."""

    def __init__(self, planes):
        super().__init__()
        self.conv1 = nn.Conv2d(planes, planes, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(planes, planes, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)

    def forward(self, x):
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        out += x
        return self.relu(out)


class ResNet(nn.Module):
    """Stands in for ``torchvision.models.resnet50``: the same names (``conv1``, ``bn1``, ``layer1``, ``fc``)."""

    def __init__(self, num_classes=CLASSES):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(8)
        self.relu = nn.ReLU(inplace=True)
        self.layer1 = nn.Sequential(BasicBlock(8))
        self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
        self.fc = nn.Linear(8, num_classes)

    def forward(self, x):
        x = self.layer1(self.relu(self.bn1(self.conv1(x))))
        return self.fc(torch.flatten(self.avgpool(x), 1))


def pretrained():
    """A MoCo checkpoint's ``state_dict``: a query encoder trained (its BatchNorm statistics moved) with an ``fc``
    of ``MOCO_DIM`` outputs, and a key encoder, under DataParallel's ``module.`` prefix."""
    torch.manual_seed(11)
    encoder = ResNet(num_classes=MOCO_DIM)
    encoder(torch.randn(16, 3, SIZE, SIZE))  # train mode: the running statistics move
    state = {}
    for prefix in ("module.encoder_q.", "module.encoder_k."):
        state.update({prefix + k: v.clone() for k, v in encoder.state_dict().items()})
    return {"state_dict": state}


CHECKPOINT = pretrained()


def create_model():
    """``main_worker``'s model: built, frozen but for the fc, fc initialized, the pre-trained weights loaded."""
    model = ResNet()

    # freeze all layers but the last fc
    for name, param in model.named_parameters():
        if name not in ["fc.weight", "fc.bias"]:
            param.requires_grad = False
    # init the fc layer
    model.fc.weight.data.normal_(mean=0.0, std=0.01)
    model.fc.bias.data.zero_()

    checkpoint = copy.deepcopy(CHECKPOINT)  # torch.load(args.pretrained, map_location="cpu")

    # rename moco pre-trained keys
    state_dict = checkpoint["state_dict"]
    for k in list(state_dict.keys()):
        # retain only encoder_q up to before the embedding layer
        if k.startswith("module.encoder_q") and not k.startswith("module.encoder_q.fc"):
            # remove prefix
            state_dict[k[len("module.encoder_q."):]] = state_dict[k]
        # delete renamed or unused k
        del state_dict[k]

    args.start_epoch = 0
    msg = model.load_state_dict(state_dict, strict=False)
    assert set(msg.missing_keys) == {"fc.weight", "fc.bias"}
    return model


criterion = nn.CrossEntropyLoss()


def make_optimizer(model):
    # optimize only the linear classifier
    parameters = list(filter(lambda p: p.requires_grad, model.parameters()))
    assert len(parameters) == 2  # fc.weight, fc.bias
    return torch.optim.SGD(parameters, args.lr, momentum=args.momentum, weight_decay=args.weight_decay)


def adjust_learning_rate(optimizer, epoch, args) -> None:
    """Decay the learning rate based on schedule"""
    lr = args.lr
    for milestone in args.schedule:
        lr *= 0.1 if epoch >= milestone else 1.0
    for param_group in optimizer.param_groups:
        param_group["lr"] = lr


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


def validate(val_loader, model, criterion, args):
    """The source's, its meters reduced to the top-1 mean (what it returns)."""
    model.eval()
    top1, n = 0.0, 0
    with torch.no_grad():
        for i, (images, target) in enumerate(val_loader):
            output = model(images)
            loss = criterion(output, target)  # noqa: F841 (the source's, for its meter)
            acc1, acc5 = accuracy(output, target, topk=(1, 3))  # (1, 5): 3 classes here
            top1, n = top1 + acc1[0].item() * images.size(0), n + images.size(0)
    return top1 / n


def sanity_check(state_dict, pretrained_weights) -> None:
    """
    Linear classifier should not change any weights other than the linear layer.
    This sanity check asserts nothing wrong happens (e.g., BN stats updated).
    """
    checkpoint = pretrained_weights  # torch.load(pretrained_weights, map_location="cpu")
    state_dict_pre = checkpoint["state_dict"]

    for k in list(state_dict.keys()):
        # only ignore fc layer
        if "fc.weight" in k or "fc.bias" in k:
            continue

        # name in pretrained model
        k_pre = "module.encoder_q." + k[len("module."):] if k.startswith("module.") else "module.encoder_q." + k

        assert (state_dict[k].cpu() == state_dict_pre[k_pre]).all(), (
            "{} is changed in linear classifier training.".format(k)
        )


def train(train_loader, model, criterion, optimizer, epoch, args) -> None:
    """
    Switch to eval mode:
    Under the protocol of linear classification on frozen features/models,
    it is not legitimate to change any part of the pre-trained model.
    BatchNorm in train mode may revise running mean/std (even if it receives
    no gradient), which are part of the model parameters too.
    """
    model.eval()

    for i, (images, target) in enumerate(train_loader):
        # compute output
        output = model(images)
        loss = criterion(output, target)

        # measure accuracy and record loss
        acc1, acc5 = accuracy(output, target, topk=(1, 3))

        # compute gradient and do SGD step
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()


def lincls_hand(model, data):
    optimizer = make_optimizer(model)
    best_acc1 = 0
    for epoch in range(args.start_epoch, args.epochs):
        adjust_learning_rate(optimizer, epoch, args)

        # train for one epoch
        train(data.train, model, criterion, optimizer, epoch, args)

        # evaluate on validation set
        acc1 = validate(data.val, model, criterion, args)
        data.accuracies.append(acc1)

        # remember best acc@1 and save checkpoint
        best_acc1 = max(acc1, best_acc1)
        if epoch == args.start_epoch:
            sanity_check(model.state_dict(), CHECKPOINT)


class LinearClassification(Trainer):
    def configure_optimizers(self):
        return make_optimizer(self.model)

    def on_epoch_start(self):
        adjust_learning_rate(self.optimizers["optimizer"], self.state.epoch, args)
        self.model.eval()  # train()'s: the protocol trains the fc on frozen features, BatchNorm included

    def training_step(self, batch):
        images, target = batch
        return criterion(self.model(images), target)

    def on_epoch_end(self):
        self.train_data.accuracies.append(validate(self.train_data.val, self.model, criterion, args))
        if self.state.epoch == args.start_epoch:
            sanity_check(self.model.state_dict(), CHECKPOINT)


class ImageNet:
    def __init__(self):
        gen = torch.Generator().manual_seed(12)

        def batch():
            return torch.randn(BATCH, 3, SIZE, SIZE, generator=gen), torch.randint(CLASSES, (BATCH,), generator=gen)
        self.train = [batch() for _ in range(PER_EPOCH)]
        self.val = [batch()]
        self.accuracies = []

    def __iter__(self):
        return iter(self.train)


def lincls(port, check):
    runs = []

    def data(model):
        runs.append(ImageNet())
        return runs[-1]
    compare(create_model, lincls_hand, port, data, check, steps=args.epochs * PER_EPOCH)
    hand, watched, port = (run.accuracies for run in runs)
    assert watched == hand and port == hand[:-1]  # the port's last pass ends after the run


@pytest.mark.parametrize("check", checks())
def test_moco_linear_classification_on_a_frozen_encoder(check):
    """The whole model in eval mode on purpose, set by the port's on_epoch_start: no eval-mode warning."""
    lincls(LinearClassification, check)


def test_the_frozen_statistics_are_the_pretrained_ones():
    """The checkpoint's BatchNorm statistics differ from a new model's (the sanity check would see them move)."""
    torch.manual_seed(0)
    assert not torch.equal(create_model().bn1.running_mean, ResNet().bn1.running_mean)
