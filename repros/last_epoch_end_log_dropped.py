"""A value self.log gives in on_epoch_end of the run's last pass never reaches the loggers.

A self.log value is written at the next log point (docs/trainer.md). The run's last log point is its last step
(safeloop/trainer.py:262, "if step % s.log_every == 0 or end"), and the last pass ends after it: _loop calls
TrainData.keep (safeloop/trainer.py:253), which runs on_epoch_end; _finish writes nothing that was logged since.
Lightning logs a value given in on_train_epoch_end at that epoch's end: 0, 1, 2 below; safeloop's logger gets 0 and
1 only (with log_every=1, so that no value is overwritten in between).

Run: PYTHONPATH=. python repros/last_epoch_end_log_dropped.py
"""
import torch

import safeloop
from _tiny import loader, net


class Rows:
    def __init__(self):
        self.marks = []

    def log_metrics(self, metrics, step):
        if "epoch_mark" in metrics:
            self.marks.append((step, metrics["epoch_mark"]))


class EpochLogs(safeloop.Trainer):
    def on_epoch_end(self):
        self.log("epoch_mark", float(self.state.epoch))


rows = Rows()
EpochLogs(model=net(), train_data=loader(), optimizer=lambda p: torch.optim.Adam(p, lr=1e-2), max_epochs=3,
          log_every=1, progress=False, device="cpu", loggers=[rows]).fit()
print("(step, epoch_mark) logged:", rows.marks, "- epoch 2's is missing")
