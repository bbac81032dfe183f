"""DCGAN-style step that keeps the fake's graph for the generator: D's backward retains it (fake not detached)."""
import torch
from torch import nn

torch.manual_seed(0)
g, d = nn.Linear(2, 2), nn.Sequential(nn.Linear(2, 4), nn.Tanh(), nn.Linear(4, 1))
og, od = torch.optim.SGD(g.parameters(), lr=0.05), torch.optim.SGD(d.parameters(), lr=0.05)
for step in range(4):
    real, fake = torch.randn(8, 2) + 2, g(torch.randn(8, 2))
    od.zero_grad()
    ld = d(fake).mean() - d(real).mean()
    ld.backward(retain_graph=True)
    od.step()
    og.zero_grad()
    lg = -d(fake).mean()
    lg.backward()
    og.step()
    print(f"step {step} d {ld.item():.6f} g {lg.item():.6f}")
