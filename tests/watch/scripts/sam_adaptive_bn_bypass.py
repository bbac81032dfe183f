# Trimmed from davda54/sam, sam.py and example/train.py (+ example/utility/bypass_bn.py): adaptive SAM over SGD
# sharing its param_groups, two forward-backward passes per update, BatchNorm's running statistics frozen (momentum 0)
# for the second pass, accuracy read from the first pass's predictions after the update. Correct: nothing to report.
import torch
from torch import nn


class SAM(torch.optim.Optimizer):
    def __init__(self, params, base_optimizer, rho=0.05, adaptive=False, **kwargs):
        super().__init__(params, dict(rho=rho, adaptive=adaptive, **kwargs))
        self.base_optimizer = base_optimizer(self.param_groups, **kwargs)
        self.param_groups = self.base_optimizer.param_groups
        self.defaults.update(self.base_optimizer.defaults)

    @torch.no_grad()
    def first_step(self, zero_grad=False):
        grad_norm = torch.norm(torch.stack([((torch.abs(p) if g["adaptive"] else 1.0) * p.grad).norm(p=2)
                                            for g in self.param_groups for p in g["params"] if p.grad is not None]))
        for group in self.param_groups:
            scale = group["rho"] / (grad_norm + 1e-12)
            for p in group["params"]:
                if p.grad is None:
                    continue
                self.state[p]["old_p"] = p.data.clone()
                p.add_((torch.pow(p, 2) if group["adaptive"] else 1.0) * p.grad * scale.to(p))
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


def set_bn_momentum(model, enable):  # bypass_bn.py's enable_running_stats / disable_running_stats
    for m in model.modules():
        if isinstance(m, nn.BatchNorm1d):
            if enable and hasattr(m, "backup_momentum"):
                m.momentum = m.backup_momentum
            elif not enable:
                m.backup_momentum, m.momentum = m.momentum, 0


torch.manual_seed(0)
model = nn.Sequential(nn.Linear(6, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 3))
optimizer = SAM(model.parameters(), torch.optim.SGD, rho=2.0, adaptive=True, lr=0.1, momentum=0.9, weight_decay=5e-4)
for step in range(4):
    inputs, targets = torch.randn(16, 6), torch.randint(0, 3, (16,))
    set_bn_momentum(model, True)
    predictions = model(inputs)
    loss = nn.functional.cross_entropy(predictions, targets, reduction="none", label_smoothing=0.1)
    loss.mean().backward()
    optimizer.first_step(zero_grad=True)
    set_bn_momentum(model, False)
    nn.functional.cross_entropy(model(inputs), targets, label_smoothing=0.1).backward()
    optimizer.second_step(zero_grad=True)
    with torch.no_grad():
        correct = torch.argmax(predictions.data, 1) == targets
        print(f"step {step} loss {loss.cpu().mean().item():.6f} acc {correct.float().mean().item():.4f}")
print(model[1].running_mean[:3].tolist(), model[3].weight.sum().item())
