# An energy-based model's persistent chains (contrastive divergence with a replay buffer), the Langevin steps taken
# with torch.autograd.grad outside torch.no_grad() and the samples put back into the buffer without `.detach()`:
# each keeps the graph of its chain, and the next draw `old = torch.cat(...)` of the buffer reaches them. The
# samples are detached where drawn, so the training is the same: the graphs only pile up in `buffer`.
import random

import torch
from torch import nn

random.seed(0)
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(4, 32), nn.SiLU(), nn.Linear(32, 1))
optimizer = torch.optim.Adam(model.parameters(), lr=1e-3, betas=(0.0, 0.999))
buffer = [torch.rand(1, 4) * 2 - 1 for _ in range(16)]


def sample_langevin(steps=4, step_size=0.1):
    old = torch.cat(random.choices(buffer, k=8))
    x = old.detach().requires_grad_()
    for _ in range(steps):
        x = x + 0.005 * torch.randn_like(x)
        energy = model(x).sum()
        grad = torch.autograd.grad(energy, x)[0]
        x = (x - step_size * grad.clamp(-0.03, 0.03)).clamp(-1, 1)
    buffer[:0] = list(x.split(1))
    del buffer[64:]
    return x.detach()


for step in range(6):
    real = torch.randn(8, 4) * 0.3
    fake = sample_langevin()
    loss = model(real).mean() - model(fake).mean() + 0.1 * (model(real) ** 2 + model(fake) ** 2).mean()
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    print(step, f"{loss.item():.6f}")
