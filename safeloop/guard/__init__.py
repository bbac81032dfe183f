"""Graph-lifecycle safety: see autograd mistakes before they corrupt a step."""
from ..settings import CHECKS, REUSE_POLICIES
from .guard import Guard

__all__ = ["Guard", "CHECKS", "REUSE_POLICIES"]
