"""Graph-lifecycle safety: see autograd mistakes before they corrupt a step."""
from .guard import CHECKS, REUSE_POLICIES, Guard

__all__ = ["Guard", "CHECKS", "REUSE_POLICIES"]
