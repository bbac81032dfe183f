# Deep SVDD (lukasruff/Deep-SVDD-PyTorch, src/optim/deepSVDD_trainer.py): the hypersphere's center c is the mean of
# the network's outputs over the training data, computed once before training, and every batch's loss is the mean
# squared distance of its outputs to c. The original computes c under torch.no_grad(); here without it, c keeps the
# graph of four forwards of the network, reused by every step.
import torch
from torch import nn

torch.manual_seed(0)
data = [torch.randn(16, 10) for _ in range(4)]
net = nn.Sequential(nn.Linear(10, 8, bias=False), nn.LeakyReLU(), nn.Linear(8, 4, bias=False))
opt = torch.optim.Adam(net.parameters(), lr=1e-3, weight_decay=1e-6)


def init_center_c(eps=0.1):
    n, c = 0, torch.zeros(4)
    for x in data:
        out = net(x)
        n += out.shape[0]
        c += out.sum(0)
    c /= n
    c[(abs(c) < eps) & (c < 0)] = -eps  # a center too near 0 is pushed away from it
    c[(abs(c) < eps) & (c > 0)] = eps
    return c


c = init_center_c()
for epoch in range(3):
    loss_epoch = 0.0
    for x in data:
        opt.zero_grad()
        outputs = net(x)
        loss = torch.mean(torch.sum((outputs - c) ** 2, dim=1))
        loss.backward()
        opt.step()
        loss_epoch += loss.item()
    print(f"epoch {epoch}: loss {loss_epoch / len(data)!r}")
print([p.sum().item() for p in net.parameters()])
