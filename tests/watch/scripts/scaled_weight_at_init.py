# Seed 001's mistake inside a module: a layer's effective weight (a learned scale times the weight, as weight
# scaling and equalized-learning-rate layers compute it) made once in __init__ and used by every forward; the model
# sits in an nn.Sequential inside main(), so the graph is held by a submodule (`model[0].scaled`).
import torch
from torch import nn


class ScaledLinear(nn.Module):
    def __init__(self, n):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(n, n) * 0.1)
        self.scale = nn.Parameter(torch.ones(()))
        self.scaled = self.scale * self.weight  # Bug: a graph built once, before training

    def forward(self, x):
        return x @ self.scaled.t()


def main():
    torch.manual_seed(0)
    model = nn.Sequential(ScaledLinear(4), nn.ReLU(), nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(3):
        loss = model(torch.randn(8, 4)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        print(f"step {step}: loss {loss.item():.4f}")


main()
