"""A denoising diffusion model trained with an EMA copy, as PyTorch's DDIM tutorial trains it: pytorch/tutorials
at commit 0d06529a8da7d86fa326c25e5365d4caddc4152a, advanced_source/DDIM_tutorial.py (``DiffUnet`` and its
blocks, ``get_beta_schedule``, ``DDIMSampler``, ``DiffusionModel``, ``train_epoch``, the training loop).

- The U-Net: a sinusoidal timestep embedding through an MLP, residual blocks adding the projected embedding
  after their first conv, dropout before their second, GroupNorm(32), self-attention blocks (``bmm`` over
  reshaped 1x1-conv projections), skip features kept in a list and popped on the way up.
- The loss: a timestep per sample (``torch.randint``) and Gaussian noise (``torch.randn``) drawn inside
  ``train_loss``, the noised input from the cosine schedule's ``alpha_cumprod``, an L1 loss on the predicted
  noise; the gradient norm clipped at 1 (``max_norm=1.0``); AdamW.
- After each update ``update_emma`` replaces every EMA parameter's data with a new tensor
  (``p_ema.data = (1 - emma) * p.data + p_ema.data * emma``); the EMA net is a deep copy made before training,
  in eval mode; ``DiffusionModel`` is no ``nn.Module`` (its ``parameters()`` are the U-Net's).

Changes for a seconds-long test: 8x8 images (64x64), 32 base channels with multipliers [1, 1] (the smallest
GroupNorm(32) allows; [2, 2, 4, 4, 8]), one block per level (2), an embedding of 32 (256), attention at
resolution 8 ([16, 8, 4]), 2 epochs of 3 batches of 2 random images in [-1, 1] in place of Oxford Flowers and
its loaders; no CUDA; ``val_epoch`` (its KID metric needs torchmetrics and CUDA), saving and generation are
left out.

The port: ``training_step`` returns ``train_loss``; ``grad_clip=1.0`` (the norm over ``model.parameters()``,
as ``clip_grad_norm_(model.parameters(), ...)``); ``update_emma`` in ``on_step_end``; the ``DiffusionModel``
wrapper (and its EMA copy) built in ``configure_optimizers`` around the Trainer's U-Net.
"""
import copy
import math
from typing import List, Optional, Tuple, Union

import numpy as np
import pytest
import torch
from torch import nn

from safeloop import Trainer

from .harness import assert_same, checks, compare

RES, BATCH, PER_EPOCH, EPOCHS = 8, 2, 3, 2
MAX_FREQ = 1000


def get_timestep_embedding(timesteps, embedding_dim):  # sinusoidal embedding like in Transformers
    assert len(timesteps.shape) == 1
    half_dim = embedding_dim // 2
    emb = math.log(MAX_FREQ) / (half_dim - 1)
    emb = torch.exp(torch.arange(half_dim, dtype=torch.float32) * -emb)
    emb = emb.to(device=timesteps.device)
    emb = timesteps.float()[:, None] * emb[None, :]
    emb = torch.cat([torch.sin(emb), torch.cos(emb)], dim=1)
    if embedding_dim % 2 == 1:  # zero pad
        emb = torch.nn.functional.pad(emb, (0, 1, 0, 0))
    return emb


def Normalize(in_channels):
    return torch.nn.GroupNorm(num_groups=32, num_channels=in_channels, eps=1e-6, affine=True)


def nonlinearity(name):
    return getattr(nn, name)()


# Resnet Block
class ResidualBlock(nn.Module):
    def __init__(self, in_chs, out_chs, temb_dim, act='SiLU', dropout=0.2):
        super().__init__()
        self.time_proj = nn.Sequential(nonlinearity(act),
                                       nn.Linear(temb_dim, out_chs))

        dims = [in_chs] + 2 * [out_chs]
        blocks = []
        for i in range(1, 3):
            blc = nn.Sequential(Normalize(dims[i - 1]),
                                nonlinearity(act),
                                nn.Conv2d(dims[i - 1], dims[i], 3, padding=1),)
            if i > 1:
                blc.insert(2, nn.Dropout(dropout))
            blocks.append(blc)
        self.blocks = nn.ModuleList(blocks)
        self.short_cut = False
        if in_chs != out_chs:
            self.short_cut = True
            self.conv_short = nn.Conv2d(in_chs, out_chs, 1)

    def forward(self, x, temb):
        h = x
        for i, blc in enumerate(self.blocks):
            h = blc(h)
            if i == 0:
                h = h + self.time_proj(temb)[:, :, None, None]
        if self.short_cut:
            x = self.conv_short(x)
        return x + h


