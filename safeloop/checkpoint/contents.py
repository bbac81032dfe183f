"""What a checkpoint holds (``Trainer.state_dict`` / ``load_state_dict``): collected from the Trainer's parts, and
loaded back into them only once all of it is checked to fit, so that a checkpoint that does not fit changes nothing."""
from __future__ import annotations

import inspect
import logging
import warnings
from collections import Counter, OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from lightning_utilities.core.apply_func import apply_to_collection

from .. import fsdp
from ..errors import CheckpointError, ConfigError, ConfigWarning, user_stacklevel
from ..state import TrainState
from . import position
from .files import FORMAT, check_payload, gradient_sets, is_rank_zero, named

log = logging.getLogger("safeloop")


@dataclass
class Parts:
    """What a checkpoint holds, as the Trainer hands it down: its modules (``Trainer.modules()``) and their
    named parameters, optimizers, schedulers, grad scaler, ``TrainState``, ``TrainData`` (where the data
    stands), and, under torchrun, ``gather``: the ``Distributed`` whose ranks' random states and gradients differ."""

    modules: dict[str, torch.nn.Module]
    parameters: list[tuple[str, torch.nn.Parameter]]
    optimizers: dict[str, torch.optim.Optimizer]
    schedulers: dict[str, Any]
    scaler: Any
    state: TrainState
    data: Any
    gather: Any = None
    sharded: bool = False  # checkpoint.sharded: FSDP2's DTensors kept as they are (each rank writes its shards)
    applied: frozenset[int] = frozenset()  # ids of the parameters whose gradients an update already applied
    configured: dict | None = None  # the optimizers' settings as configure_optimizers made them (Schedules)
    rng: dict | None = None  # the random state the next step starts from, where not the process's (one loaded)


OUTSIDE = "outside_modules"  # the module name under which the parameters trained outside Trainer.modules() are saved


def read_modules(modules: Callable[[], dict[str, torch.nn.Module]]) -> dict[str, torch.nn.Module]:
    """``Trainer.modules()``: an attribute it reads that is not there yet (read first at set-up) is explained."""
    try:
        return modules()
    except AttributeError as err:
        raise ConfigError(
            f"Trainer.modules() raised AttributeError: {err}. It is read before on_fit_start (as fit() sets up, and "
            "to load a checkpoint with resume=): make the modules it returns in __init__, not in on_fit_start") from err


def named_parameters(modules: Callable[[], dict[str, torch.nn.Module]]) -> list[tuple[str, torch.nn.Parameter]]:
    """The parameters of ``Trainer.modules()``, as ``module.parameter``."""
    return [(f"{m}.{n}", p) for m, module in read_modules(modules).items() for n, p in module.named_parameters()]


def with_outside(modules: dict[str, torch.nn.Module], parameters: list[tuple[str, torch.nn.Parameter]],
                 optimizers: dict[str, torch.optim.Optimizer]) -> tuple[dict, list]:
    """``modules`` and their named ``parameters``, plus the tensors an optimizer trains that no module of them holds
    (SAC's ``log_alpha``, a discriminator kept on the Trainer), as the module ``OUTSIDE``: each under
    ``optimizer:group:index``, so that checkpoints save and restore them as the modules' parameters."""
    inside, found = {id(p) for _, p in parameters}, {}
    for name, opt in optimizers.items():
        for g, group in enumerate(opt.param_groups):
            for i, p in enumerate(group["params"]):
                if id(p) not in inside:
                    inside.add(id(p))
                    found[f"{name}:{g}:{i}"] = p
    if not found:
        return modules, parameters
    outside = torch.nn.Module()
    for key, p in found.items():
        outside.register_buffer(key, p)  # the tensor itself: loading copies into it
    return {**modules, OUTSIDE: outside}, parameters + [(f"{OUTSIDE}.{key}", p) for key, p in found.items()]


