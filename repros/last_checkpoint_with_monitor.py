"""checkpoint={"monitor": "val_loss", "keep": 2} keeps the best two and the newest validation's checkpoint (step 42).

docs/trainer.md maps Lightning's ModelCheckpoint(monitor=, save_top_k=2, save_last=True) to this ("the K best and the
newest"). Lightning 2.6.6 writes last.ckpt only when a top-k checkpoint is saved in that step
(pytorch_lightning/callbacks/model_checkpoint.py:515-519), so on the same run its last.ckpt holds step 28, the last
validation that entered the best two, and no file holds step 42 (tests/lightning/test_parity2.py,
test_last_checkpoint_with_a_monitor_holds_what_lightnings_last_ckpt_holds).

Run: PYTHONPATH=. python repros/last_checkpoint_with_monitor.py
"""
import tempfile
from pathlib import Path

import torch

import safeloop
from _tiny import loader, net, sgd

d = Path(tempfile.mkdtemp())
trainer = safeloop.Trainer(model=net(), train_data=loader(), val_data=loader(n=6, seed=2), optimizer=sgd,
                           checkpoint={"dir": str(d), "monitor": "val_loss", "keep": 2, "every": None},
                           max_epochs=6, val_every=7, progress=False, device="cpu", loggers=[])
trainer.fit()
print("validations:", [(s, round(m["val_loss"], 3)) for s, m in trainer.state.val_history])
print("files (step held):", sorted(torch.load(p, weights_only=True)["step"] for p in d.glob("step-*.pt")))
print("Lightning's on this run: step=14.ckpt, step=28.ckpt, last.ckpt holding 28")
