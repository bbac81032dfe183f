"""A small run with everything exact resume must carry: dropout, a shuffled DataLoader,
Adam, a learning-rate schedule, validation. ``python -m tests.checkpoint_job DIR STEPS [RESUME]``
trains it in a new process (the tests' second half of an interrupted run)."""
from __future__ import annotations

import sys
from functools import partial

import torch
from torch.utils.data import DataLoader, TensorDataset

from safeloop import Trainer


def make(checkpoint_dir, max_steps: int, resume=None, own_generator: bool = True, cls: type[Trainer] = Trainer,
         **kwargs) -> Trainer:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Dropout(0.2), torch.nn.ReLU(), torch.nn.Linear(32, 1))
    gen = torch.Generator().manual_seed(1)
    x, y = torch.randn(200, 8, generator=gen), torch.randn(200, 1, generator=gen)
    # own_generator=False: the sampler seeds each epoch's shuffle from the global torch RNG
    loader = DataLoader(TensorDataset(x, y), batch_size=16, shuffle=True,
                        generator=torch.Generator().manual_seed(2) if own_generator else None)
    val = DataLoader(TensorDataset(x[:32], y[:32]), batch_size=16)
    settings = dict(max_steps=max_steps, val_every=5, checkpoint={"dir": str(checkpoint_dir), "every": 7},
                    resume=resume, progress=False, device="cpu", loggers=())
    settings.update(kwargs)
    return cls(model, loader, partial(torch.optim.Adam, lr=1e-2), val_data=val,
                   scheduler=partial(torch.optim.lr_scheduler.StepLR, step_size=4, gamma=0.7), **settings)


if __name__ == "__main__":
    torch.set_num_threads(1)
    make(sys.argv[1], int(sys.argv[2]), sys.argv[3] if len(sys.argv) > 3 else None).fit()
