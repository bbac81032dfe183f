"""wgan_n_critic.py written as a class, as GAN trainers often are: the models and their optimizers are attributes
(`self.og`, `self.od`) and a method runs the loop. `fake`, made once per generator step, feeds the critic's steps
(detached) and then the generator's loss. Correct."""
import torch
from torch import nn
from torch.optim import SGD


class GAN:
    def __init__(self):
        torch.manual_seed(0)
        self.g, self.d = nn.Linear(2, 2), nn.Linear(2, 1)
        self.og, self.od = SGD(self.g.parameters(), lr=0.1), SGD(self.d.parameters(), lr=0.1)

    def train(self, steps):
        for step in range(steps):
            fake = self.g(torch.randn(4, 2))
            for critic_it in range(2):
                ld = self.d(fake.detach()).mean() - self.d(torch.randn(4, 2)).mean()
                self.od.zero_grad()
                ld.backward()
                self.od.step()
            lg = -self.d(fake).mean()
            self.og.zero_grad()
            lg.backward()
            self.og.step()
            print(f"step {step} critic {ld.item()} generator {lg.item()}")


gan = GAN()
gan.train(3)
print(*(p.sum().item() for p in [*gan.g.parameters(), *gan.d.parameters()]))