def collect(parts: Parts, config: dict | None) -> dict:
    """A checkpoint of ``parts``: tensors and plain containers only, so that it loads with
    ``torch.load(weights_only=True)``. ``gradients`` are those the last step left on the parameters (manual
    mode accumulating over steps); under torchrun their mean over the ranks, and each rank's in
    ``rank_gradients``, with each rank's random state in ``rank_rng`` and where its data stands in ``rank_data``
    (gathered: every rank must call this). Under FSDP2 the full tensors, gathered from every rank's shards (also a
    collective call), unless ``parts.sharded``; an optimizer that shards its state, gathered too
    (``optimizer_state``)."""
    full = (lambda value: value) if parts.sharded else fsdp.full
    checkpoint = {
        "format": FORMAT,
        "step": parts.state.step,
        "modules": {name: full(module.state_dict()) for name, module in parts.modules.items()},
        "optimizers": {name: numbers(full(optimizer_state(opt))) for name, opt in parts.optimizers.items()},
        "inner_optimizers": {name: {attr: numbers(full(inner.state_dict()))
                                    for attr, inner in inner_optimizers(opt).items()}
                             for name, opt in parts.optimizers.items()},
        "optimizer_generators": {name: {attr: g.get_state() for attr, g in generators(opt).items()}
                                 for name, opt in parts.optimizers.items()},
        "optimizer_classes": optimizer_classes(parts.optimizers),
        "configured": parts.configured,
        "schedulers": {name: numbers(sched.state_dict()) for name, sched in parts.schedulers.items()},
        "scaler": parts.scaler.state_dict() if parts.scaler is not None else None,
        "state": parts.state.state_dict(),
        "rng": parts.rng if parts.rng is not None else position.rng_state(),
        "data": parts.data.state_dict(),
        "gradients": {name: full(p.grad.detach()) for name, p in parts.parameters
                      if p.grad is not None and id(p) not in parts.applied},
        "config": config,
    }
    check_schedulers_plain(checkpoint["schedulers"])
    if parts.gather is not None:  # one collective call: each rank's random state, data position and (DDP) gradients
        sharded = parts.gather.sharded  # FSDP2's gradients are the ranks' mean already
        grads = {} if sharded else {name: grad.cpu() for name, grad in checkpoint["gradients"].items()}
        every = parts.gather.gather((checkpoint["rng"], checkpoint["data"], grads))
        checkpoint["rank_rng"] = [rng for rng, _, _ in every]
        # each rank's data state: the generators its data keeps may be seeded per rank (MONAI's Randomizable)
        checkpoint["rank_data"] = [data for _, data, _ in every]
        if not sharded:
            checkpoint["rank_gradients"] = [grads for _, _, grads in every]
            checkpoint["gradients"] = mean_gradients(checkpoint["rank_gradients"])
    return checkpoint


def numbers(state: dict) -> dict:
    """``state`` with NumPy scalars as Python numbers: ``param_group["lr"] = schedule[it]`` (DINO's schedules are
    NumPy arrays) puts a ``numpy.float64`` in an optimizer's state, which ``torch.load(weights_only=True)`` refuses."""
    return state if position.np is None else apply_to_collection(state, position.np.generic, lambda x: x.item())


def optimizer_state(optimizer: torch.optim.Optimizer) -> dict:
    """``optimizer.state_dict()``. An optimizer that shards its state over the ranks (``ZeroRedundancyOptimizer``)
    gathers it first to rank zero, which alone writes checkpoints: ``consolidate_state_dict()``, a collective call
    that every rank makes, as Lightning's ``Strategy.optimizer_state`` does. The other ranks hold an empty dict for it
    (the full state on every rank is the memory such an optimizer saves)."""
    if not shards_state(optimizer):
        return optimizer.state_dict()
    optimizer.consolidate_state_dict()
    return optimizer.state_dict() if is_rank_zero() else {}


