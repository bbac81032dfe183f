"""MeanFlow with a Jacobian-vector product in every loss: haidog-yaqub/MeanFlow at commit
16d64deeb96b434f0a901d26206376904883db9b, meanflow.py (``MeanFlow.loss``, ``sample_t_r``, ``adaptive_l2_loss``,
``Normalizer``), models/dit.py (``MFDiT`` and its parts) and train.py (the loop).

Each loss runs the model four times: twice under ``no_grad`` for the conditional and unconditional velocities
(classifier-free guidance on a random share of the batch), once inside ``torch.autograd.functional.jvp`` under
``no_grad`` with ``create_graph=False`` (which enables grad inside, makes its inputs require grad and calls
``torch.autograd.grad`` twice: the double-backward trick, a graph of a gradient differentiated again), and once
with grad for the loss. The JVP's result is only used through ``stopgrad``. Times are drawn from NumPy's global
RNG, the guidance scales by ``randperm`` and ``uniform_``; an adaptive L2 weight is detached. The loop clips the
gradient norm, steps AdamW and a per-step ``LambdaLR`` (warmup then cosine), then ``zero_grad``.

Changes for a seconds-long test: 1x4x4 images, patches of 2, ``dim`` 8, ``depth`` 1, 2 heads, 3 classes, batches
of 4, 4 steps; timm's ``PatchEmbed`` and ``Mlp`` written out (a strided convolution then ``flatten(2).transpose``;
``fc1``, GELU, ``fc2``), einops' ``rearrange(t, "b -> b 1 1 1")`` as ``view(-1, 1, 1, 1)``; the zero-initialised
output layers start from a small random init (with zeros, the first steps train only those); no Accelerate (its
``backward`` and ``clip_grad_norm_`` are PyTorch's on one process), sampling, logging or checkpoints.

The port is a plain ``training_step`` returning the loss, with ``grad_clip`` and the scheduler per step.
"""
import math
from functools import partial

import numpy as np
import pytest
import torch
import torch.nn as nn

from safeloop import Trainer

from .harness import checks, compare

STEPS, BATCH, CLASSES, LR, WEIGHT_DECAY, GRAD_CLIP, WARMUP_STEPS, MIN_LR_RATIO = 4, 4, 3, 1e-2, 0.0, 1.0, 2, 0.1


def rearrange(t, pattern):
    assert pattern == "b -> b 1 1 1"
    return t.view(-1, 1, 1, 1)


# -- meanflow.py --------------------------------------------------------------------------------------------
class Normalizer:
    # minmax for raw image, mean_std for vae latent
    def __init__(self, mode='minmax', mean=None, std=None):
        assert mode in ['minmax', 'mean_std'], "mode must be 'minmax' or 'mean_std'"
        self.mode = mode

    @classmethod
    def from_list(cls, config):
        mode, mean, std = config
        return cls(mode, mean, std)

    def norm(self, x):
        if self.mode == 'minmax':
            return x * 2 - 1


def stopgrad(x):
    return x.detach()


def adaptive_l2_loss(error, gamma=0.0, c=1e-2):
    delta_sq = torch.mean(error ** 2, dim=(1, 2, 3), keepdim=False)
    p = 1.0 - gamma
    w = 1.0 / (delta_sq + c).pow(p)
    loss = delta_sq
    return (stopgrad(w) * loss).mean()


