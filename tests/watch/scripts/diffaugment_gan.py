# DiffAugment (mit-han-lab/data-efficient-gans, DiffAugment_pytorch.py) in a GAN step: the same differentiable
# color / translation / cutout policy applied to real and fake images before D, on G's step too, so G's gradient
# goes through the augmentation (translation by a padded gather, cutout by a mask); non-saturating logistic loss.
import torch
import torch.nn.functional as F
from torch import nn

torch.manual_seed(0)


def DiffAugment(x, policy="color,translation,cutout"):
    for p in policy.split(","):
        for f in AUGMENT_FNS[p]:
            x = f(x)
    return x.contiguous()


def rand_brightness(x):
    return x + (torch.rand(x.size(0), 1, 1, 1, dtype=x.dtype, device=x.device) - 0.5)


def rand_saturation(x):
    x_mean = x.mean(dim=1, keepdim=True)
    return (x - x_mean) * (torch.rand(x.size(0), 1, 1, 1, dtype=x.dtype, device=x.device) * 2) + x_mean


def rand_translation(x, ratio=0.125):
    shift_x, shift_y = int(x.size(2) * ratio + 0.5), int(x.size(3) * ratio + 0.5)
    translation_x = torch.randint(-shift_x, shift_x + 1, size=[x.size(0), 1, 1], device=x.device)
    translation_y = torch.randint(-shift_y, shift_y + 1, size=[x.size(0), 1, 1], device=x.device)
    grid_batch, grid_x, grid_y = torch.meshgrid(torch.arange(x.size(0), dtype=torch.long, device=x.device),
                                                torch.arange(x.size(2), dtype=torch.long, device=x.device),
                                                torch.arange(x.size(3), dtype=torch.long, device=x.device),
                                                indexing="ij")
    grid_x = torch.clamp(grid_x + translation_x + 1, 0, x.size(2) + 1)
    grid_y = torch.clamp(grid_y + translation_y + 1, 0, x.size(3) + 1)
    x_pad = F.pad(x, [1, 1, 1, 1, 0, 0, 0, 0])
    return x_pad.permute(0, 2, 3, 1).contiguous()[grid_batch, grid_x, grid_y].permute(0, 3, 1, 2)


def rand_cutout(x, ratio=0.5):
    cutout_size = int(x.size(2) * ratio + 0.5), int(x.size(3) * ratio + 0.5)
    offset_x = torch.randint(0, x.size(2) + (1 - cutout_size[0] % 2), size=[x.size(0), 1, 1], device=x.device)
    offset_y = torch.randint(0, x.size(3) + (1 - cutout_size[1] % 2), size=[x.size(0), 1, 1], device=x.device)
    grid_batch, grid_x, grid_y = torch.meshgrid(torch.arange(x.size(0), dtype=torch.long, device=x.device),
                                                torch.arange(cutout_size[0], dtype=torch.long, device=x.device),
                                                torch.arange(cutout_size[1], dtype=torch.long, device=x.device),
                                                indexing="ij")
    grid_x = torch.clamp(grid_x + offset_x - cutout_size[0] // 2, min=0, max=x.size(2) - 1)
    grid_y = torch.clamp(grid_y + offset_y - cutout_size[1] // 2, min=0, max=x.size(3) - 1)
    mask = torch.ones(x.size(0), x.size(2), x.size(3), dtype=x.dtype, device=x.device)
    mask[grid_batch, grid_x, grid_y] = 0
    return x * mask.unsqueeze(1)


AUGMENT_FNS = {"color": [rand_brightness, rand_saturation], "translation": [rand_translation], "cutout": [rand_cutout]}
G = nn.Sequential(nn.Linear(6, 3 * 8 * 8), nn.Tanh(), nn.Unflatten(1, (3, 8, 8)))
D = nn.Sequential(nn.Conv2d(3, 4, 3, stride=2, padding=1), nn.LeakyReLU(0.2), nn.Flatten(), nn.Linear(64, 1))
optG = torch.optim.Adam(G.parameters(), lr=2e-3, betas=(0.0, 0.99))
optD = torch.optim.Adam(D.parameters(), lr=2e-3, betas=(0.0, 0.99))
for step in range(4):
    reals = torch.rand(4, 3, 8, 8) * 2 - 1
    fakes = G(torch.randn(4, 6))
    d_loss = F.softplus(D(DiffAugment(fakes.detach()))).mean() + F.softplus(-D(DiffAugment(reals))).mean()
    optD.zero_grad()
    d_loss.backward()
    optD.step()
    g_loss = F.softplus(-D(DiffAugment(fakes))).mean()
    optG.zero_grad()
    g_loss.backward()
    optG.step()
    print(step, repr(d_loss.item()), repr(g_loss.item()))
print([p.sum().item() for p in G.parameters()], [p.sum().item() for p in D.parameters()])
