"""A validation batch whose first tensor is a 0-dim scalar counts as many samples as its next tensor's leading size
(safeloop/evaluate.py:157, "if t.dim()": scalars are skipped). Lightning's extract_batch_size counts a 0-dim tensor
as a batch of 1 (pytorch_lightning/utilities/data.py:45-46) and takes the first size found, so each such batch
weighs once, and it warns that the batch size is ambiguous. docs/trainer.md says "Lightning infers batch_size the
same way". Below, batches of 3, 3 and 1 samples: safeloop's val_loss is the mean over the 7 samples (1.0381);
Lightning's the mean of the three batch means (0.8394; tests/lightning/test_parity2.py,
test_validation_mean_with_a_scalar_first_in_the_batch_matches).

Run: PYTHONPATH=. python repros/scalar_first_batch_size.py
"""
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset, default_collate

import safeloop
from _tiny import loader, net


def with_a_scalar_first(samples):
    x, y = default_collate(samples)
    return torch.tensor(1.0), x, y


class Port(safeloop.Trainer):
    def validation_step(self, batch):
        _, x, y = batch
        return F.mse_loss(self.model(x), y)


gen = torch.Generator().manual_seed(2)
val = DataLoader(TensorDataset(torch.randn(7, 6, generator=gen), torch.randn(7, 1, generator=gen)), batch_size=3,
                 collate_fn=with_a_scalar_first)
trainer = Port(model=net(), train_data=loader(), val_data=val, optimizer=lambda p: torch.optim.Adam(p, lr=1e-2),
               max_epochs=1, val_every=7, progress=False, device="cpu", loggers=[])
trainer.fit()
with torch.no_grad():
    means = [float(F.mse_loss(trainer.model(x), y)) for _, x, y in val]
print("safeloop val_loss:", trainer.state.val_history[-1][1]["val_loss"], "(the mean over samples)")
print("mean of the batch means (Lightning's, each batch counted as 1):", sum(means) / len(means))
