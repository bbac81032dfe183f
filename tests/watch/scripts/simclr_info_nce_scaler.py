# Trimmed from sthalles/SimCLR, simclr.py (SimCLR.info_nce_loss and train): two views through one encoder, the
# similarity matrix masked into positives and negatives over a temperature, float16 autocast (on CPU here) with a
# GradScaler, zero_grad after the forward, accuracy read from the logits after the update, a scheduler per epoch.
import torch
import torch.nn.functional as F
from torch import nn

torch.manual_seed(0)
batch_size, n_views, temperature = 6, 2, 0.07
model = nn.Sequential(nn.Linear(10, 16), nn.ReLU(), nn.Linear(16, 8))
optimizer = torch.optim.Adam(model.parameters(), 3e-3, weight_decay=1e-4)
scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=4, eta_min=0, last_epoch=-1)
criterion = nn.CrossEntropyLoss()
scaler = torch.amp.GradScaler("cpu", enabled=True)


def info_nce_loss(features):
    labels = torch.cat([torch.arange(batch_size) for i in range(n_views)], dim=0)
    labels = (labels.unsqueeze(0) == labels.unsqueeze(1)).float()
    features = F.normalize(features, dim=1)
    similarity_matrix = torch.matmul(features, features.T)
    mask = torch.eye(labels.shape[0], dtype=torch.bool)
    labels = labels[~mask].view(labels.shape[0], -1)
    similarity_matrix = similarity_matrix[~mask].view(similarity_matrix.shape[0], -1)
    positives = similarity_matrix[labels.bool()].view(labels.shape[0], -1)
    negatives = similarity_matrix[~labels.bool()].view(similarity_matrix.shape[0], -1)
    logits = torch.cat([positives, negatives], dim=1)
    labels = torch.zeros(logits.shape[0], dtype=torch.long)
    return logits / temperature, labels


n_iter = 0
for epoch_counter in range(2):
    for _ in range(3):
        x = torch.randn(batch_size, 10)
        images = torch.cat([x + 0.1 * torch.randn_like(x), x + 0.1 * torch.randn_like(x)], dim=0)
        with torch.autocast("cpu", dtype=torch.float16):
            features = model(images)
            logits, labels = info_nce_loss(features)
            loss = criterion(logits, labels)
        optimizer.zero_grad()
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        top1 = (logits.argmax(1) == labels).float().mean()
        print(f"iter {n_iter} loss {loss.item():.4f} top1 {top1.item():.4f}")
        n_iter += 1
    scheduler.step()
print(model[0].weight.sum().item())
