# Layers instantiated in forward ("Can I instantiate layers in forward function?", discuss.pytorch.org/t/105054,
# its Code_1): each forward makes new layers, which no optimizer holds, so they are never trained.
import torch
from torch import nn


class MyNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.layer1 = nn.Linear(8, 16)

    def forward(self, x):
        out = self.layer1(x)
        self.layer2 = nn.Linear(16, 1)
        return self.layer2(torch.relu(out))


torch.manual_seed(0)
model = MyNet()
optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
x, y = torch.randn(32, 8), torch.randn(32, 1)
for step in range(3):
    optimizer.zero_grad()
    loss = nn.functional.mse_loss(model(x), y)
    loss.backward()
    optimizer.step()
    print(f"step {step}: loss {loss.item():.4f}")
