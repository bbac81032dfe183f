"""The Trainer: owns forward, backward, optimizer step and zero_grad."""
from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping
from functools import partial
from pathlib import Path
from typing import Any

import torch
from lightning_utilities.core.overrides import is_overridden

from . import checkpoint as ckpt, curves, distributed, fsdp, runmodes, schedules, slurm
from .callbacks import Callback, Hooks, Logging, TrainerHooks, check_monitor, lightning_attribute
from .devices import autocast, moves, place, resolve, to_device
from .errors import ConfigError, SafeloopError
from .evaluate import TEST, Evaluator
from .guard import GraphGuard, Guard, for_trainer
from .guard.explain import Scope
from .loggers import make_loggers
from .progress import Progress, say_outputs
from .seed import seed_everything
from .settings import attach, model_problem, trainer_arguments
from .state import TrainState
from .epochs import PASS_END, TrainData
from .step import Runner, StepConfig, Undo

log = logging.getLogger("safeloop")


class Trainer(TrainerHooks, Logging):
    """Trains ``model`` on ``train_data``; you write the math, it runs the step.

    Plain use: ``Trainer(model=net, train_data=loader, optimizer=torch.optim.Adam(net.parameters())).fit()``.
    The default ``training_step`` unpacks ``(x, y)`` and returns ``loss_fn(model(x), y)``. Subclass to write your own::

        class MyTrainer(Trainer):
            def training_step(self, batch):
                x, y = batch
                return F.cross_entropy(self.model(x), y)        # or {"name": loss, ...}

    Every step (``safeloop.step``): the last update's ``zero_grad(set_to_none=True)`` -> batch to device ->
    ``training_step`` (under autocast) -> guard pre-flight (before any ``.grad`` changes) -> backward(s) -> clip ->
    optimizer step(s) -> scheduler. A step that raises is abandoned: parameters and optimizer state are as they were,
    and the error names the step. After each step: logging, validation, checkpoint, stop (``_after_step``).
    Several losses (a dict) are back-propagated in order, ``retain_graph`` set only where a later one shares the
    graph; with ``{name: optimizer}``, each loss key names its optimizer. ``automatic = False``: ``training_step``
    calls ``self.backward(loss, optimizer=name)`` and ``self.step(name)``.

    Hooks, in firing order (override them here, on the instance, or in ``callbacks``): ``on_fit_start``; per step
    ``on_step_start``, per loss ``on_before_backward`` and ``on_after_backward``, per optimizer
    ``on_before_optimizer_step``, then ``on_step_end``; ``on_epoch_start`` / ``on_epoch_end`` around each pass over
    ``train_data``; ``on_validation_end``; ``on_fit_end``. ``on_load_checkpoint`` when resuming (before
    ``on_fit_start``), ``on_save_checkpoint`` at each save (put yours in under a key of your own).

    Args:
        model: the ``nn.Module`` to train (moved to ``device``).
        train_data: any iterable of batches (a DataLoader); re-iterated every epoch.
        optimizer: an ``Optimizer``, or a callable taking parameters (a Hydra ``_partial_``).
        val_data: validation batches; validated before training, every ``val_every`` steps and at the end.
        loss_fn: used by the default ``training_step`` (default: mean squared error).
        scheduler: a callable taking an optimizer (a ``_partial_`` LR scheduler), or
            ``{"scheduler": callable, "interval": "epoch", "monitor": "val_loss"}`` (``safeloop.schedules``).
        guard: its settings (``{"check": "always"}``: ``safeloop.settings.GuardSettings``), or a ``GraphGuard``.
        callbacks: ``Callback`` objects.
        run_dir: where metrics, checkpoints (unless ``checkpoint`` names a ``dir``) and graph pictures go.
        checkpoint: ``{"every": N, "keep": 3, "dir": path}`` (``safeloop.settings.CheckpointSettings``), or
            ``False``: no checkpoints (neither are there without a ``dir`` and a ``run_dir``).
        config: the resolved run config (plain containers), stored in checkpoints.
        **settings: ``max_steps``, ``max_epochs``, ``grad_accum``, ``precision``, ``device``...: the fields of
            ``safeloop.settings.Settings`` (the ``trainer`` config group), each documented there with its default.
            Kept in ``self.settings``; each is an attribute too (``trainer.max_steps = 500``).
    """

    automatic: bool = True  # False: training_step calls self.backward / self.step itself

    def __init__(self, model: torch.nn.Module | None = None, train_data: Iterable | None = None,
                 optimizer: torch.optim.Optimizer | Callable | None = None, *, val_data: Iterable | None = None,
                 loss_fn: Callable | None = None, scheduler: Callable | Mapping[str, Any] | None = None,
                 guard: Guard | GraphGuard | Mapping[str, Any] | None = None, callbacks: Iterable[Callback] = (),
                 run_dir: str | Path | None = None, checkpoint: Mapping[str, Any] | bool | None = None,
                 config: Mapping[str, Any] | None = None, **settings: Any):
        given = dict(model=model, train_data=train_data, optimizer=optimizer, val_data=val_data, loss_fn=loss_fn,
                     guard=guard, scheduler=scheduler, callbacks=callbacks, run_dir=run_dir, checkpoint=checkpoint)
        self.settings, problems = trainer_arguments(type(self), Trainer, {**given, "config": config}, settings)
        self.checkpointer, found = ckpt.configured(checkpoint, run_dir, self.settings, val_data is not None)
        problems += found
        graphs = Path(run_dir) / "graphs" if isinstance(run_dir, (str, Path)) else None
        self.guard, found = for_trainer(guard, graphs, manual=not self.automatic)  # its messages speak of our step
        problems += found
        self.device, self.precision, found = resolve(self.settings.device, self.settings.precision)
        if problems + found:
            raise ConfigError(problems + found)
        self.dist = distributed.from_env(self.device)  # under torchrun: this process joins the group
        self.device = self.dist.device if self.dist is not None else self.device  # cuda:LOCAL_RANK or the CPU
        self.state = TrainState()
        self._data = TrainData(train_data, self.state)
        self.model, self.val_data, self.loss_fn = model, val_data, loss_fn or torch.nn.functional.mse_loss
        self._optimizer, self._scheduler = optimizer, scheduler  # as given; configure_* make them
        self.run_dir = Path(run_dir) if run_dir is not None else None
        self.callbacks, self._hooks = list(callbacks), Hooks(self, Trainer)
        self.config = dict(config) if config is not None else None
        self.optimizers: dict[str, torch.optim.Optimizer] = {}
        self.logged, self.logged_since_step = {}, set()  # self.log's values, until the next log point (Logging)
        self.loggers: list = []  # made at each setup (rank zero's)
        self.schedules = schedules.Schedules()  # the schedulers and when each steps
        self.scaler, self._undo = None, None  # precision=16's GradScaler; what undoes a failed step's updates
        self._stop = ckpt.StopRequest()  # set by SIGTERM/SIGINT: save after this step and stop
        self._save_now, self._save_asked = True, False  # save_checkpoint() in a step's hooks: after what follows it
        self._unfinished: int | None = None  # the step whose validation and save are under way (or failed)
        self._loaded_rng: dict | None = None  # a loaded checkpoint's RNG states, set just before the next step
        self._kept: dict[int, int] | None = None  # ckpt.versions at the fit's first step
        self._said, self.fitting = None, False  # the last fit's line on where it writes; True inside fit()
        self.ending = False  # True from the last step's end to the end of fit(): its validation, checkpoint, on_fit_end
        self._runner: Runner | None = None  # the last setup's: it runs the steps

    # -- what users override ---------------------------------------------------------------
    def training_step(self, batch) -> torch.Tensor | Mapping[str, torch.Tensor]:
        """The loss of one batch (or a dict of named losses). Default: ``loss_fn(model(x), y)``."""
        x, y = batch
        return self.loss_fn(self.model(x), y)

    def validation_step(self, batch) -> torch.Tensor | Mapping[str, torch.Tensor] | tuple:
        """The validation loss(es) of one batch, or ``(losses, n)`` when its samples are not its first tensor's
        leading size; under ``torch.no_grad()``, eval mode. Default: ``training_step``'s (manual mode: write one)."""
        return self.training_step(batch)

    def test_step(self, batch) -> torch.Tensor | Mapping[str, torch.Tensor] | tuple:
        """``test()``'s loss(es) of one batch, returned as ``validation_step``'s. Default: ``validation_step``."""
        return self.validation_step(batch)

    def predict_step(self, batch) -> Any:
        """``predict()``'s output for one batch. Default: ``model(x)`` of a batch ``(x, ...)``, or ``model(batch)``."""
        return self.model(batch if isinstance(batch, torch.Tensor) else batch[0])

    def configure_optimizers(self) -> torch.optim.Optimizer | Mapping[str, torch.optim.Optimizer]:
        """Default: the configured ``optimizer`` over ``self.model.parameters()``."""
        return self.make_optimizer(self.model.parameters())

    def make_optimizer(self, params: Iterable) -> torch.optim.Optimizer:
        """The configured ``optimizer`` over ``params`` (a callable, a Hydra ``_partial_``, or an ``Optimizer``)."""
        return schedules.make_optimizer(self._optimizer, params)

    def configure_schedulers(self, optimizers: Mapping[str, torch.optim.Optimizer]) -> Mapping[str, Any]:
        """``{optimizer name: scheduler or {"scheduler": s, "interval": "epoch", "monitor": "val_loss"}}``
        (``safeloop.schedules``). Default: the configured ``scheduler`` (callable or such a dict) for each one."""
        return schedules.for_each(self._scheduler, optimizers)

    def configure_grad_scaler(self) -> torch.amp.GradScaler:  # precision=16's, made once: your arguments here
        return torch.amp.GradScaler(self.device.type)  # (Lightning: MixedPrecision(..., scaler=GradScaler(...)))

    def configure_sharding(self, model: torch.nn.Module) -> None:
        """``strategy=fsdp`` under torchrun: ``fully_shard`` the model in place (default: ``safeloop.fsdp.shard``)."""
        fsdp.shard(model, self.precision, self.device)

    def __getattr__(self, name: str) -> Any:  # an attribute not found: Lightning's names say where safeloop's are
        raise AttributeError(lightning_attribute(type(self).__name__, name), name=name, obj=self)

    # -- manual mode -------------------------------------------------------------------------
    def backward(self, loss: torch.Tensor, optimizer: str | None = None, retain_graph: bool = False,
                 create_graph: bool = False, sync: bool = True) -> None:
        """Manual mode: ``loss.backward(...)`` into ``optimizer``'s parameters only (required with several optimizers),
        through the guard; under torchrun averaged over the ranks as by DDP's (``sync=False``: as ``no_sync()``)."""
        self._runner.backward(loss, optimizer, retain_graph or create_graph, create_graph, sync)

    def step(self, optimizer: str | None = None, closure: Callable[[], torch.Tensor] | None = None) -> None:
        """Manual mode: update ``optimizer`` (default: the only one) as an automatic step does (sync, non-finite
        policy, unscale, ``on_before_optimizer_step``, clip, undo snapshot, ``step``, scheduler; its gradients stay
        until the next backward). ``closure`` (L-BFGS, SAM): computes the loss, calls ``self.backward(loss, ...)``
        and returns it; the Trainer clears the gradients before each call and readies them after as for any update."""
        self._runner.step(optimizer, closure)

    # -- the run -----------------------------------------------------------------------------
    def fit(self) -> TrainState:
        """Train until ``max_steps`` or ``max_epochs``; returns the final ``TrainState``."""
        zero = self.dist is None or self.dist.is_zero
        self.progress = Progress(self.settings.max_steps, zero, bar=None if self.settings.progress else False)
        failed, let_go, self.fitting = False, None, True
        try:
            if self.settings.seed is not None and self.state.step == 0:  # a new run; a resumed one sets its RNG
                seed_everything(self.settings.seed)
            self.setup()
            self._said = say_outputs(self.run_dir, self.checkpointer, bool(self.loggers), self._said) if zero else None
            resume = self.settings.resume if self.state.step == 0 else None  # a later fit goes on from this one
            let_go = ckpt.take(self.run_dir, self.checkpointer, self.state.step == 0 and resume is None)
            if resume is not None:
                self._resume(resume)
            with self.guard.context(), slurm.stop_signals(self._stop, self.state, self.settings), runmodes.during_fit(
                    self.settings, self.model, self.run_dir, self.dist.rank if self.dist else 0) as step_done:
                self._hooks("on_fit_start")
                if self.val_data is not None and self.state.step == 0:  # the monitored metrics checked, no plateau step
                    check_monitor("checkpoint", self.checkpointer and self.checkpointer.monitor, self.validate())
                self.guard.start_fit()
                self._kept = ckpt.versions(ckpt.attributes(self))  # what the Trainer keeps, as the steps find it
                if self._loaded_rng is not None:  # set last, so that nothing before the first step draws from it
                    ckpt.set_rng_state(self._loaded_rng)
                    self._loaded_rng = None
                self._loop(step_done)
                self._finish()
        except BaseException:
            failed = True
            raise
        finally:
            self.fitting, self.ending, self._save_asked, self._save_now = False, False, False, True
            if let_go is not None:
                let_go()
            self.progress.close()
            for logger in self.loggers:
                logger.close()
            if self.dist is not None:
                self.dist.close(failed)
        return self.state

    def _loop(self, step_done: Callable[[], None]) -> None:
        """The steps, each followed by what is due after it, until ``_after_step`` or a pass's edge says to stop."""
        if self.state.reached(self.settings.max_steps) or self._stop.reason is not None or \
                (self._unfinished == self.state.step and self._after_step(again=True)):  # what a failure left, first
            return
        self.progress.start(self.state.step)  # steps/s counts the steps, from here: after set-up, resume, validation
        batches = self._data.batches(self.settings, self._hooks, self.schedules, self._stop)
        try:
            for group in batches:
                if group is PASS_END:  # on_epoch_end ran: what it logged and the save it asked for, now (and
                    self._log_pending(self.logged_since_step)  # the next on_epoch_start's save at once)
                    if self._save_asked:
                        self._save()
                    self._save_now = True
                    continue
                self._save_now = False  # from here to the pass's end, a hook's save waits for what follows the step
                self._runner.run(group)
                step_done()  # the profiler's step
                if self._after_step():
                    self._data.keep(self.settings.grad_accum)  # the next fit goes on from here
                    return
        except BaseException:  # a fit tried again goes on with the next batch, as a resume would
            self._data.keep(self.settings.grad_accum, failed=True)
            raise

    def _after_step(self, again: bool = False) -> bool:
        """Due after a step, in order: unused optimizers or loss weights, logging, validation (then the schedulers
        that monitor it), a checkpoint (the last step's: ``_finish``). True: the fit stops. ``again``: what a failed
        validation or save left, in a fit tried again (a validation that ended is not run again)."""
        s, step = self.settings, self.state.step
        end = step == s.max_steps or self._data.ends_run(s.max_epochs)  # the last epoch's end: data with a length
        if not again:
            self._runner.warn_unused(step, final=end)
            if step % s.log_every == 0 or end:
                metrics = self.state.metrics(self.logged)  # empties self.logged
                self.progress.update(step, metrics)
                self.log_metrics({**metrics, **self.schedules.rates(self.optimizers, step, but=metrics)})
        self._unfinished = step
        validated = bool(self.val_data is not None and s.val_every and step % s.val_every == 0)
        if validated and not (again and self.state.validated):
            self.validate()
        stop = self._stop.agreed(step, self.dist)
        if stop or (not end and (self._save_asked or self.checkpointer and self.checkpointer.due(step, validated))):
            self._save()
        self._unfinished = None
        self.logged_since_step.clear()
        return stop or self.state.reached(self.settings.max_steps)

    def _finish(self) -> None:
        """The end of ``fit``: last validation and checkpoint, ``on_fit_end``, loss curves (a signal: the save only)."""
        self._log_pending()  # logged after the last log point (in the last pass's on_epoch_end)
        validated = self.stop_signal is None and self.val_data is not None and not self.state.validated
        self.ending = True  # that validation is not one of training's (EarlyStopping does not count it)
        if validated:
            self.validate()  # before the final checkpoint, so that it holds the last metrics
        self._save_now = True
        if self._save_asked or self.checkpointer and self.checkpointer.due_at_end(self.state.step, validated):
            self._save()
        if self.stop_signal is None:
            self._hooks("on_fit_end")
            self._log_pending()
            if self.loggers:  # there are none without a run directory
                curves.draw_logged(self.run_dir)

    def _log_pending(self, names: Iterable[str] | None = None) -> None:  # self.log's values kept (`names` of them)
        if names := [name for name in (self.logged if names is None else names) if name in self.logged]:
            self.log_metrics({name: float(self.logged.pop(name)) for name in names})

    @property
    def retain_plans(self) -> dict[tuple[tuple[str, ...], bool], int]:
        """Which backwards of several losses retained the graph: ``{(those losses, walked): first step}``."""
        return self._runner.retain_plans if self._runner is not None else {}

    def request_stop(self, reason: str) -> None:
        """End this ``fit`` after this step as ``max_steps`` does, logging ``reason`` (under torchrun: every rank)."""
        self._stop.ask(reason, self.state.step)

    @property
    def stop_signal(self) -> int | None:
        """The signal (SIGTERM, SIGINT; in a SLURM job SIGUSR1) that stopped the last ``fit``, if one did."""
        return self._stop.signum

    @property
    def train_data(self) -> Iterable:
        """The batches (under torchrun, this rank's share); may be replaced between fits or in ``on_epoch_start``."""
        return self._data.data

    @train_data.setter
    def train_data(self, data: Iterable) -> None:
        self._data.data = data

    def log_metrics(self, metrics: Mapping[str, float]) -> None:
        for logger in self.loggers:
            logger.log_metrics(dict(metrics), self.state.step)

    def validate(self) -> dict[str, float]:
        """``validation_step`` over ``val_data`` (``safeloop.evaluate``: eval mode, no gradients, each loss's mean over
        samples, all ranks' shares, training's RNG untouched); logs, returns ``val_<name>``, steps plateaus in fit."""
        metrics = self._evaluator().means(self.val_data, self.validation_step, logged=self.logged)
        self.state.val_history.append((self.state.step, metrics))
        self._save_asked |= bool(self.checkpointer and self.checkpointer.monitor) and not self._save_now  # ranked
        self._hooks("on_validation_end", metrics)  # it may add a metric of the whole pass (F1): logged with them
        self.log_metrics(metrics)
        if self.fitting and not self.ending:  # training's (val_every's, a hook's): those EarlyStopping counts
            self.schedules.after_validation(metrics, self.state.step)  # (before training: the names checked)
        return metrics

    def test(self, data: Iterable) -> dict[str, float]:
        """``test_step`` over ``data`` as ``validate()`` runs ``validation_step``; logs and returns ``test_<name>``."""
        return self._evaluator().means(data, self.test_step, TEST, self.logged)

    def predict(self, data: Iterable) -> list:
        """``predict_step``'s output for each batch (eval mode, no gradients); under torchrun, this rank's share's."""
        return self._evaluator().outputs(data, self.predict_step)

    def _evaluator(self) -> Evaluator:
        if not self.fitting:  # Lightning's hook names are refused as fit() refuses them (a script that predicts)
            self._hooks.bind(self.callbacks)
        return Evaluator(self.model, self.device, self.precision, self._mover(), self.state.step, self.dist,
                         tuple(self.modules().values()), self.fitting)

    def _mover(self) -> Callable | None:
        """``to_device`` where batches need it: not on the CPU in float32, unless overridden (a batch goes to the step
        as the DataLoader made it, which a frozen dataclass needs)."""
        return self.to_device if moves(self.device, self.precision) or is_overridden("to_device", self, Trainer) \
            else None

    def to_device(self, batch):
        """Every tensor in ``batch`` (lists, tuples, dicts) on the device (a floating one in bf16 under bf16-true),
        an object with a ``to`` method of its own (HF's ``BatchEncoding``) moved by it. Overridden: on the CPU too."""
        return to_device(batch, self.device, self.precision)

    # -- checkpoints ---------------------------------------------------------------------------
    def save_checkpoint(self) -> Path | None:
        """Save a checkpoint now, as the Trainer does every ``checkpoint.every`` steps; from a step's hooks, once
        its validation, schedulers and pass end are done, so that a resume goes on as the run did. Returns the file."""
        if self._save_now or self.checkpointer is None:
            return self._save()
        self._save_asked = True
        return self.checkpointer.path(self._runner.running or self.state.step)  # the step under way, if any

    def _save(self) -> Path | None:
        self._save_asked = False
        return self.checkpointer.save(self.state.step, self.state_dict()) if self.checkpointer is not None else None

    def _resume(self, resume: str | Path) -> None:
        found = (self.checkpointer or ckpt.Checkpointer(Path(resume))).find(resume)
        if found is None:
            return
        try:
            self.load_state_dict(found[1], found[0])
        finally:  # once loaded (an error in on_load_checkpoint leaves it so), this run goes on from it
            loaded = self._loaded_rng is not None
            if loaded and self.checkpointer is not None:
                self.checkpointer.resumed(*found)
            for logger in self.loggers if loaded else ():  # what the stopped run logged after it is superseded
                logger.resume(self.state.step)
        log.info("resumed from %s: %s%s", found[0], self.state.where(),
                 "; max_steps is reached: nothing to train" if self.state.reached(self.settings.max_steps) else "")

    def modules(self) -> dict[str, torch.nn.Module]:
        """The modules checkpoints save and evaluation puts in eval mode: ``{"model": self.model}``; add an EMA copy."""
        return {"model": self.model} if self.model is not None else {}

    @property
    def schedulers(self) -> dict[str, Any]:
        """The schedulers by optimizer name (``self.schedules`` says when each steps)."""
        return self.schedules.schedulers

    def state_dict(self) -> dict:
        """What a checkpoint holds (``safeloop.checkpoint.collect``) and ``on_save_checkpoint`` adds. Needs ``setup()``
        first (``fit()`` calls it); under torchrun every rank calls it (the Trainer's saves do)."""
        checkpoint = ckpt.collect(self._parts("state_dict"), self.config)
        ours = set(checkpoint)
        self._hooks("on_save_checkpoint", checkpoint)
        ckpt.check_added(checkpoint, ours)
        ckpt.warn_unsaved(ckpt.attributes(self), checkpoint, self._kept)
        return checkpoint

    def load_state_dict(self, checkpoint: Mapping, path: str | Path | None = None) -> None:
        """Load what ``state_dict()`` saved (``path``: its file, for errors and shards), then ``on_load_checkpoint``;
        the RNG states are set as ``fit()`` starts its next step. Needs ``setup()`` first (``fit()`` calls it)."""
        ckpt.restore(self._parts("load_state_dict"), checkpoint, path, self.dist)
        self._loaded_rng = ckpt.rng_for(checkpoint, self.dist)
        self._hooks("on_load_checkpoint", checkpoint)
        self.schedules.mark()  # loaded: where the schedulers stand now is the Trainer's doing

    def _parts(self, method: str) -> ckpt.Parts:
        if not self.optimizers:
            raise SafeloopError(f"Trainer.{method}() needs the optimizers: call trainer.setup() first (fit() does)")
        modules, named = ckpt.with_outside(self.modules(), ckpt.named_parameters(self.modules), self.optimizers)
        return ckpt.Parts(modules, named, self.optimizers, self.schedulers, self.scaler, self.state, self._data,
                          self.dist, bool(self.checkpointer and self.checkpointer.sharded),
                          self._runner.applied_parameters() if self._runner else frozenset(), self.schedules.configured,
                          self._loaded_rng)  # a checkpoint loaded: its random state until the next step begins

    # -- setup ---------------------------------------------------------------------------------
    def setup(self) -> None:
        """Place the model; build optimizers, schedulers and the undo once; hooks, loggers and the step
        at every call (``fit()`` calls it, so that a later fit sees hooks and settings changed since)."""
        if self.model is None and (problem := model_problem(type(self), Trainer)):
            raise ConfigError(problem)
        if self.model is not None:
            place(self.model, self.device, self.precision)
        if self.dist is not None and not self.optimizers:  # strategy=fsdp: sharded before the optimizers are made
            self.dist.shard_model(self.model, self.settings.strategy, self.precision, self.configure_sharding)
        if not self.optimizers:  # kept only once they and their schedulers are accepted
            optimizers, given = schedules.split(self.configure_optimizers())
            schedules.check_optimizers(self.model, optimizers)
            self.schedules = schedules.read({**self.configure_schedulers(optimizers), **given}, optimizers,
                                            self.val_data is not None, self.settings.val_every is not None)
            self.optimizers = optimizers
        for module in ckpt.read_modules(self.modules).values():  # an EMA copy too (made in configure_optimizers, say)
            place(module, self.device, self.precision)
        self.scaler = (self.scaler or self.configure_grad_scaler()) if self.precision == "16" else None
        if self._undo is None or self._undo.mode != self.settings.undo:  # (trainer.undo set between fits)
            self._undo = Undo(self.settings.undo, self.optimizers, self.schedules)
        self._hooks.bind(self.callbacks)
        forward = self.training_step
        if self.dist is not None:  # rank zero's weights and run directory, sharded data, DDP or gradient hooks
            self.run_dir = self.dist.join(self.model, self.optimizers, self.run_dir, self._data, self.guard)
            self.dist.attach(self.model, self.optimizers, self.training_step, self.settings, self.automatic,
                             per_backward_hooks=self._hooks.has("on_before_backward", "on_after_backward"))
            if self.dist.ddp is not None:
                forward = self.dist.forward  # training_step runs inside DDP's forward
        scope = Scope.of_trainer(self, self.model, type(self).training_step, self.optimizers)
        self._runner = Runner(StepConfig(
            settings=self.settings, automatic=self.automatic, optimizers=self.optimizers, schedules=self.schedules,
            undo=self._undo, hooks=self._hooks, guard=self.guard, state=self.state, training_step=self.training_step,
            forward=forward, autocast=partial(autocast, self.precision, self.device), scaler=self.scaler,
            move=self._mover(), dist=self.dist, scope=scope,
            named_parameters=partial(ckpt.named_parameters, self.modules), model=self.model, precision=self.precision),
            previous=self._runner)
        self.loggers = make_loggers(self.settings.loggers, self.run_dir) if not self.dist or self.dist.is_zero else []


attach(Trainer, made=("device", "precision", "loggers"))
