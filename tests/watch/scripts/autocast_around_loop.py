"""The whole training loop inside one `with torch.autocast(...)`, the backward and the optimizer step too (PyTorch's
AMP notes advise autocast around the forward only): autocast keeps the bf16 copies of the weights it makes for the
whole `with` block, so every step's forward uses the copies made in the first step, and the losses never move. A
mistake; the copies, not `loss`, carry the first step's graph (ToCopyBackward0) into every step."""
import torch

torch.manual_seed(0)
model = torch.nn.Linear(4, 1)
optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
x, y = torch.randn(8, 4), torch.randn(8, 1)
with torch.autocast("cpu", dtype=torch.bfloat16):
    for step in range(3):
        loss = torch.nn.functional.mse_loss(model(x).float(), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        print(step, loss.item())
print(model.weight.sum().item(), model.bias.sum().item())
