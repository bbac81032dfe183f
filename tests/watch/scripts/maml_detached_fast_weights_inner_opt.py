# MAML with fast weights made as detached copies of the parameters, and an inner optimizer built on the model's
# parameters only to hold the inner learning rate (as higher's innerloop_ctx reads `inner_opt`): it never steps.
# The meta-loss reaches the copies only, so the meta-optimizer's parameters get no gradient.
import torch
from torch import nn
from torch.func import functional_call

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(1, 32), nn.ReLU(), nn.Linear(32, 1))
meta_opt = torch.optim.Adam(model.parameters(), lr=1e-3)
inner_opt = torch.optim.SGD(model.parameters(), lr=0.01)


def task():
    amplitude, phase = torch.rand(()) * 4 + 1, torch.rand(()) * 3
    x = torch.rand(20, 1) * 10 - 5
    return x, amplitude * torch.sin(x + phase)


for iteration in range(4):
    names = [n for n, _ in model.named_parameters()]
    fast = [p.detach().clone().requires_grad_() for p in model.parameters()]  # Bug: copies, cut from the model
    x, y = task()
    inner_loss = nn.functional.mse_loss(functional_call(model, dict(zip(names, fast)), (x[:10],)), y[:10])
    grads = torch.autograd.grad(inner_loss, fast)
    fast = [w - inner_opt.param_groups[0]["lr"] * g for w, g in zip(fast, grads)]
    meta_loss = nn.functional.mse_loss(functional_call(model, dict(zip(names, fast)), (x[10:],)), y[10:])
    meta_opt.zero_grad()
    meta_loss.backward()
    meta_opt.step()
    print(f"iteration {iteration}: meta-loss {meta_loss.item():.4f}")
