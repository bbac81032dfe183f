"""Physics-informed and operator-learning libraries, their own loops run from the same seeds:

- DeepXDE 1.15.0 (backend pytorch): examples/pinn_forward/Poisson_Dirichlet_1d.py (``dde.data.PDE``, a residual
  through ``dde.grad.hessian``, ``model.compile("adam")`` then ``model.compile("L-BFGS")``, the README's pattern) and
  Burgers.py (``dde.data.TimePDE``, ``dde.grad.jacobian`` and ``hessian`` on one cached Jacobian, an IC and a BC,
  ``PDEPointResampler``). DeepXDE's loss closure (``Model._compile_pytorch``'s ``train_step``) makes the inputs
  require grad, takes the derivatives with ``torch.autograd.grad(..., create_graph=True)``, caches them in
  ``dde.grad``'s ``Jacobians``/``Hessians`` until ``grad.clear()`` at the end of the loss, and hands the closure to
  ``optimizer.step`` (L-BFGS calls it several times a step);
- a PINN written by hand in plain torch, as DeepXDE users write one next to it (collocation points made once with
  ``requires_grad_()``, ``u_x``/``u_xx`` by ``torch.autograd.grad(..., create_graph=True)``, a Dirichlet term), and
  its ``safeloop.Trainer`` port;
- neuraloperator 2.0.0: an ``FNO`` trained by ``neuralop.Trainer`` (``train_one_batch`` makes the loss,
  ``train_one_epoch`` back-propagates it and steps), with ``H1Loss`` for training and ``LpLoss``/``H1Loss`` for
  evaluation, and the same FNO in a hand loop with ``LpLoss``, ported to ``safeloop.Trainer``.

Each runs bare, under ``python -m safeloop.watch``'s guard (``Watch``, in process, this file being the user's script)
and with a ``safeloop.GraphGuard`` where a user of the library puts one. DeepXDE: a ``dde.callbacks.Callback``
(``GuardSteps``) opens ``guard.step()`` at ``on_batch_begin`` and closes it at ``on_batch_end`` (DeepXDE brackets
each ``_train_step`` with them; its L-BFGS loop skips ``on_batch_end`` when it converges, so ``on_train_end`` closes
what is open); DeepXDE hands a callback no loss, so the callback also enters a ``TorchFunctionMode`` sending each
``Tensor.backward`` of the step to ``guard.backward`` (no DeepXDE method is patched). neuralop: a ``Trainer``
subclass whose ``train_one_batch`` runs ``guard.check(loss)`` on the loss it returns, with ``GraphGuard(model,
optimizer)`` ending a step at each optimizer step. Every parameter and buffer, the optimizer's state and what the
library records (DeepXDE's loss history, neuralop's epoch metrics) must come out bit for bit the same in every
guard mode, with no warning the bare run does not emit.

Then the mistakes of a PINN loop: the derivative ``u_x`` taken from a forward done before the loop and reused by
every step; ``torch.autograd.grad`` without ``create_graph=True``; each step's derivative kept in a history list
with its graph; a boundary target computed once from the model before the loop; DeepXDE's ``dde.grad`` cache used in
a hand loop without ``dde.grad.clear()``. What the guard does with each is asserted below, also where it says
nothing.

Changes for a seconds-long test: tiny nets (two hidden layers of 16), few collocation points, a few iterations,
L-BFGS's ``iter_per_step`` set to 4 (DeepXDE computes it at import, from the default ``maxiter``); random fields for
the operator's data.
"""
import contextlib
import functools
import math
import os
import re
import warnings
from copy import deepcopy

os.environ.setdefault("DDE_BACKEND", "pytorch")  # DeepXDE reads it at import (deepxde/backend/__init__.py)

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
from torch.overrides import TorchFunctionMode  # noqa: E402

from safeloop import GraphGuard, Trainer  # noqa: E402
from safeloop.errors import GraphLeakWarning, GraphReuseError, NoGraphError  # noqa: E402
from safeloop.watch import Watch  # noqa: E402
from tests.libraries import compare  # noqa: E402
from tests.libraries.compare import same  # noqa: E402
from tests.realworld.harness import checks, strict  # noqa: E402

