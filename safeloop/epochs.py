"""``train_data`` and where a pass over it stands.

``TrainData.steps`` gives each step its micro-batches (``grad_accum`` of them in a row; fewer at the
end of a pass, as Lightning does: no update spans two passes), pass after pass, calling the epoch
hooks and stepping the epoch schedulers at each pass's edges. After a resume it goes on mid-pass:
an iterable that keeps its own position (``state_dict()`` / ``load_state_dict()``) from that
position, any other re-drawn from the RNG states its pass started with and fast-forwarded past the
batches already consumed (``safeloop.checkpoint.fast_forward``).
"""
from __future__ import annotations

import inspect
import logging
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING

from torch.utils.data import DataLoader, IterableDataset


from . import checkpoint as ckpt
from .callbacks import Hooks
from .errors import ConfigError
from .schedules import Schedules
from .seed import seeded_workers
from .state import TrainState

log = logging.getLogger("safeloop")
PASS_END = object()  # what ``TrainData.steps`` yields once a pass's end has run (the epoch schedulers, the hook)

if TYPE_CHECKING:
    from .settings import Settings


class TrainData:
    """The Trainer's ``train_data`` (``data``), the pass it is in (``state.epoch``, ``state.batch_in_epoch``)
    and, under torchrun, this rank's share of it (``shard``: see ``safeloop.distributed.Distributed.shard``)."""

    def __init__(self, data: Iterable, state: TrainState):
        self.data, self.state = data, state
        self.epoch_rng: dict | None = None  # the RNG states the current pass's order was drawn from
        self.shard: Callable[[Iterable], Iterable] | None = None
        self._sharded: Iterable | None = None  # the data this rank's share was made as
        # where the last fit() stopped: (its step iterator, grad_accum, data, step, batch): the next goes on from there
        self.left: tuple | None = None
        self._steps: Iterator | None = None  # the current fit's ``steps`` (its pass ends too: see ``keep``)
        self.schedules_stepped: int | None = None  # the last pass whose end stepped the epoch schedulers

    def batches(self, settings: Settings, hooks: Hooks, schedules: Schedules, stop: ckpt.StopRequest) -> Iterator:
        """The steps of a fit (``steps``: each step's micro-batches, and ``PASS_END`` after each pass's end): the
        last fit's iterator where it stopped (so that nothing is read again) when ``data``, ``grad_accum`` and the
        position are as then and no checkpoint was loaded since; ``steps`` anew otherwise."""
        left, self.left = self.left, None
        if self.state.step == 0:  # nothing trained yet (a first step failed: out of memory, say): the run starts over
            left, self.state.epoch, self.state.batch_in_epoch = None, 0, 0
        if left is not None and left[1:] == (settings.grad_accum, self.data, *self._where()):
            self._steps = left[0]
        else:
            self._steps = self.steps(settings, hooks, schedules, stop)
        return self._steps

    def keep(self, grad_accum: int, failed: bool = False) -> None:
        """A fit stopped after this step (``failed``: in it, the step abandoned): the next one goes on with its
        iterator from here, unless an error inside it (``on_epoch_end``...) ended it. A pass whose last batch the
        step took (data whose length is known) ends now, as Lightning ends it: its epoch schedulers step and
        ``on_epoch_end`` runs, before the end of ``fit`` validates and saves (a failed fit: the next fit ends it)."""
        if inspect.getgeneratorstate(self._steps) == inspect.GEN_CLOSED:
            return
        length = _length(self.data)
        if not failed and length is not None and self.state.batch_in_epoch >= length:
            if next(self._steps, None) is None:  # on_epoch_end asked to stop: the next fit begins the next pass
                return
        self.left = self._steps, grad_accum, self.data, *self._where()

    def _where(self) -> tuple[int, int]:
        return self.state.step, self.state.batch_in_epoch

    def steps(self, settings: Settings, hooks: Hooks, schedules: Schedules, stop: ckpt.StopRequest) -> Iterator[list]:
        """Each step's micro-batches (``settings.grad_accum`` of them, as it is when each pass begins, after
        ``on_epoch_start``: Lightning's ``GradientAccumulationScheduler``), forever or for ``settings.max_epochs``
        passes. A change in the middle of a pass is refused: that pass's batches are grouped by the old value.
        A stop asked for in ``on_epoch_start`` or ``on_epoch_end`` ends them there, before the pass's first step
        (``stop``: ``Trainer.request_stop``'s, EarlyStopping on a validation the hook ran), as in Lightning."""
        state, pending = self.state, []
        while settings.max_epochs is None or state.epoch < settings.max_epochs:
            start = state.batch_in_epoch  # > 0: going on mid-pass (a resume)
            if not start:  # before the pass draws anything: the generators as the last pass left them (a resume too)
                if self.epoch_rng is not None and state.epoch > 0:
                    ckpt.set_generators(self.data, self.epoch_rng)
                hooks("on_epoch_start")  # which may reseed them, or replace the data: its RNG states are taken after
                if stop.reason is not None:
                    return
                self.shard_again()
            grad_accum = settings.grad_accum
            data = seeded_workers(self.data)  # seed_everything(..., workers=True)
            for sampler in epoch_samplers(data):  # a new order each pass (DistributedSampler, a bucketing sampler's)
                sampler.set_epoch(state.epoch)
            if start and ckpt.stateful(data):  # it goes on from its own (loaded) position
                batches = data
            elif start:  # the order the pass had before the interruption, past the batches consumed
                batches = ckpt.fast_forward(data, self.epoch_rng, start)
            else:  # a new pass
                self.epoch_rng = ckpt.epoch_start(data)
                batches = data
            empty = True
            for i, batch in enumerate(batches, start):
                if settings.grad_accum != grad_accum:
                    raise ConfigError(f"grad_accum changed from {grad_accum} to {settings.grad_accum} in the middle "
                                      f"of pass {state.epoch}, whose batches are grouped by {grad_accum}: change it "
                                      "in on_epoch_start, and it applies from that pass on")
                empty = False
                state.batch_in_epoch = i + 1
                pending.append(batch)
                if len(pending) == grad_accum:
                    yield pending
                    pending = []
            if pending:
                yield pending
                pending = []
            if empty and start == 0:
                raise ConfigError(_no_batches(data, state.epoch))
            # the pass is over (found when the next step asks for its batch): the epoch schedulers step, then the hook
            # sees the next pass's learning rate (as Lightning orders them) and state.epoch still the pass's number
            if self.schedules_stepped != state.epoch:  # not when on_epoch_end failed, and this fit runs it again
                schedules.after_epoch(state.step)
                self.schedules_stepped = state.epoch
            hooks("on_epoch_end")
            state.epoch += 1
            state.batch_in_epoch = 0
            self.epoch_rng = ckpt.epoch_start(data)  # what the next pass draws from (a checkpoint between passes)
            if stop.reason is not None:
                return
            yield PASS_END

    def ends_run(self, max_epochs: int | None) -> bool:
        """Whether the step just taken was the last of the run's last pass: known when the data has a
        length (otherwise the pass ends when the next step asks for its batch, after this step's work)."""
        length = _length(self.data)
        return max_epochs is not None and self.state.epoch == max_epochs - 1 and length is not None and \
            self.state.batch_in_epoch >= length

    def shard_again(self) -> None:
        """Under torchrun, data replaced since this rank's share was made (between fits, or by
        ``on_epoch_start``): this rank's share of the new data."""
        if self.shard is not None and self.data is not self._sharded:
            self.data = self._sharded = self.shard(self.data)

    def state_dict(self) -> dict:
        return {"epoch_start": self.epoch_rng,
                "iterable": self.data.state_dict() if ckpt.stateful(self.data) else None,
                "seeds": [sampler.seed for sampler in _seeded(self.data)]}

    def load_state_dict(self, saved: dict) -> None:
        self.left = None  # the data goes on from the checkpoint's position, not from the last fit's
        self.schedules_stepped = None
        ckpt.load_data(self.data, saved["iterable"])
        self.epoch_rng = saved["epoch_start"]
        for sampler, seed in zip(_seeded(self.data), saved.get("seeds", [])):  # (none in older checkpoints)
            sampler.seed = seed

    def warn_workers(self) -> None:
        """After a checkpoint is loaded: a DataLoader keeping its workers from pass to pass (``persistent_workers``)
        past its first pass. Their random state (the augmentations they draw) is in no checkpoint, and the resumed
        run's new workers start theirs afresh: said, as the run draws other augmentations than one never stopped."""
        data = self.data
        if self.state.epoch > 0 and isinstance(data, DataLoader) and data.num_workers > 0 \
                and data.persistent_workers:
            log.warning("resume: train_data's DataLoader keeps its %d workers from pass to pass "
                        "(persistent_workers=True), and no checkpoint holds their random state: from pass %d on, "
                        "random augmentations drawn in the workers differ from those of a run that never stopped. "
                        "With persistent_workers=False each pass's workers are seeded anew, and a resume draws the "
                        "same ones", data.num_workers, self.state.epoch)