# Attention Module
class AttnBlock(nn.Module):
    def __init__(self, in_channels):
        super().__init__()
        self.in_channels = in_channels

        self.norm = Normalize(in_channels)
        self.q = torch.nn.Conv2d(in_channels, in_channels, kernel_size=1, stride=1, padding=0)
        self.k = torch.nn.Conv2d(in_channels, in_channels, kernel_size=1, stride=1, padding=0)
        self.v = torch.nn.Conv2d(in_channels, in_channels, kernel_size=1, stride=1, padding=0)
        self.proj_out = torch.nn.Conv2d(in_channels, in_channels, kernel_size=1, stride=1, padding=0)

    def forward(self, x):
        h_ = x
        h_ = self.norm(h_)
        q = self.q(h_)
        k = self.k(h_)
        v = self.v(h_)

        # compute attention
        b, c, h, w = q.shape
        q = q.reshape(b, c, h * w)
        q = q.permute(0, 2, 1)   # b,hw,c
        k = k.reshape(b, c, h * w)  # b,c,hw
        w_ = torch.bmm(q, k)     # b,hw,hw    w[b,i,j]=sum_c q[b,i,c]k[b,c,j]
        w_ = w_ * (c**(-0.5))
        w_ = torch.nn.functional.softmax(w_, dim=2)

        # attend to values
        v = v.reshape(b, c, h * w)
        w_ = w_.permute(0, 2, 1)   # b,hw,hw (first hw of k, second of q)
        # b, c,hw (hw of q) h_[b,c,j] = sum_i v[b,c,i] w_[b,i,j]
        h_ = torch.bmm(v, w_)
        h_ = h_.reshape(b, c, h, w)

        h_ = self.proj_out(h_)

        return x + h_


# Downsize Block
class DownBlock(nn.Module):
    def __init__(self, out_chs, with_conv=True):
        super().__init__()
        self.with_conv = with_conv
        if with_conv:
            self.down_conv = nn.Conv2d(out_chs, out_chs, 3, stride=2)
        else:
            self.down_conv = nn.AvgPool2d(2, 2)

    def _down(self, x):
        if self.with_conv:
            pad = (0, 1, 0, 1)  # to make the input shape equals to the output shape after convulotion op
            x = torch.nn.functional.pad(x, pad, mode="constant", value=0)
            x = self.down_conv(x)
        else:
            x = self.down_conv(x)
        return x

    def forward(self, x):
        return self._down(x)


# Upsample BLock
class UpBlock(nn.Module):
    def __init__(self, out_chs, with_conv=True, mode='nearest',):
        super().__init__()
        self.with_conv = with_conv
        self.mode = mode
        if with_conv:
            self.up_conv = nn.Conv2d(out_chs, out_chs, 3, padding=1)

    def _up(self, x):
        x = torch.nn.functional.interpolate(x, scale_factor=2.0, mode=self.mode)
        if self.with_conv:
            x = self.up_conv(x)
        return x

    def forward(self, x):
        return self._up(x)


