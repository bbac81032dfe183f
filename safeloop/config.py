"""Config schemas (Hydra ConfigStore) and ``train(cfg)``, the run a config describes.

The schemas (``safeloop.settings``, where every setting's default lives) make a typo or a
wrong type fail at start-up with the key path (``trainer.max_stepz``); ``train`` is kept apart
from the ``@hydra.main`` entry point so that tests and other programs can call it with a
composed config.
"""
from __future__ import annotations

import difflib
import inspect
import logging
import pydoc
import random
import re
import sys
from contextlib import suppress
from pathlib import Path
from typing import Any, Sequence

import hydra
import torch
from hydra.core.config_store import ConfigStore
from hydra.core.hydra_config import HydraConfig
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.errors import ConfigCompositionException
from hydra.utils import get_class, instantiate
from lightning_utilities.core.rank_zero import rank_zero_only
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from . import distributed
from .errors import ConfigError
from .settings import CheckpointSettings, GuardSettings, Settings, TrainerGroup, mistyped, names, read
from .trainer import Trainer

log = logging.getLogger("safeloop")
CONFIG_DIR = Path(__file__).resolve().parent / "configs"  # the repository's configs/, shipped in the package
_print = rank_zero_only(print)  # one report per job under torchrun


def register() -> None:
    cs = ConfigStore.instance()
    for group, schema in (("trainer", TrainerGroup), ("guard", GuardSettings), ("checkpoint", CheckpointSettings)):
        cs.store(group=group, name="schema", node=_schema(schema))
    # Under torchrun every rank runs @hydra.main: ranks > 0 make no output directory or log file.
    sys.argv += [o for o in distributed.hydra_overrides() if o not in sys.argv]


def _schema(cls) -> DictConfig:
    """``cls`` as a structured config whose dict settings take any key (``trainer.loss_weights={loss:2.0}``:
    their keys are names the user chooses, their values keep their type)."""
    node = OmegaConf.structured(cls)
    for key in node:
        if isinstance(node._get_node(key), DictConfig):
            OmegaConf.set_struct(node[key], False)
    return node


def run_dir(cfg: DictConfig) -> Path:
    if HydraConfig.initialized():
        return Path(HydraConfig.get().runtime.output_dir)
    return Path(cfg.get("run_dir") or "safeloop_runs/latest")


def build(cfg: DictConfig) -> Trainer:
    """The Trainer a config describes (data, model, optimizer instantiated), once ``check`` finds nothing wrong."""
    problems = check(cfg)
    if problems:
        raise ConfigError(problems)
    settings: dict[str, Any] = OmegaConf.to_container(cfg.trainer, resolve=True)  # type: ignore[assignment]
    cls = get_class(settings.pop("_target_"))
    recipe: dict[str, Any] = OmegaConf.to_container(cfg.recipe, resolve=True) if cfg.get("recipe") else {}
    seed = cfg.get("seed")
    if seed is not None:  # before anything is made: the seed decides the data and the model's initial weights
        random.seed(seed)
        torch.manual_seed(seed)
    made = {group: _instantiate(cfg[group], group) if cfg.get(group) is not None else None for group in OBJECTS}
    data = made["data"]
    return cls(
        model=made["model"],
        train_data=getattr(data, "train", data),
        val_data=getattr(data, "val", None),
        optimizer=made["optimizer"],
        scheduler=made["scheduler"],
        guard=OmegaConf.to_container(cfg.guard, resolve=True) if cfg.get("guard") else None,
        checkpoint=OmegaConf.to_container(cfg.checkpoint, resolve=True) if cfg.get("checkpoint") else None,
        config=OmegaConf.to_container(cfg, resolve=True),  # plain containers: checkpoints load weights_only
        run_dir=run_dir(cfg),
        **settings,
        **recipe,
    )


