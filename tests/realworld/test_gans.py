"""GANs: a gradient penalty (double backward), spectral normalization (buffers moved by every forward),
CycleGAN (discriminators frozen by requires_grad during the generators' update, a pool of past fakes)."""
import functools
import itertools
import random

import pytest
import torch
from torch import autograd, nn

from safeloop import Trainer

from .harness import batches, checks, compare, fixed

LATENT, N_CRITIC, LAMBDA_GP = 4, 2, 10


# -- WGAN-GP: eriklindernoren/PyTorch-GAN, implementations/wgan_gp/wgan_gp.py --------------------------
def wgan():
    model = nn.Module()
    model.g = nn.Sequential(nn.Linear(LATENT, 8), nn.LeakyReLU(0.2, inplace=True), nn.Linear(8, 8),
                            nn.BatchNorm1d(8, 0.8), nn.LeakyReLU(0.2, inplace=True), nn.Linear(8, 6), nn.Tanh())
    model.d = nn.Sequential(nn.Linear(6, 8), nn.LeakyReLU(0.2, inplace=True), nn.Linear(8, 1))
    return model


def compute_gradient_penalty(D, real_samples, fake_samples):
    """As the source: the critic's gradient at random interpolates, with create_graph=True."""
    alpha = torch.rand(real_samples.size(0), 1)
    interpolates = (alpha * real_samples + ((1 - alpha) * fake_samples)).requires_grad_(True)
    d_interpolates = D(interpolates)
    fake = torch.ones(real_samples.shape[0], 1)
    gradients = autograd.grad(outputs=d_interpolates, inputs=interpolates, grad_outputs=fake, create_graph=True,
                              retain_graph=True, only_inputs=True)[0]
    gradients = gradients.view(gradients.size(0), -1)
    return ((gradients.norm(2, dim=1) - 1) ** 2).mean()


def wgan_d_loss(model, real_imgs, fake_imgs):
    real_validity = model.d(real_imgs)
    fake_validity = model.d(fake_imgs)  # not detached: D's loss also leaves gradient on G
    gradient_penalty = compute_gradient_penalty(model.d, real_imgs.data, fake_imgs.data)
    return -torch.mean(real_validity) + torch.mean(fake_validity) + LAMBDA_GP * gradient_penalty


def wgan_opts(model):
    return (torch.optim.Adam(model.d.parameters(), lr=0.01, betas=(0.5, 0.999)),
            torch.optim.Adam(model.g.parameters(), lr=0.01, betas=(0.5, 0.999)))


def wgan_hand(model, data):
    optimizer_D, optimizer_G = wgan_opts(model)
    for i, real_imgs in enumerate(data):
        optimizer_D.zero_grad()
        z = torch.randn(real_imgs.shape[0], LATENT)
        fake_imgs = model.g(z)
        d_loss = wgan_d_loss(model, real_imgs, fake_imgs)
        d_loss.backward()
        optimizer_D.step()
        optimizer_G.zero_grad()
        if i % N_CRITIC == 0:  # the generator every n_critic steps, on a fresh G(z) through the updated D
            fake_imgs = model.g(z)
            g_loss = -torch.mean(model.d(fake_imgs))
            g_loss.backward()
            optimizer_G.step()


class WGANGP(Trainer):
    automatic = False

    def configure_optimizers(self):
        d, g = wgan_opts(self.model)
        return {"d": d, "g": g}

    def training_step(self, real_imgs):
        z = torch.randn(real_imgs.shape[0], LATENT)
        fake_imgs = self.model.g(z)
        d_loss = wgan_d_loss(self.model, real_imgs, fake_imgs)
        self.backward(d_loss, optimizer="d")
        self.step("d")
        if self.state.step % N_CRITIC == 0:
            g_loss = -torch.mean(self.model.d(self.model.g(z)))
            self.backward(g_loss, optimizer="g")
            self.step("g")
        return d_loss


@pytest.mark.parametrize("check", checks())
def test_wgan_gp(check):
    compare(wgan, wgan_hand, WGANGP, fixed(batches(5, (8, 6))), check, steps=5)


