# A physics-informed net whose network was left frozen (`requires_grad_(False)`, as a fine-tuning step leaves it):
# the residual reaches only the collocation points `x`, so the optimizer never updates anything. Unlike an
# energy-based model's Langevin steps, no later backward of the step trains the frozen parameters.
import torch
from torch import nn

torch.manual_seed(0)
net = nn.Sequential(nn.Linear(1, 16), nn.Tanh(), nn.Linear(16, 1)).requires_grad_(False)
opt = torch.optim.Adam(net.parameters(), 1e-3)
for step in range(6):
    x = torch.rand(16, 1, requires_grad=True)
    u = net(x)
    u_x = torch.autograd.grad(u.sum(), x, create_graph=True)[0]
    loss = (u_x - torch.cos(x)).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    print(step, f"{loss.item():.6f}")
