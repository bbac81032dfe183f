# A GAN projector as rosinality/stylegan2-pytorch's projector.py shapes it: for each image, a latent started from the
# mapping network's mean latent (computed under torch.no_grad()), made a leaf with requires_grad, and an optimizer of
# its own for an inner loop of steps. The mistake: the noised latent `latent_n` is made once per image, before the
# inner loop, where projector.py makes it at every step; every step back-propagates that same graph and the
# generator never sees the updated latent (PyTorch runs it: nothing in the graph saves a tensor).
import torch
import torch.nn.functional as F
from torch import nn

torch.manual_seed(0)
style = nn.Sequential(nn.Linear(8, 8), nn.LeakyReLU(0.2), nn.Linear(8, 8))
gen = nn.Linear(8, 16)
with torch.no_grad():
    latent_out = style(torch.randn(100, 8))
    latent_mean = latent_out.mean(0)
    latent_std = ((latent_out - latent_mean).pow(2).sum() / 100) ** 0.5
for img in torch.randn(2, 3, 16):
    latent_in = latent_mean.detach().clone().unsqueeze(0).repeat(3, 1)
    latent_in.requires_grad = True
    optimizer = torch.optim.Adam([latent_in], lr=0.1)
    latent_n = latent_in + torch.randn_like(latent_in) * latent_std * 0.05
    for i in range(3):
        loss = F.mse_loss(gen(latent_n), img)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    print(f"{loss.item():.6f}")
