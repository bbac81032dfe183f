"""The LinearFunction of PyTorch's "Extending torch.autograd" notes keeping its input on ctx as an attribute
(`ctx.tensor1 = tensor1`, as in pytorch/pytorch#32625) instead of save_for_backward, in a residual block that adds
in place to save memory: `h += ...` changes the input the Function keeps, and PyTorch does not check it."""
import torch
from torch import nn


class LinearFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, input, weight):
        ctx.input, ctx.weight = input, weight
        return input.mm(weight.t())

    @staticmethod
    def backward(ctx, grad_output):
        return grad_output.mm(ctx.weight), grad_output.t().mm(ctx.input)


torch.manual_seed(0)
inp, head = nn.Linear(4, 4), nn.Linear(4, 1)
weight = nn.Parameter(torch.randn(4, 4) * 0.5)
optimizer = torch.optim.SGD([*inp.parameters(), weight, *head.parameters()], lr=0.1)
for step in range(3):
    h = inp(torch.randn(8, 4))
    h += LinearFunction.apply(h, weight)
    loss = head(h).pow(2).mean()
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    print(f"step {step} loss {loss.item():.6f}")