# -- SN-GAN: christiancosgrove/pytorch-spectral-normalization-gan, main.py (hinge loss) ------------------
def sngan():
    sn = nn.utils.spectral_norm
    model = nn.Module()
    model.g = nn.Sequential(nn.Linear(LATENT, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 6), nn.Tanh())
    model.d = nn.Sequential(sn(nn.Linear(6, 8)), nn.LeakyReLU(0.1), sn(nn.Linear(8, 1)))
    return model


def sngan_opts(model):
    return (torch.optim.Adam(filter(lambda p: p.requires_grad, model.d.parameters()), lr=0.01, betas=(0.0, 0.9)),
            torch.optim.Adam(model.g.parameters(), lr=0.01, betas=(0.0, 0.9)))


def hinge_d_loss(model, data, z):
    return nn.ReLU()(1.0 - model.d(data)).mean() + nn.ReLU()(1.0 + model.d(model.g(z))).mean()


def sngan_hand(model, data):
    optim_disc, optim_gen = sngan_opts(model)
    for real in data:
        z = torch.randn(real.size(0), LATENT)
        optim_disc.zero_grad()
        optim_gen.zero_grad()
        disc_loss = hinge_d_loss(model, real, z)
        disc_loss.backward()
        optim_disc.step()
        z = torch.randn(real.size(0), LATENT)
        optim_disc.zero_grad()
        optim_gen.zero_grad()
        gen_loss = -model.d(model.g(z)).mean()
        gen_loss.backward()
        optim_gen.step()


class SNGAN(Trainer):
    automatic = False

    def configure_optimizers(self):
        d, g = sngan_opts(self.model)
        return {"d": d, "g": g}

    def training_step(self, real):
        disc_loss = hinge_d_loss(self.model, real, torch.randn(real.size(0), LATENT))
        self.backward(disc_loss, optimizer="d")
        self.step("d")
        gen_loss = -self.model.d(self.model.g(torch.randn(real.size(0), LATENT))).mean()
        self.backward(gen_loss, optimizer="g")
        self.step("g")
        return {"d": disc_loss, "g": gen_loss}


@pytest.mark.parametrize("check", checks())
def test_spectral_norm_gan(check):
    compare(sngan, sngan_hand, SNGAN, fixed(batches(5, (8, 6))), check, steps=5)


# -- CycleGAN: junyanz/pytorch-CycleGAN-and-pix2pix, models/cycle_gan_model.py, models/networks.py,
# util/image_pool.py (lsgan, identity loss, an image pool; the networks shrunk to 8×8 images) ----------
LAMBDA_A = LAMBDA_B = 10.0
LAMBDA_IDT, POOL_SIZE = 0.5, 3


def resnet_generator(ngf=4):
    """networks.ResnetGenerator, instance norm (no affine, no running statistics), one block."""
    norm = functools.partial(nn.InstanceNorm2d, affine=False, track_running_stats=False)
    block = nn.Sequential(nn.ReflectionPad2d(1), nn.Conv2d(ngf * 2, ngf * 2, 3, bias=True), norm(ngf * 2),
                          nn.ReLU(True), nn.ReflectionPad2d(1), nn.Conv2d(ngf * 2, ngf * 2, 3, bias=True),
                          norm(ngf * 2))
    return nn.Sequential(nn.ReflectionPad2d(3), nn.Conv2d(3, ngf, 7, bias=True), norm(ngf), nn.ReLU(True),
                         nn.Conv2d(ngf, ngf * 2, 3, stride=2, padding=1, bias=True), norm(ngf * 2), nn.ReLU(True),
                         Residual(block),
                         nn.ConvTranspose2d(ngf * 2, ngf, 3, stride=2, padding=1, output_padding=1, bias=True),
                         norm(ngf), nn.ReLU(True), nn.ReflectionPad2d(3), nn.Conv2d(ngf, 3, 7), nn.Tanh())


class Residual(nn.Module):
    """networks.ResnetBlock: ``x + conv_block(x)``."""

    def __init__(self, conv_block):
        super().__init__()
        self.conv_block = conv_block

    def forward(self, x):
        return x + self.conv_block(x)


