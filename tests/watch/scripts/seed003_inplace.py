# Seed 003, example three: an in-place addition (nothing saved for backward is changed: it works).
import torch

x = torch.tensor([2.0], requires_grad=True)
y = x * 3
y.add_(1)  #in-place operation
loss = y**2
try:
    loss.backward()
except RuntimeError as e:
    print(f"Caught RuntimeError: {e}")

print("Continuing")
print(x.grad)
