# The PINN above as meant: the forward and both derivatives inside the loop; and a derivative at fixed points taken
# once before it, only to print it (set-up, which trains nothing).
import math

import torch
from torch import nn

torch.manual_seed(0)
net = nn.Sequential(nn.Linear(1, 16), nn.Tanh(), nn.Linear(16, 1))
optimizer = torch.optim.Adam(net.parameters(), lr=0.01)
x = torch.linspace(-1, 1, 32).unsqueeze(1).requires_grad_()
u0 = net(x)
print(f"initial mean slope {torch.autograd.grad(u0.sum(), x)[0].mean().item():.6f}")
for step in range(3):
    optimizer.zero_grad()
    u = net(x)
    u_x = torch.autograd.grad(u, x, torch.ones_like(u), create_graph=True)[0]
    u_xx = torch.autograd.grad(u_x, x, torch.ones_like(u_x), create_graph=True)[0]
    loss = (u_xx + math.pi ** 2 * torch.sin(math.pi * x)).pow(2).mean()
    loss.backward()
    optimizer.step()
    print(f"step {step}: loss {loss.item():.6f}")
