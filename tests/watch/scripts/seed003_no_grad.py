# Seed 003, example two: a loss computed under torch.no_grad().
import torch

x = torch.tensor([2.0], requires_grad=True)
y = x * 3
with torch.no_grad():
    z = y * 2 #no grad computed here
loss = z**2 #loss computed without a graph
try:
    loss.backward()
except RuntimeError as e:
    print(f"Caught RuntimeError: {e}")
print("Continuing")
