"""The original Wasserstein GAN, with the critic's weights clipped: eriklindernoren/PyTorch-GAN,
implementations/wgan/wgan.py, at commit 36d3c77e5ff20ebe0aeefd322326a134a279b93e (its Generator,
Discriminator, RMSprop optimizers and training loop).

After every critic update the critic's parameters are clamped in place through ``.data``
(``p.data.clamp_(-opt.clip_value, opt.clip_value)``), outside the optimizer, on parameters RMSprop holds;
every ``n_critic`` batches the generator is then trained through the clamped critic, on the same latent
batch ``z`` (drawn from NumPy's global RNG) whose detached fakes the critic just saw. The generator's loss
also leaves gradients on the critic, which the critic's next ``zero_grad`` clears. The generator has
``BatchNorm1d(out_feat, 0.8)`` (0.8 is its eps, as in the source) and in-place LeakyReLUs.

Changes for a seconds-long test: 16-pixel one-channel images, a latent of 4, hidden layers of 8 (the
source's 128-256-512-1024 and 512-256), 6 batches of 8 random images in place of MNIST (one epoch;
the source's 200 epochs of 64), no CUDA (``Tensor`` is ``torch.FloatTensor`` then); the progress print and
the sample images (``save_image``) are left out.

The port is manual (two optimizers, the generator stepped on some steps only): ``self.step("d")``, the
clamp, then the generator's ``self.backward``/``self.step`` on every ``n_critic``-th step.
"""
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.nn as nn
from torch.autograd import Variable

from safeloop import Trainer

from .harness import checks, compare

# the source's --lr, --n_critic and --clip_value; sizes shrunk
opt = SimpleNamespace(n_epochs=1, batch_size=8, lr=0.00005, latent_dim=4, img_size=4, channels=1, n_critic=5,
                      clip_value=0.01)
img_shape = (opt.channels, opt.img_size, opt.img_size)
Tensor = torch.FloatTensor
HIDDEN = 8
N_BATCHES = 6


class Generator(nn.Module):
    def __init__(self):
        super(Generator, self).__init__()

        def block(in_feat, out_feat, normalize=True):
            layers = [nn.Linear(in_feat, out_feat)]
            if normalize:
                layers.append(nn.BatchNorm1d(out_feat, 0.8))
            layers.append(nn.LeakyReLU(0.2, inplace=True))
            return layers

        self.model = nn.Sequential(
            *block(opt.latent_dim, HIDDEN, normalize=False),  # 128
            *block(HIDDEN, HIDDEN),  # 128, 256 (and 256, 512 and 512, 1024)
            nn.Linear(HIDDEN, int(np.prod(img_shape))),
            nn.Tanh()
        )

    def forward(self, z):
        img = self.model(z)
        img = img.view(img.shape[0], *img_shape)
        return img


class Discriminator(nn.Module):
    def __init__(self):
        super(Discriminator, self).__init__()

        self.model = nn.Sequential(
            nn.Linear(int(np.prod(img_shape)), HIDDEN),  # 512
            nn.LeakyReLU(0.2, inplace=True),
            nn.Linear(HIDDEN, HIDDEN),  # 512, 256
            nn.LeakyReLU(0.2, inplace=True),
            nn.Linear(HIDDEN, 1),
        )

    def forward(self, img):
        img_flat = img.view(img.shape[0], -1)
        validity = self.model(img_flat)
        return validity


def gan():
    model = nn.Module()
    model.generator, model.discriminator = Generator(), Discriminator()
    return model


def wgan_hand(model, dataloader):
    """The source's loop, verbatim but for the globals (``generator``, ``discriminator``) read off ``model``."""
    generator, discriminator = model.generator, model.discriminator
    # Optimizers
    optimizer_G = torch.optim.RMSprop(generator.parameters(), lr=opt.lr)
    optimizer_D = torch.optim.RMSprop(discriminator.parameters(), lr=opt.lr)

    batches_done = 0
    for epoch in range(opt.n_epochs):

        for i, (imgs, _) in enumerate(dataloader):

            # Configure input
            real_imgs = Variable(imgs.type(Tensor))

            # ---------------------
            #  Train Discriminator
            # ---------------------

            optimizer_D.zero_grad()

            # Sample noise as generator input
            z = Variable(Tensor(np.random.normal(0, 1, (imgs.shape[0], opt.latent_dim))))

            # Generate a batch of images
            fake_imgs = generator(z).detach()
            # Adversarial loss
            loss_D = -torch.mean(discriminator(real_imgs)) + torch.mean(discriminator(fake_imgs))

            loss_D.backward()
            optimizer_D.step()

            # Clip weights of discriminator
            for p in discriminator.parameters():
                p.data.clamp_(-opt.clip_value, opt.clip_value)

            # Train the generator every n_critic iterations
            if i % opt.n_critic == 0:

                # -----------------
                #  Train Generator
                # -----------------

                optimizer_G.zero_grad()

                # Generate a batch of images
                gen_imgs = generator(z)
                # Adversarial loss
                loss_G = -torch.mean(discriminator(gen_imgs))

                loss_G.backward()
                optimizer_G.step()

            batches_done += 1


class WGAN(Trainer):
    automatic = False

    def configure_optimizers(self):
        return {"G": torch.optim.RMSprop(self.model.generator.parameters(), lr=opt.lr),
                "D": torch.optim.RMSprop(self.model.discriminator.parameters(), lr=opt.lr)}

    def training_step(self, batch):
        generator, discriminator = self.model.generator, self.model.discriminator
        imgs, _ = batch
        real_imgs = Variable(imgs.type(Tensor))
        z = Variable(Tensor(np.random.normal(0, 1, (imgs.shape[0], opt.latent_dim))))
        fake_imgs = generator(z).detach()
        loss_D = -torch.mean(discriminator(real_imgs)) + torch.mean(discriminator(fake_imgs))
        self.backward(loss_D, optimizer="D")
        self.step("D")
        for p in discriminator.parameters():
            p.data.clamp_(-opt.clip_value, opt.clip_value)
        losses = {"loss_D": loss_D}
        i = self.state.batch_in_epoch - 1  # the source's i: this batch's index in the epoch
        if i % opt.n_critic == 0:
            gen_imgs = generator(z)
            loss_G = -torch.mean(discriminator(gen_imgs))
            self.backward(loss_G, optimizer="G")
            self.step("G")
            losses["loss_G"] = loss_G
        return losses


def mnist(model):
    """Six batches of images and labels; NumPy's global RNG (the latents) seeded before each run."""
    np.random.seed(0)
    gen = torch.Generator().manual_seed(7)
    return [(torch.rand(opt.batch_size, *img_shape, generator=gen) * 2 - 1,
             torch.randint(10, (opt.batch_size,), generator=gen)) for _ in range(N_BATCHES)]


@pytest.mark.parametrize("check", checks())
def test_wgan_with_clipped_critic_weights(check):
    compare(gan, wgan_hand, WGAN, mnist, check, steps=N_BATCHES)


def test_the_clip_bites():
    """The critic's initial weights reach past 0.01: the clamp changes them (else the case proves little)."""
    torch.manual_seed(0)
    assert gan().discriminator.model[0].weight.abs().max() > 10 * opt.clip_value
