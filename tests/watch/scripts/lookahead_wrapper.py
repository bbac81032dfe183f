# Trimmed from alphadl/lookahead.pytorch, lookahead.py (Lookahead(base_optimizer, k, alpha)): a wrapper sharing the
# inner optimizer's param_groups and state, slow weights kept in its own state (`param_state["slow_param"]`, made by
# torch.zeros_like + copy_), every k steps moved towards the fast weights and copied back with `fast.data.copy_`.
# Correct: nothing to report.
from collections import defaultdict

import torch
from torch import nn
from torch.optim.optimizer import Optimizer


class Lookahead(Optimizer):
    def __init__(self, optimizer, k=5, alpha=0.5):
        self.optimizer, self.k, self.alpha = optimizer, k, alpha
        self.param_groups, self.defaults = self.optimizer.param_groups, self.optimizer.defaults
        self.state, self.fast_state = defaultdict(dict), self.optimizer.state
        for group in self.param_groups:
            group["counter"] = 0

    def update(self, group):
        for fast in group["params"]:
            param_state = self.state[fast]
            if "slow_param" not in param_state:
                param_state["slow_param"] = torch.zeros_like(fast.data)
                param_state["slow_param"].copy_(fast.data)
            slow = param_state["slow_param"]
            slow += (fast.data - slow) * self.alpha
            fast.data.copy_(slow)

    def zero_grad(self, set_to_none=True):  # torch 2's Optimizer.zero_grad reads hooks this class never set
        self.optimizer.zero_grad(set_to_none)

    def step(self, closure=None):
        loss = self.optimizer.step(closure)
        for group in self.param_groups:
            if group["counter"] == 0:
                self.update(group)
            group["counter"] += 1
            if group["counter"] >= self.k:
                group["counter"] = 0
        return loss


torch.manual_seed(0)
model = nn.Sequential(nn.Linear(3, 8), nn.Tanh(), nn.Linear(8, 1))
optimizer = Lookahead(torch.optim.Adam(model.parameters(), lr=0.05), k=3, alpha=0.5)
for step in range(7):
    x = torch.randn(16, 3)
    loss = (model(x) - x.sum(1, keepdim=True)).pow(2).mean()
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    print(f"step {step} loss {loss.item():.6f}")
print(model[0].weight.sum().item())
