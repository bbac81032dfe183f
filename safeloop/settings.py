"""Every setting of a run, its one default, its meaning and its check.

Each dataclass is both the keyword arguments of the class that uses it and the Hydra schema
of a config group: ``Trainer(max_steps=500)`` and ``python -m safeloop trainer.max_steps=500``
are one setting with one default, written here. The YAML files under ``configs/`` hold only
what a job changes. ``problems()`` returns every problem with the values at once, in the words
the Trainer's ``ConfigError`` uses; ``mistyped`` checks any call's arguments against its annotations
(the Trainer's objects, and the ``_target_`` of a config group such as ``model`` or ``optimizer``).

- ``Settings``: the Trainer's keyword arguments; with ``_target_``, the ``trainer`` group (``TrainerGroup``).
- ``GuardSettings``: ``Guard``'s keyword arguments, ``Trainer(guard={...})``, the ``guard`` group.
- ``CheckpointSettings``: ``Trainer(checkpoint={...})``, the ``checkpoint`` group.
"""
from __future__ import annotations

import difflib
import functools
import inspect
import math
import os
import types
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Literal, Optional, Union, get_args, get_origin, get_type_hints

import torch

from .loggers import problems as logger_problems

# The choices of the settings that take one of a few words.
MULTI_LOSS = ("sequential", "sum")
ON_NONFINITE = ("error", "skip", "off")
UNDO = ("auto", "full", "off")
CHECKS = ("auto", "always", "off")
REUSE_POLICIES = ("error", "warn", "retain")
STRATEGIES = ("ddp", "fsdp")
# The guard's checks that can be turned off one by one (guard.ignore, Guard.ignore(...)).
GUARD_CHECKS = ("reuse", "carried", "consumed", "inplace", "leak", "unused")


