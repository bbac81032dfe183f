"""wgan_n_critic.py with its generator steps counted by `while step < 3:` (the original WGAN's
martinarjovsky/WassersteinGAN main.py counts its iterations in `while` loops): `fake`, made once per generator step,
feeds the critic's steps (detached) and then the generator's loss. Correct."""
import torch
from torch import nn
from torch.optim import SGD

torch.manual_seed(0)
g, d = nn.Linear(2, 2), nn.Linear(2, 1)
og, od = SGD(g.parameters(), lr=0.1), SGD(d.parameters(), lr=0.1)
step = 0
while step < 3:
    fake = g(torch.randn(4, 2))
    for critic_it in range(2):
        ld = d(fake.detach()).mean() - d(torch.randn(4, 2)).mean()
        od.zero_grad()
        ld.backward()
        od.step()
    lg = -d(fake).mean()
    og.zero_grad()
    lg.backward()
    og.step()
    step += 1
    print(f"step {step} critic {ld.item():.6f} generator {lg.item():.6f}")
print(*(p.sum().item() for p in [*g.parameters(), *d.parameters()]))
