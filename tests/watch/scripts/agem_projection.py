# A-GEM (Chaudhry et al.) after facebookresearch/GradientEpisodicMemory's store_grad / overwrite_grad: each step the
# gradient on the episodic memory of the past task is stored into a buffer by `copy_`, then the current batch's
# gradient, if it points against it, is projected and written back into each parameter's `.grad` in place.
import torch
import torch.nn as nn
import torch.nn.functional as F


def store_grad(params, grads, grad_dims, tid):
    grads[:, tid].fill_(0.0)
    for cnt, param in enumerate(params()):
        if param.grad is not None:
            beg, en = sum(grad_dims[:cnt]), sum(grad_dims[:cnt + 1])
            grads[beg:en, tid].copy_(param.grad.data.view(-1))


def overwrite_grad(params, newgrad, grad_dims):
    for cnt, param in enumerate(params()):
        if param.grad is not None:
            beg, en = sum(grad_dims[:cnt]), sum(grad_dims[:cnt + 1])
            param.grad.data.copy_(newgrad[beg:en].contiguous().view(param.grad.data.size()))


torch.manual_seed(0)
net = nn.Sequential(nn.Linear(5, 12), nn.ReLU(), nn.Linear(12, 3))
opt = torch.optim.SGD(net.parameters(), lr=0.2)
grad_dims = [p.numel() for p in net.parameters()]
grads = torch.zeros(sum(grad_dims), 2)
mem_x, mem_y = torch.randn(8, 5), torch.randint(0, 3, (8,))  # the episodic memory of task 0
for step in range(4):
    x, y = torch.randn(6, 5) + 1.0, torch.randint(0, 3, (6,))  # task 1
    net.zero_grad()
    F.cross_entropy(net(mem_x), mem_y).backward()
    store_grad(net.parameters, grads, grad_dims, 0)
    net.zero_grad()
    loss = F.cross_entropy(net(x), y)
    loss.backward()
    store_grad(net.parameters, grads, grad_dims, 1)
    dot = torch.dot(grads[:, 1], grads[:, 0])
    if dot < 0:
        g = grads[:, 1] - dot / torch.dot(grads[:, 0], grads[:, 0]) * grads[:, 0]
        overwrite_grad(net.parameters, g, grad_dims)
    opt.step()
    print(f"{loss.item():.6f} {dot.item():.6f}")
print(" ".join(f"{v:.6f}" for v in net[2].weight.flatten()[:6].tolist()))
