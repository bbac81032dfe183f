"""What the library tests compare with: every bit of what two runs end with, and the three runs every correct loop
makes (bare, under ``watch``, with a ``GraphGuard``)."""
import contextlib
import math
import warnings
from copy import deepcopy

import torch
import torch.nn as nn
from torch.overrides import TorchFunctionMode

from safeloop import GraphGuard
from safeloop.watch import Watch
from tests.realworld.harness import strict


def same(ours, ref, where="result") -> None:
    """``ours`` equals ``ref`` bit for bit: modules (every parameter and buffer), tensors (their bits: a NaN equals
    the same NaN), dicts, lists and numbers."""
    if isinstance(ref, nn.Module):
        for kind in ("named_parameters", "named_buffers"):
            same(dict(getattr(ours, kind)()), dict(getattr(ref, kind)()), f"{where}.{kind[6:]}")
    elif isinstance(ref, torch.Tensor):
        assert ours.dtype == ref.dtype and ours.shape == ref.shape, where
        if ref.is_floating_point():
            assert torch.equal(ours.detach().reshape(-1).view(torch.uint8),
                               ref.detach().reshape(-1).view(torch.uint8)), where
        else:
            assert torch.equal(ours, ref), where
    elif isinstance(ref, dict):
        assert ours.keys() == ref.keys(), where
        for k in ref:
            same(ours[k], ref[k], f"{where}[{k!r}]")
    elif isinstance(ref, (list, tuple)):
        assert len(ours) == len(ref), where
        for i, (a, b) in enumerate(zip(ours, ref)):
            same(a, b, f"{where}[{i}]")
    elif isinstance(ref, float) and math.isnan(ref):
        assert isinstance(ours, float) and math.isnan(ours), where
    else:
        assert ours == ref, where


def seed_all(n) -> None:
    """torch's and NumPy's global generators from ``n`` (a library drawing from NumPy's: poutyne's loader, torchsde's
    Brownian motion, torchdiffeq's examples)."""
    import numpy as np  # (the libraries that draw from it install it)

    torch.manual_seed(n)
    np.random.seed(n)


def seeded(build, seed=torch.manual_seed):
    """``build()`` from ``seed(0)``, then ``seed(1)`` for the training (as ``three_runs`` does)."""
    seed(0)
    built = build()
    seed(1)
    return built


def three_runs(build, train, check, *, guarded=True, guard_for=None, seed=torch.manual_seed):
    """``train(*build())`` bare, under ``Watch`` (``train``'s file as the script) and, ``guarded``, with
    ``guard=GraphGuard(check=check)`` (or ``guard_for(check, *built)``: a guard made from what ``build`` made); each
    from the same seeds: ``seed(0)`` before ``build``, ``seed(1)`` before ``train``. ``train`` returns a dict whose
    first value is the trained module; all of it is compared with the bare run's, bit for bit, and the guarded runs
    may warn nothing the bare run does not. Returns the bare run's result."""
    def run(guard=None):
        seed(0)
        built = build()
        start = deepcopy(built[0])
        kw = {} if guard is None else {"guard": guard_for(check, *built) if guard_for else guard}
        seed(1)
        return train(*built, **kw), start
    with warnings.catch_warnings(record=True) as own:
        warnings.simplefilter("always")
        ref, start = run()
    with strict(own), Watch(GraphGuard(check=check), train.__code__.co_filename):
        watched, _ = run()
    same(watched, ref)
    if guarded:
        with strict(own):
            guarded_run, _ = run(guard=GraphGuard(check=check))
        same(guarded_run, ref)
    model = next(iter(ref.values()))
    assert any(not torch.equal(p, q) for p, q in zip(model.parameters(), start.parameters())), "nothing trained"
    return ref


def stepped(guard):
    """``guard.step()``, or nothing without a guard."""
    return guard.step() if guard is not None else contextlib.nullcontext()


class Backwards(TorchFunctionMode):
    """While entered, every ``Tensor.backward`` goes through ``guard.backward`` (for a library that calls backward
    itself and hands the user no loss; torch's public override mode: every other function runs as it is)."""

    def __init__(self, guard):
        super().__init__()
        self.guard = guard

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is torch.Tensor.backward:
            return self.guard.backward(*args, **(kwargs or {}))
        return func(*args, **(kwargs or {}))
