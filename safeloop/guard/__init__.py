"""Graph-lifecycle safety: see autograd mistakes before they corrupt a step.

``GraphGuard`` is the public guard (a plain loop's, and the Trainer's when handed one); ``Guard`` is
the engine it and the Trainer drive.
"""
from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ..settings import CHECKS, REUSE_POLICIES, GuardSettings, read
from .guard import Guard
from .loop import GraphGuard
from .words import MANUAL, TRAINER

__all__ = ["GraphGuard", "Guard", "CHECKS", "REUSE_POLICIES", "for_trainer"]


def for_trainer(given: GraphGuard | Guard | Mapping[str, Any] | None, out_dir: Path | None,
                manual: bool = False) -> tuple[Guard, list[str]]:
    """The engine a Trainer drives for its ``guard=`` argument, speaking of ``training_step`` (``manual``: of its
    ``self.backward`` calls): a ``GraphGuard``'s (``Trainer(guard=graph_guard)``), or one made from settings (a dict,
    or None: the defaults); and every problem with those settings. Its pictures go to ``out_dir`` (None, a Trainer
    without a run directory: no picture), unless the ``GraphGuard`` was given its own ``out_dir``."""
    words = MANUAL if manual else TRAINER
    if isinstance(given, GraphGuard):
        if given.out_dir is None:
            given.guard.out_dir = out_dir
        given = given.guard
    if isinstance(given, Guard):
        given.words = words
        return given, []
    settings, problems = read(GuardSettings, given if isinstance(given, Mapping) else {}, "guard")
    return (None if problems else Guard(**vars(settings), out_dir=out_dir, words=words)), problems
