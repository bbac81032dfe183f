"""Checkpoints: atomic save, safe load, exact resume.

A checkpoint is one ``torch.save`` file, ``<dir>/step-000001000.pt``, holding only tensors
and plain containers, so that it loads with ``torch.load(weights_only=True)``:

- ``modules``: the state dict of every ``nn.Module`` attribute of the Trainer (``model``,
  and a subclass's own, such as ``generator`` and ``critic``)
- ``optimizers``, ``schedulers``, ``scaler``: their state dicts, by name
- ``state``: ``TrainState.state_dict()`` (step, epoch, batches consumed in the epoch, ...)
- ``rng``: torch, CUDA, Python ``random`` and NumPy generator states at the save
- ``data``: the RNG states the current epoch drew its order from (see ``fast_forward``)
- ``config``: the resolved run config as plain dicts and lists (never an OmegaConf object)

Exact resume rests on two things: everything that decides the next step is in the file,
and the interrupted epoch is re-drawn from the RNG states it started with, then
fast-forwarded past the batches already consumed, so a shuffled epoch continues in the
same order.
"""
from __future__ import annotations

import logging
import os
import pickle
import random
import re
import signal
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from .errors import CheckpointError

try:
    import numpy as np
except ImportError:  # NumPy is optional
    np = None

log = logging.getLogger("safeloop")

FORMAT = 1
_NAME = re.compile(r"step-(\d+)\.pt")


def is_rank_zero() -> bool:
    """Only rank zero writes checkpoints (every rank holds the same state under DDP)."""
    dist = torch.distributed
    return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0


# -- files -------------------------------------------------------------------------------------
def atomic_save(obj: Any, path: Path) -> None:
    """Write ``obj`` so that ``path`` is either absent, its old content, or complete; never partial.

    The temporary file is in the same directory because ``os.replace`` is atomic only
    within one file system. The data is fsynced before the rename, so the name never points
    at blocks not yet on disk, and the directory after it, so the rename survives a power cut.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    if os.name == "posix":  # a directory cannot be opened for fsync on Windows
        fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def load(path: str | Path) -> dict:
    """Read a checkpoint with ``weights_only=True``; a ``CheckpointError`` naming the file otherwise."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"checkpoint {path} does not exist (resume=PATH takes a checkpoint file or "
                              "a checkpoint directory; resume=auto finds the newest one itself)", path)
    try:
        data = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as err:
        found = re.search(r"GLOBAL (\S+)", str(err))
        what = f" ({found.group(1)})" if found else ""
        raise CheckpointError(
            f"checkpoint {path} was refused: it holds a pickled Python object{what}, not only tensors and plain "
            "containers, and unpickling it could run arbitrary code. It is corrupt or was not written by "
            "safeloop; if you trust its source, open it with torch.load(path, weights_only=False) and save "
            "the state dicts you need", path) from None
    except Exception as err:  # RuntimeError from the zip reader, EOFError for an empty file, ...
        detail = str(err).splitlines()[0] if str(err) else "empty file"
        raise CheckpointError(f"checkpoint {path} is truncated or corrupt and cannot be read "
                              f"({type(err).__name__}: {detail})", path) from None
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise CheckpointError(f"{path} is not a safeloop checkpoint (it has no 'format': {FORMAT} entry)", path)
    return data


