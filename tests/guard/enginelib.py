"""A training library in miniature, in a file of its own, as ignite's ``Engine`` and ``create_supervised_trainer``
and mmengine's ``OptimWrapper`` are: the library runs the loop and calls backward, the user's code gives it functions.
"""
from __future__ import annotations

import torch


class State:
    def __init__(self):
        self.iteration, self.output = 0, None


class Engine:
    """``Engine(update).run(data)``: ``update(engine, batch)`` for every batch, then each ``completed`` handler."""

    def __init__(self, update):
        self.update, self.state, self.completed = update, State(), []

    def run(self, data, epochs: int = 1):
        for _ in range(epochs):
            for batch in data:
                self.state.iteration += 1
                self.state.output = self.update(self, batch)
                for handler in self.completed:
                    handler(self)
        return self.state


def supervised_trainer(model, optimizer, loss_fn, model_fn=lambda model, x: model(x)) -> Engine:
    """ignite's ``create_supervised_trainer``: the library's own update, which calls backward."""
    def update(engine, batch):
        model.train()
        optimizer.zero_grad()
        x, y = batch
        output = model_fn(model, x)
        loss = loss_fn(output, y)
        loss.backward()
        optimizer.step()
        return loss.item()
    return Engine(update)


class OptimWrapper:
    """mmengine's ``OptimWrapper.update_params(loss)``: backward, step and zero_grad in the library's frame."""

    def __init__(self, optimizer: torch.optim.Optimizer):
        self.optimizer = optimizer

    def update_params(self, loss: torch.Tensor) -> None:
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad()


def accumulated_backward(loss: torch.Tensor, steps: int = 2) -> None:
    """accelerate's ``accelerator.backward(loss)`` under gradient accumulation: the library divides the loss."""
    (loss / steps).backward()


def scaled_backward(loss: torch.Tensor, counts: int = 2) -> None:
    """mmengine's ``OptimWrapper.update_params`` and accelerate's ``backward``: the loss scaled under its own name
    (``loss = loss / counts``), then back-propagated, in the library's frame."""
    loss = loss / counts
    loss.backward()


LOGGED: list = []  # what ``log_loss`` keeps: the library's own, no variable of the user's loop


def log_loss(loss: torch.Tensor) -> None:
    """A logging library that keeps the tensors it is handed, in a list of its module (DeepXDE's derivative cache)."""
    LOGGED.append(loss)