@dataclass
class Settings:
    """The Trainer's settings: its keyword arguments and the ``trainer`` config group."""

    # When to stop: at least one of the two is required; training ends at whichever comes first.
    max_steps: Optional[int] = None
    max_epochs: Optional[int] = None
    # Steps between validations of val_data (null: only before and after training).
    val_every: Optional[int] = None
    # Micro-batches per optimizer step, each loss divided by it: the update equals one big batch's. The last
    # step of a pass takes the batches left (fewer, still divided by grad_accum, as Lightning does).
    grad_accum: int = 1
    # Max gradient norm (null: no clipping).
    grad_clip: Optional[float] = None
    # On CPU or CUDA: "32" (or "32-true"), "bf16" (or "bf16-mixed": autocast), "bf16-true" (the parameters and
    # batches in bf16, no autocast) or "16" (or "16-mixed": autocast to float16 and a GradScaler).
    precision: str = "32"
    # auto (CUDA when present), cpu, cuda or cuda:N.
    device: str = "auto"
    # Steps between logged (and synced) loss values.
    log_every: int = 50
    # Several losses: sequential (a backward each, retaining the graph only where a later loss
    # shares it) or sum (one backward of their sum, weighted by loss_weights).
    multi_loss: str = "sequential"
    # An optional weight per loss name: {name: weight}.
    loss_weights: Optional[dict[str, float]] = field(default_factory=dict)
    # Where metrics go: csv (metrics.csv in the run directory), tensorboard, wandb, mlflow (the optional ones when
    # installed), and any object with a log_metrics(metrics: dict, step: int) method.
    loggers: list[Any] = field(default_factory=lambda: ["csv"])
    # A progress bar in a terminal, log lines otherwise; false: the log lines, never a bar.
    progress: bool = True
    # null | auto | PATH: auto resumes from the newest readable checkpoint in the checkpoint
    # directory, if any (the same command starts and restarts a run); PATH: a checkpoint file or directory.
    resume: Optional[str] = None
    # off | error | skip: a NaN/Inf loss or gradient is not looked for, stops the run, or skips the
    # update (one fused test and one host sync per step).
    on_nonfinite: str = "off"
    # skip: this many steps in a row at most, then an error.
    max_skipped: int = 10
    # torchrun (DistributedDataParallel): true if a step may leave some of the model's parameters
    # without gradient (one more small all-reduce per step); false stops such a step with an
    # error naming the parameter.
    find_unused_parameters: bool = False
    # torchrun (DistributedDataParallel's static_graph): true if every step runs the same graph and some parameter's
    # gradient is accumulated more than once in one backward (a layer under several reentrant checkpoints, which
    # DDP otherwise stops with "Expected to mark a variable ready only once").
    static_graph: bool = False
    # torchrun: ddp (every rank holds the whole model; gradients all-reduced) or fsdp (each rank holds 1/world
    # of the parameters, gradients and optimizer state: FSDP2, safeloop.fsdp). A model sharded with fully_shard
    # before it is given to the Trainer trains sharded either way. One process ignores it.
    strategy: str = "ddp"
    # What a failed step undoes: auto (optimizers that step before a later one in the same step),
    # full (every optimizer and scheduler of the step), off (nothing; no snapshot memory).
    undo: str = "auto"
    # Seeds Python's random, NumPy's and torch's generators when a run starts (step 0), after the model is
    # built (null: nothing is seeded). The command line's own `seed` seeds before the model is built.
    seed: Optional[int] = None
    # torch.use_deterministic_algorithms(True) while fit runs (and CUBLAS_WORKSPACE_CONFIG set for CUDA): an
    # operation without a deterministic implementation raises instead of varying from run to run.
    deterministic: bool = False
    # torch.compile the model for training (in place, nn.Module.compile: checkpoints hold its usual keys).
    compile: bool = False
    # Write a torch.profiler Chrome trace of N steps, after one warm-up step, to <run dir>/trace.json; or
    # torch.profiler.schedule's {wait: W, warmup: U, active: N} (null: no profiling).
    profile: Any = None
    # In a SLURM job: once SIGUSR1 (#SBATCH --signal=SIGUSR1@90) has stopped the run after a step and its checkpoint
    # is written, rank zero requeues the job (scontrol requeue), which resumes from it with resume=auto.
    requeue: bool = True

    def problems(self) -> list[str]:
        """Every problem with these values at once (none: an empty list)."""
        out = []
        if self.max_steps is None and self.max_epochs is None:
            out.append("set max_steps or max_epochs (trainer.max_steps=N)")
        for key in ("max_steps", "max_epochs", "val_every"):
            out += _positive(key, getattr(self, key), optional=True)
        out += _positive("grad_accum", self.grad_accum) + _positive("log_every", self.log_every)
        if self.grad_clip is not None and not (_number(self.grad_clip) and self.grad_clip > 0):
            out.append(f"grad_clip must be a positive number or null, got {self.grad_clip!r}")
        out += _choice("multi_loss", self.multi_loss, MULTI_LOSS)
        out += _choice("on_nonfinite", self.on_nonfinite, ON_NONFINITE)
        out += _positive("max_skipped", self.max_skipped)
        if isinstance(self.loss_weights, Mapping):
            out += [f"loss_weights[{k!r}]={w!r} is not a finite number: give each loss a finite weight"
                    for k, w in self.loss_weights.items() if _number(w) and not math.isfinite(w)]
        out += _choice("undo", self.undo, UNDO) + _choice("strategy", self.strategy, STRATEGIES)
        if not (self.resume is None or isinstance(self.resume, (str, os.PathLike))):
            out.append(f"resume={self.resume!r} is {_a(type(self.resume).__name__)}: give auto, or the path of a "
                       "checkpoint file or directory (a str or Path)")
        elif self.resume is not None and str(self.resume) != "auto" and not Path(self.resume).exists():
            out.append(f"resume={str(self.resume)!r}: no such file or directory (give a checkpoint file, a "
                       "checkpoint directory, or auto)")
        out += profile_problems(self.profile)
        if isinstance(self.loggers, Iterable) and not isinstance(self.loggers, (str, bytes, Mapping)):
            out += logger_problems(self.loggers)
        else:
            out.append(f"loggers={_short(self.loggers)} is {_a(type(self.loggers).__name__)}: give a list of logger "
                       "names and logger objects (loggers=['csv'])")
        # the others by type (precision and device by safeloop.devices, which reads ints and torch.device too)
        return out + mistyped(Settings, {key: getattr(self, key) for key in ("loss_weights", "progress",
                                         "find_unused_parameters", "static_graph", "seed", "deterministic",
                                         "compile")})