# Unet Model
class DiffUnet(nn.Module):
    def __init__(self, chs=32, chs_mult=[2, 2, 4, 4, 8], attn_res=[16, 8, 4], block_depth=2, act='SiLU',
                 temb_dim=256, with_conv=True, res=64, dropout=0.3):
        super().__init__()
        self.chs = chs
        self.conv_in = nn.Conv2d(3, chs, 3, padding=1)
        self.time_proj = nn.Sequential(nn.Linear(chs, temb_dim),
                                       nonlinearity(act),
                                       nn.Linear(temb_dim, temb_dim))
        chs_mult = [1] + chs_mult
        # down block
        down_dims = []  # to store the down features
        downs = []  # to store the down blocks of the unet model
        for i in range(1, len(chs_mult) - 1):
            in_ch = chs * chs_mult[i - 1]
            out_ch = chs * chs_mult[i]
            down = nn.Module()
            down.res = nn.ModuleList([ResidualBlock(in_ch, out_ch, temb_dim, act, dropout)] +
                                     [ResidualBlock(out_ch, out_ch, temb_dim, act, dropout)
                                      for _ in range(1, block_depth)])
            attn = AttnBlock(out_ch) if res in attn_res else nn.Identity()
            down.attn = attn
            down.down_blc = DownBlock(out_ch, with_conv)
            downs.append(down)
            down_dims.append(out_ch)
            res = res // 2

        self.downs = nn.ModuleList(downs)

        # mid block
        last_ch_dim = chs * chs_mult[-1]
        self.mid_res1 = ResidualBlock(out_ch, last_ch_dim, temb_dim, act, dropout)
        self.mid_attn = AttnBlock(last_ch_dim)
        self.mid_res2 = ResidualBlock(last_ch_dim, last_ch_dim, temb_dim, act, dropout)

        # up block
        down_dims = down_dims[1:] + [last_ch_dim]
        ups = []
        for i, skip_ch in zip(reversed(range(1, len(chs_mult) - 1)), reversed(down_dims)):
            out_ch = chs * chs_mult[i]
            in_ch = out_ch + skip_ch
            up = nn.Module()

            up.res = nn.ModuleList([ResidualBlock(in_ch, out_ch, temb_dim, act, dropout)] +
                                   [ResidualBlock(out_ch * 2, out_ch, temb_dim, act, dropout)
                                    for _ in range(1, block_depth)])
            attn = AttnBlock(out_ch) if res in attn_res else nn.Identity()
            up.attn = attn
            up.up_blc = UpBlock(skip_ch, with_conv) if i != 0 else nn.Identity()
            ups.append(up)
            res = int(res * 2)
        self.ups = nn.ModuleList(ups)
        self.out = nn.Sequential(Normalize(out_ch),
                                 nonlinearity(act),
                                 nn.Conv2d(out_ch, 3, 3, padding=1))
        self.res = res

    def forward(self, x, timestep):
        t = get_timestep_embedding(timestep, self.chs)
        t = self.time_proj(t)
        h = self.conv_in(x)
        hs = []
        # Down
        for blc in self.downs:
            for res_block in blc.res:
                h = res_block(h, t)
                h = blc.attn(h)
                hs.append(h)
            h = blc.down_blc(h)
        # Mid
        h = self.mid_res1(h, t)
        h = self.mid_attn(h)
        h = self.mid_res2(h, t)
        # Up
        for blc in self.ups:
            h = blc.up_blc(h)
            for res_block in blc.res:
                h = torch.cat([h, hs.pop()], axis=1)
                h = res_block(h, t)
                h = blc.attn(h)
        return self.out(h)


def get_beta_schedule(beta_schedule, *, beta_start, beta_end, num_diffusion_timesteps):
    """The source's, for its ``cosv2`` schedule (the one ``DiffusionModel`` uses)."""
    def alpha_bar(time_step):
        return math.cos((time_step + 0.008) / 1.008 * math.pi / 2) ** 2
    assert beta_schedule == "cosv2"
    betas = []
    for i in range(num_diffusion_timesteps):
        t1 = i / num_diffusion_timesteps
        t2 = (i + 1) / num_diffusion_timesteps
        betas.append(min(1 - alpha_bar(t2) / alpha_bar(t1), beta_end))
    betas = np.array(betas)
    assert betas.shape == (num_diffusion_timesteps,)
    return betas


class DDIMSampler:
    """The source's training half (``q_sample``); its sampling methods are left out."""

    def __init__(self, schedule_name: str, diff_train_steps: int, beta_start: float = 0.001, beta_end: float = 0.2):
        betas = get_beta_schedule(schedule_name, beta_start=beta_start, beta_end=beta_end,
                                  num_diffusion_timesteps=diff_train_steps)
        self.betas = torch.tensor(betas).to(torch.float32)
        self.alpha = 1 - self.betas
        self.alpha_cumprod = torch.cumprod(self.alpha, dim=0)

        self.timesteps = np.arange(0, diff_train_steps)[::-1]
        self.num_train_steps = diff_train_steps
        self._num_inference_steps = 20
        self.eta = 0

    def q_sample(self, x_t: torch.Tensor, timesteps: Union[torch.Tensor, int]):
        alpha_t = self.alpha_cumprod[timesteps].to(timesteps.device)
        alpha_t = alpha_t.flatten().to(x_t.device)[:, None, None, None]
        eps = torch.randn(*list(x_t.shape)).to(x_t.device)
        x_t = alpha_t.sqrt() * x_t + (1 - alpha_t).sqrt() * eps
        return x_t, eps


