# A LightningModule trained by pytorch_lightning's own Trainer on the CPU: `python lit_regression.py MODE [DEVICES
# [STRATEGY]]`. MODE: auto (automatic optimization), manual (manual_backward), prior (a graph that saves tensors,
# built in __init__ and added to every step's loss), total (a running sum of the losses kept on the module, with
# their graphs). Rank zero prints the first layer's weight sum.
import sys
import warnings

import pytorch_lightning as pl
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

MODE = sys.argv[1]


class Regression(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
        self.automatic_optimization = MODE != "manual"
        if MODE == "prior":
            self.prior = (self.net[0].weight ** 2).sum()

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.mse_loss(self.net(x), y)
        if MODE == "prior":
            loss = loss + 0.01 * self.prior
        if MODE == "total":
            self.total = self.total + loss if batch_idx else loss
        if MODE == "manual":
            opt = self.optimizers()
            opt.zero_grad()
            self.manual_backward(loss)
            opt.step()
        return loss

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=0.01)


def main():
    warnings.filterwarnings("ignore", module="(pytorch_lightning|lightning_fabric)")  # advice on workers, logging
    torch.manual_seed(0)
    data = DataLoader(TensorDataset(torch.randn(64, 4), torch.randn(64, 1)), batch_size=8)
    devices = int(sys.argv[2]) if len(sys.argv) > 2 else 1
    strategy = sys.argv[3] if len(sys.argv) > 3 else "auto"
    model = Regression()
    trainer = pl.Trainer(max_epochs=2, accelerator="cpu", devices=devices, strategy=strategy, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(model, data)
    if trainer.global_rank == 0:
        print(f"{MODE}: {model.net[0].weight.sum().item():.6f}")


if __name__ == "__main__":
    main()
