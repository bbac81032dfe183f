"""An edit of the checkpoint dict in on_load_checkpoint (an old checkpoint converted, an entry renamed) is ignored:
safeloop calls the hook after it has loaded everything (safeloop/trainer.py:389-391). Lightning calls it before it
loads the weights and optimizer states (pytorch_lightning/trainer/connectors/checkpoint_connector.py:283-286), so the
edit is what training resumes from. docs/trainer.md's map says "on_save_checkpoint, on_load_checkpoint | the same
names".

Run: PYTHONPATH=. python repros/on_load_checkpoint_edits_ignored.py (the resumed first bias printed: not zero)
"""
import tempfile

import torch

import safeloop
from _tiny import loader, net


class Edits(safeloop.Trainer):
    def on_load_checkpoint(self, checkpoint):
        checkpoint["modules"]["model"]["0.bias"].zero_()  # Lightning's: checkpoint["state_dict"]["model.0.bias"]

    def on_fit_start(self):
        print("first bias as training starts:", self.model[0].bias.detach())


d = tempfile.mkdtemp()
common = dict(train_data=loader(), optimizer=lambda p: torch.optim.Adam(p, lr=1e-2), progress=False, device="cpu",
              loggers=[])
Edits(model=net(), max_steps=7, checkpoint={"dir": d, "every": 7}, **common).fit()
Edits(model=net(), max_steps=8, resume=d, **common).fit()
