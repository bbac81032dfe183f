"""val_every=N, which docs/trainer.md's map gives for Lightning's val_check_interval=N, validates every N steps over
the whole run (safeloop/trainer.py:266, "step % s.val_every == 0"). With Lightning's default
check_val_every_n_epoch=1, val_check_interval=N counts the batches of each epoch, starting again at every epoch:
over 3 passes of 7 batches, val_check_interval=3 validates after steps 3, 6, 10, 13, 17, 20 (never at an epoch's
end); safeloop's val_every=3 after 3, 6, 9, 12, 15, 18, 21. Only check_val_every_n_epoch=None counts as val_every
does (the case tests/lightning/test_parity.py checks). A fractional val_check_interval (0.5: the same steps here) has
no entry in the map.

Run: PYTHONPATH=. python repros/val_every_counts_across_epochs.py
"""
import torch

import safeloop
from _tiny import loader, net


class Port(safeloop.Trainer):
    validated: list = []

    def validation_step(self, batch):
        x, y = batch
        return self.loss_fn(self.model(x), y)

    def on_validation_end(self, metrics):
        self.validated.append(self.state.step)


trainer = Port(model=net(), train_data=loader(), val_data=loader(n=4, seed=2),
               optimizer=lambda p: torch.optim.Adam(p, lr=1e-2), max_epochs=3, val_every=3, progress=False,
               device="cpu", loggers=[])
trainer.fit()
print("validated after steps:", trainer.validated[1:], "(Lightning's val_check_interval=3: [3, 6, 10, 13, 17, 20])")
