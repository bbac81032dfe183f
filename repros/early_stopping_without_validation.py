"""EarlyStopping with no validation during training never stops a run, and nothing says so.

safeloop's EarlyStopping counts in on_validation_end only (safeloop/callbacks.py:171); its on_fit_start
(safeloop/callbacks.py:167) checks nothing about validation. Without val_data there is no validation; with val_data
and no val_every there is one before training (not counted) and one at the end. Both runs below train all 70 steps.
Lightning's EarlyStopping(monitor="val_loss") without validation data raises "Early stopping conditioned on metric
`val_loss` which is not available" at the first epoch's end; with it, Lightning validates every epoch by default and
stops after step 14 (patience 1, SGD at 0.1). A monitored scheduler here is a ConfigError at start-up in both cases
(docs/trainer.md, Learning-rate schedules).

Run: PYTHONPATH=. python repros/early_stopping_without_validation.py
"""
import safeloop
from _tiny import loader, net, sgd


class Port(safeloop.Trainer):
    def validation_step(self, batch):
        x, y = batch
        return self.loss_fn(self.model(x), y)


for val in ({}, {"val_data": loader(n=6, seed=2)}):
    trainer = Port(model=net(), train_data=loader(), optimizer=lambda p: sgd(p, 0.1), max_epochs=10,
                   callbacks=[safeloop.EarlyStopping(monitor="val_loss", patience=1)], progress=False, device="cpu",
                   loggers=[], **val)
    trainer.fit()
    print("val_data" if val else "no val_data", "- trained steps:", trainer.state.step)
trainer = Port(model=net(), train_data=loader(), optimizer=lambda p: sgd(p, 0.1), max_epochs=10, val_every=7,
               val_data=loader(n=6, seed=2), callbacks=[safeloop.EarlyStopping(monitor="val_loss", patience=1)],
               progress=False, device="cpu", loggers=[])
trainer.fit()
print("val_data and val_every=7 - trained steps:", trainer.state.step, "(Lightning's default: 14)")
