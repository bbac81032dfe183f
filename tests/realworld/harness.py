"""What every real-world case runs: its hand-written loop, the same loop under ``safeloop.watch``'s
guard, then its port to ``safeloop.Trainer``, under one guard mode, and a bit-for-bit comparison of
every parameter and buffer."""
from __future__ import annotations

import copy
import re
import warnings
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager

import pytest
import torch

from safeloop import GraphGuard
from safeloop.watch import Watch

CHECKS = ("auto", "always", "off")


def checks(**failing: tuple[type[BaseException], str]) -> list:
    """The guard modes to parametrize a case with. ``failing`` maps a mode to (the error it raises
    today, why): a strict xfail, so that the case shows up the day the guard stops raising."""
    return [pytest.param(mode, marks=pytest.mark.xfail(strict=True, raises=failing[mode][0],
                                                       reason=f"{failing[mode][0].__name__}: {failing[mode][1]}"))
            if mode in failing else mode for mode in CHECKS]


def compare(make_model: Callable[[], torch.nn.Module], hand: Callable, port: type, data: Callable, check: str,
            steps: int, rebuild: bool = False, **trainer_kwargs) -> None:
    """Train the same seeded model three times from the same RNG state: by ``hand(model, data(model))``,
    by the same hand-written loop under ``python -m safeloop.watch``'s guard (``Watch``: every backward
    and optimizer step of the unmodified loop checked), and by ``port(...).fit()``; assert every
    parameter and buffer of the last two equal to the first's, bit for bit.

    The watched loop and the port run with warnings as errors, except those the hand-written loop
    itself emits (the source's own, a deprecated call say): correct code must run with no error and
    no warning. ``rebuild``: each run's model is built anew from the same seed, for models a deep copy cannot
    copy (hook-based ``weight_norm``).
    """
    def model() -> torch.nn.Module:
        torch.manual_seed(0)
        return make_model()
    ref = model()
    ours, watched, start = (model(), model(), model()) if rebuild else \
        (copy.deepcopy(ref), copy.deepcopy(ref), copy.deepcopy(ref))
    torch.manual_seed(1)
    with warnings.catch_warnings(record=True) as own:
        warnings.simplefilter("always")
        hand(ref, data(ref))
    torch.manual_seed(1)
    with strict(own), Watch(GraphGuard(check=check), hand.__code__.co_filename):
        hand(watched, data(watched))
    assert_same(watched, ref)
    torch.manual_seed(1)
    with strict(own):
        trainer = port(model=ours, train_data=data(ours), max_steps=steps, device="cpu", progress=False,
                       loggers=(), guard={"check": check}, **trainer_kwargs)
        trainer.fit()
    assert trainer.state.step == steps
    assert_same(ours, ref)
    trained = [name for name, p in ref.named_parameters() if not torch.equal(p, start.get_parameter(name))]
    assert trained, "the hand-written loop changed no parameter: the comparison would prove nothing"


def compare_runs(make_model: Callable[[], torch.nn.Module], hand: Callable, port: type, make_data: Callable,
                 check: str, steps: int, **kwargs) -> list:
    """``compare`` with ``make_data()`` made afresh for each run: returns them in the order of the runs (the
    hand-written loop, the watched loop, the port), with what each run recorded on them (loss scales, rates)."""
    runs = []

    def data(model):
        runs.append(make_data())
        return runs[-1]
    compare(make_model, hand, port, data, check, steps, **kwargs)
    return runs


@contextmanager
def strict(own: list[warnings.WarningMessage]) -> Iterator[None]:
    """Warnings as errors, except those in ``own`` (the hand-written loop's)."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for w in own:
            warnings.filterwarnings("ignore", message=re.escape(str(w.message)), category=w.category)
        yield


def assert_same(ours: torch.nn.Module, ref: torch.nn.Module) -> None:
    """Every parameter and buffer (persistent or not) of ``ours`` equals ``ref``'s, bit for bit."""
    for kind in ("named_parameters", "named_buffers"):
        a, b = dict(getattr(ours, kind)()), dict(getattr(ref, kind)())
        assert a.keys() == b.keys()
        different = [name for name in a if not torch.equal(a[name], b[name])]
        assert not different, f"{kind[6:]} that differ from the hand-written loop: {different}"


def batches(n: int, *shapes: tuple[int, ...], seed: int = 2) -> list:
    """``n`` seeded batches of random tensors of ``shapes`` (one tensor, or a tuple of them)."""
    gen = torch.Generator().manual_seed(seed)
    out = [tuple(torch.randn(*shape, generator=gen) for shape in shapes) for _ in range(n)]
    return [b[0] for b in out] if len(shapes) == 1 else out


def labelled(n: int, classes: int = 3, seed: int = 4) -> list:
    """``n`` seeded classification batches: 8 inputs of 4 features and their labels."""
    gen = torch.Generator().manual_seed(seed)
    return [(torch.randn(8, 4, generator=gen), torch.randint(classes, (8,), generator=gen)) for _ in range(n)]


def bn_classifier() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.ReLU(), torch.nn.Linear(8, 3))


def fixed(items: Iterable) -> Callable:
    """``data`` for a case whose batches do not depend on the model."""
    items = list(items)
    return lambda model: items
