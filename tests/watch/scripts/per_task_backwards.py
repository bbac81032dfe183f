"""PCGrad's per-task backwards (WeiChengTseng/Pytorch-PCGrad): each task's loss back-propagated on its own through
the shared trunk with retain_graph=True, from one line, the gradients replaced by hand before the optimizer steps.
The backwards of one iteration are one step, also before the first optimizer step."""
import torch
import torch.nn as nn


def pack_grad(optimizer, objectives):      # PCGrad._pack_grad
    grads = []
    for obj in objectives:
        optimizer.zero_grad(set_to_none=True)
        obj.backward(retain_graph=True)
        grads.append([p.grad.clone() if p.grad is not None else torch.zeros_like(p)
                      for g in optimizer.param_groups for p in g["params"]])
    return grads


def train():
    torch.manual_seed(0)
    trunk, head1, head2 = nn.Linear(4, 8), nn.Linear(8, 1), nn.Linear(8, 1)
    params = [*trunk.parameters(), *head1.parameters(), *head2.parameters()]
    optimizer = torch.optim.Adam(params, lr=1e-3)
    for ep in range(2):
        for _ in range(3):
            x = torch.randn(8, 4)
            optimizer.zero_grad()
            rep = trunk(x)
            losses = [head1(rep).pow(2).mean(), head2(rep).pow(2).mean()]
            grads = pack_grad(optimizer, losses)
            for p, *gs in zip(params, *grads):
                p.grad = sum(gs) / len(gs)
            optimizer.step()
    print("trained", trunk.weight.sum().item())


train()
