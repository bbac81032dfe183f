"""Small models for the default job and the tests."""
from __future__ import annotations

from torch import nn


class MLP(nn.Sequential):
    """``depth`` Linear layers with ``hidden`` units and ReLU between them."""

    def __init__(self, in_dim: int = 16, hidden: int = 64, out_dim: int = 1, depth: int = 2):
        bad = [f"{k}={v!r}" for k, v in (("in_dim", in_dim), ("hidden", hidden), ("out_dim", out_dim),
                                         ("depth", depth)) if not (isinstance(v, int) and v > 0)]
        if bad:  # a zero width trains nothing without a word from torch
            raise ValueError(f"{', '.join(bad)}: in_dim, hidden, out_dim and depth must be positive integers")
        dims = [in_dim] + [hidden] * (depth - 1) + [out_dim]
        layers: list[nn.Module] = []
        for i, (a, b) in enumerate(zip(dims, dims[1:])):
            layers.append(nn.Linear(a, b))
            if i < depth - 1:
                layers.append(nn.ReLU())
        super().__init__(*layers)
