"""A binarized network trained through its real-valued weights: itayhubara/BinaryNet.pytorch at commit
b99870af6e73992896ab5db5ea26b83d2adb1201, main_mnist.py (``Net``, ``train``, ``test``, the epoch loop) and
models/binarized_modules.py (``Binarize``, ``BinarizeLinear``).

``BinarizeLinear.forward`` keeps the real weights in an attribute of the Parameter itself (``self.weight.org``, made
by the first forward), replaces the Parameter's data by their signs (``self.weight.data = Binarize(...)``, a write
no version counter sees) before ``F.linear`` saves it, binarizes its input in place the same way
(``input.data = ...``: the previous layer's Hardtanh output) except on the first layer, and adds the bias in place
(``out +=``, the bias's ``org`` set anew every forward). ``train`` back-propagates through the binary weights, then
copies the real weights back into every Parameter that has an ``org`` (``p.data.copy_(p.org)``) so that Adam
steps them, then clamps them in place and stores them in ``org`` again. BatchNorm after every layer, dropout,
``nn.LogSoftmax()`` without a dimension (the source's deprecation warning) under ``CrossEntropyLoss``, the learning
rate assigned every batch of every 40th epoch; ``test`` in eval mode under ``no_grad`` after each epoch (its
forwards binarize the weights again).

Changes for a seconds-long test: hidden layers of 8 units (``2048 * infl_ratio``), batches of 8 random 28x28
images, 3 batches an epoch, 2 epochs, 2 test batches; the printing and CUDA left out. The version at the newer
commit 80f6d46 ("adding support for pytorch2") moves binarization into an ``InplaceFunction`` and leaves
``input_b`` undefined on the first layer.

The port copies the real weights back in ``on_before_optimizer_step``, clamps them into ``org`` in
``on_step_end``, tests in ``on_epoch_end`` and puts the model back in train mode in ``on_epoch_start``, as
``train`` does.
"""
import copy
import warnings
from functools import partial

import pytest
import torch
import torch.nn as nn
import torch.optim as optim
from torch.autograd import Variable

from safeloop import GraphGuard, InplaceModificationError, Trainer
from safeloop.watch import Watch

from .harness import assert_same, checks, strict

EPOCHS, LR, WIDTH = 2, 0.01, 8


# -- models/binarized_modules.py -----------------------------------------------------------------------------------
def Binarize(tensor,quant_mode='det'):
    if quant_mode=='det':
        return tensor.sign()
    else:
        return tensor.add_(1).div_(2).add_(torch.rand(tensor.size()).add(-0.5)).clamp_(0,1).round().mul_(2).add_(-1)


class BinarizeLinear(nn.Linear):

    def __init__(self, *kargs, **kwargs):
        super(BinarizeLinear, self).__init__(*kargs, **kwargs)

    def forward(self, input):

        if input.size(1) != 784:
            input.data=Binarize(input.data)
        if not hasattr(self.weight,'org'):
            self.weight.org=self.weight.data.clone()
        self.weight.data=Binarize(self.weight.org)
        out = nn.functional.linear(input, self.weight)
        if not self.bias is None:
            self.bias.org=self.bias.data.clone()
            out += self.bias.view(1, -1).expand_as(out)

        return out


# -- main_mnist.py (narrowed) --------------------------------------------------------------------------------------
class Net(nn.Module):
    def __init__(self):
        super(Net, self).__init__()
        self.fc1 = BinarizeLinear(784, WIDTH)
        self.htanh1 = nn.Hardtanh()
        self.bn1 = nn.BatchNorm1d(WIDTH)
        self.fc2 = BinarizeLinear(WIDTH, WIDTH)
        self.htanh2 = nn.Hardtanh()
        self.bn2 = nn.BatchNorm1d(WIDTH)
        self.fc3 = BinarizeLinear(WIDTH, WIDTH)
        self.htanh3 = nn.Hardtanh()
        self.bn3 = nn.BatchNorm1d(WIDTH)
        self.fc4 = nn.Linear(WIDTH, 10)
        self.logsoftmax=nn.LogSoftmax()
        self.drop=nn.Dropout(0.5)

    def forward(self, x):
        x = x.view(-1, 28*28)
        x = self.fc1(x)
        x = self.bn1(x)
        x = self.htanh1(x)
        x = self.fc2(x)
        x = self.bn2(x)
        x = self.htanh2(x)
        x = self.fc3(x)
        x = self.drop(x)
        x = self.bn3(x)
        x = self.htanh3(x)
        x = self.fc4(x)
        return self.logsoftmax(x)


criterion = nn.CrossEntropyLoss()


def train(model, optimizer, train_loader, epoch):
    model.train()
    for batch_idx, (data, target) in enumerate(train_loader):
        data, target = Variable(data), Variable(target)
        optimizer.zero_grad()
        output = model(data)
        loss = criterion(output, target)

        if epoch%40==0:
            optimizer.param_groups[0]['lr']=optimizer.param_groups[0]['lr']*0.1

        optimizer.zero_grad()
        loss.backward()
        for p in list(model.parameters()):
            if hasattr(p,'org'):
                p.data.copy_(p.org)
        optimizer.step()
        for p in list(model.parameters()):
            if hasattr(p,'org'):
                p.org.copy_(p.data.clamp_(-1,1))


def test(model, test_loader):
    model.eval()
    test_loss = 0
    correct = 0
    with torch.no_grad():
        for data, target in test_loader:
            data, target = Variable(data), Variable(target)
            output = model(data)
            test_loss += criterion(output, target).item() # sum up batch loss
            pred = output.data.max(1, keepdim=True)[1] # get the index of the max log-probability
            correct += pred.eq(target.data.view_as(pred)).cpu().sum()
    return correct


