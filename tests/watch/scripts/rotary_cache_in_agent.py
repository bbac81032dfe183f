# The rotary cache of rotary_cache.py, with the model and its optimizer held by a plain object (as an RL library's
# algorithm holds its policy): no variable of the script holds a module or an optimizer itself.
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


class Agent:
    def __init__(self):
        self.policy = nn.Sequential(nn.Linear(4, 4), Rotary(4), nn.Linear(4, 1))
        self.optimizer = torch.optim.SGD(self.policy.parameters(), lr=0.1)


torch.manual_seed(0)
agent = Agent()
for step in range(3):
    x, y = torch.randn(6, 4), torch.randn(6, 1)
    loss = (agent.policy(x) - y).pow(2).mean()
    agent.optimizer.zero_grad()
    loss.backward()
    agent.optimizer.step()
    print(f"step {step} loss {loss.item():.6f}")
print(hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in agent.policy.parameters())).hexdigest())
