# Adaptive gradient clipping as an optimizer wrapper (vballoli/nfnets-pytorch, nfnets/agc.py and README.md): `AGC`
# subclasses torch.optim.Optimizer without running its __init__, shares the wrapped SGD's param_groups and state, and
# in its @torch.no_grad() step clips each gradient unit-wise in place (`p.grad.detach().data.copy_(...)`) before
# stepping the optimizer it wraps; its own zero_grad zeroes the gradients in place (set_to_none=False).
import hashlib
from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn, optim


def unitwise_norm(x: torch.Tensor):
    if x.ndim <= 1:
        dim = 0
        keepdim = False
    elif x.ndim in [2, 3]:
        dim = 0
        keepdim = True
    elif x.ndim == 4:
        dim = [1, 2, 3]
        keepdim = True
    else:
        raise ValueError('Wrong input dimensions')
    return torch.sum(x**2, dim=dim, keepdim=keepdim) ** 0.5


class AGC(optim.Optimizer):
    def __init__(self, params, optim: optim.Optimizer, clipping: float = 1e-2, eps: float = 1e-3, model=None,
                 ignore_agc=["fc"]):
        self.optim = optim
        defaults = dict(clipping=clipping, eps=eps)
        defaults = {**defaults, **optim.defaults}
        if not isinstance(ignore_agc, Iterable):
            ignore_agc = [ignore_agc]
        if model is not None:
            names = [name for name, module in model.named_modules()]
            for module_name in ignore_agc:
                if module_name not in names:
                    raise ModuleNotFoundError("Module name {} not found in the model".format(module_name))
            params = [{"params": list(module.parameters())} for name,
                      module in model.named_modules() if name not in ignore_agc]
        else:
            params = [{"params": params}]
        self.agc_params = params
        self.eps = eps
        self.clipping = clipping
        self.param_groups = optim.param_groups
        self.state = optim.state

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.agc_params:
            for p in group['params']:
                if p.grad is None:
                    continue
                param_norm = torch.max(unitwise_norm(p.detach()), torch.tensor(self.eps).to(p.device))
                grad_norm = unitwise_norm(p.grad.detach())
                max_norm = param_norm * self.clipping
                trigger = grad_norm > max_norm
                clipped_grad = p.grad * (max_norm / torch.max(grad_norm, torch.tensor(1e-6).to(grad_norm.device)))
                p.grad.detach().data.copy_(torch.where(trigger, clipped_grad, p.grad))
        return self.optim.step(closure)

    def zero_grad(self, set_to_none: bool = False):
        for group in self.agc_params:
            for p in group['params']:
                if p.grad is not None:
                    if set_to_none:
                        p.grad = None
                    else:
                        if p.grad.grad_fn is not None:
                            p.grad.detach_()
                        else:
                            p.grad.requires_grad_(False)
                        p.grad.zero_()


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)
        self.fc = nn.Linear(4, 3)

    def forward(self, x):
        return self.fc(F.relu(self.conv(x)).mean((2, 3)))


torch.manual_seed(0)
model = Net()
optimizer = torch.optim.SGD(model.parameters(), 0.1, momentum=0.9)
optimizer = AGC(model.parameters(), optimizer, model=model, ignore_agc=['fc'])
data = [(torch.randn(4, 3, 6, 6), torch.randint(3, (4,))) for _ in range(6)]
for step, (inputs, targets) in enumerate(data):
    loss = F.cross_entropy(model(inputs), targets)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    print(f"step {step} loss {loss.item()!r}")
print(hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in model.parameters())).hexdigest())
