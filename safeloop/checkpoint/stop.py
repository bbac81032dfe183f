"""Stopping a run after a step: asked by SIGTERM or SIGINT (save, then stop; a second signal stops at once), or
by the run itself (``Trainer.request_stop``)."""
from __future__ import annotations

import logging
import signal
from collections.abc import Iterator
from contextlib import contextmanager

from ..errors import Interrupted
from ..state import TrainState

log = logging.getLogger("safeloop")


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
    save cut short leaves no file. A stop, asked for by a signal or by the run (``request.reason``), lasts one fit:
    it is cleared here, as a fit starts. ``also``: signals that do as SIGTERM (SLURM's SIGUSR1, ``safeloop.slurm``)."""
    request.signum = request.reason = None
    second: list[int] = []

    def handler(signum, frame):
        if request.signum is not None:
            second.append(signum)
            raise Interrupted(signum)
        request.signum = signum
        log.warning("%s received after step %d: finishing the step under way, if any, saving a checkpoint, then "
                    "stopping (send it again to stop at once, without saving)", signal.Signals(signum).name,
                    state.step)  # (the handler cannot tell a step from the validation or save after one)

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