@dataclass
class TrainerGroup(Settings):
    """The ``trainer`` config group: the settings and the Trainer class they build."""

    # The dotted path of the Trainer class: a safeloop.Trainer subclass runs from the command line.
    _target_: str = "safeloop.Trainer"


@dataclass
class GuardSettings:
    """The graph-lifecycle guard's settings: ``Guard(...)``, ``Trainer(guard={...})``, the ``guard`` group."""

    # What to do when a step's loss reaches a graph built before training started: error, warn
    # (and retain it), retain (silently; the reused graph's buffers then stay in memory for the run).
    on_reuse: str = "error"
    # always: walk the graph every step; auto: every step for the first `warmup` steps, then on a
    # schedule that keeps the measured cost of checks under `budget` of the measured step time;
    # off: never walk. Errors raised by backward itself are explained in every mode.
    check: str = "auto"
    # Anomaly mode, so that errors name the line that made the tensor at fault (slow: to debug).
    trace: bool = False
    # auto: steps checked from the start.
    warmup: int = 10
    # auto: the share of step time checks may take (0.25%: a check also slows the next steps a
    # little, as the walk evicts cached data they reload).
    budget: float = 0.0025
    # Checks turned off for the whole run, so that one false alarm never forces check=off:
    # reuse (a graph built before training), carried (a graph from an earlier step), consumed (a
    # graph an earlier backward freed, gradients present before backward), inplace (a saved tensor
    # an optimizer step changed, manual mode), leak (a graph alive after its step), unused (gradient
    # no optimizer uses). For one region of code: ``with trainer.guard.ignore("carried"): ...``.
    ignore: list[str] = field(default_factory=list)

    def problems(self) -> list[str]:
        out = _choice("guard.check", self.check, CHECKS) + _choice("guard.on_reuse", self.on_reuse, REUSE_POLICIES)
        listed = isinstance(self.ignore, (list, tuple))  # a str is one name, not a list of letters
        out += [f"guard.ignore: {name!r} is not one of {', '.join(GUARD_CHECKS)}"
                for name in (self.ignore if listed else ()) if name not in GUARD_CHECKS]
        out += mistyped(GuardSettings, {"trace": self.trace, "ignore": self.ignore}, "guard.")
        if not (isinstance(self.warmup, int) and not isinstance(self.warmup, bool) and self.warmup >= 0):
            out.append(f"guard.warmup must be an integer >= 0, got {self.warmup!r}")
        if not (_number(self.budget) and 0 < self.budget <= 1):
            out.append(f"guard.budget must be a number in (0, 1] (the share of step time checks may take; "
                       f"0.0025 is 0.25%), got {self.budget!r}")
        return out


@dataclass
class CheckpointSettings:
    """Checkpoints: ``Trainer(checkpoint={...})`` and the ``checkpoint`` group. They are written
    every ``every`` steps, at the end, and on SIGTERM/SIGINT (which finish the step, save and stop)."""

    # Steps between saves (null: only at the end and on SIGTERM/SIGINT).
    every: Optional[int] = 1000
    # The newest `keep` checkpoints are kept, older ones deleted.
    keep: int = 3
    # Where they go (null: <run dir>/checkpoints; no run dir: no checkpoints).
    dir: Optional[str] = None
    # A validation metric to rank them by (null: keep the newest): then a checkpoint is saved at every validation
    # too, the `keep` best by it are kept plus the newest (for resume), and best.txt names the best.
    monitor: Optional[str] = None
    # min | max: whether a lower or a higher `monitor` is better.
    mode: str = "min"
    # Under FSDP2 (trainer.strategy=fsdp): each rank writes its own shards (torch.distributed.checkpoint) into
    # step-N.shards/ next to step-N.pt, instead of rank zero writing full tensors. No effect otherwise.
    sharded: bool = False

    def problems(self) -> list[str]:
        return (_positive("checkpoint.every", self.every, optional=True) + _positive("checkpoint.keep", self.keep)
                + _choice("checkpoint.mode", self.mode, ("min", "max"))
                + mistyped(CheckpointSettings, {"dir": self.dir, "monitor": self.monitor, "sharded": self.sharded},
                           "checkpoint."))


