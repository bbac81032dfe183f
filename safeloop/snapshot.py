"""Undoing the optimizer updates of a step that failed after an optimizer already stepped.

In manual mode (and with several optimizers) one optimizer can step before something
later in the same step raises. The Trainer takes a ``Snapshot`` of an optimizer just
before its first step in a step, and restores it when the step is abandoned, so that
parameters, optimizer state and learning-rate schedule are bit-identical to before the
step. Snapshots copy into buffers kept from step to step (one ``_foreach_copy_``), so a
step that does not fail pays one memory copy of the optimizer's tensors and no allocation.
"""
from __future__ import annotations

from typing import Any

import torch


class Snapshot:
    """The parameters, state and hyperparameters of one optimizer (and its scheduler)."""

    def __init__(self, optimizer: torch.optim.Optimizer, scheduler: Any = None):
        self.optimizer, self.scheduler = optimizer, scheduler
        self._live: list[torch.Tensor] = []  # parameters, then tensor state values
        self._saved: list[torch.Tensor] = []  # their copies, reused while ``_live`` is unchanged
        self._entries: list[tuple[torch.Tensor, str, bool, Any]] = []  # (param, key, is_tensor, index | value)
        self._n_params = 0
        self._groups: list[dict] = []
        self._schedule: dict | None = None

    def take(self) -> None:
        opt = self.optimizer
        params = [p for group in opt.param_groups for p in group["params"]]
        live = list(params)
        entries = []
        for p in params:
            state = opt.state.get(p)  # .get: reading must not create an empty state entry
            if not state:
                continue
            for key, value in state.items():
                if isinstance(value, torch.Tensor):
                    entries.append((p, key, True, len(live)))
                    live.append(value)
                else:
                    entries.append((p, key, False, value))
        with torch.no_grad():
            if len(live) == len(self._live) and all(a is b for a, b in zip(live, self._live)):
                torch._foreach_copy_(self._saved, live)
            else:  # first step, or the optimizer created new state (its first update): new buffers
                self._saved = [t.detach().clone() for t in live]
        self._live, self._entries, self._n_params = live, entries, len(params)
        self._groups = [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]
        self._schedule = self.scheduler.state_dict() if self.scheduler is not None else None

    def restore(self) -> None:
        """Put back exactly what ``take`` saw; the buffers are handed over, so the next ``take`` reallocates."""
        opt = self.optimizer
        params = self._live[:self._n_params]
        with torch.no_grad():
            for p, saved in zip(params, self._saved):
                p.copy_(saved)
        for p in params:  # state created by the failed step (a first update) must go too
            opt.state.pop(p, None)
        for p, key, is_tensor, where in self._entries:
            opt.state[p][key] = self._saved[where] if is_tensor else where
        for group, saved in zip(opt.param_groups, self._groups):
            group.update(saved)
        if self._schedule is not None:
            self.scheduler.load_state_dict(self._schedule)
        self._live, self._saved = [], []
