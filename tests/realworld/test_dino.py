"""Self-distillation with no labels (DINO): facebookresearch/dino at commit
7c446df5b9f45747937fb0d72314eb9f7b66930a, main_dino.py (``train_dino``, ``train_one_epoch``, ``DINOLoss``),
utils.py (``clip_gradients``, ``cancel_gradients_last_layer``, ``cosine_scheduler``, ``get_params_groups``,
``MultiCropWrapper``) and vision_transformer.py (``DINOHead``).

A student and a teacher ``MultiCropWrapper`` (one backbone forward per crop resolution, outputs concatenated,
then the head), the teacher loaded from the student's state dict with ``requires_grad`` off and run *without*
``no_grad``; ``DINOHead``'s last layer a hook-based ``weight_norm`` whose ``weight_g`` is frozen
(``norm_last_layer``). ``DINOLoss`` centres and sharpens the teacher's output with an epoch-scheduled
temperature, detaches it, sums the cross-entropies over every (teacher view, other student view) pair
(``total_loss +=``), then replaces its ``center`` buffer (``self.center = ...`` under ``no_grad``). Per
iteration: ``param_group["lr"]`` and the first group's ``weight_decay`` assigned from NumPy cosine schedules,
``loss.item()`` checked, per-parameter clipping in place through ``p.grad.data.mul_``, the last layer's
gradients dropped (``p.grad = None``) during the first ``freeze_last_layer`` epochs, AdamW in two groups (no
decay on biases and 1-d tensors), then the teacher's EMA through ``param_k.data.mul_(m).add_(...)``.

Changes for a seconds-long test: a two-convolution backbone with global pooling (a ViT), a head of 16-8-16
(2048-256-65536), 2 global 8x8 crops and 2 local 4x4 crops of 4 random images (224 and 96), 2 epochs of 3
batches; single process: no DDP, ``dist.all_reduce`` of the centre dropped (world size 1); ``--use_fp16`` (the
second test) as ``torch.autocast("cpu", dtype=torch.float16)`` and ``torch.amp.GradScaler("cpu")``.

The port is automatic: the schedules assigned in ``training_step``, ``clip_gradients`` and
``cancel_gradients_last_layer`` in ``on_before_optimizer_step``, the EMA in ``on_step_end``.
"""
import math
import re
import warnings

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from safeloop import Trainer

from .harness import checks, compare

OUT_DIM, LOCAL_CROPS, EPOCHS, PER_EPOCH, BATCH = 16, 2, 2, 3, 4
LR, MIN_LR, WARMUP_EPOCHS, WD, WD_END, MOMENTUM_TEACHER, CLIP_GRAD, FREEZE_LAST_LAYER = (
    5e-3, 1e-5, 1, 0.04, 0.4, 0.996, 0.3, 1)
WARMUP_TEACHER_TEMP, TEACHER_TEMP, WARMUP_TEACHER_TEMP_EPOCHS = 0.04, 0.04, 1


# -- utils.py -----------------------------------------------------------------------------------------------
def clip_gradients(model, clip):
    norms = []
    for name, p in model.named_parameters():
        if p.grad is not None:
            param_norm = p.grad.data.norm(2)
            norms.append(param_norm.item())
            clip_coef = clip / (param_norm + 1e-6)
            if clip_coef < 1:
                p.grad.data.mul_(clip_coef)
    return norms


def cancel_gradients_last_layer(epoch, model, freeze_last_layer):
    if epoch >= freeze_last_layer:
        return
    for n, p in model.named_parameters():
        if "last_layer" in n:
            p.grad = None


def cosine_scheduler(base_value, final_value, epochs, niter_per_ep, warmup_epochs=0, start_warmup_value=0):
    warmup_schedule = np.array([])
    warmup_iters = warmup_epochs * niter_per_ep
    if warmup_epochs > 0:
        warmup_schedule = np.linspace(start_warmup_value, base_value, warmup_iters)

    iters = np.arange(epochs * niter_per_ep - warmup_iters)
    schedule = final_value + 0.5 * (base_value - final_value) * (1 + np.cos(np.pi * iters / len(iters)))

    schedule = np.concatenate((warmup_schedule, schedule))
    assert len(schedule) == epochs * niter_per_ep
    return schedule