PROFILE_KEYS = ("wait", "warmup", "active")  # torch.profiler.schedule's


def profile_problems(profile: Any) -> list[str]:
    """What is wrong with a ``profile`` setting: N > 0 steps, or a mapping of ``PROFILE_KEYS`` to integers
    (``active`` > 0, the others >= 0)."""
    if profile is None or (type(profile) is int and profile > 0):
        return []
    how = "give the number of steps to trace (profile=3), or {active: N, wait: W, warmup: U}, or null"
    if not isinstance(profile, Mapping):
        return [f"profile={profile!r}: {how}"]
    values = dict(profile.items())
    if set(values) - set(PROFILE_KEYS) or "active" not in values or not all(
            type(v) is int and v >= (key == "active") for key, v in values.items()):
        return [f"profile={values!r}: {how} (active > 0, the others >= 0)"]
    return []


def argument_problems(model: Any, train_data: Any, val_data: Any, loss_fn: Any = None, optimizer: Any = None,
                      scheduler: Any = None, config: Any = None) -> list[str]:
    """What is wrong with a Trainer's model, data, loss, optimizer, scheduler and config."""
    out = []
    if model is not None and not isinstance(model, torch.nn.Module):
        out.append(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if train_data is None:
        out.append("train_data is required: pass an iterable of batches (e.g. a DataLoader)")
    out += [found for name, data in (("train_data", train_data), ("val_data", val_data))
            if (found := samples_problem(name, data))]
    if isinstance(loss_fn, type):
        name = _typename(loss_fn)
        out.append(f"loss_fn={name} is a class, not a loss: give an instance, loss_fn={name}(), or a function such "
                   "as torch.nn.functional.mse_loss")
    if isinstance(scheduler, Mapping):
        scheduler = scheduler.get("scheduler")
    out += _call_problems("optimizer", optimizer, "the parameters") + _call_problems("scheduler", scheduler,
                                                                                      "the optimizer")
    return out + (plain_problems(config, "config") if isinstance(config, Mapping) else [])


def _call_problems(where: str, fn: Any, argument: str) -> list[str]:
    """What keeps ``fn`` (an optimizer or scheduler given as a callable, or a Hydra ``_partial_``) from being
    called with ``argument`` alone: a required argument it lacks, a ``functools.partial``'s value that does not
    fit its target's annotation (``lr='0.01'``)."""
    if not callable(fn) or isinstance(fn, torch.optim.Optimizer):
        return []
    out = []
    if isinstance(fn, functools.partial):  # a Hydra _partial_ holds a list as a ListConfig: checked as a list
        given = {key: list(value) if isinstance(value, Sequence) and not isinstance(value, (str, bytes)) else value
                 for key, value in fn.keywords.items()}
        out += mistyped(fn.func, given, f"{where}.")
    try:
        inspect.signature(fn).bind(None)
    except TypeError as err:
        name = _typename(fn.func if isinstance(fn, functools.partial) else fn)
        out.append(f"{where}: {name} cannot be called with {argument} alone ({err}): give it, e.g. "
                   f"functools.partial({name}, ...), or {where}.KEY=VALUE in a config")
    except ValueError:  # no signature to read (a builtin)
        pass
    return out


_PLAIN = (bool, int, float, complex, str, bytes, type(None))  # what torch.load(weights_only=True) reads


def plain_problems(value: Any, where: str) -> list[str]:
    """Each place in ``value`` holding anything but tensors, numbers, strings and lists, tuples and dicts of them:
    a checkpoint holding it could not be loaded (``torch.load(weights_only=True)``)."""
    if isinstance(value, torch.Tensor) or type(value) in _PLAIN:
        return []
    if type(value) in (dict, OrderedDict):
        return [p for key, item in value.items() for p in plain_problems(key, f"a key of {where}")
                + plain_problems(item, f"{where}[{key!r}]")]
    if type(value) in (list, tuple):
        return [p for i, item in enumerate(value) for p in plain_problems(item, f"{where}[{i}]")]
    return [f"{where}={_short(value)} is {_a(_typename(type(value)))}: checkpoints store config, and one holding "
            "this could not be loaded (torch.load(weights_only=True) reads tensors, numbers, strings, and lists, "
            "tuples and dicts of them); give a plain value (a name, a number) or leave it out"]


def model_problem(cls: type, base: type) -> str | None:
    """``model`` is None: the problem if ``cls`` keeps ``base``'s ``training_step`` or ``configure_optimizers``,
    which use it."""
    defaults = [m for m in ("training_step", "configure_optimizers") if getattr(cls, m) is vars(base)[m]]
    return f"model is None, and the default {' and '.join(defaults)} use self.model: pass model=..., or override " \
        "them" if defaults else None


def trainer_arguments(cls: type, base: type, given: Mapping[str, Any],
                      settings: Mapping[str, Any]) -> tuple[Settings, list[str]]:
    """The ``Settings`` of a Trainer of class ``cls`` made with the arguments ``given`` and the keyword ``settings``,
    and every problem with them (``base``: safeloop's Trainer, whose ``__init__`` annotates the arguments)."""
    out, found = read(Settings, settings, "Trainer", suggest=True)
    problems = argument_problems(*(given[k] for k in ("model", "train_data", "val_data", "loss_fn", "optimizer",
                                                      "scheduler", "config"))) + found
    problems += manual_problems(cls, base, given["val_data"], out)
    return out, problems + mistyped(base, {k: v for k, v in given.items() if v is not None and k != "model"})


def manual_problems(cls: type, base: type, val_data: Any, settings: Settings) -> list[str]:
    """What a Trainer class ``cls`` in manual mode (``automatic = False``) cannot do with these arguments (the
    default validation_step is ``base``'s)."""
    out = []
    if cls.automatic:
        return out
    if val_data is not None and cls.validation_step is base.validation_step:
        out.append("val_data is given, and in manual mode (automatic = False) the default validation_step "
                   "cannot re-run training_step (it calls self.backward and self.step): override "
                   "validation_step(batch) to return the validation loss(es), or drop val_data")
    if settings.loss_weights:
        out.append(f"loss_weights={dict(settings.loss_weights)!r} weights the losses an automatic "
                   "training_step returns; in manual mode (automatic = False) scale each loss "
                   "before self.backward(...) instead")
    if settings.grad_accum > 1:
        out.append(f"grad_accum={settings.grad_accum} groups micro-batches into the updates of an automatic "
                   "training_step; in manual mode (automatic = False) every self.step() updates: accumulate by "
                   "calling self.step(name) every N steps (the gradients no update applied are kept), dividing each "
                   "loss by N, as Lightning's manual optimization does")
    return out


def samples_problem(name: str, data) -> str | None:
    """A map-style Dataset or a tensor is a sequence of single samples: iterated, it would give unbatched steps."""
    if isinstance(data, torch.Tensor):
        return (f"{name} is a Tensor: iterated, it gives one unbatched row per step. Pass batches: "
                "DataLoader(TensorDataset(x, y), batch_size=..., shuffle=True) (from torch.utils.data)")
    # Lightning's several loaders: a list, or a dict by name given to test() or predict() (iterated, it would give
    # its names as batches; the Trainer's train_data and val_data refuse a dict by their annotation)
    loaders = data if isinstance(data, (list, tuple)) else list(data.values()) if isinstance(data, Mapping) and \
        name in ("test data", "predict data") else ()
    if loaders and all(isinstance(d, torch.utils.data.DataLoader) for d in loaders):
        each = {"val_data": "; for a metric of each (Lightning's dataloader_idx): val_data=the first, and in "
                            "on_validation_end(metrics), metrics['val_other'] = self.test(other)['test_loss']",
                "test data": "; for the metrics of each, as Lightning's loaders give them: trainer.test(loader) for "
                             "each loader",
                "predict data": "; for the predictions of each, as Lightning's loaders give them: "
                                "trainer.predict(loader) for each loader"}
        return (f"{name} is a {type(data).__name__} of {len(data)} DataLoaders: safeloop reads one iterable of "
                "batches. For one loader over them all: DataLoader(ConcatDataset([...]), ...) (torch.utils.data)"
                + each.get(name, ""))
    if not isinstance(data, torch.utils.data.Dataset) or isinstance(data, torch.utils.data.IterableDataset):
        return None
    one = "each step would train on one unbatched sample" if name == "train_data" else "each batch would be one sample"
    return (f"{name} is a {type(data).__name__}, a Dataset of single samples: {one}. Pass DataLoader(dataset, "
            "batch_size=..., shuffle=True) (from torch.utils.data); if each item already is a whole batch, "
            "DataLoader(dataset, batch_size=None)")


# The defaults, for signatures: ``max_steps: int | None = DEFAULTS.max_steps``. Read them, never change them.
DEFAULTS = Settings()
GUARD_DEFAULTS = GuardSettings()


def attach(cls: type, made: tuple[str, ...] = ()) -> None:
    """Make ``Settings`` the keyword arguments and attributes of ``cls`` (the Trainer), which keeps them in
    ``self.settings`` and takes them as ``**settings``: its signature lists each with its default (what
    ``help()`` and notebooks show), and each is a property reading and writing ``self.settings``
    (``trainer.max_steps = 500`` before a later ``fit()``), but those in ``made``, whose attribute holds
    what ``cls`` made of them (``trainer.device`` is a ``torch.device``)."""
    own = inspect.signature(cls.__init__)
    params = [p for p in own.parameters.values() if p.kind is not p.VAR_KEYWORD]
    params += [inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=getattr(DEFAULTS, f.name),
                                 annotation=f.type) for f in fields(Settings)]
    cls.__init__.__signature__ = own.replace(parameters=params)
    for name in names(Settings):
        if name not in made:
            setattr(cls, name, property(lambda self, n=name: getattr(self.settings, n),
                                        lambda self, value, n=name: setattr(self.settings, n, value),
                                        doc=f"``self.settings.{name}`` (see ``safeloop.settings.Settings``)"))