def check(cfg: DictConfig) -> list[str]:
    """Every problem with a composed config's values, each named by its key path: a required value not
    set, the seed, the Trainer class and the recipe's arguments, and the groups without a schema
    (``model``, ``optimizer``...) against their ``_target_``'s signature. The ``trainer``, ``guard``
    and ``checkpoint`` groups are typed by their schema, and their values checked by the Trainer."""
    problems = missing_values(cfg)
    if problems:
        return problems  # resolving a ??? value would raise
    seed = cfg.get("seed")
    if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool)):
        problems.append(f"seed={seed!r} is not an integer: give one (seed=0), or null not to seed")
    target = cfg.trainer._target_
    try:
        cls = get_class(target)
    except Exception as err:
        return problems + [f"trainer._target_={target!r} cannot be imported ({err}); give the dotted path of a "
                           "safeloop.Trainer subclass, e.g. mypackage.train.MyTrainer"]
    if not (isinstance(cls, type) and issubclass(cls, Trainer)):
        return problems + [f"trainer._target_={target!r} is not a safeloop.Trainer subclass"]
    # A recipe's own settings live under ``recipe:`` and become keyword arguments of its Trainer.
    recipe: dict[str, Any] = OmegaConf.to_container(cfg.recipe, resolve=True) if cfg.get("recipe") else {}
    base = inspect.signature(Trainer).parameters
    own = [name for name, p in inspect.signature(cls).parameters.items()
           if name not in base and p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)]
    problems += [f"recipe.{k} is not a keyword argument of {target} (its own arguments: "
                 f"{', '.join(own) or 'none'}); fix the key or drop it" for k in recipe if k not in own]
    problems += mistyped(cls, {k: v for k, v in recipe.items() if k in own}, "recipe.")
    for group in OBJECTS:
        node = cfg.get(group)
        if group == "scheduler" and isinstance(node, DictConfig) and "scheduler" in node:  # {scheduler, interval, monitor}
            node, group = node.scheduler, "scheduler.scheduler"
        problems += call_problems(node, group)
    # the settings' own checks, which the Trainer runs again, so that one report holds everything
    settings = OmegaConf.to_container(cfg.trainer, resolve=True)
    known = set(names(Settings))
    takes = inspect.signature(cls).parameters
    problems += [f"trainer.{k} is not a setting of {target} (+trainer.{k} added it): drop it, or give the Trainer "
                 f"subclass a keyword argument {k}" for k in settings if k != "_target_" and k not in known
                 and k not in takes]
    problems += Settings(**{k: v for k, v in settings.items() if k in known}).problems()  # type: ignore[union-attr]
    for group, schema in (("guard", GuardSettings), ("checkpoint", CheckpointSettings)):
        if cfg.get(group) is not None:
            problems += read(schema, OmegaConf.to_container(cfg[group], resolve=True), group)[1]
    return problems


OBJECTS = ("data", "model", "optimizer", "scheduler")  # groups without a schema: checked against their _target_


