# Decoupled neural interfaces with synthetic gradients (Jaderberg et al.), trimmed from andrewliao11/dni.pytorch's
# mlp trainer: layer 1 is updated at once with the gradient a synthesizer predicts from its activation
# (`out.backward(grad.detach())`); layer 2 trains on the detached activation, whose true gradient then trains the
# synthesizer. Three optimizers, three backwards an iteration. Correct: the synthesizer reads `out.detach()`.
import torch
import torch.nn as nn
import torch.nn.functional as F

torch.manual_seed(0)
layer1 = nn.Sequential(nn.Linear(20, 16), nn.ReLU())
layer2 = nn.Linear(16, 4)
layer1_dni = nn.Sequential(nn.Linear(16 + 4, 16), nn.ReLU(), nn.Linear(16, 16))
optimizer1 = torch.optim.Adam(layer1.parameters(), 1e-3)
optimizer2 = torch.optim.Adam(layer2.parameters(), 1e-3)
grad_optimizer1 = torch.optim.Adam(layer1_dni.parameters(), 1e-3)
data = [(torch.randn(8, 20), torch.randint(0, 4, (8,))) for _ in range(3)]

for epoch in range(2):
    for images, labels in data:
        out = layer1(images)
        grad = layer1_dni(torch.cat([out.detach(), F.one_hot(labels, 4).float()], 1))  # the synthetic gradient
        optimizer1.zero_grad()
        out.backward(grad.detach())
        optimizer1.step()
        out = out.detach().requires_grad_()
        loss = F.cross_entropy(layer2(out), labels)
        optimizer2.zero_grad()
        loss.backward()
        optimizer2.step()
        grad_optimizer1.zero_grad()
        grad_loss = F.mse_loss(grad, out.grad.detach())  # the synthesizer learns the true gradient
        grad_loss.backward()
        grad_optimizer1.step()
        print(f"{loss.item():.6f} {grad_loss.item():.8f}")
print([round(p.sum().item(), 6) for m in (layer1, layer2, layer1_dni) for p in m.parameters()])
