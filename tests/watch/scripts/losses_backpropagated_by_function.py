"""Per-member losses made in the training loop of main() and handed to a function that back-propagates each in its
own loop and steps (the shape of PCGrad's `pc_backward(objectives)`, WeiChengTseng/Pytorch-PCGrad). Correct: each
iteration's `losses` replaces the last, nothing keeps a graph past its step."""
import torch

torch.manual_seed(0)


def update(opt, losses):
    opt.zero_grad()
    for loss in losses:
        loss.backward()
    opt.step()


def main():
    models = [torch.nn.Linear(4, 1) for _ in range(2)]
    opt = torch.optim.SGD([p for m in models for p in m.parameters()], lr=0.1)
    for step in range(6):
        x, y = torch.randn(6, 4), torch.randn(6, 1)
        losses = [(m(x) - y).pow(2).mean() for m in models]
        update(opt, losses)
        print(step, [loss.item() for loss in losses])
    return models


for m in main():
    print(m.weight.sum().item(), m.bias.sum().item())