def names(cls) -> list[str]:
    """The settings ``cls`` holds, in order."""
    return [f.name for f in fields(cls)]


# Lightning Trainer arguments a port may pass, and safeloop's way (docs/trainer.md, Coming from Lightning)
LIGHTNING_SETTINGS = {
    "accumulate_grad_batches": "grad_accum", "gradient_clip_val": "grad_clip (the norm)",
    "gradient_clip_algorithm": "grad_clip is the norm; for 'value', torch.nn.utils.clip_grad_value_ in "
                               "on_before_optimizer_step",
    "val_check_interval": "val_every=N (optimizer steps, counted across passes; a fraction f of a pass is "
                          "int(f * len(train_data)) batches, divided by grad_accum)",
    "check_val_every_n_epoch": "val_every=k * steps per pass (math.ceil(len(train_data) / grad_accum))",
    "limit_train_batches": "train_data=an object whose __iter__ returns itertools.islice(loader, N) and __len__ N",
    "limit_val_batches": "val_data=itertools.islice(loader, N) as a list, or such an object",
    "log_every_n_steps": "log_every", "detect_anomaly": "guard={'trace': True}", "enable_progress_bar": "progress",
    "default_root_dir": "run_dir", "max_time": "a callback calling trainer.request_stop(reason) when the time is up",
    "accelerator": "device ('cpu', 'cuda', 'auto')", "devices": "launch with torchrun --nproc-per-node=N",
    "num_nodes": "launch with torchrun --nnodes=N", "logger": "loggers", "enable_checkpointing": "checkpoint=False",
    "reload_dataloaders_every_n_epochs": "set self.train_data in on_epoch_start",
    # not max_epochs / max_steps, which the closest names would suggest: those are the most, these the least
    **dict.fromkeys(("min_epochs", "min_steps"),
                    "no minimum: a stop asked for (EarlyStopping, request_stop) ends the run after that step, however "
                    "early. Leave it out where no stop can come before it (min_epochs=1 with validation at each "
                    "pass's end or less often); max_epochs and max_steps are the most, not the least"),
    "num_sanity_val_steps": "no setting: with val_data, a whole validation runs before the first step (logged at "
                            "step 0; EarlyStopping, checkpoint.monitor and a plateau scheduler only check there that "
                            "their metric is reported)",
    "limit_test_batches": "trainer.test(itertools.islice(loader, N)) (a fraction f: N = int(f * len(loader)))",
    "limit_predict_batches": "trainer.predict(itertools.islice(loader, N)) (a fraction f: N = int(f * len(loader)))",
    "fast_dev_run": "max_steps=N, val_data=list(itertools.islice(loader, N)), checkpoint=False, loggers=[] "
                    "(True: N=1)",
    "overfit_batches": "train_data=batches and val_data=batches, batches = list(itertools.islice(loader, N)) of a "
                       "loader without shuffle",
    "profiler": "profile=N (a torch.profiler trace of N steps in run_dir)",
    "inference_mode": "validation, test and predict run under torch.no_grad() (Lightning's inference_mode=False)",
    "benchmark": "set torch.backends.cudnn.benchmark before fit()",
    "sync_batchnorm": "model = torch.nn.SyncBatchNorm.convert_sync_batchnorm(model) before making the Trainer",
    "enable_model_summary": "no summary is printed: leave it out",
    "plugins": "precision=... (a MixedPrecision plugin's), and configure_grad_scaler() returning its GradScaler",
    "barebones": "progress=False, loggers=[], checkpoint=False",
}


