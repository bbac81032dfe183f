"""Checkpoint files: atomic save, safe load, which checkpoint to resume from, the data position.

What a checkpoint holds is listed by ``Trainer.state_dict()`` / ``Trainer.load_state_dict()``;
this module writes and reads it. A checkpoint is one ``torch.save`` file,
``<dir>/step-000001000.pt``, holding only tensors and plain containers, so that it loads with
``torch.load(weights_only=True)``.

Exact resume rests on two things: everything that decides the next step is in the file, and
the interrupted epoch goes on where it stopped. A data iterable with ``state_dict()`` /
``load_state_dict()`` (torchdata's ``StatefulDataLoader``, the recipes' batch makers) keeps
its own position: its state is saved and loaded, and it goes on from there. Any other is
re-drawn from the RNG states its epoch started with, then fast-forwarded past the batches
already consumed (``fast_forward``), so a shuffled epoch continues in the same order.
"""
from __future__ import annotations

import logging
import os
import pickle
import random
import re
import signal
from collections import OrderedDict
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

FORMAT = 2  # 2: modules by Trainer.modules(), data as {epoch_start, iterable}, hooks' entries
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
    if not isinstance(data, dict) or "format" not in data:
        raise CheckpointError(f"{path} is not a safeloop checkpoint (it has no 'format' entry)", path)
    if data["format"] != FORMAT:
        raise CheckpointError(f"checkpoint {path} has format {data['format']!r} and this safeloop reads format "
                              f"{FORMAT}: resume it with the safeloop version that wrote it", path)
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
        checkpoint = trainer.state_dict()  # on every rank, so that on_save_checkpoint hooks run on every rank
        if not is_rank_zero():  # the one place deciding who writes
            return None
        path = self.path(trainer.state.step)
        atomic_save(checkpoint, path)
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


# -- loading into a Trainer (Trainer.load_state_dict) -----------------------------------------
def load_modules(modules: dict[str, torch.nn.Module], checkpoint: dict, path: Path | None) -> None:
    """Load the saved state dicts into ``modules`` (``Trainer.modules()``), after checking they fit."""
    theirs = checkpoint["modules"]
    problems = [f"the Trainer has no module {name!r} (see Trainer.modules())" for name in theirs
                if name not in modules]
    problems += [f"the checkpoint has no state for the Trainer's module {name!r}" for name in modules
                 if name not in theirs]
    for name in modules.keys() & theirs.keys():
        problems += _mismatch(name, modules[name].state_dict(), theirs[name])
    if problems:
        raise CheckpointError(f"{_named(path)} was saved from a different model: " + "; ".join(problems)
                              + ". Resume with the model configuration it was saved with" + _saved_model(checkpoint),
                              path)
    for name, module in modules.items():
        module.load_state_dict(theirs[name])


def load_named(kind: str, live: dict, saved: dict, path: Path | None) -> None:
    """Load optimizers' or schedulers' state dicts by name."""
    if live.keys() != saved.keys():
        raise CheckpointError(f"{_named(path)} has {kind}s {sorted(saved)} but this run has {sorted(live)}: "
                              f"resume with the same configure_{kind}s", path)
    for name, obj in live.items():
        try:
            obj.load_state_dict(saved[name])
        except (ValueError, KeyError, RuntimeError) as err:
            raise CheckpointError(f"{_named(path)}: {kind} {name!r} does not fit this run's ({err})", path) from None


def load_scaler(scaler, saved: dict | None, path: Path | None) -> None:
    if (scaler is None) != (saved is None):
        raise CheckpointError(f"{_named(path)} was saved {'with' if saved else 'without'} a GradScaler "
                              "(precision 16) and this run is not: resume with the same precision", path)
    if scaler is not None:
        scaler.load_state_dict(saved)


def stateful(data) -> bool:
    """Whether ``data`` keeps its own position (``state_dict()`` and ``load_state_dict()``)."""
    return callable(getattr(data, "state_dict", None)) and callable(getattr(data, "load_state_dict", None))


def load_data(data, saved: dict | None) -> None:
    """Put a stateful ``data`` back where the checkpoint's stood (see the module docstring)."""
    if stateful(data) and saved is not None:
        data.load_state_dict(saved)
    elif stateful(data):
        log.warning("resume: the checkpoint holds no state for train_data (a %s with state_dict()): it goes on "
                    "from its own state, not from where the interrupted epoch stopped", type(data).__name__)
    elif saved is not None:
        log.warning("resume: the checkpoint holds the state of a data iterable and train_data (a %s) has no "
                    "load_state_dict(): the interrupted epoch is re-drawn and fast-forwarded instead",
                    type(data).__name__)


_PLAIN = (bool, int, float, complex, str, bytes, type(None))


def check_plain(value: Any, where: str) -> None:
    """Raise unless ``value`` is tensors and plain containers, which ``torch.load(weights_only=True)`` reads:
    a checkpoint that cannot be loaded would be found out only when resuming."""
    if isinstance(value, torch.Tensor) or type(value) in _PLAIN:
        return
    if type(value) in (dict, OrderedDict):
        for key, item in value.items():
            check_plain(key, f"a key of {where}")
            check_plain(item, f"{where}[{key!r}]")
    elif type(value) in (list, tuple):
        for i, item in enumerate(value):
            check_plain(item, f"{where}[{i}]")
    else:
        raise CheckpointError(
            f"on_save_checkpoint put a {type(value).__module__}.{type(value).__qualname__} at {where}: a checkpoint "
            "holds only tensors, numbers, strings, and lists, tuples and dicts of them, so that it loads with "
            "torch.load(weights_only=True). Store its state_dict() or its values instead")


def _named(path: Path | None) -> str:
    return f"checkpoint {path}" if path is not None else "the checkpoint"


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
