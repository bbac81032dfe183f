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
from omegaconf import DictConfig
from torch.distributed.elastic.multiprocessing.errors import record

from .config import CONFIG_DIR, composition, register, train
from .errors import ConfigError, Interrupted

register()


def main() -> None:
    """The ``safeloop`` command: ``run``, Hydra's entry point over ``configs/train.yaml`` (its ``--help``
    is ``hydra.help`` there). The overrides of a run or of ``--help`` are checked first, so that a bad one
    gets safeloop's words and exit code 2 rather than Hydra's report; the values are checked by the run
    itself (``train``), in the run directory Hydra has made. Sweeps, ``--cfg`` and Hydra's other modes
    report their own errors.
    ``safeloop watch script.py [args]`` runs a script under the guard (``safeloop.watch``)."""
    args = sys.argv[1:]
    if args[:1] == ["watch"]:  # no override is a bare word
        from .watch import main as watch

        sys.exit(watch(args[1:], prog="safeloop watch"))
    flags = {arg for arg in args if arg.startswith("-")}
    sweep = any(arg.split("=", 1)[0].lstrip("+~") == "hydra.mode" for arg in args)
    if flags <= {"-h", "--help"} and not sweep:  # a run, or --help
        refusing(check_overrides, [arg for arg in args if arg not in flags])
    run()


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


def check_overrides(overrides: list[str]) -> None:
    problems, _ = composition(overrides)
    if problems:
        raise ConfigError(problems)


@hydra.main(version_base=None, config_path=str(CONFIG_DIR), config_name="train")
def run(cfg: DictConfig) -> dict[str, float]:
    # Under torchrun, record() also puts the error in torchrun's failure summary (through Hydra
    # alone it would read error_file: <N/A>); elsewhere Hydra's own report is left as it is.
    return (record(task) if "TORCHELASTIC_ERROR_FILE" in os.environ else task)(cfg)


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


if __name__ == "__main__":
    main()
