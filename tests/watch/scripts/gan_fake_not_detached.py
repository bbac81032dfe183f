# PyTorch's DCGAN step with `netD(fake)` where it means `netD(fake.detach())`: D's backward frees the
# generator's graph, which the generator's loss then goes through again.
import torch
from torch import nn

torch.manual_seed(0)
netG = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 16), nn.Tanh())
netD = nn.Sequential(nn.Linear(16, 32), nn.LeakyReLU(0.2), nn.Linear(32, 1), nn.Sigmoid())
criterion = nn.BCELoss()
optimizerD = torch.optim.Adam(netD.parameters(), lr=2e-4, betas=(0.5, 0.999))
optimizerG = torch.optim.Adam(netG.parameters(), lr=2e-4, betas=(0.5, 0.999))

for i in range(4):
    real = torch.randn(8, 16)
    netD.zero_grad()
    label = torch.full((8, 1), 1.0)
    errD_real = criterion(netD(real), label)
    errD_real.backward()
    fake = netG(torch.randn(8, 8))
    label.fill_(0.0)
    errD_fake = criterion(netD(fake), label)
    errD_fake.backward()
    optimizerD.step()

    netG.zero_grad()
    label.fill_(1.0)
    errG = criterion(netD(fake), label)
    errG.backward()
    optimizerG.step()
    print(f"[{i}] Loss_D: {(errD_real + errD_fake).item():.4f} Loss_G: {errG.item():.4f}")