class MeanFlow:
    def __init__(
        self,
        channels=1,
        image_size=32,
        num_classes=10,
        normalizer=['minmax', None, None],
        mode='i-meanflow',
        # time distribution, mu, sigma
        time_dist=['lognorm', -0.4, 1.0],
        cfg_ratio=0.10,
        # scalar or [low, high] range; None disables CFG
        cfg_scale=[1.0, 5.0],
        cfg_scale_ratio=0.75,
        adaptive_l2_gamma=0.0,
        adaptive_l2_c=1e-2,
    ):
        self.channels = channels
        self.image_size = image_size
        self.num_classes = num_classes
        self.use_cond = num_classes is not None

        self.normer = Normalizer.from_list(normalizer)

        assert mode in ('meanflow', 'i-meanflow')
        self.mode = mode
        self.time_dist = time_dist
        self.cfg_ratio = cfg_ratio
        self.cfg_scale_ratio = cfg_scale_ratio
        self.use_cfg_w = cfg_scale is not None
        if self.use_cfg_w and isinstance(cfg_scale, (int, float)):
            self.cfg_w_fixed = float(cfg_scale)
            self.cfg_w_range = None
        elif self.use_cfg_w:
            self.cfg_w_fixed = None
            self.cfg_w_range = (float(cfg_scale[0]), float(cfg_scale[1]))
        else:
            self.cfg_w_fixed = None
            self.cfg_w_range = None
        self.adaptive_l2_gamma = adaptive_l2_gamma
        self.adaptive_l2_c = adaptive_l2_c

    def sample_t_r(self, batch_size, device, sample_cfg=True):
        if self.time_dist[0] == 'uniform':
            samples = np.random.rand(batch_size, 2).astype(np.float32)

        elif self.time_dist[0] == 'lognorm':
            mu, sigma = self.time_dist[-2], self.time_dist[-1]
            normal_samples = np.random.randn(batch_size, 2).astype(np.float32) * sigma + mu
            samples = 1 / (1 + np.exp(-normal_samples))

        t_np = np.maximum(samples[:, 0], samples[:, 1])
        r_np = np.minimum(samples[:, 0], samples[:, 1])

        t = torch.tensor(t_np, device=device)
        r = torch.tensor(r_np, device=device)

        if not self.use_cfg_w:
            w = torch.ones(batch_size, device=device)
        elif self.cfg_w_fixed is not None:
            w = torch.full((batch_size,), self.cfg_w_fixed, device=device)
        else:
            low, high = self.cfg_w_range
            if sample_cfg:
                w = torch.ones(batch_size, device=device)
                num = int(self.cfg_scale_ratio * batch_size)
                if num > 0:
                    indices = torch.randperm(batch_size, device=device)[:num]
                    w[indices] = torch.empty(num, device=device).uniform_(low, high)
            else:
                w = torch.full((batch_size,), (low + high) / 2, device=device)

        return t, r, w

    def loss(self, model, x, c=None):
        batch_size = x.shape[0]
        device = x.device

        t, r, w = self.sample_t_r(batch_size, device)

        t_ = rearrange(t, "b -> b 1 1 1").detach().clone()
        r_ = rearrange(r, "b -> b 1 1 1").detach().clone()

        e = torch.randn_like(x)
        x = self.normer.norm(x)

        z = (1 - t_) * x + t_ * e
        v = e - x
        v_hat = v

        if c is not None and self.use_cfg_w:
            uncond = torch.ones_like(c) * self.num_classes
            uncond_w = torch.ones_like(w)
            cfg_mask = torch.rand_like(c.float()) < self.cfg_ratio
            c = torch.where(cfg_mask, uncond, c)
            w = torch.where(cfg_mask, torch.ones_like(w), w)
            w_ = rearrange(w, "b -> b 1 1 1")

            with torch.no_grad():
                _, v_c = model(z, t, r, y=c, w=w)
                _, v_uc = model(z, t, r, y=uncond, w=uncond_w)
                v_hat = v + (1 - 1 / w_) * (v_c - v_uc)
        else:
            with torch.no_grad():
                _, v_c = model(z, t, r, y=c, w=w)

        with torch.no_grad():
            model_partial = partial(
                model, y=c, w=w, return_v=False, use_flash_attention=False
            )
            _, dudt = torch.autograd.functional.jvp(
                model_partial,
                (z, t, r),
                (v_c, torch.ones_like(t), torch.zeros_like(r)),
                create_graph=False,
            )

        u_p, v_p = model(z, t, r, y=c, w=w)

        fm_loss = adaptive_l2_loss(
            v_p - stopgrad(v_hat),
            gamma=self.adaptive_l2_gamma,
            c=self.adaptive_l2_c,
        )

        v_est = u_p + (t_ - r_) * stopgrad(dudt)

        if self.mode == 'meanflow':
            u_tgt = v_hat - (t_ - r_) * dudt
            mf_loss = adaptive_l2_loss(
                u_p - stopgrad(u_tgt),
                gamma=self.adaptive_l2_gamma,
                c=self.adaptive_l2_c,
            )
        else:
            mf_loss = adaptive_l2_loss(
                v_est - stopgrad(v_hat),
                gamma=self.adaptive_l2_gamma,
                c=self.adaptive_l2_c,
            )

        mse_val = {
            'fm_loss': stopgrad(fm_loss),
            'mf_loss': stopgrad(mf_loss),
            'mf_v_mse': (stopgrad(v_est - v_hat) ** 2).mean(),
        }
        return mf_loss + fm_loss, mse_val


