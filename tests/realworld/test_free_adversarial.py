"""Free adversarial training: mahyarnajibi/FreeAdversarialTraining at commit
e185c84b1cf7495e59ac8453953572483541f424, main_free.py (``train``, ``main``), lib/utils.py (``fgsm``,
``adjust_learning_rate``) and configs.yml (its defaults).

Each batch is replayed ``n_repeats`` times, and every replay is a full update: a perturbation kept across
batches in a global buffer (``global_noise_data``) is wrapped in a leaf that requires grad
(``Variable(global_noise_data[0:n], requires_grad=True)``, which shares the buffer's storage), added to the
images, the sum clamped and normalized in place (``in1.clamp_``, ``in1.sub_(mean).div_(std)``), the loss
back-propagated once into both the weights and the perturbation; the perturbation's gradient sign then
moves the global buffer in place (``+=``, ``clamp_``) before ``optimizer.step()``. The epochs are divided by
``n_repeats`` and the learning-rate schedule's step with them (``adjust_learning_rate``).

Changes for a seconds-long test: a small ResNet (a 3x3 stem, BatchNorm, one basic block, average pooling,
``fc``) stands in for ``torchvision.models.resnet50``; 8x8 crops, 3 classes, 2 epochs of 3 batches of 4 (90
epochs over ImageNet, batches of 256), the 30-epoch decay every epoch (``int(math.ceil(30./n_repeats))``
would be 8 epochs here); random images in [0, 1] in place of ImageNet and its augmentations; no CUDA or
DataParallel; the meters, prints, validation and checkpoints are left out.

The port is manual, ``n_repeats`` updates per step: ``self.backward(loss)`` (one optimizer: a plain backward,
which fills the perturbation's ``.grad`` too), the buffer's update, ``self.step()``; the buffer lives on the
Trainer; the schedule in ``on_epoch_start``.
"""
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.nn as nn
from torch.autograd import Variable

from safeloop import Trainer

from .harness import checks, compare

CLASSES, SIZE, BATCH, PER_EPOCH, EPOCHS = 3, 8, 4, 3, 2
configs = SimpleNamespace(
    TRAIN=SimpleNamespace(lr=0.1, momentum=0.9, weight_decay=0.0001, mean=(0.485, 0.456, 0.406),
                          std=(0.229, 0.224, 0.225)),
    ADV=SimpleNamespace(clip_eps=4.0 / 255.0, fgsm_step=4.0 / 255.0, n_repeats=4),  # main() divides both by 255
    DATA=SimpleNamespace(batch_size=BATCH, crop_size=SIZE))
DECAY_EVERY = 1  # the schedule's int(math.ceil(30./n_repeats)) = 8 epochs, shrunk


class BasicBlock(nn.Module):
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
    """Stands in for ``torchvision.models.resnet50``."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(8)
        self.relu = nn.ReLU(inplace=True)
        self.layer1 = nn.Sequential(BasicBlock(8))
        self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
        self.fc = nn.Linear(8, CLASSES)

    def forward(self, x):
        x = self.layer1(self.relu(self.bn1(self.conv1(x))))
        return self.fc(torch.flatten(self.avgpool(x), 1))


# -- lib/utils.py -----------------------------------------------------------------------------------------
def fgsm(gradz, step_size):
    return step_size * torch.sign(gradz)


def adjust_learning_rate(initial_lr, optimizer, epoch, n_repeats):
    """Sets the learning rate to the initial LR decayed by 10 every 30 epochs"""
    lr = initial_lr * (0.1 ** (epoch // DECAY_EVERY))  # (epoch // int(math.ceil(30./n_repeats)))
    for param_group in optimizer.param_groups:
        param_group['lr'] = lr


# -- main_free.py -----------------------------------------------------------------------------------------
criterion = nn.CrossEntropyLoss()


def normalization():
    mean = torch.Tensor(np.array(configs.TRAIN.mean)[:, np.newaxis, np.newaxis])
    mean = mean.expand(3, configs.DATA.crop_size, configs.DATA.crop_size)
    std = torch.Tensor(np.array(configs.TRAIN.std)[:, np.newaxis, np.newaxis])
    std = std.expand(3, configs.DATA.crop_size, configs.DATA.crop_size)
    return mean, std


def make_optimizer(model):
    return torch.optim.SGD(model.parameters(), configs.TRAIN.lr, momentum=configs.TRAIN.momentum,
                           weight_decay=configs.TRAIN.weight_decay)


def replay(model, input, target, noise, mean, std, backward, step):
    """One of the ``n_repeats`` replays of ``train``'s loop body; ``backward``/``step``: the loop's or the
    Trainer's."""
    # Ascend on the global noise
    noise_batch = Variable(noise[0:input.size(0)], requires_grad=True)
    in1 = input + noise_batch
    in1.clamp_(0, 1.0)
    in1.sub_(mean).div_(std)
    output = model(in1)
    loss = criterion(output, target)

    backward(loss)

    # Update the noise for the next iteration
    pert = fgsm(noise_batch.grad, configs.ADV.fgsm_step)
    noise[0:input.size(0)] += pert.data
    noise.clamp_(-configs.ADV.clip_eps, configs.ADV.clip_eps)

    step()
    return loss


def free_hand(model, train_loader):
    global_noise_data = torch.zeros([configs.DATA.batch_size, 3, configs.DATA.crop_size, configs.DATA.crop_size])
    optimizer = make_optimizer(model)
    mean, std = normalization()
    for epoch in range(0, EPOCHS):
        adjust_learning_rate(configs.TRAIN.lr, optimizer, epoch, configs.ADV.n_repeats)
        model.train()
        for i, (input, target) in enumerate(train_loader):
            for j in range(configs.ADV.n_repeats):
                def backward(loss):
                    optimizer.zero_grad()
                    loss.backward()
                replay(model, input, target, global_noise_data, mean, std, backward, optimizer.step)
    train_loader.noise = global_noise_data


class FreeAdversarial(Trainer):
    automatic = False

    def configure_optimizers(self):
        self.global_noise_data = torch.zeros([configs.DATA.batch_size, 3, configs.DATA.crop_size,
                                              configs.DATA.crop_size])
        self.mean, self.std = normalization()
        return make_optimizer(self.model)

    def on_epoch_start(self):
        adjust_learning_rate(configs.TRAIN.lr, self.optimizers["optimizer"], self.state.epoch, configs.ADV.n_repeats)
        self.model.train()

    def training_step(self, batch):
        input, target = batch
        losses = [replay(self.model, input, target, self.global_noise_data, self.mean, self.std, self.backward,
                         self.step) for _ in range(configs.ADV.n_repeats)]
        return losses[-1]

    def on_fit_end(self):
        self.train_data.noise = self.global_noise_data


class ImageNet(list):
    def __init__(self):
        gen = torch.Generator().manual_seed(18)
        super().__init__((torch.rand(BATCH, 3, SIZE, SIZE, generator=gen),
                          torch.randint(CLASSES, (BATCH,), generator=gen)) for _ in range(PER_EPOCH))
        self.noise = None


@pytest.mark.parametrize("check", checks())
def test_free_adversarial_training_with_replayed_batches(check):
    runs = []

    def data(model):
        runs.append(ImageNet())
        return runs[-1]
    compare(ResNet, free_hand, FreeAdversarial, data, check, steps=EPOCHS * PER_EPOCH)
    hand, watched, port = (run.noise for run in runs)
    assert torch.equal(watched, hand) and torch.equal(port, hand)
    assert hand.abs().max() == configs.ADV.clip_eps  # the perturbation grew to its bound
