# A PINN for u'' = -pi^2 sin(pi x) on fixed collocation points: `u` and `u_x` taken once, before the loop (the
# points never change), `u_xx` from that `u_x` every step (meant: the forward and u_x inside the loop).
import math

import torch
from torch import nn

torch.manual_seed(0)
net = nn.Sequential(nn.Linear(1, 16), nn.Tanh(), nn.Linear(16, 1))
optimizer = torch.optim.Adam(net.parameters(), lr=0.01)
x = torch.linspace(-1, 1, 32).unsqueeze(1).requires_grad_()
u = net(x)
u_x = torch.autograd.grad(u, x, torch.ones_like(u), create_graph=True)[0]
for step in range(3):
    optimizer.zero_grad()
    u_xx = torch.autograd.grad(u_x, x, torch.ones_like(u_x), create_graph=True)[0]
    loss = (u_xx + math.pi ** 2 * torch.sin(math.pi * x)).pow(2).mean()
    loss.backward()
    optimizer.step()
    print(f"step {step}: loss {loss.item():.6f}")
