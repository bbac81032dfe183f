"""A Vision Transformer trained as timm's train.py trains it, with gradient checkpointing, Mixup/CutMix and an
EMA of the weights: huggingface/pytorch-image-models at commit 0d439427f235b8c5e1d779c1df2bd02113487f51,
train.py (``train_one_epoch``, ``--grad-checkpointing``, ``--mixup 0.8 --cutmix 1.0``, ``--model-ema``,
``--clip-grad``), timm/models/_manipulate.py (``checkpoint_seq``), timm/models/vision_transformer.py
(``LayerScale``, ``Block``, ``VisionTransformer._pos_embed``/``forward_features``/``forward_head``),
timm/layers/attention.py (``Attention``, fused), timm/layers/mlp.py (``Mlp``), timm/layers/drop.py
(``drop_path``, ``DropPath``), timm/layers/patch_embed.py (``PatchEmbed.forward``), timm/data/mixup.py
(``Mixup``, ``mixup_target``, ``rand_bbox``, ``cutmix_bbox_and_lam``), timm/loss/cross_entropy.py
(``SoftTargetCrossEntropy``), timm/utils/model_ema.py (``ModelEmaV3``), timm/utils/clip_grad.py
(``dispatch_clip_grad``) and timm/optim/_param_groups.py (``param_groups_weight_decay``).

- The blocks run through ``torch.utils.checkpoint.checkpoint`` one by one (``checkpoint_seq``), reentrant
  (``TIMM_REENTRANT_CKPT``) or not (timm's default): no activation inside a block is kept, the backward
  re-runs each block with the RNG state of its forward replayed (attention dropout inside
  ``scaled_dot_product_attention``, projection and MLP dropout, stochastic depth's ``bernoulli_``).
- Mixup mixes each batch in place (``x.mul_(lam).add_(x_flipped)``), or CutMix pastes a box of the flipped
  batch into it (``x[:, :, yl:yh, xl:xh] = ...``), chosen and drawn from NumPy's global RNG; the targets become
  smoothed soft labels for ``SoftTargetCrossEntropy``.
- AdamW in two parameter groups (no decay on 1-d tensors, biases, ``pos_embed`` and ``cls_token``); the
  gradient norm clipped over ``model.parameters()``; ``ModelEmaV3.update(model, step=num_updates)`` after each
  update: a deep copy in eval mode, every floating tensor of its ``state_dict`` moved by ``_foreach_lerp_``
  (its first update copies: decay 0 at step 1).

Changes for a seconds-long test: a ViT of 2 blocks, width 16, 2 heads, 4x4 patches of 8x8 images (the
command's models are ViT-B and larger), 3 classes, dropout 0.1 everywhere and stochastic depth 0.1 (the
command's defaults are 0; set so that the recomputation has RNG to replay), LayerScale; 6 batches of 4
random images in one epoch (ImageNet, its augmentations and the prefetcher left out), an EMA decay of 0.9;
no learning-rate scheduler (``step_update`` would only assign ``param_group['lr']``), no AMP, no
distributed training, no accumulation (``--grad-accum-steps 1``); the meters, logs and saver are left out.

The port: ``training_step`` mixes the batch and returns the loss, ``grad_clip`` clips, ``on_step_end``
updates the EMA, which the Trainer builds in ``configure_optimizers`` (after the model, as train.py does).
"""
import os
from copy import deepcopy
from functools import partial
from itertools import chain

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from safeloop import Trainer

from .harness import assert_same, checks, compare

IMG, PATCH, DIM, DEPTH, HEADS, CLASSES, BATCH, STEPS = 8, 4, 16, 2, 2, 3, 4, 6
SEED = 2  # NumPy's: Mixup 2 times, CutMix 4 times in the 6 batches
DROP, DROP_PATH, EMA_DECAY, CLIP, LR, WD = 0.1, 0.1, 0.9, 1.0, 1e-3, 0.05

_USE_REENTRANT_CKPT = bool(os.environ.get('TIMM_REENTRANT_CKPT', ''))


def use_reentrant_ckpt() -> bool:
    return _USE_REENTRANT_CKPT


def set_reentrant_ckpt(enable: bool = True):
    global _USE_REENTRANT_CKPT
    _USE_REENTRANT_CKPT = enable


