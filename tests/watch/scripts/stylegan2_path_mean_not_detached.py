# StyleGAN2's path-length regularization (rosinality/stylegan2-pytorch, train.py g_path_regularize) with its running
# mean returned without `.detach()`: `mean_path_length` keeps the graph of the penalty that made it, which the next
# regularization's penalty goes back through after that backward freed it (PyTorch fails at the second one).
import copy
import math
import torch
from torch import autograd, nn
import torch.nn.functional as F

torch.manual_seed(0)


def g_path_regularize(fake_img, latents, mean_path_length, decay=0.01):
    noise = torch.randn_like(fake_img) / math.sqrt(fake_img.shape[1])
    grad, = autograd.grad(outputs=(fake_img * noise).sum(), inputs=latents, create_graph=True)
    path_lengths = torch.sqrt(grad.pow(2).sum(1))
    path_mean = mean_path_length + decay * (path_lengths.mean() - mean_path_length)
    path_penalty = (path_lengths - path_mean).pow(2).mean()
    return path_penalty, path_mean, path_lengths


class Generator(nn.Module):
    def __init__(self):
        super().__init__()
        self.style, self.synth = nn.Sequential(nn.Linear(4, 4), nn.LeakyReLU(0.2)), nn.Linear(4, 6)

    def forward(self, z, return_latents=False):
        latent = self.style(z)
        return self.synth(latent), (latent if return_latents else None)


def requires_grad(model, flag=True):
    for p in model.parameters():
        p.requires_grad = flag


generator, discriminator = Generator(), nn.Sequential(nn.Linear(6, 8), nn.LeakyReLU(0.2), nn.Linear(8, 1))
g_ema = copy.deepcopy(generator)
g_optim, d_optim = torch.optim.Adam(generator.parameters(), 2e-3), torch.optim.Adam(discriminator.parameters(), 2e-3)
mean_path_length = 0
for i in range(8):
    real_img = torch.randn(8, 6) + 1
    requires_grad(generator, False)
    requires_grad(discriminator, True)
    fake_img, _ = generator(torch.randn(8, 4))
    d_loss = F.softplus(discriminator(fake_img)).mean() + F.softplus(-discriminator(real_img)).mean()
    discriminator.zero_grad()
    d_loss.backward()
    d_optim.step()
    if i % 4 == 0:
        real_img.requires_grad = True
        real_pred = discriminator(real_img)
        grad_real, = autograd.grad(outputs=real_pred.sum(), inputs=real_img, create_graph=True)
        r1_loss = grad_real.pow(2).sum(1).mean()
        discriminator.zero_grad()
        (10 / 2 * r1_loss * 4 + 0 * real_pred[0]).backward()
        d_optim.step()
    requires_grad(generator, True)
    requires_grad(discriminator, False)
    fake_img, _ = generator(torch.randn(8, 4))
    g_loss = F.softplus(-discriminator(fake_img)).mean()
    generator.zero_grad()
    g_loss.backward()
    g_optim.step()
    if i % 2 == 0:
        fake_img, latents = generator(torch.randn(4, 4), return_latents=True)
        path_loss, mean_path_length, path_lengths = g_path_regularize(fake_img, latents, mean_path_length)
        generator.zero_grad()
        weighted_path_loss = 2 * 2 * path_loss
        weighted_path_loss += 0 * fake_img[0, 0]
        weighted_path_loss.backward()
        g_optim.step()
    with torch.no_grad():
        for p_ema, p in zip(g_ema.parameters(), generator.parameters()):
            p_ema.data.mul_(0.9).add_(p.data, alpha=0.1)
    print(i, f"{d_loss.item():.6f} {g_loss.item():.6f} {float(mean_path_length):.6f}")
