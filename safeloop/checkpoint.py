"""Checkpoint files: atomic save, safe load, which checkpoint to resume from, the data position.

What a checkpoint holds is listed by ``Trainer.state_dict()`` / ``Trainer.load_state_dict()``;
this module writes and reads it. A checkpoint is one ``torch.save`` file,
``<dir>/step-000001000.pt``, holding only tensors and plain containers, so that it loads with
``torch.load(weights_only=True)``, and sealed with the SHA-256 of its bytes in the zip's comment.

Exact resume rests on two things: everything that decides the next step is in the file, and
the interrupted epoch goes on where it stopped. A data iterable with ``state_dict()`` /
``load_state_dict()`` (torchdata's ``StatefulDataLoader``, the recipes' batch makers) keeps
its own position: its state is saved and loaded, and it goes on from there. Any other is
re-drawn from the RNG states its epoch started with, then fast-forwarded past the batches
already consumed (``fast_forward``), so a shuffled epoch continues in the same order.
"""
from __future__ import annotations

import errno
import hashlib
import itertools
import logging
import math
import os
import pickle
import random
import shutil
import re
import signal
import socket
import time
import zipfile
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, get_origin, get_type_hints

import torch

from . import fsdp
from .callbacks import check_monitor
from .errors import CheckpointError, Interrupted, SafeloopError
from .settings import CheckpointSettings, read
from .state import TrainState

try:
    import numpy as np
except ImportError:  # NumPy is optional
    np = None
try:
    import fcntl
except ImportError:  # Windows: no directory lock
    fcntl = None

log = logging.getLogger("safeloop")

FORMAT = 2  # 2: modules by Trainer.modules(), data as {epoch_start, iterable}, hooks' entries
_NAME = re.compile(r"step-(\d+)\.pt")
_TEMP = re.compile(r"\..+\.(\d+)\.tmp")  # .step-000000100.pt.<pid>.tmp: a save under way, or a dead writer's


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
    The file is ``torch.save``'s zip, sealed: its comment holds the SHA-256 of every byte before it
    (``load`` verifies it), so the checksum is written, and renamed, with the file it covers.
    A write the system refuses (no space, a file-size limit, read-only) is a ``CheckpointError``
    naming the file and the cause; the temporary file is removed and nothing else is touched.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    writer = None
    try:
        with open(tmp, "w+b") as f:
            writer = _Recording(f)
            torch.save(obj, writer)
            _seal(f, writer.digest)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as err:
        tmp.unlink(missing_ok=True)
        # torch reports a refused write as "unexpected pos": the system's own error was recorded
        refused = writer.error if writer is not None and writer.error else err
        if isinstance(refused, OSError):
            raise CheckpointError(f"checkpoint {path} could not be saved: {_cause(refused)}. The checkpoints "
                                  f"saved before it are intact", path) from refused
        raise
    if os.name == "posix":  # a directory cannot be opened for fsync on Windows
        fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


class _Recording:
    """A file's ``write`` that hashes what it writes, and keeps the ``OSError`` it raised: torch replaces it
    with its own message."""

    def __init__(self, file):
        self.file, self.error, self.digest = file, None, hashlib.sha256()

    def write(self, data) -> int:
        try:
            written = self.file.write(data)
        except OSError as err:
            self.error = err
            raise
        self.digest.update(data)
        return written

    def flush(self) -> None:
        self.file.flush()


# The seal: the zip comment, which torch.load and zipfile read past. Its length (the last field of the zip's
# end record, 0 as torch.save writes it), then _SEAL and the SHA-256, in hex, of the file as torch.save wrote it.
_SEAL = b"safeloop sha256 "
_SEALED = 2 + len(_SEAL) + 64  # the bytes the seal takes at the end of the file
_ZIP_END = b"PK\x05\x06"  # the zip's end record (22 bytes with no comment): the last thing torch.save writes


def _seal(f, digest) -> None:
    f.seek(-22, os.SEEK_END)
    end = f.read(22)
    if end[:4] != _ZIP_END or end[-2:] != b"\0\0":  # torch.save's zip always ends so; a change must not go unseen
        raise RuntimeError(f"torch.save ended its zip with {end!r}, not an end record without comment: safeloop "
                           "cannot seal this file")
    f.seek(-2, os.SEEK_END)
    f.write((_SEALED - 2).to_bytes(2, "little") + _SEAL + digest.hexdigest().encode())


_FIXES = {
    errno.ENOSPC: "no space left on the device: free some, or set checkpoint.dir to a disk with room "
                  "(checkpoint.keep=N keeps fewer)",
    errno.EDQUOT: "the disk quota is exceeded: free some of it, or set checkpoint.dir to another disk",
    errno.EFBIG: "the file is larger than this process may write (a file-size limit such as ulimit -f, or the file "
                 "system's largest file): raise the limit, or set checkpoint.dir to another file system",
    errno.EROFS: "the file system is read-only: set checkpoint.dir to a writable directory",
    errno.EACCES: "permission denied: set checkpoint.dir to a directory this user can write",
    errno.EPERM: "permission denied: set checkpoint.dir to a directory this user can write",
    errno.ENOENT: "it cannot be created there (no such file or directory above it that can hold it): set "
                  "checkpoint.dir to a directory this user can create and write",
}


