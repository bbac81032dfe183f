"""After fit with a monitored checkpoint, trainer.test(data) tests the last weights (step 42), not the best (step 14).

Lightning's trainer.test(dataloaders=...) without a model after fit takes ckpt_path=None as "best"
(pytorch_lightning/trainer/connectors/checkpoint_connector.py:142-143): it loads the best checkpoint into the model
and tests it (with a warning). docs/trainer.md maps only trainer.test(model, dataloaders=), which tests the current
weights. On the run below Lightning's no-model test gives 0.6509, safeloop's 0.9498.

Run: PYTHONPATH=. python repros/evaluate_after_fit_uses_last_weights.py
"""
import tempfile

import torch

import safeloop
from _tiny import loader, net, sgd

trainer = safeloop.Trainer(model=net(), train_data=loader(), val_data=loader(n=6, seed=2), optimizer=sgd,
                           checkpoint={"dir": tempfile.mkdtemp(), "monitor": "val_loss", "keep": 1},
                           max_epochs=6, val_every=7, progress=False, device="cpu", loggers=[])
trainer.fit()
best = torch.load(trainer.checkpointer.best, weights_only=True)
print("the best: step", best["step"], "val_loss", dict(trainer.state.val_history)[best["step"]]["val_loss"])
print("trainer.test(val):", trainer.test(loader(n=6, seed=2)), "(the last weights, step", trainer.state.step, ")")