class Checkpointer:
    """Where and how often a Trainer saves, and which checkpoint it resumes from.

    Args:
        directory: where ``step-NNNNNNNNN.pt`` files go.
        every: steps between saves (None: only at the end of ``fit`` and on SIGTERM/SIGINT).
        keep: how many of the newest checkpoints to keep; older ones are deleted.
    """

    def __init__(self, directory: str | Path, every: int | None = None, keep: int = 3):
        self.dir, self.every, self.keep = Path(directory), every, keep
        self.last: Path | None = None  # the newest checkpoint this run wrote or resumed from

    def path(self, step: int) -> Path:
        return self.dir / f"step-{step:09d}.pt"

    def saved(self) -> list[Path]:
        """Checkpoints in the directory, oldest (lowest step) first. Renamed into place only when
        complete, so a name here is never a partial write; temporary files are not listed."""
        if not self.dir.is_dir():
            return []
        found = [(int(m.group(1)), p) for p in self.dir.iterdir() if (m := _NAME.fullmatch(p.name))]
        return [p for _, p in sorted(found)]

    def save(self, trainer) -> Path | None:
        if not is_rank_zero():  # the one place deciding who writes
            return None
        path = self.path(trainer.state.step)
        atomic_save(capture(trainer), path)
        self.last = path
        for old in self.saved()[:-self.keep]:
            old.unlink(missing_ok=True)
        for tmp in self.dir.glob(".step-*.tmp"):  # left by a process killed mid-save
            if not tmp.name.endswith(f".{os.getpid()}.tmp"):
                tmp.unlink(missing_ok=True)
        log.info("step %d: checkpoint saved to %s", trainer.state.step, path)
        return path

    def find(self, resume: str | Path) -> tuple[Path, dict] | None:
        """The checkpoint ``resume`` names, loaded: ``auto`` (the newest readable one in this
        directory, or None when there is none yet), a file, or a directory of checkpoints."""
        if str(resume) == "auto":
            if not self.saved():
                log.info("resume=auto: no checkpoint in %s yet, starting from scratch", self.dir)
                return None
            return self._newest_readable()
        path = Path(resume)
        if not path.is_dir():
            return path, load(path)
        if not Checkpointer(path).saved():
            raise CheckpointError(f"resume={str(resume)!r}: the directory holds no step-*.pt checkpoint", path)
        return Checkpointer(path)._newest_readable()

    def _newest_readable(self) -> tuple[Path, dict]:
        candidates = self.saved()
        for path in reversed(candidates):
            try:
                return path, load(path)
            except CheckpointError as err:
                log.warning("resume: %s; falling back to the previous checkpoint", err)
        raise CheckpointError(f"none of the {len(candidates)} checkpoints in {self.dir} can be read (see the "
                              "warnings above); move them away to start from scratch", self.dir)


# -- what goes in, what comes out --------------------------------------------------------------
def modules(trainer) -> dict[str, torch.nn.Module]:
    """The Trainer's ``nn.Module`` attributes: ``model``, and a subclass's own (``generator``...)."""
    return {name: value for name, value in vars(trainer).items() if isinstance(value, torch.nn.Module)}


def capture(trainer) -> dict:
    return {
        "format": FORMAT,
        "step": trainer.state.step,
        "modules": {name: module.state_dict() for name, module in modules(trainer).items()},
        "optimizers": {name: opt.state_dict() for name, opt in trainer.optimizers.items()},
        "schedulers": {name: sched.state_dict() for name, sched in trainer.schedulers.items()},
        "scaler": trainer.scaler.state_dict() if trainer.scaler is not None else None,
        "state": trainer.state.state_dict(),
        "rng": rng_state(),
        "data": trainer._epoch_rng,
        "config": trainer.config,
    }


def restore(trainer, data: dict, path: Path) -> None:
    """Load ``data`` into the Trainer's modules, optimizers, schedulers, scaler and state.

    The global RNG states are left to the caller (``set_rng_state(data["rng"])``), to be set
    just before the first step, so that nothing in between draws from them.
    """
    mine = modules(trainer)
    theirs = data["modules"]
    problems = [f"the Trainer has no module attribute {name!r}" for name in theirs if name not in mine]
    problems += [f"the checkpoint has no state for the Trainer's module {name!r}" for name in mine
                 if name not in theirs]
    for name in mine.keys() & theirs.keys():
        problems += _mismatch(name, mine[name].state_dict(), theirs[name])
    if problems:
        raise CheckpointError(f"checkpoint {path} was saved from a different model: " + "; ".join(problems)
                              + ". Resume with the model configuration it was saved with"
                              + _saved_model(data), path)
    for name, module in mine.items():
        module.load_state_dict(theirs[name])
    _load_named(path, "optimizer", trainer.optimizers, data["optimizers"])
    _load_named(path, "scheduler", trainer.schedulers, data["schedulers"])
    if (trainer.scaler is None) != (data["scaler"] is None):
        raise CheckpointError(f"checkpoint {path} was saved {'with' if data['scaler'] else 'without'} a "
                              "GradScaler (precision 16) and this run is not: resume with the same precision", path)
    if trainer.scaler is not None:
        trainer.scaler.load_state_dict(data["scaler"])
    trainer.state.load_state_dict(data["state"])
    trainer._epoch_rng = data["data"]


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