test.__test__ = False  # the source's name, not a pytest test


def binarynet_hand(model, data):
    train_loader, test_loader = data
    optimizer = optim.Adam(model.parameters(), lr=LR)
    for epoch in range(1, EPOCHS + 1):
        train(model, optimizer, train_loader, epoch)
        test(model, test_loader)
        if epoch%40==0:
            optimizer.param_groups[0]['lr']=optimizer.param_groups[0]['lr']*0.1


def digits():
    gen = torch.Generator().manual_seed(4)
    make = lambda: (torch.randn(8, 1, 28, 28, generator=gen), torch.randint(10, (8,), generator=gen))
    return [make() for _ in range(3)], [make() for _ in range(2)]


class BinaryTrainer(Trainer):
    test_loader: list

    def on_epoch_start(self):
        self.model.train()

    def training_step(self, batch):
        data, target = batch
        loss = criterion(self.model(data), target)
        if (self.state.epoch + 1) % 40 == 0:
            self.optimizers["optimizer"].param_groups[0]["lr"] *= 0.1
        return loss

    def on_before_optimizer_step(self, name, optimizer):
        for p in list(self.model.parameters()):
            if hasattr(p, 'org'):
                p.data.copy_(p.org)

    def on_step_end(self, losses):
        for p in list(self.model.parameters()):
            if hasattr(p, 'org'):
                p.org.copy_(p.data.clamp_(-1, 1))

    def on_epoch_end(self):
        test(self.model, self.test_loader)
        if (self.state.epoch + 1) % 40 == 0:
            self.optimizers["optimizer"].param_groups[0]["lr"] *= 0.1


def real_weights(model):
    return {name: p.org for name, p in model.named_parameters() if hasattr(p, "org")}


@pytest.mark.parametrize("check", checks())
def test_binarynet_with_sign_weights_swapped_in_through_data(check):
    torch.manual_seed(0)
    ref = Net()
    ours, watched, start = copy.deepcopy(ref), copy.deepcopy(ref), copy.deepcopy(ref)
    torch.manual_seed(1)
    with warnings.catch_warnings(record=True) as own:
        warnings.simplefilter("always")
        binarynet_hand(ref, digits())
    torch.manual_seed(1)
    with strict(own), Watch(GraphGuard(check=check), binarynet_hand.__code__.co_filename):  # as harness.compare
        binarynet_hand(watched, digits())
    torch.manual_seed(1)
    train_loader, test_loader = digits()
    with strict(own):
        trainer = BinaryTrainer(model=ours, train_data=train_loader, optimizer=partial(optim.Adam, lr=LR),
                                max_epochs=EPOCHS, device="cpu", progress=False, loggers=(), guard={"check": check})
        trainer.test_loader = test_loader
        trainer.fit()
    assert trainer.state.step == EPOCHS * len(train_loader)
    for model in (watched, ours):
        assert_same(model, ref)
        want, got = real_weights(ref), real_weights(model)
        assert want.keys() == got.keys() and all(torch.equal(got[k], want[k]) for k in want)
    assert len(real_weights(ref)) == 6 and not torch.equal(ref.fc2.weight.org, start.fc2.weight.sign())
    assert set(ref.fc2.weight.unique().tolist()) <= {-1.0, 0.0, 1.0}  # the last test left the signs in place


# -- the real weights copied back before backward: F.linear saved the Parameter, whose data changes under it
# through ``.data`` (no version bump), so backward uses the real weights instead of the signs, silently in PyTorch --
def train_restoring_before_backward(model, optimizer, train_loader, epoch):
    model.train()
    for batch_idx, (data, target) in enumerate(train_loader):
        optimizer.zero_grad()
        loss = criterion(model(data), target)
        for p in list(model.parameters()):
            if hasattr(p, 'org'):
                p.data.copy_(p.org)
        loss.backward()
        optimizer.step()
        for p in list(model.parameters()):
            if hasattr(p, 'org'):
                p.org.copy_(p.data.clamp_(-1, 1))


def restoring_hand(model, train_loader):
    optimizer = optim.Adam(model.parameters(), lr=LR)
    for epoch in range(1, EPOCHS + 1):
        train_restoring_before_backward(model, optimizer, train_loader, epoch)


class RestoringBeforeBackward(BinaryTrainer):
    def on_before_backward(self, name, loss):
        for p in list(self.model.parameters()):
            if hasattr(p, 'org'):
                p.data.copy_(p.org)

    def on_before_optimizer_step(self, name, optimizer):
        """Nothing here: the real weights were copied back before backward (``on_before_backward``)."""


@pytest.mark.filterwarnings("ignore:Implicit dimension choice")
def test_watch_sees_the_real_weights_copied_back_before_backward():
    torch.manual_seed(0)
    model = Net()
    with Watch(GraphGuard(check="always"), restoring_hand.__code__.co_filename):
        with pytest.raises(InplaceModificationError, match=r"`model\.fc3\.weight`, `model\.fc2\.weight`"):
            restoring_hand(model, digits()[0])


@pytest.mark.filterwarnings("ignore:Implicit dimension choice")
def test_the_trainer_sees_the_real_weights_copied_back_in_on_before_backward():
    torch.manual_seed(0)
    model = Net()
    train_loader, test_loader = digits()
    trainer = RestoringBeforeBackward(model=model, train_data=train_loader, optimizer=partial(optim.Adam, lr=LR),
                                      max_epochs=EPOCHS, device="cpu", progress=False, loggers=(),
                                      guard={"check": "always"})
    trainer.test_loader = test_loader
    with pytest.raises(InplaceModificationError, match=r"fc2\.weight"):
        trainer.fit()
