"""Config schemas (Hydra ConfigStore), ``compose(overrides)`` with safeloop's errors, and ``train(cfg)``.

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
import warnings
from contextlib import suppress
from pathlib import Path
from typing import Any, Iterator, Sequence

import hydra
import torch
import yaml
from hydra.core.config_store import ConfigStore
from hydra.core.hydra_config import HydraConfig
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import Override
from hydra.errors import ConfigCompositionException, OverrideParseException
from hydra.types import RunMode
from hydra.utils import get_class, instantiate, to_absolute_path
from lightning_utilities.core.rank_zero import rank_zero_only
from omegaconf import MISSING, DictConfig, OmegaConf
from omegaconf.errors import ConfigAttributeError, ConfigKeyError, InterpolationResolutionError, ValidationError

from . import distributed
from .errors import ConfigError
from .settings import (LIGHTNING_SETTINGS, CheckpointSettings, GuardSettings, Settings, TrainerGroup, mistyped, names,
                       read)
from .sweeps import MonitorCheck
from .trainer import Trainer

log = logging.getLogger("safeloop")
CONFIG_DIR = Path(__file__).resolve().parent / "configs"  # the repository's configs/, shipped in the package
USER_CONFIG_DIR = "configs"  # the user's own options: configs/ in the current directory (train.yaml's search path)
_print = rank_zero_only(print)  # one report per job under torchrun


def register() -> None:
    """What composing safeloop's configs takes: the schemas of the ``trainer``, ``guard`` and ``checkpoint``
    groups, and the ``safeloop.groups`` resolver that ``--help`` (``hydra.help`` in train.yaml) lists them with."""
    cs = ConfigStore.instance()
    for group, schema in (("trainer", TrainerGroup), ("guard", GuardSettings), ("checkpoint", CheckpointSettings)):
        cs.store(group=group, name="schema", node=_schema(schema))
    OmegaConf.register_new_resolver("safeloop.groups", _options_text, replace=True)
    # train.yaml's search path names the current directory's configs/ (the user's own options), there or not
    warnings.filterwarnings("ignore", message=f"provider=hydra.searchpath in (main|command-line), "
                            f"path={USER_CONFIG_DIR} is not available", category=UserWarning)
    # Under torchrun every rank runs @hydra.main: ranks > 0 make no output directory or log file.
    sys.argv += [o for o in distributed.hydra_overrides() if o not in sys.argv]


def _schema(cls) -> DictConfig:
    """``cls`` as a structured config whose dict settings take any key (``trainer.loss_weights={loss:2.0}``:
    their keys are names the user chooses, their values keep their type)."""
    node = OmegaConf.structured(cls)
    for key in node:
        if isinstance(node[key], DictConfig):
            OmegaConf.set_struct(node[key], False)
    return node


def options(config_dir: str | Path = CONFIG_DIR, search: Sequence[str] = ()) -> dict[str, list[str]]:
    """Each config group and its options: the YAML files under ``config_dir``, under the current directory's
    ``configs/`` (the user's own; the schemas are no options) and under the ``search`` directories (the command
    line's ``--config-dir``)."""
    found: dict[str, set[str]] = {}
    for root in (Path(config_dir), Path(USER_CONFIG_DIR), *map(Path, search)):
        for d in root.iterdir() if root.is_dir() else ():
            if d.is_dir():
                found.setdefault(d.name, set()).update(f.stem for f in d.glob("*.yaml"))
    return {group: sorted(names) for group, names in sorted(found.items())}


def _options_text() -> str:
    return "".join(f"  {group}: {', '.join(names)}\n" for group, names in options().items())


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
    checkpoint = OmegaConf.to_container(cfg.checkpoint, resolve=True) if cfg.get("checkpoint") else None
    if HydraConfig.initialized():  # a relative path is the command's, under hydra.job.chdir=True too
        if isinstance(checkpoint, dict) and checkpoint.get("dir"):
            checkpoint["dir"] = to_absolute_path(str(checkpoint["dir"]))
        if settings.get("resume") not in (None, "auto"):
            settings["resume"] = to_absolute_path(str(settings["resume"]))
    recipe: dict[str, Any] = OmegaConf.to_container(cfg.recipe, resolve=True) if cfg.get("recipe") else {}
    seed = cfg.get("seed")
    if seed is not None:  # before anything is made: the seed decides the data and the model's initial weights
        random.seed(seed)
        torch.manual_seed(seed)
    made = {group: _instantiate(cfg[group], group) if cfg.get(group) is not None else None for group in OBJECTS}
    callbacks = [_instantiate(node, f"callbacks.{name}") for name, node in (cfg.get("callbacks") or {}).items()]
    callbacks.append(MonitorCheck(cfg.get("monitor", "val_loss")))
    data = made["data"]
    if not hasattr(data, "train") and callable(getattr(data, "train_dataloader", None)):
        raise ConfigError(f"data: {cfg.data._target_} made a {type(data).__name__} with train_dataloader() (a "
                          "Lightning DataModule); the data group's target returns an object with .train (and .val), "
                          "iterables of batches (docs/own-model.md): e.g. a function that calls dm.setup('fit') and "
                          "returns safeloop.data.Data(dm.train_dataloader(), dm.val_dataloader())")
    try:
        return cls(
            model=made["model"],
            train_data=getattr(data, "train", data),
            val_data=getattr(data, "val", None),
            optimizer=made["optimizer"],
            scheduler=made["scheduler"],
            callbacks=callbacks,
            guard=OmegaConf.to_container(cfg.guard, resolve=True) if cfg.get("guard") else None,
            checkpoint=checkpoint,
            config=OmegaConf.to_container(cfg, resolve=True),  # plain containers: checkpoints load weights_only
            run_dir=run_dir(cfg),
            **settings,
            **recipe,
        )
    except ConfigError as err:  # the Trainer's own checks (device, precision...), named by their key path
        raise ConfigError([keyed(p) for p in err.problems]) from None


def check(cfg: DictConfig) -> list[str]:
    """Every problem with a composed config's values, each named by its key path: a required value not
    set, the seed, the Trainer class and the recipe's arguments, and the groups without a schema
    (``model``, ``optimizer``...) against their ``_target_``'s signature. The ``trainer``, ``guard``
    and ``checkpoint`` groups are typed by their schema, and their values checked by the Trainer."""
    problems = missing_values(cfg) or unresolved(cfg)
    if problems:
        return problems  # resolving it would raise
    seed = cfg.get("seed")
    if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool)):
        problems.append(f"seed={seed!r} is not an integer: give one (seed=0), or null not to seed")
    threads = cfg.get("threads")
    if threads is not None and (not isinstance(threads, int) or isinstance(threads, bool) or threads < 1):
        problems.append(f"threads={threads!r} is not a positive integer: give torch's CPU thread count (threads=4), "
                        "or null for torch's default")
    target = cfg.trainer.get("_target_")
    if target is None:  # a trainer option of the user's own, without the schema
        chosen = HydraConfig.get().runtime.choices.get("trainer") if HydraConfig.initialized() else None
        return problems + [f"the trainer config{f' {chosen!r}' if chosen else ''} has no _target_: begin the file with "
                           "'defaults: [default]' (safeloop's trainer options, their schema and defaults), then set "
                           "what differs"]
    try:
        cls = get_class(target)
    except Exception as err:
        return problems + [f"trainer._target_={target!r} cannot be imported ({err}); give the dotted path of a "
                           "safeloop.Trainer subclass, e.g. mypackage.train.MyTrainer"]
    if not (isinstance(cls, type) and issubclass(cls, Trainer)):
        return problems + [f"trainer._target_={target!r} is not a safeloop.Trainer subclass"]
    # A recipe's own settings live under ``recipe:`` and become keyword arguments of its Trainer.
    recipe: dict[str, Any] = checked(cfg.recipe) if cfg.get("recipe") else {}
    base = inspect.signature(Trainer).parameters
    own = [name for name, p in inspect.signature(cls).parameters.items()
           if name not in base and p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)]
    problems += [f"recipe.{k} is not a keyword argument of {target} (its own arguments: "
                 f"{', '.join(own) or 'none'}); fix the key or drop it" for k in recipe if k not in own]
    problems += mistyped(cls, {k: v for k, v in recipe.items() if k in own}, "recipe.")
    for group in OBJECTS:
        node = cfg.get(group)
        # a scheduler given as {scheduler, interval, monitor}
        if group == "scheduler" and isinstance(node, DictConfig) and "scheduler" in node:
            node, group = node.scheduler, "scheduler.scheduler"
        problems += call_problems(node, group)
    callbacks = cfg.get("callbacks")  # {name: a _target_ config} (configs/callbacks/)
    for name, node in callbacks.items() if isinstance(callbacks, DictConfig) else ():
        problems += call_problems(node, f"callbacks.{name}")
    monitor = cfg.get("monitor", "val_loss")
    if not (isinstance(monitor, str) and monitor):
        problems.append(f"monitor={monitor!r} is not a metric's name: give the metric the run returns to a sweeper, "
                        "e.g. monitor=val_loss")
    # the settings' own checks, which the Trainer runs again, so that one report holds everything
    settings = checked(cfg.trainer)
    known = set(names(Settings))
    takes = inspect.signature(cls).parameters
    problems += [f"trainer.{k} (+trainer.{k} added it): that is Lightning's; here: {LIGHTNING_SETTINGS[k]}"
                 if k in LIGHTNING_SETTINGS
                 else f"trainer.{k} is not a setting of {target} (+trainer.{k} added it): drop it, or give the Trainer "
                 f"subclass a keyword argument {k}" for k in settings if k != "_target_" and k not in known
                 and k not in takes]
    problems += [keyed(p) for p in Settings(**{k: v for k, v in settings.items() if k in known}).problems()]
    for group, schema in (("guard", GuardSettings), ("checkpoint", CheckpointSettings)):
        if cfg.get(group) is not None:
            problems += read(schema, checked(cfg[group]), group)[1]
    return problems


