"""LightningModules from public repositories, each kept as written (tiny sizes), ported to safeloop as
docs/trainer.md's "Coming from Lightning" tells, trained on the same seeded data by both."""
import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

pl = pytest.importorskip("pytorch_lightning")

import safeloop  # noqa: E402

from .common import assert_same, lightning, settings  # noqa: E402

# -- Lightning-AI/pytorch-lightning, examples/pytorch/domain_templates/generative_adversarial_net.py,
# commit 87c3101cec286aeceb8a6b3530c3897b83f40b98: Generator, Discriminator, GAN as written there (``lightning``
# imports as ``pytorch_lightning``; the image logging of ``on_train_epoch_end`` left out: it needs a logger).


class Generator(nn.Module):
    def __init__(self, latent_dim: int = 100, img_shape: tuple = (1, 28, 28)):
        super().__init__()
        self.img_shape = img_shape

        def block(in_feat, out_feat, normalize=True):
            layers = [nn.Linear(in_feat, out_feat)]
            if normalize:
                layers.append(nn.BatchNorm1d(out_feat, 0.8))
            layers.append(nn.LeakyReLU(0.2, inplace=True))
            return layers

        self.model = nn.Sequential(
            *block(latent_dim, 128, normalize=False),
            *block(128, 256),
            *block(256, 512),
            *block(512, 1024),
            nn.Linear(1024, int(math.prod(img_shape))),
            nn.Tanh(),
        )

    def forward(self, z):
        img = self.model(z)
        return img.view(img.size(0), *self.img_shape)


class Discriminator(nn.Module):
    def __init__(self, img_shape):
        super().__init__()

        self.model = nn.Sequential(
            nn.Linear(int(math.prod(img_shape)), 512),
            nn.LeakyReLU(0.2, inplace=True),
            nn.Linear(512, 256),
            nn.LeakyReLU(0.2, inplace=True),
            nn.Linear(256, 1),
        )

    def forward(self, img):
        img_flat = img.view(img.size(0), -1)
        return self.model(img_flat)


class GAN(pl.LightningModule):
    def __init__(
        self,
        img_shape: tuple = (1, 28, 28),
        lr: float = 0.0002,
        b1: float = 0.5,
        b2: float = 0.999,
        latent_dim: int = 100,
    ):
        super().__init__()
        self.save_hyperparameters()
        self.automatic_optimization = False

        # networks
        self.generator = Generator(latent_dim=self.hparams.latent_dim, img_shape=img_shape)
        self.discriminator = Discriminator(img_shape=img_shape)

        self.validation_z = torch.randn(8, self.hparams.latent_dim)

        self.example_input_array = torch.zeros(2, self.hparams.latent_dim)

    def forward(self, z):
        return self.generator(z)

    @staticmethod
    def adversarial_loss(y_hat, y):
        return F.binary_cross_entropy_with_logits(y_hat, y)

    def training_step(self, batch):
        imgs, _ = batch

        opt_g, opt_d = self.optimizers()

        # sample noise
        z = torch.randn(imgs.shape[0], self.hparams.latent_dim)
        z = z.type_as(imgs)

        # Train generator
        valid = torch.ones(imgs.size(0), 1)
        valid = valid.type_as(imgs)

        self.toggle_optimizer(opt_g)
        g_loss = self.adversarial_loss(self.discriminator(self(z)), valid)
        opt_g.zero_grad()
        self.manual_backward(g_loss)
        opt_g.step()
        self.untoggle_optimizer(opt_g)

        # Train discriminator
        valid = torch.ones(imgs.size(0), 1)
        valid = valid.type_as(imgs)

        self.toggle_optimizer(opt_d)
        real_loss = self.adversarial_loss(self.discriminator(imgs), valid)

        fake = torch.zeros(imgs.size(0), 1)
        fake = fake.type_as(imgs)

        fake_loss = self.adversarial_loss(self.discriminator(self(z).detach()), fake)

        d_loss = (real_loss + fake_loss) / 2

        opt_d.zero_grad()
        self.manual_backward(d_loss)
        opt_d.step()
        self.untoggle_optimizer(opt_d)

        self.log_dict({"d_loss": d_loss, "g_loss": g_loss})

    def configure_optimizers(self):
        lr = self.hparams.lr
        b1 = self.hparams.b1
        b2 = self.hparams.b2

        opt_g = torch.optim.Adam(self.generator.parameters(), lr=lr, betas=(b1, b2))
        opt_d = torch.optim.Adam(self.discriminator.parameters(), lr=lr, betas=(b1, b2))
        return opt_g, opt_d


IMG, LATENT = (1, 4, 4), 8


class Nets(nn.Module):
    """The GAN's two networks, made in its order from the same seed: the port's model."""

    def __init__(self):
        super().__init__()
        self.generator = Generator(latent_dim=LATENT, img_shape=IMG)
        self.discriminator = Discriminator(img_shape=IMG)


class PortGAN(safeloop.Trainer):
    """``GAN`` ported: ``automatic = False``; ``self.manual_backward`` and ``opt.step()`` with ``zero_grad`` as
    ``self.backward(loss, optimizer=name)`` and ``self.step(name)``; ``self.log_dict`` as ``self.log``;
    ``toggle_optimizer`` dropped (``self.backward(optimizer=...)`` reaches only that optimizer's parameters)."""

    automatic = False
    lr, b1, b2 = 0.0002, 0.5, 0.999

    def configure_optimizers(self):
        opt_g = torch.optim.Adam(self.model.generator.parameters(), lr=self.lr, betas=(self.b1, self.b2))
        opt_d = torch.optim.Adam(self.model.discriminator.parameters(), lr=self.lr, betas=(self.b1, self.b2))
        return {"g": opt_g, "d": opt_d}

    def training_step(self, batch):
        imgs, _ = batch
        z = torch.randn(imgs.shape[0], LATENT).type_as(imgs)
        valid = torch.ones(imgs.size(0), 1).type_as(imgs)
        g_loss = GAN.adversarial_loss(self.model.discriminator(self.model.generator(z)), valid)
        self.backward(g_loss, optimizer="g")
        self.step("g")
        real_loss = GAN.adversarial_loss(self.model.discriminator(imgs), valid)
        fake = torch.zeros(imgs.size(0), 1).type_as(imgs)
        fake_loss = GAN.adversarial_loss(self.model.discriminator(self.model.generator(z).detach()), fake)
        d_loss = (real_loss + fake_loss) / 2
        self.backward(d_loss, optimizer="d")
        self.step("d")
        self.log("d_loss", d_loss)
        self.log("g_loss", g_loss)
        return {"g": g_loss, "d": d_loss}


def images(n=12, batch=4, seed=1):
    gen = torch.Generator().manual_seed(seed)
    return DataLoader(TensorDataset(torch.rand(n, *IMG, generator=gen) * 2 - 1, torch.zeros(n)), batch_size=batch)


def test_lightning_example_gan_matches():
    """Two epochs of 3 batches: generator (with BatchNorm's running statistics) and discriminator, bit for bit."""
    torch.manual_seed(0)
    lit = GAN(img_shape=IMG, latent_dim=LATENT)
    torch.manual_seed(0)
    nets = Nets()
    port = PortGAN(model=nets, train_data=images(), **settings(max_epochs=2))
    torch.manual_seed(3)
    lightning(max_epochs=2).fit(lit, train_dataloaders=images())
    torch.manual_seed(3)
    port.fit()
    assert_same(lit.generator, port.model.generator)
    assert_same(lit.discriminator, port.model.discriminator)
