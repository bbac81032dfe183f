"""``python -m safeloop [overrides]`` (also the ``safeloop`` command): a Hydra-configured training run.

With no arguments it trains the embedded default (an MLP on seeded synthetic data).
Stopped by SIGTERM or SIGINT, it saves a checkpoint and exits with 128 + the signal
number (143, 130), so that a job script can tell a preempted run from a finished one.
A configuration error (a bad override, ``device=cuda`` without CUDA, a bad guard setting)
is one message and exit code 2.
"""
from __future__ import annotations

import os
import sys

import hydra
from hydra import version
from hydra._internal.hydra import Hydra
from hydra._internal.utils import create_config_search_path, get_args_parser, run_and_report
from hydra.core.global_hydra import GlobalHydra
from hydra.errors import ConfigCompositionException
from omegaconf import DictConfig, OmegaConf
from torch.distributed.elastic.multiprocessing.errors import record

from .config import CONFIG_DIR, compose, register, train, unknown_options
from .errors import ConfigError, Interrupted

register()

HELP = """safeloop: a PyTorch training run configured by Hydra.

  python -m safeloop [group=option] [key=value] ...     (also: safeloop ...)
  python -m safeloop -m key=a,b                         a sweep, one run per value
  python -m safeloop --cfg job [overrides]              print the composed config and stop
  python -m safeloop --hydra-help                       Hydra's own options (output directory, logging, launchers)
  python -m safeloop watch train.py [args]              run your own script with the graph guard

Config groups (group=option):
{groups}
Config ({overrides}; override any key as key=value):

{config}"""


def main() -> None:
    """The ``safeloop`` command. A plain run composes its config once, here, and its configuration
    errors end it with one message and exit code 2; help, ``--cfg`` and sweeps are Hydra's own.
    ``safeloop watch script.py [args]`` runs a script under the guard (``safeloop.watch``)."""
    if sys.argv[1:2] == ["watch"]:  # no override is a bare word
        from .watch import main as watch

        sys.exit(watch(sys.argv[2:], prog="safeloop watch"))
    args = get_args_parser().parse_args(sys.argv[1:])
    if args.help:
        refusing(print_help, args.overrides)
    elif plain_run(args):
        run_and_report(lambda: refusing(run_once, args.overrides))  # any other error: Hydra's report of it
    else:
        hydra_run()


def refusing(func, *args):
    """``func(*args)``, a ``ConfigError`` ending the program with its message and exit code 2, a second
    SIGTERM/SIGINT (``Interrupted``) with the signal's exit code (143, 130)."""
    try:
        return func(*args)
    except ConfigError as err:
        print(f"safeloop: {err}", file=sys.stderr)
        sys.exit(2)
    except Interrupted as err:
        print(f"safeloop: {err}", file=sys.stderr)
        sys.exit(err.code)


def plain_run(args) -> bool:
    return not (args.hydra_help or args.cfg or args.multirun or args.shell_completion or args.info
                or args.config_name or args.config_path or args.config_dir or args.resolve
                or any(o.split("=", 1)[0].lstrip("+~") == "hydra.mode" for o in args.overrides))


def run_once(overrides: list[str]) -> None:
    """What ``@hydra.main`` does for a run, with the config composed once: Hydra's own entry point
    composes it twice (once to read ``hydra.mode``), and a check with safeloop's errors made three."""
    missing = unknown_options(overrides)
    if missing:  # Hydra would leave the optional group out without a word
        raise ConfigError(missing)
    version.setbase(None)
    app = Hydra.create_main_hydra2(task_name="safeloop", config_search_path=create_config_search_path(str(CONFIG_DIR)))
    try:
        app.run(config_name="train", task_function=job(), overrides=overrides)
    except ConfigCompositionException:
        GlobalHydra.instance().clear()
        compose(overrides)  # again, with safeloop's errors: "did you mean", every bad override at once
        raise  # nothing safeloop can say better: Hydra's message


def print_help(overrides: list[str]) -> None:
    """The groups and their options (the YAML files: the schemas behind them are not options) and the config."""
    groups = "".join(f"  {d.name}: {', '.join(sorted(f.stem for f in d.glob('*.yaml')))}\n"
                     for d in sorted(CONFIG_DIR.iterdir()) if d.is_dir())
    cfg = compose(overrides)
    print(HELP.format(groups=groups, overrides="with " + " ".join(overrides) if overrides else "the default",
                      config=OmegaConf.to_yaml(cfg)), end="")


def task(cfg: DictConfig) -> dict[str, float]:
    """One training run of the composed config; returns its final losses and last validation metrics
    (a sweep's table shows them)."""
    trainer = refusing(train, cfg)
    if trainer.stop_signal is not None:
        where = trainer.checkpointer.last if trainer.checkpointer is not None else None
        print(f"stopped by signal {trainer.stop_signal} at step {trainer.state.step}; checkpoint: {where}. "
              "Run the same command with trainer.resume=auto (and the same checkpoint.dir) to continue",
              file=sys.stderr)
        sys.exit(128 + trainer.stop_signal)
    history = trainer.state.val_history
    return {**trainer.state.floats(), **(history[-1][1] if history else {})}


def job():
    # Under torchrun, record() also puts the error in torchrun's failure summary (through Hydra
    # alone it would read error_file: <N/A>); elsewhere Hydra's own report is left as it is.
    return record(task) if "TORCHELASTIC_ERROR_FILE" in os.environ else task


def hydra_run() -> None:
    hydra.main(version_base=None, config_path=str(CONFIG_DIR), config_name="train")(job())()


if __name__ == "__main__":
    main()
