"""DeiT's hard distillation through a distillation token: facebookresearch/deit at commit 7e160fe, losses.py
(``DistillationLoss``), engine.py (``train_one_epoch``), models.py (``DistilledVisionTransformer``) and main.py
(the optimizer, the scheduler, the teacher and the epoch loop), with timm's pieces it calls:
timm/loss/cross_entropy.py (``LabelSmoothingCrossEntropy``), timm/utils/model_ema.py (``ModelEma``),
timm/utils/cuda.py (``NativeScaler``), timm/optim/optim_factory.py (``add_weight_decay``, ``create_optimizer``
for ``adamw``) and timm/scheduler (``create_scheduler`` for ``cosine``: ``CosineLRScheduler``, shared with
test_schedulers_real).

- The student returns two predictions in training mode, the class token's head and the distillation token's
  (``head_dist``), and their mean in eval mode. ``DistillationLoss`` runs a teacher (in eval mode, its
  parameters requiring grad, never in an optimizer) under ``no_grad`` inside the loss, and trains the
  distillation head on the teacher's ``argmax``: ``base * (1 - alpha) + hard * alpha``, the base loss with
  label smoothing.
- AdamW in two groups (no decay on 1-d parameters, biases and ``no_weight_decay()``'s tokens); the loss checked
  with ``math.isfinite`` (``sys.exit`` otherwise); ``ModelEma.update`` after each step (``ema_v.copy_`` of every
  ``state_dict`` entry under ``no_grad``); timm's cosine schedule with warm-up stepped by epoch as
  ``lr_scheduler.step(epoch)`` after epoch ``epoch``, so that each epoch's rate is set for it one epoch late;
  each epoch ends with an evaluation of the student (the averaged heads).

Changes for a seconds-long test: the student a 2-block ViT (timm's ``Block`` and ``PatchEmbed`` of
test_timm_vit) of width 16 over 4x4 patches of 8x8 images, 3 classes; the teacher a small conv net (RegNetY-16GF,
loaded from a checkpoint) made from its own seed; 3 epochs of 3 batches of 4, 1 warm-up epoch; no Mixup/CutMix
(``--mixup 0 --cutmix 0``, so the base loss is ``LabelSmoothingCrossEntropy``), no AMP: ``NativeScaler``'s
``GradScaler`` made disabled and the ``torch.cuda.amp.autocast()`` region left out (both are off without CUDA),
no clipping (``--clip-grad`` None: ``dispatch_clip_grad`` unused), the EMA on the model's device; the ``cosub`` and
``bce_loss`` options (off) left out; no distributed run, logging or checkpoints.

The port: ``training_step`` returns the ``DistillationLoss``; ``on_nonfinite="error"`` for the exit;
``on_step_end`` updates the EMA, ``on_epoch_end`` steps the timm scheduler with the epoch and evaluates.
"""
import math
import sys
from copy import deepcopy
from functools import partial

import pytest
import torch
import torch.nn as nn
from torch.nn import functional as F

from safeloop import Trainer

from .harness import assert_same, checks, compare_runs
from .test_schedulers_real import CosineLRScheduler
from .test_timm_vit import Block, PatchEmbed

IMG, PATCH, DIM, DEPTH, HEADS, CLASSES, BATCH, EPOCHS, BATCHES = 8, 4, 16, 2, 2, 3, 4, 3, 3
LR, WEIGHT_DECAY, SMOOTHING, EMA_DECAY = 5e-4 * BATCH / 512.0 * 100, 0.05, 0.1, 0.9
WARMUP_EPOCHS, WARMUP_LR, MIN_LR, ALPHA, TAU = 1, 1e-6, 1e-5, 0.5, 1.0


