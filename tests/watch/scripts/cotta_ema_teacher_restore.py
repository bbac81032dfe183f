# CoTTA (qinenergy/cotta, cifar/cotta.py): continual test-time adaptation. The student trains on each test batch
# (called under robustbench's torch.no_grad(); `@torch.enable_grad()` on forward_and_adapt) against an EMA teacher's
# predictions, averaged over augmentations when the source model (the anchor) is unsure; the teacher is a deep copy
# whose parameters are `detach_()`ed, updated through `.data` after each step; then each weight is restored to its
# source value with probability rst (`p.data = ...` under torch.no_grad()). get_tta_transforms' torchvision
# augmentations are replaced by a random flip and Gaussian noise.
from copy import deepcopy

import torch
import torch.jit
import torch.nn as nn


def tta_transform(x):
    x = torch.where(torch.rand(x.size(0), 1, 1, 1) < 0.5, x.flip(3), x)
    return (x + 0.005 * torch.randn_like(x)).clamp(0.0, 1.0)


def update_ema_variables(ema_model, model, alpha_teacher):
    for ema_param, param in zip(ema_model.parameters(), model.parameters()):
        ema_param.data[:] = alpha_teacher * ema_param[:].data[:] + (1 - alpha_teacher) * param[:].data[:]
    return ema_model


@torch.jit.script
def softmax_entropy(x, x_ema):
    return -(x_ema.softmax(1) * x.log_softmax(1)).sum(1)


def copy_model_and_optimizer(model, optimizer):
    model_state = deepcopy(model.state_dict())
    model_anchor = deepcopy(model)
    optimizer_state = deepcopy(optimizer.state_dict())
    ema_model = deepcopy(model)
    for param in ema_model.parameters():
        param.detach_()
    return model_state, optimizer_state, ema_model, model_anchor


class CoTTA(nn.Module):
    def __init__(self, model, optimizer, steps=1, mt_alpha=0.99, rst_m=0.1, ap=0.9):
        super().__init__()
        self.model, self.optimizer, self.steps = model, optimizer, steps
        self.model_state, self.optimizer_state, self.model_ema, self.model_anchor = \
            copy_model_and_optimizer(self.model, self.optimizer)
        self.transform = tta_transform
        self.mt, self.rst, self.ap = mt_alpha, rst_m, ap

    def forward(self, x):
        for _ in range(self.steps):
            outputs = self.forward_and_adapt(x, self.model, self.optimizer)
        return outputs

    @torch.enable_grad()  # ensure grads in possible no grad context for testing
    def forward_and_adapt(self, x, model, optimizer):
        outputs = self.model(x)
        anchor_prob = torch.nn.functional.softmax(self.model_anchor(x), dim=1).max(1)[0]
        standard_ema = self.model_ema(x)
        N = 4
        outputs_emas = []
        for i in range(N):
            outputs_ = self.model_ema(self.transform(x)).detach()
            outputs_emas.append(outputs_)
        if anchor_prob.mean(0) < self.ap:
            outputs_ema = torch.stack(outputs_emas).mean(0)
        else:
            outputs_ema = standard_ema
        loss = (softmax_entropy(outputs, outputs_ema)).mean(0)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        self.model_ema = update_ema_variables(ema_model=self.model_ema, model=self.model, alpha_teacher=self.mt)
        for nm, m in self.model.named_modules():
            for npp, p in m.named_parameters():
                if npp in ['weight', 'bias'] and p.requires_grad:
                    mask = (torch.rand(p.shape) < self.rst).float()
                    with torch.no_grad():
                        p.data = self.model_state[f"{nm}.{npp}"] * mask + p * (1. - mask)
        return outputs_ema


def configure_model(model):
    model.train()
    model.requires_grad_(False)
    for m in model.modules():
        if isinstance(m, nn.BatchNorm2d):
            m.requires_grad_(True)
            m.track_running_stats = False
            m.running_mean = None
            m.running_var = None
        else:
            m.requires_grad_(True)
    return model


torch.manual_seed(0)
base = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                     nn.Linear(4, 5))
model = configure_model(base)
params = [p for nm, m in model.named_modules() for npp, p in m.named_parameters(recurse=False)
          if npp in ['weight', 'bias'] and p.requires_grad]
optimizer = torch.optim.Adam(params, lr=1e-3, betas=(0.9, 0.999), weight_decay=0.)
cotta = CoTTA(model, optimizer, steps=1, mt_alpha=0.99, rst_m=0.1, ap=0.92)
with torch.no_grad():  # robustbench's clean_accuracy
    for i in range(6):
        x = torch.rand(8, 3, 8, 8)
        output = cotta(x)
        print(f"batch {i}: prediction sum {output.sum().item()!r}")
print(f"student {sum(p.double().sum() for p in model.parameters()).item()!r} "
      f"teacher {sum(p.double().sum() for p in cotta.model_ema.parameters()).item()!r}")
