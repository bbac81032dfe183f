# Consistency training (openai/consistency_models, cm/karras_diffusion.py consistency_losses, cm/nn.py update_ema)
# with `update_ema` written without its `targ.detach()`: the target network's frozen parameters, written in place from
# the online ones outside torch.no_grad(), now require grad and hold a graph that grows by every update. The target
# is evaluated under torch.no_grad(), so the training runs as with `targ.detach()`, its graph piling up unseen.
import copy

import torch
from torch import nn
import torch.nn.functional as F

torch.manual_seed(0)


class Denoiser(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(9, 32), nn.SiLU(), nn.Linear(32, 8))

    def forward(self, x, t):
        return x + t * self.net(torch.cat([x, t], 1))  # a skip scaled to zero at t = 0


def update_ema(target_params, source_params, rate=0.99):
    for targ, src in zip(target_params, source_params):
        targ.mul_(rate).add_(src, alpha=1 - rate)


model = Denoiser()
target_model = copy.deepcopy(model).requires_grad_(False)
opt = torch.optim.Adam(model.parameters(), lr=1e-3)
sigmas = torch.linspace(0.002, 1.0, 10)

for step in range(4):
    x_start = torch.randn(16, 8)
    indices = torch.randint(0, len(sigmas) - 1, (16, 1))
    t, t2 = sigmas[indices + 1], sigmas[indices]
    noise = torch.randn_like(x_start)
    distiller = model(x_start + t * noise, t)
    with torch.no_grad():
        distiller_target = target_model(x_start + t2 * noise, t2)
    loss = F.mse_loss(distiller, distiller_target)
    opt.zero_grad()
    loss.backward()
    opt.step()
    update_ema(target_model.parameters(), model.parameters(), rate=0.9)
    print(step, f"{loss.item():.6f}")
print([f"{p.sum().item():.6f}" for p in target_model.parameters()])
