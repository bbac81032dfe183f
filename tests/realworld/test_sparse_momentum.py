"""Dynamic sparse training with sparse momentum: TimDettmers/sparse_learning, at commit
e19ff16c475462d50ad247ec2927113617662a4e: mnist_cifar/main.py (``train`` and ``main``'s loop),
sparselearning/core.py (``Masking``, ``CosineDecay``), sparselearning/funcs.py (``magnitude_prune``,
``momentum_growth``, ``momentum_redistribution``: the defaults ``--prune magnitude --growth momentum
--redistribution momentum``) and sparselearning/models.py (``LeNet_300_100``).

A sparse network is trained with Nesterov SGD; ``Masking.step()`` takes the optimizer's place in the loop:
``optimizer.step()``, then ``apply_mask()`` (every masked weight replaced through ``tensor.data =
tensor.data*mask``: new storage for parameters SGD holds, every step) and a step of the cosine decay of
the prune rate (a scheduler over an SGD of its own). At the end of every epoch but the last,
``truncate_weights()`` prunes the smallest surviving weights of each layer, redistributes the pruned count
across layers by the mean magnitude of their momentum (read from ``optimizer.state[weight]
['momentum_buffer']``) and regrows the zero weights where the momentum is largest, then applies the new
masks. A ``StepLR`` is stepped at the start of every batch, before the update (PyTorch's warning about that
order is the source's own).

Changes for a seconds-long test: LeNet-300-100's layers are 16-12-8-3; 3 epochs of 2 batches of 8
random inputs (the source's MNIST, batches of 100, 100 epochs); ``--density 0.25`` (0.05 leaves about
one weight in the tiny layers) and ``--decay_frequency 4`` (25000: the learning rate would never fall);
no CUDA: the source's ``.cuda()`` calls on its masks are left out. ``Masking`` keeps the methods this
configuration runs (the other modes, the fp16 paths, the prints and statistics only printed are left out);
the validation and checkpoint saving after every epoch are left out too.

The port: the Trainer updates with the same SGD; what ``Masking.step`` does after ``optimizer.step()``
runs in ``on_step_end``, the batch-start ``StepLR`` step in ``on_step_start`` (the Trainer's own scheduler
steps after the update), and ``mask.at_end_of_epoch()`` in ``on_epoch_end``.
"""
import math

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.optim as optim

from safeloop import Trainer

from .harness import checks, compare, fixed

# --lr, --momentum, --l2, --prune-rate as the source's defaults; --density, --decay_frequency changed
LR, MOMENTUM, L2, PRUNE_RATE, DENSITY, DECAY_FREQUENCY = 0.1, 0.9, 5.0e-4, 0.50, 0.25, 4
EPOCHS, N_BATCHES, BATCH, IN, CLASSES = 3, 2, 8, 16, 3


# -- sparselearning/funcs.py ------------------------------------------------------------------------------
def momentum_redistribution(masking, name, weight, mask):
    grad = masking.get_momentum_for_weight(weight)
    mean_magnitude = torch.abs(grad[mask.bool()]).mean().item()
    return mean_magnitude


def magnitude_prune(masking, mask, weight, name):
    num_remove = math.ceil(masking.name2prune_rate[name]*masking.name2nonzeros[name])
    num_zeros = masking.name2zeros[name]
    k = math.ceil(num_zeros + num_remove)
    if num_remove == 0.0: return weight.data != 0.0

    x, idx = torch.sort(torch.abs(weight.data.view(-1)))
    mask.data.view(-1)[idx[:k]] = 0.0
    return mask


def momentum_growth(masking, name, new_mask, total_regrowth, weight):
    grad = masking.get_momentum_for_weight(weight)
    if grad.dtype == torch.float16:
        grad = grad*(new_mask==0).half()
    else:
        grad = grad*(new_mask==0).float()
    y, idx = torch.sort(torch.abs(grad).flatten(), descending=True)
    new_mask.data.view(-1)[idx[:total_regrowth]] = 1.0

    return new_mask


prune_funcs = {'magnitude': magnitude_prune}
growth_funcs = {'momentum': momentum_growth}
redistribution_funcs = {'momentum': momentum_redistribution}


# -- sparselearning/core.py ---------------------------------------------------------------------------------
class CosineDecay(object):
    """Decays a pruning rate according to a cosine schedule"""
    def __init__(self, prune_rate, T_max, eta_min=0.005, last_epoch=-1):
        self.sgd = optim.SGD(torch.nn.ParameterList([torch.nn.Parameter(torch.zeros(1))]), lr=prune_rate)
        self.cosine_stepper = torch.optim.lr_scheduler.CosineAnnealingLR(self.sgd, T_max, eta_min, last_epoch)

    def step(self):
        self.cosine_stepper.step()

    def get_dr(self, prune_rate):
        return self.sgd.param_groups[0]['lr']


