"""Graph-lifecycle safety: see autograd mistakes before they corrupt a step.

``GraphGuard`` is the public guard (a plain loop's, and the Trainer's when handed one); ``Guard`` is
the engine it and the Trainer drive.
"""
from ..settings import CHECKS, REUSE_POLICIES
from .guard import Guard
from .loop import GraphGuard

__all__ = ["GraphGuard", "Guard", "CHECKS", "REUSE_POLICIES"]
