"""A run's directories held for it alone: an exclusive ``flock`` on ``.lock`` in each, which the system lets go
when the process dies, even by SIGKILL."""
from __future__ import annotations

import csv
import os
import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from ..errors import SafeloopError
from .files import is_rank_zero

try:
    import fcntl
except ImportError:  # Windows: no directory lock
    fcntl = None

if TYPE_CHECKING:
    from .directory import Checkpointer


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


def trained_there(run_dir: Path) -> None:
    """A run from scratch in ``run_dir``: an error if its metrics.csv holds another run's rows after step 0 (a
    first step that failed leaves at most the validation before it), which this run's would be mixed with."""
    path = run_dir / "metrics.csv"
    if not path.is_file():  # (or a device: /dev/null)
        return
    with open(path, newline="") as f:
        trained = any(row and row[0].isdigit() and int(row[0]) > 0 for row in csv.reader(f))
    if trained:
        raise SafeloopError(f"run directory {run_dir} holds the metrics.csv of another run, and this run starts "
                            "from scratch: their rows would be mixed. To go on from that run, set resume=auto; to "
                            "start again, give this run its own run directory (run_dir=..., or hydra.run.dir=... on "
                            "the command line), or move metrics.csv away")


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
    """Let go of what ``lock`` returned (the end of ``fit``): unlocked first, as DataLoader workers forked while it
    was held share the lock, and a Trainer keeps its workers alive between fits (closing alone would not free it)."""
    if held is not None:
        if fcntl is not None:
            fcntl.flock(held, fcntl.LOCK_UN)
        os.close(held)


def take(run_dir: Path | None, checkpointer: Checkpointer | None, from_scratch: bool) -> Callable[[], None]:
    """Before anything is trained: take the run directory and the checkpoint directory for this run (a second
    run writing there is refused; a run ``from_scratch`` is refused one holding checkpoints: see
    ``Checkpointer.from_scratch``); returns what lets them go at the end of ``fit``."""
    held = lock_run_dir(run_dir, checkpointer)
    try:
        if from_scratch and run_dir is not None and is_rank_zero():
            trained_there(run_dir)
        if checkpointer is not None:
            checkpointer.open()
            if from_scratch:
                checkpointer.from_scratch()
    except BaseException:
        if checkpointer is not None:
            checkpointer.close()
        release(held)
        raise

    def let_go() -> None:
        if checkpointer is not None:
            checkpointer.close()
        release(held)
    return let_go


def alive(pid: int) -> bool:
    """Whether process ``pid`` runs on this machine (then its temporary file is a save under way)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # it exists, under another user
        return True
    return True
