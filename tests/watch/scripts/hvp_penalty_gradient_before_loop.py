# A curvature penalty by Hessian-vector products (nimarb/pytorch_influence_functions' hvp, inside the training loop)
# along the gradient `v` of a held-out batch, taken once before the loop with create_graph=True: every step's
# torch.autograd.grad(..., create_graph=True) goes through v's graph, built from the weights before any update.
import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd import grad

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))
X, T = torch.randn(12, 4), torch.randint(0, 3, (12,))
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
params = list(model.parameters())
v = grad(F.cross_entropy(model(X[:4]), T[:4]), params, create_graph=True)
for step in range(4):
    loss = F.cross_entropy(model(X[4:]), T[4:])
    first_grads = grad(loss, params, retain_graph=True, create_graph=True)
    hv = grad(sum(torch.sum(g * e) for g, e in zip(first_grads, v)), params, create_graph=True)
    total = loss + 1e-3 * sum((h ** 2).sum() for h in hv)
    optimizer.zero_grad()
    total.backward()
    optimizer.step()
    print(f"step {step}: loss {total.item():.6f}")
