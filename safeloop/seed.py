"""``seed_everything``: the random generators a training run draws from, seeded from one number."""
from __future__ import annotations

import random

import torch
from lightning_utilities.core.imports import RequirementCache

HAVE_NUMPY = RequirementCache("numpy")


def seed_everything(seed: int) -> None:
    """Seed Python's ``random``, NumPy's global generator (when installed) and torch's generators (the CPU's
    and every GPU's). ``Trainer(seed=N)`` calls it when a run starts; call it yourself before building the
    model to seed its initial weights too (as ``python -m safeloop``'s ``seed`` does)."""
    random.seed(seed)
    torch.manual_seed(seed)  # every device's generator
    if HAVE_NUMPY:
        import numpy

        numpy.random.seed(seed)
