"""A model whose forward takes torch.autograd.grad(create_graph=True) in a loop (a power-series log-determinant, as
invertible ResNets compute it): the training loop is the script's, not the loop inside the forward."""
import torch
import torch.nn as nn

LOOP = True
torch.manual_seed(0)


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.f = nn.Sequential(nn.Linear(4, 8), nn.ELU(), nn.Linear(8, 4))

    def forward(self, x):
        fx = self.f(x)
        u = torch.randn_like(x)
        if LOOP:
            v, trace = u, 0
            for j in range(1, 3):
                v = torch.autograd.grad(fx, x, grad_outputs=v, retain_graph=True, create_graph=True)[0]
                trace = trace + (v * u).sum(1) * (-1) ** (j + 1) / j
        else:
            v1 = torch.autograd.grad(fx, x, grad_outputs=u, retain_graph=True, create_graph=True)[0]
            v2 = torch.autograd.grad(fx, x, grad_outputs=v1, retain_graph=True, create_graph=True)[0]
            trace = (v1 * u).sum(1) - (v2 * u).sum(1) / 2
        return fx + x, trace


scale = nn.Parameter(torch.ones(4))
block = Block()
opt = torch.optim.Adam([scale, *block.parameters()], 1e-3)
for step in range(4):
    z, logdet = block(torch.randn(8, 4) * scale)
    loss = (0.5 * z.pow(2).sum(1) - logdet).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
print("trained", scale.sum().item())