def read(cls, values: Mapping[str, Any], section: str, suggest: bool = False) -> tuple[Any, list[str]]:
    """``cls(**values)`` from a mapping (``guard={...}``), and every problem with it: each key that
    is no setting (``suggest``: with the closest setting's name; a Lightning Trainer argument: with safeloop's
    way), each bad value."""
    known = names(cls)
    unknown = [f"{section} has no setting {key!r}: that is Lightning's; here: {LIGHTNING_SETTINGS[key]}"
               if cls is Settings and key in LIGHTNING_SETTINGS else
               f"{section} has no setting {key!r}: use {', '.join(known)}" + (_did_you_mean(key, known) if suggest
                                                                              else "")
               for key in values if key not in known]
    settings = cls(**{key: value for key, value in values.items() if key in known})
    return settings, unknown + settings.problems()


def _did_you_mean(key: str, known: list[str]) -> str:
    close = difflib.get_close_matches(str(key), known, n=1, cutoff=0.6)
    return f" (did you mean {close[0]}?)" if close else ""


def mistyped(call, values: Mapping[str, Any], prefix: str = "") -> list[str]:
    """A problem for each of ``values`` that does not fit its annotation in ``call`` (a function, a
    class, a settings dataclass), named by ``prefix`` + key. An int fits a float, a path a str, a
    list a tuple, any iterable a list and any mapping a dict; annotations that cannot be read are
    not checked."""
    try:
        hints = get_type_hints(call.__init__ if isinstance(call, type) and not hasattr(call, "__dataclass_fields__")
                               else call)
    except Exception:  # an annotation naming something not importable here: nothing to check against
        return []
    out = []
    for key, value in values.items():
        found = _misfit(value, hints[key], f"{prefix}{key}") if key in hints else None
        if found:
            where, item, hint = found
            out.append(f"{where}={_short(item)} is {_a(type(item).__name__)}; give {_describe(hint)}")
    return out


