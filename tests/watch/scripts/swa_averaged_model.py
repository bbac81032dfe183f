# stochastic weight averaging (PyTorch's torch.optim.swa_utils recipe): an AveragedModel updated from the model every
# epoch from swa_start on, the learning rate switched to SWALR, then update_bn over the data before the averaged
# model is evaluated.
import torch
import torch.nn.functional as F
from torch import nn
from torch.optim.swa_utils import SWALR, AveragedModel, update_bn

torch.manual_seed(0)
loader = [(torch.randn(8, 5), torch.randint(0, 3, (8,))) for _ in range(3)]
model = nn.Sequential(nn.Linear(5, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 3))
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
swa_model = AveragedModel(model)
scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=4)
swa_start, swa_scheduler = 2, SWALR(optimizer, swa_lr=0.05)
for epoch in range(4):
    for x, y in loader:
        optimizer.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
    if epoch > swa_start:
        swa_model.update_parameters(model)
        swa_scheduler.step()
    else:
        scheduler.step()
    print(f"epoch {epoch}: loss {loss.item()!r}")
update_bn([x for x, _ in loader], swa_model)
with torch.no_grad():
    print(swa_model(loader[0][0]).sum().item())
