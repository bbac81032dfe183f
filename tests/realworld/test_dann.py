"""Domain-adversarial training with a gradient-reversal layer: fungtion/DANN at commit
476147f70bb818a63bb3461a6ecc12f97f7ab15e, models/functions.py (``ReverseLayerF``), models/model.py
(``CNNModel``) and train/main.py (the training loop).

``ReverseLayerF`` is a custom ``autograd.Function`` whose forward returns ``x.view_as(x)`` (a view of its
input, made inside a ``Function``) and keeps the reversal's weight as a Python float on ``ctx`` (``ctx.alpha``);
its backward negates and scales the gradient. The features feed the label classifier directly and the domain
classifier through the reversal, so one backward trains the domain classifier to tell the domains apart and
the feature extractor to confuse it. Each step runs two forwards through the same net (source images with
labels, target images without), the second's class output unused; the three losses are added,
``err_t_domain + err_s_domain + err_s_label``, and back-propagated once. ``alpha`` follows the source's
schedule ``2 / (1 + exp(-10 p)) - 1`` over the progress ``p``. The input is built as the source builds it:
``torch.FloatTensor(n, 3, 28, 28)`` resized in place to the batch (``resize_as_``) and copied into, then
``expand``-ed to 3 channels in the forward (MNIST's one). BatchNorm everywhere, ``Dropout2d`` on 2-D
features (PyTorch warns, as it does for the source), in-place ReLUs, ``LogSoftmax()`` without a dim.

Changes for a seconds-long test: 4 and 5 convolution channels (the source's 64 and 50), hidden layers of 8
(100), 3 classes (10), 2 epochs of 3 batches of 8 random 1-channel source images and 3-channel target images
(MNIST and MNIST-M; 100 epochs of 128) from fixed seeded lists in place of the shuffled DataLoaders; no CUDA;
``xrange``, ``.next()`` and ``print`` made Python 3's; the per-epoch ``torch.save`` and ``test`` are left out.

The port returns ``err`` (the same sum) from ``training_step``, the three terms logged; a second port returns
them as three losses with ``multi_loss="sum"``.
"""
import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.optim as optim
from torch.autograd import Function

from safeloop import Trainer

from .harness import checks, compare

lr = 1e-3
image_size = 28
n_epoch = 2
BATCH, PER_EPOCH, C1, C2, HIDDEN, CLASSES = 8, 3, 4, 5, 8, 3


# -- models/functions.py ----------------------------------------------------------------------------------
class ReverseLayerF(Function):

    @staticmethod
    def forward(ctx, x, alpha):
        ctx.alpha = alpha

        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad_output):
        output = grad_output.neg() * ctx.alpha

        return output, None


# -- models/model.py --------------------------------------------------------------------------------------
class CNNModel(nn.Module):

    def __init__(self):
        super(CNNModel, self).__init__()
        self.feature = nn.Sequential()
        self.feature.add_module('f_conv1', nn.Conv2d(3, C1, kernel_size=5))  # 64
        self.feature.add_module('f_bn1', nn.BatchNorm2d(C1))
        self.feature.add_module('f_pool1', nn.MaxPool2d(2))
        self.feature.add_module('f_relu1', nn.ReLU(True))
        self.feature.add_module('f_conv2', nn.Conv2d(C1, C2, kernel_size=5))  # 64, 50
        self.feature.add_module('f_bn2', nn.BatchNorm2d(C2))
        self.feature.add_module('f_drop1', nn.Dropout2d())
        self.feature.add_module('f_pool2', nn.MaxPool2d(2))
        self.feature.add_module('f_relu2', nn.ReLU(True))

        self.class_classifier = nn.Sequential()
        self.class_classifier.add_module('c_fc1', nn.Linear(C2 * 4 * 4, HIDDEN))
        self.class_classifier.add_module('c_bn1', nn.BatchNorm1d(HIDDEN))
        self.class_classifier.add_module('c_relu1', nn.ReLU(True))
        self.class_classifier.add_module('c_drop1', nn.Dropout2d())
        self.class_classifier.add_module('c_fc2', nn.Linear(HIDDEN, HIDDEN))
        self.class_classifier.add_module('c_bn2', nn.BatchNorm1d(HIDDEN))
        self.class_classifier.add_module('c_relu2', nn.ReLU(True))
        self.class_classifier.add_module('c_fc3', nn.Linear(HIDDEN, CLASSES))
        self.class_classifier.add_module('c_softmax', nn.LogSoftmax())

        self.domain_classifier = nn.Sequential()
        self.domain_classifier.add_module('d_fc1', nn.Linear(C2 * 4 * 4, HIDDEN))
        self.domain_classifier.add_module('d_bn1', nn.BatchNorm1d(HIDDEN))
        self.domain_classifier.add_module('d_relu1', nn.ReLU(True))
        self.domain_classifier.add_module('d_fc2', nn.Linear(HIDDEN, 2))
        self.domain_classifier.add_module('d_softmax', nn.LogSoftmax(dim=1))

    def forward(self, input_data, alpha):
        input_data = input_data.expand(input_data.data.shape[0], 3, 28, 28)
        feature = self.feature(input_data)
        feature = feature.view(-1, C2 * 4 * 4)
        reverse_feature = ReverseLayerF.apply(feature, alpha)
        class_output = self.class_classifier(feature)
        domain_output = self.domain_classifier(reverse_feature)

        return class_output, domain_output


# -- train/main.py ----------------------------------------------------------------------------------------
loss_class = torch.nn.NLLLoss()
loss_domain = torch.nn.NLLLoss()


