# Gradient accumulation written by hand: each micro-batch back-propagates `loss / accumulate` while `running` sums
# the losses themselves, with their graphs (meant: `running + loss.item()`).
import torch

torch.manual_seed(0)
model = torch.nn.Linear(4, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
accumulate, running = 2, 0.0
for i in range(8):
    loss = model(torch.randn(3, 4)).pow(2).mean()
    running = running + loss
    (loss / accumulate).backward()
    if i % accumulate == 1:
        opt.step()
        opt.zero_grad()
print(f"mean loss {running.item() / 8:.6f}")
