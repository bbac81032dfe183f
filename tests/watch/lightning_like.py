"""A stand-in for Lightning's ``Trainer`` (Lightning is not installed here) that drives a ``LightningModule`` as
Lightning 2.x does, in the parts that matter to the guard:

- automatic optimization (``loops/optimization/automatic.py``): a closure runs ``training_step``, then zero_grad,
  then backward, and is passed to ``optimizer.step`` through ``optimizer_step``, so training_step's forward runs
  inside the optimizer's step; with gradient accumulation, the closure is called directly until the last
  micro-batch, and each loss is divided by the number of micro-batches;
- backward (``plugins/precision/precision.py``): ``on_before_backward(loss)``, ``module.backward(loss)``
  (``loss.backward()``), ``on_after_backward()``; ``optimizer_step`` wraps the closure so that
  ``on_before_optimizer_step`` runs after it;
- ``strategy="ddp"``: the launcher (``strategies/launchers/subprocess_script.py``) starts ranks 1.. as child
  processes running the same script (``LOCAL_RANK=1 python /abs/script.py args``); then, before training, DDP's
  constructor broadcasts rank 0's parameters and buffers, written in place under no_grad on every rank. With no
  process group here, each rank writes its own values, which rank 0's equal when every rank seeds alike.
"""
from __future__ import annotations

import os
import subprocess
import sys
from functools import partial

import torch
from torch import nn


class LightningModule(nn.Module):
    automatic_optimization = True
    trainer: Trainer | None = None

    def training_step(self, batch, batch_idx):
        raise NotImplementedError

    def configure_optimizers(self):
        raise NotImplementedError

    def on_train_start(self) -> None:
        pass

    def on_before_backward(self, loss: torch.Tensor) -> None:
        pass

    def on_after_backward(self) -> None:
        pass

    def on_before_optimizer_step(self, optimizer) -> None:
        pass

    def backward(self, loss: torch.Tensor, *args, **kwargs) -> None:
        loss.backward(*args, **kwargs)

    def optimizer_step(self, epoch: int, batch_idx: int, optimizer, optimizer_closure=None) -> None:
        optimizer.step(closure=optimizer_closure)

    def optimizer_zero_grad(self, epoch: int, batch_idx: int, optimizer) -> None:
        optimizer.zero_grad()


class Trainer:
    def __init__(self, max_epochs: int = 1, accumulate_grad_batches: int = 1, strategy: str = "auto",
                 devices: int = 1):
        self.max_epochs, self.accumulate_grad_batches = max_epochs, accumulate_grad_batches
        self.strategy, self.devices = strategy, devices
        self.local_rank = int(os.environ.get("LOCAL_RANK", 0))
        self.procs: list[subprocess.Popen] = []
        self.optimizers: list[torch.optim.Optimizer] = []
        self.current_epoch = 0

    def fit(self, model: LightningModule, train_dataloaders) -> None:
        if self.strategy == "ddp":
            if self.local_rank == 0:
                self._call_children_scripts()
            with torch.no_grad():  # DDP(model): rank 0's parameters and buffers broadcast to every rank
                for tensor in [*model.parameters(), *model.buffers()]:
                    tensor.copy_(tensor.clone())
        model.trainer = self
        self.optimizers = [model.configure_optimizers()]
        model.on_train_start()
        for self.current_epoch in range(self.max_epochs):
            for batch_idx, batch in enumerate(train_dataloaders):
                self._run_optimization(model, self.optimizers[0], batch, batch_idx)
        for proc in self.procs:
            proc.wait()

    def _call_children_scripts(self) -> None:
        """Lightning's ``_SubprocessScriptLauncher``: the script again, as a child process per extra device."""
        command = [sys.executable, os.path.abspath(sys.argv[0]), *sys.argv[1:]]
        for local_rank in range(1, self.devices):
            self.procs.append(subprocess.Popen(command, env={**os.environ, "LOCAL_RANK": str(local_rank)}))

    def _run_optimization(self, model: LightningModule, optimizer, batch, batch_idx: int) -> None:
        closure = partial(self._closure, model, optimizer, batch, batch_idx)
        if (batch_idx + 1) % self.accumulate_grad_batches != 0:
            closure()  # accumulating: training_step and backward, no step
        else:
            model.optimizer_step(self.current_epoch, batch_idx, optimizer, partial(self._wrap_closure, model,
                                                                                     optimizer, closure))

    def _wrap_closure(self, model: LightningModule, optimizer, closure):
        result = closure()
        model.on_before_optimizer_step(optimizer)
        return result

    @torch.enable_grad()
    def _closure(self, model: LightningModule, optimizer, batch, batch_idx: int):
        loss = model.training_step(batch, batch_idx)
        loss = loss / self.accumulate_grad_batches
        if batch_idx % self.accumulate_grad_batches == 0:
            model.optimizer_zero_grad(self.current_epoch, batch_idx, optimizer)
        model.on_before_backward(loss)
        model.backward(loss)
        model.on_after_backward()
        return loss.detach()
