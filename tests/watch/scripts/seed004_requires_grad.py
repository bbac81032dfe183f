# Seed 004, example 2: requires_grad never set.
import torch

x = torch.randn(3) # requires_grad defaults to False
y = x * 2
try:
    y.backward()
except RuntimeError as e:
    print(f"Error: {e}")
