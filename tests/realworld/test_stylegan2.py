"""StyleGAN2's lazy regularization (rosinality/stylegan2-pytorch, train.py, model.py, op/fused_act.py).

What it exercises: on regularization steps the same optimizer steps twice (the main loss, then the
R1 penalty), and the penalty's ``autograd.grad(create_graph=True)`` goes through the graph the main
backward retained, built before that optimizer's first step (its layers save ``weight * scale``,
not the parameters the step changed in place); the same for the generator's path-length penalty
through the latents; ``requires_grad`` switched off and on every step for the network not trained;
the real images turned into leaves that take gradients; style mixing drawn from Python's ``random``;
an EMA generator updated through ``.data``; penalties kept from their last regularization step
(graphs included) and reported at every step.

Changes for a seconds-long test: fully connected layers in place of convolutions (the same
equalized-learning-rate and modulation/demodulation arithmetic), 4x4 one-channel images, two
latents, regularization every 2nd step; ``add_(1 - decay, t)`` (a signature torch dropped) written
``add_(t, alpha=1 - decay)``.
"""
import math
import random
import re
import warnings

import pytest
import torch
from torch import autograd, nn
from torch.nn import functional as F

from safeloop import InplaceModificationError, Trainer

from .harness import batches, checks, compare

LATENT, N_LATENT, SIZE, STEPS = 8, 2, 4, 6
R1, PATH_REGULARIZE, D_REG_EVERY, G_REG_EVERY, MIXING = 10.0, 2.0, 2, 2, 0.9


def fused_leaky_relu(input, bias=None, negative_slope=0.2, scale=2 ** 0.5):
    """op/fused_act.py's CPU path."""
    if bias is not None:
        rest_dim = [1] * (input.ndim - bias.ndim - 1)
        return F.leaky_relu(input + bias.view(1, bias.shape[0], *rest_dim), negative_slope=negative_slope) * scale
    return F.leaky_relu(input, negative_slope=negative_slope) * scale


class EqualLinear(nn.Module):
    def __init__(self, in_dim, out_dim, bias=True, bias_init=0, lr_mul=1, activation=None):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(out_dim, in_dim).div_(lr_mul))
        self.bias = nn.Parameter(torch.zeros(out_dim).fill_(bias_init)) if bias else None
        self.activation = activation
        self.scale = (1 / math.sqrt(in_dim)) * lr_mul
        self.lr_mul = lr_mul

    def forward(self, input):
        if self.activation:
            out = F.linear(input, self.weight * self.scale)
            return fused_leaky_relu(out, self.bias * self.lr_mul)
        return F.linear(input, self.weight * self.scale, bias=self.bias * self.lr_mul)


class PixelNorm(nn.Module):
    def forward(self, input):
        return input * torch.rsqrt(torch.mean(input ** 2, dim=1, keepdim=True) + 1e-8)


class ModulatedLinear(nn.Module):
    """ModulatedConv2d with a 1x1 kernel over flat features: the style scales the weight per sample,
    demodulation renormalizes it, a batched product applies it (grouped convolution in the source)."""

    def __init__(self, in_dim, out_dim, style_dim, demodulate=True):
        super().__init__()
        self.scale = 1 / math.sqrt(in_dim)
        self.weight = nn.Parameter(torch.randn(1, out_dim, in_dim))
        self.modulation = EqualLinear(style_dim, in_dim, bias_init=1)
        self.demodulate = demodulate
        self.bias = nn.Parameter(torch.zeros(out_dim))

    def forward(self, input, style):
        batch = input.shape[0]
        style = self.modulation(style).view(batch, 1, -1)
        weight = self.scale * self.weight * style
        if self.demodulate:
            demod = torch.rsqrt(weight.pow(2).sum(2) + 1e-8)
            weight = weight * demod.view(batch, -1, 1)
        return fused_leaky_relu(torch.bmm(weight, input.unsqueeze(2)).squeeze(2), self.bias)


class Generator(nn.Module):
    def __init__(self):
        super().__init__()
        self.style = nn.Sequential(PixelNorm(), *(EqualLinear(LATENT, LATENT, lr_mul=0.01, activation="fused_lrelu")
                                                  for _ in range(2)))
        self.input = nn.Parameter(torch.randn(1, 8))  # ConstantInput
        self.conv1 = ModulatedLinear(8, 8, LATENT)
        self.to_rgb = ModulatedLinear(8, SIZE * SIZE, LATENT, demodulate=False)
        self.n_latent = N_LATENT

    def forward(self, styles, return_latents=False):
        styles = [self.style(s) for s in styles]
        if len(styles) < 2:
            latent = styles[0].unsqueeze(1).repeat(1, self.n_latent, 1)
        else:
            inject_index = random.randint(1, self.n_latent - 1)
            latent = torch.cat([styles[0].unsqueeze(1).repeat(1, inject_index, 1),
                                styles[1].unsqueeze(1).repeat(1, self.n_latent - inject_index, 1)], 1)
        out = self.conv1(self.input.repeat(latent.shape[0], 1), latent[:, 0])
        image = self.to_rgb(out, latent[:, 1]).view(-1, 1, SIZE, SIZE)
        return (image, latent) if return_latents else (image, None)