def keyed(problem: str) -> str:
    """A Trainer setting's problem as the command line names the setting: ``val_every must be...`` ->
    ``trainer.val_every must be...`` (``Trainer(...)``'s keyword arguments have no prefix)."""
    word = re.match(r"\w+", problem)
    return f"trainer.{problem}" if word and word[0] in names(Settings) else problem


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
    values = checked(node)
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
    unknown = [key for key in args if key not in params]
    if unknown and not any(p.kind == p.VAR_KEYWORD for p in params.values()):
        takes = ", ".join(name for name, p in params.items() if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY))
        if len(unknown) == 1:
            out.append(f"{where}.{unknown[0]}: {target} takes no argument {unknown[0]!r} (it takes "
                       f"{takes or 'none'}); fix the key or drop it")
        else:  # model._target_=cnn.Net keeps the keys of model=mlp: say once how to leave them behind
            out.append(f"{where}: {target} takes none of {', '.join(unknown)} (it takes {takes or 'no arguments'}). "
                       + (f"For your own {where}, write its config, configs/{where}/NAME.yaml in the current "
                          f"directory (_target_: {target} and its arguments), and run with {where}=NAME (see "
                          f"docs/own-model.md); or drop each key: '~{where}.{unknown[0]}'..." if "." not in where
                          else "Fix the keys or drop them"))
    nested = {k for k, v in args.items() if isinstance(v, dict) and "_target_" in v}
    for key in nested:
        out += call_problems(node[key], f"{where}.{key}")
    return out + mistyped(call, {k: v for k, v in args.items() if k in params and k not in nested}, f"{where}.")