def dann_hand(my_net, data):
    dataloader_source, dataloader_target = data.source, data.target
    optimizer = optim.Adam(my_net.parameters(), lr=lr)

    for p in my_net.parameters():
        p.requires_grad = True

    for epoch in range(n_epoch):

        len_dataloader = min(len(dataloader_source), len(dataloader_target))
        data_source_iter = iter(dataloader_source)
        data_target_iter = iter(dataloader_target)

        i = 0
        while i < len_dataloader:

            p = float(i + epoch * len_dataloader) / n_epoch / len_dataloader
            alpha = 2. / (1. + np.exp(-10 * p)) - 1

            # training model using source data
            data_source = next(data_source_iter)
            s_img, s_label = data_source

            my_net.zero_grad()
            batch_size = len(s_label)

            input_img = torch.FloatTensor(batch_size, 3, image_size, image_size)
            class_label = torch.LongTensor(batch_size)
            domain_label = torch.zeros(batch_size)
            domain_label = domain_label.long()

            input_img.resize_as_(s_img).copy_(s_img)
            class_label.resize_as_(s_label).copy_(s_label)

            class_output, domain_output = my_net(input_data=input_img, alpha=alpha)
            err_s_label = loss_class(class_output, class_label)
            err_s_domain = loss_domain(domain_output, domain_label)

            # training model using target data
            data_target = next(data_target_iter)
            t_img, _ = data_target

            batch_size = len(t_img)

            input_img = torch.FloatTensor(batch_size, 3, image_size, image_size)
            domain_label = torch.ones(batch_size)
            domain_label = domain_label.long()

            input_img.resize_as_(t_img).copy_(t_img)

            _, domain_output = my_net(input_data=input_img, alpha=alpha)
            err_t_domain = loss_domain(domain_output, domain_label)
            err = err_t_domain + err_s_domain + err_s_label
            err.backward()
            optimizer.step()

            i += 1


class Domains:
    """The two data sets' batches (the hand loop's two loaders); iterated, a pass of (source, target) pairs."""

    def __init__(self):
        gen = torch.Generator().manual_seed(6)
        self.source = [(torch.randn(BATCH, 1, image_size, image_size, generator=gen),
                        torch.randint(CLASSES, (BATCH,), generator=gen)) for _ in range(PER_EPOCH)]
        self.target = [(torch.randn(BATCH, 3, image_size, image_size, generator=gen),
                        torch.randint(CLASSES, (BATCH,), generator=gen)) for _ in range(PER_EPOCH)]

    def __iter__(self):
        return iter(zip(self.source, self.target))

    def __len__(self):
        return min(len(self.source), len(self.target))


class DANN(Trainer):
    def configure_optimizers(self):
        return optim.Adam(self.model.parameters(), lr=lr)

    def losses(self, batch):
        my_net = self.model
        (s_img, s_label), (t_img, _) = batch
        len_dataloader = len(self.train_data)
        i, epoch = self.state.batch_in_epoch - 1, self.state.epoch
        p = float(i + epoch * len_dataloader) / n_epoch / len_dataloader
        alpha = 2. / (1. + np.exp(-10 * p)) - 1

        batch_size = len(s_label)
        input_img = torch.FloatTensor(batch_size, 3, image_size, image_size)
        class_label = torch.LongTensor(batch_size)
        domain_label = torch.zeros(batch_size).long()
        input_img.resize_as_(s_img).copy_(s_img)
        class_label.resize_as_(s_label).copy_(s_label)
        class_output, domain_output = my_net(input_data=input_img, alpha=alpha)
        err_s_label = loss_class(class_output, class_label)
        err_s_domain = loss_domain(domain_output, domain_label)

        batch_size = len(t_img)
        input_img = torch.FloatTensor(batch_size, 3, image_size, image_size)
        domain_label = torch.ones(batch_size).long()
        input_img.resize_as_(t_img).copy_(t_img)
        _, domain_output = my_net(input_data=input_img, alpha=alpha)
        err_t_domain = loss_domain(domain_output, domain_label)
        return {"err_t_domain": err_t_domain, "err_s_domain": err_s_domain, "err_s_label": err_s_label}

    def training_step(self, batch):
        losses = self.losses(batch)
        for name, value in losses.items():
            self.log(name, value)
        return losses["err_t_domain"] + losses["err_s_domain"] + losses["err_s_label"]


class DANNSum(DANN):
    """The three terms as three losses, added by the Trainer (``multi_loss="sum"``) in the source's order."""

    def training_step(self, batch):
        return self.losses(batch)


def dann_model():
    return CNNModel()


@pytest.mark.parametrize("check", checks())
def test_dann_with_a_gradient_reversal_layer(check):
    compare(dann_model, dann_hand, DANN, lambda model: Domains(), check, steps=n_epoch * PER_EPOCH)


@pytest.mark.parametrize("check", checks())
def test_dann_with_its_three_losses_summed_by_the_trainer(check):
    compare(dann_model, dann_hand, DANNSum, lambda model: Domains(), check, steps=n_epoch * PER_EPOCH,
            multi_loss="sum")


def test_the_reversal_reverses():
    """The feature extractor's gradient from the domain loss flips sign with the reversal (else the case
    proves little)."""
    torch.manual_seed(0)
    net = dann_model()
    (s_img, _), _ = next(iter(Domains()))
    grads = []
    for alpha in (1.0, -1.0):
        torch.manual_seed(0)
        net.zero_grad()
        _, domain_output = net(s_img, alpha)
        loss_domain(domain_output, torch.zeros(BATCH).long()).backward()
        grads.append(net.feature.f_conv1.weight.grad.clone())
    assert torch.allclose(grads[0], -grads[1])