class Discriminator(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(EqualLinear(SIZE * SIZE, 16, activation="fused_lrelu"), EqualLinear(16, 1))

    def forward(self, input):
        return self.net(input.flatten(1))


def stylegan2():
    model = nn.Module()
    model.generator, model.discriminator, model.g_ema = Generator(), Discriminator(), Generator()
    model.g_ema.eval()
    accumulate(model.g_ema, model.generator, 0)
    return model


def requires_grad(model, flag=True):
    for p in model.parameters():
        p.requires_grad = flag


def accumulate(model1, model2, decay=0.999):
    par1 = dict(model1.named_parameters())
    par2 = dict(model2.named_parameters())
    for k in par1.keys():
        par1[k].data.mul_(decay).add_(par2[k].data, alpha=1 - decay)


def d_logistic_loss(real_pred, fake_pred):
    return F.softplus(-real_pred).mean() + F.softplus(fake_pred).mean()


def d_r1_loss(real_pred, real_img):
    grad_real, = autograd.grad(outputs=real_pred.sum(), inputs=real_img, create_graph=True)
    return (grad_real.view(grad_real.shape[0], -1).norm(2, dim=1) ** 2).mean()


def g_nonsaturating_loss(fake_pred):
    return F.softplus(-fake_pred).mean()


def g_path_regularize(fake_img, latents, mean_path_length, decay=0.01):
    noise = torch.randn_like(fake_img) / math.sqrt(fake_img.shape[2] * fake_img.shape[3])
    grad, = autograd.grad(outputs=(fake_img * noise).sum(), inputs=latents, create_graph=True)
    path_lengths = torch.sqrt(grad.pow(2).sum(2).mean(1))
    path_mean = mean_path_length + decay * (path_lengths.detach().mean() - mean_path_length)
    path_penalty = (path_lengths - path_mean).pow(2).mean()
    return path_penalty, path_mean


def make_noise(batch, latent_dim, n_noise):
    if n_noise == 1:
        return torch.randn(batch, latent_dim)
    return torch.randn(n_noise, batch, latent_dim).unbind(0)


def mixing_noise(batch):
    if MIXING > 0 and random.random() < MIXING:
        noises = make_noise(batch, LATENT, 4)
        return noises[:2], noises[2:]
    noise1, noise2 = make_noise(batch, LATENT, 2)
    return [noise1], [noise2]


def discriminator_loss(generator, discriminator, real_img, i):
    """The first part of the source's iteration: D's loss (the real images made leaves on regularization steps)."""
    requires_grad(generator, False)
    requires_grad(discriminator, True)
    noise1, noise2 = mixing_noise(real_img.shape[0])

    fake_img, _ = generator(noise1)
    fake_pred = discriminator(fake_img)
    d_regularize = i % D_REG_EVERY == 0
    if d_regularize:
        real_img.requires_grad = True
    real_pred = discriminator(real_img)
    return noise2, real_pred, d_logistic_loss(real_pred, fake_pred), d_regularize


def optimizers(model):
    g_reg_ratio = G_REG_EVERY / (G_REG_EVERY + 1)
    d_reg_ratio = D_REG_EVERY / (D_REG_EVERY + 1)
    g_optim = torch.optim.Adam(model.generator.parameters(), lr=0.002 * g_reg_ratio,
                               betas=(0 ** g_reg_ratio, 0.99 ** g_reg_ratio))
    d_optim = torch.optim.Adam(model.discriminator.parameters(), lr=0.002 * d_reg_ratio,
                               betas=(0 ** d_reg_ratio, 0.99 ** d_reg_ratio))
    return g_optim, d_optim


def stylegan2_hand(model, loader):
    """train() of the source, one process."""
    random.seed(3)
    generator, discriminator, g_ema = model.generator, model.discriminator, model.g_ema
    g_optim, d_optim = optimizers(model)
    mean_path_length = 0
    r1_loss = torch.tensor(0.0)
    path_loss = torch.tensor(0.0)
    loss_dict = {}
    for i, real_img in enumerate(loader):
        noise2, real_pred, d_loss, d_regularize = discriminator_loss(generator, discriminator, real_img, i)
        loss_dict["d"] = d_loss
        discriminator.zero_grad()
        d_loss.backward(retain_graph=d_regularize)
        d_optim.step()
        if d_regularize:
            r1_loss = d_r1_loss(real_pred, real_img)
            discriminator.zero_grad()
            (R1 / 2 * r1_loss * D_REG_EVERY).backward()
            d_optim.step()
        loss_dict["r1"] = r1_loss

        requires_grad(generator, True)
        requires_grad(discriminator, False)
        fake_img, latents = generator(noise2, return_latents=True)
        fake_pred = discriminator(fake_img)
        g_loss = g_nonsaturating_loss(fake_pred)
        loss_dict["g"] = g_loss
        g_regularize = i % G_REG_EVERY == 0
        generator.zero_grad()
        g_loss.backward(retain_graph=g_regularize)
        g_optim.step()
        if g_regularize:
            path_loss, mean_path_length = g_path_regularize(fake_img, latents, mean_path_length)
            generator.zero_grad()
            (PATH_REGULARIZE * path_loss * G_REG_EVERY).backward()
            g_optim.step()
        loss_dict["path"] = path_loss
        accumulate(g_ema, generator)
    requires_grad(discriminator, True)  # as the next iteration would leave it: every run ends alike


class StyleGAN2(Trainer):
    automatic = False
    fresh_penalty = False  # True: R1 on a fresh D(real), after D's first update, as later versions of train.py do

    def configure_optimizers(self):
        g_optim, d_optim = optimizers(self.model)
        return {"g": g_optim, "d": d_optim}

    def on_fit_start(self):
        random.seed(3)
        self.mean_path_length = 0
        self.r1_loss, self.path_loss = torch.tensor(0.0), torch.tensor(0.0)

    def training_step(self, real_img):
        generator, discriminator = self.model.generator, self.model.discriminator
        i = self.state.step
        noise2, real_pred, d_loss, d_regularize = discriminator_loss(generator, discriminator, real_img, i)
        self.backward(d_loss, optimizer="d", retain_graph=d_regularize)
        self.step("d")
        if d_regularize:  # the penalty through the graph retained above, built before d stepped
            if self.fresh_penalty:
                real_pred = discriminator(real_img)
            self.r1_loss = d_r1_loss(real_pred, real_img)
            self.backward(R1 / 2 * self.r1_loss * D_REG_EVERY, optimizer="d")
            self.step("d")

        requires_grad(generator, True)
        requires_grad(discriminator, False)
        fake_img, latents = generator(noise2, return_latents=True)
        g_loss = g_nonsaturating_loss(discriminator(fake_img))
        g_regularize = i % G_REG_EVERY == 0
        self.backward(g_loss, optimizer="g", retain_graph=g_regularize)
        self.step("g")
        if g_regularize:
            self.path_loss, self.mean_path_length = g_path_regularize(fake_img, latents, self.mean_path_length)
            self.backward(PATH_REGULARIZE * self.path_loss * G_REG_EVERY, optimizer="g")
            self.step("g")
        accumulate(self.model.g_ema, generator)
        # the penalties of the last regularization step, graphs and all, reported at every step as in the source
        return {"d": d_loss, "r1": self.r1_loss, "g": g_loss, "path": self.path_loss}

    def on_fit_end(self):
        requires_grad(self.model.discriminator, True)


@pytest.mark.parametrize("check", checks())
def test_stylegan2_lazy_regularization(check):
    compare(stylegan2, stylegan2_hand, StyleGAN2, lambda model: batches(STEPS, (4, 1, SIZE, SIZE)), check,
            steps=STEPS)


class SavesItsWeights(nn.Module):
    """A discriminator of plain nn.Linear layers: they save the weights themselves for backward."""

    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(SIZE * SIZE, 16), nn.LeakyReLU(0.2), nn.Linear(16, 1))

    def forward(self, input):
        return self.net(input.flatten(1))


@pytest.mark.parametrize("check", ["auto", "always", "off"])
def test_the_penalty_through_weights_the_update_changed_names_the_parameter_and_its_fix_trains(check):
    """With layers that save their weights, the source's R1 through the graph built before D's update needs
    weights that update changed in place: PyTorch refuses it from inside the user's own autograd.grad. The
    Trainer names the parameter and the fix, and leaves the model as it was; the fix (a fresh D(real), as later
    versions of the source's train.py compute) then trains."""
    torch.manual_seed(0)
    model = stylegan2()
    model.discriminator = SavesItsWeights()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    trainer = StyleGAN2(model=model, train_data=batches(STEPS, (4, 1, SIZE, SIZE)), max_steps=STEPS, device="cpu",
                        progress=False, loggers=(), guard={"check": check})
    with pytest.raises(InplaceModificationError, match=re.escape(
            "(step 1): an autograd call outside self.backward (torch.autograd.grad in training_step, say) went "
            "through a graph built before optimizer 'd' stepped in this step; that update changed "
            "`model.discriminator.net.2.weight` in place")):
        trainer.fit()
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    trainer.fresh_penalty = True
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        trainer.fit()
    assert trainer.state.step == STEPS
