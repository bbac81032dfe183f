"""In manual mode under precision="16", safeloop calls GradScaler.update() once per step, after training_step
(safeloop/step/runner.py:173-174). Lightning's MixedPrecision.optimizer_step calls it after every optimizer step
(pytorch_lightning/plugins/precision/amp.py:96). With two optimizers (a GAN), Lightning's scaler counts two updates a
step: its scale grows after 1000 steps where safeloop's grows after 2000, and a step where both optimizers overflow
halves it twice there, once here. Below, 10 steps: safeloop's growth tracker is 10; Lightning's is 20
(tests/lightning/test_parity2.py, test_gan_float16_with_a_grad_scaler_matches). (PyTorch's AMP examples call
update() once per iteration, as safeloop does.)

Run: PYTHONPATH=. python repros/gan_float16_scaler_update.py
"""
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

import safeloop

torch.manual_seed(0)
gan = nn.ModuleDict({"g": nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 2)),
                     "d": nn.Sequential(nn.Linear(2, 16), nn.LeakyReLU(0.2), nn.Linear(16, 1))})


class GAN(safeloop.Trainer):
    automatic = False

    def configure_optimizers(self):
        return {name: torch.optim.Adam(self.model[name].parameters(), lr=1e-3) for name in ("d", "g")}

    def training_step(self, batch):
        (real,) = batch
        fake = self.model["g"](torch.randn(len(real), 4))
        d_real, d_fake = self.model["d"](real), self.model["d"](fake.detach())
        d_loss = (F.binary_cross_entropy_with_logits(d_real, torch.ones_like(d_real))
                  + F.binary_cross_entropy_with_logits(d_fake, torch.zeros_like(d_fake)))
        self.backward(d_loss, optimizer="d")
        self.step("d")
        d_fake = self.model["d"](fake)
        g_loss = F.binary_cross_entropy_with_logits(d_fake, torch.ones_like(d_fake))
        self.backward(g_loss, optimizer="g")
        self.step("g")
        return {"d": d_loss, "g": g_loss}


data = DataLoader(TensorDataset(torch.randn(80, 2)), batch_size=8)
trainer = GAN(model=gan, train_data=data, max_steps=10, precision="16", progress=False, device="cpu", loggers=[])
trainer.fit()
print("steps", trainer.state.step, "optimizer steps", 2 * trainer.state.step,
      "growth tracker", trainer.scaler.state_dict()["_growth_tracker"], "(Lightning: one per optimizer step)")
