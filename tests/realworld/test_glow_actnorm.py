"""Glow with ActNorm's data-dependent initialisation: rosinality/glow-pytorch at commit
97081ff115a694cf04aeedbd58447f33d242c879, model.py (``ActNorm``, ``InvConv2dLU``, ``ZeroConv2d``,
``AffineCoupling``, ``Flow``, ``Block``, ``Glow``) and train.py (``calc_loss``, ``train``).

Each ``ActNorm`` holds an ``initialized`` uint8 buffer read by ``.item()`` at every forward; while it is 0 the
forward first sets ``loc`` and ``scale`` from its input's per-channel mean and std through ``.data.copy_`` under
``no_grad``, then ``initialized.fill_(1)``. ``train`` spends its first batch on that: a forward under ``no_grad``
and ``continue``, no update. Every later iteration dequantizes with ``torch.rand_like`` noise, computes the
bits-per-dimension loss from the prior's log-density and the log-determinant (a Python ``sum`` over ``w_s``
in each LU-decomposed invertible 1x1 convolution, ``slogdet``-free), ``model.zero_grad()``, backward, assigns
the learning rate to ``param_groups[0]["lr"]`` and steps Adam.

Changes for a seconds-long test: 3x4x4 images in batches of 4, two blocks of one flow each, affine couplings
(``--affine``) whose hidden convolutions have 8 channels (``filter_size=512`` in the source), lr 1e-3, 5 updates;
``DataParallel`` left out (``model.module(...)`` is ``model(...)``); scipy's ``la.qr``/``la.lu`` are NumPy's
``qr`` and ``torch.linalg.lu`` (scipy is not installed here; both factor ``A = P L U``); the sampling, printing and
checkpoint files left out.

The port spends the first batch the same way in ``on_fit_start`` and trains on the others.
"""
from functools import partial
from math import log, pi

import numpy as np
import pytest
import torch
from torch import nn, optim
from torch.nn import functional as F

from safeloop import Trainer

from .harness import assert_same, checks, compare

STEPS, BATCH, IMG_SIZE, N_FLOW, N_BLOCK, N_BITS, LR, FILTER_SIZE = 5, 4, 4, 1, 2, 5, 1e-3, 8

logabs = lambda x: torch.log(torch.abs(x))


# -- model.py -----------------------------------------------------------------------------------------------
class ActNorm(nn.Module):
    def __init__(self, in_channel, logdet=True):
        super().__init__()

        self.loc = nn.Parameter(torch.zeros(1, in_channel, 1, 1))
        self.scale = nn.Parameter(torch.ones(1, in_channel, 1, 1))

        self.register_buffer("initialized", torch.tensor(0, dtype=torch.uint8))
        self.logdet = logdet

    def initialize(self, input):
        with torch.no_grad():
            flatten = input.permute(1, 0, 2, 3).contiguous().view(input.shape[1], -1)
            mean = (
                flatten.mean(1)
                .unsqueeze(1)
                .unsqueeze(2)
                .unsqueeze(3)
                .permute(1, 0, 2, 3)
            )
            std = (
                flatten.std(1)
                .unsqueeze(1)
                .unsqueeze(2)
                .unsqueeze(3)
                .permute(1, 0, 2, 3)
            )

            self.loc.data.copy_(-mean)
            self.scale.data.copy_(1 / (std + 1e-6))

    def forward(self, input):
        _, _, height, width = input.shape

        if self.initialized.item() == 0:
            self.initialize(input)
            self.initialized.fill_(1)

        log_abs = logabs(self.scale)

        logdet = height * width * torch.sum(log_abs)

        if self.logdet:
            return self.scale * (input + self.loc), logdet

        else:
            return self.scale * (input + self.loc)


class InvConv2dLU(nn.Module):
    def __init__(self, in_channel):
        super().__init__()

        weight = np.random.randn(in_channel, in_channel)
        q, _ = np.linalg.qr(weight)
        w_p, w_l, w_u = (t.numpy() for t in torch.linalg.lu(torch.from_numpy(q.astype(np.float32))))
        w_s = np.diag(w_u)
        w_u = np.triu(w_u, 1)
        u_mask = np.triu(np.ones_like(w_u), 1)
        l_mask = u_mask.T

        w_p = torch.from_numpy(w_p)
        w_l = torch.from_numpy(w_l)
        w_s = torch.from_numpy(w_s)
        w_u = torch.from_numpy(w_u)

        self.register_buffer("w_p", w_p)
        self.register_buffer("u_mask", torch.from_numpy(u_mask))
        self.register_buffer("l_mask", torch.from_numpy(l_mask))
        self.register_buffer("s_sign", torch.sign(w_s))
        self.register_buffer("l_eye", torch.eye(l_mask.shape[0]))
        self.w_l = nn.Parameter(w_l)
        self.w_s = nn.Parameter(logabs(w_s))
        self.w_u = nn.Parameter(w_u)

    def forward(self, input):
        _, _, height, width = input.shape

        weight = self.calc_weight()

        out = F.conv2d(input, weight)
        logdet = height * width * sum(self.w_s)

        return out, logdet

    def calc_weight(self):
        weight = (
            self.w_p
            @ (self.w_l * self.l_mask + self.l_eye)
            @ ((self.w_u * self.u_mask) + torch.diag(self.s_sign * torch.exp(self.w_s)))
        )

        return weight.unsqueeze(2).unsqueeze(3)