# -- timm/models/_manipulate.py ---------------------------------------------------------------------------
def checkpoint_seq(functions, x, every=1, flatten=False, skip_last=False, use_reentrant=None):
    if use_reentrant is None:
        use_reentrant = use_reentrant_ckpt()

    def run_function(start, end, functions):
        def forward(_x):
            for j in range(start, end + 1):
                _x = functions[j](_x)
            return _x
        return forward

    if isinstance(functions, torch.nn.Sequential):
        functions = functions.children()
    if flatten:
        functions = chain.from_iterable(functions)
    if not isinstance(functions, (tuple, list)):
        functions = tuple(functions)

    num_checkpointed = len(functions)
    if skip_last:
        num_checkpointed -= 1
    end = -1
    for start in range(0, num_checkpointed, every):
        end = min(start + every - 1, num_checkpointed - 1)
        x = torch.utils.checkpoint.checkpoint(
            run_function(start, end, functions),
            x,
            use_reentrant=use_reentrant,
        )
    if skip_last:
        return run_function(end + 1, len(functions) - 1, functions)(x)
    return x


# -- timm/layers ------------------------------------------------------------------------------------------
def drop_path(x, drop_prob: float = 0., training: bool = False, scale_by_keep: bool = True):
    if drop_prob == 0. or not training:
        return x
    keep_prob = 1 - drop_prob
    shape = (x.shape[0],) + (1,) * (x.ndim - 1)  # work with diff dim tensors, not just 2D ConvNets
    random_tensor = x.new_empty(shape).bernoulli_(keep_prob)
    if keep_prob > 0.0 and scale_by_keep:
        random_tensor.div_(keep_prob)
    return x * random_tensor


class DropPath(nn.Module):
    def __init__(self, drop_prob: float = 0., scale_by_keep: bool = True):
        super(DropPath, self).__init__()
        self.drop_prob = drop_prob
        self.scale_by_keep = scale_by_keep

    def forward(self, x):
        return drop_path(x, self.drop_prob, self.training, self.scale_by_keep)


class Attention(nn.Module):
    def __init__(self, dim, num_heads=8, qkv_bias=False, proj_bias=True, attn_drop=0., proj_drop=0.):
        """The source's, without ``qk_norm`` and ``scale_norm`` (off in ViT), fused attention on."""
        super().__init__()
        assert dim % num_heads == 0, 'dim should be divisible by num_heads'
        self.num_heads = num_heads
        self.head_dim = dim // num_heads
        self.scale = self.head_dim ** -0.5
        self.fused_attn = True

        self.qkv = nn.Linear(dim, dim * 3, bias=qkv_bias)
        self.q_norm = nn.Identity()
        self.k_norm = nn.Identity()
        self.attn_drop = nn.Dropout(attn_drop)
        self.norm = nn.Identity()
        self.proj = nn.Linear(dim, dim, bias=proj_bias)
        self.proj_drop = nn.Dropout(proj_drop)

    def forward(self, x, attn_mask=None):
        B, N, C = x.shape
        qkv = self.qkv(x).reshape(B, N, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)
        q, k = self.q_norm(q), self.k_norm(k)

        x = F.scaled_dot_product_attention(
            q, k, v,
            attn_mask=attn_mask,
            dropout_p=self.attn_drop.p if self.training else 0.,
        )

        x = x.transpose(1, 2).reshape(B, N, C)
        x = self.norm(x)
        x = self.proj(x)
        x = self.proj_drop(x)
        return x


class Mlp(nn.Module):
    def __init__(self, in_features, hidden_features=None, out_features=None, act_layer=nn.GELU, bias=True, drop=0.):
        super().__init__()
        out_features = out_features or in_features
        hidden_features = hidden_features or in_features
        self.fc1 = nn.Linear(in_features, hidden_features, bias=bias)
        self.act = act_layer()
        self.drop1 = nn.Dropout(drop)
        self.norm = nn.Identity()
        self.fc2 = nn.Linear(hidden_features, out_features, bias=bias)
        self.drop2 = nn.Dropout(drop)

    def forward(self, x):
        x = self.fc1(x)
        x = self.act(x)
        x = self.drop1(x)
        x = self.norm(x)
        x = self.fc2(x)
        x = self.drop2(x)
        return x


