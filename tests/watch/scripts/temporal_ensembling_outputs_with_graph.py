# Temporal ensembling after ferretj/temporal-ensembling's train.py (Laine & Aila), with the epoch's predictions
# written into `outputs` as `out` where the repository writes `out.data.clone()`: the ensemble `Z` and the next
# epoch's targets `z` keep the graphs of the epoch that wrote them, and the next epoch's MSE goes back into them.
import torch
import torch.nn as nn
import torch.nn.functional as F

torch.manual_seed(0)
n, bs, alpha = 12, 4, 0.6
x, y = torch.randn(n, 6), torch.randint(0, 3, (n,))
labeled = torch.arange(n) % 3 == 0
model = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 3))
optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
Z = torch.zeros(n, 3)
z = torch.zeros(n, 3)
outputs = torch.zeros(n, 3)
for epoch in range(3):
    w = 0.5 * epoch
    for i in range(n // bs):
        xb, yb, lb = x[i * bs:(i + 1) * bs], y[i * bs:(i + 1) * bs], labeled[i * bs:(i + 1) * bs]
        optimizer.zero_grad()
        out = model(xb)
        zcomp = z[i * bs:(i + 1) * bs]
        loss = F.cross_entropy(out[lb], yb[lb]) + w * F.mse_loss(F.softmax(out, 1), zcomp)
        outputs[i * bs:(i + 1) * bs] = out
        loss.backward()
        optimizer.step()
        print(f"{loss.item():.6f}")
    Z = alpha * Z + (1. - alpha) * F.softmax(outputs, 1)
    z = Z * (1. / (1. - alpha ** (epoch + 1)))
print(" ".join(f"{v:.6f}" for v in model[2].weight.flatten()[:6].tolist()))
