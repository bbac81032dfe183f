# watch: --check always
"""The critic step of martinarjovsky/WassersteinGAN's main.py ("clamp parameters to a cube":
`p.data.clamp_(opt.clamp_lower, opt.clamp_upper)`, at the start of each critic iteration), with the clipping moved
after the critic's forward: backward then computes with the clipped weights what the forward did with the others,
and PyTorch cannot tell (a write through .data moves no version counter)."""
import torch
from torch import nn

torch.manual_seed(0)
netD = nn.Sequential(nn.Linear(4, 16), nn.LeakyReLU(0.2), nn.Linear(16, 1))
optimizerD = torch.optim.RMSprop(netD.parameters(), lr=5e-5)
for i in range(3):
    real, fake = torch.randn(8, 4) + 1, torch.randn(8, 4)
    errD = netD(fake).mean() - netD(real).mean()
    for p in netD.parameters():
        p.data.clamp_(-0.01, 0.01)
    optimizerD.zero_grad()
    errD.backward()
    optimizerD.step()
    print(f"iteration {i} critic loss {errD.item():.6f}")
