"""K-FAC's true-Fisher pass (alecwangcq/KFAC-Pytorch, main.py), in a helper the loop calls: labels sampled under
``torch.no_grad()``, then a backward with retain_graph=True on the outputs the loop made. From Python 3.12 on, the
code after a ``with`` or ``try`` block is jumped back to from its handlers: no loop for all that, so the outputs
are this step's, not built before a loop."""
import torch
import torch.nn as nn
import torch.nn.functional as F


def fisher_pass(optimizer, outputs):
    with torch.no_grad():
        sampled = torch.multinomial(F.softmax(outputs, dim=1), 1).squeeze(1)
    try:
        weight = float("1.0")
    except ValueError:
        weight = 0.5
    (weight * F.cross_entropy(outputs, sampled)).backward(retain_graph=True)
    optimizer.zero_grad()


def train():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
    for _ in range(4):
        inputs, targets = torch.randn(8, 4), torch.randint(3, (8,))
        optimizer.zero_grad()
        outputs = net(inputs)
        loss = F.cross_entropy(outputs, targets)
        fisher_pass(optimizer, outputs)
        loss.backward()
        optimizer.step()
    print("trained", net[0].weight.sum().item())


train()