def _instantiate(node: DictConfig, where: str) -> Any:
    """``instantiate(node)``, a ``ConfigError`` naming the group and its values if the target refuses them.
    A ``_partial_`` optimizer is tried on a stand-in parameter, so that a value it refuses
    (``lr=-1``: torch checks its arguments with ``ValueError``) is found now, not when training starts."""
    values = checked(node)
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


def checked(node: DictConfig) -> Any:
    """``node`` as plain containers, resolved, for the checks; made before the run (from the command line), where
    Hydra's job does not exist yet, a node with a ``${hydra:...}`` (``${hydra:runtime.output_dir}/ckpt``) is taken as
    written: the run resolves it."""
    try:
        return OmegaConf.to_container(node, resolve=True)
    except InterpolationResolutionError as err:
        if not resolved_in_the_run(err):
            raise
        return OmegaConf.to_container(node, resolve=False)


def resolved_in_the_run(err: InterpolationResolutionError) -> bool:
    """Whether ``err`` is a ``${hydra:...}`` met before the run (the command line's checks): Hydra's job resolves it."""
    return not HydraConfig.initialized() and "HydraConfig was not set" in str(err)


def unresolved(cfg: DictConfig) -> list[str]:
    """An interpolation that cannot be resolved (an environment variable not set, a key that does not exist), by
    its key: one, the first OmegaConf meets."""
    try:
        OmegaConf.to_container(cfg, resolve=True)
    except InterpolationResolutionError as err:
        if resolved_in_the_run(err):
            return []
        return [f"{err.full_key}: its interpolation cannot be resolved ({str(err).splitlines()[0]}): set what it "
                "reads, or give the value itself"]
    return []


def missing_values(cfg: DictConfig) -> list[str]:
    """One problem per required value (``???``) left unset (an interpolation of one is not reported again:
    resolving it would raise)."""
    return [f"{key} is required and not set (it is ??? in the config): give it, e.g. "
            f"python -m safeloop {key}=VALUE" for key, value in _walk(OmegaConf.to_container(cfg, resolve=False))
            if value == MISSING]


