"""WGAN's n_critic loop with `fake` made once, before the loop, and used by every generator step."""
import torch
from torch import nn
from torch.optim import SGD

torch.manual_seed(0)
g, d = nn.Linear(2, 2), nn.Linear(2, 1)
og, od = SGD(g.parameters(), lr=0.1), SGD(d.parameters(), lr=0.1)
fake = g(torch.randn(4, 2))
for step in range(3):
    for critic_it in range(2):
        ld = d(fake.detach()).mean() - d(torch.randn(4, 2)).mean()
        od.zero_grad()
        ld.backward()
        od.step()
    lg = -d(fake).mean()
    og.zero_grad()
    lg.backward()
    og.step()
    print(f"step {step} critic {ld.item():.6f} generator {lg.item():.6f}")