try:
    import deepxde as dde
except ImportError:
    dde = None
try:
    import neuralop
    from neuralop.losses import H1Loss, LpLoss
    from neuralop.models import FNO
except ImportError:
    neuralop = None

needs_dde = pytest.mark.skipif(dde is None or dde.backend.backend_name != "pytorch",
                               reason="deepxde with its pytorch backend is not installed")
needs_neuralop = pytest.mark.skipif(neuralop is None, reason="neuraloperator is not installed")

seed = compare.seed_all  # DeepXDE samples points with NumPy's global generator
seeded = functools.partial(compare.seeded, seed=seed)
three_runs = functools.partial(compare.three_runs, seed=seed)


def watched(train, *args, check="always", **kwargs):
    """``train(*args, **kwargs)`` under ``Watch`` (this file as the script)."""
    with Watch(GraphGuard(check=check), __file__):
        return train(*args, **kwargs)


def stepped(guard):
    return guard.step() if guard is not None else contextlib.nullcontext()


def backward(guard, loss):
    return guard.backward(loss) if guard is not None else loss.backward()


# == DeepXDE =========================================================================================================
class Backwards(TorchFunctionMode):
    """While entered, every ``Tensor.backward`` goes through ``guard.backward`` (torch's public override mode: every
    other function runs as it is)."""

    def __init__(self, guard):
        super().__init__()
        self.guard = guard

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is torch.Tensor.backward:
            return self.guard.backward(*args, **(kwargs or {}))
        return func(*args, **(kwargs or {}))


if dde is not None:
    class GuardSteps(dde.callbacks.Callback):
        """A ``GraphGuard``'s steps as DeepXDE's training steps: ``guard.step()`` and ``Backwards(guard)`` entered at
        ``on_batch_begin``, left at ``on_batch_end`` (or at ``on_train_end``: DeepXDE's L-BFGS loop breaks out before
        ``on_batch_end`` once it converges)."""

        def __init__(self, guard):
            super().__init__()
            self.guard = guard
            self.open = contextlib.ExitStack()

        def on_batch_begin(self):
            self.open.enter_context(self.guard.step())
            self.open.enter_context(Backwards(self.guard))

        def on_batch_end(self):
            self.open.close()

        def on_train_end(self):
            self.open.close()


# examples/pinn_forward/Poisson_Dirichlet_1d.py: -u'' = pi^2 sin(pi x) on [-1, 1], u(-1) = u(1) = 0
def poisson_pde(x, y):
    dy_xx = dde.grad.hessian(y, x)
    return -dy_xx - np.pi ** 2 * torch.sin(np.pi * x)


def poisson_solution(x):
    return np.sin(np.pi * x)


def boundary(x, on_boundary):
    return on_boundary


def poisson_build():
    geom = dde.geometry.Interval(-1, 1)
    bc = dde.icbc.DirichletBC(geom, poisson_solution, boundary)
    data = dde.data.PDE(geom, poisson_pde, bc, 16, 2, solution=poisson_solution, num_test=20)
    net = dde.nn.FNN([1] + [16] * 2 + [1], "tanh", "Glorot uniform")
    return net, data


# examples/pinn_forward/Burgers.py: u_t + u u_x = (0.01 / pi) u_xx, u(x, 0) = -sin(pi x), u(+-1, t) = 0
def burgers_pde(x, y):
    dy_x = dde.grad.jacobian(y, x, i=0, j=0)
    dy_t = dde.grad.jacobian(y, x, i=0, j=1)
    dy_xx = dde.grad.hessian(y, x, i=0, j=0)
    return dy_t + y * dy_x - 0.01 / np.pi * dy_xx


