# a training loop whose validation runs without torch.no_grad() and keeps its summed loss as a tensor until the next
# epoch's validation (a common beginner's loop): wasteful, but no graph of a training step is kept or reused.
import torch
import torch.nn.functional as F
from torch import nn

torch.manual_seed(0)
train = [(torch.randn(8, 5), torch.randn(8, 1)) for _ in range(4)]
val = [(torch.randn(8, 5), torch.randn(8, 1)) for _ in range(2)]
model = nn.Sequential(nn.Linear(5, 8), nn.ReLU(), nn.Linear(8, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.05)
best, best_state = None, None
for epoch in range(3):
    model.train()
    for x, y in train:
        opt.zero_grad()
        loss = F.mse_loss(model(x), y)
        loss.backward()
        opt.step()
    model.eval()
    val_loss = 0
    for x, y in val:
        val_loss += F.mse_loss(model(x), y)
    val_loss /= len(val)
    if best is None or val_loss < best:
        best, best_state = val_loss, {k: v.clone() for k, v in model.state_dict().items()}
    print(f"epoch {epoch}: loss {loss.item()!r} val {val_loss.item()!r}")
print(best.item())
