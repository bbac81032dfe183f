"""safeloop's Trainer against pytorch-lightning's, bit for bit: accumulation with clipping and a per-step schedule,
``max_steps`` with ``max_epochs``, the gradients hooks see, manual clipping and schedules, the validation at a run's
end, early stopping's other options, ``self.log``'s keywords, logged test metrics.

As in ``test_parity.py``: each test trains the same tiny seeded model with ``pytorch_lightning.Trainer`` and with
its port to ``safeloop.Trainer``; ``..._matches`` tests compare what a user relies on, ``..._differs_as_documented``
tests assert a difference the docs state, exactly. A difference the docs do not state is a test asserting
Lightning's behaviour, marked ``xfail(strict=True)`` with the reason, until it is fixed or documented.
"""
import math

import pytest
import torch
import torch.nn.functional as F

pl = pytest.importorskip("pytorch_lightning")

import safeloop  # noqa: E402

from .common import Lit, Port, assert_same, close, lightning, loader, mse, net, settings, sgd  # noqa: E402

EPOCHS, STEPS = 2, 7  # passes of 7 batches by default
pytestmark = pytest.mark.filterwarnings("ignore::Warning:pytorch_lightning", "ignore::Warning:lightning_fabric")


def lr_of(optimizer) -> float:
    return optimizer.param_groups[0]["lr"]


def warm_up(model):
    """SGD with momentum and a LambdaLR warm-up stepped after every update (``interval: step``)."""
    opt = sgd(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda k: min(1.0, (k + 1) / 4))
    return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


# -- accumulation with clipping and a per-step schedule, a short last window in each pass


class LitGrads(Lit):
    """The gradient norm ``on_after_backward`` and ``on_before_optimizer_step`` see, and the learning rate at
    each update."""

    def on_after_backward(self):
        self.after.append(norm(self.model))

    def on_before_optimizer_step(self, optimizer):
        self.before.append(norm(self.model))
        self.lrs.append(lr_of(optimizer))


class PortGrads(Port):
    after: list
    before: list
    lrs: list

    def on_after_backward(self, name):
        self.after.append(norm(self.model))

    def on_before_optimizer_step(self, name, optimizer):
        self.before.append(norm(self.model))
        self.lrs.append(lr_of(optimizer))


def norm(model) -> torch.Tensor:
    return torch.stack([p.grad.norm() for p in model.parameters() if p.grad is not None]).norm()


def grads_runs(accum, clip, configure=warm_up, **limits):
    lit = LitGrads(configure=configure)
    lit.after, lit.before, lit.lrs = [], [], []
    trainer = lightning(accumulate_grad_batches=accum, gradient_clip_val=clip, **limits)
    trainer.fit(lit, train_dataloaders=loader())
    port = PortGrads(model=net(), train_data=loader(), **settings(grad_accum=accum, grad_clip=clip, **limits))
    port.configure = staticmethod(configure)
    port.after, port.before, port.lrs = [], [], []
    port.fit()
    return trainer, lit, port


@pytest.mark.parametrize("accum, clip", [(1, 0.05), (3, 0.05), (3, None)])
def test_accumulation_clipping_and_a_per_step_warm_up_match(accum, clip):
    """``accumulate_grad_batches=3``, ``gradient_clip_val=0.05`` and a LambdaLR warm-up with ``interval: step``,
    over 2 passes of 7 batches (updates of 3, 3 and a last window of 1 in each pass): the parameters, the number of
    updates, the learning rate of each update, and the gradient norms ``on_after_backward`` (each micro-batch) and
    ``on_before_optimizer_step`` (before clipping) see, bit for bit."""
    trainer, lit, port = grads_runs(accum, clip, max_epochs=EPOCHS)
    updates = EPOCHS * (STEPS if accum == 1 else 3)
    assert trainer.global_step == port.state.step == updates
    assert lit.lrs == port.lrs and len(lit.lrs) == updates
    assert len(lit.after) == len(port.after) == EPOCHS * STEPS
    assert torch.equal(torch.stack(lit.after), torch.stack(port.after))
    assert torch.equal(torch.stack(lit.before), torch.stack(port.before))
    if clip is not None:
        assert max(float(n) for n in port.before) > clip  # the clipping acted
    assert_same(lit.model, port.model)


# -- max_steps and max_epochs together


@pytest.mark.parametrize("max_epochs, max_steps, accum, expected", [
    (2, 10, 1, 10), (1, 100, 1, 7), (3, 5, 3, 5), (2, 100, 3, 6)],
    ids=["steps first", "epochs first", "steps first, accumulating", "epochs first, accumulating"])
def test_max_steps_with_max_epochs_matches(max_epochs, max_steps, accum, expected):
    """Both limits given: training ends at whichever comes first, counted in updates (accumulation: 3 a pass)."""
    trainer, lit, port = grads_runs(accum, None, max_epochs=max_epochs, max_steps=max_steps)
    assert trainer.global_step == port.state.step == expected
    assert lit.lrs == port.lrs
    assert_same(lit.model, port.model)
