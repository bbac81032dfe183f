"""Learning-rate schedules: what ``configure_optimizers`` / ``configure_schedulers`` return, when
each scheduler steps (``Schedules``: every scheduler step of a run), and the learning rates that
are logged with the losses.

A scheduler is given as itself (stepped after every update of its optimizer) or as Lightning's
dict ``{"scheduler": s, "interval": "step" | "epoch", "monitor": "val_loss"}``, whose ``interval``
is ``epoch`` unless it says otherwise, as in Lightning (so is that of a scheduler returned alone
under ``configure_optimizers``' ``"lr_scheduler"`` key, Lightning's form). ``interval: epoch``
steps it once at the end of every pass over ``train_data``; ``monitor`` names a validation metric
(``val_<loss name>``) and steps a scheduler that steps on a metric (``ReduceLROnPlateau``) after
every validation during training with that metric's value (its ``interval`` is then not used).

The Trainer alone steps the schedulers it knows: one stepped elsewhere too (``scheduler.step()``
in ``training_step`` or a hook, as Lightning's manual optimization has it) would move twice, and
the next step of it the Trainer takes stops the run with a ``StepError`` saying so.
"""
from __future__ import annotations

import inspect
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from . import fsdp
from .errors import ConfigError, StepError

INTERVALS = ("step", "epoch")
KEYS = ("scheduler", "interval", "monitor")
LIGHTNING_KEYS = {"optimizer", "lr_scheduler", "monitor"}  # monitor: the metric of a plateau given alone


@dataclass
class Schedule:
    """One optimizer's scheduler and when it steps."""

    scheduler: Any
    interval: str = "step"
    monitor: str | None = None
    at: Any = None  # the scheduler's ``last_epoch`` when the Trainer last stepped it (or it was made or loaded)

    @property
    def every_step(self) -> bool:
        return self.interval == "step" and self.monitor is None

    @property
    def when(self) -> str:
        if self.monitor is not None:
            return f"after every validation, with {self.monitor}"
        return "after every update of it" if self.interval == "step" else "at the end of every pass over train_data"


class Schedules:
    """Every scheduler step of a run, each kind in one method called from one place:
    ``after_update`` (the step, after optimizer ``name`` stepped), ``after_epoch`` (the end of a
    pass over ``train_data``) and ``after_validation`` (a validation during training)."""

    def __init__(self, schedules: Mapping[str, Schedule] | None = None, configured: dict | None = None):
        self.schedules = dict(schedules or {})
        self.schedulers = {name: s.scheduler for name, s in self.schedules.items()}  # what checkpoints save
        # each optimizer's hyperparameters as configure_optimizers made them (its schedulers built), which schedules
        # change later: what a resumed run compares its own with, to tell a setting changed for it
        self.configured = dict(configured or {})
        self.used: dict[str, tuple[int, list]] = {}  # each optimizer's last update: its step, the rates it used
        self.mark()

    def after_update(self, name: str, optimizer: torch.optim.Optimizer, step: int) -> None:
        # the rates the update used, which the log shows: its scheduler steps next (or one in on_step_end, timm's)
        self.used[name] = step, [_copied(g["lr"]) for g in optimizer.param_groups]
        schedule = self.schedules.get(name)
        if schedule is not None and schedule.every_step:
            self._step(name, step)

    def rates(self, optimizers: Mapping[str, torch.optim.Optimizer], step: int,
              but: Mapping | tuple = ()) -> dict[str, float]:
        """``learning_rates`` as step ``step``'s updates used them, an optimizer no update of it stepped (manual mode)
        as it is now (what a log point shows with that step's losses), but those of names in ``but`` (a value
        ``self.log`` gave under the same name)."""
        used, self.used = {name: rates for name, (at, rates) in self.used.items() if at == step}, {}
        return {k: v for k, v in learning_rates(optimizers, used).items() if k not in but}

    def after_epoch(self, step: int) -> None:
        for name, schedule in self.schedules.items():
            if schedule.interval == "epoch" and schedule.monitor is None:
                self._step(name, step)

    def after_validation(self, metrics: Mapping[str, float], step: int) -> None:
        self.check_monitors(metrics)
        for name, schedule in self.schedules.items():
            if schedule.monitor is not None and step > 0:  # the validation before training checks the names only
                self._step(name, step, metrics[schedule.monitor])

    def _step(self, name: str, step: int, *metric: float) -> None:
        schedule = self.schedules[name]
        self.check(name, step)
        schedule.scheduler.step(*metric)
        schedule.at = getattr(schedule.scheduler, "last_epoch", None)

    def mark(self) -> None:
        """Note where every scheduler stands (made, loaded from a checkpoint, restored by an undo)."""
        for schedule in self.schedules.values():
            schedule.at = getattr(schedule.scheduler, "last_epoch", None)

    def check(self, name: str, step: int) -> None:
        """Before the Trainer steps optimizer ``name`` or its scheduler: a ``StepError`` if the scheduler was stepped
        since by other code, which would make it move twice (``last_epoch`` tells; a scheduler without it is not
        checked)."""
        schedule = self.schedules.get(name)
        if schedule is None or getattr(schedule.scheduler, "last_epoch", None) == schedule.at:
            return
        raise StepError(
            f"step {step}: the scheduler of optimizer {name!r} ({type(schedule.scheduler).__name__}) was stepped "
            f"outside the Trainer (its last_epoch went from {schedule.at} to {schedule.scheduler.last_epoch} since "
            f"the Trainer last stepped it), and the Trainer steps it itself, {schedule.when}: it would move twice. "
            "Remove your scheduler.step() (Lightning's manual optimization leaves schedulers to you; safeloop's "
            "self.step(name) steps them); to step it yourself instead, keep it out of configure_optimizers and "
            "configure_schedulers", step)

    def check_monitors(self, metrics: Mapping[str, float]) -> None:
        """Every monitored metric is one validation reports (the Trainer checks at its first validation too,
        before anything is trained)."""
        problems = [f"the scheduler of optimizer {name!r} monitors {s.monitor!r}, which validation does not report: "
                    f"it reports {', '.join(metrics) or 'nothing'}; give monitor=<one of those>"
                    for name, s in self.schedules.items() if s.monitor is not None and s.monitor not in metrics]
        if problems:
            raise ConfigError(problems)


