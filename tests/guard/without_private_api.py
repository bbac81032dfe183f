"""Run the guard's cases on a torch without the private autograd API the guard prefers.

Hides, before safeloop is imported, what a newer or older torch may lack: ``node._sequence_nr``
(removed from every node type), ``torch._C._autograd._get_sequence_nr`` and
``torch._C._functions.AccumulateGrad``. Prints one line per case: ``name: outcome``.
"""
import ctypes
import gc
import sys
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def hide(owner, name: str) -> None:
    if isinstance(owner, type):  # node types are immutable: edit the type's own dict
        del gc.get_referents(owner.__dict__)[0][name]
        ctypes.pythonapi.PyType_Modified(ctypes.py_object(owner))
    else:
        delattr(owner, name)


for kind in [t for t in vars(torch._C._functions).values() if isinstance(t, type)] + [torch._C._FunctionBase]:
    if "_sequence_nr" in kind.__dict__:
        hide(kind, "_sequence_nr")
hide(torch._C._autograd, "_get_sequence_nr")
hide(torch._C._functions, "AccumulateGrad")
assert not hasattr((torch.ones(1, requires_grad=True) * 2).grad_fn, "_sequence_nr")

from safeloop import GraphGuard, Trainer  # noqa: E402  (after hiding)
from safeloop.guard import walk  # noqa: E402
from tests.test_step import GAN, ManualGAN, bce, gan_batches  # noqa: E402


class Plain(Trainer):
    def training_step(self, batch):
        return self.model(batch).pow(2).mean()


class Reuses(Plain):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.y = self.model.weight.sum(0).exp()

    def training_step(self, batch):
        return (self.model(batch) * self.y).pow(2).mean()


class Carries(Plain):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.h = torch.zeros(3, 4)

    def training_step(self, batch):
        self.h = torch.tanh(self.model(batch) + self.h)
        return self.h.pow(2).mean()


class Leaks(Plain):
    def training_step(self, batch):
        loss = super().training_step(batch)
        self.kept = getattr(self, "kept", []) + [loss]
        return loss


class Stale(ManualGAN):
    def training_step(self, batch):
        real, z = batch
        fake = self.model.g(z)
        g_loss = bce(self.model.d(fake), 1.0)  # built through D, whose step comes next
        self.backward(bce(self.model.d(real), 1.0) + bce(self.model.d(fake.detach()), 0.0), optimizer="d")
        self.step("d")
        self.backward(g_loss, optimizer="g")


def gan_loop(detach: bool) -> str:
    """A plain GAN loop under GraphGuard, its steps ended by the optimizers: G steps first, then D's loss
    goes through G's output, detached or not (then G's backward freed what D's backward needs)."""
    torch.manual_seed(0)
    g, d = torch.nn.Linear(2, 2), torch.nn.Linear(2, 1)
    og, od = torch.optim.SGD(g.parameters(), lr=0.1), torch.optim.SGD(d.parameters(), lr=0.1)
    guard = GraphGuard(optimizers={"g": og, "d": od}, check="always")
    try:
        for _ in range(3):
            fake = g(torch.randn(4, 2))
            og.zero_grad()
            guard.backward(-d(fake).mean())
            og.step()
            od.zero_grad()
            guard.backward(d(fake.detach() if detach else fake).mean())
            od.step()
    except Exception as err:  # the outcome is what is printed
        return f"{type(err).__name__}: {err}"
    return "trained"


def run(cls, check: str) -> str:
    gan = issubclass(cls, ManualGAN)
    data = gan_batches(4) if gan else [torch.randn(3, 4) for _ in range(8)]
    trainer = cls(model=GAN() if gan else torch.nn.Linear(4, 4), train_data=data, max_steps=4, device="cpu",
                  progress=False, loggers=(), guard={"check": check},
                  **({} if gan else {"optimizer": lambda p: torch.optim.Adam(p, lr=0.01)}))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            trainer.fit()
        except Exception as err:  # the outcome is what is printed
            return f"{type(err).__name__}: {err}"
    return "trained " + " ".join(type(w.message).__name__ for w in caught)


print(f"private API: sequence numbers {walk.HAS_SEQ}, cheap peek {walk.CHEAP_PEEK}")
for cls in (Plain, Reuses, Carries, Leaks, ManualGAN, Stale):
    for check in ("always", "auto"):
        print(f"{cls.__name__} {check}: {run(cls, check)}".replace("\n", " "))
for detach in (True, False):
    print(f"GAN loop {'detached' if detach else 'not detached'}: {gan_loop(detach)}".replace("\n", " "))
