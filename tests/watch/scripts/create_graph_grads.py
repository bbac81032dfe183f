"""The loop of davda54/ada-hessian's README (`loss.backward(create_graph=True)  # this is the important line!`,
then `optimizer.step()`; Adam stands in for AdaHessian), with no zero_grad: each step's gradient keeps its graph
on `.grad`, and the next backward adds its own to it."""
import torch
from torch import nn

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
for step in range(4):
    x = torch.randn(16, 4)
    loss = model(x).pow(2).mean()
    loss.backward(create_graph=True)
    optimizer.step()
    print(f"step {step} loss {loss.item():.6f}")