def _cause(err: OSError) -> str:
    """What went wrong with a write, and what to do, in words."""
    return _FIXES.get(err.errno, f"{type(err).__name__}: {err.strerror or err}") + f" [{err.strerror or err}]"


def load(path: str | Path) -> dict:
    """Read a checkpoint with ``weights_only=True`` after verifying its checksum (``_verify``), and check what
    it holds; a ``CheckpointError`` naming the file otherwise (a damaged file never loads)."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"checkpoint {path} does not exist (resume=PATH takes a checkpoint file or "
                              "a checkpoint directory; resume=auto finds the newest one itself)", path)
    _verify(path)
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
    except Exception as err:  # RuntimeError from the zip reader, ...
        raise _corrupt(path, f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}") from None
    if not isinstance(data, dict) or "format" not in data:
        raise CheckpointError(f"{path} is not a safeloop checkpoint (it has no 'format' entry)", path)
    if data["format"] != FORMAT:
        raise CheckpointError(f"checkpoint {path} has format {data['format']!r} and this safeloop reads format "
                              f"{FORMAT}: resume it with the safeloop version that wrote it", path)
    check_payload(data, path)
    if fsdp.SHARDS in data:
        wrong = fsdp.verify(path.parent / data[fsdp.SHARDS]["dir"], data[fsdp.SHARDS]["sha256"])
        if wrong is not None:
            raise CheckpointError(f"checkpoint {path} cannot be used: {wrong} (a file changed or was lost on disk "
                                  "or in a copy), so its values cannot be trusted", path)
    return data


def _verify(path: Path) -> None:
    """Every byte of the file against the checksum ``atomic_save`` sealed it with: one flipped bit anywhere
    (a tensor, the pickle, the zip's headers or directory) would otherwise load as a wrong number, or fail
    in the zip reader. A file without the seal, as ``torch.save`` writes it (``torch.save(trainer.state_dict(),
    path)``), has each entry checked against its CRC-32 instead, which leaves the zip's directory unchecked."""
    try:
        with open(path, "rb") as f:
            size = f.seek(0, os.SEEK_END)
            f.seek(max(0, size - _SEALED))
            tail = f.read()
            if tail[2:2 + len(_SEAL)] != _SEAL:
                _verify_entries(path)
                if tail[-22:-18] != _ZIP_END or tail[-2:] != b"\0\0":
                    raise _corrupt(path, "its end, where safeloop seals the file with a checksum, is damaged")
                return
            f.seek(0)
            digest, left = hashlib.sha256(), size - _SEALED
            while left > 0:
                chunk = f.read(min(left, 1 << 24))
                if not chunk:
                    break
                digest.update(chunk)
                left -= len(chunk)
    except OSError as err:
        raise _corrupt(path, f"{type(err).__name__}: {err}") from None
    digest.update(b"\0\0")  # the comment length as torch.save wrote it
    if tail != (_SEALED - 2).to_bytes(2, "little") + _SEAL + digest.hexdigest().encode():
        raise CheckpointError(f"checkpoint {path} is corrupt: it does not match the checksum saved with it (a bit "
                              "changed on disk or in a copy), so its values cannot be trusted", path)


def _verify_entries(path: Path) -> None:
    """Every entry of an unsealed file against the CRC-32 ``torch.save`` wrote with it."""
    try:
        with zipfile.ZipFile(path) as archive:
            bad = archive.testzip()
    except Exception as err:  # cut short, not a zip, a damaged directory (zlib.error, NotImplementedError...)
        raise _corrupt(path, f"not a complete zip archive, as torch.save writes: {err}" if str(err)
                       else "empty file") from None
    if bad is not None:
        raise CheckpointError(f"checkpoint {path} is corrupt: its entry {bad} does not match the checksum saved "
                              "with it (a bit changed on disk or in a copy), so its values cannot be trusted", path)


def _corrupt(path: Path, detail: str) -> CheckpointError:
    return CheckpointError(f"checkpoint {path} is truncated or corrupt and cannot be read ({detail})", path)


_ENTRIES = {"step": int, "modules": dict, "optimizers": dict, "schedulers": dict, "scaler": (dict, type(None)),
            "state": dict, "rng": dict, "data": dict, "config": (dict, type(None))}
_STATE = {name: get_origin(hint) or hint for name, hint in get_type_hints(TrainState).items()}
_RNG = {"torch": torch.Tensor, "python": (tuple, list), "cuda": list, "numpy": (dict, type(None))}


def check_payload(checkpoint: Any, path: Path | None = None) -> None:
    """Raise a ``CheckpointError`` listing everything in a checkpoint's structure that ``load_state_dict``
    could not use: a missing entry, an entry of the wrong type, a state key the Trainer does not have."""
    problems = _kinds(checkpoint, _ENTRIES, "")
    for group in ("modules", "optimizers", "schedulers"):
        entries = checkpoint.get(group)
        if isinstance(entries, dict):
            problems += [f"{group}[{name!r}] is {_a(value)}, not a state dict" for name, value in entries.items()
                         if not isinstance(value, dict)]
    for name, value in (checkpoint.get("optimizers") or {}).items():
        if isinstance(value, dict):
            problems += [f"optimizers[{name!r}] has no {key!r}" for key in ("state", "param_groups")
                         if key not in value]
    if isinstance(checkpoint.get("state"), dict):
        problems += _kinds(checkpoint["state"], _STATE, "state")
        problems += [f"state[{key!r}] is not a TrainState field (they are {', '.join(_STATE)})"
                     for key in checkpoint["state"] if key not in _STATE]
    if isinstance(checkpoint.get("rng"), dict):
        problems += _kinds(checkpoint["rng"], _RNG, "rng")
    if isinstance(checkpoint.get("data"), dict):
        problems += _kinds(checkpoint["data"], {"epoch_start": (dict, type(None)), "iterable": object}, "data")
    if not isinstance(checkpoint.get("rank_gradients", []), list):
        problems.append(f"rank_gradients is {_a(checkpoint['rank_gradients'])}, not a list")
    for where, gradients in _gradient_sets(checkpoint):
        if not isinstance(gradients, dict):
            problems.append(f"{where} is {_a(gradients)}, not a dict")
        else:
            problems += [f"{where}[{name!r}] is {_a(value)}, not a tensor" for name, value in gradients.items()
                         if not isinstance(value, torch.Tensor)]
    if problems:
        raise CheckpointError(f"{_named(path)} cannot be used: " + "; ".join(problems) + ". It was not written by "
                              "safeloop's Trainer.state_dict(), or was changed since: resume from another one",
                              path)


def _gradient_sets(checkpoint: dict) -> list[tuple[str, Any]]:
    """The saved gradients, each set with the name errors give it: ``gradients`` (absent from checkpoints
    written before they were saved) and, from torchrun in manual mode, ``rank_gradients[r]``."""
    every = checkpoint.get("rank_gradients", [])
    every = every if isinstance(every, list) else []
    return [("gradients", checkpoint.get("gradients", {})),
            *((f"rank_gradients[{rank}]", grads) for rank, grads in enumerate(every))]


def _kinds(entries: dict, kinds: dict[str, Any], where: str) -> list[str]:
    """A problem for each key of ``kinds`` missing from ``entries`` or of another type."""
    out = []
    for key, kind in kinds.items():
        name = f"{where}[{key!r}]" if where else repr(key)
        if key not in entries:
            out.append(f"{name} is missing")
        elif not isinstance(entries[key], kind) or (kind is int and isinstance(entries[key], bool)):
            out.append(f"{name} is {_a(entries[key])}")
    return out


def _a(value: Any) -> str:
    name = type(value).__name__
    return f"{'an' if name[:1] in 'aeiouAEIOU' else 'a'} {name} ({repr(value)[:40]})"


def configured(given: Mapping[str, Any] | bool | None, run_dir: str | Path | None, resume: str | Path | None,
               validates: bool = True) -> tuple[Checkpointer | None, list[str]]:
    """The ``Checkpointer`` that ``Trainer(checkpoint=given, run_dir=...)`` asks for (None: no checkpoints,
    when ``given`` is False or there is neither a ``dir`` nor a run directory), and every problem with it
    (``validates``: there is ``val_data``, which a ``monitor`` needs)."""
    settings, problems = read(CheckpointSettings, given if isinstance(given, Mapping) else {}, "checkpoint")
    if settings.monitor is not None and not validates:
        problems.append(f"checkpoint.monitor={settings.monitor!r} ranks checkpoints by a validation metric, and "
                        "there is no val_data: pass val_data=... (and val_every=N), or drop checkpoint.monitor")
    where = settings.dir or (Path(run_dir) / "checkpoints" if isinstance(run_dir, (str, Path)) else None)
    saves = given is not False and where is not None
    if str(resume) == "auto" and not saves:
        problems.append("resume=auto looks in the checkpoint directory, and there is none: pass run_dir=... "
                        "or checkpoint={'dir': ...}")
    if not saves or problems:
        return None, problems
    return Checkpointer(where, settings.every, settings.keep, settings.monitor, settings.mode,
                        settings.sharded), problems


class Checkpointer:
    """Where and how often a Trainer saves, and which checkpoint it resumes from.

    Args:
        directory: where ``step-NNNNNNNNN.pt`` files go.
        every: steps between saves (None: only at the end of ``fit`` and on SIGTERM/SIGINT).
        keep: how many of the newest checkpoints to keep; older ones are deleted.
        monitor: a validation metric (None: keep the newest). Then a checkpoint is also saved at every
            validation during training, ranked by the metric of the validation at its step; the ``keep`` best
            and the newest (what ``resume=auto`` takes) are kept, and ``best.txt`` names the best.
        mode: ``min`` or ``max``: whether a lower or a higher ``monitor`` is better.
    """

    def __init__(self, directory: str | Path, every: int | None = None, keep: int = 3, monitor: str | None = None,
                 mode: str = "min", sharded: bool = False):
        self.dir, self.every, self.keep, self.monitor, self.mode = Path(directory), every, keep, monitor, mode
        self.sharded = sharded  # under FSDP2: each rank writes its shards (safeloop.fsdp.save_shards)
        self.scores: dict[Path, float] = {}  # with a monitor: each checkpoint's metric, by its step's validation
        self.last: Path | None = None  # the newest checkpoint this run wrote or resumed from
        self.damaged: set[Path] = set()  # checkpoints that failed to load here: not counted toward keep
        self._lock: int | None = None  # the open lock file while this run holds the directory

    def path(self, step: int) -> Path:
        return self.dir / f"step-{step:09d}.pt"

    def due(self, step: int, validated: bool) -> bool:
        """Whether the Trainer saves after ``step``: every ``every`` steps, and with a ``monitor`` after every
        validation (``validated``), so that the checkpoint has its metric."""
        return bool(self.every and step % self.every == 0) or (validated and self.monitor is not None)

    def due_at_end(self, step: int, validated: bool) -> bool:
        """Whether ``fit`` saves as it ends: unless this step's checkpoint is written already, and the end of ``fit``
        did not validate after it (``validated``), so that the last checkpoint holds the last metrics."""
        return validated or self.last != self.path(step)

    @property
    def best(self) -> Path | None:
        """With a ``monitor``: the best checkpoint in the directory (``best.txt`` names it too)."""
        ranked = self.ranked([p for p in self.saved() if p not in self.damaged])
        return ranked[0] if ranked else None

    def ranked(self, paths: list[Path]) -> list[Path]:
        """Those of ``paths`` with a ``monitor`` value, best first (a tie: the older first; NaN last)."""
        sign = 1 if self.mode == "min" else -1
        scored = [p for p in paths if p in self.scores]
        return sorted(scored, key=lambda p: (math.isnan(self.scores[p]), sign * self.scores[p]))

    def score(self, checkpoint: Mapping) -> None:
        """Read each checkpoint's ``monitor`` value from ``checkpoint``'s validation history (every validation
        of the run so far, the one at its own step last); a ``ConfigError`` if that one lacks the metric."""
        history = checkpoint["state"]["val_history"] if self.monitor is not None else None
        if not history:
            return
        step, metrics = history[-1]
        if step == checkpoint["step"]:
            check_monitor("checkpoint", self.monitor, metrics)
        self.scores = {self.path(s): m[self.monitor] for s, m in history if self.monitor in m}

    def saved(self) -> list[Path]:
        """Checkpoints in the directory, oldest (lowest step) first. Renamed into place only when
        complete, so a name here is never a partial write; temporary files are not listed."""
        if not self.dir.is_dir():
            return []
        found = [(int(m.group(1)), p) for p in self.dir.iterdir() if (m := _NAME.fullmatch(p.name))]
        return [p for _, p in sorted(found)]

    def open(self) -> None:
        """At start-up, before anything is trained: take the directory (a second run saving there gets a
        ``CheckpointError`` naming the run holding it), prove that a file can be written there, and
        remove the temporary files of writers that died mid-save. Rank zero only: it alone writes."""
        if self._lock is not None or not is_rank_zero():
            return
        try:
            self._lock = lock(self.dir, lambda holder: CheckpointError(
                f"checkpoint directory {self.dir} is in use by another run ({holder}): two runs saving there would "
                "overwrite and delete each other's checkpoints. Give this run its own directory (checkpoint.dir=...), "
                "or wait until that run ends", self.dir))
        except OSError as err:
            raise CheckpointError(f"checkpoint directory {self.dir} cannot be used: {_cause(err)}", self.dir) from err
        try:
            probe = self.dir / f".write-test.{os.getpid()}.tmp"
            with open(probe, "wb") as f:
                f.write(b"0" * 4096)
                f.flush()
                os.fsync(f.fileno())
            probe.unlink()
        except OSError as err:
            self.close()
            raise CheckpointError(f"checkpoint directory {self.dir} is not writable: {_cause(err)}", self.dir) from err
        for tmp in self.dir.iterdir():
            m = _TEMP.fullmatch(tmp.name)
            if m and int(m.group(1)) != os.getpid() and not _alive(int(m.group(1))):
                log.info("removing %s, left by a process that died while saving", tmp)
                tmp.unlink(missing_ok=True)
        for tmp in self.dir.glob(".step-*.shards.tmp"):  # the ranks' shards of a save a failure cut short
            log.info("removing %s, left by a save that did not complete", tmp)
            shutil.rmtree(tmp, ignore_errors=True)

    def close(self) -> None:
        """Let the directory go (the end of ``fit``)."""
        if self._lock is not None:
            os.close(self._lock)  # closing releases the lock; the file stays, so that no one locks a stale inode
            self._lock = None

    def save(self, step: int, checkpoint: dict) -> Path | None:
        """Write ``checkpoint`` (``Trainer.state_dict()``, made on every rank, so that ``on_save_checkpoint``
        hooks run on every rank) as step ``step``'s, then delete the oldest beyond ``keep``. Rank zero writes."""
        path = self.path(step)
        self.score(checkpoint)
        checkpoint, shards = fsdp.split(checkpoint)
        if shards:  # checkpoint.sharded under FSDP2: every rank writes its own, before rank zero's file
            checkpoint[fsdp.SHARDS] = fsdp.save_shards(shards, self.dir, f"{path.stem}.shards")
        if not is_rank_zero():  # the one place deciding who writes
            self.last = path  # on every rank: the end of fit saves again only where this differs, on all alike
            return None
        atomic_save(checkpoint, path)
        self.last = path
        self.damaged.discard(path)
        self.prune()  # only once the new one is complete
        log.info("step %d: checkpoint saved to %s", step, path)
        return path

    def resumed(self, path: Path, checkpoint: Mapping) -> None:
        """The run resumed from ``path`` (``checkpoint``, loaded): the newest checkpoint it has; and the directory
        is pruned to ``keep`` (a run killed between a save and its pruning left more)."""
        self.last = path
        self.score(checkpoint)
        self.prune()

    def prune(self) -> None:
        """Delete the checkpoints older than the newest ``keep`` that are not known to be damaged (after each save,
        and on resuming). A damaged one newer than those stays: it does not count, and is not deleted. With a
        ``monitor``: delete those older than the newest good one but the ``keep`` best, and name the best in
        ``best.txt``. Rank zero; the directory is this run's."""
        if not is_rank_zero():
            return
        saved = self.saved()
        good = [p for p in saved if p not in self.damaged]
        if self.monitor is not None and good:
            best = self.ranked(good)[:self.keep]
            for old in saved[:saved.index(good[-1])]:
                if old not in best:
                    old.unlink(missing_ok=True)
            if best:
                self.name_best(best[0])
        elif len(good) > self.keep:
            for old in saved[:saved.index(good[-self.keep])]:
                old.unlink(missing_ok=True)
        for shards in self.dir.glob("step-*.shards"):  # a pruned checkpoint's, or one whose file was never written
            if not shards.with_suffix(".pt").exists():
                shutil.rmtree(shards, ignore_errors=True)

    def name_best(self, path: Path) -> None:
        """Write ``path``'s file name to ``best.txt`` (a text file rather than a link: links need privileges on
        Windows), atomically, when it changes."""
        pointer = self.dir / "best.txt"
        if pointer.is_file() and pointer.read_text().strip() == path.name:
            return
        tmp = pointer.with_name(f".best.txt.{os.getpid()}.tmp")
        tmp.write_text(path.name + "\n")
        os.replace(tmp, pointer)
        log.info("best checkpoint: %s (%s %.4g)", path, self.monitor, self.scores[path])

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
                self.damaged.add(path)
                log.warning("resume: %s; falling back to the previous checkpoint", err)
        raise CheckpointError(f"none of the {len(candidates)} checkpoints in {self.dir} can be read (see the "
                              "warnings above); move them away to start from scratch", self.dir)


def lock(directory: Path, in_use: Callable[[str], Exception]) -> int:
    """Hold ``directory`` for this run (its checkpoint directory, its run directory): an exclusive ``flock`` on
    ``<directory>/.lock``, which the system releases when the process dies, even by SIGKILL, the file naming
    the holder. Returns the open file (closing it lets go). While another run holds it, raises
    ``in_use(that run, in words)``; an ``OSError`` (the directory cannot be made or written) is the caller's."""
    directory.mkdir(parents=True, exist_ok=True)
    fd = os.open(directory / ".lock", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        if fcntl is not None:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                holder = os.read(fd, 200).decode(errors="replace").strip()
                raise in_use(holder or "a process that is just starting") from None
        os.ftruncate(fd, 0)
        os.write(fd, f"process {os.getpid()} on {socket.gethostname()}, since "
                     f"{time.strftime('%Y-%m-%d %H:%M:%S')}".encode())
    except BaseException:
        os.close(fd)
        raise
    return fd


def lock_run_dir(run_dir: Path | None, checkpointer: Checkpointer | None) -> int | None:
    """``lock`` on the run directory, where metrics.csv and graph pictures go; rank zero, which writes them
    (none when there is no run directory, or it is the checkpoint directory, which the ``Checkpointer`` holds)."""
    if run_dir is None or not is_rank_zero() or (checkpointer is not None and
                                                 checkpointer.dir.resolve() == run_dir.resolve()):
        return None
    try:
        return lock(run_dir, lambda holder: run_dir_in_use(run_dir, holder))
    except OSError as err:
        raise SafeloopError(f"run directory {run_dir} cannot be used: {err.strerror or err} ({err.filename})") from err


def run_dir_in_use(run_dir: Path, holder: str) -> SafeloopError:
    return SafeloopError(f"run directory {run_dir} is in use by another run ({holder}): two runs writing there would "
                         "interleave their metrics.csv. Give this run its own run directory (run_dir=..., or "
                         "hydra.run.dir=... on the command line), or wait until that run ends")


def holder(directory: Path) -> str | None:
    """Who holds ``directory`` (see ``lock``), in words; None when no run does. Takes nothing."""
    if fcntl is None or not (directory / ".lock").is_file():
        return None
    fd = os.open(directory / ".lock", os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)  # let go at the close below
    except OSError:
        return os.read(fd, 200).decode(errors="replace").strip() or "a process that is just starting"
    finally:
        os.close(fd)
    return None


def release(held: int | None) -> None:
    """Let go of what ``lock_run_dir`` returned (the end of ``fit``)."""
    if held is not None:
        os.close(held)


def take(run_dir: Path | None, checkpointer: Checkpointer | None) -> Callable[[], None]:
    """Before anything is trained: take the run directory and the checkpoint directory for this run (a second
    run writing there is refused); returns what lets them go at the end of ``fit``."""
    held = lock_run_dir(run_dir, checkpointer)
    try:
        if checkpointer is not None:
            checkpointer.open()
    except BaseException:
        release(held)
        raise

    def let_go() -> None:
        if checkpointer is not None:
            checkpointer.close()
        release(held)
    return let_go


def _alive(pid: int) -> bool:
    """Whether process ``pid`` runs on this machine (then its temporary file is a save under way)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # it exists, under another user
        return True
    return True


# -- what a Trainer saves and loads (Trainer.state_dict / load_state_dict) ----------------------
@dataclass
class Parts:
    """What a checkpoint holds, as the Trainer hands it down: its modules (``Trainer.modules()``) and their
    named parameters, optimizers, schedulers, grad scaler, ``TrainState``, ``TrainData`` (where the data
    stands), and, under torchrun in manual mode, ``gather``: the ``Distributed`` whose ranks' gradients differ."""

    modules: dict[str, torch.nn.Module]
    parameters: list[tuple[str, torch.nn.Parameter]]
    optimizers: dict[str, torch.optim.Optimizer]
    schedulers: dict[str, Any]
    scaler: Any
    state: TrainState
    data: Any
    gather: Any = None
    sharded: bool = False  # checkpoint.sharded: FSDP2's DTensors kept as they are (each rank writes its shards)


def collect(parts: Parts, config: dict | None) -> dict:
    """A checkpoint of ``parts``: tensors and plain containers only, so that it loads with
    ``torch.load(weights_only=True)``. ``gradients`` are those the last step left on the parameters (manual
    mode accumulating over steps); under torchrun their mean over the ranks, and each rank's in
    ``rank_gradients`` (gathered: every rank must call this). Under FSDP2 the full tensors, gathered from
    every rank's shards (also a collective call), unless ``parts.sharded``."""
    full = (lambda value: value) if parts.sharded else fsdp.full
    checkpoint = {
        "format": FORMAT,
        "step": parts.state.step,
        "modules": {name: full(module.state_dict()) for name, module in parts.modules.items()},
        "optimizers": {name: full(opt.state_dict()) for name, opt in parts.optimizers.items()},
        "optimizer_classes": optimizer_classes(parts.optimizers),
        "schedulers": {name: sched.state_dict() for name, sched in parts.schedulers.items()},
        "scaler": parts.scaler.state_dict() if parts.scaler is not None else None,
        "state": parts.state.state_dict(),
        "rng": rng_state(),
        "data": parts.data.state_dict(),
        "gradients": {name: full(p.grad.detach()) for name, p in parts.parameters if p.grad is not None},
        "config": config,
    }
    if parts.gather is not None and not parts.gather.sharded:  # FSDP2's gradients are the ranks' mean already
        every = parts.gather.gather({name: grad.cpu() for name, grad in checkpoint["gradients"].items()})
        checkpoint["gradients"], checkpoint["rank_gradients"] = mean_gradients(every), every
    return checkpoint


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
    parts.data.load_state_dict(checkpoint["data"])
    load_modules(parts.modules, checkpoint)
    load_gradients(parts.parameters, gradients_for(checkpoint, dist))
    load_optimizers(parts.optimizers, checkpoint, path)
    load_named("scheduler", parts.schedulers, checkpoint["schedulers"], path)
    load_scaler(parts.scaler, checkpoint["scaler"])
    parts.state.load_state_dict(checkpoint["state"])
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
                 if name not in theirs]
    for name in modules.keys() & theirs.keys():
        problems += _mismatch(name, modules[name].state_dict(), theirs[name])
    live = dict(parameters)
    for where, grads in _gradient_sets(checkpoint):
        problems += [f"{where}[{name!r}] names no parameter of the Trainer's modules" for name in grads
                     if name not in live]
        problems += [f"{where}[{name!r}] has shape {tuple(grad.shape)} and the parameter {tuple(live[name].shape)}"
                     for name, grad in grads.items() if name in live and grad.shape != live[name].shape]
    if problems:
        raise CheckpointError(f"{_named(path)} was saved from a different model: " + "; ".join(problems)
                              + ". Resume with the model configuration it was saved with" + _saved_model(checkpoint),
                              path)


def load_modules(modules: dict[str, torch.nn.Module], checkpoint: dict) -> None:
    """Load the saved state dicts into ``modules`` (``Trainer.modules()``; ``check_fits`` first)."""
    for name, module in modules.items():
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


def gradients_for(checkpoint: dict, dist) -> dict[str, torch.Tensor]:
    """The gradients this process resumes with: its own rank's when the checkpoint was written by as many
    ranks (bit-identical), else the checkpoint's ``gradients`` (under torchrun, the ranks' mean: the same
    update up to the summation order)."""
    every = checkpoint.get("rank_gradients")
    if every is not None and dist is not None and len(every) == dist.world:
        return every[dist.rank]
    return checkpoint.get("gradients", {})


def check_names(kind: str, live: dict, saved: dict, path: Path | None) -> None:
    if live.keys() != saved.keys():
        raise CheckpointError(f"{_named(path)} has {kind}s {sorted(saved)} but this run has {sorted(live)}: "
                              f"resume with the same configure_{kind}s", path)


def load_named(kind: str, live: dict, saved: dict, path: Path | None) -> None:
    """Load optimizers' or schedulers' state dicts by name (``check_fits`` first)."""
    for name, obj in live.items():
        try:
            obj.load_state_dict(saved[name])
        except (ValueError, KeyError, RuntimeError) as err:
            raise CheckpointError(f"{_named(path)}: {kind} {name!r} does not fit this run's ({err})", path) from None


def optimizer_classes(optimizers: dict[str, torch.optim.Optimizer]) -> dict[str, str]:
    """What a checkpoint records of each optimizer besides its state: its class."""
    return {name: _class_name(type(opt)) for name, opt in optimizers.items()}


def check_optimizers(optimizers: dict[str, torch.optim.Optimizer], checkpoint: dict, path: Path | None,
                     names: dict[int, str] | None = None) -> None:
    """Each optimizer is of the class it was saved from, with as many parameters in each group, each of the
    shape its saved state has (``names``: the parameters' names by ``id``, for the message)."""
    saved, classes = checkpoint["optimizers"], checkpoint.get("optimizer_classes") or {}
    check_names("optimizer", optimizers, saved, path)
    for name, opt in optimizers.items():
        mine, was = _class_name(type(opt)), classes.get(name)
        groups = saved[name]["param_groups"]
        keys = {k for g in groups for k in g} - {"params"}, {k for g in opt.param_groups for k in g} - {"params"}
        if (was is not None and was != mine) or (was is None and groups and keys[0] != keys[1]):
            raise CheckpointError(
                f"{_named(path)}: optimizer {name!r} was saved from "
                f"{was or 'an optimizer with the settings ' + ', '.join(sorted(keys[0]))} "
                f"and this run's is {mine}: an optimizer's state does not carry over to another class. Resume with "
                f"the optimizer it was saved with, or start a new run without resume", path)
        sizes = [len(g["params"]) for g in groups], [len(g["params"]) for g in opt.param_groups]
        if sizes[0] != sizes[1]:
            raise CheckpointError(f"{_named(path)}: optimizer {name!r} does not fit this run's (parameters per group: "
                                  f"{sizes[0]} saved, {sizes[1]} now): resume with the same configure_optimizers",
                                  path)
        live = [p for g in opt.param_groups for p in g["params"]]
        for i, p in enumerate(live):  # the state is saved by position: a parameter in another place gets another's
            shapes = {tuple(v.shape) for v in saved[name]["state"].get(i, {}).values()
                      if isinstance(v, torch.Tensor) and v.dim() > 0}
            if shapes and shapes != {tuple(p.shape)}:
                raise CheckpointError(
                    f"{_named(path)}: optimizer {name!r} saved state of shape {sorted(shapes)[0]} for its parameter "
                    f"{i}, and this run's parameter {i} ({(names or {}).get(id(p), 'unnamed')}) has shape "
                    f"{tuple(p.shape)}: its parameters are in another order, or are others. Resume with "
                    "configure_optimizers listing the parameters as when it was saved", path)


def check_schedulers(schedulers: dict, saved: dict, path: Path | None) -> None:
    """Each scheduler has the settings it was saved with (a state dict does not name its class)."""
    for name, scheduler in schedulers.items():
        keys = [{k for k in state if not k.startswith("_")} for state in (saved[name], scheduler.state_dict())]
        if keys[0] != keys[1]:
            raise CheckpointError(
                f"{_named(path)}: scheduler {name!r} was saved from another class of scheduler (with "
                f"{', '.join(sorted(keys[0] - keys[1])) or 'fewer settings'}; this run's {type(scheduler).__name__} "
                f"has {', '.join(sorted(keys[1] - keys[0])) or 'no others'}): a scheduler's state does not carry over "
                "to another class. Resume with the scheduler it was saved with, or start a new run without resume",
                path)


def load_optimizers(optimizers: dict[str, torch.optim.Optimizer], checkpoint: dict, path: Path | None) -> None:
    """Load the optimizers' states (``check_fits`` first). Where this run's hyperparameters differ from
    the checkpoint's, the checkpoint's are kept (the run goes on as it was), and a warning says so."""
    saved = checkpoint["optimizers"]
    for name, opt in optimizers.items():
        groups = saved[name]["param_groups"]
        differ = [f"{key} {_show(g_saved[key])} (this run: {_show(g_live[key])})"
                  for i, (g_live, g_saved) in enumerate(zip(opt.param_groups, groups))
                  for key in g_live if key != "params" and key in g_saved and not _same(g_live[key], g_saved[key])
                  and not (key == "lr" and "initial_lr" in g_live and "initial_lr" in g_saved)]  # a scheduler's
        if differ:
            log.warning("resume: optimizer %r of %s has %s: the checkpoint's values are used, so the run goes on as "
                        "it was. To use this run's, set them in on_load_checkpoint (trainer.optimizers[%r]"
                        ".param_groups)", name, _named(path), ", ".join(differ), name)
    load_named("optimizer", optimizers, {name: fsdp.optimizer_shards(opt, saved[name]) for name, opt in
                                         optimizers.items()}, path)


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
    if (scaler is None) != (saved is None):
        raise CheckpointError(f"{_named(path)} was saved {'with' if saved else 'without'} a GradScaler "
                              "(precision 16) and this run is not: resume with the same precision", path)


def load_scaler(scaler, saved: dict | None) -> None:
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
    exactly what it would have drawn without the interruption. A list or tuple draws nothing:
    it is only stepped past them.
    """
    if isinstance(data, (list, tuple)):
        return itertools.islice(data, consumed, None)
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
class StopRequest:
    """A stop asked for: by SIGTERM or SIGINT (``signum`` is its number), or by the run itself (``reason``, from
    ``Trainer.request_stop``: ``EarlyStopping``). None: none yet."""

    signum: int | None = None
    reason: str | None = None
    AGREE_EVERY = 8  # under torchrun: steps between the ranks' agreements on a stop

    def ask(self, reason: str, step: int) -> None:
        if self.reason is None:
            log.info("%s: stopping after step %d", reason, step)
        self.reason = reason

    def agreed(self, step: int, dist) -> bool:
        """Whether training stops after ``step``. A stop the run asked for is asked for on every rank alike
        (``EarlyStopping`` decides on validation metrics, which are the same on every rank). Under torchrun
        (``dist``) a rank stops for a signal only together with the others: signals reach ranks at different
        moments, so every ``AGREE_EVERY`` steps the ranks share the signal any of them got (one small
        all-reduce) and all stop after that same step."""
        if self.reason is not None:
            return True
        if dist is None:
            return self.signum is not None
        if step % self.AGREE_EVERY:
            return False
        signum = dist.agree(self.signum or 0)
        if signum and self.signum is None:
            self.signum = signum
        return bool(signum)


@contextmanager
def stop_signals(request: StopRequest, state: TrainState, also: tuple[int, ...] = ()) -> Iterator[None]:
    """While training: SIGTERM or SIGINT sets ``request``, and the Trainer finishes its step, saves and
    stops; a second one stops at once, without saving: ``Interrupted``, whose ``code`` (128 + the
    signal: 143, 130) ``python -m safeloop`` exits with. Older checkpoints are left as they are, and a
    save cut short leaves no file. A stop the run asked for (``request.reason``) lasts one fit: it is cleared
    here, as a fit starts. ``also``: signals that do as SIGTERM (SLURM's SIGUSR1, ``safeloop.slurm``)."""
    request.reason = None
    second: list[int] = []

    def handler(signum, frame):
        if request.signum is not None:
            second.append(signum)
            raise Interrupted(signum)
        request.signum = signum
        log.warning("%s received: finishing step %d, saving a checkpoint, then stopping (send it again to "
                    "stop at once, without saving)", signal.Signals(signum).name, state.step + 1)

    try:
        previous = {sig: signal.signal(sig, handler) for sig in (signal.SIGTERM, signal.SIGINT, *also)}
    except ValueError:  # not the main thread: signals cannot be caught here
        yield
        return
    try:
        yield
    except BaseException as err:
        if second and not isinstance(err, Interrupted):  # raised inside torch.save, it comes out as torch's error
            raise Interrupted(second[0]) from err
        raise
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)
