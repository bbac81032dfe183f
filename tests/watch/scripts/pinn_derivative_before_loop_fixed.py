"""pinn_derivative_before_loop.py fixed: `u` and its derivatives taken inside the loop. Before the loop the
residual of the untrained network is printed (its derivative taken with torch.autograd.grad, once, outside the
loop: no training step); after it an L-BFGS refinement, one `step(closure)` outside any loop, whose closure takes
the derivatives again at each evaluation (Adam, then L-BFGS, as PINN codes train)."""
import math

import torch
from torch import nn

torch.manual_seed(0)
net = nn.Sequential(nn.Linear(1, 16), nn.Tanh(), nn.Linear(16, 1))
optimizer = torch.optim.Adam(net.parameters(), lr=1e-2)
x = torch.linspace(-1, 1, 32).unsqueeze(1).requires_grad_()
edges = torch.tensor([[-1.0], [1.0]])


def residual():
    u = net(x)
    u_x = torch.autograd.grad(u, x, torch.ones_like(u), create_graph=True)[0]
    u_xx = torch.autograd.grad(u_x, x, torch.ones_like(u_x), create_graph=True)[0]
    return (-u_xx - math.pi ** 2 * torch.sin(math.pi * x)).pow(2).mean() + net(edges).pow(2).mean()


u = net(x)
u_x = torch.autograd.grad(u, x, torch.ones_like(u))[0]
print(f"before training: mean |u_x| {u_x.abs().mean().item():.6f}")
for step in range(3):
    optimizer.zero_grad()
    loss = residual()
    loss.backward()
    optimizer.step()
    print(f"step {step}: loss {loss.item():.6f}")
lbfgs = torch.optim.LBFGS(net.parameters(), lr=0.5, max_iter=5)


def closure():
    lbfgs.zero_grad()
    loss = residual()
    loss.backward()
    return loss


lbfgs.step(closure)
print(f"after L-BFGS: loss {residual().item():.6f}")
print(sum(p.sum().item() for p in net.parameters()))
