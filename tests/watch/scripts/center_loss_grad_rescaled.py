# center loss (KaiyangZhou/pytorch-center-loss, main.py): the class centers are parameters of the loss with an
# optimizer of their own; after the backward of the weighted sum, their gradients are rescaled by 1/weight in place
# (`param.grad.data *= 1. / weight_cent`) before that optimizer steps, so the weight does not slow the centers.
import torch
import torch.nn.functional as F
from torch import nn

torch.manual_seed(0)


class CenterLoss(nn.Module):
    def __init__(self, num_classes=3, feat_dim=2):
        super().__init__()
        self.centers = nn.Parameter(torch.randn(num_classes, feat_dim))

    def forward(self, x, labels):
        distmat = (x.pow(2).sum(1, keepdim=True) + self.centers.pow(2).sum(1)
                   - 2 * x @ self.centers.t())
        mask = labels.unsqueeze(1).eq(torch.arange(self.centers.shape[0]))
        return (distmat * mask.float()).clamp(min=1e-12, max=1e12).sum() / x.shape[0]


model = nn.Sequential(nn.Linear(5, 8), nn.PReLU(), nn.Linear(8, 2))
head = nn.Linear(2, 3)
criterion_cent = CenterLoss()
weight_cent = 0.5
optimizer = torch.optim.SGD([*model.parameters(), *head.parameters()], lr=0.05, momentum=0.9)
optimizer_centloss = torch.optim.SGD(criterion_cent.parameters(), lr=0.5)
for step in range(5):
    x, y = torch.randn(8, 5), torch.randint(0, 3, (8,))
    features = model(x)
    outputs = head(features)
    loss_xent = F.cross_entropy(outputs, y)
    loss_cent = criterion_cent(features, y) * weight_cent
    loss = loss_xent + loss_cent
    optimizer.zero_grad()
    optimizer_centloss.zero_grad()
    loss.backward()
    optimizer.step()
    for param in criterion_cent.parameters():
        param.grad.data *= (1. / weight_cent)
    optimizer_centloss.step()
    print(f"step {step}: loss {loss.item()!r}")
print(criterion_cent.centers.sum().item(), [p.sum().item() for p in model.parameters()])
