"""A temporal convolutional network on the adding problem: locuslab/TCN (2f8c2b817050206397458dfd1f5a25ce8a32fe65),
``TCN/tcn.py`` (``Chomp1d``, ``TemporalBlock``, ``TemporalConvNet``), ``TCN/adding_problem/model.py`` (``TCN``),
``TCN/adding_problem/utils.py`` (``data_generator``) and ``TCN/adding_problem/add_test.py`` (``train``), verbatim but
for one change: the deprecated hook-based ``torch.nn.utils.weight_norm`` is swapped for
``torch.nn.utils.parametrizations.weight_norm``, as its deprecation warning asks. The weight of each dilated
convolution is then a parametrization (``parametrizations.weight.original0`` and ``original1``, the magnitude and
the direction), computed anew at every access of ``conv.weight``, where the hook-based one set an attribute before
each forward. ``init_weights`` writes ``self.conv1.weight.data.normal_(0, 0.01)``: with either ``weight_norm`` that
writes a computed tensor and changes no parameter (as in the source).

The loop: Adam, ``clip_grad_norm_(model.parameters(), clip)`` when ``--clip`` is positive (here 0.5; the source's
default -1 clips nothing), the batches sliced from the whole training set, the last one shorter.

Changes for a seconds-long test: 3 levels of 6 channels (8 of 30), kernel size 3 (7), sequences of 16 (400), 10
training sequences in batches of 4 (50000 in batches of 32), 2 epochs (10); the evaluation and prints left out.
"""
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.optim as optim
from torch.autograd import Variable
from torch.nn.utils.parametrizations import weight_norm

from safeloop import Trainer

from .harness import assert_same, checks, compare
from .test_resume_ports import straight_and_resumed


# -- TCN/tcn.py ---------------------------------------------------------------------------------------------------
class Chomp1d(nn.Module):
    def __init__(self, chomp_size):
        super(Chomp1d, self).__init__()
        self.chomp_size = chomp_size

    def forward(self, x):
        return x[:, :, :-self.chomp_size].contiguous()


class TemporalBlock(nn.Module):
    def __init__(self, n_inputs, n_outputs, kernel_size, stride, dilation, padding, dropout=0.2):
        super(TemporalBlock, self).__init__()
        self.conv1 = weight_norm(nn.Conv1d(n_inputs, n_outputs, kernel_size,
                                           stride=stride, padding=padding, dilation=dilation))
        self.chomp1 = Chomp1d(padding)
        self.relu1 = nn.ReLU()
        self.dropout1 = nn.Dropout(dropout)

        self.conv2 = weight_norm(nn.Conv1d(n_outputs, n_outputs, kernel_size,
                                           stride=stride, padding=padding, dilation=dilation))
        self.chomp2 = Chomp1d(padding)
        self.relu2 = nn.ReLU()
        self.dropout2 = nn.Dropout(dropout)

        self.net = nn.Sequential(self.conv1, self.chomp1, self.relu1, self.dropout1,
                                 self.conv2, self.chomp2, self.relu2, self.dropout2)
        self.downsample = nn.Conv1d(n_inputs, n_outputs, 1) if n_inputs != n_outputs else None
        self.relu = nn.ReLU()
        self.init_weights()

    def init_weights(self):
        self.conv1.weight.data.normal_(0, 0.01)
        self.conv2.weight.data.normal_(0, 0.01)
        if self.downsample is not None:
            self.downsample.weight.data.normal_(0, 0.01)

    def forward(self, x):
        out = self.net(x)
        res = x if self.downsample is None else self.downsample(x)
        return self.relu(out + res)


class TemporalConvNet(nn.Module):
    def __init__(self, num_inputs, num_channels, kernel_size=2, dropout=0.2):
        super(TemporalConvNet, self).__init__()
        layers = []
        num_levels = len(num_channels)
        for i in range(num_levels):
            dilation_size = 2 ** i
            in_channels = num_inputs if i == 0 else num_channels[i-1]
            out_channels = num_channels[i]
            layers += [TemporalBlock(in_channels, out_channels, kernel_size, stride=1, dilation=dilation_size,
                                     padding=(kernel_size-1) * dilation_size, dropout=dropout)]

        self.network = nn.Sequential(*layers)

    def forward(self, x):
        return self.network(x)


