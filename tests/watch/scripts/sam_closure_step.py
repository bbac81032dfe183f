# Trimmed from davda54/sam, sam.py (SAM.step) and README.md's closure usage: the first backward outside the
# optimizer, the second inside `optimizer.step(closure)` (step runs under no_grad, the closure under enable_grad),
# then zero_grad. Correct: nothing to report.
import torch
from torch import nn


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
                p.add_(p.grad * scale.to(p))
        if zero_grad:
            self.zero_grad()

    @torch.no_grad()
    def second_step(self, zero_grad=False):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.data = self.state[p]["old_p"]
        self.base_optimizer.step()
        if zero_grad:
            self.zero_grad()

    @torch.no_grad()
    def step(self, closure=None):
        closure = torch.enable_grad()(closure)  # the closure should do a full forward-backward pass
        self.first_step(zero_grad=True)
        closure()
        self.second_step()


torch.manual_seed(0)
model = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 1))
optimizer = SAM(model.parameters(), torch.optim.Adam, rho=0.1, lr=0.01)
for step in range(4):
    input, output = torch.randn(32, 4), torch.randn(32, 1)

    def closure():
        loss = nn.functional.mse_loss(model(input), output)
        loss.backward()
        return loss

    loss = nn.functional.mse_loss(model(input), output)
    loss.backward()
    optimizer.step(closure)
    optimizer.zero_grad()
    print(f"step {step} loss {loss.item():.6f}")
print(model[2].weight.sum().item())
