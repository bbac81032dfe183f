# DDPM with an EMA model (lucidrains/ema-pytorch EMA.update) whose update lost its @torch.no_grad(): the EMA
# parameters, frozen (requires_grad_(False)), are written in place from the trained ones with lerp_ outside no_grad,
# so they now require grad and each holds a graph growing by every update. Sampled under no_grad, the run goes on as
# with the decorator, its graph piling up unseen.
import copy
import torch
from torch import nn
import torch.nn.functional as F

torch.manual_seed(0)


class EMA(nn.Module):
    def __init__(self, model, beta=0.9):
        super().__init__()
        self.beta, self.online_model = beta, [model]
        self.ema_model = copy.deepcopy(model)
        self.ema_model.requires_grad_(False)

    def update(self):
        for ma, cur in zip(self.ema_model.parameters(), self.online_model[0].parameters()):
            ma.lerp_(cur, 1. - self.beta)


model = nn.Sequential(nn.Linear(5, 16), nn.SiLU(), nn.Linear(16, 4))
ema = EMA(model)
opt = torch.optim.Adam(model.parameters(), lr=1e-3)
alphas_cumprod = torch.cumprod(1. - torch.linspace(1e-4, 0.02, 10), 0)
for step in range(8):
    x_start, t = torch.randn(8, 4), torch.randint(0, 10, (8,))
    noise = torch.randn_like(x_start)
    a = alphas_cumprod[t].unsqueeze(1)
    loss = F.mse_loss(model(torch.cat([a.sqrt() * x_start + (1 - a).sqrt() * noise, t.unsqueeze(1) / 10.], 1)), noise)
    loss.backward()
    opt.step()
    opt.zero_grad()
    ema.update()
    print(step, f"{loss.item():.6f}")
with torch.no_grad():
    print(ema.ema_model(torch.ones(1, 5)).sum().item())