def patch_discriminator(ndf=4):
    """networks.NLayerDiscriminator with n_layers=1 (in-place LeakyReLU, as the source)."""
    norm = functools.partial(nn.InstanceNorm2d, affine=False, track_running_stats=False)
    return nn.Sequential(nn.Conv2d(3, ndf, 4, stride=2, padding=1), nn.LeakyReLU(0.2, True),
                         nn.Conv2d(ndf, ndf * 2, 4, stride=1, padding=1, bias=True), norm(ndf * 2),
                         nn.LeakyReLU(0.2, True), nn.Conv2d(ndf * 2, 1, 4, stride=1, padding=1))


class GANLoss(nn.Module):
    """networks.GANLoss('lsgan'): the targets are buffers expanded to the prediction's shape."""

    def __init__(self):
        super().__init__()
        self.register_buffer("real_label", torch.tensor(1.0))
        self.register_buffer("fake_label", torch.tensor(0.0))
        self.loss = nn.MSELoss()

    def __call__(self, prediction, target_is_real):
        target = self.real_label if target_is_real else self.fake_label
        return self.loss(prediction, target.expand_as(prediction))


class ImagePool:
    """util/image_pool.py as written: stores ``image.data``; once full, half the time it hands back an
    older fake (a clone) and keeps the new one, drawing from Python's ``random``."""

    def __init__(self, pool_size):
        self.pool_size, self.num_imgs, self.images = pool_size, 0, []

    def query(self, images):
        return_images = []
        for image in images:
            image = torch.unsqueeze(image.data, 0)
            if self.num_imgs < self.pool_size:
                self.num_imgs = self.num_imgs + 1
                self.images.append(image)
                return_images.append(image)
            elif random.uniform(0, 1) > 0.5:
                random_id = random.randint(0, self.pool_size - 1)
                tmp = self.images[random_id].clone()
                self.images[random_id] = image
                return_images.append(tmp)
            else:
                return_images.append(image)
        return torch.cat(return_images, 0)


def cyclegan():
    model = nn.Module()
    model.G_A, model.G_B = resnet_generator(), resnet_generator()
    model.D_A, model.D_B = patch_discriminator(), patch_discriminator()
    model.criterionGAN = GANLoss()
    for m in model.modules():  # networks.init_weights, init_type='normal'
        if isinstance(m, (nn.Conv2d, nn.ConvTranspose2d)):
            nn.init.normal_(m.weight, 0.0, 0.02)
            nn.init.zeros_(m.bias)
    return model


def cyclegan_opts(model):
    return (torch.optim.Adam(itertools.chain(model.G_A.parameters(), model.G_B.parameters()), lr=0.01,
                             betas=(0.5, 0.999)),
            torch.optim.Adam(itertools.chain(model.D_A.parameters(), model.D_B.parameters()), lr=0.01,
                             betas=(0.5, 0.999)))


def set_requires_grad(nets, requires_grad):
    for net in nets:
        for param in net.parameters():
            param.requires_grad = requires_grad


def cycle_forward(m, real_A, real_B):
    fake_B = m.G_A(real_A)
    rec_A = m.G_B(fake_B)
    fake_A = m.G_B(real_B)
    rec_B = m.G_A(fake_A)
    return fake_B, rec_A, fake_A, rec_B


def backward_G_loss(m, real_A, real_B, fake_B, rec_A, fake_A, rec_B):
    """backward_G's loss: identity, GAN (through the frozen discriminators) and cycle terms."""
    l1 = nn.L1Loss()
    loss_idt_A = l1(m.G_A(real_B), real_B) * LAMBDA_B * LAMBDA_IDT
    loss_idt_B = l1(m.G_B(real_A), real_A) * LAMBDA_A * LAMBDA_IDT
    loss_G_A = m.criterionGAN(m.D_A(fake_B), True)
    loss_G_B = m.criterionGAN(m.D_B(fake_A), True)
    loss_cycle_A = l1(rec_A, real_A) * LAMBDA_A
    loss_cycle_B = l1(rec_B, real_B) * LAMBDA_B
    return loss_G_A + loss_G_B + loss_cycle_A + loss_cycle_B + loss_idt_A + loss_idt_B


