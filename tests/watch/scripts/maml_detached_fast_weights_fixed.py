# maml_detached_fast_weights.py fixed: fast weights made from the parameters, second-order gradients.
import torch
from torch import nn
from torch.func import functional_call

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(1, 32), nn.ReLU(), nn.Linear(32, 1))
meta_opt = torch.optim.Adam(model.parameters(), lr=1e-3)
inner_lr = 0.01


def task():
    amplitude, phase = torch.rand(()) * 4 + 1, torch.rand(()) * 3
    x = torch.rand(20, 1) * 10 - 5
    return x, amplitude * torch.sin(x + phase)


for iteration in range(3):
    names = [n for n, _ in model.named_parameters()]
    fast = list(model.parameters())  # the parameters themselves: the meta-loss reaches them
    x, y = task()
    inner_loss = nn.functional.mse_loss(functional_call(model, dict(zip(names, fast)), (x[:10],)), y[:10])
    grads = torch.autograd.grad(inner_loss, fast, create_graph=True)
    fast = [w - inner_lr * g for w, g in zip(fast, grads)]
    meta_loss = nn.functional.mse_loss(functional_call(model, dict(zip(names, fast)), (x[10:],)), y[10:])
    meta_opt.zero_grad()
    meta_loss.backward()
    meta_opt.step()
    print(f"iteration {iteration}: meta-loss {meta_loss.item():.4f}")
