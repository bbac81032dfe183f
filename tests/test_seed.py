"""seed_everything(workers=True): each DataLoader worker of each rank draws its own reproducible numbers."""
import random

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, Dataset

from safeloop import seed_everything
from safeloop.seed import SEED_WORKERS, seeded_workers


class Draws(Dataset):
    """Each item: the worker that made it and its draws from random, numpy and torch."""

    def __len__(self):
        return 4

    def __getitem__(self, i):
        worker = torch.utils.data.get_worker_info().id
        return worker, random.random(), float(np.random.rand()), float(torch.rand(()))


def draws(loader) -> dict[int, tuple]:
    return {int(w): (r, n, t) for batch in loader for w, r, n, t in zip(*batch)}


@pytest.fixture
def env(monkeypatch):
    monkeypatch.setenv(SEED_WORKERS, "0")  # put back as it was after the test
    monkeypatch.delenv("RANK", raising=False)
    return monkeypatch


def test_workers_draw_the_same_after_the_same_seed_apart_from_each_other_and_from_other_ranks(env):
    made_before = DataLoader(Draws(), batch_size=2, num_workers=2)

    def run(rank: int) -> dict[int, tuple]:
        env.setenv("RANK", str(rank))
        seed_everything(7, workers=True)
        return draws(seeded_workers(made_before))

    first, again, rank1 = run(0), run(0), run(1)
    assert first == again  # reproducible
    assert first[0] != first[1]  # each worker its own numbers
    assert all(first[w][k] != rank1[w][k] for w in (0, 1) for k in range(3))  # and each rank
    assert made_before.worker_init_fn is not None


def test_without_workers_true_the_loader_is_left_alone(env):
    loader = DataLoader(Draws(), batch_size=2, num_workers=2)
    seed_everything(7)
    assert seeded_workers(loader).worker_init_fn is None
