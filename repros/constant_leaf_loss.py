"""A step whose loss is a constant leaf that requires grad (deep_pipe's masked_loss for an empty mask,
MoCo-style losses before the queue fills, "no valid pairs" in metric learning) is refused with NoGraphError
before backward, in every guard mode (check="off" too), by the Trainer and under watch. PyTorch runs that
backward (it only sets the leaf's .grad) and the optimizer skips parameters without gradient.
The same constant made a non-leaf (``torch.tensor(0., requires_grad=True).sum()``, or ``.to(prediction)`` moving
it to CUDA) gets an UnusedGradientWarning instead ("this loss trains nothing"), under check="auto"/"always".
Run: python repros/constant_leaf_loss.py"""
import warnings
import torch
from safeloop import Trainer

torch.manual_seed(0)
model = torch.nn.Linear(2, 1)
data = [(torch.randn(4, 2), torch.ones(4, dtype=torch.bool)), (torch.randn(4, 2), torch.zeros(4, dtype=torch.bool))]


class Masked(Trainer):
    def training_step(self, batch):
        x, mask = batch
        if not mask.any():  # nothing to learn from in this batch
            return torch.tensor(0., requires_grad=True)
        return self.model(x)[mask].pow(2).mean()


opt = torch.optim.Adam(model.parameters(), lr=0.1)
for x, mask in data:  # the same steps by hand: no error
    opt.zero_grad()
    (torch.tensor(0., requires_grad=True) if not mask.any() else model(x)[mask].pow(2).mean()).backward()
    opt.step()
print("hand loop: ok")


class Summed(Masked):
    def training_step(self, batch):
        x, mask = batch
        if not mask.any():
            return torch.tensor(0., requires_grad=True).sum()
        return self.model(x)[mask].pow(2).mean()


with warnings.catch_warnings(record=True) as seen:
    warnings.simplefilter("always")
    Summed(model=model, train_data=data, optimizer=torch.optim.Adam(model.parameters(), lr=0.1), max_steps=2,
           device="cpu", progress=False, loggers=()).fit()
print("non-leaf constant:", [type(w.message).__name__ for w in seen])  # ['UnusedGradientWarning']
Masked(model=model, train_data=data, optimizer=torch.optim.Adam(model.parameters(), lr=0.1), max_steps=2,
       device="cpu", progress=False, loggers=(), guard={"check": "off"}).fit()  # NoGraphError at step 2
