# diffusers' EMAModel (huggingface/diffusers, src/diffusers/training_utils.py EMAModel.step) with its
# @torch.no_grad() left out: the shadow parameters, detached clones in a plain list, are written in place from the
# trained parameters (`s_param.sub_(one_minus_decay * (s_param - param))`) and keep a graph growing every step; the
# sampler gets them through `.data`, so the run trains and samples as with the decorator.
import copy
import torch
from torch import nn
import torch.nn.functional as F

torch.manual_seed(0)


class EMAModel:
    def __init__(self, parameters, decay=0.999, inv_gamma=1.0, power=2 / 3):
        self.shadow_params = [p.clone().detach() for p in parameters]
        self.decay, self.inv_gamma, self.power, self.optimization_step = decay, inv_gamma, power, 0

    def get_decay(self, optimization_step):
        value = 1 - (1 + optimization_step / self.inv_gamma) ** -self.power
        return max(min(value, self.decay), 0.0)

    def step(self, parameters):
        self.optimization_step += 1
        one_minus_decay = 1 - self.get_decay(self.optimization_step)
        for s_param, param in zip(self.shadow_params, parameters):
            if param.requires_grad:
                s_param.sub_(one_minus_decay * (s_param - param))
            else:
                s_param.copy_(param)

    def copy_to(self, parameters):
        for s_param, param in zip(self.shadow_params, parameters):
            param.data.copy_(s_param.to(param.device).data)


model = nn.Sequential(nn.Linear(5, 16), nn.SiLU(), nn.Linear(16, 4))
ema_model = EMAModel(model.parameters())
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
alphas_cumprod = torch.cumprod(1. - torch.linspace(1e-4, 0.02, 10), 0)
for step in range(8):
    clean_images, noise = torch.randn(8, 4), torch.randn(8, 4)
    timesteps = torch.randint(0, 10, (8,))
    a = alphas_cumprod[timesteps].unsqueeze(1)
    noisy_images = a.sqrt() * clean_images + (1 - a).sqrt() * noise  # noise_scheduler.add_noise
    loss = F.mse_loss(model(torch.cat([noisy_images, timesteps[:, None] / 10.], 1)), noise)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    optimizer.zero_grad()
    ema_model.step(model.parameters())
    print(step, f"{loss.item():.6f}")
sampler = copy.deepcopy(model)
ema_model.copy_to(sampler.parameters())
with torch.no_grad():
    print(sampler(torch.ones(1, 5)).sum().item())
