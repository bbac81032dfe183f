"""A ResNet with stochastic depth and a per-batch warm-up: weiaicunzai/pytorch-cifar100,
models/stochasticdepth.py at commit 0c8fc6be2bba2b481342fec6dbe42c7fd783150f (``StochasticDepthBasicBlock``,
``StochasticDepthResNet``), train.py at commit a30566700743599e3fcc5bb6f956040c39035ea1 (``train``, ``__main__``)
and utils.py (``WarmUpLR``).

In training each residual block draws ``torch.bernoulli(self.p)`` from the global generator and, when it dies,
returns ``self.shortcut(x)`` alone: its convolutions and BatchNorms take no part in that step (no gradient,
``.grad`` left ``None`` by ``zero_grad``, so SGD applies neither momentum nor weight decay to them; their running
statistics do not move); the survival probability falls linearly with depth (``self.pl -= self.step``), the
first block always lives. Evaluation scales the residual by ``p``. ``train`` steps the ``WarmUpLR`` (``base_lr *
last_epoch / total_iters``) at the *start* of each batch of the warm-up epoch, before ``optimizer.step()``
(PyTorch warns), and ``MultiStepLR.step(epoch)`` (the deprecated epoch argument) before each later epoch.

Changes for a seconds-long test: four blocks of 4-8 channels (ResNet-18's eight of 64-512) over 3x6x6 images,
3 classes, 2 epochs of 3 batches of 4, ``MILESTONES = [2]``; plain ``nn.Module`` blocks (the source's
``torch.jit.ScriptModule`` with ``@torch.jit.script_method`` around a forward that calls the Python
``survival()``); no CUDA, TensorBoard, evaluation or checkpoints.

The port is the default step; the warm-up scheduler steps in ``on_step_start``, the decay in ``on_epoch_start``.
"""
import pytest
import torch
import torch.nn as nn
import torch.optim as optim
from torch.optim.lr_scheduler import _LRScheduler

from safeloop import Trainer

from .harness import checks, compare

CLASSES, BATCH, PER_EPOCH, EPOCH, WARM, LR, MILESTONES = 3, 4, 3, 3, 1, 0.1, [2]


# -- models/stochasticdepth.py ------------------------------------------------------------------------------
class StochasticDepthBasicBlock(nn.Module):

    expansion = 1

    def __init__(self, p, in_channels, out_channels, stride=1):
        super().__init__()

        self.p = torch.tensor(p).float()
        self.residual = nn.Sequential(
            nn.Conv2d(in_channels, out_channels, kernel_size=3, stride=stride, padding=1),
            nn.BatchNorm2d(out_channels),
            nn.ReLU(inplace=True),
            nn.Conv2d(out_channels, out_channels * StochasticDepthBasicBlock.expansion, kernel_size=3, padding=1),
            nn.BatchNorm2d(out_channels)
        )

        self.shortcut = nn.Sequential()

        if stride != 1 or in_channels != out_channels * StochasticDepthBasicBlock.expansion:
            self.shortcut = nn.Sequential(
                nn.Conv2d(in_channels, out_channels * StochasticDepthBasicBlock.expansion, kernel_size=1,
                          stride=stride),
                nn.BatchNorm2d(out_channels)
            )

    def survival(self):
        var = torch.bernoulli(self.p)
        return torch.equal(var, torch.tensor(1).float().to(var.device))

    def forward(self, x):

        if self.training:
            if self.survival():
                x = self.residual(x) + self.shortcut(x)
            else:
                # If bl = 0, the ResBlock reduces to the identity function
                x = self.shortcut(x)

        else:
            x = self.residual(x) * self.p + self.shortcut(x)

        return x


class StochasticDepthResNet(nn.Module):

    def __init__(self, block, num_block, num_classes=CLASSES):
        super().__init__()

        self.in_channels = 4
        self.conv1 = nn.Sequential(
            nn.Conv2d(3, 4, kernel_size=3, padding=1),
            nn.BatchNorm2d(4),
            nn.ReLU(inplace=True)
        )

        self.step = (1 - 0.5) / (sum(num_block) - 1)
        self.pl = 1
        self.conv2_x = self._make_layer(block, 4, num_block[0], 1)
        self.conv3_x = self._make_layer(block, 8, num_block[1], 2)
        self.conv4_x = self._make_layer(block, 8, num_block[2], 1)  # 256, stride 2
        self.conv5_x = self._make_layer(block, 8, num_block[3], 1)  # 512, stride 2
        self.avg_pool = nn.AdaptiveAvgPool2d((1, 1))
        self.fc = nn.Linear(8 * block.expansion, num_classes)

    def _make_layer(self, block, out_channels, num_blocks, stride):

        strides = [stride] + [1] * (num_blocks - 1)
        layers = []
        for stride in strides:
            layers.append(block(self.pl, self.in_channels, out_channels, stride))
            self.in_channels = out_channels * block.expansion
            self.pl -= self.step

        return nn.Sequential(*layers)

    def forward(self, x):
        output = self.conv1(x)
        output = self.conv2_x(output)
        output = self.conv3_x(output)
        output = self.conv4_x(output)
        output = self.conv5_x(output)
        output = self.avg_pool(output)
        output = output.view(output.size(0), -1)
        output = self.fc(output)

        return output


