# train.py's model trained by a plain loop: python plain.py [--scale-in-init exp|pow].
import argparse

import torch
from torch import nn

parser = argparse.ArgumentParser()
parser.add_argument("--scale-in-init", choices=["exp", "pow"])
args = parser.parse_args()
SCALES = {"exp": lambda w: w.sum(0).exp(), "pow": lambda w: w.pow(2).sum(0)}


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.layer = nn.Linear(4, 4)
        if args.scale_in_init:
            self.scale = SCALES[args.scale_in_init](self.layer.weight)


torch.manual_seed(0)
model = Model()
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
data = [torch.randn(3, 4) for _ in range(4)]
for epoch in range(2):
    for batch in data:
        scale = model.scale if args.scale_in_init else SCALES["exp"](model.layer.weight)
        loss = (model.layer(batch) * scale).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
print(f"weight sum {model.layer.weight.sum().item():.6f}")
