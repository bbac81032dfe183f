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

A snapshot costs one ``torch.cat`` per device and dtype: every parameter and state tensor
copied into one flat buffer kept from step to step (parameters + optimizer state, once more).
"""
from __future__ import annotations

from itertools import chain
from typing import Any

import torch

_data_ptr = torch.Tensor.data_ptr


class Snapshot:
    """The parameters, state and hyperparameters of one optimizer (and its scheduler)."""

    def __init__(self, optimizer: torch.optim.Optimizer, scheduler: Any = None):
        self.optimizer, self.scheduler = optimizer, scheduler
        self._live: list[torch.Tensor] = []  # parameters, then tensor state values
        self._ptrs: list[int | None] = []  # ``_addresses()`` when ``_build`` listed them
        self._tensors_only = False  # every state value was a tensor at ``_build``
        self._param_lists: list[list[torch.Tensor]] = []
        self._params: list[torch.Tensor] = []
        self._keys: list[tuple[torch.Tensor, str]] = []  # (param, state key) of each tensor state value
        self._others: list[tuple[torch.Tensor, str]] = []  # state entries that are not tensors
        self._copies: list[tuple[torch.Tensor, list[torch.Tensor]]] = []  # (flat buffer, flat views of live tensors)
        self._loose: tuple[list[torch.Tensor], list[torch.Tensor]] = ([], [])  # non-contiguous: (live, copies)
        self._saved: list[torch.Tensor] = []  # each live tensor's saved value (a view into its buffer)
        self._values: list[Any] = []  # the non-tensor state values at ``take``
        self._groups: list[dict] = []
        self._group_tensors: list[tuple[torch.Tensor, torch.Tensor]] = []  # (tensor in a param group, its value)
        self._schedule: dict | None = None

    def take(self) -> None:
        opt = self.optimizer
        if not self._layout_holds():
            self._build()
        for flat, views in self._copies:  # the views are detached: no autograd, no no_grad() needed
            torch.cat(views, out=flat)
        if self._loose[0]:
            torch._foreach_copy_(self._loose[1], self._loose[0])
        self._values = [opt.state[p][key] for p, key in self._others]
        self._groups = [dict(g) for g in opt.param_groups]
        # a tensor hyperparameter (lr=torch.tensor(...)) is changed in place by schedulers: keep its value
        self._group_tensors = [(value, value.clone()) for group in opt.param_groups
                               for value in group.values() if type(value) is torch.Tensor]
        self._schedule = self.scheduler.state_dict() if self.scheduler is not None else None

    def _layout_holds(self) -> bool:
        """Whether the optimizer holds the tensors ``_build`` listed, their data where it was (every step, so cheap)."""
        opt = self.optimizer
        if not self._live or len(opt.param_groups) != len(self._param_lists):
            return False
        if any(g["params"] is not params for g, params in zip(opt.param_groups, self._param_lists)):
            return False
        try:
            return self._addresses() == self._ptrs
        except TypeError:  # a state value that is not a tensor where ``_build`` saw only tensors
            return False

    def _addresses(self) -> list[int | None]:
        """Where the parameters' data live, then each state entry's (None: not a tensor), in the state's own
        order: read without looking a parameter up in the state, which hashes it in Python. A replaced tensor
        (``p.data = ...``, a loaded state) has a new address: the old one is still held by the views, so no
        new tensor can have it; an entry added or removed changes the length. When every state value was a
        tensor (Adam, SGD with momentum), one pass in C: 5-7 µs less on the GAN benchmark's discriminator,
        whose tensors the step's compute has pushed out of cache."""
        state = self.optimizer.state
        if self._tensors_only:
            return list(map(_data_ptr, chain(self._params, chain.from_iterable(map(dict.values, state.values())))))
        return list(map(_data_ptr, self._params)) + [_data_ptr(v) if isinstance(v, torch.Tensor) else None
                                                     for entry in state.values() for v in entry.values()]

    def _build(self) -> None:
        """List the parameters and state tensors and allocate their copies (first step, or new layout)."""
        opt = self.optimizer
        self._param_lists = [g["params"] for g in opt.param_groups]
        self._params = [p for params in self._param_lists for p in params]
        live, keys, others = list(self._params), [], []
        for p in self._params:
            for key, value in opt.state.get(p, {}).items():  # .get: must not create empty state entries
                if isinstance(value, torch.Tensor):
                    keys.append((p, key))
                    live.append(value)
                else:
                    others.append((p, key))
        self._live, self._keys, self._others = live, keys, others
        self._tensors_only = False
        self._ptrs = self._addresses()
        self._tensors_only = None not in self._ptrs
        buckets: dict[tuple, list[int]] = {}
        loose = []
        for i, t in enumerate(live):
            if t.is_contiguous():
                buckets.setdefault((t.device, t.dtype), []).append(i)
            else:
                loose.append(i)
        saved: list[torch.Tensor | None] = [None] * len(live)
        self._copies = []
        for (device, dtype), index in buckets.items():
            flat = torch.empty(sum(live[i].numel() for i in index), device=device, dtype=dtype)
            start = 0
            for i in index:
                n = live[i].numel()
                saved[i] = flat[start:start + n].view_as(live[i])
                start += n
            self._copies.append((flat, [live[i].detach().view(-1) for i in index]))
        for i in loose:
            saved[i] = live[i].detach().clone()
        self._loose = ([live[i].detach() for i in loose], [saved[i] for i in loose])
        self._saved = saved

    def nbytes(self) -> int:
        return sum(flat.nbytes for flat, _ in self._copies) + sum(t.nbytes for t in self._loose[1])

    def restore(self) -> None:
        """Put back exactly what ``take`` saw."""
        opt = self.optimizer
        params = self._params
        with torch.no_grad():
            for p, saved in zip(params, self._saved):
                p.copy_(saved)
        for p in params:  # state created by the failed step (a first update) must go too
            opt.state.pop(p, None)
        for (p, key), saved in zip(self._keys, self._saved[len(params):]):
            opt.state[p][key] = saved.clone()
        for (p, key), value in zip(self._others, self._values):
            opt.state[p][key] = value
        for group, saved in zip(opt.param_groups, self._groups):
            group.update(saved)
        for tensor, value in self._group_tensors:  # group.update put the tensor itself back
            with torch.no_grad():
                tensor.copy_(value)
        if self._schedule is not None:
            self.scheduler.load_state_dict(self._schedule)
        self._live = []  # the state tensors are new ones: list them again at the next ``take``


class Undo:
    """Which optimizer updates of the current step a failure can undo, and the undoing.

    The step calls ``before_update(name, last)`` just before each optimizer update (``last``:
    whether it is the step's last update, None when unknown, as in manual mode),
    ``restore()`` when the step fails and ``end()`` when it succeeds.
    """

    def __init__(self, mode: str, optimizers: dict, schedulers: dict):
        self.mode, self.optimizers, self.schedulers = mode, optimizers, schedulers
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
                snapshot = self._snapshots[name] = Snapshot(self.optimizers[name], self.schedulers.get(name))
            snapshot.take()
            self.saved.append(name)
        else:
            self.unsaved.append(name)

    def end(self) -> None:
        """The step is over (done or undone): learn the order of its updates, start the next one clean."""
        order = self.order
        if order:
            self._seen.update(order)
            self._followed.update(order[:-1])
            order.clear()
        if self.saved:
            self.saved.clear()
        if self.unsaved:
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
        self.order.clear()  # an abandoned step may not have reached its last update: nothing is learned from it
        self.end()
        return report