def burgers_build():
    geom = dde.geometry.Interval(-1, 1)
    timedomain = dde.geometry.TimeDomain(0, 0.99)
    geomtime = dde.geometry.GeometryXTime(geom, timedomain)
    bc = dde.icbc.DirichletBC(geomtime, lambda x: 0, lambda _, on_boundary: on_boundary)
    ic = dde.icbc.IC(geomtime, lambda x: -np.sin(np.pi * x[:, 0:1]), lambda _, on_initial: on_initial)
    data = dde.data.TimePDE(geomtime, burgers_pde, [bc, ic], num_domain=32, num_boundary=8, num_initial=8)
    net = dde.nn.FNN([2] + [16] * 2 + [1], "tanh", "Glorot normal")
    return net, data


def lbfgs_options(steps):
    """``dde.optimizers.set_LBFGS_options(maxiter=steps)``; DeepXDE's pytorch backend computes the iterations of one
    ``optimizer.step`` (``iter_per_step``, ``fun_per_step``) at import, from the default ``maxiter``: set here."""
    dde.optimizers.set_LBFGS_options(maxiter=steps)
    dde.optimizers.config.LBFGS_options.update(iter_per_step=4, fun_per_step=5)


def recorded(model, losshistory):
    """What DeepXDE records: the loss history's steps, train and test losses and metrics, and the train state."""
    state = model.train_state
    return {"steps": list(losshistory.steps), "loss_train": [t.tolist() for t in losshistory.loss_train],
            "loss_test": [t.tolist() for t in losshistory.loss_test],
            "metrics": [list(map(float, m)) for m in losshistory.metrics_test],
            "step": state.step, "best_loss": float(state.best_loss_train)}


def dde_train(net, data, guard=None, iterations=12, lbfgs=0, callbacks=()):
    """The example's ``Model(data, net)``, ``compile("adam", lr=1e-3)``, ``train(iterations=...)``, then (``lbfgs``:
    its iterations) ``compile("L-BFGS")`` and ``train()``; ``guard``: ``GuardSteps(guard)`` among the callbacks."""
    steps = [GuardSteps(guard)] if guard is not None else []
    model = dde.Model(data, net)
    metrics = ["l2 relative error"] if data.soln is not None else []
    model.compile("adam", lr=1e-3, metrics=metrics)
    losshistory, _ = model.train(iterations=iterations, display_every=4, verbose=0,
                                 callbacks=[*deepcopy(list(callbacks)), *steps])
    out = {"net": net, "adam": model.opt.state_dict()}
    if lbfgs:
        lbfgs_options(lbfgs)
        model.compile("L-BFGS", metrics=metrics)
        losshistory, _ = model.train(verbose=0, callbacks=steps)
        out["lbfgs"] = model.opt.state_dict()
    return {**out, **recorded(model, losshistory)}


@needs_dde
@pytest.mark.parametrize("check", checks())
def test_deepxde_poisson_adam_then_lbfgs(check):
    """Poisson_Dirichlet_1d.py: Adam, then L-BFGS (whose closure DeepXDE's ``train_step`` hands to
    ``optimizer.step``), the residual through ``dde.grad.hessian``; the net, both optimizers' states and the loss
    history bit for bit alike bare, watched and guarded."""
    ref = three_runs(poisson_build, lambda *a, guard=None: dde_train(*a, guard=guard, lbfgs=8), check)
    assert ref["step"] == 12 + ref["lbfgs"]["state"][0]["n_iter"] >= 12 + 8
    assert ref["loss_train"][-1][0] < ref["loss_train"][0][0]


@needs_dde
@pytest.mark.parametrize("check", checks())
def test_deepxde_burgers_with_point_resampler(check):
    """Burgers.py: ``TimePDE`` with a BC and an IC, the residual through two ``dde.grad.jacobian`` entries of one
    cached Jacobian and a ``hessian``, the collocation points resampled every 4 steps (``PDEPointResampler``)."""
    resample = [dde.callbacks.PDEPointResampler(period=4)]
    ref = three_runs(burgers_build, lambda *a, guard=None: dde_train(*a, guard=guard, iterations=10,
                                                                     callbacks=resample), check)
    assert ref["step"] == 10 and len(ref["loss_train"][0]) == 3
