"""A physics-informed network trained by L-BFGS alone: one `optimizer.step(closure)`, outside any loop, whose
closure takes the network's derivatives with torch.autograd.grad(create_graph=True) at each of the evaluations
step() runs (the training step of many PINN scripts; DeepXDE's L-BFGS runs its closure the same way)."""
import math

import torch
from torch import nn

torch.manual_seed(0)
net = nn.Sequential(nn.Linear(1, 16), nn.Tanh(), nn.Linear(16, 1))
optimizer = torch.optim.LBFGS(net.parameters(), lr=0.5, max_iter=8)
x = torch.linspace(-1, 1, 32).unsqueeze(1).requires_grad_()
edges = torch.tensor([[-1.0], [1.0]])


def closure():
    optimizer.zero_grad()
    u = net(x)
    u_x = torch.autograd.grad(u, x, torch.ones_like(u), create_graph=True)[0]
    u_xx = torch.autograd.grad(u_x, x, torch.ones_like(u_x), create_graph=True)[0]
    loss = (-u_xx - math.pi ** 2 * torch.sin(math.pi * x)).pow(2).mean() + net(edges).pow(2).mean()
    loss.backward()
    print(f"loss {loss.item():.6f}")
    return loss


optimizer.step(closure)
print(sum(p.sum().item() for p in net.parameters()))
