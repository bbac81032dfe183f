# A plain loop in a script that imports torch.distributed (as many do, for a run that may be distributed).
import torch
import torch.distributed as dist
from torch import nn
torch.manual_seed(0)
model = nn.Linear(4, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for step in range(3):
    loss = model(torch.randn(8, 4)).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    print(f"step {step}: {loss.item():.6f} (distributed: {dist.is_initialized()})")
