"""Undoing the optimizer updates of a step that failed after an optimizer already stepped.

In manual mode (and with several optimizers) one optimizer can step before something
later in the same step raises. ``Undo`` takes a ``Snapshot`` of an optimizer just before
its first update in a step, and restores it when the step is abandoned, so that
parameters, optimizer state, param groups and learning-rate schedule are bit-identical to
before the step. ``trainer.undo`` says which updates are snapshotted:

- ``auto``: those a later update of the same step follows. An update that is the step's
  last (the last optimizer of an automatic step; in manual mode, the optimizer that stepped
  last in every earlier step) is not: nothing after it can fail but its own ``step()`` and
  its scheduler.
- ``full``: every update, so a failure anywhere in the step, the last ``optimizer.step()``
  and ``scheduler.step()`` included, is undone.
- ``off``: none (no snapshot memory).

A snapshot costs one ``torch._foreach_copy_``: every parameter and state tensor copied into a copy
kept from step to step (memory: parameters + optimizer state, once more).
"""
from __future__ import annotations

from operator import attrgetter
from typing import Any

import torch

from ..fsdp import local, locals_of
from ..schedules import Schedules


_LAYOUT = attrgetter("shape", "dtype")


class Snapshot:
    """The parameters, state and hyperparameters of one optimizer (and its scheduler), taken just
    before an update; ``restore`` puts back exactly what ``take`` saw."""

    def __init__(self, optimizer: torch.optim.Optimizer, scheduler: Any = None):
        self.optimizer, self.scheduler = optimizer, scheduler
        # a copy of each tensor, kept from step to step while the tensors keep their shapes and types: a fresh
        # multi-MB copy every step would fault its pages in again
        self._saved: list[torch.Tensor] = []
        self._layout: list[tuple] = []  # (shape, dtype) of each copy
        # a wrapper (Lookahead, SAM) keeps its inner optimizer's state apart from its own, and may count its steps in
        # a plain attribute: both are taken too
        self._inner = [Snapshot(inner) for inner in vars(optimizer).values()
                       if isinstance(inner, torch.optim.Optimizer) and inner is not optimizer]

    def take(self) -> None:
        opt = self.optimizer
        for inner in self._inner:
            inner.take()
        self._numbers = {k: v for k, v in vars(opt).items() if type(v) in (int, float, bool)}
        self._params = [p for g in opt.param_groups for p in g["params"]]
        # ``in`` first: looking a parameter up in the state (a defaultdict) would create an empty entry; a list in it
        # (L-BFGS's history) is changed in place by the update: a copy of it is kept
        self._state = [(p, _entry(opt.state[p])) for p in self._params if p in opt.state]
        live = locals_of(self._params + [v for _, entry in self._state for v in (entry or {}).values()
                                         if isinstance(v, torch.Tensor)])  # under FSDP2 this rank's shards
        # the copies are reused while every tensor keeps its shape and dtype (one comparison of two lists: the
        # per-tensor Python of a snapshot is what it costs on models of many small tensors)
        layout = list(map(_LAYOUT, live))
        if layout == self._layout:
            with torch.no_grad():
                torch._foreach_copy_(self._saved, live)  # one call for them all
        else:
            self._saved, self._layout = [t.detach().clone() for t in live], layout
        self._groups = [dict(g) for g in opt.param_groups]
        # a tensor hyperparameter (lr=torch.tensor(...)) is changed in place by schedulers: keep its value
        self._group_tensors = [(value, value.clone()) for group in opt.param_groups
                               for value in group.values() if type(value) is torch.Tensor]
        self._schedule = self.scheduler.state_dict() if self.scheduler is not None else None

    def nbytes(self) -> int:
        return sum(t.nbytes for t in self._saved) + sum(inner.nbytes() for inner in self._inner)

    def restore(self) -> None:
        opt, params = self.optimizer, self._params
        for inner in self._inner:
            inner.restore()
        vars(opt).update(self._numbers)
        with torch.no_grad():
            for p, saved in zip(params, self._saved):
                local(p).copy_(saved)
            for p in params:  # state created by the failed step (a first update) must go too
                opt.state.pop(p, None)
            values = iter(self._saved[len(params):])
            for p, entry in self._state:  # each state tensor as it was taken, with the values it had
                opt.state[p] = entry if entry is None else {
                    key: _put(value, next(values)) if isinstance(value, torch.Tensor) else _copied(value)
                    for key, value in entry.items()}
        for group, saved in zip(opt.param_groups, self._groups):
            group.update(saved)
        for tensor, value in self._group_tensors:  # group.update put the tensor itself back
            with torch.no_grad():
                tensor.copy_(value)
        if self._schedule is not None:
            self.scheduler.load_state_dict(self._schedule)


