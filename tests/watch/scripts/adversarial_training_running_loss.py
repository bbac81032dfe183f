# FGSM adversarial training: each step takes the input's gradient with torch.autograd.grad (the attack), then
# back-propagates the loss on the perturbed batch, and keeps a running sum of the losses with their graphs (meant:
# `total + loss.item()`).
import torch
from torch import nn

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 2))
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
total = 0.0
for step in range(6):
    x, y = torch.randn(8, 4), torch.randint(0, 2, (8,))
    x.requires_grad_()
    grad, = torch.autograd.grad(nn.functional.cross_entropy(model(x), y), x)
    x_adv = (x + 0.1 * grad.sign()).detach()
    loss = nn.functional.cross_entropy(model(x_adv), y)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    total = total + loss
print(f"mean loss {total.item() / 6:.6f}")
