# Reptile on sine waves (the Reptile paper's PyTorch demo, openai.com/blog/reptile, reptile-sinewaves-demo.py;
# the clone-and-adapt form of learn2learn's examples/vision/reptile_miniimagenet.py): each task's inner SGD runs on
# a deep copy of the model with an optimizer of its own, then the meta-model moves towards the adapted weights
# through `.data` (`p.data.add_(outerstepsize * (q.data - p.data))`), the outer step size annealed.
import copy
import math
import torch
from torch import nn

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(1, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 1))
x_all = torch.linspace(-5, 5, 20)[:, None]
niterations = 6
for iteration in range(niterations):
    phase, ampl = torch.rand(()).item() * 2 * math.pi, 0.1 + torch.rand(()).item() * 4.9
    y_all = ampl * torch.sin(x_all + phase)
    learner = copy.deepcopy(model)
    inner_opt = torch.optim.SGD(learner.parameters(), lr=0.02)
    inds = torch.randperm(len(x_all))
    for _ in range(2):
        for start in range(0, len(x_all), 10):
            mbinds = inds[start:start + 10]
            inner_opt.zero_grad()
            loss = (learner(x_all[mbinds]) - y_all[mbinds]).pow(2).mean()
            loss.backward()
            inner_opt.step()
    outerstepsize = 0.1 * (1 - iteration / niterations)
    for p, q in zip(model.parameters(), learner.parameters()):
        p.data.add_(outerstepsize * (q.data - p.data))
    print(iteration, f"{loss.item():.6f}")
print(model[0].weight.sum().item())
