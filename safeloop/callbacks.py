"""Callback objects: the Trainer's hooks, as separate objects.

A callback's hook receives the trainer first: ``on_step_end(self, trainer, losses)``.
Only hooks a callback overrides are called. ``on_save_checkpoint`` puts what the callback needs
saved into the checkpoint dict under a key of its own (tensors and plain containers);
``on_load_checkpoint`` reads it back when a run resumes.

``EarlyStopping`` is Lightning's: it stops a run whose validation metric stopped improving.
"""
from __future__ import annotations

import inspect
import logging
import math
from collections.abc import Callable, Mapping
from functools import partial
from typing import Any

import torch
from lightning_utilities.core.overrides import is_overridden

from .errors import ConfigError

log = logging.getLogger("safeloop")

HOOKS = (
    "on_fit_start",
    "on_step_start",
    "on_before_backward",
    "on_after_backward",
    "on_before_optimizer_step",
    "on_step_end",
    "on_epoch_start",
    "on_epoch_end",
    "on_validation_end",
    "on_fit_end",
    "on_save_checkpoint",
    "on_load_checkpoint",
)


# Lightning's hooks and methods that safeloop does not call, and what does their work here: defined on a Trainer
# subclass or a callback, each would never run, without a word (a port keeping Lightning's names).
LIGHTNING_NAMES = {
    "on_train_start": "use on_fit_start (it runs before the validation before training, which is logged, not a "
                      "sanity check: to leave it out of a best-so-far, skip it in on_validation_end while "
                      "self.state.step == 0)",
    "on_train_end": "use on_fit_end",
    "on_train_batch_start": "use on_step_start", "on_train_batch_end": "use on_step_end(losses)",
    "on_train_epoch_start": "use on_epoch_start", "on_train_epoch_end": "use on_epoch_end",
    "training_epoch_end": "use on_epoch_end", "validation_epoch_end": "use on_validation_end(metrics)",
    "on_validation_epoch_end": "use on_validation_end(metrics)",
    "optimizer_step": "the Trainer makes each update; a warm-up is a scheduler (LambdaLR, interval: step), and "
                      "gradients are changed in on_before_optimizer_step",
    "optimizer_zero_grad": "the Trainer clears an update's gradients when the next step begins (set_to_none)",
    "on_before_zero_grad": "use on_before_optimizer_step, or on_step_end (an update's gradients stay until the next "
                           "step begins)",
    "configure_gradient_clipping": "give grad_clip=..., or clip in on_before_optimizer_step",
    "lr_scheduler_step": "the Trainer steps the schedulers it is given (interval, monitor); to step one your way, keep "
                         "it out of configure_optimizers and step it in a hook",
    "configure_callbacks": "pass callbacks=[...]",
    "on_before_batch_transfer": "change the batch in training_step (or override to_device(batch))",
    "transfer_batch_to_device": "override to_device(batch)",
    "on_after_batch_transfer": "change the batch in training_step (or override to_device(batch))",
    "val_dataloader": "pass val_data=...", "prepare_data": "prepare the data before making the Trainer",
    "train_dataloader": "pass train_data=... (new data each pass: set self.train_data in on_epoch_start)",
    "test_dataloader": "call trainer.test(data)", "predict_dataloader": "call trainer.predict(data)",
    "automatic_optimization": "manual mode is automatic = False, a class attribute (automatic mode is the default)",
    "configure_model": "build the model before making the Trainer (to shard it: configure_sharding)",
    "setup": "change the model before fit() (a freeze too: fit() makes the optimizers before on_fit_start), or "
             "use on_fit_start", "teardown": "use on_fit_end",
    "state_dict": "keep a callback's state with on_save_checkpoint(checkpoint) and on_load_checkpoint(checkpoint)",
    **dict.fromkeys(("on_validation_start", "on_validation_epoch_start", "on_validation_batch_start",
                     "on_validation_batch_end"),
                    "validation_step(batch) runs on each batch, on_validation_end(metrics) after the pass"),
    **dict.fromkeys(("on_validation_model_eval", "on_validation_model_train", "on_test_model_eval",
                     "on_test_model_train", "on_predict_model_eval"),
                    "the Trainer puts every module in eval mode to validate, test or predict, and back after"),
    "on_validation_model_zero_grad": "validation runs under torch.no_grad() and leaves the gradients as they are",
    **dict.fromkeys(("on_test_start", "on_test_epoch_start", "on_test_batch_start", "on_test_batch_end",
                     "on_test_epoch_end", "on_test_end", "on_predict_start", "on_predict_epoch_start",
                     "on_predict_batch_start", "on_predict_batch_end", "on_predict_epoch_end", "on_predict_end"),
                    "trainer.test(data) returns the metrics and trainer.predict(data) the predictions: use them after "
                    "the call"),
    **dict.fromkeys(("on_sanity_check_start", "on_sanity_check_end"),
                    "there is no sanity check: the validation before the first step checks the monitored metrics; "
                    "use on_validation_end(metrics)"),
    "on_exception": "a failed fit() raises its error, after the step is undone and the run's files closed: catch "
                    "it around trainer.fit()",
    "load_state_dict": "keep a callback's state with on_save_checkpoint(checkpoint) and on_load_checkpoint(checkpoint)",
    "configure_sharded_model": "build the model before making the Trainer (to shard it: configure_sharding)",
}


