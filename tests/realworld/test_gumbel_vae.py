"""A categorical VAE through the straight-through Gumbel-softmax, its temperature annealed:
YongfeiYan/Gumbel_Softmax_VAE at commit 7d3df6c3c7ac9001e5d3a9ededd6f382a8421668, gumbel_softmax_vae.py
(``sample_gumbel``, ``gumbel_softmax``, ``VAE_gumbel``, ``loss_function``, ``train``, ``test``, ``run``).

Each batch's latent is drawn by ``gumbel_softmax`` with ``--hard``: Gumbel noise from ``torch.rand``, a softmax
divided by the temperature (a NumPy float once annealed), its argmax written into ``zeros_like`` by ``scatter_``
and the straight-through ``(y_hard - y).detach() + y``; the module-level ``latent_dim`` and ``categorical_dim``
read by the function. The loss sums a binary cross-entropy (``size_average=False``: PyTorch's deprecation warning)
and the KL to the uniform prior. The temperature, reset to ``args.temp`` each epoch, is annealed by
``np.maximum(temp * np.exp(-ANNEAL_RATE * batch_idx), temp_min)`` after the batches whose index is 1 modulo 100.
After each epoch ``test`` runs the model in eval mode *with* grad enabled on the test batches (graphs made and
dropped, ``.item()`` read) with its own annealing, then ``run`` decodes one-hot codes drawn by NumPy's
``np.random.choice``, again with grad.

Changes for a seconds-long test: 4x4 inputs (16 pixels for 784) and hidden layers of 8, ``latent_dim=3``,
``categorical_dim=4``, batches of 4, 3 training and 2 test batches, 2 epochs, ``ANNEAL_RATE=0.3`` (0.00003 in the
source: the temperature moves visibly in 3 batches); ``save_image`` and the printing left out, CUDA left out.

The port anneals in ``on_step_end`` from ``state.batch_in_epoch``, puts the model in train mode and resets the
temperature in ``on_epoch_start``, and tests and decodes in ``on_epoch_end``.
"""
from functools import partial

import numpy as np
import pytest
import torch
from torch import nn, optim
from torch.nn import functional as F

from safeloop import Trainer

from .harness import checks, compare

EPOCHS, BATCH_SIZE, PIXELS, HIDDEN = 2, 4, 16, 8
TEMP, HARD = 1.0, True


# -- gumbel_softmax_vae.py -----------------------------------------------------------------------------------
def sample_gumbel(shape, eps=1e-20):
    U = torch.rand(shape)
    return -torch.log(-torch.log(U + eps) + eps)


def gumbel_softmax_sample(logits, temperature):
    y = logits + sample_gumbel(logits.size())
    return F.softmax(y / temperature, dim=-1)


def gumbel_softmax(logits, temperature, hard=False):
    """
    ST-gumple-softmax
    input: [*, n_class]
    return: flatten --> [*, n_class] an one-hot vector
    """
    y = gumbel_softmax_sample(logits, temperature)

    if not hard:
        return y.view(-1, latent_dim * categorical_dim)

    shape = y.size()
    _, ind = y.max(dim=-1)
    y_hard = torch.zeros_like(y).view(-1, shape[-1])
    y_hard.scatter_(1, ind.view(-1, 1), 1)
    y_hard = y_hard.view(*shape)
    # Set gradients w.r.t. y_hard gradients w.r.t. y
    y_hard = (y_hard - y).detach() + y
    return y_hard.view(-1, latent_dim * categorical_dim)


class VAE_gumbel(nn.Module):
    def __init__(self, temp):
        super(VAE_gumbel, self).__init__()

        self.fc1 = nn.Linear(PIXELS, HIDDEN)
        self.fc2 = nn.Linear(HIDDEN, HIDDEN)
        self.fc3 = nn.Linear(HIDDEN, latent_dim * categorical_dim)

        self.fc4 = nn.Linear(latent_dim * categorical_dim, HIDDEN)
        self.fc5 = nn.Linear(HIDDEN, HIDDEN)
        self.fc6 = nn.Linear(HIDDEN, PIXELS)

        self.relu = nn.ReLU()
        self.sigmoid = nn.Sigmoid()

    def encode(self, x):
        h1 = self.relu(self.fc1(x))
        h2 = self.relu(self.fc2(h1))
        return self.relu(self.fc3(h2))

    def decode(self, z):
        h4 = self.relu(self.fc4(z))
        h5 = self.relu(self.fc5(h4))
        return self.sigmoid(self.fc6(h5))

    def forward(self, x, temp, hard):
        q = self.encode(x.view(-1, PIXELS))
        q_y = q.view(q.size(0), latent_dim, categorical_dim)
        z = gumbel_softmax(q_y, temp, hard)
        return self.decode(z), F.softmax(q_y, dim=-1).reshape(*q.size())


