"""Undoing the optimizer updates of a step that failed after an optimizer already stepped.

In manual mode (and with several optimizers) one optimizer can step before something
later in the same step raises. The Trainer takes a ``Snapshot`` of an optimizer just
before its first step in a step, and restores it when the step is abandoned, so that
parameters, optimizer state and learning-rate schedule are bit-identical to before the
step. Snapshots copy into buffers kept from step to step (one ``_foreach_copy_``), so a
step that does not fail pays one memory copy of the optimizer's tensors and no allocation.
"""
from __future__ import annotations

import operator
from typing import Any

import torch


class Snapshot:
    """The parameters, state and hyperparameters of one optimizer (and its scheduler)."""

    def __init__(self, optimizer: torch.optim.Optimizer, scheduler: Any = None):
        self.optimizer, self.scheduler = optimizer, scheduler
        self._live: list[torch.Tensor] = []  # parameters, then tensor state values
        self._saved: list[torch.Tensor] = []  # their copies, reused while the layout holds
        self._tensors: list[tuple[torch.Tensor, str, int]] = []  # (param, state key, index into _live)
        self._others: list[tuple[torch.Tensor, str]] = []  # state entries that are not tensors
        self._values: list[Any] = []  # their values at ``take``
        self._param_lists: list[list[torch.Tensor]] = []
        self._n_params = self._n_entries = 0
        self._state_live: list[torch.Tensor] = []  # the state tensors of ``_live``, in ``_tensors`` order
        self._groups: list[dict] = []
        self._schedule: dict | None = None

    def take(self) -> None:
        opt = self.optimizer
        if not self._layout_holds():
            self._build()
        with torch.no_grad():
            torch._foreach_copy_(self._saved, self._live)
        self._values = [opt.state[p][key] for p, key in self._others]
        self._groups = [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]
        self._schedule = self.scheduler.state_dict() if self.scheduler is not None else None

    def _layout_holds(self) -> bool:
        """Whether the optimizer still holds exactly the tensors ``_build`` listed (per step, so cheap)."""
        opt, live, state = self.optimizer, self._live, self.optimizer.state
        if not live or len(opt.param_groups) != len(self._param_lists):
            return False
        if any(g["params"] is not params for g, params in zip(opt.param_groups, self._param_lists)):
            return False
        if sum(map(len, state.values())) != self._n_entries:
            return False
        now = [state[p][key] for p, key, _ in self._tensors]  # a list and map: this runs every step
        return all(map(operator.is_, now, self._state_live))

    def _build(self) -> None:
        """List the parameters and state tensors and allocate their copies (first step, or new state)."""
        opt = self.optimizer
        self._param_lists = [g["params"] for g in opt.param_groups]
        params = [p for params in self._param_lists for p in params]
        live, tensors, others = list(params), [], []
        for p in params:
            for key, value in opt.state.get(p, {}).items():  # .get: must not create empty state entries
                if isinstance(value, torch.Tensor):
                    tensors.append((p, key, len(live)))
                    live.append(value)
                else:
                    others.append((p, key))
        self._live, self._tensors, self._others, self._n_params = live, tensors, others, len(params)
        self._state_live = [live[i] for _, _, i in tensors]
        self._n_entries = sum(map(len, opt.state.values()))
        self._saved = [t.detach().clone() for t in live]

    def restore(self) -> None:
        """Put back exactly what ``take`` saw; the buffers are handed over, so the next ``take`` reallocates."""
        opt = self.optimizer
        params = self._live[:self._n_params]
        with torch.no_grad():
            for p, saved in zip(params, self._saved):
                p.copy_(saved)
        for p in params:  # state created by the failed step (a first update) must go too
            opt.state.pop(p, None)
        for p, key, i in self._tensors:
            opt.state[p][key] = self._saved[i]
        for (p, key), value in zip(self._others, self._values):
            opt.state[p][key] = value
        for group, saved in zip(opt.param_groups, self._groups):
            group.update(saved)
        if self._schedule is not None:
            self.scheduler.load_state_dict(self._schedule)
        self._live, self._saved = [], []