# -- models/dit.py ------------------------------------------------------------------------------------------
def expand_ada_params(param, x):
    if param.ndim == 2:
        return param.unsqueeze(1)
    return param


def modulate(x, scale, shift):
    scale = expand_ada_params(scale, x)
    shift = expand_ada_params(shift, x)
    return x * (1 + scale) + shift


class TimestepEmbedder(nn.Module):
    def __init__(self, dim, nfreq=256, scale=1000.0):
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(nfreq, dim), nn.SiLU(), nn.Linear(dim, dim))
        self.nfreq = nfreq
        self.scale = scale

    @staticmethod
    def timestep_embedding(t, dim, max_period=10000):
        half_dim = dim // 2
        freqs = torch.exp(
            -math.log(max_period)
            * torch.arange(start=0, end=half_dim, dtype=torch.float32)
            / half_dim
        ).to(device=t.device)
        args = t[:, None].float() * freqs[None]
        embedding = torch.cat([torch.cos(args), torch.sin(args)], dim=-1)
        if dim % 2:
            embedding = torch.cat(
                [embedding, torch.zeros_like(embedding[:, :1])], dim=-1
            )
        return embedding

    def forward(self, t):
        t = t * self.scale
        t_freq = self.timestep_embedding(t, self.nfreq)
        t_emb = self.mlp(t_freq)
        return t_emb

    def initialize_weights(self):
        nn.init.normal_(self.mlp[0].weight, std=0.02)
        nn.init.normal_(self.mlp[2].weight, std=0.02)


class LabelEmbedder(nn.Module):
    def __init__(self, num_classes, dim):
        super().__init__()
        self.embedding = nn.Embedding(num_classes + 1, dim)
        self.num_classes = num_classes

    def forward(self, labels):
        embeddings = self.embedding(labels)
        return embeddings


class Attention(nn.Module):
    def __init__(self, dim, num_heads=8, qkv_bias=True, qk_norm=True):
        super().__init__()
        assert dim % num_heads == 0
        self.num_heads = num_heads
        self.head_dim = dim // num_heads
        self.scale = self.head_dim ** -0.5

        self.qkv = nn.Linear(dim, dim * 3, bias=qkv_bias)
        self.q_norm = nn.RMSNorm(self.head_dim) if qk_norm else nn.Identity()
        self.k_norm = nn.RMSNorm(self.head_dim) if qk_norm else nn.Identity()
        self.proj = nn.Linear(dim, dim)

    def _native_attention(self, q, k, v):
        attn = (q @ k.transpose(-2, -1)) * self.scale
        attn = attn.softmax(dim=-1)
        return attn @ v

    def forward(self, x, use_flash_attention=False):
        B, N, C = x.shape
        qkv = self.qkv(x).reshape(B, N, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)
        q = self.q_norm(q)
        k = self.k_norm(k)
        x = self._native_attention(q, k, v)
        x = x.transpose(1, 2).reshape(B, N, C)
        return self.proj(x)


class Mlp(nn.Module):
    """timm's Mlp as DiTBlock uses it (no dropout, no norm)."""

    def __init__(self, in_features, hidden_features, act_layer, drop=0):
        super().__init__()
        self.fc1, self.act, self.fc2 = nn.Linear(in_features, hidden_features), act_layer(), \
            nn.Linear(hidden_features, in_features)

    def forward(self, x):
        return self.fc2(self.act(self.fc1(x)))


