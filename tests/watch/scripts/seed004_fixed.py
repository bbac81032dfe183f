# Seed 004, example 3 and the fixes: requires_grad set, no detach, `y = x * 2 + 1` out of place.
import torch

torch.manual_seed(0)
x = torch.randn(3, requires_grad=True)
y = x * 2
y += 1 # In-place operation
loss = y.sum()
try:
  loss.backward()
except RuntimeError as e:
  print(f"Error: {e}")
print(x.grad)
y = x * 2 + 1
y.sum().backward()
print(x.grad)
