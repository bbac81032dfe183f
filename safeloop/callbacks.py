"""Callback objects: the Trainer's hooks, as separate objects.

A callback's hook receives the trainer first: ``on_step_end(self, trainer, losses)``.
Only hooks a callback overrides are called. ``on_save_checkpoint`` puts what the callback needs
saved into the checkpoint dict under a key of its own (tensors and plain containers);
``on_load_checkpoint`` reads it back when a run resumes.
"""
from __future__ import annotations

HOOKS = (
    "on_fit_start",
    "on_step_start",
    "on_before_backward",
    "on_after_backward",
    "on_before_optimizer_step",
    "on_step_end",
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
    def on_validation_end(self, trainer, metrics) -> None: ...
    def on_fit_end(self, trainer) -> None: ...
    def on_save_checkpoint(self, trainer, checkpoint) -> None: ...
    def on_load_checkpoint(self, trainer, checkpoint) -> None: ...