def _seeded(data) -> list:
    """The samplers of ``data`` that shuffle from a seed of their own (a DistributedSampler's, under torchrun the
    first run's process seed): a resumed process, seeded otherwise, must read the same order."""
    return [sampler for sampler in epoch_samplers(data) if isinstance(getattr(sampler, "seed", None), int)]


def _length(data) -> int | None:
    """The batches a pass of ``data`` yields, where that is known for sure: a list or tuple, or a DataLoader over
    a dataset with a length (an IterableDataset's may say another number than it yields)."""
    if isinstance(data, (list, tuple)):
        return len(data)
    if isinstance(data, DataLoader) and not isinstance(data.dataset, IterableDataset):
        return len(data)
    return None


def epoch_samplers(data) -> list:
    """The samplers with ``set_epoch`` that order a pass of ``data``: a DataLoader's sampler, and the sampler inside
    its batch sampler (each once), as Lightning finds them."""
    found = []
    for sampler in (getattr(data, "sampler", None), getattr(getattr(data, "batch_sampler", None), "sampler", None)):
        if callable(getattr(sampler, "set_epoch", None)) and all(sampler is not s for s in found):
            found.append(sampler)
    return found


def _no_batches(data, epoch: int) -> str:
    if epoch > 0 and iter(data) is data:
        return (f"train_data is a {type(data).__name__}, an iterator that one pass uses up: epoch {epoch + 1} got "
                "no batches. Pass something that can be iterated again (a DataLoader, a list, or an object whose "
                "__iter__ returns a new generator each time), or set max_steps to at most the batches of one pass")
    return "train_data yielded no batches: check the dataset and batch size"