class MultiCropWrapper(nn.Module):
    def __init__(self, backbone, head):
        super(MultiCropWrapper, self).__init__()
        # disable layers dedicated to ImageNet labels classification
        backbone.fc, backbone.head = nn.Identity(), nn.Identity()
        self.backbone = backbone
        self.head = head

    def forward(self, x):
        # convert to list
        if not isinstance(x, list):
            x = [x]
        idx_crops = torch.cumsum(torch.unique_consecutive(
            torch.tensor([inp.shape[-1] for inp in x]),
            return_counts=True,
        )[1], 0)
        start_idx, output = 0, torch.empty(0).to(x[0].device)
        for end_idx in idx_crops:
            _out = self.backbone(torch.cat(x[start_idx: end_idx]))
            if isinstance(_out, tuple):
                _out = _out[0]
            # accumulate outputs
            output = torch.cat((output, _out))
            start_idx = end_idx
        # Run the head forward on the concatenated features.
        return self.head(output)


def get_params_groups(model):
    regularized = []
    not_regularized = []
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        # we do not regularize biases nor Norm parameters
        if name.endswith(".bias") or len(param.shape) == 1:
            not_regularized.append(param)
        else:
            regularized.append(param)
    return [{'params': regularized}, {'params': not_regularized, 'weight_decay': 0.}]


# -- vision_transformer.py ----------------------------------------------------------------------------------
class DINOHead(nn.Module):
    def __init__(self, in_dim, out_dim, use_bn=False, norm_last_layer=True, nlayers=3, hidden_dim=16,
                 bottleneck_dim=8):
        super().__init__()
        nlayers = max(nlayers, 1)
        if nlayers == 1:
            self.mlp = nn.Linear(in_dim, bottleneck_dim)
        else:
            layers = [nn.Linear(in_dim, hidden_dim)]
            if use_bn:
                layers.append(nn.BatchNorm1d(hidden_dim))
            layers.append(nn.GELU())
            for _ in range(nlayers - 2):
                layers.append(nn.Linear(hidden_dim, hidden_dim))
                if use_bn:
                    layers.append(nn.BatchNorm1d(hidden_dim))
                layers.append(nn.GELU())
            layers.append(nn.Linear(hidden_dim, bottleneck_dim))
            self.mlp = nn.Sequential(*layers)
        self.apply(self._init_weights)
        self.last_layer = nn.utils.weight_norm(nn.Linear(bottleneck_dim, out_dim, bias=False))
        self.last_layer.weight_g.data.fill_(1)
        if norm_last_layer:
            self.last_layer.weight_g.requires_grad = False

    def _init_weights(self, m):
        if isinstance(m, nn.Linear):
            nn.init.trunc_normal_(m.weight, std=.02)
            if isinstance(m, nn.Linear) and m.bias is not None:
                nn.init.constant_(m.bias, 0)

    def forward(self, x):
        x = self.mlp(x)
        x = nn.functional.normalize(x, dim=-1, p=2)
        x = self.last_layer(x)
        return x