# LightningModule attributes a port may still read, and safeloop's (``Trainer.__getattr__``: not found on a Trainer)
LIGHTNING_ATTRIBUTES = {
    "current_epoch": "self.state.epoch", "global_step": "self.state.step (manual mode: steps, not optimizer steps)",
    "trainer": "the Trainer is self: self.state.epoch, self.state.step, self.request_stop(reason) for should_stop",
    "lr_schedulers": "self.schedulers, a dict by optimizer name (self.optimizers too: no call)",
    "manual_backward": "self.backward(loss, optimizer=name)",
    **dict.fromkeys(("toggle_optimizer", "untoggle_optimizer"),
                    "drop it: self.backward(loss, optimizer=name) reaches only that optimizer's parameters"),
    **dict.fromkeys(("hparams", "save_hyperparameters"),
                    "keep settings as attributes of your Trainer subclass; the run's resolved config is self.config"),
    "clip_gradients": "grad_clip=N (norm), or torch.nn.utils.clip_grad_value_ in on_before_optimizer_step",
    "logger": "self.loggers, a list", "automatic_optimization": "automatic (a class attribute: False for manual mode)",
}


def lightning_attribute(owner: str, name: str) -> str:
    """The message of an attribute ``owner`` (a Trainer) does not have: with safeloop's way for Lightning's."""
    found = f"'{owner}' object has no attribute '{name}'"
    return f"{found}: that is Lightning's; here: {LIGHTNING_ATTRIBUTES[name]}" if name in LIGHTNING_ATTRIBUTES \
        else found


# The Trainer's own methods that Lightning's hooks of the same name would replace: (when an override is Lightning's,
# what to do instead)
REPLACED = {
    "setup": (lambda method, automatic: bool(inspect.signature(method).parameters),  # Lightning's setup(stage)
              "Trainer.setup() places the model and builds the optimizers, and fit() calls it; Lightning's "
              "setup(stage) would replace it: " + LIGHTNING_NAMES["setup"]),
    "backward": (lambda method, automatic: automatic,
                 "Trainer.backward is manual mode's self.backward(loss): in automatic mode the Trainer back-propagates "
                 "each loss itself and never calls it. For backward(create_graph=True) (AdaHessian, a gradient "
                 "penalty) set automatic = False and call self.backward(loss, create_graph=True)"),
}