class Masking(object):
    def __init__(self, optimizer, prune_rate_decay, prune_rate=0.5, prune_mode='magnitude', growth_mode='momentum',
                 redistribution_mode='momentum', prune_every_k_steps=0, verbose=False, fp16=False):
        self.growth_mode = growth_mode
        self.prune_mode = prune_mode
        self.redistribution_mode = redistribution_mode
        self.prune_rate_decay = prune_rate_decay
        self.verbose = verbose

        self.growth_func = growth_mode
        self.prune_func = prune_mode
        self.redistribution_func = redistribution_mode

        self.global_growth = False
        self.global_prune = False

        self.masks = {}
        self.modules = []
        self.names = []
        self.optimizer = optimizer

        self.adjusted_growth = 0
        self.adjustments = []
        self.baseline_nonzero = None
        self.name2baseline_nonzero = {}

        # stats
        self.name2variance = {}
        self.name2zeros = {}
        self.name2nonzeros = {}
        self.name2removed = {}

        self.total_variance = 0
        self.total_removed = 0
        self.total_zero = 0
        self.total_nonzero = 0
        self.prune_rate = prune_rate
        self.name2prune_rate = {}
        self.steps = 0
        self.start_name = None

        # global growth/prune state
        self.prune_threshold = 0.001
        self.growth_threshold = 0.001
        self.growth_increment = 0.2
        self.increment = 0.2
        self.tolerance = 0.02
        self.prune_every_k_steps = prune_every_k_steps
        self.half = fp16
        self.name_to_32bit = {}

    def init(self, mode='constant', density=0.05):
        self.init_growth_prune_and_redist()
        if mode == 'constant':
            # initializes each layer with a constant percentage of dense weights
            # each layer will have weight.numel()*density weights.
            # weight.numel()*density == weight.numel()*(1.0-sparsity)
            self.baseline_nonzero = 0
            for module in self.modules:
                for name, weight in module.named_parameters():
                    if name not in self.masks: continue
                    self.masks[name][:] = (torch.rand(weight.shape) < density).float().data  # .cuda()
                    self.baseline_nonzero += weight.numel()*density
            self.apply_mask()

    def init_growth_prune_and_redist(self):
        self.growth_func = growth_funcs[self.growth_func]
        self.prune_func = prune_funcs[self.prune_func]
        self.redistribution_func = redistribution_funcs[self.redistribution_func]

    def at_end_of_epoch(self):
        self.truncate_weights()

    def step(self):
        self.optimizer.step()
        self.apply_mask()
        self.prune_rate_decay.step()
        self.prune_rate = self.prune_rate_decay.get_dr(self.prune_rate)

        self.steps += 1

        if self.prune_every_k_steps:
            if self.steps % self.prune_every_k_steps == 0:
                self.truncate_weights()

    def add_module(self, module, density, sparse_init='constant', remove_param_names=()):
        self.modules.append(module)
        for name, tensor in module.named_parameters():
            self.names.append(name)
            self.masks[name] = torch.zeros_like(tensor, dtype=torch.float32, requires_grad=False)  # .cuda()
        self.remove_weight_partial_name('bias')
        self.remove_type(nn.BatchNorm2d, verbose=self.verbose)
        self.remove_type(nn.BatchNorm1d, verbose=self.verbose)
        for param_name in remove_param_names:
            self.remove_weight_partial_name(param_name)
        self.init(mode=sparse_init, density=density)

    def remove_weight(self, name):
        if name in self.masks:
            self.masks.pop(name)
        elif name+'.weight' in self.masks:
            self.masks.pop(name+'.weight')

    def remove_weight_partial_name(self, partial_name, verbose=False):
        removed = set()
        for name in list(self.masks.keys()):
            if partial_name in name:
                removed.add(name)
                self.masks.pop(name)

        i = 0
        while i < len(self.names):
            name = self.names[i]
            if name in removed: self.names.pop(i)
            else: i += 1

    def remove_type(self, nn_type, verbose=False):
        for module in self.modules:
            for name, module in module.named_modules():
                if isinstance(module, nn_type):
                    self.remove_weight(name)

    def apply_mask(self):
        for module in self.modules:
            for name, tensor in module.named_parameters():
                if name in self.masks:
                    if not self.half:
                        tensor.data = tensor.data*self.masks[name]

    def adjust_prune_rate(self):
        for module in self.modules:
            for name, weight in module.named_parameters():
                if name not in self.masks: continue
                if name not in self.name2prune_rate: self.name2prune_rate[name] = self.prune_rate

                self.name2prune_rate[name] = self.prune_rate

                sparsity = self.name2zeros[name]/float(self.masks[name].numel())
                if sparsity < 0.2:
                    # determine if matrix is relativly dense but still growing
                    expected_variance = 1.0/len(list(self.name2variance.keys()))
                    actual_variance = self.name2variance[name]
                    expected_vs_actual = expected_variance/actual_variance
                    if expected_vs_actual < 1.0:
                        # growing
                        self.name2prune_rate[name] = min(sparsity, self.name2prune_rate[name])

    def truncate_weights(self):
        self.gather_statistics()
        self.adjust_prune_rate()

        total_nonzero_new = 0
        for module in self.modules:
            for name, weight in module.named_parameters():
                if name not in self.masks: continue
                mask = self.masks[name]

                # prune
                new_mask = self.prune_func(self, mask, weight, name)
                removed = self.name2nonzeros[name] - new_mask.sum().item()
                self.total_removed += removed
                self.name2removed[name] = removed
                self.masks[name][:] = new_mask

        name2regrowth = self.calc_growth_redistribution()
        for module in self.modules:
            for name, weight in module.named_parameters():
                if name not in self.masks: continue
                new_mask = self.masks[name].data.bool()

                # growth
                new_mask = self.growth_func(self, name, new_mask, math.floor(name2regrowth[name]), weight)
                new_nonzero = new_mask.sum().item()

                # exchanging masks
                self.masks.pop(name)
                self.masks[name] = new_mask.float()
                total_nonzero_new += new_nonzero
        self.apply_mask()

        # Some growth techniques and redistribution are probablistic and we might not grow enough weights or too
        # much weights. Here we run an exponential smoothing over (prune-growth) residuals to adjust future growth
        self.adjustments.append(self.baseline_nonzero - total_nonzero_new)
        self.adjusted_growth = 0.25*self.adjusted_growth + (0.75*(self.baseline_nonzero - total_nonzero_new)) + \
            np.mean(self.adjustments)

    def gather_statistics(self):
        self.name2nonzeros = {}
        self.name2zeros = {}
        self.name2variance = {}
        self.name2removed = {}

        self.total_variance = 0.0
        self.total_removed = 0
        self.total_nonzero = 0
        self.total_zero = 0.0
        for module in self.modules:
            for name, weight in module.named_parameters():
                if name not in self.masks: continue
                mask = self.masks[name]

                # redistribution
                self.name2variance[name] = self.redistribution_func(self, name, weight, mask)

                if not np.isnan(self.name2variance[name]):
                    self.total_variance += self.name2variance[name]
                self.name2nonzeros[name] = mask.sum().item()
                self.name2zeros[name] = mask.numel() - self.name2nonzeros[name]

                self.total_nonzero += self.name2nonzeros[name]
                self.total_zero += self.name2zeros[name]

        for name in self.name2variance:
            if self.total_variance != 0.0:
                self.name2variance[name] /= self.total_variance

    def calc_growth_redistribution(self):
        residual = 9999
        mean_residual = 0
        name2regrowth = {}
        i = 0
        while residual > 0 and i < 1000:
            residual = 0
            for name in self.name2variance:
                prune_rate = self.name2prune_rate[name]
                num_remove = math.ceil(prune_rate*self.name2nonzeros[name])
                num_zero = self.name2zeros[name]
                max_regrowth = num_zero + num_remove

                if name in name2regrowth:
                    regrowth = name2regrowth[name]
                else:
                    regrowth = math.ceil(self.name2variance[name]*(self.total_removed+self.adjusted_growth))
                regrowth += mean_residual

                if regrowth > 0.99*max_regrowth:
                    name2regrowth[name] = 0.99*max_regrowth
                    residual += regrowth - name2regrowth[name]
                else:
                    name2regrowth[name] = regrowth
            if len(name2regrowth) == 0: mean_residual = 0
            else:
                mean_residual = residual / len(name2regrowth)
            i += 1

        return name2regrowth

    def get_momentum_for_weight(self, weight):
        if 'exp_avg' in self.optimizer.state[weight]:
            adam_m1 = self.optimizer.state[weight]['exp_avg']
            adam_m2 = self.optimizer.state[weight]['exp_avg_sq']
            grad = adam_m1/(torch.sqrt(adam_m2) + 1e-08)
        elif 'momentum_buffer' in self.optimizer.state[weight]:
            grad = self.optimizer.state[weight]['momentum_buffer']

        return grad


