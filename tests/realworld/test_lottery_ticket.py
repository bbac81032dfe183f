"""Iterative magnitude pruning with rewinding (the lottery ticket hypothesis): rahulvigneswaran/
Lottery-Ticket-Hypothesis-in-Pytorch, main.py (``main``, ``train``, ``prune_by_percentile``, ``make_mask``,
``original_initialization``, ``weight_init``) and archs/mnist/fc1.py, at commit
34a8c9678406a1c7dd0fec4c9f0d25d017be55fb (``--prune_type lt``, the default).

Each pruning round trains with Adam; after ``loss.backward()`` the pruned weights' gradients are zeroed by a
round trip through NumPy, ``p.grad.data = torch.from_numpy(...)`` (new storage for every weight's gradient,
between the backward and the step). Between rounds ``prune_by_percentile`` drops the smallest of each
layer's surviving weights, writing ``param.data = torch.from_numpy(tensor * new_mask)``; then
``original_initialization`` rewinds every weight to its initial value times the mask
(``param.data = torch.from_numpy(...)``) and every bias to ``param.data = initial_state_dict[name]``; then a
new Adam (at ``--lr``; the first one at Adam's default) takes over.

Two of the source's quirks are kept as they are, since they do not touch the autograd graph: the gradient
mask is ``tensor < EPS``, so the gradients of all negative weights are zeroed too, not only the pruned ones
(weight decay still moves them); and a bias rewound by ``param.data = initial_state_dict[name]`` shares that
tensor's storage from then on, so Adam's updates move the "initial" bias too, and the next rewind leaves
biases as they are.

Changes for a seconds-long test: fc1's 784-300-100-10 layers are 16-12-8-3; 3 pruning rounds (the source
makes 35) of one pass (``--end_iter``, 100) over 2 batches of 8 (``--batch_size`` 60) instead of MNIST;
no CUDA (the source's ``device`` is the CPU then); the globals ``model`` and ``mask`` (and ``step``) are
passed as arguments; the accuracy test every pass (``test``: eval mode, ``no_grad``), TensorBoard, the
plots and the saved files are left out.

The port is one fit of 3 epochs: the gradient mask runs in ``on_before_optimizer_step``, and pruning and
rewinding in ``on_epoch_start`` of every round but the first, which then gives its optimizer a fresh
start (its state cleared and the learning rate set), what the source's new ``torch.optim.Adam`` is.
"""
import copy

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.init as init

from safeloop import Trainer

from .harness import checks, compare, fixed

LR, PRUNE_PERCENT, ITERATION, END_ITER = 1.2e-3, 10, 3, 1  # --lr, --prune_percent; --prune_iterations 35
N_BATCHES, BATCH, IN, CLASSES = 2, 8, 16, 3
device = torch.device("cpu")
resample = False  # main.py's "FIXME resample"


# -- archs/mnist/fc1.py ------------------------------------------------------------------------------------
class fc1(nn.Module):

    def __init__(self, num_classes=CLASSES):
        super(fc1, self).__init__()
        self.classifier = nn.Sequential(
            nn.Linear(IN, 12),  # 28*28, 300
            nn.ReLU(inplace=True),
            nn.Linear(12, 8),  # 300, 100
            nn.ReLU(inplace=True),
            nn.Linear(8, num_classes),
        )

    def forward(self, x):
        x = torch.flatten(x, 1)
        x = self.classifier(x)
        return x


# -- main.py -------------------------------------------------------------------------------------------------
def train(model, train_loader, optimizer, criterion):
    EPS = 1e-6
    model.train()
    for batch_idx, (imgs, targets) in enumerate(train_loader):
        optimizer.zero_grad()
        imgs, targets = imgs.to(device), targets.to(device)
        output = model(imgs)
        train_loss = criterion(output, targets)
        train_loss.backward()

        # Freezing Pruned weights by making their gradients Zero
        for name, p in model.named_parameters():
            if 'weight' in name:
                tensor = p.data.cpu().numpy()
                grad_tensor = p.grad.data.cpu().numpy()
                grad_tensor = np.where(tensor < EPS, 0, grad_tensor)
                p.grad.data = torch.from_numpy(grad_tensor).to(device)
        optimizer.step()
    return train_loss.item()


def prune_by_percentile(model, mask, percent, resample=False, reinit=False, **kwargs):
    # Calculate percentile value
    step = 0
    for name, param in model.named_parameters():

        # We do not prune bias term
        if 'weight' in name:
            tensor = param.data.cpu().numpy()
            alive = tensor[np.nonzero(tensor)]  # flattened array of nonzero values
            percentile_value = np.percentile(abs(alive), percent)

            # Convert Tensors to numpy and calculate
            weight_dev = param.device
            new_mask = np.where(abs(tensor) < percentile_value, 0, mask[step])

            # Apply new weight and mask
            param.data = torch.from_numpy(tensor * new_mask).to(weight_dev)
            mask[step] = new_mask
            step += 1
    step = 0


