"""safeloop gives its loggers the step count after the update (update k at step k); Lightning gives
_batches_that_stepped before its increment (pytorch_lightning/trainer/connectors/logger_connector/
logger_connector.py:123, loops/training_epoch_loop.py:415): update k's self.log values, and the validation after
it, at step k - 1. With log_every_n_steps=3 over 14 updates Lightning logs "index" at steps 2, 5, 8, 11 and
val_loss at 6 and 13; safeloop at 3, 6, 9, 12 (and 14, its last step) and val_loss at 0, 7, 14.

Run: PYTHONPATH=. python repros/logger_step_off_by_one.py
"""
import torch

import safeloop
from _tiny import loader, net


class Rows:
    def __init__(self):
        self.rows = []

    def log_metrics(self, metrics, step):
        self.rows.append((step, sorted(metrics)))


class Logs(safeloop.Trainer):
    def training_step(self, batch):
        self.log("index", float(self.state.batch_in_epoch - 1))
        return super().training_step(batch)

    def validation_step(self, batch):
        x, y = batch
        return self.loss_fn(self.model(x), y)


rows = Rows()
Logs(model=net(), train_data=loader(), val_data=loader(n=4, seed=2), optimizer=lambda p: torch.optim.Adam(p, lr=1e-2),
     max_epochs=2, log_every=3, val_every=7, progress=False, device="cpu", loggers=[rows]).fit()
for step, names in rows.rows:
    print(step, names)