def backward_D_basic_loss(m, netD, real, fake):
    loss_D_real = m.criterionGAN(netD(real), True)
    loss_D_fake = m.criterionGAN(netD(fake.detach()), False)
    return (loss_D_real + loss_D_fake) * 0.5


def cyclegan_hand(model, data):
    random.seed(0)
    fake_A_pool, fake_B_pool = ImagePool(POOL_SIZE), ImagePool(POOL_SIZE)
    optimizer_G, optimizer_D = cyclegan_opts(model)
    for real_A, real_B in data:  # optimize_parameters
        fake_B, rec_A, fake_A, rec_B = cycle_forward(model, real_A, real_B)
        set_requires_grad([model.D_A, model.D_B], False)
        optimizer_G.zero_grad()
        backward_G_loss(model, real_A, real_B, fake_B, rec_A, fake_A, rec_B).backward()
        optimizer_G.step()
        set_requires_grad([model.D_A, model.D_B], True)
        optimizer_D.zero_grad()
        backward_D_basic_loss(model, model.D_A, real_B, fake_B_pool.query(fake_B)).backward()
        backward_D_basic_loss(model, model.D_B, real_A, fake_A_pool.query(fake_A)).backward()
        optimizer_D.step()


class CycleGAN(Trainer):
    automatic = False

    def configure_optimizers(self):
        g, d = cyclegan_opts(self.model)
        return {"g": g, "d": d}

    def on_fit_start(self):
        random.seed(0)
        self.fake_A_pool, self.fake_B_pool = ImagePool(POOL_SIZE), ImagePool(POOL_SIZE)

    def training_step(self, batch):
        real_A, real_B = batch
        m = self.model
        fake_B, rec_A, fake_A, rec_B = cycle_forward(m, real_A, real_B)
        set_requires_grad([m.D_A, m.D_B], False)
        loss_G = backward_G_loss(m, real_A, real_B, fake_B, rec_A, fake_A, rec_B)
        self.backward(loss_G, optimizer="g")
        self.step("g")
        set_requires_grad([m.D_A, m.D_B], True)
        loss_D_A = backward_D_basic_loss(m, m.D_A, real_B, self.fake_B_pool.query(fake_B))
        self.backward(loss_D_A, optimizer="d")
        loss_D_B = backward_D_basic_loss(m, m.D_B, real_A, self.fake_A_pool.query(fake_A))
        self.backward(loss_D_B, optimizer="d")
        self.step("d")
        return {"G": loss_G, "D_A": loss_D_A, "D_B": loss_D_B}


@pytest.mark.parametrize("check", checks())
def test_cyclegan_with_an_image_pool(check):
    compare(cyclegan, cyclegan_hand, CycleGAN, fixed(batches(6, (2, 3, 8, 8), (2, 3, 8, 8))), check, steps=6)


class AutomaticCycleGAN(CycleGAN):
    """The same step returned to the Trainer: D's losses do not read G's new weights (the pool holds
    detached fakes), so updating G and D after both backwards is the source's step; D_A's and D_B's
    losses reach disjoint parameters, so their sum leaves the same gradients as two backwards."""
    automatic = True

    def training_step(self, batch):
        real_A, real_B = batch
        m = self.model
        fake_B, rec_A, fake_A, rec_B = cycle_forward(m, real_A, real_B)
        set_requires_grad([m.D_A, m.D_B], False)
        loss_G = backward_G_loss(m, real_A, real_B, fake_B, rec_A, fake_A, rec_B)
        set_requires_grad([m.D_A, m.D_B], True)
        loss_D_A = backward_D_basic_loss(m, m.D_A, real_B, self.fake_B_pool.query(fake_B))
        loss_D_B = backward_D_basic_loss(m, m.D_B, real_A, self.fake_A_pool.query(fake_A))
        return {"g": loss_G, "d": loss_D_A + loss_D_B}


@pytest.mark.parametrize("check", checks())
def test_cyclegan_with_an_image_pool_in_automatic_mode(check):
    compare(cyclegan, cyclegan_hand, AutomaticCycleGAN, fixed(batches(6, (2, 3, 8, 8), (2, 3, 8, 8))), check, steps=6)