def make_net():
    return StochasticDepthResNet(StochasticDepthBasicBlock, [1, 1, 1, 1])


# -- utils.py -----------------------------------------------------------------------------------------------
class WarmUpLR(_LRScheduler):
    """warmup_training learning rate scheduler
    Args:
        optimizer: optimzier(e.g. SGD)
        total_iters: totoal_iters of warmup phase
    """
    def __init__(self, optimizer, total_iters, last_epoch=-1):

        self.total_iters = total_iters
        super().__init__(optimizer, last_epoch)

    def get_lr(self):
        """we will use the first m batches, and set the learning
        rate to base_lr * m / total_iters
        """
        return [base_lr * self.last_epoch / (self.total_iters + 1e-8) for base_lr in self.base_lrs]


# -- train.py -----------------------------------------------------------------------------------------------
loss_function = nn.CrossEntropyLoss()


def make_optimizer(net):
    return optim.SGD(net.parameters(), lr=LR, momentum=0.9, weight_decay=5e-4)


def make_schedulers(optimizer):
    train_scheduler = optim.lr_scheduler.MultiStepLR(optimizer, milestones=MILESTONES, gamma=0.2)
    warmup_scheduler = WarmUpLR(optimizer, PER_EPOCH * WARM)
    return train_scheduler, warmup_scheduler


def cifar_hand(net, cifar100_training_loader):
    optimizer = make_optimizer(net)
    train_scheduler, warmup_scheduler = make_schedulers(optimizer)

    def train(epoch):

        net.train()
        for batch_index, (images, labels) in enumerate(cifar100_training_loader):
            if epoch <= WARM:
                warmup_scheduler.step()

            optimizer.zero_grad()
            outputs = net(images)
            loss = loss_function(outputs, labels)
            loss.backward()
            optimizer.step()

    for epoch in range(1, EPOCH):
        if epoch > WARM:
            train_scheduler.step(epoch)

        train(epoch)
    cifar_hand.lrs = [g["lr"] for g in optimizer.param_groups]


class StochasticDepthTrainer(Trainer):
    def configure_optimizers(self):
        optimizer = make_optimizer(self.model)
        self.train_scheduler, self.warmup_scheduler = make_schedulers(optimizer)
        return optimizer

    def on_epoch_start(self):
        if self.state.epoch + 1 > WARM:
            self.train_scheduler.step(self.state.epoch + 1)
        self.model.train()

    def on_step_start(self):
        if self.state.epoch + 1 <= WARM:
            self.warmup_scheduler.step()

    def training_step(self, batch):
        images, labels = batch
        return loss_function(self.model(images), labels)

    def on_fit_end(self):
        self.lrs = [g["lr"] for g in self.optimizers["optimizer"].param_groups]


def cifar(model):
    gen = torch.Generator().manual_seed(9)
    return [(torch.randn(BATCH, 3, 6, 6, generator=gen), torch.randint(CLASSES, (BATCH,), generator=gen))
            for _ in range(PER_EPOCH)]


@pytest.mark.parametrize("check", checks())
def test_stochastic_depth_with_blocks_skipped_at_random_and_a_per_batch_warmup(check):
    compare(make_net, cifar_hand, StochasticDepthTrainer, cifar, check, steps=(EPOCH - 1) * PER_EPOCH)


def test_some_block_is_skipped_in_some_step():
    """The case means something: with this seed a block dies in some step (its parameters get no gradient)."""
    torch.manual_seed(0)
    net = make_net()
    torch.manual_seed(1)
    dead = []
    for images, _ in cifar(net) * 2:
        net.zero_grad()
        loss_function(net(images), torch.zeros(BATCH, dtype=torch.long)).backward()
        dead.append([name for name, p in net.named_parameters() if p.grad is None])
    assert any(dead) and not all(d == dead[0] for d in dead)