def _misfit(value: Any, hint: Any, where: str) -> tuple[str, Any, Any] | None:
    """Where ``value`` does not fit ``hint`` (the innermost item, its value and its expected type), or None."""
    origin, args = get_origin(hint), get_args(hint)
    if hint is Any:
        return None
    if origin in (Union, types.UnionType):
        fits = [a for a in args if _fits_outside(value, a)]
        return _misfit(value, fits[0], where) if fits else (where, value, hint)
    if origin is Literal:
        return None if value in args else (where, value, hint)
    if not _fits_outside(value, hint):
        return (where, value, hint)
    if isinstance(value, Mapping) and len(args) == 2:
        for key, item in value.items():
            found = _misfit(key, args[0], f"{where} key") or _misfit(item, args[1], f"{where}[{key!r}]")
            if found:
                return found
    elif isinstance(value, (list, tuple)) and args and origin is not Callable:
        items = args if origin is tuple and Ellipsis not in args else [args[0]] * len(value)
        if len(items) != len(value):
            return (where, value, hint)
        for i, (item, item_hint) in enumerate(zip(value, items)):
            if found := _misfit(item, item_hint, f"{where}[{i}]"):
                return found
    return None


def _fits_outside(value: Any, hint: Any) -> bool:
    """Whether ``value`` is of ``hint``'s outer type (its items are checked by ``_misfit``)."""
    if hint is None or hint is type(None):
        return value is None
    origin = get_origin(hint) or hint
    if origin in (Union, types.UnionType, Literal):
        return _misfit(value, hint, "") is None
    if origin is Callable:
        return callable(value)
    if origin is float:
        return _number(value)
    if origin is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if origin is str:
        return isinstance(value, (str, os.PathLike))
    if origin is tuple:
        return isinstance(value, (list, tuple))
    if origin in (list, Iterable):  # any iterable of items (loggers={"csv"}); not a string's letters, a dict's keys
        return isinstance(value, Iterable) and not isinstance(value, (str, bytes, Mapping))
    if origin is dict:
        return isinstance(value, Mapping)
    return not isinstance(origin, type) or isinstance(value, origin)  # a TypeVar, a name not resolved: not checked


