"""KL annealing: hubertrybka/vae-annealing, README.md's usage and annealing.py (``Annealer`` with
``shape='linear'``: the KL term multiplied by ``current_step / total_steps``, the annealer's ``step()`` after
each optimizer step; ``VAELoss``: binary cross-entropy summed, KL divergence of a diagonal Gaussian).

Changes for a seconds-long test: a linear VAE of 6 inputs and a latent of 2, 4 steps of 8 samples,
``total_steps=3`` (the weight reaches 1 and stays), Adam.

Ports: (a) the annealed KL computed in ``training_step``, the sum returned, as the README; (b) the two terms
returned as a dict and the KL weight set per step through ``self.loss_weights`` in ``on_step_start``
with ``multi_loss="sum"``: each step trains with the weight its hook set, as (a) does.
"""
import pytest
import torch
import torch.nn.functional as F

from safeloop import Trainer

from .harness import checks, compare, fixed

IN, Z, STEPS, TOTAL = 6, 2, 4, 3


class Annealer:
    def __init__(self, total_steps, shape='linear'):
        self.total_steps, self.current_step, self.shape = total_steps, 0, shape

    def __call__(self, kld):
        return kld * self.slope()

    def slope(self):
        return self.current_step / self.total_steps

    def step(self):
        if self.current_step < self.total_steps:
            self.current_step += 1


def vae_loss(x, x0, mu, logvar):
    bce = F.binary_cross_entropy(x, x0, reduction='sum')
    kld = -0.5 * torch.sum(1 + logvar - mu.pow(2) - logvar.exp())
    return bce, kld


class VAE(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.enc = torch.nn.Linear(IN, 2 * Z)
        self.dec = torch.nn.Linear(Z, IN)

    def forward(self, x0):
        mu, logvar = self.enc(x0).chunk(2, dim=-1)
        z = mu + torch.randn_like(mu) * (0.5 * logvar).exp()
        return torch.sigmoid(self.dec(z)), mu, logvar


def items():
    gen = torch.Generator().manual_seed(5)
    return [torch.rand(8, IN, generator=gen) for _ in range(STEPS)]


def hand(model, data):
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    annealer = Annealer(TOTAL)
    for x0 in data:
        x, mu, logvar = model(x0)
        bce, kld = vae_loss(x, x0, mu, logvar)
        kld = annealer(kld)
        optimizer.zero_grad()
        (bce + kld).backward()
        optimizer.step()
        annealer.step()


class Port(Trainer):
    def on_fit_start(self):
        self.annealer = Annealer(TOTAL)

    def configure_optimizers(self):
        return torch.optim.Adam(self.model.parameters(), lr=1e-2)

    def training_step(self, x0):
        x, mu, logvar = self.model(x0)
        bce, kld = vae_loss(x, x0, mu, logvar)
        return bce + self.annealer(kld)

    def on_step_end(self, losses):
        self.annealer.step()


class WeightPort(Port):
    def on_step_start(self):
        self.loss_weights['kld'] = self.annealer.slope()

    def training_step(self, x0):
        x, mu, logvar = self.model(x0)
        bce, kld = vae_loss(x, x0, mu, logvar)
        return {'bce': bce, 'kld': kld}


@pytest.mark.parametrize("check", checks())
def test_kl_annealing_in_step(check):
    compare(VAE, hand, Port, fixed(items()), check, STEPS)


@pytest.mark.parametrize("check", checks())
def test_kl_annealing_loss_weights(check):
    compare(VAE, hand, WeightPort, fixed(items()), check, STEPS, loss_weights={'bce': 1.0, 'kld': 0.0},
            multi_loss="sum")