# -- deit/losses.py -----------------------------------------------------------------------------------------
class DistillationLoss(torch.nn.Module):
    """
    This module wraps a standard criterion and adds an extra knowledge distillation loss by
    taking a teacher model prediction and using it as additional supervision.
    """
    def __init__(self, base_criterion: torch.nn.Module, teacher_model: torch.nn.Module,
                 distillation_type: str, alpha: float, tau: float):
        super().__init__()
        self.base_criterion = base_criterion
        self.teacher_model = teacher_model
        assert distillation_type in ['none', 'soft', 'hard']
        self.distillation_type = distillation_type
        self.alpha = alpha
        self.tau = tau

    def forward(self, inputs, outputs, labels):
        outputs_kd = None
        if not isinstance(outputs, torch.Tensor):
            # assume that the model outputs a tuple of [outputs, outputs_kd]
            outputs, outputs_kd = outputs
        base_loss = self.base_criterion(outputs, labels)
        if self.distillation_type == 'none':
            return base_loss

        if outputs_kd is None:
            raise ValueError("When knowledge distillation is enabled, the model is "
                             "expected to return a Tuple[Tensor, Tensor] with the output of the "
                             "class_token and the dist_token")
        # don't backprop throught the teacher
        with torch.no_grad():
            teacher_outputs = self.teacher_model(inputs)

        if self.distillation_type == 'soft':
            T = self.tau
            distillation_loss = F.kl_div(
                F.log_softmax(outputs_kd / T, dim=1),
                F.log_softmax(teacher_outputs / T, dim=1),
                reduction='sum',
                log_target=True
            ) * (T * T) / outputs_kd.numel()
        elif self.distillation_type == 'hard':
            distillation_loss = F.cross_entropy(outputs_kd, teacher_outputs.argmax(dim=1))

        loss = base_loss * (1 - self.alpha) + distillation_loss * self.alpha
        return loss


# -- deit/models.py (the base VisionTransformer: timm's, for the arguments used) ----------------------------
class DistilledVisionTransformer(nn.Module):
    def __init__(self, img_size=IMG, patch_size=PATCH, num_classes=CLASSES, embed_dim=DIM, depth=DEPTH,
                 num_heads=HEADS, mlp_ratio=4, qkv_bias=True, drop_rate=0.1):
        super().__init__()
        norm_layer = partial(nn.LayerNorm, eps=1e-6)
        self.embed_dim, self.num_classes = embed_dim, num_classes
        self.patch_embed = PatchEmbed(patch_size, 3, embed_dim)
        num_patches = (img_size // patch_size) ** 2
        self.cls_token = nn.Parameter(torch.zeros(1, 1, embed_dim))
        self.pos_drop = nn.Dropout(p=drop_rate)
        self.blocks = nn.ModuleList([Block(embed_dim, num_heads, mlp_ratio, qkv_bias=qkv_bias, proj_drop=drop_rate,
                                           norm_layer=norm_layer) for _ in range(depth)])
        self.norm = norm_layer(embed_dim)
        self.head = nn.Linear(embed_dim, num_classes)
        nn.init.trunc_normal_(self.cls_token, std=.02)
        # DistilledVisionTransformer.__init__ after VisionTransformer's
        self.dist_token = nn.Parameter(torch.zeros(1, 1, self.embed_dim))
        self.pos_embed = nn.Parameter(torch.zeros(1, num_patches + 2, self.embed_dim))
        self.head_dist = nn.Linear(self.embed_dim, self.num_classes) if self.num_classes > 0 else nn.Identity()

        nn.init.trunc_normal_(self.dist_token, std=.02)
        nn.init.trunc_normal_(self.pos_embed, std=.02)

    def no_weight_decay(self):
        return {'pos_embed', 'cls_token', 'dist_token'}

    def forward_features(self, x):
        # taken from https://github.com/rwightman/pytorch-image-models/blob/master/timm/models/vision_transformer.py
        # with slight modifications to add the dist_token
        B = x.shape[0]
        x = self.patch_embed(x)

        cls_tokens = self.cls_token.expand(B, -1, -1)  # stole cls_tokens impl from Phil Wang, thanks
        dist_token = self.dist_token.expand(B, -1, -1)
        x = torch.cat((cls_tokens, dist_token, x), dim=1)

        x = x + self.pos_embed
        x = self.pos_drop(x)

        for blk in self.blocks:
            x = blk(x)

        x = self.norm(x)
        return x[:, 0], x[:, 1]

    def forward(self, x):
        x, x_dist = self.forward_features(x)
        x = self.head(x)
        x_dist = self.head_dist(x_dist)
        if self.training:
            return x, x_dist
        else:
            # during inference, return the average of both classifier predictions
            return (x + x_dist) / 2


def make_teacher():
    """The teacher, trained elsewhere: built from its own seed, the global generator left as it was."""
    with torch.random.fork_rng():
        torch.manual_seed(7)
        teacher_model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                                      nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, CLASSES))
    teacher_model.eval()
    return teacher_model