class PatchEmbed(nn.Module):
    """timm's PatchEmbed: a strided convolution, flattened to tokens."""

    def __init__(self, img_size, patch_size, in_chans, embed_dim):
        super().__init__()
        self.patch_size = (patch_size, patch_size)
        self.num_patches = (img_size // patch_size) ** 2
        self.proj = nn.Conv2d(in_chans, embed_dim, kernel_size=patch_size, stride=patch_size)

    def forward(self, x):
        return self.proj(x).flatten(2).transpose(1, 2)


class DiTBlock(nn.Module):
    def __init__(self, dim, num_heads, mlp_ratio=4.0):
        super().__init__()
        self.norm1 = nn.RMSNorm(dim, elementwise_affine=False)
        self.attn = Attention(dim, num_heads=num_heads, qkv_bias=True, qk_norm=True)
        self.norm2 = nn.RMSNorm(dim, elementwise_affine=False)
        mlp_dim = int(dim * mlp_ratio)
        approx_gelu = lambda: nn.GELU(approximate="tanh")
        self.mlp = Mlp(
            in_features=dim, hidden_features=mlp_dim, act_layer=approx_gelu, drop=0
        )
        self.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(dim, 6 * dim))

    def forward(self, x, c, use_flash_attention=False):
        shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = (
            self.adaLN_modulation(c).chunk(6, dim=-1)
        )
        x = x + expand_ada_params(gate_msa, x) * self.attn(
            modulate(self.norm1(x), scale_msa, shift_msa),
            use_flash_attention=use_flash_attention,
        )
        x = x + expand_ada_params(gate_mlp, x) * self.mlp(
            modulate(self.norm2(x), scale_mlp, shift_mlp)
        )
        return x


class FinalLayer(nn.Module):
    def __init__(self, dim, patch_size, out_dim):
        super().__init__()
        self.norm_final = nn.RMSNorm(dim, elementwise_affine=False)
        self.linear = nn.Linear(dim, patch_size * patch_size * out_dim)
        self.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(dim, 2 * dim))

    def forward(self, x, c):
        shift, scale = self.adaLN_modulation(c).chunk(2, dim=-1)
        x = modulate(self.norm_final(x), scale, shift)
        x = self.linear(x)
        return x


