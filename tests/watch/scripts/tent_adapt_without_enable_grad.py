# Tent's adaptation (tent_adapt_under_caller_no_grad.py) without `@torch.enable_grad()` on forward_and_adapt: run
# inside robustbench's clean_accuracy, which evaluates under torch.no_grad(), the entropy has no graph.
import math
from copy import deepcopy

import torch
import torch.jit
from torch import nn


class Tent(nn.Module):
    def __init__(self, model, optimizer, steps=1):
        super().__init__()
        self.model, self.optimizer, self.steps = model, optimizer, steps
        self.model_state = deepcopy(model.state_dict())
        self.optimizer_state = deepcopy(optimizer.state_dict())

    def forward(self, x):
        for _ in range(self.steps):
            outputs = forward_and_adapt(x, self.model, self.optimizer)
        return outputs

    def reset(self):
        self.model.load_state_dict(self.model_state, strict=True)
        self.optimizer.load_state_dict(self.optimizer_state)


@torch.jit.script
def softmax_entropy(x: torch.Tensor) -> torch.Tensor:
    return -(x.softmax(1) * x.log_softmax(1)).sum(1)


def forward_and_adapt(x, model, optimizer):
    outputs = model(x)
    loss = softmax_entropy(outputs).mean(0)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return outputs


def configure_model(model):
    model.train()
    model.requires_grad_(False)
    for m in model.modules():
        if isinstance(m, nn.BatchNorm2d):
            m.requires_grad_(True)
            m.track_running_stats = False
            m.running_mean = None
            m.running_var = None
    return model


def collect_params(model):
    return [p for m in model.modules() if isinstance(m, nn.BatchNorm2d) for n, p in m.named_parameters()
            if n in ["weight", "bias"]]


def clean_accuracy(model, x, y, batch_size=4):  # robustbench.utils.clean_accuracy
    acc = 0.0
    with torch.no_grad():
        for counter in range(math.ceil(x.shape[0] / batch_size)):
            output = model(x[counter * batch_size:(counter + 1) * batch_size])
            acc += (output.max(1)[1] == y[counter * batch_size:(counter + 1) * batch_size]).float().sum()
    return acc.item() / x.shape[0]


torch.manual_seed(0)
model = configure_model(nn.Sequential(
    nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(), nn.Conv2d(4, 4, 3, padding=1), nn.BatchNorm2d(4),
    nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, 3)))
optimizer = torch.optim.Adam(collect_params(model), lr=1e-3, betas=(0.9, 0.999))
tented = Tent(model, optimizer, steps=2)
for severity in [5, 3]:
    for corruption in ["gaussian_noise", "shot_noise"]:
        tented.reset()
        x_test, y_test = torch.randn(8, 3, 4, 4) * severity, torch.randint(3, (8,))
        print(f"error % [{corruption}{severity}]: {1.0 - clean_accuracy(tented, x_test, y_test):.2%}")
print(" ".join(f"{p.sum().item():.6f}" for p in collect_params(model)))
