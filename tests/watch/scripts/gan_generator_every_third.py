# watch: --check always
# A GAN whose networks keep their own optimizer (`nets.g.optimizer`), the generator stepped every third
# iteration only, with the discriminator frozen for the generator's loss: that loss reaches the generator's
# parameters only, whose optimizer has not stepped before the third iteration. Correct, and quiet under watch.
import torch
from torch import nn

torch.manual_seed(0)
nets = nn.ModuleDict({"g": nn.Linear(2, 2), "d": nn.Linear(2, 1)})
nets.g.optimizer = torch.optim.SGD(nets.g.parameters(), lr=0.1)
nets.d.optimizer = torch.optim.SGD(nets.d.parameters(), lr=0.1)
for step in range(7):
    fake = nets.g(torch.randn(4, 2))
    ld = nets.d(fake.detach()).mean() - nets.d(torch.randn(4, 2)).mean()
    nets.d.optimizer.zero_grad()
    ld.backward()
    nets.d.optimizer.step()
    if step % 3 == 2:
        nets.d.requires_grad_(False)
        lg = -nets.d(fake).mean()
        nets.g.optimizer.zero_grad()
        lg.backward()
        nets.g.optimizer.step()
        nets.d.requires_grad_(True)
        print(f"step {step} generator {lg.item():.6f}")
    print(f"step {step} critic {ld.item():.6f}")
print(" ".join(f"{p.sum().item():.6f}" for p in nets.parameters()))