# -- timm --------------------------------------------------------------------------------------------------
class LabelSmoothingCrossEntropy(nn.Module):
    def __init__(self, smoothing=0.1):
        super(LabelSmoothingCrossEntropy, self).__init__()
        assert smoothing < 1.0
        self.smoothing = smoothing
        self.confidence = 1. - smoothing

    def forward(self, x, target):
        logprobs = F.log_softmax(x, dim=-1)
        nll_loss = -logprobs.gather(dim=-1, index=target.unsqueeze(1))
        nll_loss = nll_loss.squeeze(1)
        smooth_loss = -logprobs.mean(dim=-1)
        loss = self.confidence * nll_loss + self.smoothing * smooth_loss
        return loss.mean()


class ModelEma:
    def __init__(self, model, decay=0.9999, device='', resume=''):
        # make a copy of the model for accumulating moving average of weights
        self.ema = deepcopy(model)
        self.ema.eval()
        self.decay = decay
        self.device = device  # perform ema on different device from model if set
        if device:
            self.ema.to(device=device)
        self.ema_has_module = hasattr(self.ema, 'module')
        for p in self.ema.parameters():
            p.requires_grad_(False)

    def update(self, model):
        # correct a mismatch in state dict keys
        needs_module = hasattr(model, 'module') and not self.ema_has_module
        with torch.no_grad():
            msd = model.state_dict()
            for k, ema_v in self.ema.state_dict().items():
                if needs_module:
                    k = 'module.' + k
                model_v = msd[k].detach()
                if self.device:
                    model_v = model_v.to(device=self.device)
                ema_v.copy_(ema_v * self.decay + (1. - self.decay) * model_v)


class NativeScaler:
    state_dict_key = "amp_scaler"

    def __init__(self):
        self._scaler = torch.amp.GradScaler("cpu", enabled=False)

    def __call__(self, loss, optimizer, clip_grad=None, clip_mode='norm', parameters=None, create_graph=False):
        self._scaler.scale(loss).backward(create_graph=create_graph)
        if clip_grad is not None:
            assert parameters is not None
            self._scaler.unscale_(optimizer)  # unscale the gradients of optimizer's assigned params in-place
            torch.nn.utils.clip_grad_norm_(parameters, clip_grad)
        self._scaler.step(optimizer)
        self._scaler.update()


def add_weight_decay(model, weight_decay=1e-5, skip_list=()):
    decay = []
    no_decay = []
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue  # frozen weights
        if len(param.shape) == 1 or name.endswith(".bias") or name in skip_list:
            no_decay.append(param)
        else:
            decay.append(param)
    return [
        {'params': no_decay, 'weight_decay': 0.},
        {'params': decay, 'weight_decay': weight_decay}]


def create_optimizer(model):
    """``create_optimizer(args, model)`` for ``--opt adamw``."""
    skip = model.no_weight_decay()
    parameters = add_weight_decay(model, WEIGHT_DECAY, skip)
    return torch.optim.AdamW(parameters, lr=LR, eps=1e-8, weight_decay=0.)


def create_scheduler(optimizer):
    """``create_scheduler(args, optimizer)`` for ``--sched cosine``."""
    return CosineLRScheduler(optimizer, t_initial=EPOCHS, lr_min=MIN_LR, warmup_lr_init=WARMUP_LR,
                             warmup_t=WARMUP_EPOCHS, cycle_limit=1, t_in_epochs=True)


