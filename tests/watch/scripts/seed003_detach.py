# Seed 003, example one: a loss computed from a detached tensor.
import torch

x = torch.tensor([2.0], requires_grad=True)
y = x * 3
z = y.detach() # detached from the graph
loss = z**2
try:
    loss.backward() # this line causes the error
except RuntimeError as e:
    print(f"Caught RuntimeError: {e}")

print("Continuing")
