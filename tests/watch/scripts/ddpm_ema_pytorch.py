# DDPM training step with an EMA model (lucidrains/denoising-diffusion-pytorch, denoising_diffusion_pytorch.py
# GaussianDiffusion.p_losses / Trainer.train; lucidrains/ema-pytorch, ema_pytorch/ema_pytorch.py EMA.update):
# the EMA copy's parameters frozen (requires_grad_(False)), updated under @torch.no_grad() with lerp_, its step
# counter a buffer written in place (add_), copied whole with copy_ at the first update.
import copy
import torch
from torch import nn
import torch.nn.functional as F

torch.manual_seed(0)


class EMA(nn.Module):
    def __init__(self, model, beta=0.9, update_after_step=2):
        super().__init__()
        self.beta, self.update_after_step, self.online_model = beta, update_after_step, [model]
        self.ema_model = copy.deepcopy(model)
        self.ema_model.requires_grad_(False)
        self.register_buffer("initted", torch.tensor(False))
        self.register_buffer("step", torch.tensor(0))

    @torch.no_grad()
    def update(self):
        step = self.step.item()
        self.step += 1
        if step <= self.update_after_step:
            for ma, cur in zip(self.ema_model.parameters(), self.online_model[0].parameters()):
                ma.copy_(cur)
            return
        for ma, cur in zip(self.ema_model.parameters(), self.online_model[0].parameters()):
            ma.lerp_(cur, 1. - self.beta)


model = nn.Sequential(nn.Linear(5, 16), nn.SiLU(), nn.Linear(16, 4))  # x_t and t -> predicted noise
ema = EMA(model)
opt = torch.optim.Adam(model.parameters(), lr=1e-3)
betas = torch.linspace(1e-4, 0.02, 10)
alphas_cumprod = torch.cumprod(1. - betas, 0)
for step in range(8):
    x_start = torch.randn(8, 4)
    t = torch.randint(0, 10, (8,))
    noise = torch.randn_like(x_start)
    a = alphas_cumprod[t].unsqueeze(1)
    x = a.sqrt() * x_start + (1 - a).sqrt() * noise  # q_sample
    loss = F.mse_loss(model(torch.cat([x, t.unsqueeze(1) / 10.], 1)), noise)
    loss.backward()
    opt.step()
    opt.zero_grad()
    ema.update()
    print(step, f"{loss.item():.6f}")
with torch.no_grad():
    print(ema.ema_model(torch.ones(1, 5)).sum().item())
