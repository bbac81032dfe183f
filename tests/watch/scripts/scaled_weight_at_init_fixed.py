# scaled_weight_at_init.py fixed: the scaled weight computed in forward.
import torch
from torch import nn


class ScaledLinear(nn.Module):
    def __init__(self, n):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(n, n) * 0.1)
        self.scale = nn.Parameter(torch.ones(()))

    def forward(self, x):
        return x @ (self.scale * self.weight).t()  # the scaled weight made by every forward


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
