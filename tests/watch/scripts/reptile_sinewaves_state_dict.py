# Reptile on sine waves (the Reptile paper's PyTorch demo, openai.com/blog/reptile, reptile-sinewaves-demo.py:
# train_on_batch, the meta loop): the inner SGD by hand (`model.zero_grad()`, backward, `param.data -= lr *
# param.grad.data`), the outer update by load_state_dict of weights_before + (weights_after - weights_before) * step,
# weights_before a deepcopy of the state dict.
from copy import deepcopy
import math
import torch
from torch import nn

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(1, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 1))
x_all = torch.linspace(-5, 5, 20)[:, None]


def train_on_batch(x, y):
    model.zero_grad()
    loss = (model(x) - y).pow(2).mean()
    loss.backward()
    for param in model.parameters():
        param.data -= 0.02 * param.grad.data
    return loss


niterations = 6
for iteration in range(niterations):
    weights_before = deepcopy(model.state_dict())
    phase, ampl = torch.rand(()).item() * 2 * math.pi, 0.1 + torch.rand(()).item() * 4.9
    y_all = ampl * torch.sin(x_all + phase)
    inds = torch.randperm(len(x_all))
    for _ in range(2):
        for start in range(0, len(x_all), 10):
            mbinds = inds[start:start + 10]
            loss = train_on_batch(x_all[mbinds], y_all[mbinds])
    weights_after = model.state_dict()
    outerstepsize = 0.1 * (1 - iteration / niterations)
    model.load_state_dict({name: weights_before[name] + (weights_after[name] - weights_before[name]) * outerstepsize
                           for name in weights_before})
    print(iteration, f"{loss.item():.6f}")
print(model[0].weight.sum().item())