# -- main_dino.py -------------------------------------------------------------------------------------------
class DINOLoss(nn.Module):
    def __init__(self, out_dim, ncrops, warmup_teacher_temp, teacher_temp,
                 warmup_teacher_temp_epochs, nepochs, student_temp=0.1,
                 center_momentum=0.9):
        super().__init__()
        self.student_temp = student_temp
        self.center_momentum = center_momentum
        self.ncrops = ncrops
        self.register_buffer("center", torch.zeros(1, out_dim))
        self.teacher_temp_schedule = np.concatenate((
            np.linspace(warmup_teacher_temp,
                        teacher_temp, warmup_teacher_temp_epochs),
            np.ones(nepochs - warmup_teacher_temp_epochs) * teacher_temp
        ))

    def forward(self, student_output, teacher_output, epoch):
        student_out = student_output / self.student_temp
        student_out = student_out.chunk(self.ncrops)

        temp = self.teacher_temp_schedule[epoch]
        teacher_out = F.softmax((teacher_output - self.center) / temp, dim=-1)
        teacher_out = teacher_out.detach().chunk(2)

        total_loss = 0
        n_loss_terms = 0
        for iq, q in enumerate(teacher_out):
            for v in range(len(student_out)):
                if v == iq:
                    continue
                loss = torch.sum(-q * F.log_softmax(student_out[v], dim=-1), dim=-1)
                total_loss += loss.mean()
                n_loss_terms += 1
        total_loss /= n_loss_terms
        self.update_center(teacher_output)
        return total_loss

    @torch.no_grad()
    def update_center(self, teacher_output):
        batch_center = torch.sum(teacher_output, dim=0, keepdim=True)
        batch_center = batch_center / len(teacher_output)

        self.center = self.center * self.center_momentum + batch_center * (1 - self.center_momentum)


def backbone():
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.GELU(), nn.Conv2d(8, 8, 3, padding=1), nn.GELU(),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten())


def make_dino():
    student = MultiCropWrapper(backbone(), DINOHead(8, OUT_DIM))
    teacher = MultiCropWrapper(backbone(), DINOHead(8, OUT_DIM))
    teacher.load_state_dict(student.state_dict())
    for p in teacher.parameters():
        p.requires_grad = False
    dino_loss = DINOLoss(OUT_DIM, LOCAL_CROPS + 2, WARMUP_TEACHER_TEMP, TEACHER_TEMP, WARMUP_TEACHER_TEMP_EPOCHS,
                         EPOCHS)
    return nn.ModuleDict({'student': student, 'teacher': teacher, 'dino_loss': dino_loss})


def make_optimizer(student):
    return torch.optim.AdamW(get_params_groups(student))


def schedules(niter_per_ep):
    lr_schedule = cosine_scheduler(LR * BATCH / 256., MIN_LR, EPOCHS, niter_per_ep, warmup_epochs=WARMUP_EPOCHS)
    wd_schedule = cosine_scheduler(WD, WD_END, EPOCHS, niter_per_ep)
    momentum_schedule = cosine_scheduler(MOMENTUM_TEACHER, 1, EPOCHS, niter_per_ep)
    return lr_schedule, wd_schedule, momentum_schedule


def train_one_epoch(student, teacher, teacher_without_ddp, dino_loss, data_loader,
                    optimizer, lr_schedule, wd_schedule, momentum_schedule, epoch, fp16_scaler=None):
    for it, (images, _) in enumerate(data_loader):
        it = len(data_loader) * epoch + it  # global training iteration
        for i, param_group in enumerate(optimizer.param_groups):
            param_group["lr"] = lr_schedule[it]
            if i == 0:  # only the first group is regularized
                param_group["weight_decay"] = wd_schedule[it]

        with torch.autocast("cpu", dtype=torch.float16, enabled=fp16_scaler is not None):
            teacher_output = teacher(images[:2])  # only the 2 global views pass through the teacher
            student_output = student(images)
            loss = dino_loss(student_output, teacher_output, epoch)

        if not math.isfinite(loss.item()):
            raise SystemExit(1)

        optimizer.zero_grad()
        if fp16_scaler is None:
            loss.backward()
            clip_gradients(student, CLIP_GRAD)
            cancel_gradients_last_layer(epoch, student, FREEZE_LAST_LAYER)
            optimizer.step()
        else:
            fp16_scaler.scale(loss).backward()
            fp16_scaler.unscale_(optimizer)  # unscale the gradients of optimizer's assigned params in-place
            clip_gradients(student, CLIP_GRAD)
            cancel_gradients_last_layer(epoch, student, FREEZE_LAST_LAYER)
            fp16_scaler.step(optimizer)
            fp16_scaler.update()

        with torch.no_grad():
            m = momentum_schedule[it]  # momentum parameter
            for param_q, param_k in zip(student.parameters(), teacher_without_ddp.parameters()):
                param_k.data.mul_(m).add_((1 - m) * param_q.detach().data)