def make_mask(model):
    step = 0
    for name, param in model.named_parameters():
        if 'weight' in name:
            step = step + 1
    mask = [None] * step
    step = 0
    for name, param in model.named_parameters():
        if 'weight' in name:
            tensor = param.data.cpu().numpy()
            mask[step] = np.ones_like(tensor)
            step = step + 1
    step = 0
    return mask


def original_initialization(model, mask_temp, initial_state_dict):
    step = 0
    for name, param in model.named_parameters():
        if "weight" in name:
            weight_dev = param.device
            param.data = torch.from_numpy(mask_temp[step] * initial_state_dict[name].cpu().numpy()).to(weight_dev)
            step = step + 1
        if "bias" in name:
            param.data = initial_state_dict[name]
    step = 0


def weight_init(m):
    """The source's, for the layers fc1 has."""
    if isinstance(m, nn.Linear):
        init.xavier_normal_(m.weight.data)
        init.normal_(m.bias.data)


def lottery_model():
    model = fc1().to(device)
    # Weight Initialization
    model.apply(weight_init)
    return model


def lth_hand(model, train_loader):
    """main()'s training, less what it only reports."""
    # Copying and Saving Initial State
    initial_state_dict = copy.deepcopy(model.state_dict())
    # Making Initial Mask
    mask = make_mask(model)
    # Optimizer and Loss
    optimizer = torch.optim.Adam(model.parameters(), weight_decay=1e-4)
    criterion = nn.CrossEntropyLoss()  # Default was F.nll_loss
    for _ite in range(0, ITERATION):
        if not _ite == 0:
            prune_by_percentile(model, mask, PRUNE_PERCENT, resample=resample, reinit=False)
            original_initialization(model, mask, initial_state_dict)
            optimizer = torch.optim.Adam(model.parameters(), lr=LR, weight_decay=1e-4)
        for iter_ in range(END_ITER):
            # Training
            loss = train(model, train_loader, optimizer, criterion)  # the source plots it


class LotteryTicket(Trainer):
    def configure_optimizers(self):
        self.initial_state_dict = copy.deepcopy(self.model.state_dict())
        self.mask = make_mask(self.model)
        self.criterion = nn.CrossEntropyLoss()
        return torch.optim.Adam(self.model.parameters(), weight_decay=1e-4)

    def training_step(self, batch):
        imgs, targets = batch
        return self.criterion(self.model(imgs), targets)

    def on_before_optimizer_step(self, name, optimizer):
        EPS = 1e-6
        for name, p in self.model.named_parameters():
            if 'weight' in name:
                tensor = p.data.cpu().numpy()
                grad_tensor = p.grad.data.cpu().numpy()
                grad_tensor = np.where(tensor < EPS, 0, grad_tensor)
                p.grad.data = torch.from_numpy(grad_tensor).to(device)

    def on_epoch_start(self):
        if self.state.epoch == 0 or self.state.epoch % END_ITER:
            return
        prune_by_percentile(self.model, self.mask, PRUNE_PERCENT, resample=resample, reinit=False)
        original_initialization(self.model, self.mask, self.initial_state_dict)
        optimizer = self.optimizers["optimizer"]
        optimizer.state.clear()  # a new Adam: no moments, no step count
        optimizer.param_groups[0]["lr"] = LR


def mnist(n=N_BATCHES):
    gen = torch.Generator().manual_seed(6)
    return [(torch.randn(BATCH, 1, 4, 4, generator=gen), torch.randint(CLASSES, (BATCH,), generator=gen))
            for _ in range(n)]


@pytest.mark.parametrize("check", checks())
def test_lottery_ticket_pruning_with_rewinding(check):
    compare(lottery_model, lth_hand, LotteryTicket, fixed(mnist()), check, steps=ITERATION * END_ITER * N_BATCHES,
            max_epochs=ITERATION * END_ITER)


def test_the_pruning_prunes():
    """The hand loop leaves the rounds' pruned weights at zero: 10% of each layer a round, compounded."""
    torch.manual_seed(0)
    model = lottery_model()
    torch.manual_seed(1)
    lth_hand(model, mnist())
    for layer in (0, 2, 4):
        weight = model.classifier[layer].weight
        zeros = int((weight == 0).sum())
        assert zeros >= int(weight.numel() * (1 - 0.9 ** (ITERATION - 1))) - 1 > 0
