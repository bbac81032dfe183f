# Seed 003, fixed: the loss computed from y itself, with grad enabled, out of place.
import torch

x = torch.tensor([2.0], requires_grad=True)
y = x * 3
z = y * 2
loss = z**2
loss.backward()
print(x.grad)
y = x * 3 + 1
loss = y**2
loss.backward()
print(x.grad)
