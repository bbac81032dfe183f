"""Graph-lifecycle safety: see autograd mistakes before they corrupt a step."""
from ..settings import CHECKS, REUSE_POLICIES
from .guard import Guard
from .loop import GraphGuard

__all__ = ["Guard", "GraphGuard", "CHECKS", "REUSE_POLICIES"]