class PatchEmbed(nn.Module):
    def __init__(self, patch_size, in_chans, embed_dim):
        super().__init__()
        self.proj = nn.Conv2d(in_chans, embed_dim, kernel_size=patch_size, stride=patch_size)
        self.norm = nn.Identity()

    def forward(self, x):
        x = self.proj(x)
        x = x.flatten(2).transpose(1, 2)  # NCHW -> NLC
        x = self.norm(x)
        return x


# -- timm/models/vision_transformer.py ---------------------------------------------------------------------
class LayerScale(nn.Module):
    def __init__(self, dim, init_values=1e-5, inplace=False):
        super().__init__()
        self.inplace = inplace
        self.gamma = nn.Parameter(init_values * torch.ones(dim))

    def forward(self, x):
        return x.mul_(self.gamma) if self.inplace else x * self.gamma


class Block(nn.Module):
    def __init__(self, dim, num_heads, mlp_ratio=4., qkv_bias=False, proj_drop=0., attn_drop=0., init_values=None,
                 drop_path=0., act_layer=nn.GELU, norm_layer=nn.LayerNorm, mlp_layer=Mlp):
        super().__init__()
        self.norm1 = norm_layer(dim)
        self.attn = Attention(dim, num_heads=num_heads, qkv_bias=qkv_bias, attn_drop=attn_drop, proj_drop=proj_drop)
        self.ls1 = LayerScale(dim, init_values=init_values) if init_values else nn.Identity()
        self.drop_path1 = DropPath(drop_path) if drop_path > 0. else nn.Identity()

        self.norm2 = norm_layer(dim)
        self.mlp = mlp_layer(in_features=dim, hidden_features=int(dim * mlp_ratio), act_layer=act_layer, drop=proj_drop)
        self.ls2 = LayerScale(dim, init_values=init_values) if init_values else nn.Identity()
        self.drop_path2 = DropPath(drop_path) if drop_path > 0. else nn.Identity()

    def forward(self, x, attn_mask=None):
        x = x + self.drop_path1(self.ls1(self.attn(self.norm1(x), attn_mask=attn_mask)))
        x = x + self.drop_path2(self.ls2(self.mlp(self.norm2(x))))
        return x