def _describe(hint: Any) -> str:
    """``hint`` in words: "a number or None", "a list[str]", "a Callback"."""
    origin, args = get_origin(hint), get_args(hint)
    if origin in (Union, types.UnionType):
        words = [_describe(a) for a in args]
        return ", ".join(words[:-1]) + " or " + words[-1]
    if origin is Literal:
        return " or ".join(repr(a) for a in args)
    words = {float: "a number", int: "an integer", bool: "True or False", str: "a string", type(None): "None"}
    if hint in words or hint is None:
        return words.get(hint, "None")
    return "a callable" if (origin or hint) is Callable else _a(_typename(hint))


def _typename(hint: Any) -> str:
    origin, args = get_origin(hint) or hint, get_args(hint)
    if origin in (Union, types.UnionType):
        return " | ".join(_typename(a) for a in args)
    name = "Any" if hint is Any else getattr(origin, "__name__", str(origin))
    return name + (f"[{', '.join('...' if a is Ellipsis else _typename(a) for a in args)}]" if args else "")


def _a(name: str) -> str:
    return ("an " if name[:1].lower() in "aeiou" else "a ") + name


def _short(value: Any, n: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= n else text[:n - 3] + "..."


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _positive(key: str, value: Any, optional: bool = False) -> list[str]:
    if (value is None and optional) or (isinstance(value, int) and not isinstance(value, bool) and value > 0):
        return []
    fraction = key == "val_every" and isinstance(value, float) and 0 < value < 1
    return [f"{key} must be a positive integer, got {value!r}" + (
        ": it counts optimizer steps, not a fraction of a pass (Lightning's val_check_interval): give "
        "val_every=math.ceil(f * len(train_data) / grad_accum)" if fraction else "")]


def _choice(key: str, value: Any, choices: tuple[str, ...]) -> list[str]:
    return [] if value in choices else [f"{key}={value!r} is not one of {', '.join(choices)}"]

