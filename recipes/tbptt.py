"""Truncated back-propagation through time: an RNN over a long sequence, in chunks.

    python recipes/tbptt.py                              # same as: python -m safeloop experiment=tbptt
    python recipes/tbptt.py recipe.detach_hidden=false   # the classic mistake, caught at step 2

Config: ``configs/experiment/tbptt.yaml``. A long synthetic signal (two sines and noise,
generated in-process) is cut into ``streams`` parallel streams and read ``chunk`` time
steps per training step; a GRU predicts the next value. The hidden state is carried from
one chunk to the next so the model sees the whole history, and is *detached* when it is
stored, so each step back-propagates through its own chunk only.

Without the ``.detach()`` (``recipe.detach_hidden=false``), step 2's loss reaches step 1's
graph through ``self.hidden``: raw PyTorch fails with "Trying to backward through the graph
a second time", and with ``retain_graph=True`` the graph would grow every step. The guard
sees the node from the earlier step before any backward and raises ``CarriedGraphError``
naming ``self.hidden`` and the fix.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from safeloop import Trainer
from safeloop.data import Data, data_seed, positive


class Chunks:
    """``(x, y)`` chunks of ``streams`` parallel streams, in time order; ``y`` is ``x`` one step ahead.

    It knows how many chunks of the current pass it gave (``batch``), and checkpoints save that
    (``state_dict``), so a resumed run goes on from the next chunk.
    """

    def __init__(self, signal: torch.Tensor, streams: int, chunk: int):
        length = (len(signal) - 1) // streams
        self.x = signal[:length * streams].view(streams, length, 1)
        self.y = signal[1:length * streams + 1].view(streams, length, 1)
        self.chunk = chunk
        self.batch = 0

    def __len__(self) -> int:
        return self.x.shape[1] // self.chunk

    def __iter__(self):
        while self.batch < len(self):
            t = slice(self.batch * self.chunk, (self.batch + 1) * self.chunk)
            self.batch += 1
            yield self.x[:, t], self.y[:, t]
        self.batch = 0

    def state_dict(self) -> dict:
        return {"batch": self.batch}

    def load_state_dict(self, state: dict) -> None:
        self.batch = state["batch"]


def signal(length: int = 200_000, streams: int = 16, chunk: int = 50, noise: float = 0.05,
           seed: int | None = 0) -> Data:
    """A long 1-D signal: two incommensurate sines plus noise, read as chunks of parallel streams."""
    positive(length=length, streams=streams, chunk=chunk)
    seed = data_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    t = torch.arange(length, dtype=torch.float32)
    s = torch.sin(0.05 * t) + 0.5 * torch.sin(0.05 * math.sqrt(2) * 7 * t + 1.0)
    return Data(Chunks(s + noise * torch.randn(length, generator=gen), streams, chunk))


class SequenceModel(nn.Module):
    """A GRU and a linear read-out: the next value of the signal at every time step."""

    def __init__(self, hidden: int = 64, layers: int = 1):
        super().__init__()
        positive(hidden=hidden, layers=layers)
        self.rnn = nn.GRU(1, hidden, num_layers=layers, batch_first=True)
        self.out = nn.Linear(hidden, 1)

    def forward(self, x, hidden=None):
        y, hidden = self.rnn(x, hidden)
        return self.out(y), hidden


class TBPTTTrainer(Trainer):
    """Carries the RNN's hidden state across steps (``self.hidden``), detached by default."""

    def __init__(self, *args, detach_hidden: bool = True, **kwargs):
        super().__init__(*args, **kwargs)
        self.detach_hidden = detach_hidden
        self.hidden: torch.Tensor | None = None
        self.first: tuple[int, float] | None = None  # (step, loss) of the run's first step

    def training_step(self, batch):
        x, y = batch
        if self.state.batch_in_epoch == 1:  # a new pass over the sequence: no history yet
            self.hidden = None
        pred, hidden = self.model(x, self.hidden)
        # .detach(): the next step starts from this state's value, not from this step's graph.
        self.hidden = hidden.detach() if self.detach_hidden else hidden
        return F.mse_loss(pred, y)

    def on_save_checkpoint(self, checkpoint) -> None:
        checkpoint["tbptt"] = {"hidden": self.hidden, "first": self.first}  # a resumed run carries on from here

    def on_load_checkpoint(self, checkpoint) -> None:
        hidden = checkpoint["tbptt"]["hidden"]
        self.hidden = hidden.to(self.device) if hidden is not None else None
        self.first = checkpoint["tbptt"].get("first")

    def on_step_end(self, losses) -> None:
        if self.first is None:
            self.first = (self.state.step, float(losses["loss"]))

    def on_fit_end(self) -> None:
        last = float(self.state.losses["loss"])
        step, first = self.first
        print(f"next-value MSE: {first:.4g} at step {step} -> {last:.4g} at step {self.state.step} "
              f"(hidden state carried from chunk to chunk, detached each step)")


if __name__ == "__main__":
    from safeloop.recipes import main

    main("tbptt")
