"""``python -m safeloop [overrides]`` (also the ``safeloop`` command): a Hydra-configured training run.

With no arguments it trains the embedded default (an MLP on seeded synthetic data).
Stopped by SIGTERM or SIGINT (in a SLURM job SIGUSR1 too, ``safeloop.slurm``), it saves a checkpoint and exits
with 128 + the signal number (143, 130, 138), so that a job script can tell a preempted run from a finished one.
A configuration error (a bad override, ``device=cuda`` without CUDA, a bad guard setting)
is one message and exit code 2, and leaves no output directory. An error at run time (a
``SafeloopError`` such as ``CarriedGraphError``, or an ``OSError``: a full disk) is its message and
the frames of the user's own code, and exit code 1.
"""
from __future__ import annotations

import errno
import os
import shutil
import sys
import sysconfig
import traceback
from pathlib import Path

import hydra
import lightning_utilities
import omegaconf
import torch
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.errors import HydraException
from omegaconf import DictConfig, OmegaConf
from torch.distributed.elastic.multiprocessing.errors import record

from .checkpoint import holder, run_dir_in_use
from .config import CONFIG_DIR, compose, declared_sweep, register, train
from .errors import ConfigError, Interrupted, SafeloopError
from .sweeps import Result

register()


def main() -> None:
    """The ``safeloop`` command: ``run``, Hydra's entry point over ``configs/train.yaml`` (its ``--help``
    is ``hydra.help`` there). The overrides of a run or of ``--help`` are checked first, so that a bad one
    gets safeloop's words and exit code 2 rather than Hydra's report, with the values and the run directory
    (``check_overrides``), before Hydra makes it; a sweep's each value, before its first run (``check_sweep``).
    With ``--config-dir`` too (its options are checked). ``--cfg``, Hydra's other modes and a primary config of
    your own (``--config-name``) report their own errors. The current directory is importable, as under
    ``python -m``, for ``_target_`` of your own. ``safeloop watch script.py [args]`` runs a script under the
    guard (``safeloop.watch``)."""
    args = sys.argv[1:]
    if os.getcwd() not in sys.path:  # the user's modules (model._target_=cnn.Net), as `python -m` has them
        sys.path.insert(0, os.getcwd())
    if args[:1] == ["watch"]:  # no override is a bare word
        from .watch import main as watch

        sys.exit(watch(args[1:], prog="safeloop watch"))
    args, where = config_flags(args)
    flags = {arg for arg in args if arg.startswith("-")}
    sweep = bool(flags & {"-m", "--multirun"}) or any(arg.split("=", 1)[0].lstrip("+~") == "hydra.mode"
                                                       for arg in args)
    # a run, a sweep, or --help, of train.yaml (a primary config of your own: Hydra's to compose and report)
    if flags <= {"-h", "--help", "-m", "--multirun"} and where["config_name"] == "train":
        refusing(check_sweep if sweep else check_overrides, [arg for arg in args if arg not in flags], **where)
    run()


def config_flags(args: list[str]) -> tuple[list[str], dict]:
    """``args`` without Hydra's ``--config-dir``/``-cd`` and ``--config-name``/``-cn`` (and their values), and
    what they give ``compose``: the directories searched, the primary config's name. ``--config-path`` is left in
    ``args``: Hydra's to resolve (the checks before the run are then left to Hydra, as for another primary config:
    ``compose`` finds the primary config in safeloop's directory only)."""
    rest, where = [], {"search": [], "config_name": "train"}
    names = {"--config-dir": "search", "-cd": "search", "--config-name": "config_name", "-cn": "config_name"}
    values = iter(args)
    for arg in values:
        flag, given, value = arg.partition("=")
        if flag in names:
            value = value if given else next(values, "")
            if names[flag] == "search":
                where["search"].append(os.path.abspath(value))
            else:
                where["config_name"] = value
        else:
            rest.append(arg)
    return rest, where