def dino_hand(nets, data_loader, use_fp16=False):
    student, teacher, dino_loss = nets['student'], nets['teacher'], nets['dino_loss']
    optimizer = make_optimizer(student)
    fp16_scaler = None
    if use_fp16:
        fp16_scaler = torch.amp.GradScaler("cpu")  # torch.cuda.amp.GradScaler()
    lr_schedule, wd_schedule, momentum_schedule = schedules(len(data_loader))
    for epoch in range(EPOCHS):
        train_one_epoch(student, teacher, teacher, dino_loss, data_loader, optimizer, lr_schedule,
                        wd_schedule, momentum_schedule, epoch, fp16_scaler)


def dino_fp16_hand(nets, data_loader):
    dino_hand(nets, data_loader, use_fp16=True)


class DINOTrainer(Trainer):
    def configure_optimizers(self):
        self.lr_schedule, self.wd_schedule, self.momentum_schedule = schedules(len(self.train_data))
        self.it = -1
        self.dino_optimizer = make_optimizer(self.model['student'])
        return self.dino_optimizer

    def training_step(self, batch):
        images, _ = batch
        nets, epoch = self.model, self.state.epoch
        self.it += 1
        for i, param_group in enumerate(self.dino_optimizer.param_groups):
            param_group["lr"] = self.lr_schedule[self.it]
            if i == 0:
                param_group["weight_decay"] = self.wd_schedule[self.it]
        teacher_output = nets['teacher'](images[:2])
        student_output = nets['student'](images)
        loss = nets['dino_loss'](student_output, teacher_output, epoch)
        if not math.isfinite(loss.item()):
            raise SystemExit(1)
        return loss

    def on_before_optimizer_step(self, *args):
        clip_gradients(self.model['student'], CLIP_GRAD)
        cancel_gradients_last_layer(self.state.epoch, self.model['student'], FREEZE_LAST_LAYER)

    def on_step_end(self, *args):
        with torch.no_grad():
            m = self.momentum_schedule[self.it]
            for param_q, param_k in zip(self.model['student'].parameters(), self.model['teacher'].parameters()):
                param_k.data.mul_(m).add_((1 - m) * param_q.detach().data)


def crops():
    gen = torch.Generator().manual_seed(5)
    return [([torch.randn(BATCH, 3, 8, 8, generator=gen) for _ in range(2)]
             + [torch.randn(BATCH, 3, 4, 4, generator=gen) for _ in range(LOCAL_CROPS)], torch.zeros(BATCH))
            for _ in range(PER_EPOCH)]


@pytest.mark.parametrize("check", checks())
def test_dino_with_a_centred_teacher_and_last_layer_gradients_dropped(check):
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=re.escape("`torch.nn.utils.weight_norm` is deprecated"))
        compare(make_dino, dino_hand, DINOTrainer, lambda nets: crops(), check, steps=EPOCHS * PER_EPOCH,
                max_epochs=EPOCHS, rebuild=True)


@pytest.mark.parametrize("check", checks())
def test_dino_in_float16_with_the_gradients_unscaled_before_they_are_dropped(check):
    """``--use_fp16``: a GradScaler, ``unscale_`` before the clipping and the dropping (the port: ``precision="16"``,
    whose unscale comes before ``on_before_optimizer_step``)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=re.escape("`torch.nn.utils.weight_norm` is deprecated"))
        compare(make_dino, dino_fp16_hand, DINOTrainer, lambda nets: crops(), check,
                steps=EPOCHS * PER_EPOCH, max_epochs=EPOCHS, precision="16", rebuild=True)
