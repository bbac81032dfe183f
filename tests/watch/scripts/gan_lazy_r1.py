# A GAN with StyleGAN2's lazy R1 penalty as its train.py first wrote it: the penalty differentiates the
# D(real) of the D loss, after D's update changed the weights that graph saved.
import torch
from torch import nn
from torch.nn import functional as F

torch.manual_seed(0)
generator = nn.Sequential(nn.Linear(8, 32), nn.LeakyReLU(0.2), nn.Linear(32, 16))
discriminator = nn.Sequential(nn.Linear(16, 32), nn.LeakyReLU(0.2), nn.Linear(32, 1))
g_optim = torch.optim.Adam(generator.parameters(), lr=2e-3, betas=(0.0, 0.99))
d_optim = torch.optim.Adam(discriminator.parameters(), lr=2e-3, betas=(0.0, 0.99))
D_REG_EVERY, R1 = 2, 10.0

for i in range(4):
    real_img = torch.randn(8, 16)
    real_img.requires_grad = True
    fake_img = generator(torch.randn(8, 8))
    real_pred, fake_pred = discriminator(real_img), discriminator(fake_img.detach())
    d_loss = F.softplus(-real_pred).mean() + F.softplus(fake_pred).mean()
    discriminator.zero_grad()
    d_loss.backward(retain_graph=True)
    d_optim.step()

    if i % D_REG_EVERY == 0:
        grad_real, = torch.autograd.grad(real_pred.sum(), real_img, create_graph=True)
        r1_loss = grad_real.pow(2).flatten(1).sum(1).mean()
        discriminator.zero_grad()
        (R1 / 2 * r1_loss * D_REG_EVERY).backward()
        d_optim.step()

    g_loss = F.softplus(-discriminator(generator(torch.randn(8, 8)))).mean()
    generator.zero_grad()
    g_loss.backward()
    g_optim.step()
    print(f"iteration {i}: d {d_loss.item():.6f} g {g_loss.item():.6f}")