def _load_named(path: Path, kind: str, live: dict, saved: dict) -> None:
    if live.keys() != saved.keys():
        raise CheckpointError(f"checkpoint {path} has {kind}s {sorted(saved)} but this run has {sorted(live)}: "
                              f"resume with the same configure_{kind}s", path)
    for name, obj in live.items():
        try:
            obj.load_state_dict(saved[name])
        except (ValueError, KeyError, RuntimeError) as err:
            raise CheckpointError(f"checkpoint {path}: {kind} {name!r} does not fit this run's ({err})", path) from None


# -- random number generators and the data position -------------------------------------------
def rng_state() -> dict:
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate(), "cuda": [], "numpy": None}
    if torch.cuda.is_available() and torch.cuda.is_initialized():  # never create a CUDA context to save
        state["cuda"] = torch.cuda.get_rng_state_all()
    if np is not None:
        kind, keys, pos, has_gauss, gauss = np.random.get_state()
        state["numpy"] = {"kind": kind, "keys": keys.tolist(), "pos": pos, "has_gauss": has_gauss, "gauss": gauss}
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    if state["cuda"] and torch.cuda.is_available() and len(state["cuda"]) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(state["cuda"])
    if state["numpy"] is not None and np is not None:
        s = state["numpy"]
        np.random.set_state((s["kind"], np.array(s["keys"], dtype=np.uint32), s["pos"], s["has_gauss"], s["gauss"]))


def _generators(data: Iterable) -> list[torch.Generator]:
    """The generators an epoch of ``data`` draws its order from: the DataLoader's and its samplers'."""
    found: list[torch.Generator] = []
    batch_sampler = getattr(data, "batch_sampler", None)
    for obj in (data, getattr(data, "sampler", None), getattr(batch_sampler, "sampler", None)):
        gen = getattr(obj, "generator", None)
        if isinstance(gen, torch.Generator) and all(gen is not g for g in found):
            found.append(gen)
    return found


def epoch_start(data: Iterable) -> dict:
    """The RNG states an epoch of ``data`` is about to draw its order from. A shuffling sampler
    without a generator of its own seeds itself from the global torch RNG, so that is kept too."""
    return {"generators": [g.get_state() for g in _generators(data)], "torch": torch.get_rng_state()}


def fast_forward(data: Iterable, start: dict | None, consumed: int) -> Iterator:
    """An iterator over the interrupted epoch of ``data``, past its first ``consumed`` batches.

    The epoch's order is re-drawn from the RNG states it started with (``start``); the
    consumed batches are loaded and dropped (the only way to get past them for any
    iterable), and the global RNG states are put back afterwards, so the next step draws
    exactly what it would have drawn without the interruption.
    """
    now = rng_state()
    if start is not None:
        gens = _generators(data)
        if len(gens) == len(start["generators"]):
            for gen, state in zip(gens, start["generators"]):
                gen.set_state(state)
        else:
            log.warning("resume: the data loader has %d generators, the checkpoint %d; the interrupted epoch "
                        "continues in a different order", len(gens), len(start["generators"]))
        torch.set_rng_state(start["torch"])
    it = iter(data)
    for _ in range(consumed):
        if next(it, _END) is _END:
            break
    set_rng_state(now)
    return it


_END = object()


# -- SIGTERM / SIGINT ---------------------------------------------------------------------------
@contextmanager
def stop_signals(trainer) -> Iterator[None]:
    """While training: SIGTERM or SIGINT asks the Trainer to finish its step, save and stop
    (``trainer.stop_signal``); a second one stops at once (KeyboardInterrupt)."""
    def handler(signum, frame):
        if trainer.stop_signal is not None:
            raise KeyboardInterrupt
        trainer.stop_signal = signum
        log.warning("%s received: finishing step %d, saving a checkpoint, then stopping (send it again to "
                    "stop at once, without saving)", signal.Signals(signum).name, trainer.state.step + 1)

    try:
        previous = {sig: signal.signal(sig, handler) for sig in (signal.SIGTERM, signal.SIGINT)}
    except ValueError:  # not the main thread: signals cannot be caught here
        yield
        return
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)
