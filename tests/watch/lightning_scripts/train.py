# A LightningModule trained by the stand-in Trainer of tests/watch/lightning_like.py, which drives it as
# Lightning's automatic optimization does: python train.py [--scale-in-init exp|pow] [--strategy ddp --devices 2]
# [--accumulate 2]. --scale-in-init builds the module's scale once, in __init__, with its graph (the mistake);
# without it, training_step computes the scale from the weights every step.
import argparse

import torch
from torch import nn

from tests.watch.lightning_like import LightningModule, Trainer

parser = argparse.ArgumentParser()
parser.add_argument("--scale-in-init", choices=["exp", "pow"])
parser.add_argument("--strategy", default="auto")
parser.add_argument("--devices", type=int, default=1)
parser.add_argument("--accumulate", type=int, default=1)
args = parser.parse_args()
SCALES = {"exp": lambda w: w.sum(0).exp(), "pow": lambda w: w.pow(2).sum(0)}


class Model(LightningModule):
    def __init__(self):
        super().__init__()
        self.layer = nn.Linear(4, 4)
        if args.scale_in_init:
            self.scale = SCALES[args.scale_in_init](self.layer.weight)

    def training_step(self, batch, batch_idx):
        scale = self.scale if args.scale_in_init else SCALES["exp"](self.layer.weight)
        return (self.layer(batch) * scale).pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


torch.manual_seed(0)
model = Model()
data = [torch.randn(3, 4) for _ in range(4)]
Trainer(max_epochs=2, strategy=args.strategy, devices=args.devices,
        accumulate_grad_batches=args.accumulate).fit(model, data)
print(f"weight sum {model.layer.weight.sum().item():.6f}")
