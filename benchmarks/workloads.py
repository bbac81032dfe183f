"""The models and batches the benchmarks time: same seeds, same data for every system."""
from __future__ import annotations

import time

import torch
import torch.nn.functional as F
from torch import nn

from safeloop import Trainer
from safeloop.models import MLP


def tiny_mlp():
    return MLP(in_dim=64, hidden=64, out_dim=64, depth=2), 32, 64


def mid_mlp():
    return MLP(in_dim=512, hidden=512, out_dim=512, depth=8), 64, 512


class Encoder(nn.Module):
    """A small transformer encoder (2 layers, d_model 128) with a regression head."""

    def __init__(self, d_model: int = 128, layers: int = 2):
        super().__init__()
        layer = nn.TransformerEncoderLayer(d_model, nhead=4, dim_feedforward=4 * d_model, batch_first=True,
                                           dropout=0.0)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(d_model, d_model)

    def forward(self, x):
        return self.head(self.encoder(x))


def encoder():
    return Encoder(), 16, (64, 128)


def batches(batch: int, shape, count: int, seed: int = 0) -> list:
    gen = torch.Generator().manual_seed(seed)
    shape = (shape,) if isinstance(shape, int) else tuple(shape)
    return [(torch.randn(batch, *shape, generator=gen), torch.randn(batch, *shape, generator=gen))
            for _ in range(count)]


def sgd(model, lr: float = 1e-3) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=lr)


class HandLoop:
    """The hand-written PyTorch loop the Trainer is compared with.

    It zeroes gradients right after the optimizer step, as the Trainer does: both then
    free gradient memory between steps, so neither pays for the other's allocations.
    The systems a benchmark compares share one model and optimizer (``opt``): the same
    tensors at the same addresses, so that memory layout favours neither.
    """

    def __init__(self, model, data, opt: torch.optim.Optimizer | None = None):
        self.model, self.data = model, data
        self.opt = opt or sgd(model)

    def __call__(self):
        model, opt = self.model, self.opt
        for x, y in self.data:
            loss = F.mse_loss(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)


class TrainerLoop:
    """Runs ``len(data)`` more steps of one long-lived Trainer per call; returns the seconds from
    ``on_fit_start`` to the end of ``fit()``: the steps, not the set-up before them, which a run pays
    once and this benchmark at every call (``setup`` keeps the last call's, timed apart)."""

    def __init__(self, model, data, opt: torch.optim.Optimizer | None = None, cls: type[Trainer] = Trainer,
                 device: str = "cpu", **kwargs):
        self.trainer = cls(model=model, train_data=data, optimizer=opt or sgd(model),
                           max_steps=len(data), device=device, progress=False, loggers=(), **kwargs)
        self.steps = len(data)
        self.trainer.max_steps = 0
        self.trainer.on_fit_start = self.started  # a hook set on the instance
        self.start = self.setup = 0.0

    def started(self) -> None:
        self.start = time.perf_counter()

    def __call__(self) -> float:
        self.trainer.max_steps += self.steps
        called = time.perf_counter()
        self.trainer.fit()
        self.setup = self.start - called
        return time.perf_counter() - self.start
