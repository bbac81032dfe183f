# Batch renormalization as ludvb/batchrenorm writes it, its running statistics updated with the step's graph in
# forward and both detached at the end of each step, as the guard's fixes say, one after the other: quiet.
import torch
from torch import nn

torch.manual_seed(0)


class BatchRenorm1d(nn.Module):
    def __init__(self, num_features, eps=1e-3, momentum=0.01):
        super().__init__()
        self.register_buffer("running_mean", torch.zeros(num_features))
        self.register_buffer("running_std", torch.ones(num_features))
        self.weight = nn.Parameter(torch.ones(num_features))
        self.bias = nn.Parameter(torch.zeros(num_features))
        self.eps, self.momentum = eps, momentum

    def forward(self, x):
        batch_mean = x.mean(0)
        batch_std = x.std(0, unbiased=False) + self.eps
        r = (batch_std.detach() / self.running_std).clamp_(1 / 3.0, 3.0)
        d = ((batch_mean.detach() - self.running_mean) / self.running_std).clamp_(-5.0, 5.0)
        x = (x - batch_mean) / batch_std * r + d
        self.running_mean += self.momentum * (batch_mean - self.running_mean)
        self.running_std += self.momentum * (batch_std - self.running_std)
        return self.weight * x + self.bias


model = nn.Sequential(nn.Linear(5, 8), BatchRenorm1d(8), nn.ReLU(), nn.Linear(8, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for step in range(4):
    loss = model(torch.randn(6, 5)).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    model[1].running_mean = model[1].running_mean.detach()
    model[1].running_std = model[1].running_std.detach()
    print(f"step {step}: loss {loss.item()!r}")
print(repr(model[1].running_std.sum().item()))