# -- sparselearning/models.py ---------------------------------------------------------------------------------
class LeNet_300_100(nn.Module):
    def __init__(self, save_features=None, bench_model=False):
        super(LeNet_300_100, self).__init__()
        self.fc1 = nn.Linear(IN, 12, bias=True)  # 28*28, 300
        self.fc2 = nn.Linear(12, 8, bias=True)  # 300, 100
        self.fc3 = nn.Linear(8, CLASSES, bias=True)  # 100, 10
        self.mask = None

    def forward(self, x):
        x0 = x.view(-1, IN)
        x1 = F.relu(self.fc1(x0))
        x2 = F.relu(self.fc2(x1))
        x3 = self.fc3(x2)
        return F.log_softmax(x3, dim=1)


# -- mnist_cifar/main.py ----------------------------------------------------------------------------------------
def train(model, device, train_loader, optimizer, epoch, lr_scheduler, mask=None):
    model.train()
    for batch_idx, (data, target) in enumerate(train_loader):
        if lr_scheduler is not None: lr_scheduler.step()
        data, target = data.to(device), target.to(device)
        optimizer.zero_grad()
        output = model(data)

        loss = F.nll_loss(output, target)

        loss.backward()

        if mask is not None: mask.step()
        else: optimizer.step()


def sparse_opt(model):
    optimizer = optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM, weight_decay=L2, nesterov=True)
    lr_scheduler = optim.lr_scheduler.StepLR(optimizer, DECAY_FREQUENCY, gamma=0.1)
    decay = CosineDecay(PRUNE_RATE, N_BATCHES*(EPOCHS))
    mask = Masking(optimizer, decay, prune_rate=PRUNE_RATE, prune_mode='magnitude', growth_mode='momentum',
                   redistribution_mode='momentum', verbose=False, fp16=False)
    mask.add_module(model, density=DENSITY)
    return optimizer, lr_scheduler, mask


