"""Checkpoint files: written atomically and sealed with the SHA-256 of their bytes, read only once the seal
and what they hold are verified: tensors and plain containers alone (``torch.load(weights_only=True)``)."""
from __future__ import annotations

import errno
import hashlib
import os
import pickle
import re
import zipfile
from pathlib import Path
from typing import Any, get_origin, get_type_hints

import torch

from .. import fsdp
from ..errors import CheckpointError
from ..state import TrainState

FORMAT = 2  # 2: modules by Trainer.modules(), data as {epoch_start, iterable}, hooks' entries


def is_rank_zero() -> bool:
    """Only rank zero writes checkpoints (every rank holds the same state under DDP)."""
    dist = torch.distributed
    return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0


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
            raise CheckpointError(f"checkpoint {path} could not be saved: {cause(refused)}. The checkpoints "
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


def cause(err: OSError) -> str:
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
_DATA = {"epoch_start": (dict, type(None)), "iterable": object}


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
        problems += _kinds(checkpoint["data"], _DATA, "data")
    problems += _per_rank(checkpoint, "rank_rng", _RNG) + _per_rank(checkpoint, "rank_data", _DATA)
    if not isinstance(checkpoint.get("rank_gradients", []), list):
        problems.append(f"rank_gradients is {_a(checkpoint['rank_gradients'])}, not a list")
    for where, gradients in gradient_sets(checkpoint):
        if not isinstance(gradients, dict):
            problems.append(f"{where} is {_a(gradients)}, not a dict")
        else:
            problems += [f"{where}[{name!r}] is {_a(value)}, not a tensor" for name, value in gradients.items()
                         if not isinstance(value, torch.Tensor)]
    if problems:
        raise CheckpointError(f"{named(path)} cannot be used: " + "; ".join(problems) + ". It was not written by "
                              "safeloop's Trainer.state_dict(), or was changed since: resume from another one",
                              path)


def _per_rank(checkpoint: dict, key: str, kinds: dict[str, Any]) -> list[str]:
    """The problems of ``checkpoint[key]``, one dict per rank of ``kinds`` (none where a checkpoint has no such
    entry: written in one process, or before it was saved)."""
    ranks = checkpoint.get(key, [])
    if not isinstance(ranks, list):
        return [f"{key} is {_a(ranks)}, not a list"]
    problems = []
    for rank, entry in enumerate(ranks):
        where = f"{key}[{rank}]"
        problems += _kinds(entry, kinds, where) if isinstance(entry, dict) else [f"{where} is {_a(entry)}, not a dict"]
    return problems


def gradient_sets(checkpoint: dict) -> list[tuple[str, Any]]:
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


def named(path: Path | None) -> str:
    return f"checkpoint {path}" if path is not None else "the checkpoint"