def call_problems(node: Any, where: str) -> list[str]:
    """Every problem with a ``_target_`` config (``model``, ``optimizer``...): a target that cannot be
    imported, a key it takes no argument for, a value of the wrong type for its signature."""
    if node is None:
        return []
    if not isinstance(node, DictConfig) or "_target_" not in node:
        return [f"{where}={OmegaConf.to_container(node) if isinstance(node, DictConfig) else node!r} is not "
                f"a config with a _target_: choose one of configs/{where}/ ({where}=NAME), or give "
                f"{where}._target_=dotted.path.of.a.Class and its arguments"]
    values = OmegaConf.to_container(node, resolve=True)
    target = values.pop("_target_")
    try:
        call = pydoc.locate(target)
    except pydoc.ErrorDuringImport as err:  # the module exists and fails to import
        call, why = None, _first_lines(err.value)
    else:
        why = "no such module or attribute"
    if call is None:
        return [f"{where}._target_={target!r} cannot be imported ({why}); give the dotted path of a class or "
                "function"]
    try:
        params = inspect.signature(call).parameters
    except (TypeError, ValueError):  # a builtin without a signature: nothing to check against
        return []
    args = {k: v for k, v in values.items() if not k.startswith("_")}
    out = []
    if not any(p.kind == p.VAR_KEYWORD for p in params.values()):
        takes = [name for name, p in params.items() if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
        out += [f"{where}.{key}: {target} takes no argument {key!r} (it takes {', '.join(takes)}); fix the key or "
                "drop it" for key in args if key not in params]
    nested = {k for k, v in args.items() if isinstance(v, dict) and "_target_" in v}
    for key in nested:
        out += call_problems(node[key], f"{where}.{key}")
    return out + mistyped(call, {k: v for k, v in args.items() if k in params and k not in nested}, f"{where}.")


def _instantiate(node: DictConfig, where: str) -> Any:
    """``instantiate(node)``, a ``ConfigError`` naming the group and its values if the target refuses them.
    A ``_partial_`` optimizer is tried on a stand-in parameter, so that a value it refuses
    (``lr=-1``: torch checks its arguments with ``ValueError``) is found now, not when training starts."""
    values = OmegaConf.to_container(node, resolve=True)
    try:
        made = instantiate(node)
        if where == "optimizer" and callable(made) and not isinstance(made, torch.optim.Optimizer):
            with suppress(RuntimeError):  # fused=True wants CUDA parameters, say: the real ones decide, at setup
                made([torch.nn.Parameter(torch.zeros(1, 1))])
    except Exception as err:
        cause = err.__cause__ or err
        detail = str(cause).splitlines()[0] if str(cause) else ""
        shown = ", ".join(f"{k}={v!r}" for k, v in values.items() if not k.startswith("_"))
        raise ConfigError(f"{where}: {values['_target_']}({shown}) failed: {type(cause).__name__}: {detail}; fix "
                          f"the value at fault ({where}.KEY=VALUE)") from None
    return made


def missing_values(cfg: DictConfig) -> list[str]:
    """One problem per required value (``???``) left unset."""
    return [f"{key} is required and not set (it is ??? in the config): give it, e.g. "
            f"python -m safeloop {key}=VALUE" for key in _missing(cfg)]


def _missing(cfg: DictConfig, prefix: str = "") -> list[str]:
    """Keys set to ``???`` (an interpolation of one is not reported again: resolving it would raise)."""
    out = []
    for key in cfg.keys():
        node = cfg._get_node(key)
        if node._is_interpolation():
            continue
        if node._is_missing():
            out.append(f"{prefix}{key}")
        elif isinstance(node, DictConfig) and not node._is_none():
            out += _missing(node, f"{prefix}{key}.")
    return out


def compose(overrides: Sequence[str] = (), config_name: str = "train",
            config_dir: str | Path = CONFIG_DIR) -> DictConfig:
    """``hydra.compose`` with safeloop's errors, for programs, notebooks and the command line.

    Every bad override is reported in one ``ConfigError``: an unknown key with the closest
    known keys ("did you mean"), a wrong type with the key and what was expected, a
    required value left ``???``, a value its ``_target_`` does not take (``check``).
    """
    register()
    overrides = list(overrides)
    missing = unknown_options(overrides, config_dir)
    if missing:  # Hydra would leave the optional group out without a word
        raise ConfigError(missing)
    with hydra.initialize_config_dir(config_dir=str(config_dir), version_base=None):
        problems, cfg = _compose_reporting(config_name, overrides)
    if cfg is not None:
        problems += check(cfg)
    if problems:
        raise ConfigError(problems)
    return cfg


def unknown_options(overrides: Sequence[str], config_dir: str | Path = CONFIG_DIR) -> list[str]:
    """``experiment=gann``: an option an optional group (``experiment``, ``debug``) does not have
    (Hydra leaves such a group out silently; a group that is not optional it reports itself), and
    ``optimizer=null`` (which Hydra answers with a bare ValueError)."""
    config_dir = Path(config_dir)
    defaults = OmegaConf.load(config_dir / "train.yaml").defaults
    optional = [key.split()[1] for d in defaults if isinstance(d, DictConfig) for key in d
                if key.startswith("optional ")]
    groups = {d.name for d in config_dir.iterdir() if d.is_dir()}
    problems = []
    for o in OverridesParser.create().parse_overrides(list(overrides)):
        value, group = o.value(), o.key_or_group
        names = sorted(f.stem for f in (config_dir / group).glob("*.yaml")) if group in groups else []
        if group in groups and value is None and not o.is_delete():
            problems.append(f"{o.input_line}: a config group takes one of its options ({', '.join(names)})"
                            + (f"; ~{group} leaves it out" if group in optional else ""))
        if group in optional and not o.is_delete() and isinstance(value, str):
            if value not in names:
                close = difflib.get_close_matches(value, names, n=1, cutoff=0.6)
                problems.append(f"{o.input_line}: {group} has no option {value!r}; "
                                + (f"did you mean {group}={close[0]}? " if close else "")
                                + f"options: {', '.join(names)}")
    return problems


def _compose_reporting(config_name: str, overrides: list[str]) -> tuple[list[str], DictConfig | None]:
    """Compose, dropping each override Hydra rejects, until it works; a problem for each one dropped."""
    failed: list[tuple[Any, ConfigCompositionException]] = []
    remaining = OverridesParser.create().parse_overrides(overrides)
    while True:
        try:
            cfg = hydra.compose(config_name, overrides=[o.input_line for o in remaining])
            break
        except ConfigCompositionException as err:
            head = str(err).splitlines()[0] if str(err) else ""
            # the override itself where the error quotes it (trainer.max_steps=2 ... trainer.max_steps=abc), else its key
            culprit = next((o for o in remaining if o.input_line in head), None) or next(
                (o for o in remaining if re.search(rf"\b{re.escape(o.key_or_group)}\b", head)), None)
            if culprit is None:  # nothing to drop: report Hydra's own words
                return [_first_lines(err)], None
            failed.append((culprit, err))
            remaining.remove(culprit)
    known = list(dict.fromkeys(_paths(cfg) + [p.name for p in CONFIG_DIR.iterdir() if p.is_dir()]))
    return [_problem(o, err, known) for o, err in failed], cfg


def _problem(override, err: ConfigCompositionException, known: list[str]) -> str:
    cause = err.__cause__
    key = override.key_or_group
    if "not in" in str(cause) or "No match in the defaults list" in str(err):
        # the same section first (a shared "trainer." prefix would make every sibling look close)
        parent, _, leaf = key.rpartition(".")
        siblings = [k.rpartition(".")[2] for k in known if k.rpartition(".")[0] == parent]
        close = [f"{parent}.{m}" if parent else m for m in difflib.get_close_matches(leaf, siblings, n=3, cutoff=0.6)]
        if not close:  # a key of another section: trainer.hidden -> model.hidden
            leaves = difflib.get_close_matches(leaf, {k.rpartition(".")[2] for k in known}, n=3, cutoff=0.8)
            close = [k for k in known if k.rpartition(".")[2] in leaves][:3]
        hint = f"did you mean {close[0]}?" + (f" (also close: {', '.join(close[1:])})" if close[1:] else "") \
            if close else "python -m safeloop --cfg job lists every key"
        return (f"{override.input_line}: there is no config key {key!r}; {hint} "
                f"(to add a new key on purpose, write +{override.input_line})")
    options = re.search(r"Available options in '(.+)':\n((?:\t.*\n)+)", str(err))
    if options:  # group=option with no such option: Hydra's list of the options, and the closest one
        names = options[2].split()
        close = difflib.get_close_matches(str(override.value()), names, n=1, cutoff=0.6)
        return (f"{override.input_line}: {options[1]} has no option {override.value()!r}; "
                + (f"did you mean {options[1]}={close[0]}? " if close else "") + f"options: {', '.join(names)}")
    if isinstance(cause, OmegaConfBaseException):
        return f"{override.input_line}: {str(cause.msg).splitlines()[0].rstrip('.')}; give {cause.full_key} a value of that type"
    return f"{override.input_line}: {_first_lines(err)}"


def _first_lines(err: Exception) -> str:
    return " ".join(line.strip() for line in str(err).splitlines()[:3] if line.strip())


def _paths(cfg, prefix: str = "") -> list[str]:
    """Every key path in ``cfg`` (``trainer``, ``trainer.max_steps``...), values unresolved."""
    out = []
    for key in cfg.keys():
        path = f"{prefix}{key}"
        out.append(path)
        node = cfg._get_node(key)
        if isinstance(node, DictConfig) and not node._is_missing() and not node._is_none():
            out += _paths(node, path + ".")
    return out


def train(cfg: DictConfig) -> Trainer:
    """Build the Trainer from ``cfg``, fit it, and report where the outputs went."""
    trainer = build(cfg)
    trainer.fit()
    history = trainer.state.val_history
    if history:
        (s0, first), (s1, last) = history[0], history[-1]
        key = next(iter(first))
        _print(f"{key}: {first[key]:.4g} at step {s0} -> {last[key]:.4g} at step {s1}")
    _print(f"outputs: {trainer.run_dir}")
    return trainer