def shards_state(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer`` keeps its state in shards over the ranks, gathered by ``consolidate_state_dict()``
    (``torch.distributed.optim.ZeroRedundancyOptimizer``, fairscale's ``OSS``)."""
    return callable(getattr(optimizer, "consolidate_state_dict", None))


def inner_optimizers(optimizer: torch.optim.Optimizer) -> dict[str, torch.optim.Optimizer]:
    """The optimizers ``optimizer`` wraps, by attribute (SAM's ``base_optimizer``, Lookahead's): a wrapper's
    ``state_dict()`` may leave their state out (SAM's holds its own ``old_p`` only, not the base SGD's momentum), so
    checkpoints keep theirs too, as the undo snapshots them. None of one that shards its state (``optimizer_state``):
    its inner optimizer holds this rank's share, which the gathered state holds with the others'."""
    if shards_state(optimizer):
        return {}
    return {attr: inner for attr, inner in vars(optimizer).items()
            if isinstance(inner, torch.optim.Optimizer) and inner is not optimizer}


def wrapped(optimizers: dict[str, torch.optim.Optimizer], checkpoint: dict) -> tuple[dict, dict]:
    """The inner optimizers of ``optimizers`` that ``checkpoint`` holds a state for, and those states, each named
    ``optimizer.attribute`` (none in a checkpoint of an earlier safeloop)."""
    saved, inner, states = checkpoint.get("inner_optimizers", {}), {}, {}
    for name, wrapper in optimizers.items():
        for attr, opt in inner_optimizers(wrapper).items():
            if attr in saved.get(name, {}):
                inner[f"{name}.{attr}"], states[f"{name}.{attr}"] = opt, saved[name][attr]
    return inner, states


def generators(optimizer: torch.optim.Optimizer) -> dict[str, torch.Generator]:
    """The random generators an optimizer keeps as attributes (AdaHessian's, for its Rademacher draws): its
    ``state_dict()`` leaves them out, so checkpoints keep their states, for a resumed run to draw as the straight
    run does."""
    return {attr: g for attr, g in vars(optimizer).items() if isinstance(g, torch.Generator)}


SCHEDULERS = (torch.optim.lr_scheduler.LRScheduler, torch.optim.lr_scheduler.ReduceLROnPlateau)


def attributes(trainer: Any) -> dict[str, Any]:
    """What a Trainer keeps that a checkpoint may miss, by the name a warning gives it: its own attributes
    (``trainer.ema``) and its callbacks' (``ModelEma.ema``: timm's EMA kept by a callback)."""
    return {**{f"trainer.{k}": v for k, v in vars(trainer).items()},
            **{f"{type(cb).__name__}.{k}": v for cb in trainer.callbacks for k, v in vars(cb).items()}}


def versions(attributes: dict[str, Any]) -> dict[int, int]:
    """The version counter of each tensor ``kept`` among ``attributes`` (``attributes()``), and where each scheduler
    among them stands (``last_epoch``), by ``id``."""
    return {**{id(t): t._version for value in attributes.values() for t in kept(value)},
            **{id(value): value.last_epoch for value in attributes.values() if isinstance(value, SCHEDULERS)}}


def kept(value: Any) -> list[torch.Tensor]:
    """The tensors a Trainer's attribute holds: a module's parameters and buffers, a tensor, or those of the modules
    and tensors in a list, tuple or dict (guided diffusion's list of EMA parameters)."""
    if isinstance(value, torch.nn.Module):
        return [*value.parameters(), *value.buffers()]
    if isinstance(value, torch.Tensor):
        return [value]
    items = value.values() if type(value) is dict else value if type(value) in (list, tuple) else ()
    return [t for item in items if isinstance(item, (torch.nn.Module, torch.Tensor)) for t in kept(item)]


def warn_unsaved(attributes: dict[str, Any], checkpoint: dict, before: dict[int, int] | None) -> None:
    """A ``ConfigWarning`` for each of ``attributes`` (``attributes()``) that changed during the fit and none of whose
    tensors ``checkpoint`` holds: a run resumed from it would start it from its first values (Lightning saves every
    submodule). Changed: a module made since ``before`` (``versions`` at the fit's first step) or written since (an
    EMA copy, a target network; not a frozen teacher), a tensor, or a list or dict of them, written in place since
    (JEM's replay buffer), not one replaced (an output kept for logging). Nothing before a fit (``before`` None)."""
    if before is None:
        return
    held: set[int | None] = set()
    apply_to_collection(checkpoint, torch.Tensor, lambda t: held.add(_storage(t)))
    states = _scheduler_states(checkpoint)
    for name, value in attributes.items():
        owner, attr = name.split(".", 1)
        if isinstance(value, SCHEDULERS) and value.last_epoch != before.get(id(value), 0) and not any(
                state.keys() == value.state_dict().keys() and state["last_epoch"] == value.last_epoch
                for state in states):
            warnings.warn(f"{name} ({type(value).__name__}) stepped during this fit, and checkpoints do not "
                          "hold its state: a run resumed from one would start its schedule again. Save its "
                          f"state_dict() in on_save_checkpoint (checkpoint[{attr!r}] = self.{attr}.state_dict()) "
                          "and load it in on_load_checkpoint, or give it to the Trainer from configure_optimizers",
                          ConfigWarning, stacklevel=user_stacklevel())
            continue
        tensors, module = kept(value), isinstance(value, torch.nn.Module)
        changed = any(before[id(t)] != t._version if id(t) in before else module for t in tensors)
        if not changed or any(fsdp.local(t) is not t for t in tensors) or any(_storage(t) in held for t in tensors):
            continue  # unchanged, sharded (a checkpoint holds its gathered copy), or saved
        fix = (f"Save its state_dict() in {owner}'s on_save_checkpoint(trainer, checkpoint) and load it in its "
               "on_load_checkpoint" if owner != "trainer" else
               f"Return it from modules() ({{**super().modules(), {attr!r}: self.{attr}}}), or save its state_dict() "
               "in on_save_checkpoint" if module else
               f"Save it in on_save_checkpoint (checkpoint[{attr!r}] = self.{attr}) and put it back in "
               "on_load_checkpoint")
        warnings.warn(f"{name} ({type(value).__name__}) changed during this fit, and checkpoints do not hold "
                      f"it: a run resumed from one would start it from its first values. {fix}", ConfigWarning,
                      stacklevel=user_stacklevel())


def _scheduler_states(value: Any) -> list[dict]:
    """The dicts in ``value`` that may be a scheduler's state (they hold a ``last_epoch``)."""
    if isinstance(value, dict):
        own = [value] if "last_epoch" in value else []
        return own + [state for item in value.values() for state in _scheduler_states(item)]
    if isinstance(value, (list, tuple)):
        return [state for item in value for state in _scheduler_states(item)]
    return []


def _storage(tensor: torch.Tensor) -> int | None:
    """Where ``tensor``'s memory is (a state dict's tensors share their parameters'), if it is a dense tensor."""
    tensor = fsdp.local(tensor)
    return tensor.untyped_storage().data_ptr() if tensor.layout == torch.strided else None


def restore(parts: Parts, checkpoint: dict, path: Path | None, dist) -> None:
    """Load ``checkpoint`` into ``parts`` once it is checked to fit them all (``dist``: under torchrun, whose
    rank's saved gradients to take). The global RNG states are not set here (see ``Trainer.load_state_dict``)."""
    check_payload(checkpoint, path)
    check_fits(parts.modules, parts.parameters, parts.optimizers, parts.schedulers, parts.scaler, checkpoint, path)
    if fsdp.SHARDS in checkpoint:  # checkpoint.sharded: the tensors are in the shard directory next to the file
        if path is None:
            raise CheckpointError("this checkpoint keeps its tensors in a shard directory next to its file: "
                                  "load_state_dict(checkpoint, path) needs the file's path", path)
        checkpoint = fsdp.join(checkpoint, Path(path).parent / checkpoint[fsdp.SHARDS]["dir"], _live(parts))
    # the data iterable's own load_state_dict first: if it refuses the state, nothing else has changed
    parts.data.load_state_dict(data_for(checkpoint, dist))
    load_modules(parts.modules, checkpoint)
    load_gradients(parts.parameters, gradients_for(checkpoint, dist))
    # a wrapper's inner optimizers first: its own load_state_dict may link their param_groups to its (SAM's)
    inner, states = wrapped(parts.optimizers, checkpoint)
    load_named("optimizer", inner, {key: fsdp.optimizer_shards(inner[key], state) for key, state in states.items()},
               path)
    load_optimizers(parts.optimizers, checkpoint, path, parts.configured)
    for name, states in checkpoint.get("optimizer_generators", {}).items():  # none before they were saved
        for attr, generator in generators(parts.optimizers[name]).items():
            if attr in states:
                generator.set_state(states[attr])
    log_scheduler_settings(parts.schedulers, checkpoint["schedulers"], path)
    load_named("scheduler", parts.schedulers, checkpoint["schedulers"], path)
    load_scaler(parts.scaler, checkpoint["scaler"])
    parts.state.load_state_dict(checkpoint["state"])
    parts.data.warn_workers()
    if parts.state.step:  # what torch's "lr_scheduler.step() before optimizer.step()" warning looks at
        for opt in parts.optimizers.values():
            opt._opt_called = True


def _live(parts: Parts) -> Callable[[tuple[str, ...]], torch.Tensor | None]:
    """The tensor each entry of a checkpoint is loaded into (``fsdp.join``), by its path in the checkpoint: a module's
    state, an optimizer's state (as its parameter holds it), a parameter's gradient."""
    found: dict[tuple[str, ...], torch.Tensor] = {}
    for name, module in parts.modules.items():
        found.update((("modules", name, key), value) for key, value in module.state_dict().items())
    for name, opt in parts.optimizers.items():
        params = [p for g in opt.param_groups for p in g["params"]]
        found.update((("optimizers", name, "state", str(i)), p) for i, p in enumerate(params))
    found.update((("gradients", name), p) for name, p in parts.parameters)
    return lambda path: found.get(path[:4] if path[0] == "optimizers" else path)


# -- loading, piece by piece --------------------------------------------------------------------
def check_fits(modules: dict[str, torch.nn.Module], parameters: list[tuple[str, torch.nn.Parameter]],
               optimizers: dict[str, torch.optim.Optimizer], schedulers: dict, scaler, checkpoint: dict,
               path: Path | None) -> None:
    """Raise the ``CheckpointError`` that loading ``checkpoint`` would raise part way, before anything is
    loaded: a checkpoint that does not fit leaves the modules, the optimizers and the rest as they were."""
    check_modules(modules, parameters, checkpoint, path)
    check_optimizers(optimizers, checkpoint, path, {id(p): name for name, p in parameters})
    inner, saved = wrapped(optimizers, checkpoint)
    check_optimizers(inner, {"optimizers": saved}, path, {id(p): name for name, p in parameters})
    check_names("scheduler", schedulers, checkpoint["schedulers"], path)
    check_schedulers(schedulers, checkpoint["schedulers"], path)
    check_scaler(scaler, checkpoint["scaler"], path)


def check_modules(modules: dict[str, torch.nn.Module], parameters: list[tuple[str, torch.nn.Parameter]],
                  checkpoint: dict, path: Path | None) -> None:
    """The modules' state dicts, and the gradients saved for their parameters, fit ``modules``."""
    theirs = checkpoint["modules"]
    problems = [f"the Trainer has no module {name!r} (see Trainer.modules())" for name in theirs
                if name not in modules]
    problems += [f"the checkpoint has no state for the Trainer's module {name!r}" for name in modules
                 if name not in theirs and name != OUTSIDE]
    for name in modules.keys() & theirs.keys():
        problems += _mismatch(name, modules[name].state_dict(), theirs[name])
    live = dict(parameters)
    for where, grads in gradient_sets(checkpoint):
        problems += [f"{where}[{name!r}] names no parameter of the Trainer's modules" for name in grads
                     if name not in live]
        problems += [f"{where}[{name!r}] has shape {tuple(grad.shape)} and the parameter {tuple(live[name].shape)}"
                     for name, grad in grads.items() if name in live and grad.shape != live[name].shape]
    if problems:
        raise CheckpointError(f"{named(path)} was saved from a different model: " + "; ".join(problems)
                              + ". Resume with the model configuration it was saved with" + _saved_model(checkpoint),
                              path)


def load_modules(modules: dict[str, torch.nn.Module], checkpoint: dict) -> None:
    """Load the saved state dicts into ``modules`` (``Trainer.modules()``; ``check_fits`` first)."""
    for name, module in modules.items():
        if name == OUTSIDE and name not in checkpoint["modules"]:
            log.warning("resume: the checkpoint holds no parameters trained outside Trainer.modules() (%s): an earlier "
                        "safeloop did not save them; they start from their values at this run's start",
                        ", ".join(name for name, _ in module.named_buffers()))
            continue
        module.load_state_dict(fsdp.shards(module, checkpoint["modules"][name]))


def load_gradients(parameters: list[tuple[str, torch.nn.Parameter]], saved: dict) -> None:
    """Put back the gradients a step left on the parameters for a later one (manual mode accumulating over
    several steps; ``check_fits`` first); every other parameter's gradient is None, as after the step."""
    for name, p in parameters:
        grad = saved.get(name)
        p.grad = None if grad is None else fsdp.like(grad.to(device=p.device, dtype=p.dtype), p)


def mean_gradients(every: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """The ranks' gradients averaged as the all-reduce averages them: a rank without one counts as zeros."""
    total: dict[str, torch.Tensor] = {}
    for grads in every:
        for name, grad in grads.items():
            total[name] = total[name] + grad if name in total else grad.clone()
    return {name: grad.div_(len(every)) for name, grad in total.items()}


def _own(checkpoint: dict, key: str, dist) -> Any:
    """This rank's entry of ``checkpoint[key]`` (one per rank) when the checkpoint was written by as many ranks;
    None otherwise (one process, another number of ranks, a checkpoint written before the entry was saved)."""
    every = checkpoint.get(key)
    if every is not None and dist is not None and len(every) == dist.world:
        return every[dist.rank]
    return None


def rng_for(checkpoint: dict, dist) -> dict:
    """The random state this process resumes with: its own rank's when the checkpoint was written by as many
    ranks (a rank seeded apart, as nanoGPT seeds each, draws its own dropout masks on), else the checkpoint's
    ``rng`` (rank zero's)."""
    own = _own(checkpoint, "rank_rng", dist)
    return own if own is not None else checkpoint["rng"]


def data_for(checkpoint: dict, dist) -> dict:
    """Where this process's data resumes: its own rank's when the checkpoint was written by as many ranks (a
    transform's own generator seeded per rank draws its own augmentations on), else the checkpoint's ``data``
    (rank zero's)."""
    own = _own(checkpoint, "rank_data", dist)
    return own if own is not None else checkpoint["data"]


def gradients_for(checkpoint: dict, dist) -> dict[str, torch.Tensor]:
    """The gradients this process resumes with: its own rank's when the checkpoint was written by as many
    ranks (bit-identical), else the checkpoint's ``gradients`` (under torchrun, the ranks' mean: the same
    update up to the summation order)."""
    own = _own(checkpoint, "rank_gradients", dist)
    return own if own is not None else checkpoint.get("gradients", {})


def check_names(kind: str, live: dict, saved: dict, path: Path | None) -> None:
    if live.keys() != saved.keys():
        raise CheckpointError(f"{named(path)} has {kind}s {sorted(saved)} but this run has {sorted(live)}: "
                              f"resume with the same configure_{kind}s", path)


def load_named(kind: str, live: dict, saved: dict, path: Path | None) -> None:
    """Load optimizers' or schedulers' state dicts by name (``check_fits`` first)."""
    for name, obj in live.items():
        try:
            obj.load_state_dict(saved[name])
        except (ValueError, KeyError, RuntimeError) as err:
            raise CheckpointError(f"{named(path)}: {kind} {name!r} does not fit this run's ({err})", path) from None


def optimizer_classes(optimizers: dict[str, torch.optim.Optimizer]) -> dict[str, str]:
    """What a checkpoint records of each optimizer besides its state: its class."""
    return {name: _class_name(type(opt)) for name, opt in optimizers.items()}


def check_optimizers(optimizers: dict[str, torch.optim.Optimizer], checkpoint: dict, path: Path | None,
                     names: dict[int, str] | None = None) -> None:
    """Each optimizer is of the class it was saved from, with as many parameters in each group, each of a shape
    its saved state fits (its own, one broadcast to it, or one vector over all the parameters) (``names``: the
    parameters' names by ``id``, for the message)."""
    saved, classes = checkpoint["optimizers"], checkpoint.get("optimizer_classes") or {}
    check_names("optimizer", optimizers, saved, path)
    for name, opt in optimizers.items():
        mine, was = _class_name(type(opt)), classes.get(name)
        groups = saved[name]["param_groups"]
        keys = {k for g in groups for k in g} - {"params"}, {k for g in opt.param_groups for k in g} - {"params"}
        if (was is not None and was != mine) or (was is None and groups and keys[0] != keys[1]):
            raise CheckpointError(
                f"{named(path)}: optimizer {name!r} was saved from "
                f"{was or 'an optimizer with the settings ' + ', '.join(sorted(keys[0]))} "
                f"and this run's is {mine}: an optimizer's state does not carry over to another class. Resume with "
                f"the optimizer it was saved with, or start a new run without resume", path)
        sizes = [len(g["params"]) for g in groups], [len(g["params"]) for g in opt.param_groups]
        if sizes[0] != sizes[1]:
            added = len(sizes[0]) > len(sizes[1]) and sizes[0][:len(sizes[1])] == sizes[1]
            raise CheckpointError(
                f"{named(path)}: optimizer {name!r} does not fit this run's (parameters per group: {sizes[0]} saved, "
                f"{sizes[1]} now): " + ("its last groups were added during the run (add_param_group: unfreezing at "
                                        "a milestone, as Lightning's BaseFinetuning does). Add them again before the "
                                        "state is loaded: override load_state_dict(self, checkpoint, path=None) to "
                                        "add them, then call super().load_state_dict(checkpoint, path)" if added else
                                        "resume with the same configure_optimizers"), path)
        live = [p for g in opt.param_groups for p in g["params"]]
        flat = (sum(p.numel() for p in live),)  # L-BFGS keeps its vectors over all the parameters under the first
        for i, p in enumerate(live):  # the state is saved by position: a parameter in another place gets another's
            shapes = {tuple(v.shape) for v in saved[name]["state"].get(i, {}).values()
                      if isinstance(v, torch.Tensor) and v.dim() > 0}
            # the parameter's shape, or one that broadcasts to it (Adafactor's row and column statistics)
            misfits = sorted(s for s in shapes if s != flat and not (
                len(s) == p.dim() and all(n in (1, m) for n, m in zip(s, p.shape))))
            if misfits:
                raise CheckpointError(
                    f"{named(path)}: optimizer {name!r} saved state of shape {misfits[0]} for its parameter "
                    f"{i}, and this run's parameter {i} ({(names or {}).get(id(p), 'unnamed')}) has shape "
                    f"{tuple(p.shape)}: its parameters are in another order, or are others. Resume with "
                    "configure_optimizers listing the parameters as when it was saved", path)


def check_schedulers(schedulers: dict, saved: dict, path: Path | None) -> None:
    """Each scheduler has the settings it was saved with (a state dict does not name its class)."""
    for name, scheduler in schedulers.items():
        keys = [{k for k in state if not k.startswith("_")} for state in (saved[name], scheduler.state_dict())]
        if keys[0] != keys[1]:
            raise CheckpointError(
                f"{named(path)}: scheduler {name!r} was saved from another class of scheduler (with "
                f"{', '.join(sorted(keys[0] - keys[1])) or 'fewer settings'}; this run's {type(scheduler).__name__} "
                f"has {', '.join(sorted(keys[1] - keys[0])) or 'no others'}): a scheduler's state does not carry over "
                "to another class. Resume with the scheduler it was saved with, or start a new run without resume",
                path)


def load_optimizers(optimizers: dict[str, torch.optim.Optimizer], checkpoint: dict, path: Path | None,
                    configured: dict | None = None) -> None:
    """Load the optimizers' states (``check_fits`` first). Where this run configures other hyperparameters than the
    run that wrote the checkpoint (``configured``: as ``configure_optimizers`` made them, before any schedule changed
    them), the checkpoint's values are kept (the run goes on as it was), and a warning says so. A checkpoint without
    them (written before they were saved) is compared with the values it holds."""
    saved, theirs = checkpoint["optimizers"], checkpoint.get("configured") or {}
    for name, opt in optimizers.items():
        if configured and name in configured and name in theirs:
            pairs = zip(configured[name], theirs[name])
        else:
            pairs = zip(opt.param_groups, [{k: v for k, v in g.items() if not (k == "lr" and "initial_lr" in g)}
                                           for g in saved[name]["param_groups"]])  # lr: a scheduler's
        differ = [f"{key} {_show(g_saved[key])} (this run: {_show(g_live[key])})" for g_live, g_saved in pairs
                  for key in g_live if key != "params" and key in g_saved and not _same(g_live[key], g_saved[key])]
        if differ:
            log.warning("resume: optimizer %r of %s was configured with %s: the checkpoint's values are used, so the "
                        "run goes on as it was. To use this run's, set them in on_load_checkpoint "
                        "(trainer.optimizers[%r].param_groups)", name, named(path), ", ".join(differ), name)
    load_named("optimizer", optimizers, {name: fsdp.optimizer_shards(opt, saved[name]) for name, opt in
                                         optimizers.items()}, path)


def log_scheduler_settings(schedulers: dict, saved: dict, path: Path | None) -> None:
    """Before loading: a warning for each setting (an argument of its class, such as ``T_max``) that a scheduler of
    this run was made with and the checkpoint's was not. The checkpoint's is kept, as an optimizer's is."""
    for name, scheduler in schedulers.items():
        try:
            arguments = set(inspect.signature(type(scheduler).__init__).parameters)
        except (TypeError, ValueError):  # no signature to read
            continue
        arguments -= {"self", "optimizer", "last_epoch"}  # last_epoch: where it stands, not a setting
        mine, theirs = scheduler.state_dict(), saved[name]
        differ = [f"{key} {_show(theirs[key])} (this run: {_show(mine[key])})" for key in mine
                  if key in arguments and key in theirs and not _same(mine[key], theirs[key])]
        if differ:
            log.warning("resume: scheduler %r of %s was made with %s: the checkpoint's values are used, so the run "
                        "goes on as it was. To use this run's, set them in on_load_checkpoint (trainer.schedulers[%r])",
                        name, named(path), ", ".join(differ), name)


def _class_name(cls: type) -> str:
    public = f"torch.optim.{cls.__name__}"  # torch.optim.Adam rather than torch.optim.adam.Adam
    return public if getattr(torch.optim, cls.__name__, None) is cls else f"{cls.__module__}.{cls.__qualname__}"


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return torch.equal(torch.as_tensor(a).cpu(), torch.as_tensor(b).cpu())
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


def _show(value: Any) -> str:
    return repr(value.item() if isinstance(value, torch.Tensor) and value.numel() == 1 else value)


def check_scaler(scaler, saved: dict | None, path: Path | None) -> None:
    if saved is not None and scaler is None:
        raise CheckpointError(f"{named(path)} was saved with a GradScaler (precision 16) and this run has none: "
                              "resume with the precision it was saved with", path)
    if saved is None and scaler is not None:
        raise CheckpointError(f"{named(path)} was saved without a GradScaler (precision 32 or bf16) and this run has "
                              "one (precision 16): resume with the precision it was saved with", path)


def load_scaler(scaler, saved: dict | None) -> None:
    if scaler is not None:
        scaler.load_state_dict(saved)


_PLAIN = (bool, int, float, complex, str, bytes, type(None))


def unplain(value: Any, where: str) -> tuple[str, Any] | None:
    """Where in ``value`` the first object is that ``torch.load(weights_only=True)`` does not read (anything but
    tensors, numbers, strings and lists, tuples, sets and dicts of them: a MultiStepLR's ``Counter`` too), and that
    object; None when there is none."""
    if isinstance(value, (torch.Tensor, torch.device, torch.dtype)) or type(value) in (*_PLAIN, bytearray):
        return None
    if type(value) in (dict, OrderedDict, Counter):
        items = [(key, f"a key of {where}") for key in value] + [(v, f"{where}[{k!r}]") for k, v in value.items()]
    elif type(value) in (list, tuple, set, torch.Size):
        items = [(item, f"{where}[{i}]") for i, item in enumerate(value)]
    else:
        return where, value
    return next((found for item, at in items if (found := unplain(item, at)) is not None), None)


def _kind(value: Any) -> str:
    return f"{type(value).__module__}.{type(value).__qualname__}"


def check_added(checkpoint: dict, ours: set[str]) -> None:
    """Raise unless what ``on_save_checkpoint`` added (the keys not in ``ours``) is tensors and plain containers,
    which ``torch.load(weights_only=True)`` reads: a checkpoint that cannot be loaded would be found out only when
    resuming."""
    for key in checkpoint.keys() - ours:
        found = unplain(checkpoint[key], f"checkpoint[{key!r}]")
        if found is not None:
            raise CheckpointError(
                f"on_save_checkpoint put a {_kind(found[1])} at {found[0]}: a checkpoint holds only tensors, "
                "numbers, strings, and lists, tuples and dicts of them, so that it loads with "
                "torch.load(weights_only=True). Store its state_dict() or its values instead")


def check_schedulers_plain(states: dict) -> None:
    """Raise unless every scheduler's state is tensors and plain containers (``check_added``): otherwise each
    checkpoint would be written, and none could be read back."""
    for name, state in states.items():
        found = unplain(state, f"scheduler {name!r}'s state_dict()")
        if found is not None:
            raise CheckpointError(
                f"{found[0]} holds a {_kind(found[1])}, which a checkpoint cannot hold (it loads with "
                "torch.load(weights_only=True)): no run could resume from it. Make that state plain (a NumPy array "
                "kept by an lr_lambda object as a list), chain schedulers with SequentialLR rather than one kept "
                "inside another (a warm-up's after_scheduler), or leave the scheduler out of configure_optimizers, "
                "step it in a hook and save what it needs in on_save_checkpoint")


def _mismatch(module: str, mine: dict, theirs: dict) -> list[str]:
    out = []
    missing = [k for k in mine if k not in theirs]
    extra = [k for k in theirs if k not in mine]
    shapes = [f"{k} {tuple(theirs[k].shape)} vs {tuple(mine[k].shape)}" for k in mine
              if k in theirs and isinstance(mine[k], torch.Tensor) and mine[k].shape != theirs[k].shape]
    if missing:
        out.append(f"{module} keys missing from the checkpoint: {_few(missing)}")
    if extra:
        out.append(f"checkpoint keys not in {module}: {_few(extra)}")
    if shapes:
        out.append(f"{module} shapes differ (checkpoint vs now): {_few(shapes)}")
    return out


def _few(items: list[str], n: int = 6) -> str:
    return ", ".join(items[:n]) + (f" and {len(items) - n} more" if len(items) > n else "")


def _saved_model(data: dict) -> str:
    model = (data.get("config") or {}).get("model")
    return f" (its model config: {model})" if model else ""
