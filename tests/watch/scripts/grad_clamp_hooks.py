# Gradient clipping by Tensor.register_hook, as in the discuss.pytorch.org answer "How to do gradient clipping in
# pytorch?" (`p.register_hook(lambda grad: torch.clamp(grad, -clip_value, clip_value))` on every parameter, once) and
# an activation hook that rescales the gradient flowing into a shared trunk (DANN-style, registered every forward).
# Correct: nothing to report.
import torch
from torch import nn


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.trunk, self.head = nn.Linear(5, 12), nn.Linear(12, 2)

    def forward(self, x, scale):
        h = torch.relu(self.trunk(x))
        if self.training:
            h.register_hook(lambda grad: grad * scale)
        return self.head(h)


torch.manual_seed(0)
model = Net()
clip_value = 0.05
for p in model.parameters():
    p.register_hook(lambda grad: torch.clamp(grad, -clip_value, clip_value))
optimizer = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.5)
for step in range(5):
    x, y = torch.randn(20, 5), torch.randint(0, 2, (20,))
    optimizer.zero_grad()
    loss = nn.functional.cross_entropy(model(x, scale=0.5 ** step), y)
    loss.backward()
    optimizer.step()
    print(f"step {step} loss {loss.item():.6f} grad {model.trunk.weight.grad.abs().max().item():.6f}")
print(model.trunk.weight.sum().item())
