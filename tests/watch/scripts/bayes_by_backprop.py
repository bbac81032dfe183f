# Bayes by backprop (Blundell et al.), as in blitz-bayesian-pytorch's BayesianLinear: each forward samples the
# weights w = mu + log1p(exp(rho)) * eps, stores them on the layer with the KL term of that sample (log q(w) - log p(w)),
# and the loss is the data NLL plus the layers' KL, averaged over two samples per step.
import math

import torch
import torch.nn as nn
import torch.nn.functional as F


class BayesianLinear(nn.Module):
    def __init__(self, n_in, n_out):
        super().__init__()
        self.mu = nn.Parameter(torch.randn(n_out, n_in) * 0.1)
        self.rho = nn.Parameter(torch.full((n_out, n_in), -3.0))
        self.weight = None
        self.kl = 0

    def forward(self, x):
        sigma = F.softplus(self.rho)
        eps = torch.randn_like(sigma)
        self.weight = self.mu + sigma * eps
        log_q = (-0.5 * eps.pow(2) - sigma.log() - 0.5 * math.log(2 * math.pi)).sum()
        log_p = (-0.5 * self.weight.pow(2) - 0.5 * math.log(2 * math.pi)).sum()
        self.kl = log_q - log_p
        return x @ self.weight.t()


torch.manual_seed(0)
net = nn.Sequential(BayesianLinear(4, 10), nn.Tanh(), BayesianLinear(10, 2))
opt = torch.optim.Adam(net.parameters(), lr=0.01)
x, y = torch.randn(16, 4), torch.randint(0, 2, (16,))
for step in range(4):
    opt.zero_grad()
    loss = 0
    for _ in range(2):
        nll = F.cross_entropy(net(x), y, reduction="sum")
        kl = sum(m.kl for m in net.modules() if isinstance(m, BayesianLinear))
        loss = loss + (nll + kl / 4) / 2
    loss.backward()
    opt.step()
    print(f"{loss.item():.6f}")
print(" ".join(f"{v:.6f}" for v in net[2].mu.flatten()[:6].tolist()))
