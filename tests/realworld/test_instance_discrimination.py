"""Non-parametric instance discrimination with a memory bank updated inside backward: zhirongw/lemniscate.pytorch
at commit 06c2d49de8a05a2034a0df2942f9121621f49dc0, lib/LinearAverage.py (``LinearAverageOp``,
``LinearAverage``), lib/normalize.py (``Normalize``) and main.py (``train``, ``adjust_learning_rate``, the
``nce_k == 0`` branch: ``LinearAverage`` with ``nn.CrossEntropyLoss``).

``LinearAverageOp`` is an ``autograd.Function`` that keeps its tensors as a ctx attribute
(``self.data_for_backward = x, memory, y, params``, not ``save_for_backward``): the input features (with their
graph), the memory bank buffer, the instance indices, the temperature buffer. Its backward divides the incoming
gradient in place (``gradOutput.data.div_(T)``), computes the features' gradient from the memory, then moves the
memory bank itself in place (``memory.index_copy_(0, y, updated_weight)``: a momentum average of each instance's
entry and its new feature, renormalized): a buffer changed during backward, whose new values the next step's
forward reads. ``train`` accumulates ``iter_size`` batches (``loss / args.iter_size``, ``zero_grad`` after each
update, once before the epoch).

Changes for a seconds-long test: a conv-pool-linear net with a 4-d output (ResNet-18, ``low_dim`` 128) over
3x6x6 images, a dataset of 8 instances, batches of 4 with their instance indices (``ImageFolderInstance``),
``iter_size`` 2, 2 epochs of 4 batches, the lr decayed at epoch 1 (120); ``.cuda()``, ``DataParallel`` and
``Variable`` dropped, ``loss.data[0]`` (an error on a 0-dim tensor today) as ``loss.item()``; no kNN
evaluation or checkpoints.

The port: ``grad_accum=2`` (each loss divided by it, as the loop does); the lr in ``on_epoch_start``; the net and
the memory module in one ``nn.Module`` so that both are compared (the optimizer holds the net's parameters, as
the source's ``SGD(model.parameters())``).
"""
import math

import pytest
import torch
import torch.nn as nn
from torch.autograd import Function, Variable

from safeloop import Trainer

from .harness import checks, compare

LOW_DIM, NDATA, BATCH, ITER_SIZE, PER_EPOCH, EPOCHS = 4, 8, 4, 2, 4, 2
LR, MOMENTUM, WEIGHT_DECAY, NCE_T, NCE_M = 0.03, 0.9, 1e-4, 0.07, 0.5


# -- lib/LinearAverage.py -----------------------------------------------------------------------------------
class LinearAverageOp(Function):
    @staticmethod
    def forward(self, x, y, memory, params):
        T = params[0]
        batchSize = x.size(0)
        outputSize = memory.size(1)
        inputSize = memory.size(1)

        # inner product
        out = torch.mm(x, memory.t())
        out.div_(T)  # batchSize * N

        self.data_for_backward = x, memory, y, params

        return out

    @staticmethod
    def backward(self, gradOutput):
        x, memory, y, params = self.data_for_backward
        batchSize = gradOutput.size(0)
        T = params[0]
        momentum = params[1]

        # add temperature
        gradOutput.data.div_(T)

        # gradient of linear
        gradInput = torch.mm(gradOutput.data, memory)
        gradInput.resize_as_(x)

        # update the non-parametric data
        weight_pos = memory.index_select(0, y.view(-1)).resize_as_(x)
        weight_pos.mul_(momentum)
        weight_pos.add_(torch.mul(x, 1-momentum))
        w_norm = weight_pos.pow(2).sum(1, keepdim=True).pow(0.5)
        updated_weight = weight_pos.div(w_norm)
        memory.index_copy_(0, y, updated_weight)

        return Variable(gradInput), None, None, None


class LinearAverage(nn.Module):

    def __init__(self, inputSize, outputSize, T=0.07, momentum=0.5):
        super(LinearAverage, self).__init__()
        stdv = 1 / math.sqrt(inputSize)
        self.nLem = outputSize

        self.register_buffer('params', torch.Tensor([T, momentum]))
        stdv = 1. / math.sqrt(inputSize/3)
        self.register_buffer('memory', torch.rand(outputSize, inputSize).mul_(2*stdv).add_(-stdv))

    def forward(self, x, y):
        out = LinearAverageOp.apply(x, y, self.memory, self.params)
        return out


