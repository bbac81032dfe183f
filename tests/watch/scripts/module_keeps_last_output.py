"""A module that keeps its last output for logging (attention maps, features): correct, and quiet under watch."""
import torch
from torch import nn

torch.manual_seed(0)


class M(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(3, 1)
        self.last_out = None

    def forward(self, x):
        out = self.fc(x)
        self.last_out = out
        return out


model = M()
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for step in range(3):
    loss = model(torch.randn(4, 3)).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    print(f"step {step} loss {loss.item():.6f} last mean {model.last_out.mean().item():.6f}")