class ZeroConv2d(nn.Module):
    def __init__(self, in_channel, out_channel, padding=1):
        super().__init__()

        self.conv = nn.Conv2d(in_channel, out_channel, 3, padding=0)
        self.conv.weight.data.zero_()
        self.conv.bias.data.zero_()
        self.scale = nn.Parameter(torch.zeros(1, out_channel, 1, 1))

    def forward(self, input):
        out = F.pad(input, [1, 1, 1, 1], value=1)
        out = self.conv(out)
        out = out * torch.exp(self.scale * 3)

        return out


class AffineCoupling(nn.Module):
    def __init__(self, in_channel, filter_size=FILTER_SIZE, affine=True):
        super().__init__()

        self.affine = affine

        self.net = nn.Sequential(
            nn.Conv2d(in_channel // 2, filter_size, 3, padding=1),
            nn.ReLU(inplace=True),
            nn.Conv2d(filter_size, filter_size, 1),
            nn.ReLU(inplace=True),
            ZeroConv2d(filter_size, in_channel if self.affine else in_channel // 2),
        )

        self.net[0].weight.data.normal_(0, 0.05)
        self.net[0].bias.data.zero_()

        self.net[2].weight.data.normal_(0, 0.05)
        self.net[2].bias.data.zero_()

    def forward(self, input):
        in_a, in_b = input.chunk(2, 1)

        if self.affine:
            log_s, t = self.net(in_a).chunk(2, 1)
            # s = torch.exp(log_s)
            s = F.sigmoid(log_s + 2)
            # out_a = s * in_a + t
            out_b = (in_b + t) * s

            logdet = torch.sum(torch.log(s).view(input.shape[0], -1), 1)

        else:
            net_out = self.net(in_a)
            out_b = in_b + net_out
            logdet = None

        return torch.cat([in_a, out_b], 1), logdet


class Flow(nn.Module):
    def __init__(self, in_channel, affine=True, conv_lu=True):
        super().__init__()

        self.actnorm = ActNorm(in_channel)

        self.invconv = InvConv2dLU(in_channel)

        self.coupling = AffineCoupling(in_channel, affine=affine)

    def forward(self, input):
        out, logdet = self.actnorm(input)
        out, det1 = self.invconv(out)
        out, det2 = self.coupling(out)

        logdet = logdet + det1
        if det2 is not None:
            logdet = logdet + det2

        return out, logdet


def gaussian_log_p(x, mean, log_sd):
    return -0.5 * log(2 * pi) - log_sd - 0.5 * (x - mean) ** 2 / torch.exp(2 * log_sd)


class Block(nn.Module):
    def __init__(self, in_channel, n_flow, split=True, affine=True, conv_lu=True):
        super().__init__()

        squeeze_dim = in_channel * 4

        self.flows = nn.ModuleList()
        for i in range(n_flow):
            self.flows.append(Flow(squeeze_dim, affine=affine, conv_lu=conv_lu))

        self.split = split

        if split:
            self.prior = ZeroConv2d(in_channel * 2, in_channel * 4)

        else:
            self.prior = ZeroConv2d(in_channel * 4, in_channel * 8)

    def forward(self, input):
        b_size, n_channel, height, width = input.shape
        squeezed = input.view(b_size, n_channel, height // 2, 2, width // 2, 2)
        squeezed = squeezed.permute(0, 1, 3, 5, 2, 4)
        out = squeezed.contiguous().view(b_size, n_channel * 4, height // 2, width // 2)

        logdet = 0

        for flow in self.flows:
            out, det = flow(out)
            logdet = logdet + det

        if self.split:
            out, z_new = out.chunk(2, 1)
            mean, log_sd = self.prior(out).chunk(2, 1)
            log_p = gaussian_log_p(z_new, mean, log_sd)
            log_p = log_p.view(b_size, -1).sum(1)

        else:
            zero = torch.zeros_like(out)
            mean, log_sd = self.prior(zero).chunk(2, 1)
            log_p = gaussian_log_p(out, mean, log_sd)
            log_p = log_p.view(b_size, -1).sum(1)
            z_new = out

        return out, logdet, log_p, z_new


class Glow(nn.Module):
    def __init__(self, in_channel, n_flow, n_block, affine=True, conv_lu=True):
        super().__init__()

        self.blocks = nn.ModuleList()
        n_channel = in_channel
        for i in range(n_block - 1):
            self.blocks.append(Block(n_channel, n_flow, affine=affine, conv_lu=conv_lu))
            n_channel *= 2
        self.blocks.append(Block(n_channel, n_flow, split=False, affine=affine))

    def forward(self, input):
        log_p_sum = 0
        logdet = 0
        out = input
        z_outs = []

        for block in self.blocks:
            out, det, log_p, z_new = block(out)
            z_outs.append(z_new)
            logdet = logdet + det

            if log_p is not None:
                log_p_sum = log_p_sum + log_p

        return log_p_sum, logdet, z_outs


# -- train.py -----------------------------------------------------------------------------------------------
def calc_loss(log_p, logdet, image_size, n_bins):
    # log_p = calc_log_p([z_list])
    n_pixel = image_size * image_size * 3

    loss = -log(n_bins) * n_pixel
    loss = loss + logdet + log_p

    return (
        (-loss / (log(2) * n_pixel)).mean(),
        (log_p / (log(2) * n_pixel)).mean(),
        (logdet / (log(2) * n_pixel)).mean(),
    )


def quantize(image, n_bins):
    image = image * 255

    if N_BITS < 8:
        image = torch.floor(image / 2 ** (8 - N_BITS))

    return image / n_bins - 0.5


def glow_hand(model, dataset):
    optimizer = optim.Adam(model.parameters(), lr=LR)
    dataset = iter(dataset)
    n_bins = 2.0 ** N_BITS

    for i in range(STEPS + 1):
        image, _ = next(dataset)

        image = quantize(image, n_bins)

        if i == 0:
            with torch.no_grad():
                log_p, logdet, _ = model(
                    image + torch.rand_like(image) / n_bins
                )

                continue

        else:
            log_p, logdet, _ = model(image + torch.rand_like(image) / n_bins)

        logdet = logdet.mean()

        loss, log_p, log_det = calc_loss(log_p, logdet, IMG_SIZE, n_bins)
        model.zero_grad()
        loss.backward()
        # warmup_lr = args.lr * min(1, i * batch_size / (50000 * 10))
        warmup_lr = LR
        optimizer.param_groups[0]["lr"] = warmup_lr
        optimizer.step()


def glow():
    return Glow(3, N_FLOW, N_BLOCK, affine=True, conv_lu=True)


def images(model):
    gen = torch.Generator().manual_seed(2)
    return [(torch.rand(BATCH, 3, IMG_SIZE, IMG_SIZE, generator=gen), torch.zeros(BATCH, dtype=torch.long))
            for _ in range(STEPS + 1)]


class GlowTrainer(Trainer):
    n_bins = 2.0 ** N_BITS
    first_batch: tuple

    def on_fit_start(self):
        image, _ = self.first_batch
        image = quantize(image, self.n_bins)
        with torch.no_grad():  # ActNorm's data-dependent initialisation
            self.model(image + torch.rand_like(image) / self.n_bins)

    def training_step(self, batch):
        image, _ = batch
        image = quantize(image, self.n_bins)
        log_p, logdet, _ = self.model(image + torch.rand_like(image) / self.n_bins)
        loss, log_p, log_det = calc_loss(log_p, logdet.mean(), IMG_SIZE, self.n_bins)
        return loss


def port(model, train_data, **kwargs):
    """The Trainer, given the first batch for ``on_fit_start`` and the others to train on."""
    trainer = GlowTrainer(model=model, train_data=train_data[1:], **kwargs)
    trainer.first_batch = train_data[0]
    return trainer


@pytest.mark.parametrize("check", checks())
def test_glow_with_actnorm_data_dependent_initialisation(check):
    compare(glow, glow_hand, port, images, check, steps=STEPS, optimizer=partial(optim.Adam, lr=LR))


def test_the_first_batch_initialises_every_actnorm():
    torch.manual_seed(0)
    model = glow()
    before = [m.loc.clone() for m in model.modules() if isinstance(m, ActNorm)]
    glow_hand(model, images(model))
    actnorms = [m for m in model.modules() if isinstance(m, ActNorm)]
    assert len(actnorms) == N_BLOCK and all(m.initialized.item() == 1 for m in actnorms)
    assert all(not torch.equal(m.loc, b) for m, b in zip(actnorms, before))


def run(checkpoint_dir, steps, resume=None):
    """A run in a fresh process would start so: the model built from the seeds (NumPy's draws the LU factors)."""
    torch.manual_seed(0)
    np.random.seed(0)
    model = glow()
    torch.manual_seed(1)
    trainer = port(model, images(model), max_steps=steps, device="cpu", progress=False, loggers=(),
                   checkpoint={"dir": str(checkpoint_dir)}, resume=resume, optimizer=partial(optim.Adam, lr=LR))
    trainer.fit()
    return trainer


@pytest.mark.filterwarnings("error")
def test_glow_resumed_midway_keeps_its_actnorm_initialisation(tmp_path):
    """The ``initialized`` flags come back with the checkpoint, so the resumed run's ``on_fit_start`` forward (its
    noise drawn too) initialises nothing again, and the run goes on as the straight one."""
    straight = run(tmp_path / "straight", STEPS)
    run(tmp_path / "stopped", STEPS // 2)
    resumed = run(tmp_path / "stopped", STEPS, resume="auto")
    assert resumed.state.step == STEPS
    assert_same(resumed.model, straight.model)