def split(returned) -> tuple[dict[str, torch.optim.Optimizer], dict[str, Any]]:
    """What ``configure_optimizers`` returned, as ``({name: optimizer}, {name: scheduler given with it})``.

    Accepted: an optimizer; ``{name: optimizer}``; Lightning's ``{"optimizer": opt, "lr_scheduler": s}`` (and
    ``"monitor": metric`` for an ``s`` given alone); ``{name: {"optimizer": opt, "lr_scheduler": s}}``.
    """
    if isinstance(returned, (list, tuple)):
        raise ConfigError(f"configure_optimizers returned a {type(returned).__name__}: Lightning's lists ([opt], "
                          "([opt], [scheduler]), [opt_g, opt_d]) are not read here, since optimizers go by name: "
                          "return {'g': opt_g, 'd': opt_d} (self.backward(loss, optimizer='g'), self.step('g')), or "
                          "{'optimizer': opt, 'lr_scheduler': scheduler}")
    if isinstance(returned, Mapping) and "optimizer" in returned and set(returned) <= LIGHTNING_KEYS:
        returned = {"optimizer": returned}
    if not isinstance(returned, Mapping):
        returned = {"optimizer": returned}
    optimizers, schedulers = {}, {}
    for name, value in returned.items():
        if isinstance(value, Mapping) and set(value) <= LIGHTNING_KEYS and "optimizer" in value:
            optimizers[name] = value["optimizer"]
            lightning = value.get("lr_scheduler")  # Lightning's form: alone, it steps once per epoch, as there
            if lightning is not None and not isinstance(lightning, Mapping):
                lightning = {"scheduler": lightning, **{key: value[key] for key in ("monitor",) if key in value}}
            if lightning is not None:
                schedulers[name] = lightning
        else:
            optimizers[name] = value
    for name, opt in optimizers.items():
        if not isinstance(opt, torch.optim.Optimizer):
            raise ConfigError(f"configure_optimizers returned {type(opt).__name__} for {name!r}, "
                              "not a torch.optim.Optimizer")
    return optimizers, schedulers


