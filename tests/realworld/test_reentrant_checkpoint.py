"""A memory-efficient DenseNet with reentrant checkpointing: pytorch/vision v0.4.0, torchvision/models/densenet.py
(``_bn_function_factory``, ``_DenseLayer``, ``_DenseBlock``, ``_Transition``, ``DenseNet``), trained as
pytorch/examples, imagenet/main.py (``train``) trains it.

With ``memory_efficient=True`` each dense layer runs its concatenation, BatchNorm, in-place ReLU and 1x1
convolution through ``torch.utils.checkpoint.checkpoint`` in its reentrant form (torchvision 0.4's call passes no
``use_reentrant``; True is what that meant): the function runs under ``no_grad`` in the forward, an autograd
``Function`` keeps only its inputs, and its backward runs the function again with grad enabled and calls
``torch.autograd.backward`` itself on the recomputed output, from inside the outer backward. So BatchNorm's
running statistics move twice per step. Dropout after each layer; the block concatenates all features.

Changes for a seconds-long test: 2x6x6 images (224x224 RGB), ``num_init_features`` 4 (64), ``growth_rate`` 2 (32),
``bn_size`` 2 (4), two blocks of 2 layers (4), 3 classes, batches of 4, 5 steps, ``drop_rate`` 0.2 (0, so that the
RNG is used); ``use_reentrant=True`` written out (PyTorch warns when it is left out).

The port is the plain Trainer with the loop's criterion and optimizer.
"""
from collections import OrderedDict

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.utils.checkpoint as cp

from safeloop import Trainer

from .harness import checks, compare, fixed


# -- torchvision/models/densenet.py (v0.4.0) ----------------------------------------------------------------
def _bn_function_factory(norm, relu, conv):
    def bn_function(*inputs):
        concated_features = torch.cat(inputs, 1)
        bottleneck_output = conv(relu(norm(concated_features)))
        return bottleneck_output

    return bn_function


class _DenseLayer(nn.Module):
    def __init__(self, num_input_features, growth_rate, bn_size, drop_rate, memory_efficient=False):
        super(_DenseLayer, self).__init__()
        self.add_module('norm1', nn.BatchNorm2d(num_input_features)),
        self.add_module('relu1', nn.ReLU(inplace=True)),
        self.add_module('conv1', nn.Conv2d(num_input_features, bn_size *
                                           growth_rate, kernel_size=1, stride=1,
                                           bias=False)),
        self.add_module('norm2', nn.BatchNorm2d(bn_size * growth_rate)),
        self.add_module('relu2', nn.ReLU(inplace=True)),
        self.add_module('conv2', nn.Conv2d(bn_size * growth_rate, growth_rate,
                                           kernel_size=3, stride=1, padding=1,
                                           bias=False)),
        self.drop_rate = drop_rate
        self.memory_efficient = memory_efficient

    def forward(self, *prev_features):
        bn_function = _bn_function_factory(self.norm1, self.relu1, self.conv1)
        if self.memory_efficient and any(prev_feature.requires_grad for prev_feature in prev_features):
            bottleneck_output = cp.checkpoint(bn_function, *prev_features, use_reentrant=True)
        else:
            bottleneck_output = bn_function(*prev_features)
        new_features = self.conv2(self.relu2(self.norm2(bottleneck_output)))
        if self.drop_rate > 0:
            new_features = F.dropout(new_features, p=self.drop_rate,
                                     training=self.training)
        return new_features


class _DenseBlock(nn.Module):
    def __init__(self, num_layers, num_input_features, bn_size, growth_rate, drop_rate, memory_efficient=False):
        super(_DenseBlock, self).__init__()
        for i in range(num_layers):
            layer = _DenseLayer(
                num_input_features + i * growth_rate,
                growth_rate=growth_rate,
                bn_size=bn_size,
                drop_rate=drop_rate,
                memory_efficient=memory_efficient,
            )
            self.add_module('denselayer%d' % (i + 1), layer)

    def forward(self, init_features):
        features = [init_features]
        for name, layer in self.named_children():
            new_features = layer(*features)
            features.append(new_features)
        return torch.cat(features, 1)


class _Transition(nn.Sequential):
    def __init__(self, num_input_features, num_output_features):
        super(_Transition, self).__init__()
        self.add_module('norm', nn.BatchNorm2d(num_input_features))
        self.add_module('relu', nn.ReLU(inplace=True))
        self.add_module('conv', nn.Conv2d(num_input_features, num_output_features,
                                          kernel_size=1, stride=1, bias=False))
        self.add_module('pool', nn.AvgPool2d(kernel_size=2, stride=2))


class DenseNet(nn.Module):
    def __init__(self, growth_rate=2, block_config=(2, 2),
                 num_init_features=4, bn_size=2, drop_rate=0.2, num_classes=3, memory_efficient=True):

        super(DenseNet, self).__init__()

        # First convolution
        self.features = nn.Sequential(OrderedDict([
            ('conv0', nn.Conv2d(2, num_init_features, kernel_size=3, stride=1,
                                padding=1, bias=False)),
            ('norm0', nn.BatchNorm2d(num_init_features)),
            ('relu0', nn.ReLU(inplace=True)),
            ('pool0', nn.MaxPool2d(kernel_size=3, stride=2, padding=1)),
        ]))

        # Each denseblock
        num_features = num_init_features
        for i, num_layers in enumerate(block_config):
            block = _DenseBlock(
                num_layers=num_layers,
                num_input_features=num_features,
                bn_size=bn_size,
                growth_rate=growth_rate,
                drop_rate=drop_rate,
                memory_efficient=memory_efficient
            )
            self.features.add_module('denseblock%d' % (i + 1), block)
            num_features = num_features + num_layers * growth_rate
            if i != len(block_config) - 1:
                trans = _Transition(num_input_features=num_features,
                                    num_output_features=num_features // 2)
                self.features.add_module('transition%d' % (i + 1), trans)
                num_features = num_features // 2

        # Final batch norm
        self.features.add_module('norm5', nn.BatchNorm2d(num_features))

        # Linear layer
        self.classifier = nn.Linear(num_features, num_classes)

        # Official init from torch repo.
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight)
            elif isinstance(m, nn.BatchNorm2d):
                nn.init.constant_(m.weight, 1)
                nn.init.constant_(m.bias, 0)
            elif isinstance(m, nn.Linear):
                nn.init.constant_(m.bias, 0)

    def forward(self, x):
        features = self.features(x)
        out = F.relu(features, inplace=True)
        out = F.adaptive_avg_pool2d(out, (1, 1))
        out = torch.flatten(out, 1)
        out = self.classifier(out)
        return out


# -- imagenet/main.py's train -------------------------------------------------------------------------------
def densenet_opt(params):
    return torch.optim.SGD(params, lr=0.1, momentum=0.9, weight_decay=1e-4)


def densenet_hand(model, train_loader):
    criterion = nn.CrossEntropyLoss()
    optimizer = densenet_opt(model.parameters())
    model.train()
    for i, (images, target) in enumerate(train_loader):
        output = model(images)
        loss = criterion(output, target)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()


def images(n=5):
    gen = torch.Generator().manual_seed(4)
    return [(torch.randn(4, 2, 6, 6, generator=gen), torch.randint(3, (4,), generator=gen)) for _ in range(n)]


@pytest.mark.parametrize("check", checks())
def test_densenet_with_reentrant_checkpoints_around_batchnorm(check):
    compare(DenseNet, densenet_hand, Trainer, fixed(images()), check, steps=5, optimizer=densenet_opt,
            loss_fn=nn.CrossEntropyLoss())
