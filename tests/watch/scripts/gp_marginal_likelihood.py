# An exact GP's negative log marginal likelihood in plain torch (Rasmussen & Williams, Algorithm 2.1, as in the
# GPyTorch-free tutorials): the RBF kernel's log lengthscale, log outputscale and log noise are Parameters, the kernel
# matrix is built and Cholesky-factored anew every step, and the loss is 0.5 y^T K^-1 y + sum(log diag L).
import math

import torch
import torch.nn as nn


class ExactGP(nn.Module):
    def __init__(self):
        super().__init__()
        self.log_lengthscale = nn.Parameter(torch.zeros(()))
        self.log_outputscale = nn.Parameter(torch.zeros(()))
        self.log_noise = nn.Parameter(torch.tensor(-2.0))

    def kernel(self, a, b):
        d2 = (a[:, None] - b[None, :]).pow(2)
        return self.log_outputscale.exp() * torch.exp(-0.5 * d2 / self.log_lengthscale.exp().pow(2))

    def nll(self, x, y):
        K = self.kernel(x, x) + self.log_noise.exp() * torch.eye(len(x), dtype=x.dtype)
        L = torch.linalg.cholesky(K)
        alpha = torch.cholesky_solve(y[:, None], L)
        return 0.5 * (y[:, None] * alpha).sum() + L.diagonal().log().sum() + 0.5 * len(x) * math.log(2 * math.pi)


torch.manual_seed(0)
x = torch.linspace(0, 3, 10, dtype=torch.double)
y = torch.sin(2 * x) + 0.1 * torch.randn(10, dtype=torch.double)
gp = ExactGP().double()
opt = torch.optim.Adam(gp.parameters(), lr=0.1)
for step in range(5):
    opt.zero_grad()
    loss = gp.nll(x, y)
    loss.backward()
    opt.step()
    print(f"{loss.item():.10f}")
print(" ".join(f"{p.item():.10f}" for p in gp.parameters()))
