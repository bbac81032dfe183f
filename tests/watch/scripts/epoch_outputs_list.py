"""Model outputs kept for an epoch's accuracy with their graphs (the training_step_outputs of
sktime/pytorch-forecasting before its pull request #1924): every step's graph stays alive until the epoch ends."""
import torch
from torch import nn

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
criterion = nn.CrossEntropyLoss()
for epoch in range(2):
    all_outputs, all_targets = [], []
    for i in range(4):
        x, y = torch.randn(16, 4), torch.randint(0, 2, (16,))
        out = model(x)
        loss = criterion(out, y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        all_outputs.append(out)
        all_targets.append(y)
    accuracy = (torch.cat(all_outputs).argmax(1) == torch.cat(all_targets)).float().mean()
    print(f"epoch {epoch} accuracy {accuracy.item():.6f}")