def sparse_hand(model, train_loader):
    """main()'s loop for one ``--iters``, less evaluation, checkpoints and logging."""
    device = torch.device("cpu")
    optimizer, lr_scheduler, mask = sparse_opt(model)
    for epoch in range(1, EPOCHS + 1):
        train(model, device, train_loader, optimizer, epoch, lr_scheduler, mask)

        if epoch < EPOCHS:
            mask.at_end_of_epoch()


class SparseMomentum(Trainer):
    def configure_optimizers(self):
        optimizer, self.lr_scheduler, self.mask = sparse_opt(self.model)
        return optimizer

    def on_step_start(self):
        self.lr_scheduler.step()

    def training_step(self, batch):
        data, target = batch
        return F.nll_loss(self.model(data), target)

    def on_step_end(self, losses):
        """Masking.step() after its ``self.optimizer.step()``."""
        mask = self.mask
        mask.apply_mask()
        mask.prune_rate_decay.step()
        mask.prune_rate = mask.prune_rate_decay.get_dr(mask.prune_rate)
        mask.steps += 1

    def on_epoch_end(self):
        if self.state.epoch + 1 < EPOCHS:  # the source's 1-based epoch < args.epochs
            self.mask.at_end_of_epoch()


def mnist(n=N_BATCHES):
    gen = torch.Generator().manual_seed(8)
    return [(torch.randn(BATCH, 1, 4, 4, generator=gen), torch.randint(CLASSES, (BATCH,), generator=gen))
            for _ in range(n)]


@pytest.mark.parametrize("check", checks())
def test_sparse_momentum(check):
    compare(LeNet_300_100, sparse_hand, SparseMomentum, fixed(mnist()), check, steps=EPOCHS * N_BATCHES,
            max_epochs=EPOCHS)


@pytest.mark.filterwarnings("ignore:Detected call of `lr_scheduler.step\\(\\)` before")  # the source's order
def test_the_masks_move():
    """The end-of-epoch prune and regrowth change where the weights live: some weights zero after the first
    epoch are nonzero at the end, and the density stays at what the masks allow."""
    torch.manual_seed(0)
    model = LeNet_300_100()
    torch.manual_seed(1)
    optimizer, lr_scheduler, mask = sparse_opt(model)
    loader = mnist()
    train(model, torch.device("cpu"), loader, optimizer, 1, lr_scheduler, mask)
    before = {name: (p != 0) for name, p in model.named_parameters() if name in mask.masks}
    mask.at_end_of_epoch()
    train(model, torch.device("cpu"), loader, optimizer, 2, lr_scheduler, mask)
    after = {name: (p != 0) for name, p in model.named_parameters() if name in mask.masks}
    assert any(bool((after[name] & ~before[name]).any()) for name in before)  # regrown
    assert any(bool((before[name] & ~after[name]).any()) for name in before)  # pruned
    for name, p in model.named_parameters():
        if name in mask.masks:
            assert not bool(p[mask.masks[name] == 0].any())
