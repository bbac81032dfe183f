"""A static hypernetwork generating every convolution kernel of a ResNet: g1910/HyperNetworks at commit
0087b8081a80e451666aeec952293326db878c8e, hypernetwork_modules.py (``HyperNetwork``), primary_net.py
(``Embedding``, ``PrimaryNetwork``), resnet_blocks.py (``ResNetBlock``) and train.py.

The primary network owns no convolution weight of its blocks: each forward asks the one shared ``HyperNetwork``
(two matmuls over ``Parameter``s initialized with ``torch.fmod(torch.randn(...), 2)``) for a kernel per layer
embedding ``z`` (``ParameterList``s in ``Embedding`` modules, tiled with ``torch.cat`` into larger kernels), and the
blocks apply them with ``F.conv2d``; so the hypernetwork's parameters are reached through every layer of the
graph, and each ``z`` only through its own. The blocks add the residual in place (``out += residual``) after an
in-place ReLU. Adam with weight decay, ``MultiStepLR`` stepped every iteration after ``optimizer.step()``.

Changes for a seconds-long test: ``z_dim`` 4 (64), 4-8 channels (16-64), three blocks (18) over 3x8x8 images
(32x32; the global pool over 4x4, 8x8), 3 classes, 4 iterations (``max_iter``; 1,000,000) of batches of 4, a
milestone at iteration 2 (168000); ``.cuda()`` dropped, ``loss.data[0]`` (an error on a 0-dim tensor today) as
``loss.item()``; no augmentation, evaluation or checkpoints.

The port is the default step with the scheduler per step (``interval: "step"``).
"""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.optim as optim
from torch.nn.parameter import Parameter

from safeloop import Trainer

from .harness import checks, compare

Z_DIM, CLASSES, BATCH, MAX_ITER = 4, 3, 4, 4
learning_rate, weight_decay, milestones = 0.002, 0.0005, [2]


# -- hypernetwork_modules.py --------------------------------------------------------------------------------
class HyperNetwork(nn.Module):

    def __init__(self, f_size=3, z_dim=Z_DIM, out_size=4, in_size=4):
        super(HyperNetwork, self).__init__()
        self.z_dim = z_dim
        self.f_size = f_size
        self.out_size = out_size
        self.in_size = in_size

        self.w1 = Parameter(torch.fmod(torch.randn((self.z_dim, self.out_size*self.f_size*self.f_size)), 2))
        self.b1 = Parameter(torch.fmod(torch.randn((self.out_size*self.f_size*self.f_size)), 2))

        self.w2 = Parameter(torch.fmod(torch.randn((self.z_dim, self.in_size*self.z_dim)), 2))
        self.b2 = Parameter(torch.fmod(torch.randn((self.in_size*self.z_dim)), 2))

    def forward(self, z):

        h_in = torch.matmul(z, self.w2) + self.b2
        h_in = h_in.view(self.in_size, self.z_dim)

        h_final = torch.matmul(h_in, self.w1) + self.b1
        kernel = h_final.view(self.out_size, self.in_size, self.f_size, self.f_size)

        return kernel


# -- resnet_blocks.py ---------------------------------------------------------------------------------------
class IdentityLayer(nn.Module):

    def forward(self, x):
        return x


class ResNetBlock(nn.Module):

    def __init__(self, in_size=16, out_size=16, downsample=False):
        super(ResNetBlock, self).__init__()
        self.out_size = out_size
        self.in_size = in_size
        if downsample:
            self.stride1 = 2
            self.reslayer = nn.Conv2d(in_channels=self.in_size, out_channels=self.out_size, stride=2, kernel_size=1)
        else:
            self.stride1 = 1
            self.reslayer = IdentityLayer()

        self.bn1 = nn.BatchNorm2d(out_size)
        self.bn2 = nn.BatchNorm2d(out_size)

    def forward(self, x, conv1_w, conv2_w):

        residual = self.reslayer(x)

        out = F.relu(self.bn1(F.conv2d(x, conv1_w, stride=self.stride1, padding=1)), inplace=True)
        out = self.bn2(F.conv2d(out, conv2_w, padding=1))

        out += residual

        out = F.relu(out)

        return out


