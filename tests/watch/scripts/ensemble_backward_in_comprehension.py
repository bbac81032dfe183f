"""An ensemble's members trained side by side in a function, each member's loss back-propagated by a list
comprehension written for its side effect (`[loss.backward() for loss in losses]`: a frame of its own on Python
3.11, inlined into the function on 3.12), one optimizer over all members. Correct: nothing keeps a graph."""
import torch

torch.manual_seed(0)


def train():
    models = [torch.nn.Linear(4, 1) for _ in range(2)]
    opt = torch.optim.SGD([p for m in models for p in m.parameters()], lr=0.1)
    for step in range(8):
        x = torch.randn(6, 4)
        opt.zero_grad()
        losses = [m(x).pow(2).mean() for m in models]
        [loss.backward() for loss in losses]
        opt.step()
        print(step, [loss.item() for loss in losses])
    return models


for m in train():
    print(m.weight.sum().item(), m.bias.sum().item())
