# sam_predictions_reused.py with the guard's first fix applied: `predictions` computed again after the change.
import hashlib

import torch
from torch import nn
from torch.nn import functional as F


class SAM(torch.optim.Optimizer):
    def __init__(self, params, base_optimizer, rho=0.05, **kwargs):
        super().__init__(params, dict(rho=rho, **kwargs))
        self.base_optimizer = base_optimizer(self.param_groups, **kwargs)
        self.param_groups = self.base_optimizer.param_groups

    @torch.no_grad()
    def first_step(self, zero_grad=False):
        grad_norm = torch.norm(torch.stack([p.grad.norm(p=2) for g in self.param_groups for p in g["params"]
                                            if p.grad is not None]), p=2)
        for group in self.param_groups:
            scale = group["rho"] / (grad_norm + 1e-12)
            for p in group["params"]:
                if p.grad is None:
                    continue
                self.state[p]["old_p"] = p.data.clone()
                p.add_(p.grad * scale.to(p))  # climb to the local maximum "w + e(w)"
        if zero_grad:
            self.zero_grad()

    @torch.no_grad()
    def second_step(self, zero_grad=False):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.data = self.state[p]["old_p"]  # get back to "w" from "w + e(w)"
        self.base_optimizer.step()  # do the actual "sharpness-aware" update
        if zero_grad:
            self.zero_grad()


torch.manual_seed(0)
model = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 1))
optimizer = SAM(model.parameters(), torch.optim.SGD, rho=0.05, lr=0.1, momentum=0.9)
for step in range(3):
    inputs, targets = torch.randn(32, 4), torch.randn(32, 1)
    # first forward-backward step
    predictions = model(inputs)
    loss = F.mse_loss(predictions, targets)
    loss.backward()
    optimizer.first_step(zero_grad=True)
    # second forward-backward step
    predictions = model(inputs)
    F.mse_loss(predictions, targets).backward()
    optimizer.second_step(zero_grad=True)
    print(f"step {step} loss {loss.item():.6f}")
print(hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in model.parameters())).hexdigest())