class DiffusionModel:
    def __init__(self, main_net: DiffUnet, ema_net: Optional[DiffUnet] = None, num_steps: int = 100,
                 input_res: Union[Tuple[int, int], List[int]] = (32, 32), emma: float = 0.999,
                 noise_sch_name: str = 'cosv2', **noise_sch_kwargs):
        self.device = torch.device('cpu')  # 'cuda' if torch.cuda.is_available() else 'cpu'
        self.eps_net = main_net.to(self.device)
        self.ema_net = ema_net if ema_net is not None else copy.deepcopy(main_net)
        self.ema_net = self.ema_net.to(self.device)
        self.ema_net.eval()
        self.steps = num_steps
        self.res = (3,) + input_res if isinstance(input_res, tuple) else [3] + input_res
        self.num_steps = num_steps
        self.scheduler = DDIMSampler(noise_sch_name, diff_train_steps=num_steps, **noise_sch_kwargs)
        self.emma = emma

    def train_loss(self, input_batch: torch.Tensor, loss_type: Optional[str] = 'l1_loss', **losskwargs):
        """Training loss"""
        bs, _, _, _ = input_batch.shape
        t = torch.randint(0, self.num_steps, size=(bs,))
        x_t, eps = self.scheduler.q_sample(input_batch, t)
        t = t.int().to(input_batch.device)
        eps_pred = self.eps_net(x_t, t)
        loss = getattr(torch.nn.functional, loss_type)(eps_pred, eps, **losskwargs)
        return loss

    def update_emma(self):
        for p_ema, p in zip(self.ema_net.parameters(), self.eps_net.parameters()):
            p_ema.data = (1 - self.emma) * p.data + p_ema.data * self.emma

    def train(self):
        self.eps_net.train()

    def eval(self):
        self.eps_net.eval()

    def parameters(self):
        return self.eps_net.parameters()


def unet():
    return DiffUnet(chs=32, chs_mult=[1, 1], attn_res=[8], block_depth=1, temb_dim=32, res=RES)


def wrap(net):
    return DiffusionModel(net, num_steps=1000, input_res=(RES, RES))


mean = lambda x: sum(x) / len(x)  # noqa: E731 (the source's)


def train_epoch(model, train_ds, opt, loss_type='mse_loss', num=5, max_norm=None, **kwargs):
    model.train()
    losses = []
    for i, inputs in enumerate(train_ds):
        opt.zero_grad()

        loss = model.train_loss(inputs, loss_type, **kwargs)
        loss.backward()
        if max_norm is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        opt.step()
        loss = loss.item()
        losses.append(loss)
        model.update_emma()
    return mean(losses)


def ddim_hand(net, train_iter):
    Model = wrap(net)
    optim = torch.optim.AdamW(net.parameters(), 5e-4, weight_decay=0.01)
    loss_type = 'l1_loss'
    for e in range(EPOCHS):
        train_epoch(Model, train_iter, optim, loss_type, max_norm=1.0)
    train_iter.ema = Model.ema_net


class DDIM(Trainer):
    def configure_optimizers(self):
        self.diffusion = wrap(self.model)
        return torch.optim.AdamW(self.model.parameters(), 5e-4, weight_decay=0.01)

    def on_epoch_start(self):
        self.diffusion.train()

    def training_step(self, batch):
        return self.diffusion.train_loss(batch, 'l1_loss')

    def on_step_end(self, losses):
        self.diffusion.update_emma()

    def on_fit_end(self):
        self.train_data.ema = self.diffusion.ema_net


class Flowers(list):
    def __init__(self):
        gen = torch.Generator().manual_seed(23)
        super().__init__(torch.rand(BATCH, 3, RES, RES, generator=gen) * 2 - 1 for _ in range(PER_EPOCH))
        self.ema = None


@pytest.mark.parametrize("check", checks())
def test_ddim_training_with_an_ema_net_through_data(check):
    runs = []

    def data(model):
        runs.append(Flowers())
        return runs[-1]
    compare(unet, ddim_hand, DDIM, data, check, steps=EPOCHS * PER_EPOCH, grad_clip=1.0)
    hand, watched, port = (run.ema for run in runs)
    assert_same(watched, hand)
    assert_same(port, hand)