class MFDiT(nn.Module):
    def __init__(
        self,
        input_size=4,
        patch_size=2,
        in_channels=1,
        dim=8,
        depth=1,
        num_heads=2,
        mlp_ratio=4.0,
        num_classes=CLASSES,
        max_cfg=4.0,
    ):
        super().__init__()
        self.in_channels = in_channels
        self.out_channels = in_channels
        self.patch_size = patch_size
        self.num_heads = num_heads
        self.num_classes = num_classes
        self.max_cfg = max_cfg

        self.x_embedder = PatchEmbed(input_size, patch_size, in_channels, dim)
        self.t_embedder = TimestepEmbedder(dim)
        self.r_embedder = TimestepEmbedder(dim)
        self.w_embedder = TimestepEmbedder(dim)

        self.use_cond = num_classes is not None
        self.y_embedder = LabelEmbedder(num_classes, dim) if self.use_cond else None

        num_patches = self.x_embedder.num_patches
        self.pos_embed = nn.Parameter(torch.zeros(1, num_patches, dim), requires_grad=True)

        self.blocks = nn.ModuleList([
            DiTBlock(dim, num_heads, mlp_ratio) for _ in range(depth)
        ])
        self.final_layer_v = FinalLayer(dim, patch_size, self.out_channels)
        self.final_layer_u = FinalLayer(dim, patch_size, self.out_channels)

        self.initialize_weights()

    def initialize_weights(self):
        def _basic_init(module):
            if isinstance(module, nn.Linear):
                torch.nn.init.xavier_uniform_(module.weight)
                if module.bias is not None:
                    nn.init.constant_(module.bias, 0)
        self.apply(_basic_init)
        w = self.x_embedder.proj.weight.data
        nn.init.xavier_uniform_(w.view([w.shape[0], -1]))
        nn.init.constant_(self.x_embedder.proj.bias, 0)
        if self.y_embedder is not None:
            nn.init.normal_(self.y_embedder.embedding.weight, std=0.02)
        for embedder in (self.t_embedder, self.r_embedder, self.w_embedder):
            embedder.initialize_weights()
        for final_layer in (self.final_layer_v, self.final_layer_u):  # small, not zero: see the docstring
            nn.init.normal_(final_layer.linear.weight, std=0.1)

    def unpatchify(self, x):
        c = self.out_channels
        p = self.x_embedder.patch_size[0]
        h = w = int(x.shape[1] ** 0.5)
        assert h * w == x.shape[1]

        x = x.reshape(shape=(x.shape[0], h, w, p, p, c))
        x = torch.einsum('nhwpqc->nchpwq', x)
        imgs = x.reshape(shape=(x.shape[0], c, h * p, h * p))
        return imgs

    def forward(self, x, t, r, y=None, w=None, return_v=True, use_flash_attention=False):
        x = self.x_embedder(x) + self.pos_embed  # (N, T, D), where T = H * W / patch_size ** 2

        if w is None:
            w = torch.ones_like(t)
        w = w / self.max_cfg

        t = self.t_embedder(t)                   # (N, D)
        r = self.r_embedder(r)
        w = self.w_embedder(w)
        t = t + r + w

        c = t
        if self.use_cond:
            y = self.y_embedder(y)               # (N, D)
            c = c + y                            # (N, D)

        for block in self.blocks:
            x = block(x, c, use_flash_attention=use_flash_attention)

        u = self.unpatchify(self.final_layer_u(x, c))
        if not return_v:
            return u

        v = self.unpatchify(self.final_layer_v(x, c))
        return u, v


# -- train.py -----------------------------------------------------------------------------------------------
def lr_lambda(step):
    if WARMUP_STEPS > 0 and step < WARMUP_STEPS:
        return max(step, 1) / WARMUP_STEPS
    if step >= STEPS:
        return MIN_LR_RATIO
    progress = (step - WARMUP_STEPS) / max(STEPS - WARMUP_STEPS, 1)
    cosine = 0.5 * (1.0 + math.cos(math.pi * progress))
    return MIN_LR_RATIO + (1.0 - MIN_LR_RATIO) * cosine


def images(model):
    np.random.seed(0)  # sample_t_r draws from NumPy's global RNG
    gen = torch.Generator().manual_seed(3)
    return [(torch.rand(BATCH, 1, 4, 4, generator=gen), torch.randint(CLASSES, (BATCH,), generator=gen))
            for _ in range(STEPS)]


def meanflow_hand(model, train_dataloader):
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda)
    meanflow = MeanFlow(channels=1, image_size=4, num_classes=CLASSES)
    train_dataloader = iter(train_dataloader)
    model.train()
    for _ in range(STEPS):
        x, c = next(train_dataloader)
        loss, mse_val = meanflow.loss(model, x, c)
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), GRAD_CLIP)
        optimizer.step()
        if scheduler is not None:
            scheduler.step()
        optimizer.zero_grad()


class MeanFlowTrainer(Trainer):
    def configure_optimizers(self):
        self.meanflow = MeanFlow(channels=1, image_size=4, num_classes=CLASSES)
        optimizer = torch.optim.AdamW(self.model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
        return {"optimizer": optimizer, "lr_scheduler": {
            "scheduler": torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda), "interval": "step"}}

    def training_step(self, batch):
        x, c = batch
        loss, mse_val = self.meanflow.loss(self.model, x, c)
        self.log("mf_v_mse", mse_val["mf_v_mse"])
        return loss


@pytest.mark.parametrize("check", checks())
def test_meanflow_with_a_double_backward_jvp_in_the_loss(check):
    compare(MFDiT, meanflow_hand, MeanFlowTrainer, images, check, steps=STEPS, grad_clip=GRAD_CLIP)
