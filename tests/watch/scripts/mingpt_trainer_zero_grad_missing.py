# karpathy/minGPT, mingpt/trainer.py's step (backward, clip_grad_norm_ with grad_norm_clip=1.0, optimizer.step)
# without its `model.zero_grad(set_to_none=True)`: every step applies the sum of every gradient so far, clipped.
# The clipping scales the gradients in place between backward and step; the sum is still there.
import torch
from torch import nn

torch.manual_seed(0)
model = nn.Sequential(nn.Embedding(9, 8), nn.Flatten(), nn.Linear(24, 9))
optimizer = torch.optim.AdamW(model.parameters(), lr=5e-3, betas=(0.9, 0.95), weight_decay=0.1)
for iter_num in range(6):
    x, y = torch.randint(0, 9, (16, 3)), torch.randint(0, 9, (16,))
    logits = model(x)
    loss = nn.functional.cross_entropy(logits, y)
    # backprop and update the parameters
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    print(f"iter {iter_num}: train loss {loss.item():.5f}")
print(model[2].weight.sum().item())
