# Trimmed from pytorch/tutorials, intermediate_source/per_sample_grads.py (torch.func.grad of a functional_call,
# vmapped over the batch, parameters detached into a dict), used as DP-SGD does it: each sample's gradient clipped,
# summed with noise and written into p.grad for the optimizer. No backward. Correct: nothing to report.
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.func import functional_call, grad, vmap

torch.manual_seed(0)


class SimpleCNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(10, 16), nn.Linear(16, 4)

    def forward(self, x):
        return F.log_softmax(self.fc2(F.relu(self.fc1(x))), dim=-1)


model = SimpleCNN()
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)


def compute_loss(params, buffers, sample, target):
    batch, targets = sample.unsqueeze(0), target.unsqueeze(0)
    predictions = functional_call(model, (params, buffers), (batch,))
    return F.nll_loss(predictions, targets)


ft_compute_sample_grad = vmap(grad(compute_loss), in_dims=(None, None, 0, 0))
for step in range(4):
    data, targets = torch.randn(8, 10), torch.randint(0, 4, (8,))
    params = {k: v.detach() for k, v in model.named_parameters()}
    buffers = {k: v.detach() for k, v in model.named_buffers()}
    ft_per_sample_grads = ft_compute_sample_grad(params, buffers, data, targets)
    norms = torch.stack([g.flatten(1).norm(dim=1) for g in ft_per_sample_grads.values()]).norm(dim=0)
    factor = (1.0 / (norms + 1e-6)).clamp(max=1.0)
    for name, p in model.named_parameters():
        g = ft_per_sample_grads[name]
        p.grad = (torch.einsum("i,i...->...", factor, g) + 0.01 * torch.randn_like(p)) / len(data)
    optimizer.step()
    optimizer.zero_grad()
    with torch.no_grad():
        print(f"step {step} loss {F.nll_loss(model(data), targets).item():.6f} norm {norms.mean().item():.6f}")
print(model.fc1.weight.sum().item())
