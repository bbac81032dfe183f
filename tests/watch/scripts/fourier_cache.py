# Fourier features cached two module levels deep (`model.enc.cached`) by the first forward, from a fixed random
# projection made with requires_grad=True that no optimizer holds: the cache keeps the graph of step 1.
import hashlib

import torch
from torch import nn


class Fourier(nn.Module):
    def __init__(self):
        super().__init__()
        self.B = torch.randn(2, 4, requires_grad=True)
        self.cached = None

    def forward(self, x):
        if self.cached is None:
            self.cached = torch.cat([(x @ self.B).sin(), (x @ self.B).cos()], -1)
        return self.cached


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.enc = Fourier()
        self.head = nn.Linear(8, 1)

    def forward(self, x):
        return self.head(self.enc(x))


torch.manual_seed(0)
grid, target = torch.rand(16, 2), torch.randn(16, 1)
model = Model()
opt = torch.optim.SGD(model.head.parameters(), lr=0.1)
for step in range(3):
    loss = (model(grid) - target).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    print(f"step {step} loss {loss.item():.6f}")
print(hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in model.parameters())).hexdigest())
