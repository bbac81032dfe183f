# CycleGAN's ImagePool (junyanz/pytorch-CycleGAN-and-pix2pix, util/image_pool.py) with `image.data` written as
# `image`: the pool keeps the generator's fakes with their graphs, appended while it fills, then put in place of a
# random item. The discriminator's step reads `fake.detach()`, so the training is the same: the graphs only pile up.
import random

import torch
from torch import nn


class ImagePool:
    def __init__(self, pool_size):
        self.pool_size = pool_size
        self.num_imgs = 0
        self.images = []

    def query(self, images):
        return_images = []
        for image in images:
            image = torch.unsqueeze(image, 0)
            if self.num_imgs < self.pool_size:
                self.num_imgs = self.num_imgs + 1
                self.images.append(image)
                return_images.append(image)
            elif random.uniform(0, 1) > 0.5:
                random_id = random.randint(0, self.pool_size - 1)
                tmp = self.images[random_id].clone()
                self.images[random_id] = image
                return_images.append(tmp)
            else:
                return_images.append(image)
        return torch.cat(return_images, 0)


random.seed(0)
torch.manual_seed(0)
netG = nn.Sequential(nn.Linear(4, 8), nn.Tanh())
netD = nn.Sequential(nn.Linear(8, 1))
optimizer_G = torch.optim.Adam(netG.parameters(), lr=2e-4, betas=(0.5, 0.999))
optimizer_D = torch.optim.Adam(netD.parameters(), lr=2e-4, betas=(0.5, 0.999))
fake_pool = ImagePool(3)
for i in range(6):
    real_A, real_B = torch.randn(2, 4), torch.randn(2, 8)
    fake_B = netG(real_A)
    netD.requires_grad_(False)
    optimizer_G.zero_grad()
    loss_G = ((netD(fake_B) - 1) ** 2).mean() + (fake_B - real_B).abs().mean()
    loss_G.backward()
    optimizer_G.step()
    netD.requires_grad_(True)
    optimizer_D.zero_grad()
    fake = fake_pool.query(fake_B)
    loss_D = (((netD(real_B) - 1) ** 2).mean() + (netD(fake.detach()) ** 2).mean()) * 0.5
    loss_D.backward()
    optimizer_D.step()
    print(i, f"{loss_G.item():.6f} {loss_D.item():.6f}")
