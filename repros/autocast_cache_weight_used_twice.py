"""Under precision="bf16-mixed" (and "16-mixed") a model that uses a weight twice in its forward (an RNN's steps, tied
embeddings, a discriminator on real and fake) trains differently from Lightning in the last bits.

safeloop runs the forward under torch.autocast(device_type, dtype) (safeloop/devices.py:73), whose cache casts
each weight once: the two uses' gradients are summed in the low precision, then converted. Lightning's
MixedPrecision uses torch.autocast(..., cache_enabled=False) (pytorch_lightning/plugins/precision/amp.py:116): each
use casts again, and the gradients are summed in float32. Below, a hand loop with cache_enabled=False (Lightning's
run, bit for bit; tests/lightning/test_parity2.py, test_bf16_mixed_with_a_weight_used_twice_matches) and safeloop's
run differ by up to 2.0e-4 after 2 epochs; with cache_enabled=True the hand loop is safeloop's, bit for bit.

Run: PYTHONPATH=. python repros/autocast_cache_weight_used_twice.py
"""
import torch
import torch.nn as nn
import torch.nn.functional as F

import safeloop
from _tiny import loader

torch.set_num_threads(1)


class Twice(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.inner, self.head = nn.Linear(6, 6), nn.Linear(6, 1)

    def forward(self, x):
        return self.head(torch.tanh(self.inner(torch.tanh(self.inner(x)))))


def hand(cache_enabled):
    model = Twice()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    for _ in range(2):
        for x, y in loader():
            with torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=cache_enabled):
                loss = F.mse_loss(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
    return model


def max_diff(a, b):
    return max(float((p - q).abs().max()) for p, q in zip(a.parameters(), b.parameters()))


trainer = safeloop.Trainer(model=Twice(), train_data=loader(), optimizer=lambda p: torch.optim.Adam(p, lr=1e-2),
                           max_epochs=2, precision="bf16-mixed", progress=False, device="cpu", loggers=[])
trainer.fit()
print("safeloop vs the loop with cache_enabled=False (Lightning's):", max_diff(trainer.model, hand(False)))
print("safeloop vs the loop with cache_enabled=True:", max_diff(trainer.model, hand(True)))