def read(schedulers: Mapping[str, Any], optimizers: Mapping[str, Any], validates: bool,
         every: bool = True) -> Schedules:
    """The ``Schedules`` of ``{name: scheduler or its dict}``, every problem in one ``ConfigError``
    (``validates``: there is ``val_data``, which a ``monitor`` needs; ``every``: ``val_every`` is set, so that
    validation runs during training too, not only at its end)."""
    out, problems = {}, []
    for name, value in schedulers.items():
        where = f"the scheduler of optimizer {name!r}"
        if name not in optimizers:
            problems.append(f"{where}: there is no optimizer {name!r}; choose from {sorted(optimizers)}")
            continue
        given = dict(value) if isinstance(value, Mapping) else {"scheduler": value}
        if given.get("frequency") == 1:  # Lightning's default, kept by many configs: every interval
            del given["frequency"]
        unknown = [key for key in given if key not in KEYS]
        if unknown or "scheduler" not in given:
            problems.append(f"{where} is a dict with keys {sorted(given)}: give 'scheduler' and optionally "
                            f"'interval' ({' or '.join(INTERVALS)}) and 'monitor' (a validation metric)"
                            + ("; Lightning's 'frequency' other than 1 is not supported: step it yourself in a hook, "
                               "leaving it out of the Trainer's schedulers" if "frequency" in unknown else ""))
            continue
        # Lightning's dict steps once per epoch unless it says otherwise; a scheduler given alone, after every update
        schedule = Schedule(given["scheduler"], given.get("interval") or ("epoch" if isinstance(value, Mapping)
                                                                           else "step"), given.get("monitor"))
        missing = [f"{method}()" for method in ("step", "state_dict", "load_state_dict")
                   if not callable(getattr(schedule.scheduler, method, None))]
        if missing:
            problems.append(f"{where} is a {type(schedule.scheduler).__name__} without {' or '.join(missing)}: the "
                            "Trainer steps a scheduler with step() and saves and restores it (checkpoints, the undo "
                            "of a failed step) with state_dict() and load_state_dict(); add them, or step it "
                            "yourself in a hook (on_before_optimizer_step, on_step_end)")
            continue
        plateau = steps_on_a_metric(schedule.scheduler)
        needs = [] if plateau else needed_arguments(schedule.scheduler.step)
        if needs:
            problems.append(f"{where} is a {type(schedule.scheduler).__name__}, whose step() needs {', '.join(needs)}: "
                            "the Trainer calls step() without arguments. Leave it out of configure_optimizers and "
                            "step it yourself in a hook (timm's: step_update(num_updates) in on_step_end, "
                            "step(epoch) in on_epoch_end), saving its state_dict() in on_save_checkpoint")
        if schedule.interval not in INTERVALS:
            problems.append(f"{where}: interval={schedule.interval!r} is not one of {', '.join(INTERVALS)}")
        if plateau and schedule.monitor is None:
            problems.append(f"{where} is {type(schedule.scheduler).__name__}, which steps on a metric: give "
                            "{'scheduler': ..., 'monitor': 'val_loss'} (a validation metric's name)")
        if schedule.monitor is not None and not plateau:
            problems.append(f"{where} ({type(schedule.scheduler).__name__}) monitors {schedule.monitor!r}, and its "
                            "step() takes no metric (it would read the value as an epoch number): 'monitor' is for "
                            "a scheduler that steps on a metric, such as ReduceLROnPlateau. Drop it, and give "
                            "'interval' (Lightning ignores it there)")
        if schedule.monitor is not None and not validates:
            problems.append(f"{where} monitors {schedule.monitor!r}, a validation metric, and there is no "
                            "val_data: pass val_data=... (and val_every=N)")
        elif schedule.monitor is not None and not every:
            problems.append(f"{where} monitors {schedule.monitor!r}, a validation metric, and no validation runs "
                            "during training (val_every is not set: only at its end), so it would never step: set "
                            "val_every=N, the steps between validations (Lightning validates every epoch)")
        out[name] = schedule
    if problems:
        raise ConfigError(problems)
    return Schedules(out, {name: hyperparameters(opt) for name, opt in optimizers.items()})


def hyperparameters(optimizer: torch.optim.Optimizer) -> list[dict[str, Any]]:
    """Each parameter group's settings (all but its parameters), as plain values."""
    return [{key: value.item() if hasattr(value, "item") and getattr(value, "ndim", 1) == 0 else value
             for key, value in group.items() if key != "params" and not isinstance(value, torch.Tensor)}
            for group in optimizer.param_groups]


def needed_arguments(method: Any) -> list[str]:
    """The arguments ``method`` cannot be called without (none where its signature cannot be read)."""
    try:
        parameters = inspect.signature(method).parameters.values()
    except (TypeError, ValueError):
        return []
    return [p.name for p in parameters
            if p.default is p.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]