# -- deit/engine.py, main.py --------------------------------------------------------------------------------
def train_one_epoch(model, criterion, data_loader, optimizer, device, epoch, loss_scaler, max_norm=0,
                    model_ema=None, mixup_fn=None, set_training_mode=True):
    model.train(set_training_mode)
    for samples, targets in data_loader:
        samples = samples.to(device, non_blocking=True)
        targets = targets.to(device, non_blocking=True)

        if mixup_fn is not None:
            samples, targets = mixup_fn(samples, targets)

        outputs = model(samples)
        loss = criterion(samples, outputs, targets)

        loss_value = loss.item()

        if not math.isfinite(loss_value):
            print("Loss is {}, stopping training".format(loss_value))
            sys.exit(1)

        optimizer.zero_grad()

        # this attribute is added by timm on one optimizer (adahessian)
        is_second_order = hasattr(optimizer, 'is_second_order') and optimizer.is_second_order
        loss_scaler(loss, optimizer, clip_grad=max_norm,
                    parameters=model.parameters(), create_graph=is_second_order)

        if model_ema is not None:
            model_ema.update(model)


@torch.no_grad()
def evaluate(data_loader, model, device):
    criterion = torch.nn.CrossEntropyLoss()
    model.eval()
    total = 0.0
    for images, target in data_loader:
        output = model(images.to(device, non_blocking=True))
        total += criterion(output, target.to(device, non_blocking=True)).item()
    return total


def make_criterion():
    return DistillationLoss(LabelSmoothingCrossEntropy(smoothing=SMOOTHING), make_teacher(), 'hard', ALPHA, TAU)


def deit_hand(model, data_loader_train):
    device = torch.device("cpu")
    model_ema = ModelEma(model, decay=EMA_DECAY, device='', resume='')
    optimizer = create_optimizer(model)
    loss_scaler = NativeScaler()
    lr_scheduler = create_scheduler(optimizer)
    criterion = make_criterion()
    for epoch in range(0, EPOCHS):
        train_one_epoch(model, criterion, data_loader_train, optimizer, device, epoch, loss_scaler,
                        None, model_ema, None, set_training_mode=True)
        lr_scheduler.step(epoch)
        evaluate(data_loader_train, model, device)
    data_loader_train.model_ema = model_ema


class DeiTTrainer(Trainer):
    def configure_optimizers(self):
        self.model_ema = ModelEma(self.model, decay=EMA_DECAY, device='', resume='')
        optimizer = create_optimizer(self.model)
        self.lr_scheduler = create_scheduler(optimizer)
        self.criterion = make_criterion()
        return optimizer

    def training_step(self, batch):
        samples, targets = batch
        return self.criterion(samples, self.model(samples), targets)

    def on_step_end(self, losses):
        self.model_ema.update(self.model)

    def on_epoch_end(self):
        self.lr_scheduler.step(self.state.epoch)
        evaluate(self.train_data, self.model, torch.device("cpu"))
        self.model.train()

    def on_fit_end(self):
        self.train_data.model_ema = self.model_ema


class Loader(list):
    """The batches, and the EMA model the run leaves on them."""


def images():
    gen = torch.Generator().manual_seed(4)
    return Loader((torch.randn(BATCH, 3, IMG, IMG, generator=gen), torch.randint(CLASSES, (BATCH,), generator=gen))
                  for _ in range(BATCHES))


@pytest.mark.parametrize("check", checks())
def test_deit_hard_distillation_with_a_frozen_teacher_in_the_loss_and_an_ema(check):
    hand, watched, port = compare_runs(DistilledVisionTransformer, deit_hand, DeiTTrainer, images, check,
                                       steps=EPOCHS * BATCHES, on_nonfinite="error")
    assert_same(watched.model_ema.ema, hand.model_ema.ema)
    assert_same(port.model_ema.ema, hand.model_ema.ema)
    assert hand.model_ema.ema.head_dist.weight.grad is None
