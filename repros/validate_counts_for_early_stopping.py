"""trainer.validate() outside fit counts toward EarlyStopping's patience, though docs/trainer.md says "The validations
during training count". EarlyStopping.on_validation_end (safeloop/callbacks.py:171-174) skips only step 0, and
Trainer.validate() calls that hook whenever it runs (safeloop/trainer.py:325). Lightning's EarlyStopping skips any
validation outside fitting (pytorch_lightning/callbacks/early_stopping.py:208-211).

Below: 5 epochs, patience 3, two validations without improvement counted. Two validate() calls raise the count to
4, and the next fit() (max_epochs raised to 8) trains nothing: it stays at step 35. Lightning's count stays 2, and
its next fit trains to step 42, where its third validation without improvement stops it.

Run: PYTHONPATH=. python repros/validate_counts_for_early_stopping.py
"""
import safeloop
from _tiny import loader, net, sgd


class Val(safeloop.Trainer):
    def validation_step(self, batch):
        x, y = batch
        return self.loss_fn(self.model(x), y)


early = safeloop.EarlyStopping(monitor="val_loss", patience=3)
trainer = Val(model=net(), train_data=loader(), val_data=loader(n=6, seed=2), optimizer=lambda p: sgd(p, 0.02),
              callbacks=[early], max_epochs=5, val_every=7, progress=False, device="cpu", loggers=[])
trainer.fit()
print("after fit: step", trainer.state.step, "count", early.wait)
trainer.validate()
trainer.validate()
print("after two validate(): count", early.wait)
trainer.max_epochs = 8
trainer.fit()
print("after fit(max_epochs=8): step", trainer.state.step, "(Lightning: 42)")
