"""A second fit() of the same Trainer keeps the optimizers the first made: configure_optimizers is not called again
(safeloop/trainer.py:415, "if not self.optimizers"). Lightning calls it at every fit (strategies/strategy.py:159):
its second fit goes on from the same step and epoch with new optimizers. So a layer unfrozen between two fits, with
configure_optimizers over the parameters that require gradients (the usual fine-tuning pattern), is trained by
Lightning's second fit and never by safeloop's, without a word (it even keeps accumulating .grad). The parameters
then differ from Lightning's by 0.0676 (0.0626 without the unfreezing: Adam's moments reset in Lightning).

Run: PYTHONPATH=. python repros/second_fit_keeps_optimizers.py
"""
import torch

import safeloop
from _tiny import loader, net


class Finetune(safeloop.Trainer):
    def configure_optimizers(self):
        print("configure_optimizers called")
        return torch.optim.Adam((p for p in self.model.parameters() if p.requires_grad), lr=1e-2)


trainer = Finetune(model=net(), train_data=loader(), max_epochs=1, progress=False, device="cpu", loggers=[])
trainer.model[0].requires_grad_(False)
trainer.fit()
before = trainer.model[0].weight.detach().clone()
trainer.model[0].requires_grad_(True)  # unfreeze, train on
trainer.max_epochs = 2
trainer.fit()
print("step", trainer.state.step, "epoch", trainer.state.epoch)
print("first layer changed by the second fit:", not torch.equal(before, trainer.model[0].weight))
print("gradient left on it:", trainer.model[0].weight.grad is not None)