latent_dim = 3
categorical_dim = 4  # one-of-K vector

temp_min = 0.5
ANNEAL_RATE = 0.3


# Reconstruction + KL divergence losses summed over all elements and batch
def loss_function(recon_x, x, qy):
    BCE = F.binary_cross_entropy(recon_x, x.view(-1, PIXELS), size_average=False) / x.shape[0]

    log_ratio = torch.log(qy * categorical_dim + 1e-20)
    KLD = torch.sum(qy * log_ratio, dim=-1).mean()

    return BCE + KLD


def train(model, optimizer, train_loader, epoch):
    model.train()
    train_loss = 0
    temp = TEMP
    for batch_idx, (data, _) in enumerate(train_loader):
        optimizer.zero_grad()
        recon_batch, qy = model(data, temp, HARD)
        loss = loss_function(recon_batch, data, qy)
        loss.backward()
        train_loss += loss.item() * len(data)
        optimizer.step()
        if batch_idx % 100 == 1:
            temp = np.maximum(temp * np.exp(-ANNEAL_RATE * batch_idx), temp_min)


def test(model, test_loader, epoch):
    model.eval()
    test_loss = 0
    temp = TEMP
    for i, (data, _) in enumerate(test_loader):
        recon_batch, qy = model(data, temp, HARD)
        test_loss += loss_function(recon_batch, data, qy).item() * len(data)
        if i % 100 == 1:
            temp = np.maximum(temp * np.exp(-ANNEAL_RATE * i), temp_min)
    return test_loss


test.__test__ = False  # the source's name, not a pytest test


def sample_codes(model):
    M = 64 * latent_dim
    np_y = np.zeros((M, categorical_dim), dtype=np.float32)
    np_y[range(M), np.random.choice(categorical_dim, M)] = 1
    np_y = np.reshape(np_y, [M // latent_dim, latent_dim, categorical_dim])
    sample = torch.from_numpy(np_y).view(M // latent_dim, latent_dim * categorical_dim)
    sample = model.decode(sample).cpu()
    return sample


def gumbel_hand(model, data):
    train_loader, test_loader = data
    optimizer = optim.Adam(model.parameters(), lr=1e-3)
    for epoch in range(1, EPOCHS + 1):
        train(model, optimizer, train_loader, epoch)
        test(model, test_loader, epoch)
        sample_codes(model)


def vae():
    return VAE_gumbel(TEMP)


def pixels(model):
    gen = torch.Generator().manual_seed(2)
    make = lambda: (torch.rand(BATCH_SIZE, 1, 4, 4, generator=gen), torch.zeros(BATCH_SIZE, dtype=torch.long))
    return [make() for _ in range(3)], [make() for _ in range(2)]


class GumbelTrainer(Trainer):
    test_loader: list

    def on_epoch_start(self):
        self.model.train()  # as ``train`` does: ``test`` left it in eval mode (the Trainer leaves modes as they are)
        self.temp = TEMP

    def training_step(self, batch):
        data, _ = batch
        recon_batch, qy = self.model(data, self.temp, HARD)
        return loss_function(recon_batch, data, qy)

    def on_step_end(self, losses):
        batch_idx = self.state.batch_in_epoch - 1
        if batch_idx % 100 == 1:
            self.temp = np.maximum(self.temp * np.exp(-ANNEAL_RATE * batch_idx), temp_min)

    def on_epoch_end(self):
        test(self.model, self.test_loader, self.state.epoch)
        sample_codes(self.model)


def port(model, train_data, **kwargs):
    """The Trainer over the training batches, given the test batches."""
    trainer = GumbelTrainer(model=model, train_data=train_data[0], **kwargs)
    trainer.test_loader = train_data[1]
    return trainer


@pytest.mark.parametrize("check", checks())
def test_gumbel_softmax_vae_with_an_annealed_temperature_and_straight_through_samples(check):
    compare(vae, gumbel_hand, port, pixels, check, steps=EPOCHS * 3, optimizer=partial(optim.Adam, lr=1e-3))


def test_the_temperature_moves():
    """At the test's sizes, the annealing changes the temperature the second epoch's last batch is drawn at."""
    temp = TEMP
    for batch_idx in range(2):
        if batch_idx % 100 == 1:
            temp = np.maximum(temp * np.exp(-ANNEAL_RATE * batch_idx), temp_min)
    assert temp_min < temp < TEMP