# -- TCN/adding_problem/model.py ----------------------------------------------------------------------------------
class TCN(nn.Module):
    def __init__(self, input_size, output_size, num_channels, kernel_size, dropout):
        super(TCN, self).__init__()
        self.tcn = TemporalConvNet(input_size, num_channels, kernel_size=kernel_size, dropout=dropout)
        self.linear = nn.Linear(num_channels[-1], output_size)
        self.init_weights()

    def init_weights(self):
        self.linear.weight.data.normal_(0, 0.01)

    def forward(self, x):
        y1 = self.tcn(x)
        return self.linear(y1[:, :, -1])


# -- TCN/adding_problem/utils.py ----------------------------------------------------------------------------------
def data_generator(N, seq_length):
    """
    Args:
        seq_length: Length of the adding problem data
        N: # of data in the set
    """
    X_num = torch.rand([N, 1, seq_length])
    X_mask = torch.zeros([N, 1, seq_length])
    Y = torch.zeros([N, 1])
    for i in range(N):
        positions = np.random.choice(seq_length, size=2, replace=False)
        X_mask[i, 0, positions[0]] = 1
        X_mask[i, 0, positions[1]] = 1
        Y[i, 0] = X_num[i, 0, positions[0]] + X_num[i, 0, positions[1]]
    X = torch.cat((X_num, X_mask), dim=1)
    return Variable(X), Variable(Y)


# -- TCN/adding_problem/add_test.py -------------------------------------------------------------------------------
args = SimpleNamespace(batch_size=4, dropout=0.0, clip=0.5, epochs=2, ksize=3, levels=3, seq_len=16, lr=4e-3,
                       optim='Adam', nhid=6)
N_TRAIN = 10


def make_model():
    input_channels = 2
    n_classes = 1
    channel_sizes = [args.nhid]*args.levels
    return TCN(input_channels, n_classes, channel_sizes, kernel_size=args.ksize, dropout=args.dropout)


def make_optimizer(params):
    return getattr(optim, args.optim)(params, lr=args.lr)


def training_set():
    torch.manual_seed(1111)
    np.random.seed(1111)
    return data_generator(N_TRAIN, args.seq_len)


def batches(X_train, Y_train):
    """``train``'s slicing, the last batch shorter."""
    batch_size = args.batch_size
    for i in range(0, X_train.size(0), batch_size):
        if i + batch_size > X_train.size(0):
            x, y = X_train[i:], Y_train[i:]
        else:
            x, y = X_train[i:(i+batch_size)], Y_train[i:(i+batch_size)]
        yield x, y


def tcn_hand(model, data):
    X_train, Y_train = data.X_train, data.Y_train
    optimizer = make_optimizer(model.parameters())

    def train(epoch):
        model.train()
        batch_idx = 1
        total_loss = 0
        for x, y in batches(X_train, Y_train):
            optimizer.zero_grad()
            output = model(x)
            loss = F.mse_loss(output, y)
            loss.backward()
            if args.clip > 0:
                torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
            optimizer.step()
            batch_idx += 1
            total_loss += loss.item()

    for ep in range(1, args.epochs+1):
        train(ep)


class Sliced:
    """The training set, iterated as ``train`` slices it."""

    def __init__(self, X_train, Y_train):
        self.X_train, self.Y_train = X_train, Y_train

    def __iter__(self):
        return batches(self.X_train, self.Y_train)

    def __len__(self):
        return -(-self.X_train.size(0) // args.batch_size)


class TCNTrainer(Trainer):
    def training_step(self, batch):
        x, y = batch
        return F.mse_loss(self.model(x), y)


STEPS = args.epochs * -(-N_TRAIN // args.batch_size)


@pytest.mark.parametrize("check", checks())
def test_tcn_with_parametrized_weight_norm_and_clipping(check):
    data = training_set()

    compare(make_model, tcn_hand, TCNTrainer, lambda model: Sliced(*data), check, steps=STEPS,
            optimizer=make_optimizer, grad_clip=args.clip)


def test_tcn_with_parametrized_weight_norm_resumed_midway(tmp_path):
    data = training_set()
    straight, resumed = straight_and_resumed(tmp_path, make_model, TCNTrainer, lambda model: Sliced(*data), STEPS,
                                             2, optimizer=make_optimizer, grad_clip=args.clip)
    assert_same(resumed.model, straight.model)
