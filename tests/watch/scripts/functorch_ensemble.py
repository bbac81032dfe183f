# Trimmed from pytorch/pytorch, functorch/examples/ensembling/parallel_train.py (0293e26): training by
# `torch.func.grad_and_value` (the guard's `torch.autograd.grad` called inside functorch's transform) and SGD by hand,
# one model, then two stacked models under `vmap`; no optimizer and no `backward`. Correct: nothing to report.
import math

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.func import functional_call, grad_and_value, stack_module_state, vmap

torch.manual_seed(0)


def make_spirals(n_samples, noise_std=0., rotations=1.):
    ts = torch.linspace(0, 1, n_samples)
    rs = ts ** 0.5
    thetas = rs * rotations * 2 * math.pi
    signs = torch.randint(0, 2, (n_samples,)) * 2 - 1
    labels = (signs > 0).to(torch.long)
    xs = rs * signs * torch.cos(thetas) + torch.randn(n_samples) * noise_std
    ys = rs * signs * torch.sin(thetas) + torch.randn(n_samples) * noise_std
    return torch.stack([xs, ys], dim=1), labels


points, labels = make_spirals(100, noise_std=0.05)


class MLPClassifier(nn.Module):
    def __init__(self, hidden_dim=32, n_classes=2):
        super().__init__()
        self.fc1 = nn.Linear(2, hidden_dim)
        self.fc2 = nn.Linear(hidden_dim, n_classes)

    def forward(self, x):
        return F.log_softmax(self.fc2(F.relu(self.fc1(x))), -1)


loss_fn = nn.NLLLoss()
model = MLPClassifier()


def train_step_fn(weights, batch, targets, lr=0.2):
    def compute_loss(weights, batch, targets):
        return loss_fn(functional_call(model, weights, batch), targets)

    grad_weights, loss = grad_and_value(compute_loss)(weights, batch, targets)
    new_weights = {}
    with torch.no_grad():
        for key in grad_weights:
            new_weights[key] = weights[key] - grad_weights[key] * lr
    return loss, new_weights


def step4():
    global weights
    for i in range(20):
        loss, weights = train_step_fn(dict(model.named_parameters()), points, labels)
        if i % 5 == 0:
            print(loss)


step4()


def init_fn(num_models):
    params, _ = stack_module_state([MLPClassifier() for _ in range(num_models)])
    return params


def step6():
    parallel_train_step_fn = vmap(train_step_fn, in_dims=(0, None, None))
    batched_weights = init_fn(num_models=2)
    for i in range(20):
        loss, batched_weights = parallel_train_step_fn(batched_weights, points, labels)
        if i % 5 == 0:
            print(loss)
    print({k: v.sum().item() for k, v in batched_weights.items()})


step6()
