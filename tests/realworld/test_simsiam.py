"""SimSiam: facebookresearch/simsiam at commit 39ac33e618948b88cbe43a65e31f142537073e55, simsiam/builder.py
(``SimSiam``) and main_simsiam.py (``train``, ``adjust_learning_rate``, the optimizer with ``--fix-pred-lr``).

Two views through one encoder (a projector of three BatchNorm'd layers, the last an affine-free BatchNorm) and a
predictor; the stop-gradient is the forward's ``z1.detach(), z2.detach()``. The encoder's original ``fc`` has its
bias frozen (``requires_grad = False``) before it is moved inside the projector, and the optimizer still holds that
bias. In-place ReLUs follow every BatchNorm. The predictor's parameter group keeps a fixed learning rate while
``adjust_learning_rate`` assigns the cosine schedule to the encoder's group at each epoch's start.

Changes for a seconds-long test: a two-layer MLP over 6 features as ``base_encoder`` (a torchvision ResNet in the
source: an ``fc`` attribute and the ``num_classes``/``zero_init_residual`` arguments are what ``SimSiam`` uses of
it), ``dim`` 8 (2048), ``pred_dim`` 4 (512), batches of 8 (512) two epochs of 3 batches, on one process (the
source requires DistributedDataParallel); Gaussian noise as the two augmentations; no printing or checkpoints.

The port sets the learning rates in ``on_epoch_start``, as the loop does before each epoch.
"""
import math
from types import SimpleNamespace

import pytest
import torch
import torch.nn as nn

from safeloop import Trainer

from .harness import batches, checks, compare

EPOCHS, BATCHES = 2, 3
args = SimpleNamespace(lr=0.05 * 8 / 256, momentum=0.9, weight_decay=1e-4, epochs=EPOCHS, dim=8, pred_dim=4,
                       fix_pred_lr=True)


# -- simsiam/builder.py -------------------------------------------------------------------------------------
class SimSiam(nn.Module):
    """
    Build a SimSiam model.
    """
    def __init__(self, base_encoder, dim=2048, pred_dim=512):
        """
        dim: feature dimension (default: 2048)
        pred_dim: hidden dimension of the predictor (default: 512)
        """
        super(SimSiam, self).__init__()

        # create the encoder
        # num_classes is the output fc dimension, zero-initialize last BNs
        self.encoder = base_encoder(num_classes=dim, zero_init_residual=True)

        # build a 3-layer projector
        prev_dim = self.encoder.fc.weight.shape[1]
        self.encoder.fc.bias.requires_grad = False # not use bias as followed by BN
        self.encoder.fc = nn.Sequential(nn.Linear(prev_dim, prev_dim, bias=False),
                                        nn.BatchNorm1d(prev_dim),
                                        nn.ReLU(inplace=True), # first layer
                                        nn.Linear(prev_dim, prev_dim, bias=False),
                                        nn.BatchNorm1d(prev_dim),
                                        nn.ReLU(inplace=True), # second layer
                                        self.encoder.fc,
                                        nn.BatchNorm1d(dim, affine=False)) # output layer

        # build a 2-layer predictor
        self.predictor = nn.Sequential(nn.Linear(dim, pred_dim, bias=False),
                                        nn.BatchNorm1d(pred_dim),
                                        nn.ReLU(inplace=True), # hidden layer
                                        nn.Linear(pred_dim, dim)) # output layer

    def forward(self, x1, x2):
        # compute features for one view
        z1 = self.encoder(x1) # NxC
        z2 = self.encoder(x2) # NxC

        p1 = self.predictor(z1) # NxC
        p2 = self.predictor(z2) # NxC

        return p1, p2, z1.detach(), z2.detach()


class TinyEncoder(nn.Module):
    """What SimSiam uses of torchvision's ResNet: a body, then ``fc``."""

    def __init__(self, num_classes, zero_init_residual=False):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(6, 10), nn.ReLU())
        self.fc = nn.Linear(10, num_classes)

    def forward(self, x):
        return self.fc(self.body(x))


# -- main_simsiam.py ----------------------------------------------------------------------------------------
def make_simsiam():
    return SimSiam(TinyEncoder, args.dim, args.pred_dim)


def make_optimizer(model):
    if args.fix_pred_lr:
        optim_params = [{'params': model.encoder.parameters(), 'fix_lr': False},
                        {'params': model.predictor.parameters(), 'fix_lr': True}]
    else:
        optim_params = model.parameters()

    return torch.optim.SGD(optim_params, args.lr,
                           momentum=args.momentum,
                           weight_decay=args.weight_decay)


def adjust_learning_rate(optimizer, epoch, args):
    """Decay the learning rate based on schedule"""
    lr = args.lr * 0.5 * (1. + math.cos(math.pi * epoch / args.epochs))
    for param_group in optimizer.param_groups:
        if 'fix_lr' in param_group and param_group['fix_lr']:
            param_group['lr'] = args.lr
        else:
            param_group['lr'] = lr


def train(train_loader, model, criterion, optimizer, epoch, args):
    # switch to train mode
    model.train()

    for i, (images, _) in enumerate(train_loader):
        # compute output and loss
        p1, p2, z1, z2 = model(x1=images[0], x2=images[1])
        loss = -(criterion(p1, z2).mean() + criterion(p2, z1).mean()) * 0.5

        # compute gradient and do SGD step
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()


def simsiam_hand(model, train_loader):
    criterion = nn.CosineSimilarity(dim=1)
    optimizer = make_optimizer(model)
    for epoch in range(0, args.epochs):
        adjust_learning_rate(optimizer, epoch, args)

        # train for one epoch
        train(train_loader, model, criterion, optimizer, epoch, args)


def two_crops(model):
    """TwoCropsTransform's pair of views of each image, as a DataLoader yields them ([x1, x2], label)."""
    out = []
    for x, noise1, noise2 in batches(BATCHES, (8, 6), (8, 6), (8, 6)):
        out.append(([x + 0.1 * noise1, x + 0.1 * noise2], torch.zeros(8, dtype=torch.long)))
    return out


class SimSiamTrainer(Trainer):
    def configure_optimizers(self):
        self.criterion = nn.CosineSimilarity(dim=1)
        return make_optimizer(self.model)

    def on_epoch_start(self):
        adjust_learning_rate(self.optimizers["optimizer"], self.state.epoch, args)

    def training_step(self, batch):
        images, _ = batch
        p1, p2, z1, z2 = self.model(x1=images[0], x2=images[1])
        return -(self.criterion(p1, z2).mean() + self.criterion(p2, z1).mean()) * 0.5


@pytest.mark.parametrize("check", checks())
def test_simsiam_with_stop_gradient_and_a_fixed_predictor_lr(check):
    compare(make_simsiam, simsiam_hand, SimSiamTrainer, two_crops, check, steps=EPOCHS * BATCHES)
