# Seed 004, example 1: a detached tensor.
import torch

x = torch.randn(3, requires_grad=True)
y = x * 2
z = y.detach()  # z is detached
w = z + 3
try:
    w.backward()
except RuntimeError as e:
    print(f"Error: {e}")
