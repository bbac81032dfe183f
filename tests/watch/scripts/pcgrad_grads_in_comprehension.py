"""Per-task gradients as PCGrad takes them (WeiChengTseng/Pytorch-PCGrad, pcgrad.py, `_pack_grad`: one backward per
objective with retain_graph=True), written as torch.autograd.grad in a list comprehension inside the training loop
(a frame of its own on Python 3.11, inlined into the loop on 3.12), the conflicting components projected out and
the sum written to `.grad` before the step. Two regression heads over a shared trunk, random data."""
import random

import torch
from torch import nn

torch.manual_seed(0)
random.seed(0)
trunk, head1, head2 = nn.Linear(5, 6), nn.Linear(6, 1), nn.Linear(6, 1)
params = list(trunk.parameters())
optimizer = torch.optim.Adam([*params, *head1.parameters(), *head2.parameters()], lr=1e-2)
for step in range(4):
    x, y1, y2 = torch.randn(8, 5), torch.randn(8, 1), torch.randn(8, 1)
    feat = trunk(x).relu()
    objectives = [nn.functional.mse_loss(head1(feat), y1), nn.functional.l1_loss(head2(feat), y2)]
    optimizer.zero_grad()
    grads = [torch.autograd.grad(obj, params, retain_graph=True) for obj in objectives]
    flat = [torch.cat([g.flatten() for g in gs]) for gs in grads]
    pc = [g.clone() for g in flat]
    for g_i in pc:
        random.shuffle(flat)
        for g_j in flat:
            dot = torch.dot(g_i, g_j)
            if dot < 0:
                g_i -= dot * g_j / (g_j.norm() ** 2)
    merged = torch.stack(pc).sum(dim=0)
    sum(objectives).backward(inputs=[*head1.parameters(), *head2.parameters()])
    offset = 0
    for p in params:
        p.grad = merged[offset:offset + p.numel()].view_as(p).clone()
        offset += p.numel()
    optimizer.step()
    print(step, [o.item() for o in objectives])
for p in optimizer.param_groups[0]["params"]:
    print(p.sum().item())