def steps_on_a_metric(scheduler: Any) -> bool:
    """Whether ``scheduler.step`` takes a metric first (``ReduceLROnPlateau.step(metrics)``): a monitored one's."""
    if isinstance(scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau):
        return True
    try:
        first = next(iter(inspect.signature(scheduler.step).parameters.values()), None)
    except (TypeError, ValueError):  # no signature to read
        return False
    return first is not None and first.name.startswith("metric") and first.kind in (
        inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)


def check_optimizers(model: torch.nn.Module | None, optimizers: Mapping[str, torch.optim.Optimizer]) -> None:
    """An optimizer set that holds none of the model's trainable parameters never changes the model: an error
    (optimizing an input through a fixed model is a real use: ``model.requires_grad_(False)`` says so)."""
    if model is None:
        return
    trained = {id(p) for p in model.parameters() if p.requires_grad}
    held = {id(p) for opt in optimizers.values() for g in opt.param_groups for p in g["params"]}
    if trained and not trained & held and fsdp.is_sharded(model):
        raise ConfigError("strategy=fsdp replaced the model's parameters with sharded ones after the optimizer was "
                          "built over the old ones: pass optimizer as a callable (functools.partial(torch.optim.AdamW, "
                          "lr=...), a Hydra _partial_), which the Trainer calls after sharding, or build it in "
                          "configure_optimizers")
    if trained and not trained & held:
        names = ", ".join(repr(n) for n in optimizers)
        raise ConfigError(
            f"no optimizer holds any of the model's {len(trained)} trainable parameters, so training would not "
            f"change the model: optimizer {names} holds {len(held)} other tensor(s) (built over another "
            "model's parameters, or before the model was replaced?). Build it from self.model.parameters() "
            "in configure_optimizers, or pass optimizer=lambda params: torch.optim.AdamW(params, ...), "
            "which the Trainer calls with them; if the model is meant to stay fixed, "
            "model.requires_grad_(False) says so")


def make_optimizer(given: Any, params: Iterable) -> torch.optim.Optimizer:
    """The Trainer's ``optimizer`` argument over ``params`` (``Trainer.make_optimizer``): a callable is called with
    them, an ``Optimizer`` returned as it is; a ``ConfigError`` says what keeps it from being made."""
    if given is None:
        raise ConfigError("no optimizer: pass optimizer=... (an Optimizer or a callable taking parameters) "
                          "or override configure_optimizers()")
    if isinstance(given, torch.optim.Optimizer):
        return given
    params = list(params)
    if not params:
        raise ConfigError("optimizer: there are no parameters to optimize (a model without parameters?): give a "
                          "model with parameters, or override configure_optimizers")
    try:
        return given(params)
    except (TypeError, ValueError) as err:  # torch checks its arguments with these: say it is the optimizer's
        raise ConfigError(f"optimizer: making it over the parameters failed: {type(err).__name__}: {err}; fix "
                          "its arguments (a learning rate is a number: lr=0.01, not '0.01')") from err


def for_each(given: Any, optimizers: Mapping[str, torch.optim.Optimizer]) -> dict[str, Any]:
    """The Trainer's ``scheduler`` argument (a callable taking an optimizer, or a dict whose "scheduler" is
    one) made for each optimizer."""
    if given is None:
        return {}
    if isinstance(given, Mapping):
        return {name: {**given, "scheduler": given["scheduler"](opt)} for name, opt in optimizers.items()}
    return {name: given(opt) for name, opt in optimizers.items()}


def learning_rates(optimizers: Mapping[str, torch.optim.Optimizer],
                   used: Mapping[str, list[float]] | None = None) -> dict[str, float]:
    """Each optimizer's learning rate (``used``: its groups' as given), named ``lr`` (one optimizer) or
    ``lr_<name>``; with several parameter groups, one per group (``lr_<name>_<i>``)."""
    out = {}
    for name, opt in optimizers.items():
        base = "lr" if len(optimizers) == 1 else f"lr_{name}"
        rates = (used or {}).get(name) or [group["lr"] for group in opt.param_groups]
        for i, rate in enumerate(rates):
            out[base if len(rates) == 1 else f"{base}_{i}"] = float(rate)
    return out


def _copied(rate: float | torch.Tensor) -> float | torch.Tensor:
    """A rate as it is now: a tensor one (``lr=torch.tensor(...)``), which schedulers change in place, copied on
    its device (no host sync; read at a log point)."""
    return rate.detach().clone() if isinstance(rate, torch.Tensor) else rate
