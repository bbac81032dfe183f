# Reptile with a meta-optimizer (the form of learn2learn's examples and of many Reptile ports, e.g.
# dragen1860/Reptile-Pytorch, meta.py): each task adapts a deep copy with its own SGD; the meta-gradient is assigned
# by hand, `p.grad = p.data - q.data` (the difference of weights as a gradient), and the meta Adam steps, its
# zero_grad at the top of each meta-iteration; the meta-model itself never back-propagates.
import copy
import math
import torch
from torch import nn

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(1, 16), nn.Tanh(), nn.Linear(16, 1))
meta_opt = torch.optim.Adam(model.parameters(), lr=0.05)
x_all = torch.linspace(-5, 5, 20)[:, None]
for iteration in range(6):
    meta_opt.zero_grad()
    phase, ampl = torch.rand(()).item() * 2 * math.pi, 0.1 + torch.rand(()).item() * 4.9
    y_all = ampl * torch.sin(x_all + phase)
    learner = copy.deepcopy(model)
    inner_opt = torch.optim.SGD(learner.parameters(), lr=0.02)
    for _ in range(3):
        inner_opt.zero_grad()
        loss = (learner(x_all) - y_all).pow(2).mean()
        loss.backward()
        inner_opt.step()
    for p, q in zip(model.parameters(), learner.parameters()):
        p.grad = p.data - q.data
    meta_opt.step()
    print(iteration, f"{loss.item():.6f}")
print(model[0].weight.sum().item())