class VisionTransformer(nn.Module):
    """The source's, for its defaults (class token, ``global_pool='token'``, learned position embedding) and
    the arguments used here; ``trunc_normal_`` initialization of ``pos_embed`` and ``cls_token`` as timm's
    ``init_weights`` does, the layers' own initialization otherwise (its ``jax``/``timm`` init left out)."""

    def __init__(self, img_size=IMG, patch_size=PATCH, in_chans=3, num_classes=CLASSES, embed_dim=DIM, depth=DEPTH,
                 num_heads=HEADS, mlp_ratio=4., qkv_bias=True, init_values=1e-2, drop_rate=DROP,
                 pos_drop_rate=DROP, proj_drop_rate=DROP, attn_drop_rate=DROP, drop_path_rate=DROP_PATH):
        super().__init__()
        norm_layer = partial(nn.LayerNorm, eps=1e-6)
        self.num_prefix_tokens = 1
        self.grad_checkpointing = False
        self.patch_embed = PatchEmbed(patch_size, in_chans, embed_dim)
        num_patches = (img_size // patch_size) ** 2
        self.cls_token = nn.Parameter(torch.zeros(1, 1, embed_dim))
        self.pos_embed = nn.Parameter(torch.randn(1, num_patches + 1, embed_dim) * .02)
        self.pos_drop = nn.Dropout(p=pos_drop_rate)
        self.patch_drop = nn.Identity()
        self.norm_pre = nn.Identity()
        dpr = [x.item() for x in torch.linspace(0, drop_path_rate, depth)]  # stochastic depth decay rule
        self.blocks = nn.Sequential(*[
            Block(dim=embed_dim, num_heads=num_heads, mlp_ratio=mlp_ratio, qkv_bias=qkv_bias, init_values=init_values,
                  proj_drop=proj_drop_rate, attn_drop=attn_drop_rate, drop_path=dpr[i], norm_layer=norm_layer)
            for i in range(depth)])
        self.norm = norm_layer(embed_dim)
        self.fc_norm = nn.Identity()
        self.head_drop = nn.Dropout(drop_rate)
        self.head = nn.Linear(embed_dim, num_classes)
        nn.init.trunc_normal_(self.pos_embed, std=.02)
        nn.init.normal_(self.cls_token, std=1e-6)

    def no_weight_decay(self):
        return {'pos_embed', 'cls_token', 'dist_token'}

    def set_grad_checkpointing(self, enable=True):
        self.grad_checkpointing = enable

    def _pos_embed(self, x):
        pos_embed = self.pos_embed
        to_cat = [self.cls_token.expand(x.shape[0], -1, -1)]
        # original timm, JAX, and deit vit impl
        # pos_embed has entry for class token, concat then add
        x = torch.cat(to_cat + [x], dim=1)
        x = x + pos_embed
        return self.pos_drop(x)

    def forward_features(self, x):
        x = self.patch_embed(x)
        x = self._pos_embed(x)
        x = self.patch_drop(x)
        x = self.norm_pre(x)
        if self.grad_checkpointing and not torch.jit.is_scripting():
            x = checkpoint_seq(self.blocks, x)
        else:
            x = self.blocks(x)
        x = self.norm(x)
        return x

    def forward_head(self, x, pre_logits=False):
        x = x[:, 0]  # global_pool_nlc(pool_type='token')
        x = self.fc_norm(x)
        x = self.head_drop(x)
        return x if pre_logits else self.head(x)

    def forward(self, x):
        x = self.forward_features(x)
        x = self.forward_head(x)
        return x


# -- timm/data/mixup.py -----------------------------------------------------------------------------------
def one_hot(x, num_classes, on_value=1., off_value=0.):
    x = x.long().view(-1, 1)
    return torch.full((x.size()[0], num_classes), off_value, device=x.device).scatter_(1, x, on_value)


def mixup_target(target, num_classes, lam=1., smoothing=0.0):
    off_value = smoothing / num_classes
    on_value = 1. - smoothing + off_value
    y1 = one_hot(target, num_classes, on_value=on_value, off_value=off_value)
    y2 = one_hot(target.flip(0), num_classes, on_value=on_value, off_value=off_value)
    return y1 * lam + y2 * (1. - lam)


def rand_bbox(img_shape, lam, margin=0., count=None):
    ratio = np.sqrt(1 - lam)
    img_h, img_w = img_shape[-2:]
    cut_h, cut_w = int(img_h * ratio), int(img_w * ratio)
    margin_y, margin_x = int(margin * cut_h), int(margin * cut_w)
    cy = np.random.randint(0 + margin_y, img_h - margin_y, size=count)
    cx = np.random.randint(0 + margin_x, img_w - margin_x, size=count)
    yl = np.clip(cy - cut_h // 2, 0, img_h)
    yh = np.clip(cy + cut_h // 2, 0, img_h)
    xl = np.clip(cx - cut_w // 2, 0, img_w)
    xh = np.clip(cx + cut_w // 2, 0, img_w)
    return yl, yh, xl, xh


def cutmix_bbox_and_lam(img_shape, lam, ratio_minmax=None, correct_lam=True, count=None):
    """The source's, without ``rand_bbox_minmax`` (``--cutmix-minmax`` is not set)."""
    assert ratio_minmax is None
    yl, yu, xl, xu = rand_bbox(img_shape, lam, count=count)
    if correct_lam or ratio_minmax is not None:
        bbox_area = (yu - yl) * (xu - xl)
        lam = 1. - bbox_area / float(img_shape[-2] * img_shape[-1])
    return (yl, yu, xl, xu), lam


class Mixup:
    """The source's, in its ``batch`` mode (train.py's default ``--mixup-mode``)."""

    def __init__(self, mixup_alpha=1., cutmix_alpha=0., cutmix_minmax=None, prob=1.0, switch_prob=0.5,
                 mode='batch', correct_lam=True, label_smoothing=0.1, num_classes=1000):
        self.mixup_alpha = mixup_alpha
        self.cutmix_alpha = cutmix_alpha
        self.cutmix_minmax = cutmix_minmax
        self.mix_prob = prob
        self.switch_prob = switch_prob
        self.label_smoothing = label_smoothing
        self.num_classes = num_classes
        self.mode = mode
        self.correct_lam = correct_lam  # correct lambda based on clipped area for cutmix
        self.mixup_enabled = True  # set to false to disable mixing (intended tp be set by train loop)

    def _params_per_batch(self):
        lam = 1.
        use_cutmix = False
        if self.mixup_enabled and np.random.rand() < self.mix_prob:
            if self.mixup_alpha > 0. and self.cutmix_alpha > 0.:
                use_cutmix = np.random.rand() < self.switch_prob
                lam_mix = np.random.beta(self.cutmix_alpha, self.cutmix_alpha) if use_cutmix else \
                    np.random.beta(self.mixup_alpha, self.mixup_alpha)
            elif self.mixup_alpha > 0.:
                lam_mix = np.random.beta(self.mixup_alpha, self.mixup_alpha)
            elif self.cutmix_alpha > 0.:
                use_cutmix = True
                lam_mix = np.random.beta(self.cutmix_alpha, self.cutmix_alpha)
            else:
                assert False, "One of mixup_alpha > 0., cutmix_alpha > 0., cutmix_minmax not None should be true."
            lam = float(lam_mix)
        return lam, use_cutmix

    def _mix_batch(self, x):
        lam, use_cutmix = self._params_per_batch()
        if lam == 1.:
            return 1.
        if use_cutmix:
            (yl, yh, xl, xh), lam = cutmix_bbox_and_lam(
                x.shape, lam, ratio_minmax=self.cutmix_minmax, correct_lam=self.correct_lam)
            x[:, :, yl:yh, xl:xh] = x.flip(0)[:, :, yl:yh, xl:xh]
        else:
            x_flipped = x.flip(0).mul_(1. - lam)
            x.mul_(lam).add_(x_flipped)
        return lam

    def __call__(self, x, target):
        assert len(x) % 2 == 0, 'Batch size should be even when using this'
        assert self.mode == 'batch'
        lam = self._mix_batch(x)
        target = mixup_target(target, self.num_classes, lam, self.label_smoothing)
        return x, target


# -- timm/loss, timm/utils, timm/optim --------------------------------------------------------------------
class SoftTargetCrossEntropy(nn.Module):
    def __init__(self):
        super(SoftTargetCrossEntropy, self).__init__()

    def forward(self, x, target):
        loss = torch.sum(-target * F.log_softmax(x, dim=-1), dim=-1)
        return loss.mean()


def dispatch_clip_grad(parameters, value: float, mode: str = 'norm', norm_type: float = 2.0):
    assert mode == 'norm'
    torch.nn.utils.clip_grad_norm_(parameters, value, norm_type=norm_type)


def param_groups_weight_decay(model, weight_decay=1e-5, no_weight_decay_list=()):
    no_weight_decay_list = set(no_weight_decay_list)
    decay = []
    no_decay = []
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue

        if param.ndim <= 1 or name.endswith(".bias") or name in no_weight_decay_list:
            no_decay.append(param)
        else:
            decay.append(param)

    return [
        {'params': no_decay, 'weight_decay': 0.},
        {'params': decay, 'weight_decay': weight_decay}]


class ModelEmaV3(nn.Module):
    """The source's, with ``device=None`` and ``foreach=True`` (train.py's defaults)."""

    def __init__(self, model, decay=0.9999, min_decay=0.0, update_after_step=0, use_warmup=False, warmup_gamma=1.0,
                 warmup_power=2 / 3, exclude_buffers=False):
        super().__init__()
        # make a copy of the model for accumulating moving average of weights
        self.module = deepcopy(model)
        self.module.eval()
        self.decay = decay
        self.min_decay = min_decay
        self.update_after_step = update_after_step
        self.use_warmup = use_warmup
        self.warmup_gamma = warmup_gamma
        self.warmup_power = warmup_power
        self.exclude_buffers = exclude_buffers

    def get_decay(self, step=None):
        if step is None:
            return self.decay
        step = max(0, step - self.update_after_step - 1)
        if step <= 0:
            return 0.0
        if self.use_warmup:
            decay = 1 - (1 + step / self.warmup_gamma) ** -self.warmup_power
            decay = max(min(decay, self.decay), self.min_decay)
        else:
            decay = self.decay
        return decay

    @torch.no_grad()
    def update(self, model, step=None):
        decay = self.get_decay(step)
        assert not self.exclude_buffers
        self.apply_update_(model, decay)

    def apply_update_(self, model, decay):
        # interpolate parameters and buffers
        ema_lerp_values = []
        model_lerp_values = []
        for ema_v, model_v in zip(self.module.state_dict().values(), model.state_dict().values()):
            if ema_v.is_floating_point():
                ema_lerp_values.append(ema_v)
                model_lerp_values.append(model_v)
            else:
                ema_v.copy_(model_v)
        if hasattr(torch, '_foreach_lerp_'):
            torch._foreach_lerp_(ema_lerp_values, model_lerp_values, weight=1. - decay)
        else:
            torch._foreach_mul_(ema_lerp_values, scalar=decay)
            torch._foreach_add_(ema_lerp_values, model_lerp_values, alpha=1. - decay)


# -- train.py ----------------------------------------------------------------------------------------------
def vit():
    model = VisionTransformer()
    model.set_grad_checkpointing(enable=True)  # --grad-checkpointing
    return model


def make_optimizer(model):
    """create_optimizer_v2(model, 'adamw', lr, weight_decay): the no-decay group first, as the source's."""
    return torch.optim.AdamW(param_groups_weight_decay(model, WD, model.no_weight_decay()), lr=LR, weight_decay=WD)


def mixup_fn_():
    return Mixup(mixup_alpha=0.8, cutmix_alpha=1.0, cutmix_minmax=None, prob=1.0, switch_prob=0.5, mode='batch',
                 label_smoothing=0.1, num_classes=CLASSES)


loss_fn = SoftTargetCrossEntropy()


def timm_hand(model, data):
    """main()'s EMA and optimizer, then ``train_one_epoch`` with ``accum_steps`` 1 and no loss scaler."""
    model_ema = ModelEmaV3(model, decay=EMA_DECAY)
    optimizer = make_optimizer(model)
    mixup_fn = mixup_fn_()
    second_order = hasattr(optimizer, 'is_second_order') and optimizer.is_second_order
    num_updates = 0
    model.train()
    optimizer.zero_grad()
    for batch_idx, (input, target) in enumerate(data.batches):
        input, target = mixup_fn(input, target)
        output = model(input)
        loss = loss_fn(output, target)
        loss.backward(create_graph=second_order)
        dispatch_clip_grad(model.parameters(), value=CLIP, mode='norm')
        optimizer.step()
        num_updates += 1
        optimizer.zero_grad()
        model_ema.update(model, step=num_updates)
    data.ema = model_ema


class TimmTrainer(Trainer):
    def configure_optimizers(self):
        self.model_ema = ModelEmaV3(self.model, decay=EMA_DECAY)
        self.mixup_fn = mixup_fn_()
        return make_optimizer(self.model)

    def training_step(self, batch):
        input, target = self.mixup_fn(*batch)
        return loss_fn(self.model(input), target)

    def on_step_end(self, losses):
        self.model_ema.update(self.model, step=self.state.step)

    def on_fit_end(self):
        self.train_data.ema = self.model_ema


class ImageNet:
    """Fresh batches for each run (Mixup mixes them in place); NumPy's global RNG seeded for Mixup."""

    def __init__(self):
        np.random.seed(SEED)
        gen = torch.Generator().manual_seed(13)
        self.batches = [(torch.randn(BATCH, 3, IMG, IMG, generator=gen),
                         torch.randint(CLASSES, (BATCH,), generator=gen)) for _ in range(STEPS)]

    def __iter__(self):
        return iter(self.batches)


@pytest.mark.parametrize("reentrant", [False, True], ids=["non_reentrant", "reentrant"])
@pytest.mark.parametrize("check", checks())
def test_vit_with_checkpointed_blocks_mixup_and_an_ema(check, reentrant):
    set_reentrant_ckpt(reentrant)
    runs = []

    def data(model):
        runs.append(ImageNet())
        return runs[-1]
    try:
        compare(vit, timm_hand, TimmTrainer, data, check, steps=STEPS, grad_clip=CLIP)
    finally:
        set_reentrant_ckpt(False)
    hand, watched, port = (run.ema.module for run in runs)
    assert_same(watched, hand)
    assert_same(port, hand)


def test_mixup_and_cutmix_both_drawn():
    """Over the run's batches NumPy's draws pick Mixup and CutMix both (else the case proves less)."""
    data, mixup_fn, picks = ImageNet(), mixup_fn_(), []
    draw = mixup_fn._params_per_batch
    mixup_fn._params_per_batch = lambda: picks.append(draw()) or picks[-1]
    for input, target in data:
        mixup_fn(input, target)
    assert sorted(use_cutmix for _, use_cutmix in picks) == [False] * 2 + [True] * 4
