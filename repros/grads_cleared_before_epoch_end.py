"""The Trainer clears gradients right after each update, so code that runs between steps and reads
``p.grad`` sees None where a hand-written loop (``zero_grad()`` before ``backward()``) still has the last
step's gradients. timm's ``Lookahead.sync_lookahead()`` (called by timm's train.py after each epoch) skips
every parameter whose ``.grad`` is None, so in ``on_epoch_end`` it silently does nothing.
Run: python repros/grads_cleared_before_epoch_end.py"""
import torch
from safeloop import Trainer

torch.manual_seed(0)
data = [(torch.randn(4, 2), torch.randn(4, 1)) for _ in range(2)]


def sync(params):  # timm Lookahead.update_slow's guard, reduced
    return [p.grad is not None for p in params]


def hand(model):
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for x, y in data:
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    return sync(model.parameters())  # end of the epoch


class Port(Trainer):
    def on_epoch_end(self):
        self.seen = sync(self.model.parameters())


print("hand loop, epoch end, parameters a sync would update:", hand(torch.nn.Linear(2, 1)))
model = torch.nn.Linear(2, 1)
trainer = Port(model=model, train_data=data, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), max_epochs=1,
               device="cpu", progress=False, loggers=())
trainer.fit()
print("Trainer, on_epoch_end, parameters a sync would update:", trainer.seen)  # [False, False]
