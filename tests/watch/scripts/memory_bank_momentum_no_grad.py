# instance discrimination with a memory bank (zhirongw/lemniscate.pytorch, lib/LinearAverage.py): every sample's
# feature is kept in a bank, the loss compares a batch's features with the whole bank, and the bank's rows of the
# batch are updated by momentum. There the update is made without a graph (inside the autograd.Function's backward);
# here it is written in the loop under torch.no_grad().
import torch
import torch.nn.functional as F
from torch import nn

torch.manual_seed(0)
n, dim, t, m = 32, 4, 0.1, 0.5
data = torch.randn(n, 6)
net = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, dim))
opt = torch.optim.SGD(net.parameters(), lr=0.05)
memory = F.normalize(torch.randn(n, dim), dim=1)
for step in range(6):
    idx = torch.randperm(n)[:8]
    feat = F.normalize(net(data[idx]), dim=1)
    out = feat @ memory.t() / t
    loss = F.cross_entropy(out, idx)
    opt.zero_grad()
    loss.backward()
    opt.step()
    with torch.no_grad():
        memory[idx] = F.normalize(memory[idx] * m + feat * (1 - m), dim=1)
    print(f"step {step}: loss {loss.item()!r}")