def refusing(func, *args, **kwargs):
    """``func(*args)``, a ``ConfigError`` ending the program with its message and exit code 2, a second
    SIGTERM/SIGINT (``Interrupted``) with the signal's exit code (143, 130), any other ``SafeloopError``
    or an ``OSError`` with its message, the user's own frames (``your_frames``) and exit code 1."""
    try:
        return func(*args, **kwargs)
    except ConfigError as err:
        print(f"safeloop: {err}", file=sys.stderr)
        sys.exit(2)
    except Interrupted as err:
        print(f"safeloop: {err}", file=sys.stderr)
        sys.exit(err.code)
    except (SafeloopError, OSError) as err:
        hint = (" (free some space, or give the run another directory: hydra.run.dir=PATH, checkpoint.dir=PATH)"
                if isinstance(err, OSError) and err.errno in DISK_ERRORS else "")
        print(f"safeloop: {type(err).__name__}: {err}{hint}", file=sys.stderr)
        frames = your_frames(err)
        if frames:
            print("Traceback of your code (safeloop's, Hydra's and torch's frames left out):", *frames, sep="\n",
                  end="", file=sys.stderr)
        sys.exit(1)


DISK_ERRORS = (errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM, errno.ENOTDIR)
# Frames from these directories are not the user's code (a user's own directory may be named safeloop: a clone).
_LIBRARIES = tuple(str(path) + os.sep for path in (
    Path(__file__).parent, *(Path(m.__file__).parent for m in (hydra, omegaconf, torch, lightning_utilities)),
    sysconfig.get_paths()["stdlib"]))


def your_frames(err: BaseException) -> list[str]:
    """The frames of ``err``'s traceback in the user's own files, formatted as a traceback prints them."""
    return traceback.format_list([f for f in traceback.extract_tb(err.__traceback__)
                                  if not f.filename.startswith(_LIBRARIES)])


def check_overrides(overrides: list[str], **where) -> None:
    """Everything the command line can get wrong before a run directory is made: the overrides and the
    values (``compose``; ``where``: ``config_flags``'), a run directory that cannot be made (``hydra.run.dir``, or
    ``outputs/``), and one that another run holds (before Hydra writes this run's ``.hydra/`` over that run's)."""
    compose(overrides, **where)
    if declared := declared_sweep(overrides, **where):  # a sweep a config file declares: its values checked too
        check_sweep([*overrides, *declared], **where)
    given = [o.split("=", 1)[1] for o in overrides if o.split("=", 1)[0].lstrip("+") == "hydra.run.dir"]
    path = Path(_resolved(given[-1]) if given else "outputs").absolute()
    held_by = holder(path) if given else None
    if held_by is not None:
        raise run_dir_in_use(path, held_by)
    there = next(p for p in (path, *path.parents) if p.exists())
    if not there.is_dir() or not os.access(there, os.W_OK | os.X_OK):
        why = "is not a directory" if not there.is_dir() else "is not writable"
        raise ConfigError(f"the run directory {path} cannot be made: {there} {why}; give a directory you can write "
                          "to with hydra.run.dir=PATH")


def _resolved(value: str) -> str:
    """A command-line value with its interpolations resolved where they can be before the run
    (``${oc.env:RUN_DIR}``); as given where not (they read Hydra's own config)."""
    try:
        return str(OmegaConf.create({"value": value}).value)
    except omegaconf.errors.OmegaConfBaseException:  # Hydra reports it in the run
        return value


def check_sweep(overrides: list[str], **where) -> None:
    """A sweep's overrides before its first run, so that a bad value is refused before any run trains: each value
    of each swept key (``key=a,b``, ``range``, ``choice``) once, the other swept keys at their first value. A sweep
    with a sweeper of its own (``hydra/sweeper=optuna``) or a range that is no list of values (``interval``) is
    left to its sweeper."""
    try:
        parsed = OverridesParser.create().parse_overrides(overrides)
        if any(o.key_or_group.startswith(("hydra/sweeper", "hydra.sweeper")) or
               (o.is_sweep_override() and not o.is_discrete_sweep()) for o in parsed):
            return
        swept = {i: (o.input_line.split("=", 1)[0], list(o.sweep_string_iterator())) for i, o in enumerate(parsed)
                 if o.is_sweep_override()}
    except HydraException:  # no override, or values Hydra alone expands (glob): Hydra reports them
        return
    first = {i: f"{key}={values[0]}" for i, (key, values) in swept.items()}

    def one(changed: dict[int, str]) -> list[str]:  # the overrides of one run, in the order given
        return [changed.get(i, first.get(i, o.input_line)) for i, o in enumerate(parsed)]

    shared_checkpoints(compose(one({}), **where), swept)
    for overrides_of_run in [one({i: f"{key}={value}"}) for i, (key, values) in swept.items() for value in values[1:]]:
        compose(overrides_of_run, **where)


