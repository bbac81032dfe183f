"""The Trainer: owns forward, backward, optimizer step and zero_grad."""
from __future__ import annotations

import logging
from contextlib import suppress
from functools import partial
import time
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import torch
from lightning_utilities.core.apply_func import apply_to_collection

from . import checkpoint as ckpt
from . import distributed, nonfinite
from . import step as steps
from .callbacks import HOOKS, Callback
from .devices import autocast, resolve_device, resolve_precision
from .errors import ConfigError, GraphLifecycleError, NonFiniteError, SafeloopError, StepError
from .guard import CHECKS, REUSE_POLICIES, Guard
from .guard.guard import Recorder
from .guard.walk import HAS_SEQ, sequence_now
from .loggers import make_loggers
from .progress import Progress
from .snapshot import Snapshot
from .state import TrainState

log = logging.getLogger("safeloop")
STOP_CHECK_EVERY = 8  # under torchrun: steps between the ranks' agreements on a stop signal


class Trainer:
    """Trains ``model`` on ``train_data``; you write the math, it runs the step.

    Plain use::

        trainer = Trainer(model=net, train_data=loader, optimizer=torch.optim.Adam(net.parameters()),
                          max_steps=1000)
        trainer.fit()

    The default ``training_step`` unpacks ``(x, y)`` and returns ``loss_fn(model(x), y)``.
    Subclass to write your own::

        class MyTrainer(Trainer):
            def training_step(self, batch):
                x, y = batch
                return F.cross_entropy(self.model(x), y)        # or {"name": loss, ...}

    Every step: batch to device -> ``training_step`` (under autocast) -> guard pre-flight
    (the loss's autograd graph is checked before any ``.grad`` changes) -> backward(s)
    -> clip -> optimizer step(s) -> ``zero_grad(set_to_none=True)`` -> scheduler step.
    Between steps every gradient is None.
    If anything raises, the step is abandoned: its gradients are dropped, parameters and
    optimizer state are as they were before it, and the error names the step.

    Several losses (a dict) are back-propagated in order with ``retain_graph`` set only
    where a later loss shares the graph (``multi_loss="sum"`` back-propagates their sum).
    If ``configure_optimizers`` returns ``{name: optimizer}``, each loss key names the
    optimizer whose parameters receive its gradient.

    Hooks, in firing order (override them here or in ``callbacks``):
    ``on_fit_start()``; per step ``on_step_start()``, per loss ``on_before_backward(name,
    loss)``, ``on_after_backward(name)``, per optimizer ``on_before_optimizer_step(name,
    optimizer)``, then ``on_step_end(losses)``; ``on_validation_end(metrics)`` after each
    validation; ``on_fit_end()``. Checkpoints: ``on_load_checkpoint(checkpoint)`` when resuming
    (before ``on_fit_start``), ``on_save_checkpoint(checkpoint)`` at each save; put what you
    need saved into ``checkpoint`` under a key of your own, as tensors and plain containers.

    Args:
        model: the ``nn.Module`` to train (moved to ``device``).
        train_data: any iterable of batches (a DataLoader); re-iterated every epoch.
        optimizer: an ``Optimizer``, or a callable taking parameters (a Hydra ``_partial_``).
        val_data: iterable of validation batches; validated before training, every
            ``val_every`` steps and at the end.
        loss_fn: used by the default ``training_step`` (default: mean squared error).
        scheduler: callable taking an optimizer (a ``_partial_`` LR scheduler), stepped every step.
        max_steps / max_epochs: when to stop (at least one is required).
        grad_accum: micro-batches per optimizer step; the update equals one big batch's.
        grad_clip: max gradient norm (None: no clipping).
        precision: ``"32"``, ``"bf16"`` (autocast, CPU or CUDA) or ``"16"`` (CUDA, GradScaler).
        device: ``auto`` (CUDA when present), ``cpu``, ``cuda`` or ``cuda:N``.
        log_every: steps between logged (and synced) loss values.
        multi_loss / loss_weights: ``sequential`` or ``sum``; optional weight per loss name.
        guard: a ``Guard`` or its keyword arguments (``check``, ``on_reuse``, ``trace``).
        callbacks: ``Callback`` objects; loggers: names (``csv``, ``tensorboard``), written under ``run_dir``.
        progress: show a progress bar (a terminal) or log lines (otherwise).
        checkpoint: ``{"every": N, "keep": 3, "dir": path}``; saves every ``every`` steps (None: only
            at the end and on SIGTERM/SIGINT, which finish the step, save and stop) into ``dir``
            (default ``run_dir/checkpoints``; no ``dir`` and no ``run_dir``, or ``False``: no checkpoints).
        resume: ``None``, ``"auto"`` (the newest readable checkpoint in the checkpoint directory, if
            any: the same command starts and restarts a run), or a checkpoint file or directory.
        on_nonfinite: ``off`` (default), ``error`` or ``skip``: a NaN/Inf loss or gradient stops the
            run, or skips the update (at most ``max_skipped`` steps in a row), found by one fused test
            and one host sync per step.
        find_unused_parameters: under torchrun, when the usual run goes through
            ``DistributedDataParallel``: set it if a step may leave some of the model's
            parameters without gradient (costs one more small all-reduce per step). Without
            it such a step stops with an error naming the parameter, before the optimizer step.
        config: the resolved run config (plain containers), stored in checkpoints.
    """

    automatic: bool = True  # False: training_step calls self.backward / self.step itself

    def __init__(
        self,
        model: torch.nn.Module | None = None,
        train_data: Iterable | None = None,
        optimizer: torch.optim.Optimizer | Callable | None = None,
        *,
        val_data: Iterable | None = None,
        loss_fn: Callable | None = None,
        scheduler: Callable | None = None,
        max_steps: int | None = None,
        max_epochs: int | None = None,
        val_every: int | None = None,
        grad_accum: int = 1,
        grad_clip: float | None = None,
        precision: str | int = "32",
        device: str | torch.device = "auto",
        log_every: int = 50,
        multi_loss: str = "sequential",
        loss_weights: Mapping[str, float] | None = None,
        guard: Guard | Mapping[str, Any] | None = None,
        callbacks: Iterable[Callback] = (),
        loggers: Iterable[str] = ("csv",),
        run_dir: str | Path | None = None,
        progress: bool = True,
        checkpoint: Mapping[str, Any] | bool | None = None,
        resume: str | Path | None = None,
        on_nonfinite: str = "off",
        max_skipped: int = 10,
        find_unused_parameters: bool = False,
        config: Mapping[str, Any] | None = None,
    ):
        problems = []
        if model is not None and not isinstance(model, torch.nn.Module):
            problems.append(f"model must be a torch.nn.Module, got {type(model).__name__}")
        if train_data is None:
            problems.append("train_data is required: pass an iterable of batches (e.g. a DataLoader)")
        if max_steps is None and max_epochs is None:
            problems.append("set max_steps or max_epochs (trainer.max_steps=N)")
        for key, value in (("max_steps", max_steps), ("max_epochs", max_epochs), ("val_every", val_every),
                           ("grad_accum", grad_accum), ("log_every", log_every)):
            if value is not None and (not isinstance(value, int) or value <= 0):
                problems.append(f"{key} must be a positive integer, got {value!r}")
        if grad_clip is not None and grad_clip <= 0:
            problems.append(f"grad_clip must be positive or null, got {grad_clip!r}")
        if multi_loss not in steps.MULTI_LOSS:
            problems.append(f"multi_loss={multi_loss!r} is not one of {', '.join(steps.MULTI_LOSS)}")
        if on_nonfinite not in nonfinite.POLICIES:
            problems.append(f"on_nonfinite={on_nonfinite!r} is not one of {', '.join(nonfinite.POLICIES)}")
        if not isinstance(max_skipped, int) or max_skipped <= 0:
            problems.append(f"max_skipped must be a positive integer, got {max_skipped!r}")
        checkpoint = {} if checkpoint is None or checkpoint is True else checkpoint
        if checkpoint is not False:
            checkpoint = dict(checkpoint)
            unknown = sorted(set(checkpoint) - {"every", "keep", "dir"})
            if unknown:
                problems.append(f"checkpoint has no setting {unknown[0]!r}: use every, keep, dir")
            for key in ("every", "keep"):
                value = checkpoint.get(key, 1)
                if value is not None and (not isinstance(value, int) or value <= 0):
                    problems.append(f"checkpoint.{key} must be a positive integer, got {value!r}")
        where = (checkpoint or {}).get("dir") or (Path(run_dir) / "checkpoints" if run_dir is not None else None)
        if resume is not None and (where is None or checkpoint is False) and str(resume) == "auto":
            problems.append("resume=auto looks in the checkpoint directory, and there is none: pass run_dir=... "
                            "or checkpoint={'dir': ...}")
        if resume is not None and str(resume) != "auto" and not Path(resume).exists():
            problems.append(f"resume={str(resume)!r}: no such file or directory (give a checkpoint file, a "
                            "checkpoint directory, or auto)")
        if isinstance(guard, Mapping):
            if guard.get("check", "auto") not in CHECKS:
                problems.append(f"guard.check={guard['check']!r} is not one of {', '.join(CHECKS)}")
            if guard.get("on_reuse", "error") not in REUSE_POLICIES:
                problems.append(f"guard.on_reuse={guard['on_reuse']!r} is not one of {', '.join(REUSE_POLICIES)}")
        try:
            self.device = resolve_device(device)
            self.precision = resolve_precision(precision, self.device)
        except ConfigError as err:
            problems.extend(err.problems)
        if problems:
            raise ConfigError(problems)
        # Under torchrun: join the process group; this rank trains on cuda:LOCAL_RANK or the CPU.
        self.dist = distributed.from_env(self.device)
        if self.dist is not None:
            self.device = self.dist.device

        self._autocast = None if self.precision == "32" else partial(autocast, self.precision, self.device)
        self._move_batches = self.device.type != "cpu"  # DataLoader batches are already on the CPU
        self.model = model
        self.train_data, self.val_data = train_data, val_data
        self.loss_fn = loss_fn or torch.nn.functional.mse_loss
        self._optimizer, self._scheduler = optimizer, scheduler
        self.max_steps, self.max_epochs, self.val_every = max_steps, max_epochs, val_every
        self.grad_accum, self.grad_clip, self.log_every = grad_accum, grad_clip, log_every
        self.multi_loss, self.loss_weights = multi_loss, dict(loss_weights or {})
        self.run_dir = Path(run_dir) if run_dir is not None else None
        if not isinstance(guard, Guard):
            guard = Guard(**dict(guard or {}), out_dir=self.run_dir / "graphs" if self.run_dir else None)
        self.guard = guard
        self.callbacks = list(callbacks)
        self._logger_names = loggers
        self._progress_enabled = progress
        self.checkpointer = ckpt.Checkpointer(where, checkpoint.get("every", 1000), checkpoint.get("keep", 3)) \
            if checkpoint is not False and where is not None else None
        self.resume = resume
        self.on_nonfinite, self.max_skipped = on_nonfinite, max_skipped
        self.find_unused_parameters = find_unused_parameters
        self.config = dict(config) if config is not None else None
        self.stop_signal: int | None = None  # set by SIGTERM/SIGINT: save after this step and stop
        self._epoch_rng: dict | None = None  # RNG states the current epoch's order was drawn from
        self._skipped_in_row = 0
        self._finite_check = nonfinite.FiniteCheck()
        self.state = TrainState()
        self.optimizers: dict[str, torch.optim.Optimizer] = {}
        self.schedulers: dict[str, Any] = {}
        self.scaler = None
        self._stepped: dict[str, int] = {}  # manual mode: optimizer -> node counter at its step
        self._undo: list[str] = []  # optimizers stepped in this step whose update a failure must undo
        self._snapshots: dict[str, Snapshot] = {}
        # (losses whose backward retained the graph, whether the guard walked the step) -> first step seen
        self.retain_plans: dict[tuple[tuple[str, ...], bool], int] = {}
        self._diagnosing = False  # re-running training_step to explain a missing graph

    # -- what users override ---------------------------------------------------------------
    def training_step(self, batch) -> torch.Tensor | Mapping[str, torch.Tensor]:
        """The loss of one batch (or a dict of named losses). Default: ``loss_fn(model(x), y)``."""
        x, y = batch
        return self.loss_fn(self.model(x), y)

    def validation_step(self, batch) -> torch.Tensor | Mapping[str, torch.Tensor]:
        """The validation loss(es) of one batch; runs under ``torch.no_grad()`` in eval mode."""
        return self.training_step(batch)

    def configure_optimizers(self) -> torch.optim.Optimizer | Mapping[str, torch.optim.Optimizer]:
        """Default: the configured optimizer over ``self.model.parameters()``."""
        opt = self._optimizer
        if opt is None:
            raise ConfigError("no optimizer: pass optimizer=... (an Optimizer or a callable taking parameters) "
                              "or override configure_optimizers()")
        if isinstance(opt, torch.optim.Optimizer):
            return opt
        return opt(self.model.parameters())

    def configure_schedulers(self, optimizers: Mapping[str, torch.optim.Optimizer]) -> Mapping[str, Any]:
        """Default: the configured scheduler (a callable taking an optimizer) for each optimizer."""
        if self._scheduler is None:
            return {}
        return {name: self._scheduler(opt) for name, opt in optimizers.items()}

    def on_fit_start(self) -> None: ...
    def on_step_start(self) -> None: ...
    def on_before_backward(self, name: str, loss: torch.Tensor) -> None: ...
    def on_after_backward(self, name: str) -> None: ...
    def on_before_optimizer_step(self, name: str, optimizer: torch.optim.Optimizer) -> None: ...
    def on_step_end(self, losses: Mapping[str, torch.Tensor]) -> None: ...
    def on_validation_end(self, metrics: Mapping[str, float]) -> None: ...
    def on_fit_end(self) -> None: ...
    def on_save_checkpoint(self, checkpoint: dict) -> None: ...
    def on_load_checkpoint(self, checkpoint: Mapping) -> None: ...

    # -- the run -----------------------------------------------------------------------------
    def fit(self) -> TrainState:
        """Train until ``max_steps`` or ``max_epochs``; returns the final ``TrainState``."""
        try:
            self.setup()
        except BaseException:
            if self.dist is not None:
                self.dist.close(failed=True)
            raise
        self.progress = Progress(self.max_steps, self._progress_enabled and (self.dist is None or self.dist.is_zero))
        failed = False
        try:
            if self.resume is not None:
                self._resume()
            with self.guard.context(), ckpt.stop_signals(self):
                self._call("on_fit_start")
                if self.val_data is not None and self.state.step == 0:
                    self.validate()
                self.guard.start_fit()
                if self._loaded_rng is not None:  # set last, so that nothing before the first step draws from it
                    ckpt.set_rng_state(self._loaded_rng)
                    self._loaded_rng = None
                self._loop()
                if self.checkpointer is not None and self.checkpointer.last != self.checkpointer.path(self.state.step):
                    self.checkpointer.save(self)
                if self.stop_signal is not None:
                    return self.state  # stopped early: no final validation, no on_fit_end
                history = self.state.val_history
                if self.val_data is not None and (not history or history[-1][0] != self.state.step):
                    self.validate()
                self._call("on_fit_end")
        except BaseException:
            failed = True
            raise
        finally:
            self.progress.close()
            for logger in self.loggers:
                logger.close()
            if self.dist is not None:
                self.dist.close(failed)
        return self.state

    def _resume(self) -> None:
        """Load the checkpoint ``resume`` names."""
        finder = self.checkpointer or ckpt.Checkpointer(Path(self.resume))
        found = finder.find(self.resume)
        if found is None:
            return
        path, data = found
        self.load_state_dict(data, path)
        if self.checkpointer is not None:
            self.checkpointer.last = path
        state = self.state
        log.info("resumed from %s: step %d, epoch %d, %d batches into it", path, state.step, state.epoch,
                 state.batch_in_epoch)
        if self.max_steps is not None and state.step >= self.max_steps:
            log.info("the checkpoint is at step %d and max_steps=%d: nothing to train", state.step, self.max_steps)

    def save_checkpoint(self) -> Path | None:
        """Save a checkpoint now (the Trainer does at every ``checkpoint.every`` steps and at the end)."""
        return self.checkpointer.save(self) if self.checkpointer is not None else None

    # -- what a checkpoint holds ---------------------------------------------------------------
    _loaded_rng: dict | None = None  # a loaded checkpoint's RNG states, set just before fit()'s next step

    def modules(self) -> dict[str, torch.nn.Module]:
        """The user's modules by name: what checkpoints save. Default ``{"model": self.model}`` (none
        without a model); override it to add a module kept outside ``model``, such as an EMA copy."""
        return {"model": self.model} if self.model is not None else {}

    def state_dict(self) -> dict:
        """What a checkpoint holds: ``modules()``' state dicts, optimizers, schedulers, the grad scaler,
        ``state`` (``TrainState``), the global RNG states, where the data stands (the RNG states its
        epoch started with and, if ``train_data`` has ``state_dict()``, its state), the run config,
        and whatever ``on_save_checkpoint`` hooks add. Tensors and plain containers only, so that
        it loads with ``torch.load(weights_only=True)``. Needs ``setup()`` first (``fit()`` calls it).
        """
        self._need_setup("state_dict")
        data = self.train_data
        checkpoint = {
            "format": ckpt.FORMAT,
            "step": self.state.step,
            "modules": {name: module.state_dict() for name, module in self.modules().items()},
            "optimizers": {name: opt.state_dict() for name, opt in self.optimizers.items()},
            "schedulers": {name: sched.state_dict() for name, sched in self.schedulers.items()},
            "scaler": self.scaler.state_dict() if self.scaler is not None else None,
            "state": self.state.state_dict(),
            "rng": ckpt.rng_state(),
            "data": {"epoch_start": self._epoch_rng, "iterable": data.state_dict() if ckpt.stateful(data) else None},
            "config": self.config,
        }
        ours = set(checkpoint)
        self._call("on_save_checkpoint", checkpoint)
        for key in checkpoint.keys() - ours:
            ckpt.check_plain(checkpoint[key], f"checkpoint[{key!r}]")
        return checkpoint

    def load_state_dict(self, checkpoint: Mapping, path: str | Path | None = None) -> None:
        """Load what ``state_dict()`` saved (``path``: the file it came from, named in errors), then call
        ``on_load_checkpoint``. The global RNG states are set when ``fit()`` starts its next step, so
        that nothing before it draws from them. Needs ``setup()`` first (``fit()`` calls it)."""
        self._need_setup("load_state_dict")
        ckpt.load_modules(self.modules(), checkpoint, path)
        ckpt.load_named("optimizer", self.optimizers, checkpoint["optimizers"], path)
        ckpt.load_named("scheduler", self.schedulers, checkpoint["schedulers"], path)
        ckpt.load_scaler(self.scaler, checkpoint["scaler"], path)
        self.state.load_state_dict(checkpoint["state"])
        self._epoch_rng = checkpoint["data"]["epoch_start"]
        ckpt.load_data(self.train_data, checkpoint["data"]["iterable"])
        self._loaded_rng = checkpoint["rng"]
        self._call("on_load_checkpoint", checkpoint)

    def _need_setup(self, method: str) -> None:
        if not self.optimizers:
            raise SafeloopError(f"Trainer.{method}() needs the optimizers: call trainer.setup() first (fit() does)")

    def setup(self) -> None:
        """Place the model, build optimizers, schedulers, hooks and loggers (idempotent)."""
        if self.model is not None:
            self.model.to(self.device)
        if not self.optimizers:
            opts = self.configure_optimizers()
            self.optimizers = dict(opts) if isinstance(opts, Mapping) else {"optimizer": opts}
            for name, opt in self.optimizers.items():
                if not isinstance(opt, torch.optim.Optimizer):
                    raise ConfigError(f"configure_optimizers returned {type(opt).__name__} for {name!r}, "
                                      "not a torch.optim.Optimizer")
            self.schedulers = dict(self.configure_schedulers(self.optimizers))
            self._all_optimizers = list(self.optimizers)
            if self.precision == "16":
                self.scaler = torch.amp.GradScaler("cuda")
        self._hooks = {name: self._bind(name) for name in HOOKS}
        self._forward = self.training_step
        if self.dist is not None:  # rank zero's weights and run directory, sharded data, DDP or gradient hooks
            self.dist.attach(self)
            self.guard.agree = self.dist.agree
            if self.dist.ddp is not None:
                self._forward = self.dist.ddp  # training_step runs inside DDP's forward
        # The usual step (one optimizer, no scaler, clipping, DDP, accumulation or backward hooks)
        # skips the general bookkeeping: on a tiny model each check is a visible share of the step.
        self._plain = (len(self.optimizers) == 1 and self.scaler is None and self.dist is None and self.automatic
                       and self.grad_clip is None and self.grad_accum == 1 and not self.loss_weights
                       and not any(self._hooks[h] for h in ("on_before_backward", "on_after_backward",
                                                               "on_before_optimizer_step")))
        zero = self.dist is None or self.dist.is_zero
        self.loggers = make_loggers(self._logger_names, self.run_dir) if zero else []

    def _bind(self, name: str) -> list[Callable]:
        """Only overridden hooks are called, so that unused hooks cost nothing per step."""
        fns = [getattr(self, name)] if getattr(type(self), name) is not getattr(Trainer, name) else []
        for cb in self.callbacks:
            if getattr(type(cb), name, None) is not getattr(Callback, name):
                fns.append(lambda *a, _f=getattr(cb, name): _f(self, *a))
        return fns

    def _call(self, name: str, *args) -> None:
        fns = self._hooks[name]
        if fns:
            for fn in fns:
                fn(*args)

    def _batches(self):
        """Batches forever (or for ``max_epochs``), keeping ``state.epoch`` and ``batch_in_epoch``."""
        while self.max_epochs is None or self.state.epoch < self.max_epochs:
            sampler = getattr(self.train_data, "sampler", None)
            if hasattr(sampler, "set_epoch"):
                sampler.set_epoch(self.state.epoch)
            start = self.state.batch_in_epoch  # > 0: resuming mid-epoch
            if start and ckpt.stateful(self.train_data):  # it goes on from its own (loaded) position
                batches = self.train_data
            elif start:  # the order the epoch had before the interruption, past the batches consumed
                batches = ckpt.fast_forward(self.train_data, self._epoch_rng, start)
            else:
                self._epoch_rng = ckpt.epoch_start(self.train_data)
                batches = self.train_data
            empty = True
            for i, batch in enumerate(batches, start):
                empty = False
                self.state.batch_in_epoch = i + 1
                yield batch
            if empty and start == 0:
                raise ConfigError("train_data yielded no batches: check the dataset and batch size")
            self.state.epoch += 1
            self.state.batch_in_epoch = 0

    def _loop(self) -> None:
        if self.max_steps is not None and self.state.step >= self.max_steps:  # resumed from the end
            return
        self._plan_events()
        guard, state = self.guard, self.state
        plain_step = self._plain_step()
        pending: list = []
        for batch in self._batches():
            if plain_step is not None and state.step + 1 < guard.next_timed:  # neither checked nor timed
                plain_step(batch)
            elif plain_step is not None and state.step + 1 < guard.next_due:  # timed: the bare step time
                started = time.perf_counter()
                plain_step(batch)
                guard.record_step_time(state.step, time.perf_counter() - started)
            else:
                pending.append(batch)
                if len(pending) < self.grad_accum:
                    continue
                started = time.perf_counter()
                self._train_step(pending)
                pending = []
                if guard.timed:
                    guard.end_step(state.step, self)
                    guard.record_step_time(state.step, time.perf_counter() - started)
            stop = self.stop_signal is not None if self.dist is None else self._agreed_stop()
            if state.step >= self._next_event or stop:
                self._after_step(stop)
                if stop or (self.max_steps is not None and state.step >= self.max_steps):
                    return

    def _plain_step(self) -> Callable | None:
        """The plain run's step (see ``setup``), for steps the guard neither checks nor times:
        ``_train_step``'s cycle with everything looked up once, since on a tiny model every
        lookup shows. None when the run is not plain."""
        hooks = self._hooks
        if not self._plain or self.on_nonfinite != "off" or hooks["on_step_start"] or hooks["on_step_end"]:
            return None
        guard, state, training_step, to_device = self.guard, self.state, self.training_step, self.to_device
        move, autocast, optimizers = self._move_batches, self._autocast, self.optimizers
        name = self._all_optimizers[0]
        opt, scheduler = optimizers[name], self.schedulers.get(name)

        def plain_step(batch) -> None:
            step = state.step + 1
            guard.unchecked()
            try:
                if move:
                    batch = to_device(batch)
                if autocast is None:
                    loss = training_step(batch)
                else:
                    with autocast():
                        loss = training_step(batch)
                if type(loss) is torch.Tensor and loss.requires_grad and loss.numel() == 1:
                    try:
                        loss.backward()
                    except RuntimeError as err:
                        raise self._explained(err, "loss", loss, step, batch)
                    losses = {"loss": loss.data}  # detached: the value without the graph, cheaper than detach()
                else:  # several losses, or one without a graph (the guard says why)
                    losses = steps.named_losses(loss, step, optimizers)
                    self._backward(losses, step, batch, first=True)
                    losses = {k: v.data for k, v in losses.items()}
                opt.step()
                opt.zero_grad(set_to_none=True)
                if scheduler is not None:
                    scheduler.step()
            except BaseException as err:
                raise self._abandoned(err, step)
            state.losses = losses
            state.step = step

        return plain_step

    def _agreed_stop(self) -> bool:
        """Under torchrun a rank stops only together with the others. Signals reach ranks at
        different moments, so every ``STOP_CHECK_EVERY`` steps the ranks share the signal any of them
        got (one small all-reduce) and all stop after that same step: none is left waiting in an
        all-reduce for a rank that already left."""
        if self.state.step % STOP_CHECK_EVERY:
            return False
        signum = self.dist.agree(self.stop_signal or 0)
        if signum and self.stop_signal is None:
            self.stop_signal = signum
        return bool(signum)

    def _plan_events(self) -> None:
        """The next step at which something happens after the step: log, validate, save, stop."""
        step = self.state.step
        every = [self.log_every, self.val_every if self.val_data is not None else None,
                 self.checkpointer.every if self.checkpointer is not None else None]
        due = [(step // e + 1) * e for e in every if e]
        if self.max_steps is not None:
            due.append(self.max_steps)
        self._next_event = min(due) if due else float("inf")

    def _after_step(self, stop: bool = False) -> None:
        self._plan_events()
        step = self.state.step
        if step % self.log_every == 0 or step == self.max_steps:
            metrics = self.state.floats()
            if self.state.skipped:
                metrics["skipped"] = self.state.skipped
            self.progress.update(step, metrics)
            self.log_metrics(metrics)
        if self.val_data is not None and self.val_every and step % self.val_every == 0:
            self.validate()
        every = self.checkpointer.every if self.checkpointer is not None else None
        if stop or (every and step % every == 0):
            self.save_checkpoint()

    def log_metrics(self, metrics: Mapping[str, float]) -> None:
        for logger in self.loggers:
            logger.log(dict(metrics), self.state.step)

    # -- one step ----------------------------------------------------------------------------
    def _train_step(self, batches: list) -> None:
        step = self.state.step + 1
        self.guard.begin_step(step)
        for fn in self._hooks["on_step_start"]:  # hooks inlined on the hot path: one call fewer each
            fn()
        if self._stepped or self._undo:
            self._stepped.clear()
            self._undo.clear()
        try:
            total: dict[str, torch.Tensor] = {}
            for i, batch in enumerate(batches):
                if self._move_batches:
                    batch = self.to_device(batch)
                if self._autocast is None:
                    output = self._forward(batch)
                else:
                    with self._autocast():
                        output = self._forward(batch)
                if not self.automatic:
                    losses = steps.named_losses(output, step, ()) if output is not None else {}
                else:
                    if type(output) is torch.Tensor and output.numel() == 1:  # checked inline: the usual case
                        losses = {"loss": output}
                    else:
                        losses = steps.named_losses(output, step, self.optimizers)
                    self._backward(losses, step, batch, first=i == 0, last=i == len(batches) - 1)
                for name, loss in losses.items():
                    value = loss.data  # detached
                    total[name] = total[name] + value if name in total else value
                del output, losses, batch
            if self.dist is not None and self.automatic:  # every rank checks the same averaged gradients
                self.dist.sync_all(step)
            if self.automatic and (self.on_nonfinite == "off" or self._finite(total, step)):
                self._optimizer_steps(total)
            elif self.scaler is not None and self._stepped:
                self.scaler.update()
        except BaseException as err:
            raise self._abandoned(err, step)
        n = len(batches)
        self.state.losses = {k: v / n for k, v in total.items()} if n > 1 else total
        self.state.step = step
        for fn in self._hooks["on_step_end"]:
            fn(self.state.losses)

    def _backward(self, losses: dict[str, torch.Tensor], step: int, batch, first: bool, last: bool = True) -> None:
        retain = self.guard.preflight(losses, step, self, batch)
        if first and self.guard.thorough:
            started = time.perf_counter()
            self._check_no_grads(step, next(iter(losses)))
            self.guard.spent += time.perf_counter() - started  # part of the check's cost
        if self._plain and len(losses) == 1:
            (name, loss), = losses.items()
            self._run_backward(loss, name, loss, step, batch, bool(retain and retain[0]), None)
            return
        scale = 1.0 / self.grad_accum
        mode = "sum" if self.dist is not None and self.dist.losses_summed else self.multi_loss
        plan = steps.plan(losses, self.optimizers, retain, mode, self.loss_weights)
        if len(plan) > 1:
            self._note_retain(plan, retain is not None, step)
        for k, todo in enumerate(plan):
            for fn in self._hooks["on_before_backward"]:
                fn(todo.name, todo.loss)
            loss = todo.loss * scale if self.grad_accum > 1 else todo.loss
            if self.scaler is not None:
                loss = self.scaler.scale(loss)
            # DDP: the last backward into an optimizer's parameters all-reduces them while it runs
            armed = self.dist.arm(plan, k, self.optimizers) if last and self.dist is not None else None
            self._run_backward(loss, todo.name, todo.loss, step, batch, todo.retain, todo.inputs)
            if armed is not None:
                self.dist.flush(armed)
            for fn in self._hooks["on_after_backward"]:
                fn(todo.name)

    def _note_retain(self, plan: list[steps.Backward], walked: bool, step: int) -> None:
        """Log, once per pattern, which backwards kept the graph alive for a later loss."""
        key = (tuple(todo.name for todo in plan if todo.retain), walked)
        if key in self.retain_plans:
            return
        self.retain_plans[key] = step
        kept = ", ".join(key[0]) or "none"
        if walked:
            freed = ", ".join(todo.name for todo in plan[:-1] if not todo.retain) or "none"
            log.info("step %d: backward retained the graph for %s (a later loss shares nodes with it); "
                     "freed it for %s (no later loss shares it) and for the last loss, %s",
                     step, kept, freed, plan[-1].name)
        else:
            log.info("step %d (not walked by the guard): backward retained the graph for every loss but the "
                     "last: %s", step, kept)

    def _run_backward(self, loss, name, original, step, batch, retain, inputs) -> None:
        try:
            loss.backward(retain_graph=retain, inputs=inputs)
        except RuntimeError as err:
            raise self._explained(err, name, original, step, batch)

    def _explained(self, err: RuntimeError, name: str, loss, step: int, batch) -> Exception:
        """What to raise for backward's ``err``: the guard's explanation, or ``err`` if it has none."""
        explained = self.guard.explain(err, name, loss, step, self, batch, list(self._stepped))
        if explained is None:
            return err
        explained.__cause__ = err
        return explained

    def _check_no_grads(self, step: int, name: str) -> None:
        """Gradients present before the first backward mean training_step ran backward itself."""
        from .errors import DoubleBackwardError

        for opt in self.optimizers.values():
            for group in opt.param_groups:
                if any(p.grad is not None for p in group["params"]):
                    raise DoubleBackwardError(
                        "gradients were already present when training_step returned: training_step (or a hook) "
                        "called backward itself, so the Trainer's backward would add them a second time",
                        step=step, loss_name=name,
                        fixes=["return the loss from training_step and let the Trainer call backward",
                               "set automatic = False on your Trainer and call self.backward(loss) / "
                               "self.step() inside training_step"])

    def _finite(self, losses: Mapping[str, torch.Tensor], step: int) -> bool:
        """One fused NaN/Inf test over the losses and gradients (one host sync). False: skip the update."""
        # under precision 16 the GradScaler skips steps whose gradients overflow: only the losses are ours
        grads = nonfinite.gradients(self.optimizers.values()) if self.scaler is None else []
        if self._finite_check(losses.values(), grads):
            self._skipped_in_row = 0
            return True
        named = [(f"{m}.{n}", p) for m, module in self.modules().items() for n, p in module.named_parameters()]
        what = nonfinite.describe(losses, named)
        if self.on_nonfinite == "error":
            raise NonFiniteError(
                f"step {step}: {what}. The step was abandoned before the optimizer step (parameters and optimizer "
                "state are unchanged). To find the cause run with debug=default (anomaly detection names the "
                "backward operation that made the first NaN), lower the learning rate or set trainer.grad_clip; "
                "trainer.on_nonfinite=skip skips such steps instead", step)
        if self._skipped_in_row >= self.max_skipped:
            raise NonFiniteError(
                f"step {step}: {what}, and the {self._skipped_in_row} steps before it were skipped for the same "
                f"reason (trainer.max_skipped={self.max_skipped}): training diverged, this is not a rare bad "
                "batch. Resume from an earlier checkpoint with a lower learning rate or trainer.grad_clip", step)
        self._skipped_in_row += 1
        self.state.skipped += 1
        log.warning("step %d skipped, nothing updated: %s (%d skipped so far, %d in a row; trainer.max_skipped=%d)",
                    step, what, self.state.skipped, self._skipped_in_row, self.max_skipped)
        self._abandon()
        return False

    def _optimizer_steps(self, losses: Mapping[str, torch.Tensor]) -> None:
        if self._plain:
            name = self._all_optimizers[0]
            opt = self.optimizers[name]
            opt.step()
            opt.zero_grad(set_to_none=True)
            if self.schedulers:
                self.schedulers[name].step()
            return
        names = [n for n in self.optimizers if n in losses] if len(self.optimizers) > 1 else self._all_optimizers
        for name in names:
            if name is not names[-1]:  # a later optimizer can still fail: keep this update undoable
                self._keep_undoable(name)
            self._step_optimizer(name)
        if self.scaler is not None:
            self.scaler.update()

    def _step_optimizer(self, name: str) -> None:
        opt = self.optimizers[name]
        if self.dist is not None:  # average gradients over ranks before unscale, clip and step
            self.dist.sync(name, self.state.step + 1)
        if self.scaler is not None:
            self.scaler.unscale_(opt)
        if self.grad_clip is not None:
            params = [p for g in opt.param_groups for p in g["params"]]
            torch.nn.utils.clip_grad_norm_(params, self.grad_clip)
        self._call("on_before_optimizer_step", name, opt)
        if self.scaler is not None:
            self.scaler.step(opt)
        else:
            opt.step()
        opt.zero_grad(set_to_none=True)  # free gradient memory now; the next step starts from None
        if name in self.schedulers:
            self.schedulers[name].step()

    def _keep_undoable(self, name: str) -> None:
        """Snapshot optimizer ``name`` before its first update in this step (``_abandon`` restores it)."""
        if name in self._undo:
            return
        snapshot = self._snapshots.get(name)
        if snapshot is None:
            snapshot = self._snapshots[name] = Snapshot(self.optimizers[name], self.schedulers.get(name))
        snapshot.take()
        self._undo.append(name)

    def _abandoned(self, err: BaseException, step: int) -> BaseException:
        """Abandon the failed ``step``; returns the error to raise: ours as it is, any other
        exception as a StepError naming the step."""
        self._abandon()
        if isinstance(err, SafeloopError) or not isinstance(err, Exception):
            return err
        wrapped = StepError(f"step {step} failed and was abandoned (parameters and optimizer state are "
                            f"unchanged): {type(err).__name__}: {err}", step)
        wrapped.__cause__ = err
        return wrapped

    def _abandon(self) -> None:
        """Drop the failed step's gradients and undo the optimizer updates it already made."""
        for name in reversed(self._undo):
            self._snapshots[name].restore()
        self._undo.clear()
        if self.dist is not None:
            self.dist.reset()
        for opt in self.optimizers.values():
            opt.zero_grad(set_to_none=True)
        if self.model is not None:
            self.model.zero_grad(set_to_none=True)

    # -- manual mode -------------------------------------------------------------------------
    def backward(self, loss: torch.Tensor, optimizer: str | None = None, retain_graph: bool = False) -> None:
        """Manual mode: back-propagate ``loss`` into ``optimizer``'s parameters only, through the guard.

        With several optimizers, ``optimizer`` is required, so that a loss never leaves gradient
        on another optimizer's parameters. If an optimizer stepped earlier in this step and
        ``loss``'s graph saved tensors that step changed, this raises ``InplaceModificationError``
        naming the optimizer: before any gradient is written on the steps the guard checks
        (every step at first, then on its schedule), from backward's own error otherwise; in
        both cases the step is undone.
        """
        if self._diagnosing:
            return
        step = self.state.step + 1
        if optimizer is None and len(self.optimizers) > 1:
            raise StepError(f"step {step}: self.backward(loss) needs optimizer=... when there are several "
                            f"optimizers, so that the loss's gradient reaches only that optimizer's parameters; "
                            f"choose from {sorted(self.optimizers)}", step)
        if optimizer is not None and optimizer not in self.optimizers:
            raise StepError(f"step {step}: self.backward(optimizer={optimizer!r}) names no optimizer; "
                            f"choose from {sorted(self.optimizers)}", step)
        name = optimizer or "loss"
        loss = steps.named_losses(loss, step, ())["loss"]
        self.guard.preflight({name: loss}, step, self, None)
        if self._stepped and HAS_SEQ and self.guard.checking:  # unchecked steps: explained if backward fails
            found = self.guard.inplace_check(loss, self._stepped, self.guard.start_seq)
            if found is not None:
                err, stepped = found
                raise self.guard.explain(err, name, loss, step, self, None, stepped) from err
        inputs = None
        if optimizer is not None and len(self.optimizers) > 1:
            inputs = [p for g in self.optimizers[optimizer].param_groups for p in g["params"] if p.requires_grad]
        self._call("on_before_backward", name, loss)
        scaled = self.scaler.scale(loss) if self.scaler is not None else loss
        self._run_backward(scaled, name, loss, step, None, retain_graph, inputs)
        self._call("on_after_backward", name)

    def step(self, optimizer: str | None = None) -> None:
        """Manual mode: clip, step and zero ``optimizer`` (default: the only one).

        The optimizer's parameters and state are snapshotted before its first step in a step,
        so that if anything later in the step raises, the update is undone.
        """
        if self._diagnosing:
            return
        step = self.state.step + 1
        if optimizer is None and len(self.optimizers) > 1:
            raise StepError(f"step {step}: self.step() needs the optimizer's name when there are several; "
                            f"choose from {sorted(self.optimizers)}", step)
        name = optimizer or next(iter(self.optimizers))
        if name not in self.optimizers:
            raise StepError(f"step {step}: self.step({name!r}) names no optimizer; "
                            f"choose from {sorted(self.optimizers)}", step)
        self._keep_undoable(name)
        self._step_optimizer(name)
        self._stepped[name] = sequence_now()

    # -- helpers -----------------------------------------------------------------------------
    def to_device(self, batch):
        """Move every tensor in ``batch`` (any nesting of lists, tuples, dicts) to the device."""
        if self.device.type == "cpu":
            return batch  # DataLoader batches are already on the CPU: skip the walk
        return apply_to_collection(batch, torch.Tensor, lambda t: t.to(self.device, non_blocking=True))

    @torch.no_grad()
    def validate(self) -> dict[str, float]:
        """Run ``validation_step`` over ``val_data`` in eval mode; returns and logs mean losses."""
        was_training = self.model.training if self.model is not None else False
        if self.model is not None:
            self.model.eval()
        sums: dict[str, float] = {}
        count = 0
        try:
            for batch in self.val_data:
                with autocast(self.precision, self.device):
                    out = self.validation_step(self.to_device(batch))
                out = {"loss": out} if isinstance(out, torch.Tensor) else dict(out)
                for name, value in out.items():
                    sums[name] = sums.get(name, 0.0) + float(value)
                count += 1
        finally:
            if self.model is not None:
                self.model.train(was_training)
        metrics = {f"val_{k}": v / max(count, 1) for k, v in sums.items()}
        self.state.val_history.append((self.state.step, metrics))
        self.log_metrics(metrics)
        log.info("validation at step %d: %s", self.state.step,
                 " ".join(f"{k} {v:.4g}" for k, v in metrics.items()))
        self._call("on_validation_end", metrics)
        return metrics

    def rerun_recorded(self, batch) -> set[str] | None:
        """Re-run ``training_step`` on ``batch`` recording how the graph was lost (error path only).

        RNG state and module buffers are restored afterwards, and manual backward/step are
        skipped, so the re-run changes nothing.
        """
        if batch is None or self._diagnosing:
            return None
        rng = torch.get_rng_state()
        buffers = {k: v.clone() for k, v in self.model.named_buffers()} if self.model is not None else {}
        self._diagnosing = True
        recorder = Recorder()
        try:
            # the re-run only records how the graph was lost; its own failure adds nothing
            with suppress(Exception), recorder, autocast(self.precision, self.device):
                self.training_step(batch)
        finally:
            self._diagnosing = False
            torch.set_rng_state(rng)
            if self.model is not None:
                for k, v in self.model.named_buffers():
                    v.copy_(buffers[k])
        return recorder.seen
