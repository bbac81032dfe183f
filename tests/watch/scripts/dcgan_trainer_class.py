"""pytorch/examples dcgan/main.py's loop (https://github.com/pytorch/examples/blob/main/dcgan/main.py) in a trainer
class, the nets and optimizers as attributes: D on real, then on `fake.detach()`, optimizerD.step(), then G through
the same `fake`, optimizerG.step(). Linear nets on random points instead of DCGAN's convolutions on images."""
import torch
from torch import nn


class Trainer:
    def __init__(self):
        torch.manual_seed(0)
        self.netG, self.netD = nn.Linear(3, 2), nn.Sequential(nn.Linear(2, 1), nn.Sigmoid())
        self.optimizerD = torch.optim.Adam(self.netD.parameters(), lr=2e-4, betas=(0.5, 0.999))
        self.optimizerG = torch.optim.Adam(self.netG.parameters(), lr=2e-4, betas=(0.5, 0.999))
        self.criterion = nn.BCELoss()

    def fit(self, dataloader):
        for i, real in enumerate(dataloader):
            self.netD.zero_grad()
            label = torch.full((real.size(0), 1), 1.0)
            errD_real = self.criterion(self.netD(real), label)
            errD_real.backward()
            fake = self.netG(torch.randn(real.size(0), 3))
            label.fill_(0.0)
            errD_fake = self.criterion(self.netD(fake.detach()), label)
            errD_fake.backward()
            self.optimizerD.step()
            self.netG.zero_grad()
            label.fill_(1.0)
            errG = self.criterion(self.netD(fake), label)
            errG.backward()
            self.optimizerG.step()
            print(i, errD_real.item() + errD_fake.item(), errG.item())


t = Trainer()
t.fit([torch.randn(4, 2) for _ in range(4)])
print(*(p.sum().item() for p in [*t.netG.parameters(), *t.netD.parameters()]))