def _walk(tree: dict, prefix: str = "") -> Iterator[tuple[str, Any]]:
    """Every key path in a config as plain containers (``trainer``, ``trainer.max_steps``...) and its value."""
    for key, value in tree.items():
        yield f"{prefix}{key}", value
        if isinstance(value, dict):
            yield from _walk(value, f"{prefix}{key}.")


def compose(overrides: Sequence[str] = (), config_name: str = "train",
            config_dir: str | Path = CONFIG_DIR, search: Sequence[str] = ()) -> DictConfig:
    """``hydra.compose`` with safeloop's errors, for programs, notebooks and the command line.

    Every problem is reported in one ``ConfigError``: a group option that does not exist, an
    unknown key with the closest known keys ("did you mean"), a wrong type with the key and what
    was expected, a required value left ``???``, a value its ``_target_`` does not take (``check``).
    ``search``: more config directories, as the command line's ``--config-dir`` adds them.
    """
    problems, cfg = composition(overrides, config_name, config_dir, search)
    if cfg is not None:
        problems += check(cfg)
    if problems:
        raise ConfigError(problems)
    return cfg


def composition(overrides: Sequence[str], config_name: str = "train", config_dir: str | Path = CONFIG_DIR,
                search: Sequence[str] = ()) -> tuple[list[str], DictConfig | None]:
    """Every problem with the overrides themselves, and the config that those Hydra accepts make (None when
    one is no override or chooses no option: the others alone would compose a different run)."""
    register()
    parser, parsed, problems = OverridesParser.create(), [], []
    for line in overrides:  # one at a time: every one that is no override is reported
        try:
            parsed += parser.parse_overrides([line])
        except OverrideParseException as err:
            problems.append(f"{line}: {_first_lines(err)}")
    groups = options(config_dir, [*search, *searched(parsed)])
    where = searchpath(search)
    problems += [problem for o in parsed for problem in _option_problems(o, groups)]
    if problems:
        return problems, None
    # Hydra applies the group choices before the keys, whatever their order: a key that a chosen option
    # brings (experiment=gan model.noise_dim=4) is then there when the key is tried alone, below.
    parsed.sort(key=lambda o: o.key_or_group not in groups)
    with hydra.initialize_config_dir(config_dir=str(config_dir), version_base=None):
        try:
            return [], hydra.compose(config_name, overrides=[*where, *(o.input_line for o in parsed)])
        except ConfigCompositionException:
            pass  # an override is at fault: found below
        except yaml.YAMLError as err:  # a config file of the user's own
            return [not_yaml(err)], None
        # Every override at fault, not only the first: each one tried on the config of those that compose.
        cfg, kept, refused = hydra.compose(config_name, overrides=where), [], []
        for o in parsed:
            try:
                cfg = hydra.compose(config_name, overrides=[*where, *kept, o.input_line])
                kept.append(o.input_line)
            except ConfigCompositionException as err:
                refused.append((o, err))
    known = list(dict.fromkeys([key for key, _ in _walk(OmegaConf.to_container(cfg, resolve=False))] + list(groups)))
    return [_problem(o, err, known) for o, err in refused], cfg


def searchpath(search: Sequence[str]) -> list[str]:
    """The override giving Hydra the search path train.yaml gives, and the ``--config-dir`` ones (none without)."""
    return [f"hydra.searchpath=[{','.join(f'file://{d}' for d in (USER_CONFIG_DIR, *search))}]"] if search else []


def declared_sweep(overrides: Sequence[str], config_name: str = "train", config_dir: str | Path = CONFIG_DIR,
                   search: Sequence[str] = ()) -> list[str]:
    """The swept values a config file declares (``hydra.mode: MULTIRUN`` with ``hydra.sweeper.params``, as
    lightning-hydra-template's ``hparams_search/``), as overrides; none for a single run. For overrides ``compose``
    takes."""
    where = searchpath(search)
    with hydra.initialize_config_dir(config_dir=str(config_dir), version_base=None):
        declared = hydra.compose(config_name, overrides=[*where, *overrides], return_hydra_config=True).hydra
    params = declared.sweeper.get("params") if declared.mode == RunMode.MULTIRUN else None
    return [f"{key}={value}" for key, value in (params or {}).items()]


def searched(parsed: list[Override]) -> list[str]:
    """The directories a ``hydra.searchpath=[file://DIR,...]`` override adds (its other kinds of path are left out)."""
    paths = [o.value() for o in parsed if o.key_or_group == "hydra.searchpath"]
    return [p.removeprefix("file://") for value in paths[-1:] for p in (value if isinstance(value, list) else [value])
            if isinstance(p, str) and p.startswith("file://")]


