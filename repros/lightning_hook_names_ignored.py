"""Lightning hook names kept on a port are never called, and no error says so.

docs/trainer.md: "A Trainer subclass or callback that keeps one of Lightning's names safeloop never calls
(on_train_epoch_end, optimizer_step, configure_gradient_clipping...) is a ConfigError at start-up naming safeloop's
way". safeloop/callbacks.py:42-56 (LIGHTNING_NAMES) lists 15 names; Lightning 2.6.6 calls many more in a fit, test
and predict, and a port keeping any of the ones below runs without them. on_after_batch_transfer is the one that
changes training: below, its transform (the input doubled) is skipped, and the parameters end up to 0.0735 from
Lightning's (tests/lightning/test_parity2.py, test_on_after_batch_transfer_transforms_the_batches).

Run: PYTHONPATH=. python repros/lightning_hook_names_ignored.py
"""
import torch

import safeloop
from _tiny import loader, net

NAMES = ["on_before_batch_transfer", "transfer_batch_to_device", "on_after_batch_transfer", "on_validation_start",
         "on_validation_epoch_start", "on_validation_batch_start", "on_validation_batch_end", "on_test_epoch_end",
         "on_predict_end", "prepare_data", "teardown", "configure_model", "val_dataloader"]
CALLBACK_NAMES = ["on_validation_start", "on_validation_epoch_start", "on_validation_batch_end", "setup",
                  "teardown", "state_dict", "load_state_dict", "on_exception"]
called = []


def hook(name):
    def fn(self, *args, **kwargs):
        called.append(name)
        return args[0] if args else None
    return fn


class Port(safeloop.Trainer):
    def validation_step(self, batch):
        x, y = batch
        return self.loss_fn(self.model(x), y)


Hooked = type("Hooked", (Port,), {name: hook(name) for name in NAMES})
Callback = type("Callback", (safeloop.Callback,), {name: hook("callback " + name) for name in CALLBACK_NAMES})
trainer = Hooked(model=net(), train_data=loader(n=4), val_data=loader(n=4, seed=2),
                 optimizer=lambda p: torch.optim.Adam(p, lr=1e-2), callbacks=[Callback()], max_steps=2, val_every=1,
                 progress=False, device="cpu", loggers=[])
trainer.fit()
trainer.test(loader(n=4, seed=2))
trainer.predict(loader(n=4, seed=2))
print("hooks called:", called, "of", len(NAMES) + len(CALLBACK_NAMES), "defined; no error")