def shared_checkpoints(cfg: DictConfig, swept: dict) -> None:
    """A sweep of several jobs given one ``checkpoint.dir``: each job would resume the one before (``resume=auto``)
    or be refused its directory. A directory of each job's own (``${hydra:...}``) is fine."""
    given = OmegaConf.to_container(cfg.checkpoint, resolve=False).get("dir") if cfg.get("checkpoint") else None
    if given is not None and "${hydra:" not in str(given) and any(len(values) > 1 for _, values in swept.values()):
        raise ConfigError(f"checkpoint.dir={given} is one directory for every job of the sweep: each job would "
                          "resume the one before it (resume=auto), or be refused it. Leave checkpoint.dir out (each "
                          "job's checkpoints go to its run directory), or give each job its own: "
                          "checkpoint.dir=" + str(given).rstrip("/") + "/${hydra:job.num}")


@hydra.main(version_base=None, config_path=str(CONFIG_DIR), config_name="train")
def run(cfg: DictConfig) -> float:
    # Under torchrun, record() also puts the error in torchrun's failure summary (without it the summary
    # would read error_file: <N/A>), before ``refusing`` reports it.
    try:
        return refusing(record(task) if "TORCHELASTIC_ERROR_FILE" in os.environ else task, cfg)
    except SystemExit as err:  # a sweep's job that failed (not one a signal stopped): the next jobs run, as in Hydra
        if HydraConfig.get().mode != RunMode.MULTIRUN or not isinstance(err.code, int) or not 0 < err.code < 128:
            raise
        raise JobFailed(f"this job failed (exit code {err.code}, its error above); the sweep's other jobs ran") \
            from None


class JobFailed(SafeloopError):
    """A job of a sweep failed; its error was reported as the job ended."""


def task(cfg: DictConfig) -> float:
    """One training run of the composed config; returns the metric ``monitor`` names (``val_loss``: the last
    validation's), the float a sweeper optimises; the final training loss for a run that did not validate.
    The float carries the run's final losses and last validation metrics, which a sweep's table shows
    (``safeloop.sweeps.Result``)."""
    if cfg.get("threads") is not None:
        torch.set_num_threads(cfg.threads)
    try:
        trainer = train(cfg)
    except ConfigError:
        discard_run_dir()
        raise
    if trainer.stop_signal is not None:
        where = trainer.checkpointer.last if trainer.checkpointer is not None else None
        # the directory named in full: the default one is inside this run's directory, which a new command changes
        print(f"stopped by signal {trainer.stop_signal} at step {trainer.state.step}; checkpoint: {where}. "
              + (f"To continue, run the same command with trainer.resume=auto checkpoint.dir={Path(where).parent}"
                 if where is not None else "No checkpoint was written (checkpoints are off)"), file=sys.stderr)
        sys.exit(128 + trainer.stop_signal)
    return Result.of(trainer.state, cfg.get("monitor", "val_loss"))


def discard_run_dir() -> None:
    """A run refused at start-up leaves no output directory: the run directory, when it holds only what Hydra
    wrote for this run (``.hydra/``, the log), is deleted, then its parents up to the current directory
    while they are empty (``outputs/DATE/``)."""
    if not HydraConfig.initialized():  # called as a function (a program, a test), not from the command line
        return
    run_dir, cwd = Path(HydraConfig.get().runtime.output_dir), Path.cwd()
    if run_dir == cwd or {p.name for p in run_dir.iterdir()} - {".hydra", "safeloop.log"}:
        return  # the user's directory, or a run's: not made for this one alone
    shutil.rmtree(run_dir)
    for parent in run_dir.parents:
        if parent == cwd or not parent.is_relative_to(cwd) or any(parent.iterdir()):
            break
        parent.rmdir()


if __name__ == "__main__":
    main()