def not_yaml(err: yaml.YAMLError) -> str:
    """A config file that YAML cannot read, named with the place and what is wrong there."""
    mark = getattr(err, "context_mark", None) or getattr(err, "problem_mark", None)
    where = f"{mark.name}, line {mark.line + 1}, column {mark.column + 1}" if mark is not None else "a config file"
    problem, context = getattr(err, "problem", None), getattr(err, "context", None)
    return f"{where} is not valid YAML: " + (f"{problem}{f' ({context})' if context else ''}" if problem
                                             else _first_lines(err))


def _option_problems(o: Override, groups: dict[str, list[str]]) -> list[str]:
    """``optimizer=adamm``: an option the group does not have (Hydra leaves an optional group such as
    ``experiment`` out without a word), with the closest one; ``optimizer=null`` (a bare ValueError)."""
    group, value = o.key_or_group, o.value()
    if group not in groups or o.is_delete() or not (value is None or isinstance(value, str)) or value in groups[group]:
        return []
    names = ", ".join(groups[group])
    if value is None:
        return [f"{o.input_line}: a config group takes one of its options ({names})"]
    close = difflib.get_close_matches(value, groups[group], n=1, cutoff=0.6)
    return [f"{o.input_line}: {group} has no option {value!r}; "
            + (f"did you mean {group}={close[0]}? " if close else "") + f"options: {names}"]


def _problem(o: Override, err: ConfigCompositionException, known: list[str]) -> str:
    """What OmegaConf found wrong with an override Hydra refused, in safeloop's words where they add
    something (the closest keys, how to add a key on purpose); Hydra's own words otherwise."""
    cause = err.__cause__
    if isinstance(cause, (ConfigKeyError, ConfigAttributeError)):
        group, _, leaf = o.key_or_group.rpartition(".")
        if group == "trainer" and leaf in LIGHTNING_SETTINGS:
            return f"{o.input_line}: there is no config key {o.key_or_group!r}: that is Lightning's; here: " + \
                LIGHTNING_SETTINGS[leaf]
        return (f"{o.input_line}: there is no config key {o.key_or_group!r}; {_closest(o.key_or_group, known)} "
                f"(to add a new key on purpose, write +{o.input_line})")
    if isinstance(cause, ValidationError):
        return (f"{o.input_line}: {str(cause.msg).splitlines()[0].rstrip('.')}; give {cause.full_key} a value of "
                "that type")
    if o.input_line.startswith("+") and "Multiple values for" in str(err):  # +group=option of a chosen group
        return (f"{o.input_line}: {o.key_or_group} has an option chosen already (train.yaml's defaults list): write "
                f"{o.input_line.lstrip('+')}, without the +")
    in_file = re.search(r"ConfigKeyError raised while composing config:\nKey '\w+' not in .*\n\s*full_key: (\S+)",
                        str(err))  # a key that a config file the override chose sets (Hydra gives no cause)
    if in_file is not None:
        key = in_file[1]
        group, _, leaf = key.rpartition(".")
        return f"{o.input_line}: its config file sets {key}, which is no config key: " + (
            f"that is Lightning's; here: {LIGHTNING_SETTINGS[leaf]}" if group == "trainer" and leaf in
            LIGHTNING_SETTINGS else _closest(key, known))
    return f"{o.input_line}: {_first_lines(err)}"


def _closest(key: str, known: list[str]) -> str:
    """"did you mean" the known keys closest to ``key``: its own section's first (a shared ``trainer.``
    prefix would make every sibling look close), then any section's (``trainer.lr`` -> ``optimizer.lr``)."""
    parent, _, leaf = key.rpartition(".")
    siblings = [k.rpartition(".")[2] for k in known if k.rpartition(".")[0] == parent]
    close = [f"{parent}.{m}" if parent else m for m in difflib.get_close_matches(leaf, siblings, n=3, cutoff=0.6)]
    if not close:
        leaves = difflib.get_close_matches(leaf, {k.rpartition(".")[2] for k in known}, n=3, cutoff=0.8)
        close = [k for k in known if k.rpartition(".")[2] in leaves][:3]
    if not close:
        return "python -m safeloop --cfg job lists every key"
    return f"did you mean {close[0]}?" + (f" (also close: {', '.join(close[1:])})" if close[1:] else "")


def _first_lines(err: Exception) -> str:
    return " ".join(line.strip() for line in str(err).splitlines()[:3] if line.strip())


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
