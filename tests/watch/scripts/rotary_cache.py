# A rotary-embedding cache two module levels deep (`model.rot.cached_freqs`), built by the first forward from a
# learned frequency and kept, with its graph, for the next steps.
import hashlib

import torch
from torch import nn


class Rotary(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.inv_freq = nn.Parameter(1.0 / 10 ** torch.linspace(0, 1, dim))
        self.cached_freqs = None

    def forward(self, x):
        if self.cached_freqs is None:
            self.cached_freqs = torch.outer(torch.arange(x.shape[0], dtype=x.dtype), self.inv_freq)
        return x * self.cached_freqs.cos() + x.flip(-1) * self.cached_freqs.sin()


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(4, 4)
        self.rot = Rotary(4)
        self.head = nn.Linear(4, 1)

    def forward(self, x):
        return self.head(self.rot(self.proj(x)))


torch.manual_seed(0)
model = Model()
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for step in range(3):
    x, y = torch.randn(6, 4), torch.randn(6, 1)
    loss = (model(x) - y).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    print(f"step {step} loss {loss.item():.6f}")
print(hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in model.parameters())).hexdigest())
