"""The checkpoint directory: ``step-NNNNNNNNN.pt`` files, when one is due, which are kept (the newest ``keep``, or
the best by a ``monitor``), and which one a run resumes from."""
from __future__ import annotations

import logging
import math
import os
import re
import shutil
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from .. import fsdp
from ..callbacks import check_monitor
from ..errors import CheckpointError
from ..settings import CheckpointSettings, Settings, read
from .files import atomic_save, cause, is_rank_zero, load
from .locks import alive, lock, release

log = logging.getLogger("safeloop")

_NAME = re.compile(r"step-(\d+)\.pt")
_TEMP = re.compile(r"\..+\.(\d+)\.tmp")  # .step-000000100.pt.<pid>.tmp: a save under way, or a dead writer's


def configured(given: Mapping[str, Any] | bool | None, run_dir: str | Path | None, trainer: Settings,
               validates: bool = True) -> tuple[Checkpointer | None, list[str]]:
    """The ``Checkpointer`` that ``Trainer(checkpoint=given, run_dir=...)`` asks for (None: no checkpoints,
    when ``given`` is False or there is neither a ``dir`` nor a run directory), and every problem with it
    (``validates``: there is ``val_data``, which a ``monitor`` needs, and so is ``trainer.val_every``: without it
    only the last checkpoint would be ranked; ``trainer.resume=auto`` needs a directory)."""
    resume, val_every = trainer.resume, trainer.val_every
    settings, problems = read(CheckpointSettings, given if isinstance(given, Mapping) else {}, "checkpoint")
    if settings.monitor is not None and not validates:
        problems.append(f"checkpoint.monitor={settings.monitor!r} ranks checkpoints by a validation metric, and "
                        "there is no val_data: pass val_data=... (and val_every=N), or drop checkpoint.monitor")
    elif settings.monitor is not None and not val_every:
        problems.append(f"checkpoint.monitor={settings.monitor!r} ranks checkpoints by a validation metric, and no "
                        "validation runs during training (val_every is not set: only at its end), so the best would "
                        "always be the last: set val_every=N, the steps between validations (Lightning validates "
                        "every epoch: one pass's steps), or drop checkpoint.monitor")
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
        """With a ``monitor``: the best checkpoint in the directory (``best.txt`` names it too). Before this run has
        ranked any (a Trainer made to evaluate a finished run), the one ``best.txt`` names, if it is there."""
        ranked = self.ranked([p for p in self.saved() if p not in self.damaged])
        if ranked or self.scores:
            return ranked[0] if ranked else None
        named = self.dir / "best.txt"
        found = self.dir / named.read_text().strip() if self.monitor is not None and named.is_file() else None
        return found if found is not None and found.is_file() else None

    def ranked(self, paths: list[Path]) -> list[Path]:
        """Those of ``paths`` with a ``monitor`` value, best first (a tie: the older first; NaN last)."""
        sign = 1 if self.mode == "min" else -1
        scored = [p for p in paths if p in self.scores]
        return sorted(scored, key=lambda p: (math.isnan(self.scores[p]), sign * self.scores[p]))

    def score(self, checkpoint: Mapping, saving: bool = True) -> None:
        """Read each checkpoint's ``monitor`` value from ``checkpoint``'s validation history (every validation
        of the run so far, the one at its own step last); ``saving`` it, a ``ConfigError`` if that one lacks the
        metric (not resuming it: a run may go on monitoring a metric its validation reports from now on)."""
        history = checkpoint["state"]["val_history"] if self.monitor is not None else None
        if not history:
            return
        step, metrics = history[-1]
        if step == checkpoint["step"] and saving:
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
            raise CheckpointError(f"checkpoint directory {self.dir} cannot be used: {cause(err)}", self.dir) from err
        try:
            probe = self.dir / f".write-test.{os.getpid()}.tmp"
            with open(probe, "wb") as f:
                f.write(b"0" * 4096)
                f.flush()
                os.fsync(f.fileno())
            probe.unlink()
        except OSError as err:
            self.close()
            raise CheckpointError(f"checkpoint directory {self.dir} is not writable: {cause(err)}", self.dir) from err
        for tmp in self.dir.iterdir():
            m = _TEMP.fullmatch(tmp.name)
            if m and int(m.group(1)) != os.getpid() and not alive(int(m.group(1))):
                log.info("removing %s, left by a process that died while saving", tmp)
                tmp.unlink(missing_ok=True)
        for tmp in self.dir.glob(".step-*.shards.tmp"):  # the ranks' shards of a save a failure cut short
            log.info("removing %s, left by a save that did not complete", tmp)
            shutil.rmtree(tmp, ignore_errors=True)

    def close(self) -> None:
        """Let the directory go (the end of ``fit``)."""
        if self._lock is not None:
            release(self._lock)  # the file stays, so that no one locks a stale inode
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
        self.set_aside(checkpoint["step"])
        self.score(checkpoint, saving=False)
        self.prune()

    def from_scratch(self) -> None:
        """A run from scratch saves here: checkpoints already here are another run's, which pruning would keep over
        its own (of lower steps) and ``resume=auto`` would take: a ``CheckpointError``. Rank zero only."""
        if is_rank_zero() and (saved := self.saved()):
            raise CheckpointError(
                f"checkpoint directory {self.dir} holds the checkpoints of another run ({saved[0].name} to "
                f"{saved[-1].name}), and this run starts from scratch: pruning would delete its own as older than "
                "those, and resume=auto would go on from theirs. To go on from them, set resume=auto; to start "
                "again, give this run another checkpoint.dir, or move them away", self.dir)

    def set_aside(self, step: int) -> None:
        """Resumed at ``step`` (a restart from an earlier checkpoint, the best say): the checkpoints of later steps
        here are of the run that went on from there. Moved to ``superseded-<time>/`` (nothing is deleted), so that
        pruning and ``resume=auto`` take this run's; damaged ones stay (see ``prune``). Rank zero only."""
        later = [p for p in self.saved() if int(_NAME.fullmatch(p.name).group(1)) > step and p not in self.damaged]
        if not later or not is_rank_zero():
            return
        aside = self.dir / time.strftime("superseded-%Y%m%d-%H%M%S")
        aside.mkdir(exist_ok=True)
        for path in later:
            for part in (path, path.with_suffix(".shards")):
                if part.exists():
                    os.replace(part, aside / part.name)
        log.warning("resumed at step %d: the later checkpoints in %s (%s) are of a run that went on from there; moved "
                    "to %s, so that pruning and resume=auto take this run's", step, self.dir,
                    ", ".join(p.name for p in later), aside)

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
