# Seed 001, fixed as the question found: y recomputed inside the loop.
import torch

measure = torch.nn.MSELoss()

x = torch.tensor([1, 0], dtype=torch.float64)
t = torch.eye(2, dtype=torch.float64, requires_grad=True)
a = torch.ones(2, dtype=torch.float64, requires_grad=True)
y = t @ a

for __ in range(2):
    # x_out = t @ (x + y)  # Raises `RuntimeError` later on.
    x_out = t @ (x + t @ a)  # Works fine.
    loss = measure(x_out, x)
    loss.backward()
    print(f"iteration {__}: loss {loss.item():.6f}")
print(t.grad, a.grad)
