# Two heads on one trunk, each loss stepped by its own optimizer in a loop over (optimizer, loss) pairs inside the
# step function (retain_graph=True: both losses go through the trunk's features); the trunk is trained by the second
# optimizer only. Correct: a loop over optimizers is one update of each, inside the training loop's iteration, so the
# features made before it are that iteration's own, not a graph built before training.
import torch
from torch import nn

torch.manual_seed(0)
trunk, head1, head2 = nn.Linear(4, 8), nn.Linear(8, 1), nn.Linear(8, 1)
opts = [torch.optim.SGD(head1.parameters(), lr=0.1),
        torch.optim.SGD([*head2.parameters(), *trunk.parameters()], lr=0.1)]


def train_step(x):
    out = torch.relu(trunk(x))
    losses = [head1(out).pow(2).mean(), head2(out).pow(2).mean()]
    for opt, loss in zip(opts, losses):
        opt.zero_grad()
        loss.backward(retain_graph=True)
        opt.step()
    return [loss.item() for loss in losses]


for epoch in range(2):
    for x in torch.randn(3, 5, 4):
        print(train_step(x))
print(repr(trunk.weight.sum().item()))
