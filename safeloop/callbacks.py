"""Callback objects: the Trainer's hooks, as separate objects.

A callback's hook receives the trainer first: ``on_step_end(self, trainer, losses)``.
Only hooks a callback overrides are called. ``on_save_checkpoint`` puts what the callback needs
saved into the checkpoint dict under a key of its own (tensors and plain containers);
``on_load_checkpoint`` reads it back when a run resumes.
"""
from __future__ import annotations

from collections.abc import Callable
from functools import partial

from lightning_utilities.core.overrides import is_overridden

HOOKS = (
    "on_fit_start",
    "on_step_start",
    "on_before_backward",
    "on_after_backward",
    "on_before_optimizer_step",
    "on_step_end",
    "on_epoch_start",
    "on_epoch_end",
    "on_validation_end",
    "on_fit_end",
    "on_save_checkpoint",
    "on_load_checkpoint",
)


class Callback:
    def on_fit_start(self, trainer) -> None: ...
    def on_step_start(self, trainer) -> None: ...
    def on_before_backward(self, trainer, name, loss) -> None: ...
    def on_after_backward(self, trainer, name) -> None: ...
    def on_before_optimizer_step(self, trainer, name, optimizer) -> None: ...
    def on_step_end(self, trainer, losses) -> None: ...
    def on_epoch_start(self, trainer) -> None: ...
    def on_epoch_end(self, trainer) -> None: ...
    def on_validation_end(self, trainer, metrics) -> None: ...
    def on_fit_end(self, trainer) -> None: ...
    def on_save_checkpoint(self, trainer, checkpoint) -> None: ...
    def on_load_checkpoint(self, trainer, checkpoint) -> None: ...


class Hooks:
    """The hooks a run calls: those overridden on the Trainer (its class or the instance itself,
    ``trainer.on_step_end = fn``) and on its callbacks, bound again at every ``fit`` (``bind``)."""

    def __init__(self, trainer, base: type):
        self.trainer, self.base = trainer, base
        self.bound: dict[str, list[Callable]] = {name: [] for name in HOOKS}

    def bind(self, callbacks: list[Callback]) -> None:
        trainer = self.trainer
        for name in HOOKS:
            fns = [getattr(trainer, name)] if is_overridden(name, trainer, self.base) else []
            fns += [partial(getattr(cb, name), trainer) for cb in callbacks if is_overridden(name, cb, Callback)]
            self.bound[name] = fns

    def __call__(self, name: str, *args) -> None:
        for fn in self.bound[name]:
            fn(*args)

    def has(self, *names: str) -> bool:
        """Whether any of these hooks is overridden anywhere."""
        return any(self.bound[name] for name in names)
