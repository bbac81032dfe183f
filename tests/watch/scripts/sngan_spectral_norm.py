# Trimmed from w86763777/pytorch-gan-collections, source/models/sngan.py and train.py (hinge loss, n_dis=2): a
# discriminator under torch.nn.utils.parametrizations.spectral_norm (its power iteration writes the buffers _u, _v in
# place in every training forward) and a generator under parametrizations.weight_norm; D stepped on G(z).detach(),
# the fake made again for G's step. Correct: nothing to report.
import torch
from torch import nn
from torch.nn.utils.parametrizations import spectral_norm, weight_norm

torch.manual_seed(0)
net_G = nn.Sequential(weight_norm(nn.Linear(4, 16)), nn.ReLU(), nn.Linear(16, 6), nn.Tanh())
net_D = nn.Sequential(spectral_norm(nn.Linear(6, 16)), nn.LeakyReLU(0.1), spectral_norm(nn.Linear(16, 1)))
optim_G = torch.optim.Adam(net_G.parameters(), lr=2e-3, betas=(0.0, 0.9))
optim_D = torch.optim.Adam(net_D.parameters(), lr=2e-3, betas=(0.0, 0.9))
for step in range(4):
    for n in range(2):  # n_dis
        real = torch.randn(8, 6) * 0.5 + 1
        z = torch.randn(16, 4)
        with torch.no_grad():
            fake = net_G(z).detach()
        net_real_fake = net_D(torch.cat([real, fake[:8]], dim=0))
        net_real, net_fake = torch.split(net_real_fake, [8, 8])
        loss_D = nn.functional.relu(1 - net_real).mean() + nn.functional.relu(1 + net_fake).mean()
        optim_D.zero_grad()
        loss_D.backward()
        optim_D.step()
    for p in net_D.parameters():
        p.requires_grad_(False)
    z = torch.randn(16, 4)
    loss_G = -net_D(net_G(z)).mean()
    optim_G.zero_grad()
    loss_G.backward()
    optim_G.step()
    for p in net_D.parameters():
        p.requires_grad_(True)
    print(f"step {step} loss_D {loss_D.item():.6f} loss_G {loss_G.item():.6f}")
print(net_D[0].parametrizations.weight[0]._u[:3].tolist(), net_G[0].weight.sum().item())