# -- lib/normalize.py ---------------------------------------------------------------------------------------
class Normalize(nn.Module):

    def __init__(self, power=2):
        super(Normalize, self).__init__()
        self.power = power

    def forward(self, x):
        norm = x.pow(self.power).sum(1, keepdim=True).pow(1./self.power)
        out = x.div(norm)
        return out


class Net(nn.Module):
    """Stands in for ``models.resnet18(low_dim=...)``: its last layers, ``fc`` to ``low_dim`` and ``l2norm``."""

    def __init__(self, low_dim=LOW_DIM):
        super().__init__()
        self.features = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(inplace=True),
                                      nn.AdaptiveAvgPool2d(1))
        self.fc = nn.Linear(4, low_dim)
        self.l2norm = Normalize(2)

    def forward(self, x):
        return self.l2norm(self.fc(self.features(x).view(x.size(0), -1)))


class Instances(nn.Module):
    """The net and the memory module, held together so that both are compared."""

    def __init__(self):
        super().__init__()
        self.net = Net()
        self.lemniscate = LinearAverage(LOW_DIM, NDATA, NCE_T, NCE_M)


# -- main.py ------------------------------------------------------------------------------------------------
criterion = nn.CrossEntropyLoss()


def adjust_learning_rate(optimizer, epoch):
    """Sets the learning rate to the initial LR decayed by 10 every 100 epochs"""
    lr = LR
    if epoch < 1:  # 120
        lr = LR
    else:
        lr = LR * 0.1
    for param_group in optimizer.param_groups:
        param_group['lr'] = lr


def make_optimizer(params):
    return torch.optim.SGD(params, LR, momentum=MOMENTUM, weight_decay=WEIGHT_DECAY)


def train(train_loader, model, lemniscate, criterion, optimizer, epoch):
    # switch to train mode
    model.train()

    optimizer.zero_grad()
    for i, (input, _, index) in enumerate(train_loader):
        # compute output
        feature = model(input)
        output = lemniscate(feature, index)
        loss = criterion(output, index) / ITER_SIZE

        loss.backward()

        if (i+1) % ITER_SIZE == 0:
            # compute gradient and do SGD step
            optimizer.step()
            optimizer.zero_grad()


def lemniscate_hand(instances, train_loader):
    model, lemniscate = instances.net, instances.lemniscate
    optimizer = make_optimizer(model.parameters())
    for epoch in range(0, EPOCHS):
        adjust_learning_rate(optimizer, epoch)

        # train for one epoch
        train(train_loader, model, lemniscate, criterion, optimizer, epoch)


class InstanceTrainer(Trainer):
    def configure_optimizers(self):
        return make_optimizer(self.model.net.parameters())

    def on_epoch_start(self):
        adjust_learning_rate(self.optimizers["optimizer"], self.state.epoch)
        self.model.net.train()

    def training_step(self, batch):
        input, _, index = batch
        feature = self.model.net(input)
        output = self.model.lemniscate(feature, index)
        return criterion(output, index)


def instance_batches(model):
    gen = torch.Generator().manual_seed(12)
    images = torch.randn(NDATA, 3, 6, 6, generator=gen)
    out = []
    for _ in range(PER_EPOCH // 2):
        for index in torch.randperm(NDATA, generator=gen).split(BATCH):
            out.append((images[index], torch.zeros(BATCH, dtype=torch.long), index))
    return out


@pytest.mark.parametrize("check", checks())
def test_instance_discrimination_with_a_memory_bank_moved_inside_backward(check):
    compare(Instances, lemniscate_hand, InstanceTrainer, instance_batches, check,
            steps=EPOCHS * PER_EPOCH // ITER_SIZE, grad_accum=ITER_SIZE)


def test_the_memory_bank_moves():
    torch.manual_seed(0)
    instances = Instances()
    before = instances.lemniscate.memory.clone()
    lemniscate_hand(instances, instance_batches(instances))
    assert not torch.equal(before, instances.lemniscate.memory)
