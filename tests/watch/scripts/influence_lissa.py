# Influence functions (nimarb/pytorch_influence_functions influence_function.py: grad_z, s_test, hvp): LiSSA's
# inverse-Hessian-vector product, a loop of torch.autograd.grad(..., create_graph=True) through the test gradient `v`
# taken before it, then the influence of each training point, then training on the most helpful ones.
import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd import grad

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))
X, T = torch.randn(12, 4), torch.randint(0, 3, (12,))
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)


def grad_z(x, t):
    loss = F.cross_entropy(model(x), t)
    return list(grad(loss, [p for p in model.parameters() if p.requires_grad], create_graph=True))


def hvp(y, w, v):
    first_grads = grad(y, w, retain_graph=True, create_graph=True)
    elemwise_products = 0
    for grad_elem, v_elem in zip(first_grads, v):
        elemwise_products += torch.sum(grad_elem * v_elem)
    return grad(elemwise_products, w, create_graph=True)


def s_test(x_test, t_test, damp=0.01, scale=25.0, recursion_depth=3):
    v = grad_z(x_test, t_test)
    h_estimate = v.copy()
    for i in range(recursion_depth):
        for k in range(0, 12, 4):
            loss = F.cross_entropy(model(X[k:k + 4]), T[k:k + 4])
            hv = hvp(loss, [p for p in model.parameters() if p.requires_grad], h_estimate)
            h_estimate = [(_v + (1 - damp) * _h_e - _hv / scale).detach() for _v, _h_e, _hv in zip(v, h_estimate, hv)]
            break
    return h_estimate


s = s_test(X[:2], T[:2])
influences = [-sum(torch.sum(k * j).item() for k, j in zip(grad_z(X[i:i + 1], T[i:i + 1]), s)) / 12 for i in range(12)]
keep = sorted(range(12), key=lambda i: influences[i])[:8]
for step in range(4):
    idx = keep[step % 2 * 4:step % 2 * 4 + 4]
    loss = F.cross_entropy(model(X[idx]), T[idx])
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    print(f"step {step}: loss {loss.item():.6f}")
print("weights", repr(torch.cat([p.flatten() for p in model.parameters()]).double().sum().item()))
