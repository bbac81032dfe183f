# Hidden layers kept in a plain Python list: not registered, so model.parameters() and the optimizer miss them and
# they keep their initial weights (the bug of engineermaxxing.com/micro/lessons/pytorch-internals.html,
# `self.layers = [nn.Linear(64, 32), nn.Linear(32, 10)]`, here with a registered output layer).
import torch
from torch import nn


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = [nn.Linear(8, 16), nn.Linear(16, 16)]  # Bug: a plain list
        self.out = nn.Linear(16, 1)

    def forward(self, x):
        for layer in self.layers:
            x = torch.relu(layer(x))
        return self.out(x)


torch.manual_seed(0)
model = MLP()
optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
x, y = torch.randn(32, 8), torch.randn(32, 1)
for epoch in range(3):
    loss = nn.functional.mse_loss(model(x), y)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    print(f"epoch {epoch}: loss {loss.item():.4f}")
