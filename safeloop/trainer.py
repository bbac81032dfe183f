"""The Trainer: owns forward, backward, optimizer step and zero_grad."""
from __future__ import annotations

import logging
import warnings
from contextlib import suppress
from functools import partial
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import torch
from lightning_utilities.core.apply_func import apply_to_collection

from . import checkpoint as ckpt
from . import curves, distributed, schedules
from .step import Runner, Undo
from .callbacks import HOOKS, Callback
from .devices import autocast, placed, resolve_device, resolve_precision
from .errors import ConfigError, ConfigWarning, SafeloopError, StepError
from .guard import GraphGuard, Guard
from .guard.explain import Scope
from .guard.guard import Recorder
from .loggers import make_loggers
from .progress import Progress, show_logs
from .settings import DEFAULTS, CheckpointSettings, GuardSettings, Settings, mistyped, names, read
from .state import TrainState

log = logging.getLogger("safeloop")
STOP_CHECK_EVERY = 8  # under torchrun: steps between the ranks' agreements on a stop signal
UNUSED_AFTER = 20  # steps after which an optimizer no gradient reached, or an unused loss weight, is reported


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
    optimizer)``, then ``on_step_end(losses)``; ``on_epoch_start()`` before a pass over ``train_data``
    asks for its first batch (not again when a resumed run or a later ``fit()`` goes on within it),
    ``on_epoch_end()`` when it ends (found when the next step asks for a batch; before epoch schedulers
    step);
    ``on_validation_end(metrics)`` after each validation; ``on_fit_end()``. Checkpoints:
    ``on_load_checkpoint(checkpoint)`` when resuming (before ``on_fit_start``),
    ``on_save_checkpoint(checkpoint)`` at each save; put what you need saved into ``checkpoint``
    under a key of your own, as tensors and plain containers.

    Args:
        model: the ``nn.Module`` to train (moved to ``device``).
        train_data: any iterable of batches (a DataLoader); re-iterated every epoch.
        optimizer: an ``Optimizer``, or a callable taking parameters (a Hydra ``_partial_``).
        val_data: iterable of validation batches; validated before training, every
            ``val_every`` steps and at the end.
        loss_fn: used by the default ``training_step`` (default: mean squared error).
        scheduler: callable taking an optimizer (a ``_partial_`` LR scheduler), stepped after every
            update; or ``{"scheduler": callable, "interval": "epoch", "monitor": "val_loss"}`` (see
            ``safeloop.schedules``). ``configure_optimizers`` may also return Lightning's
            ``{"optimizer": opt, "lr_scheduler": {...}}``.
        max_steps, max_epochs, val_every, grad_accum, grad_clip, precision, device, log_every,
            multi_loss, loss_weights, loggers, progress, resume, on_nonfinite, max_skipped,
            find_unused_parameters, undo: the settings, the same as the ``trainer`` config group's
            keys; each is documented with its default in ``safeloop.settings.Settings``.
        guard: a ``Guard`` (or a ``GraphGuard``: the one it drives), or its settings as a dict
            (``{"check": "always"}``; see ``safeloop.settings.GuardSettings``).
        callbacks: ``Callback`` objects.
        run_dir: where loggers, checkpoints (unless ``checkpoint`` names a ``dir``) and graph
            pictures are written.
        checkpoint: checkpoint settings as a dict (``{"every": N, "keep": 3, "dir": path}``; see
            ``safeloop.settings.CheckpointSettings``), or ``False``: no checkpoints (neither are
            there without a ``dir`` and a ``run_dir``).
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
        scheduler: Callable | Mapping[str, Any] | None = None,
        max_steps: int | None = DEFAULTS.max_steps,
        max_epochs: int | None = DEFAULTS.max_epochs,
        val_every: int | None = DEFAULTS.val_every,
        grad_accum: int = DEFAULTS.grad_accum,
        grad_clip: float | None = DEFAULTS.grad_clip,
        precision: str | int = DEFAULTS.precision,
        device: str | torch.device = DEFAULTS.device,
        log_every: int = DEFAULTS.log_every,
        multi_loss: str = DEFAULTS.multi_loss,
        loss_weights: Mapping[str, float] | None = DEFAULTS.loss_weights,
        guard: Guard | GraphGuard | Mapping[str, Any] | None = None,
        callbacks: Iterable[Callback] = (),
        loggers: Iterable[str] = DEFAULTS.loggers,
        run_dir: str | Path | None = None,
        progress: bool = DEFAULTS.progress,
        checkpoint: Mapping[str, Any] | bool | None = None,
        resume: str | Path | None = DEFAULTS.resume,
        on_nonfinite: str = DEFAULTS.on_nonfinite,
        max_skipped: int = DEFAULTS.max_skipped,
        find_unused_parameters: bool = DEFAULTS.find_unused_parameters,
        undo: str = DEFAULTS.undo,
        config: Mapping[str, Any] | None = None,
    ):
        args = locals()  # the settings among them are checked by safeloop.settings, where they are defined
        problems = []
        if model is not None and not isinstance(model, torch.nn.Module):
            problems.append(f"model must be a torch.nn.Module, got {type(model).__name__}")
        if train_data is None:
            problems.append("train_data is required: pass an iterable of batches (e.g. a DataLoader)")
        problems += [_samples(name, data) for name, data in (("train_data", train_data), ("val_data", val_data))
                     if _samples(name, data)]
        problems += Settings(**{name: args[name] for name in names(Settings)}).problems()
        if not self.automatic:
            if val_data is not None and type(self).validation_step is Trainer.validation_step:
                problems.append("val_data is given, and in manual mode (automatic = False) the default "
                                "validation_step cannot re-run training_step (it calls self.backward and "
                                "self.step): override validation_step(batch) to return the validation loss(es), "
                                "or drop val_data")
            if loss_weights:
                problems.append(f"loss_weights={dict(loss_weights)!r} weights the losses an automatic "
                                "training_step returns; in manual mode (automatic = False) scale each loss "
                                "before self.backward(...) instead")
        problems += mistyped(Trainer, {k: v for k, v in args.items() if k not in (*names(Settings), "self", "model")
                                       and not (k == "train_data" and v is None)})
        saves = checkpoint is not False
        checkpoints, found = read(CheckpointSettings, checkpoint if isinstance(checkpoint, Mapping) else {},
                                  "checkpoint")
        problems += found
        where = checkpoints.dir or (Path(run_dir) / "checkpoints" if isinstance(run_dir, (str, Path)) else None)
        if resume is not None and (where is None or not saves) and str(resume) == "auto":
            problems.append("resume=auto looks in the checkpoint directory, and there is none: pass run_dir=... "
                            "or checkpoint={'dir': ...}")
        if isinstance(guard, GraphGuard):  # the guard of a plain loop, now driven by this Trainer
            guard = guard.guard
        if isinstance(guard, Mapping):
            guard, found = read(GuardSettings, guard, "guard")
            problems += found
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
            guard = Guard(**vars(guard or GuardSettings()), out_dir=self.run_dir / "graphs" if self.run_dir else None)
        self.guard = guard
        self.callbacks = list(callbacks)
        self._logger_names = list(loggers)
        self._progress_enabled = progress
        self.checkpointer = ckpt.Checkpointer(where, checkpoints.every, checkpoints.keep) \
            if saves and where is not None else None
        self.resume = resume
        self.on_nonfinite, self.max_skipped = on_nonfinite, max_skipped
        self.find_unused_parameters = find_unused_parameters
        self.undo = undo
        self.config = dict(config) if config is not None else None
        self.stop_signal: int | None = None  # set by SIGTERM/SIGINT: save after this step and stop
        self._epoch_rng: dict | None = None  # RNG states the current epoch's order was drawn from
        self.state = TrainState()
        self.optimizers: dict[str, torch.optim.Optimizer] = {}
        self.schedulers: dict[str, Any] = {}
        self.schedules: dict[str, schedules.Schedule] = {}  # the schedulers and when each steps
        self.scaler = None
        # (losses whose backward retained the graph, whether the guard walked the step) -> first step seen
        self.retain_plans: dict[tuple[tuple[str, ...], bool], int] = {}
        self._diagnosing = False  # re-running training_step to explain a missing graph
        self._said: str | None = None  # the last fit's line on where it writes
        self._unused: tuple[set, set] | None = None  # the runner's unreached optimizers and unused loss weights
        self._shared = False  # under torchrun: weights, run directory and data set up for the ranks
        self._sharded = None  # under torchrun: the train_data this rank's share was made as (see _shard_again)
        self._runner: Runner | None = None  # the last setup's: it runs the steps
        # where the last fit() stopped: (its batches, train_data, grad_accum, step); the next goes on from there
        self._left: tuple | None = None

    # -- what users override ---------------------------------------------------------------
    def training_step(self, batch) -> torch.Tensor | Mapping[str, torch.Tensor]:
        """The loss of one batch (or a dict of named losses). Default: ``loss_fn(model(x), y)``."""
        x, y = batch
        return self.loss_fn(self.model(x), y)

    def validation_step(self, batch) -> torch.Tensor | Mapping[str, torch.Tensor]:
        """The validation loss(es) of one batch; runs under ``torch.no_grad()`` in eval mode.
        Default: ``training_step``'s (automatic mode; manual mode needs its own)."""
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
        """``{optimizer name: scheduler}``, or ``{name: {"scheduler": s, "interval": "step" | "epoch",
        "monitor": "val_loss"}}`` (see ``safeloop.schedules``). Default: the configured ``scheduler`` (a
        callable taking an optimizer, or such a dict whose "scheduler" is one) for each optimizer."""
        given = self._scheduler
        if given is None:
            return {}
        if isinstance(given, Mapping):
            return {name: {**given, "scheduler": given["scheduler"](opt)} for name, opt in optimizers.items()}
        return {name: given(opt) for name, opt in optimizers.items()}

    def on_fit_start(self) -> None: ...
    def on_step_start(self) -> None: ...
    def on_before_backward(self, name: str, loss: torch.Tensor) -> None: ...
    def on_after_backward(self, name: str) -> None: ...
    def on_before_optimizer_step(self, name: str, optimizer: torch.optim.Optimizer) -> None: ...
    def on_step_end(self, losses: Mapping[str, torch.Tensor]) -> None: ...
    def on_epoch_start(self) -> None: ...
    def on_epoch_end(self) -> None: ...
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
        zero = self.dist is None or self.dist.is_zero
        self.progress = Progress(self.max_steps, self._progress_enabled and zero)
        if zero:
            show_logs()
            outputs = self._outputs()
            if outputs != self._said:  # once, not at every fit() of a run trained in several calls
                log.info(outputs)
                self._said = outputs
        failed = False
        try:
            if self.checkpointer is not None:
                self.checkpointer.open()  # before anything is trained: the directory is this run's and writable
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
                history = self.state.val_history
                if self.stop_signal is None and self.val_data is not None and (
                        not history or history[-1][0] != self.state.step):
                    # before the final checkpoint, so that it holds the last metrics; with the random state
                    # put back (a DataLoader draws a seed), as a run that goes on would not have validated here
                    rng = ckpt.rng_state()
                    self.validate()
                    ckpt.set_rng_state(rng)
                if self.checkpointer is not None and self.checkpointer.last != self.checkpointer.path(self.state.step):
                    self.checkpointer.save(self)
                if self.stop_signal is not None:
                    return self.state  # stopped early: no final validation, no on_fit_end
                self._call("on_fit_end")
                self._draw_curves()
        except BaseException:
            failed = True
            raise
        finally:
            if self.checkpointer is not None:
                self.checkpointer.close()
            self.progress.close()
            for logger in self.loggers:
                logger.close()
            if self.dist is not None:
                self.dist.close(failed)
        return self.state

    def _draw_curves(self) -> None:
        """``curves.png`` in the run directory, when there are metrics and matplotlib draws them."""
        if self.run_dir is None or not (self.run_dir / "metrics.csv").exists() or not self.loggers:
            return
        if not curves.HAVE_MATPLOTLIB:
            log.info("no loss curves: pip install matplotlib to have them drawn to %s", self.run_dir / "curves.png")
            return
        try:  # metrics.csv is flushed at every write
            path = curves.draw(self.run_dir)
        except Exception as err:  # noqa: BLE001 - a picture never fails a finished run
            log.warning("loss curves not drawn: %s: %s", type(err).__name__, err)
            return
        if path is not None:
            log.info("loss curves: %s", path)

    def _outputs(self) -> str:
        """Where this fit writes, or that it writes nothing."""
        ckpt_dir = self.checkpointer.dir if self.checkpointer is not None else None
        if self.run_dir is None and ckpt_dir is None:
            return ("no run_dir: no metrics file, no checkpoints and no graph pictures are written (pass "
                    "run_dir=... to keep them)")
        parts = [f"metrics to {self.run_dir}" if self.loggers else None,
                 f"checkpoints to {ckpt_dir}" if ckpt_dir is not None else "no checkpoints (checkpoint=False)"]
        return "writing " + "; ".join(p for p in parts if p)

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
        epoch started with and, if ``train_data`` has ``state_dict()``, its state), the gradients the
        last step left on the parameters (manual mode accumulating over several steps; none after an
        automatic step; under torchrun, their mean over the ranks and, in ``rank_gradients``, each
        rank's), the run config, and whatever ``on_save_checkpoint`` hooks add. Tensors and plain
        containers only, so that it loads with ``torch.load(weights_only=True)``. Needs ``setup()``
        first (``fit()`` calls it). Under torchrun in manual mode it gathers the ranks' gradients:
        every rank calls it (the Trainer's own saves do).
        """
        self._need_setup("state_dict")
        data = self.train_data
        checkpoint = {
            "format": ckpt.FORMAT,
            "step": self.state.step,
            "modules": {name: module.state_dict() for name, module in self.modules().items()},
            "optimizers": {name: opt.state_dict() for name, opt in self.optimizers.items()},
            "optimizer_classes": ckpt.optimizer_classes(self.optimizers),
            "schedulers": {name: sched.state_dict() for name, sched in self.schedulers.items()},
            "scaler": self.scaler.state_dict() if self.scaler is not None else None,
            "state": self.state.state_dict(),
            "rng": ckpt.rng_state(),
            "data": {"epoch_start": self._epoch_rng, "iterable": data.state_dict() if ckpt.stateful(data) else None},
            "gradients": {name: p.grad.detach() for name, p in self._named_parameters() if p.grad is not None},
            "config": self.config,
        }
        if self.dist is not None and not self.automatic:  # gradients carried between steps are each rank's own
            every = self.dist.gather({name: grad.cpu() for name, grad in checkpoint["gradients"].items()})
            checkpoint["gradients"], checkpoint["rank_gradients"] = ckpt.mean_gradients(every), every
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
        self._left = None  # the data goes on from the checkpoint's position, not from the last fit's
        ckpt.check_payload(checkpoint, path)
        ckpt.check_fits(self.modules(), self._named_parameters(), self.optimizers, self.schedulers, self.scaler,
                        checkpoint, path)
        # the data iterable's own load_state_dict first: if it refuses the state, nothing else has changed
        ckpt.load_data(self.train_data, checkpoint["data"]["iterable"])
        ckpt.load_modules(self.modules(), checkpoint)
        ckpt.load_gradients(self._named_parameters(), ckpt.gradients_for(checkpoint, self.dist))
        ckpt.load_optimizers(self.optimizers, checkpoint, path)
        ckpt.load_named("scheduler", self.schedulers, checkpoint["schedulers"], path)
        ckpt.load_scaler(self.scaler, checkpoint["scaler"])
        self.state.load_state_dict(checkpoint["state"])
        if self.state.step:  # what torch's "lr_scheduler.step() before optimizer.step()" warning looks at
            for opt in self.optimizers.values():
                opt._opt_called = True
        self._epoch_rng = checkpoint["data"]["epoch_start"]
        self._loaded_rng = checkpoint["rng"]
        self._call("on_load_checkpoint", checkpoint)

    def _need_setup(self, method: str) -> None:
        if not self.optimizers:
            raise SafeloopError(f"Trainer.{method}() needs the optimizers: call trainer.setup() first (fit() does)")

    def setup(self) -> None:
        """Place the model, build optimizers, schedulers, hooks and loggers (idempotent)."""
        if self.model is not None and not placed(self.model, self.device):
            self.model.to(self.device)
        if not self.optimizers:
            self.optimizers, given = schedules.split(self.configure_optimizers())
            self._check_optimizers()
            self.schedules = schedules.read({**self.configure_schedulers(self.optimizers), **given},
                                            self.optimizers, self.val_data is not None)
            self.schedulers = {name: s.scheduler for name, s in self.schedules.items()}
            if self.precision == "16":
                self.scaler = torch.amp.GradScaler("cuda")
            self._undo = Undo(self.undo, self.optimizers, self.schedulers)
        self._hooks = {name: self._bind(name) for name in HOOKS}
        forward = self.training_step
        if self.dist is not None:  # rank zero's weights and run directory, sharded data, DDP or gradient hooks
            if not self._shared:
                self.run_dir, self.train_data = self.dist.share(self.model, self.run_dir, self.train_data)
                if self.run_dir is not None:
                    self.guard.out_dir = self.run_dir / "graphs" / (f"rank{self.dist.rank}" if self.dist.rank else "")
                self._shared, self._sharded = True, self.train_data
            self._shard_again()
            self.dist.attach(self, per_backward_hooks=bool(self._hooks["on_before_backward"]
                                                           or self._hooks["on_after_backward"]))
            self.guard.agree = self.dist.agree
            if self.dist.ddp is not None:
                forward = self.dist.forward  # training_step runs inside DDP's forward
        # listed once per fit, for the guard (on checked steps): a parameter added later by add_param_group can
        # still hold the gradients of steps that did not train it, which no zero_grad cleared
        trained = self._parameters()
        scope = Scope(roots={"self": self, "self.model": self.model}, functions=(type(self).training_step,),
                      parameters=lambda: trained, rerun=self.rerun_recorded)
        runner = self._runner = Runner(self, forward, self._hooks, scope, self._autocast,
                                       self.to_device if self._move_batches else None, self._undo,
                                       self._named_parameters, previous=self._runner)
        if self._unused is not None:  # a later fit(): what an earlier one found reached, or warned about, stays so
            runner.unreached &= self._unused[0]
            runner.unweighted &= self._unused[1]
        self._unused = runner.unreached, runner.unweighted
        zero = self.dist is None or self.dist.is_zero
        self.loggers = make_loggers(self._logger_names, self.run_dir) if zero else []

    def _check_optimizers(self) -> None:
        """An optimizer set that holds none of the model's trainable parameters never changes the model
        (a warning, not an error: optimizing an input through a fixed model is a real use)."""
        if self.model is None:
            return
        trained = {id(p) for p in self.model.parameters() if p.requires_grad}
        held = {id(p) for opt in self.optimizers.values() for g in opt.param_groups for p in g["params"]}
        if trained and not trained & held:
            names = ", ".join(repr(n) for n in self.optimizers)
            warnings.warn(
                f"no optimizer holds any of the model's {len(trained)} trainable parameters, so training will not "
                f"change the model: optimizer {names} holds {len(held)} other tensor(s) (built over another "
                "model's parameters, or before the model was replaced?). Build it from self.model.parameters() "
                "in configure_optimizers, or pass optimizer=lambda params: torch.optim.AdamW(params, ...), "
                "which the Trainer calls with them; if the model is meant to stay fixed, "
                "model.requires_grad_(False) says so", ConfigWarning, stacklevel=3)

    def _warn_unused(self) -> None:
        """Once, after ``UNUSED_AFTER`` steps (or at the end): optimizers that no gradient reached and
        ``loss_weights`` keys that named no loss so far."""
        runner, step = self._runner, self.state.step
        for name in sorted(runner.unreached):
            if any(p.grad is not None for g in self.optimizers[name].param_groups for p in g["params"]):
                continue  # reached: its gradients wait for a later self.step() (manual mode accumulating over steps)
            warnings.warn(f"optimizer {name!r} has not updated anything in the {step} steps so far: no loss's "
                          "gradient reached its parameters (is a loss returned, or self.backward(loss, "
                          f"optimizer={name!r}) called, for it? are its parameters the ones the forward uses, "
                          "with requires_grad?)", ConfigWarning, stacklevel=2)
        if runner.unweighted:
            warnings.warn(f"loss_weights names {sorted(runner.unweighted)}, but no loss of the {step} steps so "
                          f"far had that name (the losses: {sorted(self.state.losses)}): the weight is not "
                          "applied; fix the key", ConfigWarning, stacklevel=2)
        runner.unreached.clear()
        runner.unweighted.clear()

    def _parameters(self) -> list[torch.Tensor]:
        """The trained parameters: the optimizers', whose gradients every step clears. A model parameter
        outside them may take gradients step after step, as it would in the hand-written loop."""
        return list({id(p): p for opt in self.optimizers.values() for g in opt.param_groups
                     for p in g["params"]}.values())

    def _named_parameters(self) -> list[tuple[str, torch.nn.Parameter]]:
        return [(f"{m}.{n}", p) for m, module in self.modules().items() for n, p in module.named_parameters()]

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
        """Each step's batches (``grad_accum`` of them in a row; fewer at the end of a pass), forever or for
        ``max_epochs``, keeping ``state.epoch`` and ``batch_in_epoch``."""
        accumulate, pending = self.grad_accum, []
        while self.max_epochs is None or self.state.epoch < self.max_epochs:
            start = self.state.batch_in_epoch  # > 0: resuming mid-epoch
            if not start:  # before the pass draws anything: its RNG states are taken after the hook
                self._call("on_epoch_start")
                self._shard_again()
            sampler = getattr(self.train_data, "sampler", None)
            if hasattr(sampler, "set_epoch"):
                sampler.set_epoch(self.state.epoch)
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
                if accumulate == 1:
                    yield [batch]
                    continue
                pending.append(batch)
                if len(pending) == accumulate:
                    yield pending
                    pending = []
            if pending:  # the pass's last step takes the batches left, as Lightning's does: no update spans two
                yield pending
                pending = []
            if empty and start == 0 and self.state.epoch > 0 and iter(self.train_data) is self.train_data:
                raise ConfigError(
                    f"train_data is a {type(self.train_data).__name__}, an iterator that one pass uses up: epoch "
                    f"{self.state.epoch + 1} got no batches. Pass something that can be iterated again (a "
                    "DataLoader, a list, or an object whose __iter__ returns a new generator each time), or "
                    "set max_steps to at most the batches of one pass")
            if empty and start == 0:
                raise ConfigError("train_data yielded no batches: check the dataset and batch size")
            # the pass is over (found when the next step asks for its batch): state.epoch is still its number
            self._call("on_epoch_end")
            self.state.epoch += 1
            self.state.batch_in_epoch = 0
            for schedule in self.schedules.values():
                if schedule.interval == "epoch" and schedule.monitor is None:
                    schedule.scheduler.step()

    def _shard_again(self) -> None:
        """Under torchrun, ``train_data`` replaced since this rank's share was made (between fits, or by
        ``on_epoch_start``): this rank's share of the new data."""
        if self.dist is not None and self.train_data is not self._sharded:
            self.train_data = self._sharded = self.dist.shard(self.train_data)

    def _loop(self) -> None:
        if self.max_steps is not None and self.state.step >= self.max_steps:  # resumed from the end
            return
        self._plan_events()
        left, self._left = self._left, None
        if left is not None and left[1] is self.train_data and left[2:] == (self.grad_accum, self.state.step):
            batches = left[0]  # the last fit's iterator, where it stopped: nothing is read again
        else:
            batches = self._batches()
        steps = self._runner.steps
        stopped = (lambda: self.stop_signal is not None) if self.dist is None else self._agreed_stop
        while steps(batches, self._next_event, stopped):  # to the next step after which something happens
            stop = self.stop_signal is not None
            self._after_step(stop)
            if stop or (self.max_steps is not None and self.state.step >= self.max_steps):
                self._left = batches, self.train_data, self.grad_accum, self.state.step
                return

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
        if self._runner.unreached or self._runner.unweighted:
            if step >= UNUSED_AFTER or step == self.max_steps:
                self._warn_unused()
        if step % self.log_every == 0 or step == self.max_steps:
            metrics = self.state.floats()
            if self.state.skipped:
                metrics["skipped"] = self.state.skipped
            self.progress.update(step, metrics)
            self.log_metrics({**metrics, **schedules.learning_rates(self.optimizers)})
        if self.val_data is not None and self.val_every and step % self.val_every == 0:
            metrics = self.validate()
            for name, schedule in self.schedules.items():
                if schedule.monitor is not None:
                    schedule.scheduler.step(self._monitored(metrics, name, schedule.monitor))
        every = self.checkpointer.every if self.checkpointer is not None else None
        if stop or (every and step % every == 0):
            self.save_checkpoint()

    def _monitored(self, metrics: Mapping[str, float], name: str, monitor: str) -> float:
        if monitor not in metrics:
            raise ConfigError(f"the scheduler of optimizer {name!r} monitors {monitor!r}, which validation does "
                              f"not report: it reports {', '.join(metrics) or 'nothing'}")
        return metrics[monitor]

    def log_metrics(self, metrics: Mapping[str, float]) -> None:
        for logger in self.loggers:
            logger.log(dict(metrics), self.state.step)

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
        if not self._diagnosing:
            self._runner.manual_backward(loss, optimizer, retain_graph)

    def step(self, optimizer: str | None = None, closure: Callable[[], torch.Tensor] | None = None) -> None:
        """Manual mode: update ``optimizer`` (default: the only one) as an automatic step does:
        gradient sync, non-finite policy, unscale, clip, ``on_before_optimizer_step``, undo snapshot,
        ``step``, ``zero_grad``, scheduler.

        ``closure``, for optimizers whose ``step`` takes one (L-BFGS; SAM's two-phase update): a
        function that computes the loss, calls ``self.backward(loss, ...)`` and returns the loss.
        Before each call the Trainer clears this optimizer's gradients; after it, the gradients go
        through sync, the non-finite policy, clipping and the hook, as before any update.

        Which updates a later failure in the step can undo is ``trainer.undo``'s choice (``auto``:
        every optimizer but the one that stepped last in earlier steps; ``full``: all).
        """
        if not self._diagnosing:
            self._runner.manual_step(optimizer, closure)

    # -- helpers -----------------------------------------------------------------------------
    def to_device(self, batch):
        """Move every tensor in ``batch`` (any nesting of lists, tuples, dicts) to the device."""
        if self.device.type == "cpu":
            return batch  # DataLoader batches are already on the CPU: skip the walk
        return apply_to_collection(batch, torch.Tensor, lambda t: t.to(self.device, non_blocking=True))

    @torch.no_grad()
    def validate(self) -> dict[str, float]:
        """Run ``validation_step`` over ``val_data`` in eval mode; returns and logs mean losses."""
        # each module's own mode comes back afterwards: a frozen part left in eval (BatchNorm
        # statistics) stays frozen
        modes = [(m, m.training) for m in self.model.modules()] if self.model is not None else []
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
        except Exception as err:
            if isinstance(err, SafeloopError):
                raise
            raise StepError(f"validation at step {self.state.step} failed on batch {count + 1} of val_data (training "
                            f"is unchanged): {type(err).__name__}: {err}", self.state.step) from err
        finally:
            for module, training in modes:
                module.training = training
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


def _samples(name: str, data) -> str | None:
    """A map-style Dataset is a sequence of single samples: iterated, it would give unbatched steps."""
    if not isinstance(data, torch.utils.data.Dataset) or isinstance(data, torch.utils.data.IterableDataset):
        return None
    return (f"{name} is a {type(data).__name__}, a Dataset of single samples: each step would train on one "
            f"unbatched sample. Pass DataLoader(dataset, batch_size=..., shuffle=True) (from torch.utils.data); "
            "if each item already is a whole batch, DataLoader(dataset, batch_size=None)")