def _entry(state: dict | None) -> dict | None:
    """A parameter's state as a new dict (``_copied`` items). None as it is: ``ZeroRedundancyOptimizer``'s
    ``load_state_dict`` leaves None in its own state for each parameter another rank updates."""
    return None if state is None else {key: _copied(value) for key, value in state.items()}


def _copied(value: Any) -> Any:
    """A list or dict of an optimizer's state as a new one (its items the same objects), anything else itself."""
    return type(value)(value) if type(value) in (list, dict) else value


class Undo:
    """Which optimizer updates of the current step a failure can undo, and the undoing.

    The step calls ``before_update(name, last)`` just before each optimizer update (``last``:
    whether it is the step's last update, None when unknown, as in manual mode),
    ``restore()`` when the step fails and ``end()`` when it succeeds.
    """

    def __init__(self, mode: str, optimizers: dict, schedules: Schedules):
        self.mode, self.optimizers, self.schedules = mode, optimizers, schedules
        self._snapshots: dict[str, Snapshot] = {}
        self.saved: list[str] = []  # snapshotted in this step
        self.unsaved: list[str] = []  # updated in this step without a snapshot
        self.order: list[str] = []  # manual mode (``last`` unknown): updates of this step, in order
        self._seen: set[str] = set()  # manual mode: optimizers updated in an earlier step ...
        self._followed: set[str] = set()  # ... and those another update followed in the same step

    def nbytes(self) -> int:
        """Memory the snapshots hold (their copies live from step to step)."""
        return sum(s.nbytes() for s in self._snapshots.values())

    def before_update(self, name: str, last: bool | None) -> None:
        if last is None:  # manual mode: last if it always was
            self.order.append(name)
            last = name in self._seen and name not in self._followed
        if name in self.saved or name in self.unsaved:
            return
        if self.mode == "full" or (self.mode == "auto" and not last):
            snapshot = self._snapshots.get(name)
            if snapshot is None:
                snapshot = self._snapshots[name] = Snapshot(self.optimizers[name], self.schedules.schedulers.get(name))
            snapshot.take()
            self.saved.append(name)
        else:
            self.unsaved.append(name)

    def end(self) -> None:
        """The step is over (done or undone): learn the order of its updates, start the next one clean."""
        self._seen.update(self.order)
        self._followed.update(self.order[:-1])
        self.order.clear()
        self.saved.clear()
        self.unsaved.clear()

    def report(self) -> str:
        """What ``restore`` will leave as it was, for the error message."""
        if not self.unsaved:
            return "parameters and optimizer state are unchanged"
        names = ", ".join(repr(n) for n in self.unsaved)
        had = "had" if len(self.unsaved) == 1 else "had each"
        undone = f"; optimizer {', '.join(repr(n) for n in self.saved)} was restored" if self.saved else ""
        if self.mode == "off":
            return f"optimizer {names} {had} already updated its parameters, which trainer.undo=off leaves{undone}"
        return (f"optimizer {names} {had} already updated its parameters or begun to, and is not undone{undone}; "
                "set trainer.undo=full to make such failures undoable")

    def restore(self) -> str:
        """Undo the step's snapshotted updates (latest first); returns ``report()``."""
        report = self.report()
        for name in reversed(self.saved):
            self._snapshots[name].restore()
        self.schedules.mark()  # the schedulers as they were
        self.order.clear()  # an abandoned step may not have reached its last update: nothing is learned from it
        self.end()
        return report


def _put(tensor: torch.Tensor, saved: torch.Tensor) -> torch.Tensor:
    """``tensor`` with the values ``saved`` holds (under FSDP2, into this rank's shard)."""
    local(tensor).copy_(saved)
    return tensor