# -- primary_net.py -----------------------------------------------------------------------------------------
class Embedding(nn.Module):

    def __init__(self, z_num, z_dim):
        super(Embedding, self).__init__()

        self.z_list = nn.ParameterList()
        self.z_num = z_num
        self.z_dim = z_dim

        h, k = self.z_num

        for i in range(h):
            for j in range(k):
                self.z_list.append(Parameter(torch.fmod(torch.randn(self.z_dim), 2)))

    def forward(self, hyper_net):
        ww = []
        h, k = self.z_num
        for i in range(h):
            w = []
            for j in range(k):
                w.append(hyper_net(self.z_list[i*k + j]))
            ww.append(torch.cat(w, dim=1))
        return torch.cat(ww, dim=0)


class PrimaryNetwork(nn.Module):

    def __init__(self, z_dim=Z_DIM):
        super(PrimaryNetwork, self).__init__()
        self.conv1 = nn.Conv2d(3, 4, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(4)

        self.z_dim = z_dim
        self.hope = HyperNetwork(z_dim=self.z_dim)

        self.zs_size = [[1, 1], [1, 1], [2, 1], [2, 2], [2, 2], [2, 2]]

        self.filter_size = [[4, 4], [4, 8], [8, 8]]

        self.res_net = nn.ModuleList()

        for i in range(3):
            down_sample = False
            if i == 1:  # i > 5 and i % 6 == 0
                down_sample = True
            self.res_net.append(ResNetBlock(self.filter_size[i][0], self.filter_size[i][1], downsample=down_sample))

        self.zs = nn.ModuleList()

        for i in range(6):
            self.zs.append(Embedding(self.zs_size[i], self.z_dim))

        self.global_avg = nn.AvgPool2d(4)
        self.final = nn.Linear(8, CLASSES)

    def forward(self, x):
        x = F.relu(self.bn1(self.conv1(x)))

        for i in range(3):
            w1 = self.zs[2*i](self.hope)
            w2 = self.zs[2*i+1](self.hope)
            x = self.res_net[i](x, w1, w2)

        x = self.global_avg(x)
        x = self.final(x.view(-1, 8))

        return x


# -- train.py -----------------------------------------------------------------------------------------------
criterion = nn.CrossEntropyLoss()


def make_optimizer(params):
    return optim.Adam(params, lr=learning_rate, weight_decay=weight_decay)


def make_scheduler(optimizer):
    return torch.optim.lr_scheduler.MultiStepLR(optimizer=optimizer, milestones=milestones, gamma=0.5)


def hyper_hand(net, trainloader):
    optimizer = make_optimizer(net.parameters())
    lr_scheduler = make_scheduler(optimizer)
    total_iter = 0
    epochs = 0
    while total_iter < MAX_ITER:

        running_loss = 0.0

        for i, data in enumerate(trainloader, 0):

            inputs, labels = data

            optimizer.zero_grad()

            outputs = net(inputs)
            loss = criterion(outputs, labels)
            loss.backward()

            optimizer.step()
            lr_scheduler.step()

            running_loss += loss.item()

            total_iter += 1

        epochs += 1


class HyperTrainer(Trainer):
    def training_step(self, batch):
        inputs, labels = batch
        return criterion(self.model(inputs), labels)


def cifar(model):
    gen = torch.Generator().manual_seed(10)
    return [(torch.randn(BATCH, 3, 8, 8, generator=gen), torch.randint(CLASSES, (BATCH,), generator=gen))
            for _ in range(MAX_ITER)]


@pytest.mark.parametrize("check", checks())
def test_hypernetwork_kernels_through_functional_convolutions(check):
    compare(PrimaryNetwork, hyper_hand, HyperTrainer, cifar, check, steps=MAX_ITER, optimizer=make_optimizer,
            scheduler={"scheduler": make_scheduler, "interval": "step"})
