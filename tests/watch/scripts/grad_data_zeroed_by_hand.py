# Gradients cleared by a helper of its own, as code written before zero_grad(set_to_none=True) did (pyro 0.1's
# util.zero_grads, DARTS's Architect._backward_step): p.grad.data.zero_(), through .data, which no version counts.
# Correct: each update applies only its own step's gradient.
import torch
import torch.nn as nn
import torch.nn.functional as F


def zero_grads(tensors):
    """Sets gradients of list of Variables to zero in place"""
    for p in tensors:
        if p.grad is not None:
            p.grad.data.zero_()


torch.manual_seed(0)
model = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 1))
optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
x, y = torch.randn(64, 4), torch.randn(64, 1)
for step in range(8):
    loss = F.mse_loss(model(x), y)
    loss.backward()
    optimizer.step()
    zero_grads(model.parameters())
    print(f"step {step}: loss {loss.item():.6f}")
print(f"w {model[0].weight.sum().item():.6f}")
