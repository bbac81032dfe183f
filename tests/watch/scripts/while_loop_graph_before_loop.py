"""seed001_reused_graph.py's mistake in a loop counted with `while step < 3:`: features made by a trained encoder
once, before the loop, and used by every step's loss."""
import torch

torch.manual_seed(0)
enc, head = torch.nn.Linear(4, 4), torch.nn.Linear(4, 1)
opt = torch.optim.SGD([*enc.parameters(), *head.parameters()], lr=0.1)
feat = enc(torch.randn(8, 4))
step = 0
while step < 3:
    loss = head(feat).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    step += 1
    print(step, loss.item())
