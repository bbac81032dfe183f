"""Seeded synthetic data generated in-process, for the default job, recipes and tests."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

import torch
from torch.utils.data import DataLoader, TensorDataset


def positive(**values) -> None:
    """Raise a ValueError naming each of ``values`` that is not a number above zero: a size of zero makes an empty
    dataset or layer (which trains nothing without a word from torch), a negative one fails deep inside it."""
    bad = [f"{key}={value!r}" for key, value in values.items()
           if not (isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0)]
    if bad:
        raise ValueError(f"{', '.join(bad)}: {', '.join(values)} must be positive")


def data_seed(seed: int | None) -> int:
    """``seed``; with ``seed=null`` (nothing seeded, lightning-hydra-template's default) one drawn from torch's
    random state, so that the data is drawn unseeded too."""
    return int(torch.randint(2**31, ())) if seed is None else seed


@dataclass
class Data:
    train: Iterable
    val: Iterable | None = None


def regression(n_train: int = 4096, n_val: int = 512, in_dim: int = 16, out_dim: int = 1,
               batch_size: int = 64, noise: float = 0.05, seed: int | None = 0) -> Data:
    """A smooth nonlinear target, y = sin(x A) B + noise, that a small MLP can learn."""
    positive(n_train=n_train, n_val=n_val, in_dim=in_dim, out_dim=out_dim, batch_size=batch_size)
    seed = data_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    a = torch.randn(in_dim, 32, generator=gen) / in_dim**0.5
    b = torch.randn(32, out_dim, generator=gen) / 32**0.5

    def make(n: int):
        x = torch.randn(n, in_dim, generator=gen)
        y = torch.sin(2 * x @ a) @ b + noise * torch.randn(n, out_dim, generator=gen)
        return TensorDataset(x, y)

    train, val = make(n_train), make(n_val)
    loader_gen = torch.Generator().manual_seed(seed + 1)
    return Data(DataLoader(train, batch_size=batch_size, shuffle=True, generator=loader_gen, drop_last=True),
                DataLoader(val, batch_size=batch_size))
