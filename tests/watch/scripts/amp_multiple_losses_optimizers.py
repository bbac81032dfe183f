# Trimmed from pytorch/pytorch, docs/source/notes/amp_examples.rst ("Working with Multiple Models, Losses, and
# Optimizers"), on CPU: two models, two losses sharing both outputs (the first backward with retain_graph=True), one
# GradScaler, unscale_ of the first optimizer only, both stepped through the scaler, one update. Correct.
import torch
from torch import nn

torch.manual_seed(0)
model0, model1 = nn.Linear(6, 3), nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3))
optimizer0 = torch.optim.SGD(model0.parameters(), lr=0.05)
optimizer1 = torch.optim.Adam(model1.parameters(), lr=0.01)
scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8)
loss_fn = nn.MSELoss()
for epoch in range(4):
    input, target = torch.randn(10, 6), torch.randn(10, 3)
    optimizer0.zero_grad()
    optimizer1.zero_grad()
    with torch.autocast(device_type="cpu", dtype=torch.float16):
        output0 = model0(input)
        output1 = model1(input)
        loss0 = loss_fn(2 * output0 + 3 * output1, target)
        loss1 = loss_fn(3 * output0 - 5 * output1, target)
    # (retain_graph here is unrelated to amp, it's present because in this
    # example, both backward() calls share some sections of graph.)
    scaler.scale(loss0).backward(retain_graph=True)
    scaler.scale(loss1).backward()
    # You can choose which optimizers receive explicit unscaling, if you
    # want to inspect or modify the gradients of the params they own.
    scaler.unscale_(optimizer0)
    torch.nn.utils.clip_grad_norm_(model0.parameters(), 1.0)
    scaler.step(optimizer0)
    scaler.step(optimizer1)
    scaler.update()
    print(f"epoch {epoch} loss0 {loss0.float().item():.4f} loss1 {loss1.float().item():.4f}")
print(model0.weight.sum().item(), model1[2].weight.sum().item())