def replaced(obj: object, base: type) -> list[str]:
    """A problem for each of the Trainer's own methods (``REPLACED``) that ``obj``'s class overrides as Lightning's
    hook of the same name."""
    return [f"{type(obj).__name__}.{name} overrides the Trainer's own {name}: {advice}"
            for name, (lightning, advice) in REPLACED.items()
            if getattr(type(obj), name) is not getattr(base, name)
            and lightning(getattr(obj, name), getattr(obj, "automatic", True))]


def lightning_names(obj: object, base: type) -> list[str]:
    """A problem for each of Lightning's names (``LIGHTNING_NAMES``) that ``obj`` defines (on its class or itself)
    and ``base`` does not, and for each step method of ``base`` that ``obj`` gives Lightning's ``batch_idx``."""
    defined = set(dir(obj))  # (not hasattr: a Trainer's __getattr__ words a message for each name it misses)
    problems = [f"{type(obj).__name__}.{name} is Lightning's name, which safeloop never calls: {advice}"
                for name, advice in LIGHTNING_NAMES.items() if name in defined and not hasattr(base, name)]
    for name in ("training_step", "validation_step", "test_step", "predict_step"):
        try:
            needed = [p for p in inspect.signature(getattr(obj, name)).parameters.values()
                      if p.default is p.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        except (AttributeError, TypeError, ValueError):  # not there, or no signature to read
            continue
        if len(needed) > 1:
            counted = ("self.state.batch_in_epoch counts the batches of the pass" if name == "training_step" else
                       "nothing counts an evaluation's batches: keep a count of your own, set to 0 where it starts")
            problems.append(f"{type(obj).__name__}.{name} takes ({', '.join(p.name for p in needed)}), and safeloop "
                            f"calls {name}(batch): drop {', '.join(p.name for p in needed[1:])} (Lightning's "
                            f"batch_idx: {counted})")
    return problems


def hook_signatures(obj: object, base: type, names: list[str]) -> list[str]:
    """A problem for each hook of ``names`` (those ``obj`` overrides) that cannot take the arguments ``base``'s takes
    (a port that kept Lightning's ``on_after_backward(self)`` or ``on_before_optimizer_step(self, optimizer)``)."""
    problems = []
    for name in names:
        args = list(inspect.signature(getattr(base, name)).parameters)[1:]
        try:
            inspect.signature(getattr(obj, name)).bind(*args)
        except TypeError:
            given = ", ".join(args)
            fix = f"a function of ({given})" if name in vars(obj) else f"def {name}({', '.join(['self', *args])})"
            problems.append(f"{type(obj).__name__}.{name} takes {inspect.signature(getattr(obj, name))}, and safeloop "
                            f"calls {name}({given}): write it as {fix}")
        except ValueError:  # no signature to read (a builtin): nothing to check
            continue
    return problems


class TrainerHooks:
    """The Trainer's hooks, which it inherits: override them in a subclass, or set one on the instance
    (``trainer.on_step_end = fn``). Their order: ``Trainer``'s docstring (docs/trainer.md, Hooks)."""

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


class Logging:
    """``self.log`` and ``self.log_dict``, as Lightning's, which the Trainer inherits: each value waits in
    ``self.logged`` for the next log point (one logged in ``on_epoch_end``: the pass's end)."""

    logged: dict[str, torch.Tensor | float]
    logged_since_step: set[str]  # the names logged since the last step's log point and validation

    def log(self, name: str, value: torch.Tensor | float, **lightning: Any) -> None:
        """Lightning's ``self.log``: written every ``log_every`` steps; in ``validation_step``, the pass's mean; in
        ``on_epoch_end``, at the pass's end."""
        self.logged[str(name)] = logged_value(name, value, lightning)
        self.logged_since_step.add(str(name))

    def log_dict(self, values: Mapping[str, torch.Tensor | float], **lightning: Any) -> None:
        """``self.log(name, value, ...)`` for each entry (Lightning's ``self.log_dict``)."""
        for name, value in values.items():
            self.log(name, value, **lightning)


class Callback:
    """The same hooks as separate objects: each receives the trainer first."""

    def on_fit_start(self, trainer) -> None: ...
    def on_step_start(self, trainer) -> None: ...
    def on_before_backward(self, trainer, name, loss) -> None: ...
    def on_after_backward(self, trainer, name) -> None: ...
    def on_before_optimizer_step(self, trainer, name, optimizer) -> None: ...
    def on_step_end(self, trainer, losses) -> None: ...
    def on_epoch_start(self, trainer) -> None: ...
    def on_epoch_end(self, trainer) -> None: ...
    def on_validation_end(self, trainer, metrics) -> None: ...
    def on_fit_end(self, trainer) -> None: ...
    def on_save_checkpoint(self, trainer, checkpoint) -> None: ...
    def on_load_checkpoint(self, trainer, checkpoint) -> None: ...


class Hooks:
    """The hooks a run calls: those overridden on the Trainer (its class or the instance itself,
    ``trainer.on_step_end = fn``) and on its callbacks, bound again at every ``fit`` (``bind``); before the first,
    at the first call (``trainer.validate()`` of a loaded model calls ``on_validation_end`` too)."""

    def __init__(self, trainer, base: type):
        self.trainer, self.base = trainer, base
        problems = replaced(trainer, base)  # here, before fit() calls an overridden setup
        if problems:
            raise ConfigError(problems)
        self.bound: dict[str, list[Callable]] | None = None

    def bind(self, callbacks: list[Callback]) -> None:
        trainer = self.trainer
        own = [name for name in HOOKS if is_overridden(name, trainer, self.base)]
        theirs = [(cb, [name for name in HOOKS if is_overridden(name, cb, Callback)]) for cb in callbacks]
        problems = replaced(trainer, self.base) + lightning_names(trainer, self.base)
        problems += hook_signatures(trainer, self.base, own)
        problems += [p for cb, names in theirs for p in lightning_names(cb, Callback) + hook_signatures(cb, Callback,
                                                                                                         names)]
        if problems:
            raise ConfigError(problems)
        self.bound = {name: [getattr(trainer, name)] if name in own else [] for name in HOOKS}
        for cb, names in theirs:  # each hook's in the callbacks' order
            for name in names:
                self.bound[name].append(partial(getattr(cb, name), trainer))

    def __call__(self, name: str, *args) -> None:
        if self.bound is None:
            self.bind(self.trainer.callbacks)
        for fn in self.bound[name]:
            if fn(*args) is not None and name == "on_step_start":
                raise ConfigError("on_step_start returned a value: Lightning's on_train_batch_start returns -1 to end "
                                  "the epoch there; safeloop's hooks return nothing. Leave the batches out of "
                                  "train_data instead, or end the fit with self.request_stop(reason)")
        if vars(self.trainer).pop("should_stop", False):  # Lightning's way, kept from a port (in a hook or the step)
            self.trainer.request_stop("trainer.should_stop was set (Lightning's name for request_stop)")

    def has(self, *names: str) -> bool:
        """Whether any of these hooks is overridden anywhere."""
        if self.bound is None:
            self.bind(self.trainer.callbacks)
        return any(self.bound[name] for name in names)


# Lightning's self.log options other than those safeloop's self.log does anyway (prog_bar: the progress line shows
# every logged value; logger=True), and what safeloop does instead
LOG_OPTIONS = {
    **dict.fromkeys(("on_step", "on_epoch"), "from training_step or a step's hooks the value is written every "
                    "log_every steps (Lightning's on_step), from on_epoch_end at the pass's end; from validation_step "
                    "or test_step it is the pass's mean over the samples (Lightning's on_epoch). For a training "
                    "value's mean over a pass, add it up yourself and self.log it in on_epoch_end: Lightning's mean "
                    "of a logged tensor weighs each batch by its samples (value * len(x)), a torchmetrics MeanMetric "
                    "each update alike"),
    "sync_dist": "a validation or test value is the mean over every rank's samples already; a training value is "
                 "rank zero's (all_reduce it yourself first for the ranks' mean)",
    "batch_size": "a validation value's mean counts the samples by the batch's first tensor; for another count, "
                  "return (losses, n) from validation_step",
    "logger": "every logged value is written to the loggers: leave this one out of self.log",
}


def logged_value(name: str, value: Any, options: Mapping[str, object]) -> torch.Tensor | float:
    """What Lightning's ``self.log(name, value, **options)`` keeps: a detached copy of the value, or a float.
    ``prog_bar`` and ``logger=True`` are taken (safeloop does that anyway); any other option, or a value that is no
    number (a torchmetrics ``Metric``, a tensor of several elements), is a ``ConfigError`` saying what safeloop
    does instead, not a TypeError."""
    problems = [f"self.log(..., {key}={value!r}): safeloop's self.log(name, value) takes no {key}: "
                + LOG_OPTIONS.get(key, "it has no such option") for key, value in options.items()
                if key != "prog_bar" and not (key == "logger" and value is True)]
    if problems:
        raise ConfigError(problems)
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:  # here, by name: float() at the log point or the pass's end would name neither
            raise ConfigError(f"self.log({name!r}, <tensor of shape {tuple(value.shape)}>): a logged value is one "
                              f"number, and this tensor holds {value.numel()} (one per sample?): reduce it, "
                              f"self.log({name!r}, value.mean()); from validation_step those batch means are "
                              "averaged over the samples")
        return value.detach().clone()  # a copy: a parameter logged (CLIP's logit_scale) is updated after the step
    try:
        return float(value)
    except (TypeError, ValueError):
        raise ConfigError(f"self.log({name!r}, <{type(value).__name__}>): safeloop logs a number or a one-element "
                          "tensor. For a torchmetrics Metric (Lightning computes it over the epoch): a mean over "
                          "samples (accuracy, MSE) ports as self.log(name, metric(preds, target)) in "
                          "validation_step, which safeloop averages over the samples; any other (F1, AUROC) as "
                          "metric.update(preds, target) there and, in on_validation_end(metrics), "
                          "metrics[name] = float(metric.compute()) and metric.reset()") from None


MODES = ("min", "max")


def check_monitor(who: str, name: str | None, metrics: Mapping[str, float]) -> None:
    """A ``ConfigError`` naming the metrics a validation reports, unless ``name`` (what ``who`` monitors; None:
    nothing) is one."""
    if name is not None and name not in metrics:
        raise ConfigError(f"{who} monitors {name!r}, which validation does not report: it reports "
                          f"{', '.join(metrics) or 'nothing'}; give monitor=<one of those> (a metric a callback "
                          "adds in on_validation_end reaches the callbacks listed after it: list that one first)")


def improved(value: float, best: float, mode: str, min_delta: float = 0.0) -> bool:
    """Whether ``value`` is better than ``best`` by more than ``min_delta`` (``mode``: min or max; NaN never is)."""
    return value < best - min_delta if mode == "min" else value > best + min_delta


class EarlyStopping(Callback):
    """Stop training when ``monitor`` (a validation metric) has not improved for ``patience`` validations.

    Lightning's names and rule: a validation improves on the best so far when its value is lower (``mode="min"``)
    or higher (``"max"``) by more than ``min_delta``; after ``patience`` validations in a row without improvement,
    training stops after that step, as at ``max_steps`` (``Trainer.request_stop``): the checkpoint is saved and
    ``on_fit_end`` runs. The validation before training only checks that ``monitor`` is a metric validation
    reports; every later one of a fit counts but the one a fit ends with after a step that had none, which a run
    that never stopped does not have (``trainer.ending``). A ``trainer.validate()`` outside ``fit`` does not
    count, after a fit that Ctrl-C or an error ended too. The best value, its step and the count are saved in
    checkpoints, so a resumed run counts on exactly, and one resumed after the stop trains nothing (unless
    ``patience`` was raised). A fit without validations during training is refused.
    """

    def __init__(self, monitor: str = "val_loss", mode: str = "min", patience: int = 3, min_delta: float = 0.0):
        problems = [] if mode in MODES else [f"EarlyStopping(mode={mode!r}): give {' or '.join(MODES)}" + (
            " (Lightning's EarlyStopping takes min_delta second, then patience; safeloop's order is monitor, mode, "
            "patience, min_delta: give them by name)" if isinstance(mode, (int, float)) else "")]
        if not (isinstance(patience, int) and not isinstance(patience, bool) and patience > 0):
            problems.append(f"EarlyStopping(patience={patience!r}): give a positive integer (validations)")
        if not (isinstance(min_delta, (int, float)) and not isinstance(min_delta, bool) and min_delta >= 0):
            problems.append(f"EarlyStopping(min_delta={min_delta!r}): give a number >= 0")
        if problems:
            raise ConfigError(problems)
        self.monitor, self.mode, self.patience, self.min_delta = monitor, mode, patience, float(min_delta)
        self.best = math.inf if mode == "min" else -math.inf
        self.best_step: int | None = None  # the step of the best validation
        self.wait = 0  # validations since the best

    @property
    def stopped(self) -> bool:
        return self.wait >= self.patience

    def reason(self) -> str:
        return (f"early stopping: {self.monitor} did not improve by more than {self.min_delta:g} over the last "
                f"{self.wait} validations (best {self.best:.4g} at step {self.best_step})")

    def on_fit_start(self, trainer) -> None:
        if trainer.val_data is None or not trainer.settings.val_every:
            raise ConfigError(f"EarlyStopping monitors {self.monitor!r}, but no validation runs during training ("
                              + ("no val_data" if trainer.val_data is None else "val_every is not set: only at its end")
                              + "), so it would never stop the run: pass val_data=... and val_every=N, the steps "
                              "between validations (Lightning validates every epoch)")
        if sum(isinstance(cb, EarlyStopping) and cb.monitor == self.monitor for cb in trainer.callbacks) > 1:
            raise ConfigError(f"two EarlyStopping callbacks monitor {self.monitor!r}: checkpoints keep one state per "
                              "monitored metric, so a resumed run would count both from one's (Lightning refuses them "
                              "too); give one EarlyStopping per metric")
        if self.stopped:  # resumed after the stop: nothing to train
            trainer.request_stop(self.reason())

    def on_validation_end(self, trainer, metrics) -> None:
        check_monitor("EarlyStopping", self.monitor, metrics)
        step = trainer.state.step
        # before training, the one a fit ends with, or outside fit (a trainer.validate() after Ctrl-C stopped it)
        if step == 0 or trainer.ending or not trainer.fitting:
            return
        value = metrics[self.monitor]
        if improved(value, self.best, self.mode, self.min_delta):
            self.best, self.best_step, self.wait = value, step, 0
        else:
            self.wait += 1
        if self.stopped:
            trainer.request_stop(self.reason())

    def on_save_checkpoint(self, trainer, checkpoint) -> None:
        checkpoint.setdefault("early_stopping", {})[self.monitor] = {
            "mode": self.mode, "best": self.best, "best_step": self.best_step, "wait": self.wait}

    def on_load_checkpoint(self, trainer, checkpoint) -> None:
        saved = checkpoint.get("early_stopping", {}).get(self.monitor)
        if saved is None or saved["mode"] != self.mode:
            log.info("resume: the checkpoint holds no early-stopping state for %s (mode %s): counting starts afresh",
                     self.monitor, self.mode)
            return
        self.best, self.best_step, self.wait = saved["best"], saved["best_step"], saved["wait"]
