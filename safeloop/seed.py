"""``seed_everything``: the random generators a training run draws from, seeded from one number; and
``seed_worker``, which seeds each DataLoader worker apart from every other worker of every rank."""
from __future__ import annotations

import hashlib
import os
import random

import torch
from lightning_utilities.core.imports import RequirementCache

HAVE_NUMPY = RequirementCache("numpy")
SEED_WORKERS = "SAFELOOP_SEED_WORKERS"  # "1" once seed_everything(..., workers=True) ran (child processes see it)


def seed_everything(seed: int, workers: bool = False) -> None:
    """Seed Python's ``random``, NumPy's global generator (when installed) and torch's generators (the CPU's
    and every GPU's). ``Trainer(seed=N)`` calls it when a run starts; call it yourself before building the
    model to seed its initial weights too (as ``python -m safeloop``'s ``seed`` does).

    ``workers=True``: the Trainer's DataLoaders with workers and no ``worker_init_fn`` get ``seed_worker``, also
    those made before this call (Lightning's ``seed_everything(workers=True)``)."""
    random.seed(seed)
    torch.manual_seed(seed)  # every device's generator
    if HAVE_NUMPY:
        import numpy

        numpy.random.seed(seed)
    os.environ[SEED_WORKERS] = str(int(workers))


def seed_worker(worker_id: int) -> None:
    """A DataLoader ``worker_init_fn``: seeds the worker's ``random``, NumPy and torch generators from the
    loader's base seed, the worker's id and the process's rank under torchrun. Torch seeds each worker from
    the base seed and the worker's id only, and every rank seeded alike draws the same base seed: without
    the rank, rank 1's workers would repeat rank 0's random augmentations."""
    info = torch.utils.data.get_worker_info()
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else int(os.environ.get("RANK", 0))
    text = f"{info.seed - worker_id} {worker_id} {rank}"  # info.seed is torch's base seed + worker_id
    seed = int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little")
    random.seed(seed)
    torch.manual_seed(seed)
    if HAVE_NUMPY:
        import numpy

        numpy.random.seed(seed % 2**32)


def seeded_workers(data):
    """``data``, given ``seed_worker`` if ``seed_everything(..., workers=True)`` asked for it and it is a
    DataLoader with workers and no ``worker_init_fn`` of its own."""
    loader = isinstance(data, torch.utils.data.DataLoader) and data.num_workers and data.worker_init_fn is None
    if loader and os.environ.get(SEED_WORKERS) == "1":
        data.worker_init_fn = seed_worker
    return data
