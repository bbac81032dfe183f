"""The graph-lifecycle guard: pre-flight checks before backward, explanations after.

The engine: one ``Guard`` lives in a Trainer, or in a ``GraphGuard`` (a plain loop's), and is
internal to them. It sees only what it is handed: the losses, the step number, the batch and a
``Scope`` (the roots to search for the tensor at fault, the trained parameters, a re-run for
diagnosis). Per step its caller calls, in order: ``begin_step`` (decides whether this step is
checked and reads the node counter), ``preflight`` (before any backward: raises or warns, and says
which backwards must retain the graph), ``explain`` (only when a backward raised), ``end_step``
(the leak checks of ``leaks.py``). Its messages use the caller's ``words`` (see ``words.py``).
"""
from __future__ import annotations

import functools
import inspect
import linecache
import logging
import math
import os
import re
import time
import types
from contextlib import contextmanager, nullcontext, suppress
from dataclasses import dataclass
from itertools import islice
from pathlib import Path
from typing import Any, Callable, Mapping

import torch
from torch.nn.utils import parametrize
from torch.overrides import TorchFunctionMode

from ..errors import (
    CarriedGraphError,
    ConfigError,
    DoubleBackwardError,
    GraphLifecycleError,
    GraphReuseError,
    GraphSharingWarning,
    InplaceModificationError,
    NoGraphError,
    StepError,
    warn_at,
)
from ..settings import GUARD_CHECKS, GUARD_DEFAULTS
from . import bytecode, explain, walk
from .explain import Scope, code_of
from .leaks import (COPY_FIX, SENTINEL, SLOTS_FIX, WRITTEN_EXAMPLE, WRITTEN_FIX, Leaks, detach_what_is_added,
                    written_before, written_below, written_in_slots)
from .prints import Prints
from .render import render
from .unused import UnusedGradients
from .walk import CHEAP_PEEK, sequence_nr
from .words import LOOP, TRAINER, Words

log = logging.getLogger("safeloop.guard")

_FIRST_SEEN = "safeloop_first_seen"  # node.metadata: the step that first found a node made before it
_BUILT_FROM = "safeloop_built_from"  # node.metadata: its leaves' versions when a retaining backward first reused it


def _average(mean: float | None, sample: float) -> float:
    """A running average that follows slow drift (machine load) and smooths step-to-step noise."""
    return sample if mean is None else 0.8 * mean + 0.2 * sample


@dataclass(frozen=True)
class Case:
    """The loss being judged, and what explaining a mistake in it may search."""

    name: str
    loss: torch.Tensor
    step: int
    scope: Scope | None = None
    batch: Any = None
    retains: bool = False  # its backward keeps the graph and makes one of the gradient (create_graph=True)
    keeps: bool = False  # its backward is told to keep the graph (retain_graph=True)


class Guard:
    """Checks the autograd graph of every loss its caller (a Trainer, a ``GraphGuard``) back-propagates.

    Args:
        on_reuse / check / trace / warmup / budget / ignore: the guard's settings, each documented with
            its default in ``safeloop.settings.GuardSettings`` (also the ``guard`` config group).
        out_dir: where graph pictures are written on error (None: no picture).
        words: how messages name the caller's code (``words.TRAINER``, ``words.LOOP``); the attribute
            ``words`` may be set later, by a caller taking over a guard another one made.
    """

    def __init__(
        self,
        on_reuse: str = GUARD_DEFAULTS.on_reuse,
        check: str = GUARD_DEFAULTS.check,
        trace: bool = GUARD_DEFAULTS.trace,
        warmup: int = GUARD_DEFAULTS.warmup,
        budget: float = GUARD_DEFAULTS.budget,
        out_dir: str | Path | None = None,
        ignore: tuple[str, ...] = (),
        words: Words = TRAINER,
    ):
        self.on_reuse, self.check, self.trace = on_reuse, check, bool(trace)
        self.words = words
        self.ignored = _check_names(ignore)
        self._prints: Prints | None = None  # the parameters' fingerprints (check=always)
        self._regions: list[tuple[int, int, frozenset]] = []  # node numbers made inside ignore() regions
        self._active: list[frozenset] = []  # the ignore() regions running now
        self.warmup, self.budget = warmup, budget
        self.out_dir = Path(out_dir) if out_dir else None
        self.fit_seq: int | None = None  # node counter when training started
        self.start_seq: int | None = None  # node counter at the start of this step (None: unknown)
        # the counter when the last step ended (or the fit started): the next step starts there, so
        # that a graph made while fetching its batch (an RL rollout) is the step's own
        self.next_start: int | None = None
        self.prev_seq: int | None = None  # the last step's start
        # step -> the counter of its newest loss (this step's and the last's): a value kept from the last step and
        # made after its loss is a state set up for the next step, not a cache its loss read (``_set_up_after_loss``)
        self.loss_seqs: dict[int, int] = {}
        self.checking = False
        self.thorough = False  # this checked step also runs the secondary checks
        self._checks = 0
        # The schedule: steps before ``next_timed`` are neither checked nor timed (see
        # ``begin_step``); from it to ``next_due`` they are timed, unchecked, for the bare step
        # time; ``next_due`` is checked. ``always``: every step is due; ``off``: none.
        self.next_due = self.next_timed = math.inf if check == "off" else 0
        self.timed = False  # this step is timed (for the schedule)
        self.interval = 1
        # under torchrun: the largest of a number over the ranks (the Trainer sets it), so that
        # all ranks take the slowest rank's interval
        self.agree: Callable[[int], int] | None = None
        self.spent = 0.0  # seconds spent checking in this step
        # ``auto``'s running averages (None: nothing measured yet): the bare step time, the extra
        # time of a checked step over it, and the time timed inside the checks
        self._step_time: float | None = None
        self._cost: float | None = None
        self._spent: float | None = None
        # the parameters that the step wrote through `.data` where the fingerprints saw it (version counters do not):
        # what abandoning the step does not undo, said by the Trainer
        self.written_unseen: list[torch.Tensor] = []
        self._micro_seq: int | None = None  # under gradient accumulation, where the step's current micro-batch began
        self.leaks = Leaks(self._warn, self.is_off)  # graphs kept alive after their step
        self._warned: set[str] = set()
        self.unused = UnusedGradients()  # gradient that no optimizer uses, and the order of zero_grad/backward/step
        self._giving = False  # ``unused.order`` reads the gradients of the backward pre-flighted last
        self.heeded: list | None = None  # under watch: the warning filters set before the script ran (``warn_at``)
        self.frame = None  # a plain loop's frame that called the backward being pre-flighted: its warnings point there
        self._failed_inplace = False  # explaining a backward that stopped at a saved tensor changed in place
        self.caller = None  # the frame that called it, where that is a library's below ``frame`` (under watch)
        # this checked step's backwards that did not retain the graph: (loss name, root, nodes walked,
        # inputs, its leaves' versions then, where it was called, whether someone else ran it, whether autograd.grad
        # did); a later backward of the step reaching a node they ran would find it freed
        self._consumed: list[tuple[str, Any, set, Any, list, str | None, bool, bool]] = []
        self._last_versions: list[tuple[torch.Tensor, tuple[int, int]]] = []  # the last step's (see end_step)
        self._walked: tuple | None = None  # the last loss pre-flighted alone: (name, root, nodes, leaves, where)
        self._printed: dict[str, tuple] = {}  # per loss of a checked step: what _check_written compared (always)
        # the node numbers that a checked step's retaining backwards ran (this step's, the last step's): a later
        # step reaching one back-propagates a graph a second time (retain_graph=True on a carried state)
        self._ran_now: set[int] = set()
        self._ran_last: set[int] = set()

    # -- turning checks off --------------------------------------------------------
    @contextmanager
    def ignore(self, *checks: str):
        """Turn the named checks off (see ``guard.ignore``) for one region of code: for the backwards run
        inside it (manual mode), and for the graph nodes made inside it (by this thread), wherever a
        step meets them later: ``with trainer.guard.ignore("carried"): self.h = self.rnn(x, self.h)``."""
        names = _check_names(checks)
        start = walk.sequence_now()
        self._active.append(names)
        try:
            yield
        finally:
            self._active.pop()
            end = walk.sequence_now()
            if end > start:
                self._regions.append((start, end, names))
                if len(self._regions) > 256:  # regions of earlier steps: keep those before training, and the newest
                    fit = self.fit_seq if self.fit_seq is not None else 0
                    self._regions = [r for r in self._regions[:-128] if r[0] < fit] + self._regions[-128:]

    def is_off(self, check: str, node=None) -> bool:
        """Whether ``check`` is turned off: for the run, in the running region, or for ``node``."""
        if check in self.ignored or any(check in names for names in self._active):
            return True
        if node is None or not self._regions or not walk.HAS_SEQ:
            return False
        seq = sequence_nr(node)
        return any(a <= seq < b and check in names for a, b, names in self._regions)

    # -- schedule ------------------------------------------------------------------
    @contextmanager
    def context(self):
        """Wraps the whole fit: anomaly mode when ``trace`` is on; the parameters' fingerprints (``check=always``,
        see ``prints.py``) are taken until it ends."""
        with torch.autograd.detect_anomaly(check_nan=False) if self.trace else nullcontext():
            try:
                yield
            finally:
                self.stop_prints()

    def start_fit(self, at: int | None = None) -> None:
        """Training starts now, or at node counter ``at``: a graph made before it was built before training.
        Under ``check=always`` the parameters' fingerprints are taken from now on (see ``prints.py``)."""
        self.fit_seq = self.next_start = walk.sequence_now() if at is None else at
        if self.check == "always" and "inplace" not in self.ignored:
            self._prints = self._prints or Prints()

    def stop_prints(self) -> None:
        """No more fingerprints (the fit is over, or a ``GraphGuard`` closed)."""
        if self._prints is not None:
            self._prints.stop()
            self._prints = None

    def step_done(self) -> None:
        """A step is over: what is made from now on (its batch being fetched too) belongs to the next."""
        if self._prints is not None:
            self._prints.clear()
        self._printed = {}  # it holds the step's losses and nodes: a loss name not seen again would keep them
        if CHEAP_PEEK:
            self.next_start = walk.sequence_now()
        self.leaks.look_back(self.start_seq)

    def begin_step(self, step: int) -> bool:
        """Decide whether ``step`` is checked, and whether it is timed (returned); read the node counter."""
        self.prev_seq = self.start_seq
        self._ran_last, self._ran_now = self._ran_now, set()
        self.written_unseen, self._micro_seq = [], None
        if CHEAP_PEEK:  # read every step: post-mortems on unchecked steps know the step's nodes too
            # where the last step ended (see ``step_done``): a graph made while fetching the batch is this step's
            self.start_seq = walk.sequence_now() if self.next_start is None else self.next_start
        else:
            self.start_seq = None  # read below if checked
        if step < self.next_timed and not self.timed:  # most steps: neither checked nor timed, as the last
            return False
        self.spent = 0.0
        if self._consumed or self._walked:
            self._forget_consumed()
        if step < self.next_timed:
            self.checking = self.thorough = self.timed = False
            return False
        self.checking = step >= self.next_due
        self.timed = True
        if self.checking:
            # The secondary checks (a graph consumed inside training_step, a graph kept after its
            # step) look for mistakes that repeat every step: every warm-up step and every 4th
            # check after it see them soon enough, at a quarter of their cost.
            self._checks += 1
            self.thorough = step <= self.warmup or self._checks % 4 == 0
            if not CHEAP_PEEK:
                t0 = time.perf_counter()
                self.start_seq = walk.sequence_now()
                self.spent += time.perf_counter() - t0
        else:
            self.thorough = False
        return True

    def last_step_from(self, seq: int) -> None:
        """The last step began at node counter ``seq`` if that is earlier than where it began (for the one-step
        lag, see ``_why_carried``): a plain loop whose updates each end a step counts its iteration as one."""
        if self.prev_seq is not None:
            self.prev_seq = min(self.prev_seq, seq)

    def record_step_time(self, step: int, seconds: float) -> None:
        """Feed the measured time of a timed ``step``; after a checked one, plan the next check.

        ``auto`` keeps what checks cost under ``budget`` of the bare step time. A check's
        cost is what its whole step took over the bare step (timed just before it, away from
        the caches the previous check evicted), and never less than the timed check itself.
        """
        if self.check != "auto":
            return
        if not self.checking:
            self._step_time = _average(self._step_time, seconds)
            return
        # averaged before any floor is applied: a floor per sample would bias the average upwards
        self._spent = _average(self._spent, self.spent)
        if self._step_time is not None:
            self._cost = _average(self._cost, seconds - self._step_time)
        if step < self.warmup:
            self.next_due = self.next_timed = step + 1
            return
        if self._cost is not None:
            # at least 2: a bare step between two checks is what they are measured against
            cost = max(self._cost, self._spent)
            self.interval = max(2, math.ceil(cost / (self.budget * self._step_time)))
        else:  # no bare step timed yet: time the next one
            self.interval = 2
        if self.agree is not None:  # every rank checks the same steps: an error stops them together
            self.interval = self.agree(self.interval)
        self.next_due = step + self.interval
        self.next_timed = self.next_due - 1

    # -- before backward -----------------------------------------------------------
    def preflight(
        self, losses: Mapping[str, torch.Tensor], step: int, scope: Scope | None = None, batch: Any = None,
        first: bool = False, summed: bool = False, iteration: int | None = None, inputs=None, updates: bool = True,
        kept: list | None = None, retains: bool = False, keeps: bool = False,
    ) -> list[bool] | None:
        """Check every loss of the step before any backward runs (``first``: no backward of the
        step has run yet, so no trained parameter may hold a gradient; ``summed``: the losses are
        back-propagated as their sum, so a constant term among them is fine; ``iteration``: in a plain
        loop whose steps end at each optimizer step, the node counter where this step's loop iteration
        began, when an earlier step of it came before: a graph made since is the iteration's, not carried;
        ``inputs``: the ``backward(inputs=...)`` of one loss's backward, which runs only the nodes on paths
        to them, so only those can meet saved tensors an earlier backward freed; ``updates``: the backward writes
        the ``.grad`` of the leaves it reaches, which ``torch.autograd.grad`` does not; ``kept``: under gradient
        accumulation, the gradients the step's earlier micro-batches left (``accumulated``), which must be there still;
        ``retains``: the one loss's backward makes a graph of its gradient and keeps the loss's (``create_graph=True``),
        so a graph built before training that it reaches is judged by whether what it was made from changed, see
        ``_reused``; ``keeps``: it is told ``retain_graph=True``, so such a graph is not freed).

        Returns, per loss in order, whether its backward must retain the graph (because
        a later loss shares nodes with it, or a reused graph is being retained); None
        when this step is not checked (the caller then retains on all but the last).
        """
        for name, loss in losses.items():
            if loss.grad_fn is None and not (summed and any(x.grad_fn is not None for x in losses.values())) \
                    and not _hooked(loss) and not _placeholder(loss):
                raise self.no_graph(name, loss, step, scope, batch,
                                    among=any(x.grad_fn is not None for x in losses.values()))
        if walk.HAS_SEQ:
            newest = max((sequence_nr(x.grad_fn) for x in losses.values() if x.grad_fn is not None), default=-1)
            if step not in self.loss_seqs:
                self.loss_seqs = {step - 1: self.loss_seqs[step - 1]} if step - 1 in self.loss_seqs else {}
            self.loss_seqs[step] = max(newest, self.loss_seqs.get(step, -1))
        # every step but under check=off: one look at each trained parameter's .grad (a backward of training_step's
        # own can start at any step, an adversarial attack's after a warm-up); after the walk on a checked step
        look = (first or kept is not None) and scope is not None and self.check != "off" \
            and not self.is_off("consumed")
        if not self.checking:
            if look:
                self._check_grads(next(iter(losses)), step, scope, kept)
            return None
        t0 = time.perf_counter()
        try:
            retain = self._preflight(losses, step, scope, batch, iteration, inputs, updates, retains, keeps)
            if look:
                self._check_grads(next(iter(losses)), step, scope, kept)
            return retain
        finally:
            self.spent += time.perf_counter() - t0

    def micro_batch_done(self) -> None:
        """Under gradient accumulation, a micro-batch's backward is over: a node made before now that a later
        micro-batch's loss reaches was made by an earlier one (see ``_carried_from_micro_batch``)."""
        self._micro_seq = walk.sequence_now() if walk.HAS_SEQ else None

    def _carried_from_micro_batch(self, nodes, case: Case) -> None:
        """A node of an earlier micro-batch of the step whose backward freed its saved tensors (an RNN's hidden state
        carried from one micro-batch to the next without ``.detach()``): this loss's backward would fail on it."""
        for node in nodes:
            if sequence_nr(node) < self._micro_seq and walk.holds_tensors(node) \
                    and walk.is_freed(walk.unpack_error(node, first=True)):
                holder = explain.find_holder(node, case.scope, case.batch)
                built = self._built_from_list(node, case, self._micro_seq, holder)
                if built or isinstance(holder, explain.Element):  # a list the micro-batches add to, as steps would
                    fixes = _list_fixes(built or holder, built)
                else:
                    fixes = ["detach the carried state at the end of each training_step (`{detached}`)"]
                if _is_held(holder, case.loss, case):  # the loss itself: a sum of the micro-batches' losses
                    fixes.insert(0, _START_AGAIN)
                raise self._error(CarriedGraphError, node, case,
                    "the loss reaches {node}, made by an earlier micro-batch of this step and held by {holder}, whose "
                    "backward already freed its saved tensors: under grad_accum each micro-batch is back-propagated "
                    "on its own", fixes, what="graph carried over from an earlier micro-batch", holder=built or holder)

    @staticmethod
    def accumulated(scope: Scope) -> list[tuple[torch.Tensor | None, int]]:
        """Each trained parameter's gradient and its version, as a micro-batch's backward left them: what the next
        micro-batch of the update must find (``preflight``'s ``kept``)."""
        return [(p.grad, -1 if p.grad is None else p.grad._version) for p in scope.parameters()]

    def _check_grads(self, name: str, step: int, scope: Scope, kept: list | None) -> None:
        """Gradients present before the first backward, or changed since the last micro-batch's, mean training_step
        ran backward itself; gone since the last micro-batch's, that it cleared them."""
        params = scope.parameters()
        if kept is None:
            changed, why = [p for p in params if p.grad is not None], "already present when training_step returned"
        else:
            if any(grad is not None and p.grad is None for p, (grad, _) in zip(params, kept)):
                names = explain.parameter_names(scope)
                cleared = [f"`{names[id(p)][0]}`" if id(p) in names else "a parameter"
                           for p, (grad, _) in zip(params, kept) if grad is not None and p.grad is None]
                raise StepError(
                    f"step {step}: under gradient accumulation, the gradients this update's earlier micro-batches "
                    f"left ({', '.join(cleared[:3])}{' and more' if len(cleared) > 3 else ''}) were cleared in "
                    "training_step before the next micro-batch's backward (a zero_grad() there, after a backward "
                    "taken for an input's gradient, say): the update would apply the last micro-batch's gradient "
                    "alone. Remove that zero_grad() (the Trainer clears the gradients after each update), and take "
                    "an input's gradient with torch.autograd.grad(loss, [x]) or loss.backward(inputs=[x]), which "
                    "leave the parameters' .grad alone", step)
            changed = [p for p, (grad, version) in zip(params, kept)
                       if p.grad is not None and (p.grad is not grad or p.grad._version != version)]
            why = ("changed inside training_step since the last micro-batch's backward (under gradient accumulation; "
                   "a zero_grad(set_to_none=False) changes them too)")
        if changed:
            raise DoubleBackwardError(
                f"gradients were {why}: training_step (or a hook) called backward itself, so the Trainer's "
                "backward would add the loss's gradients to them and the update would apply both",
                step=step, loss_name=name,
                fixes=["return the loss from training_step and let the Trainer call backward",
                       "set automatic = False on your Trainer and call self.backward(loss) / "
                       "self.step() inside training_step",
                       "if that backward is meant for another tensor's gradient only (an adversarial attack's "
                       "input), take it with torch.autograd.grad(loss, [x]) or loss.backward(inputs=[x]): the "
                       "parameters' .grad is then left alone"])

    def _preflight(self, losses, step, scope, batch, iteration=None, inputs=None, updates=False,
                   retains=False, keeps=False) -> list[bool]:
        seen: set = set()
        reached: list[tuple[str, Any, list]] = []  # (loss name, root, the leaves its walk met first)
        owner: dict[int, int] = {}  # node -> the first loss whose walk visited it
        # Losses whose graphs share a node (directly or through another loss) form a group; a
        # non-retaining backward frees every buffer it passes, so in a group every loss but the
        # last must retain. (Conservative: it may retain for a loss whose own nodes a later one
        # never reaches; never the reverse.)
        group = list(range(len(losses)))

        def find(i: int) -> int:
            while group[i] != i:
                group[i] = group[group[i]]
                i = group[i]
            return i

        kept: set[int] = set()  # graphs built before the step that on_reuse keeps: every loss reaching one retains
        retain = [False] * len(losses)
        for i, (name, loss) in enumerate(losses.items()):
            root = loss.grad_fn
            if root is None:  # a constant term of a summed step: nothing to walk
                continue
            if id(root) in owner:  # the same graph returned twice, or a loss inside another's graph
                group[find(i)] = find(owner[id(root)])
                continue
            found = walk.walk(root, self.start_seq, step, seen)
            # the nodes this backward runs: with inputs=..., only those on paths to them
            ran = walk.runs(root, inputs) if inputs is not None else None
            runs = found.nodes if ran is None else [n for n in found.nodes if n in ran]
            if self._micro_seq is not None and not self.is_off("carried"):
                self._carried_from_micro_batch(runs, Case(name, loss, step, scope, batch))
            if self._consumed and not self.is_off("consumed"):
                self._check_ran(runs, name, loss, step, scope)
            if len(losses) == 1:
                self._walked = (name, root, found.nodes, found.leaves, explain.where(self.frame))
            if len(losses) > 1:  # which earlier losses' graphs does this one reach?
                for node in found.nodes:
                    owner.setdefault(id(node), i)
                    for nxt, _ in node.next_functions:
                        j = owner.get(id(nxt))
                        if j is not None and j != i:
                            group[find(i)] = find(j)
                        if id(nxt) in kept:
                            retain[i] = True
            self._written_parameter([*found.nodes, *found.before], Case(name, loss, step, scope, batch))
            if found.before and self._before_step(found.before, Case(name, loss, step, scope, batch, retains, keeps),
                                                  iteration):
                retain[i] = True
                kept.update(id(n) for n in found.before)
            if not self.thorough:
                continue
            reached.append((name, root, found.leaves))
            if found.functions and not self.is_off("inplace"):
                self._check_ctx(found.functions, found.nodes, Case(name, loss, step, scope, batch))
            if self._prints is not None and found.leaves and not self.is_off("inplace"):
                self._printed[name] = (found.leaves, found.nodes, Case(name, loss, step, scope, batch))
                self._check_written(*self._printed[name])
            if not self.is_off("consumed"):
                self._check_consumed(runs, name, loss, step, scope)
            # one per loss of the step's first call, and one per backward that updates: a step's first call may be an
            # `autograd.grad` whose graph dies with it (an attack's), and a later backward's graph may be the one kept
            # (a GAN's generator loss, back-propagated after the discriminator's)
            if self.leaks.marked < len(losses) or updates:
                self._watch(root, found.nodes, found.before)
        if reached and updates and scope is not None:
            if not self.is_off("unused"):
                self.unused.check(reached, step, scope, inputs, _warn_where(self.frame), self.heeded)
            optimized = scope.optimized()
            self._giving = optimized is not None
            if optimized is not None:
                held = set(map(id, optimized))
                routed = None if inputs is None else set(map(id, inputs))  # backward(inputs=...) writes theirs only
                plain = {id(t): t for _, _, leaves in reached for t in (n.variable for n in leaves)
                         if id(t) not in held and type(t) is torch.Tensor and (routed is None or id(t) in routed)}
                self.unused.before_backward(optimized, list(plain.values()),
                                            (step, reached[0][0], _warn_where(self.frame)), scope, self.heeded)
        if len(losses) == 1:
            return retain
        last = {find(i): i for i in range(len(losses))}  # the last loss of each group
        return [keep or last[find(i)] != i for i, keep in enumerate(retain)]

    def check_written_again(self, name: str) -> None:
        """After ``on_before_backward``, which may write parameters through ``.data`` too: the pre-flight's check of
        such writes again for loss ``name`` (checked steps under ``check=always``; nothing otherwise)."""
        if name in self._printed:
            self._check_written(*self._printed[name])

    def _check_written(self, leaves, nodes, case: Case) -> None:
        """A parameter the step's graph saved, written since the forward that used it by a write PyTorch's version
        counter does not see (``p.data.clamp_(-c, c)``, ``p.data = ...``): backward would compute with the new
        values. Seen by the fingerprints taken after each module's forward (``check=always``, see ``prints.py``) whose
        output the loss's graph holds; said only where a node of the step saved a tensor that shares the parameter's
        storage now."""
        if case.scope is not None:  # hooks on the modules it can name; from the next forward on
            self._prints.watch(_modules_of(case.scope))
        written = self._prints.changed([leaf.variable for leaf in leaves], nodes)
        if not written:
            return
        saved: dict[int, Any] = {}  # storage -> the first node of the step that saved a tensor in it
        for node in nodes:
            if walk.holds_tensors(node):
                for tensor in walk.saved_tensors(node):
                    if tensor.layout is torch.strided:  # (a sparse one, GCN's adjacency, has no storage to share)
                        saved.setdefault(tensor.untyped_storage().data_ptr(), node)
        # a parameter no node saved (a bias only added) changes no gradient: its new values are fine
        stale = [p for p in written if p.untyped_storage().data_ptr() in saved and p.untyped_storage().data_ptr()]
        if not stale:
            return
        names = explain.leaf_names(stale, case.scope)
        first = explain.leaf_names(stale[:1], case.scope)
        self.written_unseen = written
        raise self._error(InplaceModificationError, saved[stale[0].untyped_storage().data_ptr()], case,
            f"the loss reaches {{node}}, whose graph saved {names}, written since the forward that used them by a "
            "write PyTorch's version counter does not see (through `.data`: the version is unchanged): backward would "
            "compute with the new values, and PyTorch cannot tell",
            ["write them before the forward that uses them (a weight clipping at the start of the step, before the "
             "forward), or compute the loss again after the write",
             "write them under torch.no_grad() on the parameter itself (`with torch.no_grad(): p.clamp_(-c, c)`), "
             "not through `.data`: PyTorch then sees the change and refuses a backward through stale values",
             "if that forward's output is a target not to train through (a teacher's prediction made with weights "
             "swapped in and back through `.data`, as torch-ema's `with ema.average_parameters():` does), compute it "
             "under torch.no_grad() or detach it"],
            holder=first.strip("`") if first.startswith("`") else None)

    def _check_ctx(self, functions, nodes, case: Case) -> None:
        """A tensor an autograd Function keeps as an attribute of its ctx (``ctx.x = x``, not ``save_for_backward``)
        and that was changed in place after the Function's output was used: backward would compute with the
        changed values, and PyTorch checks the version of saved tensors only. Seen for tensors with a graph: an
        in-place change gives the tensor a new grad_fn, made after the node that used the Function's output, whose
        first inputs lead back to the Function's node or to one of its inputs (what the tensor was before)."""
        if not walk.HAS_SEQ:
            return
        # the Functions' nodes (``functions``, found by the walk) that keep tensors on ctx
        kept = {n for n in functions if any(isinstance(v, (torch.Tensor, tuple, list)) for v in vars(n).values())}
        if not kept:
            return
        users: dict = {}  # a Function's node -> the node counter of the first node of the step that used its output
        for node in nodes:
            for nxt, _ in node.next_functions:
                if nxt in kept:
                    made = sequence_nr(node)
                    users[nxt] = min(users.get(nxt, made), made)
        for fn, used in users.items():
            if self.is_off("inplace", fn):
                continue
            for key, value in vars(fn).items():
                if not _backward_reads(fn, key):  # kept but never read by backward: harmless
                    continue
                for tensor in value if isinstance(value, (tuple, list)) else (value,):
                    changed = _changed_after(fn, tensor, used)
                    if changed is None:
                        continue
                    holder = explain.leaf_names([tensor], case.scope)
                    holder = holder if holder.startswith("`") else "a tensor made in the step"
                    function = type(fn).__name__.removesuffix("Backward")
                    raise self._error(InplaceModificationError, fn, case,
                        f"the loss reaches {{node}}, the node of the autograd Function `{function}`, which keeps "
                        f"{holder} as an attribute of its ctx (`ctx.{key}`) instead of saving it with "
                        f"ctx.save_for_backward; it was changed in place after the Function ran ({changed}), so "
                        "backward would compute with the changed values, and PyTorch checks the version of saved "
                        "tensors only",
                        [f"change it out of place (`x = x + 1` rather than `x += 1` or `x.add_(1)`), or change a "
                         f"`.clone()` of it, so that `ctx.{key}` keeps the value the Function was given",
                         f"keep it with `ctx.save_for_backward(...)` in `{function}.forward` (read back from "
                         "`ctx.saved_tensors`): PyTorch then refuses a backward through a tensor changed since"],
                        holder=holder.strip("`") if holder.startswith("`") else None)

    def at_update(self, params=None) -> None:
        """An optimizer update of ``params`` (the optimizer's; None: unknown) is about to run (the Trainer's, watch's),
        or has just run (a ``GraphGuard``'s loop, and the Trainer's and watch's after a closure's backwards): what
        the checks of gradient that no optimizer uses kept for it is said now (``unused.UnusedGradients``). An
        optimizer no gradient reaches is said here for a plain loop only: the Trainer says it itself, in every check
        mode (its step's ``warn_unused``)."""
        self.unused.at_update(params, self.heeded, starved=self.words is LOOP)

    def _warn(self, warning: Warning, frame: types.FrameType | None = None) -> None:
        """Warn at ``frame``, else the loop's line (``self.frame``), else (the Trainer) at the user's line that called
        into safeloop (``trainer.fit()``): there the user's warning filters and their own file name apply."""
        frame = frame or self.frame
        warn_at(warning, frame and (frame.f_code.co_filename, frame.f_lineno, frame.f_globals), self.heeded)

    def _watch(self, root, nodes, before=()) -> None:
        """Mark the nodes of the step that a loss's walk met (``leaks.Leaks.mark``), not those whose carried check is
        off: a graph carried from step to step on purpose is alive for several steps by design."""
        if self.is_off("carried"):
            nodes = ()
        elif self._regions:
            nodes = [node for node in nodes if not self.is_off("carried", node)]
        self.leaks.mark(root, nodes, before)

    def _before_step(self, nodes, case: Case, iteration: int | None = None) -> bool:
        """Judge the nodes made before the step that the loss reaches, by the verdicts below in order (each
        states its rule): raises or warns where one applies; returns whether the loss's backward must retain
        the graph. ``iteration``: see ``preflight``.

        Made during an earlier step: ``_freed_in_iteration``, ``_carried_and_kept``; a one-step lag is fine
        (``_why_carried``). Built before training: ``_reused`` (saves tensors), ``_shared_stale`` (saves none).
        """
        carried = [n for n in nodes if not self._before_fit(n) and not self.is_off("carried", n)]
        if carried:
            why = _why_carried(carried, self.prev_seq if walk.HAS_SEQ else None, iteration)
            if why is _FREED and self._failed_inplace:  # freed by the backward that failed, at a tensor changed
                why = _SAVED_CHANGED
            # the nodes the last step's backward ran already (retain_graph=True): not a one-step lag
            ran = [sequence_nr(n) for n in carried if self._ran_last and sequence_nr(n) in self._ran_last]
            if why is None and any(iteration is None or seq < iteration for seq in ran):
                why = _RAN_AGAIN
            if why is None:  # a one-step lag, unless it is a weight a cache keeps (an autocast copy, a parametrized
                # weight) that the last step's backward used, updated since
                stale = [n for n in carried if _cached_weight(n) and explain.changed([n], self._last_versions)]
                if stale:
                    self._stale_cast(stale[0], case)
            if why is not None:
                # freed in this iteration: named by the first node whose saved tensors were freed, where the loss's
                # own nodes are old too, but unfreed (a critic's loss built before the actor's update, on its features);
                # a part the last step's update left as it was first (see _unchanged)
                ordered = sorted(carried, key=lambda n: bool(explain.changed([n], self._last_versions))) \
                    if why is _FREED else []
                freed = next((n for c in ordered for n in islice(walk.iter_nodes(c), 10_000)
                              if type(n) is not walk.ACCUMULATE and walk.holds_tensors(n)
                              and walk.is_freed(walk.unpack_error(n, first=True))), carried[0])
                self._freed_in_iteration(freed, why, case, iteration)
                self._carried_and_kept(carried[0], why, case)
        reused = [n for n in nodes if self._before_fit(n) and not self.is_off("reuse", n)]
        if not reused:
            return False
        # A graph built before training is judged by everything below the node the step reaches: an
        # operation that saves nothing (an add, a squeeze) can sit on top of one that does (a matmul).
        below = [(n, *walk.below(n)) for n in reused]
        saving = [(n, saver, leaves) for n, saver, leaves in below if saver is not None]
        if saving:  # the newest first: the tensor nearest the loss (a derivative `u_x`, not the `u` it was taken of)
            return self._reused(*(max(saving, key=lambda s: sequence_nr(s[0])) if walk.HAS_SEQ else saving[0]), case)
        node, _, leaves = below[0]
        self._shared_stale(node, leaves, case)
        return False

    def _written_parameter(self, nodes, case: Case) -> None:
        """A node of a parameter's graph (``explain.written_parameters``: an EMA copy written outside torch.no_grad())
        among ``nodes``, the loss's -> CarriedGraphError, at the first loss that reaches it: that loss back-propagates
        through the writes into the parameters they were made from (their AccumulateGrad nodes, which the loss
        reaches anyway, do not count)."""
        for name, param in explain.written_parameters(case.scope):
            graph = [n for n in islice(walk.iter_nodes(param.grad_fn), 10_000) if type(n) is not walk.ACCUMULATE]
            ids = {id(n) for n in graph}  # (the list keeps the nodes, and so their ids, alive)
            node = next((n for n in nodes if id(n) in ids and not self.is_off("carried", n)), None)
            if node is not None:
                raise self._error(CarriedGraphError, node, case,
                    "the loss reaches {node}, the graph of the parameter {holder}: it was written in place outside "
                    f"torch.no_grad() from tensors that require grad ({WRITTEN_EXAMPLE}), so it now requires grad "
                    "and this loss back-propagates through those writes into the parameters they were made from; "
                    "each write adds to its graph", [WRITTEN_FIX], holder=name)

    def _before_fit(self, node) -> bool:
        """Whether ``node`` was made before training started (or, without node numbers, first seen in step 1)."""
        if self.fit_seq is not None and walk.HAS_SEQ:
            return sequence_nr(node) < self.fit_seq
        return walk.node_step(node) in (None, 1)

    def _freed_in_iteration(self, node, why: str, case: Case, iteration: int | None) -> None:
        """Freed in this loop iteration -> DoubleBackwardError. In a plain loop whose steps end at each
        update, a graph made earlier in the same iteration, whose saved tensors an earlier backward of the
        iteration freed (a GAN's D loss on an undetached fake), is the iteration's own, not carried."""
        if why is _FREED and iteration is not None and sequence_nr(node) >= iteration:
            made = "the loss reaches {node}, made earlier in this loop iteration and held by {holder}"
            changed = explain.changed([node], self._last_versions)
            if changed:  # an update since (SAC's actor step before its alpha loss on log_pi): retaining cannot help
                detail = (f"{made}, whose graph an earlier backward of the iteration already ran"
                          + _CHANGED.format(explain.leaf_names(changed, case.scope)))
                fixes = ["compute `{code}` again after the change (a fresh forward) for this backward, so that its "
                         "gradient is taken at the parameters as they are now",
                         "if this loss is meant for the parameters as they were, run its backward before changing "
                         "them, and pass retain_graph=True to the earlier backward"]
                if _only_changed_below(node, changed, case.scope):
                    fixes.insert(1, _DETACH_STALE)
            else:
                # named where the freed graph begins: the node made before this step may be a graph no backward ran,
                # built on one that an earlier backward freed (a synthetic-gradient module's output `grad =
                # dni(out)` over `out`, freed by `out.backward(grad.detach())`): `out` is what to detach, not `grad`
                node = next((n for n in islice(walk.iter_nodes(node), 10_000)
                             if type(n) is not walk.ACCUMULATE and _freed(n)), node)
                detail = (f"{made}; an earlier backward of the iteration already freed its saved tensors: going "
                          "through them again is what makes PyTorch fail with 'Trying to backward through the graph a "
                          "second time'")
                # no name holds what it made, only a tensor computed from it with a graph of its own (the synthetic
                # gradient `grad` once `out` is rebound): detaching that tensor would cut its own graph too
                examples = ("a GAN's discriminator loss on the generator's output, a synthetic gradient module on "
                            "the activation whose gradient it predicts")
                detach = (f"it where that loss uses it (`{{code}}.detach()`: {examples})"
                          if explain.holds(node, case.scope, case.batch) else
                          f"what {{node}} made where `{{code}}` is computed from it ({examples}), not "
                          "`{code}` itself")
                fixes = [f"if one of the two losses must not reach it, detach {detach}",
                         "if both losses need its gradient, pass retain_graph=True to the earlier backward"]
            raise self._error(DoubleBackwardError, node, case, detail, fixes, trace_hint=True)

    def _stale_cast(self, node, case: Case) -> None:
        """A weight that a cache made during an earlier step (see ``_cached_weight``) -> CarriedGraphError."""
        stale = "this step's forward computed with that step's weights, not the updated ones"
        if _cached_weight(node) == "parametrize":
            raise self._error(CarriedGraphError, node, case,
                "the loss reaches {node}, a parametrized weight that torch.nn.utils.parametrize.cached() computed "
                "during an earlier step and keeps until its region exits: " + stale,
                ["enter parametrize.cached() around each forward only, never around an optimizer step, so that the "
                 "weight is computed anew after each update"])
        raise self._error(CarriedGraphError, node, case,
            "the loss reaches {node}, a low-precision copy of a weight that torch.autocast made during an "
            "earlier step and keeps until its outermost region exits: " + stale,
            ["enter torch.autocast around each forward and its loss only, never around an optimizer step (as "
             "PyTorch's AMP examples do), so that the weights are cast anew after each update",
             "call torch.clear_autocast_cache() after each optimizer step"])

    def _carried_and_kept(self, node, why: str, case: Case) -> None:
        """Carried from an earlier step and kept -> CarriedGraphError (``why``: see ``_why_carried``). Not kept
        (a node another thread made in this step, see ``_kept``): no verdict. Made by an earlier forward as a module
        attribute that each forward makes again (a pruned weight, see ``explain.remade_attribute``), read before this
        step's forward: said as such, kept or not (the attribute holds this step's value now)."""
        self._remade(CarriedGraphError, node, case, "by an earlier step's forward", why)
        cache = _cached_weight(node)
        if cache == "parametrize" or cache == "autocast" and (any(torch.is_autocast_enabled(d) for d in ("cpu", "cuda"))
                                                             or not explain.holds(node, case.scope, case.batch)):
            self._stale_cast(node, case)  # (inside a region turned off, the casts are kept too: held by no variable)
        kept, holder = self._kept(node, case, freed=why is _FREED)
        # no tensor made by node itself is found, only ones reaching it (the loss): an attribute stored over by this
        # step's value after the loss read the old one names the place that kept it; not where an attribute or an item
        # reaches it (a batch renormalization's running std, written in place with its graph every forward: not the
        # running mean beside it, made alike). A variable reaching it is most likely the loss (HF's `loss`, scaled)
        stored = re.search(r"[.\[]", code_of(holder) or "") is not None
        replaced = explain.replaced_holder(node, case.scope, case.batch) if kept and not stored and not \
            explain.holds(node, case.scope, case.batch) else None
        if replaced is not None:
            raise self._error(CarriedGraphError, node, case,
                "the loss reaches {node}, created during an earlier step and kept in {holder}, which this step then "
                "set to its own value (the loss read the old one); " + why,
                ["store it detached where it is set (`{code} = ....detach()`), so each step back-propagates through "
                 "its own graph only", f"recompute it inside {self.words.place} from its inputs"],
                trace_hint=True, holder=replaced)
        # a list keeping values with their graphs, one per step; a list made anew every step from the last one (a
        # Transformer-XL's memories, one per layer) is a carried state, detached whole below
        # a list the loss is built from, named by it rather than by a variable that took an item of it (the loop
        # variable of `for log_prob, R in zip(saved_log_probs, returns)`)
        built = self._built_from_list(node, case) if kept else None
        holder = built or holder
        if kept and _snapshot(node):
            why += "; " + _SNAPSHOT_WHY
            if isinstance(holder, explain.Element):  # not what is added to a list: the list as it is, detached
                raise self._error(CarriedGraphError, node, case,
                    "the loss reaches {node}, created during an earlier step and held by {holder}; " + why,
                    [_snapshot_fix(holder)], holder=holder)
        if built or kept and isinstance(holder, explain.Element) and explain.holds_as_made(node, holder, case.scope,
                                                                                            case.batch):
            listed = code_of(_list_of(holder))
            if why not in (_FREED, _AGAIN):
                why = f"the graphs of earlier steps pile up in `{listed}`, one more every step"
            raise self._error(CarriedGraphError, node, case,
                "the loss reaches {node}, created during an earlier step and held by {holder}; " + why,
                _list_fixes(holder, built), trace_hint=True, holder=holder)
        if kept:
            holder = self._passed_back(holder, case) or holder
            # a state whose gradient the loop reads (``retain_grad()``: learning to learn's optimizee weights, carried
            # with their graph across unrolled steps) must still require grad once cut
            held = [t for n, t in explain.candidates(case.scope, case.batch) if n == holder]
            # a value the loss reaches only through the slots it was written into (a replay buffer of recurrent
            # states, `C[ptr] = c[0, 0]`): named by that buffer, not by a variable still holding it
            slotted = self._written_through(node, held, case, holder)
            if slotted:
                holder = slotted[0]
                held = [t for n, t in explain.candidates(case.scope, case.batch) if n == holder]
            cut = "{detached}.requires_grad_()" if any(t.retains_grad for t in held) else "{detached}"
            # an object's tensors written in place beside it (llama's cache_k beside its cache_v), or its lists beside
            # the one holding it (a key/value cache's key_cache beside its value_cache), are detached with it: the fix
            # of one alone would stop the next run at the other
            layers = self._layers_beside(holder, case)
            cut = "; ".join([cut, *(f"{c} = {c}.detach()" for c in [*self._written_beside(holder, held, case),
                                                                      *self._carried_beside(holder, held, case),
                                                                      *layers]),
                             *(f"{c} = [t.detach() for t in {c}]" for c in self._lists_beside(holder, case))])
            fixes = [f"detach the carried state at the end of each step (`{cut}`) "
                     "so each step back-propagates through its own graph only (truncated BPTT)",
                     f"recompute it inside {self.words.place} from its inputs"]
            reset = self._reset_fix(holder, layers, case)
            if reset:
                fixes.insert(0, reset)
            written = any(written_in_slots(t) for t in held)
            own = re.search(r"\.\w+$", code_of(holder) or "") is not None  # an object's attribute, not a taken item
            if written and type(node).__name__ in walk.SLOT_WRITES and node.metadata.get(SENTINEL):
                # the loss reaches a write in place that the step making it back-propagated through (its walk met it:
                # an adversarial patch placed into each image of a batch kept in a list, read again in a second
                # epoch): the write carries the gradient, so a copy is written into, never a detached value. Not an
                # object's own tensor that each forward writes into and reads (llama's KV cache trained as it is):
                # its copy, stored back, would keep the last step's graph; detached, it keeps its values
                if not own:
                    fixes = [COPY_FIX, fixes[1]]
            elif written:
                # a buffer whose slots are written in place with values that keep their graphs (dark experience
                # replay's logits stored without .data): the graphs of every step that wrote one pile up in it; the
                # buffers written so beside it too (a replay buffer's `H` beside its `C`): the fix of one alone would
                # stop the next run at the next
                others = ", ".join(f"`{code_of(name)}`" for name in slotted[1:])
                fixes.insert(0, SLOTS_FIX + f" (and alike for {others}, written so beside it)" * bool(others))
            elif type(node).__name__ == "CopyBackwards" and not node.metadata.get(SENTINEL) \
                    and any(type(t.grad_fn).__name__ == "CopyBackwards" for t in held):
                # a tensor written over whole with a value that keeps its graph, a write that no loss of the step
                # making it went back through (StyleGAN2-ADA's running mean of path lengths, `self.pl_mean.copy_(
                # pl_mean)` without its .detach()): that write is what to detach. Not a cache each forward writes and
                # its loss reads (llama's KV cache written whole): detaching the write would stop its gradient
                fixes.insert(0, _COPIED_FIX)
            if any(t is case.loss for t in held):  # the loss itself: a sum of losses over several iterations
                fixes.insert(0, _START_AGAIN)
            elif held and not any(t._version for t in held) and written_below(node):
                # made from a tensor whose graph grew by writes in place outside any loss, from the parameters (seen by
                # ``Leaks``' looks): Synaptic Intelligence's omega, from its path integral `W[n].add_(-p.grad * (p -
                # p_old[n]))`. Not a tensor written in place itself (a KV cache the loss reads): detached as a state
                fixes.insert(0, _WRITTEN_BELOW)
            elif _summed(node, held, case):  # sums the loss is made from (MuZero's value, reward and policy losses)
                sums = "; ".join(f"{c} = 0" for c in [code_of(holder), *self._carried_beside(holder, held, case)])
                fixes.insert(0, _START_AGAIN.replace("{code} = 0", sums))
            if explain.holds_as_made(node, holder, case.scope, case.batch) and not self._set_up_after_loss(
                    node, case.step):  # kept as it was made, before the loss that read it: a cache
                fixes = self._cache_fixes(node, case, holder)
                stale = _stale_term(node, holder, held, case)
                if stale is not None:
                    fixes.insert(0, _STALE_TERM_FIX.format(mapping=stale[0], key=stale[1]))
            if re.fullmatch(r"(local|global) \w+", str(holder)) and _rebound_leaf(node, held, case) is not None:
                why += ("; {holder} was rebound to a value made from the tensor the optimizer updates, which keeps "
                        "updating that one while every step back-propagates through all the values made from it")
                fixes = [_REBOUND_FIX]
            raise self._error(CarriedGraphError, node, case,
                "the loss reaches {node}, created during an earlier step and held by {holder}; " + why,
                fixes, trace_hint=True, holder=holder)

    def _written_through(self, node, held: list[torch.Tensor], case: Case, holder: str | None = None) -> list[str]:
        """When the loss reaches ``node`` only through values written into the slots of tensors, and ``held``
        (what holds ``node``) is no such tensor: the holders of the tensors whose slots an earlier step wrote too, with
        values that keep their graph (a replay buffer of recurrent states filled outside ``torch.no_grad()``, without
        ``.detach()``), the first one reaching ``node``; else none. Not a tensor this step made and wrote (torchdiffeq's
        solution `pred_y`, whose first slot is the state `y0` carried from the last step: `y0` is named). Where
        ``holder`` is a variable the plain loop sets before it reads it, left over from the last iteration (a CA's
        `final_states`, written back into its sample `pool` after the optimizer step, which ``watch`` counts as this
        step's start), a tensor the loop does not set anew is, written in this step or not: that variable carries
        nothing to this iteration."""
        if not held or any(written_in_slots(t) for t in held) or self.start_seq is None or not walk.HAS_SEQ:
            return []
        if any(n is node for n in islice(walk.iter_nodes(case.loss.grad_fn, stop=lambda n: type(n).__name__ in
                                                         walk.SLOT_WRITES), 100_000)):
            return []
        fresh = bytecode.set_first(self.frame) if self.frame is not None else frozenset()
        kind, _, code = str(holder or "").partition(" ")
        left_over = kind in ("global", "local") and code in fresh
        written: dict[int, tuple[str, torch.Tensor]] = {}
        for name, tensor in explain.candidates(case.scope, case.batch):
            if written_in_slots(tensor) and id(tensor) not in written and (written_before(tensor, self.start_seq) or (
                    left_over and name.partition(" ")[2] not in fresh)):
                written[id(tensor)] = name, tensor
        first = [name for name, tensor in written.values() if walk.reachable(tensor.grad_fn, node)]
        return first[:1] + [name for name, _ in written.values() if name not in first[:1]] if first else []

    def _carried_beside(self, holder: str | None, held: list[torch.Tensor], case: Case) -> list[str]:
        """The other variables of the plain loop holding ``holder`` (a variable too) that carry the state with it
        (a simulator's `vel` beside its `pos`): read by the loop before it sets them, holding a graph that reaches a
        node made before this step. The fix of one alone would stop the next run at the same step."""
        kind, _, code = (holder or "").partition(" ")
        if kind not in ("global", "local") or self.frame is None or self.start_seq is None or not walk.HAS_SEQ:
            return []
        carried = bytecode.carried(self.frame)
        beside = []
        for name, tensor in explain.candidates(case.scope, case.batch):
            other = name.partition(" ")[2]
            if name.partition(" ")[0] == kind and other in carried and other != code and other not in beside \
                    and tensor.grad_fn is not None and not any(tensor is t for t in held) \
                    and any(type(n) is not walk.ACCUMULATE and sequence_nr(n) < self.start_seq
                            for n in islice(walk.iter_nodes(tensor.grad_fn), 1_000)):
                beside.append(other)
        return beside

    def _passed_back(self, holder: str | None, case: Case) -> str | None:
        """The variable of the plain loop that holds the tensor the module attribute ``holder`` holds and that the loop
        reads before it sets it, or None: a state the loop passes back to the layer, which stores it (snntorch's
        ``spk1, mem1 = lif1(cur1, mem1)`` keeps ``mem1`` as ``lif1.mem``). Reset or detached on the layer alone, it
        would be set again from the variable."""
        if self.frame is None or not re.search(r"\.\w+$", code_of(holder) or ""):
            return None
        held = [t for n, t in explain.candidates(case.scope, case.batch) if n == holder]
        carried = bytecode.carried(self.frame)
        for name, tensor in explain.candidates(case.scope, case.batch):
            kind, _, code = name.partition(" ")
            if kind in ("global", "local") and code in carried and any(tensor is t for t in held):
                return name
        return None

    def _layers_beside(self, holder: str | None, case: Case) -> list[str]:
        """The same attribute of the other layers of ``holder``'s layer's class (a spiking network's membranes,
        ``net[3].mem`` beside ``net[1].mem``), as code, that hold a graph made before this step: each layer carries
        its own state, and the fix of one alone would stop the next run at the next. Not the holder's layer itself
        reached by another name (`snapshot.model.memory`, where an object keeps the model too)."""
        owner, _, attribute = (code_of(holder) or "").rpartition(".")
        found = explain.module_at(owner, case.scope) if owner and re.fullmatch(r"\w+", attribute) else None
        if found is None or self.start_seq is None or not walk.HAS_SEQ:
            return []
        beside = []
        for name, tensor in explain.candidates(case.scope, case.batch):
            other = code_of(name) or ""
            layer = explain.module_at(other.rpartition(".")[0], case.scope) if other.endswith("." + attribute) \
                and other != code_of(holder) and other not in beside else None
            if layer is not None and layer[1] is not found[1] and type(layer[1]) is type(found[1]) \
                    and tensor.grad_fn is not None \
                    and any(type(n) is not walk.ACCUMULATE and sequence_nr(n) < self.start_seq
                            for n in islice(walk.iter_nodes(tensor.grad_fn), 1_000)):
                beside.append(other)
        return sorted(beside)

    def _reset_fix(self, holder: str | None, layers: list[str], case: Case) -> str | None:
        """The fix starting from rest the state ``holder`` a layer keeps, with ``layers`` (its siblings' states),
        where its layer has a method for it (snntorch's ``reset_mem``, spikingjelly's ``reset``): a spiking network's
        membrane carried into the next batch, of other inputs. Detaching it instead would run, but start each batch
        from the last one's membranes. None where the layer has no such method."""
        owner = (code_of(holder) or "").rpartition(".")[0]
        found = explain.module_at(owner, case.scope) if owner else None
        method = explain.state_reset(found[1]) if found else None
        if method is None:
            return None
        calls = "; ".join(f"{code.rpartition('.')[0]}.{method}()" for code in sorted([code_of(holder), *layers]))
        network = explain.network_reset(found[1], found[0])
        return (f"start the state from rest before each batch's forward (`{calls}`), as a new input begins"
                + (f"; `{network}` does it for every layer of the network" if network else ""))

    def _lists_beside(self, holder: str | None, case: Case) -> list[str]:
        """The other lists of the object whose list ``holder`` is an element of (transformers' DynamicCache:
        ``cache.key_cache`` beside ``cache.value_cache``), as code, that hold a graph made before this step."""
        listed = code_of(holder.list_of) if isinstance(holder, explain.Element) else None
        owner = (listed or "").rpartition(".")[0]
        if not owner or self.start_seq is None or not walk.HAS_SEQ:
            return []
        beside = []
        for name, tensor in explain.candidates(case.scope, case.batch):
            other = code_of(name.list_of) if isinstance(name, explain.Element) else ""
            if other.rpartition(".")[0] == owner and other != listed and re.fullmatch(r"\w+", other[len(owner) + 1:]) \
                    and other not in beside and tensor.grad_fn is not None \
                    and any(type(n) is not walk.ACCUMULATE and sequence_nr(n) < self.start_seq
                            for n in islice(walk.iter_nodes(tensor.grad_fn), 1_000)):
                beside.append(other)
        return beside

    def _written_beside(self, holder: str | None, held: list[torch.Tensor], case: Case) -> list[str]:
        """The other attributes of the object whose attribute ``holder`` is (``model.attn.cache_k`` beside
        ``model.attn.cache_v``), as code, that hold a tensor written in place (``copy_``, slots) over a graph made
        before this step."""
        code = code_of(holder) or ""
        owner = code.rpartition(".")[0]
        if not owner or self.start_seq is None or not walk.HAS_SEQ:
            return []
        beside = []
        for name, tensor in explain.candidates(case.scope, case.batch):
            other = code_of(name) or ""
            if other.rpartition(".")[0] == owner and other != code and re.fullmatch(r"\w+", other[len(owner) + 1:]) \
                    and not any(tensor is t for t in held) and type(tensor.grad_fn).__name__ in walk.WRITES \
                    and any(type(n) is not walk.ACCUMULATE and sequence_nr(n) < self.start_seq
                            for n in islice(walk.iter_nodes(tensor.grad_fn), 1_000)) and other not in beside:
                beside.append(other)
        return beside

    def _remade(self, cls, node, case: Case, made: str, why: str) -> None:
        """``node`` made ``made`` as a module attribute that each forward makes again (``explain.remade_attribute``:
        a pruned weight), read before this step's forward -> ``cls``, naming the attribute (not a tensor of this step
        made from it, whose detaching would drop its gradient)."""
        remade = explain.remade_attribute(node, case.scope)
        if remade is not None:
            raise self._error(cls, node, case,
                f"the loss reaches {{node}}, made {made} as `{remade}`, which each forward makes again (a forward "
                "pre-hook sets it: torch.nn.utils.prune, weight_norm): it was read before this step's forward, which "
                "replaced it; " + why,
                [f"read `{remade}` after this step's forward, so that it holds this step's value",
                 "compute it from what it is made of (`weight_orig * weight_mask` for a pruned weight)"],
                holder=remade)

    def _set_up_after_loss(self, node, step: int) -> bool:
        """Whether ``node`` was made after the last step's loss: a state that step set up for the next one
        (``y0 = pred[-1]`` after the update, a memory bank's ``queue = torch.cat([queue, emb])``), not a value
        made before the loss that read it and kept since (a cache: rotary embeddings' ``cached_freqs``, an
        ``alpha = log_alpha.exp()`` made once)."""
        last = self.loss_seqs.get(step - 1)
        return walk.HAS_SEQ and last is not None and sequence_nr(node) > last

    def _cache_fixes(self, node, case: Case, holder: str) -> list[str]:
        """The fixes for a value made in an earlier step and kept as it was (a cache built by the first forward:
        rotary embeddings' ``cached_freqs``): made from trained parameters, a kept value misses their updates,
        detached or not, so it is made again every step; made from none, it is kept without its graph."""
        leaves = walk.below(node)[1]
        trained = _trained(leaves, case.scope)
        # where the optimizers are known, only what they update now goes stale: a teacher whose training phase is over
        # (Noisy Student's pseudo-labels made once per generation without no_grad) is no cache to make again
        held = _optimized_ids(case.scope)
        trained = [t for t in trained if id(t) in held] if held else trained
        if not trained:
            only = f" (only on {explain.leaf_names(list(leaves), case.scope)})" if leaves else ""
            return [f"keep it without its graph: it depends on no trained parameter{only}, so build it under "
                    "torch.no_grad() or store it detached once made (`{detached}`)",
                    f"recompute it inside {self.words.place} from its inputs"]
        # a dict's entry is cleared by removing it (forward tests `key in cache`, cache.get(key)), an attribute by None,
        # a tuple's item with its tuple (PyG's `conv._cached_edge_index`, an (edge_index, edge_weight) pair)
        keyed = re.fullmatch(r"(?:\w+ )?(.+)\[((['\"]).*\3)\]", holder)
        cleared = f"`{code_of(holder.whole or holder.tuple_of)} = None`" if isinstance(holder, explain.Item) \
            else "`{code} = None`"
        clear = f"`{keyed.group(1)}.pop({keyed.group(2)}, None)`, where forward rebuilds it when it is missing" \
            if keyed else f"{cleared}, where forward rebuilds it when it is None"
        # a plain tensor variable (a latent made once per image before its optimization loop) is no cache a forward
        # rebuilds; an object holding the tensor (a distribution built `if dist is None`) is cleared by None
        cache = "" if not isinstance(holder, explain.Inside) and re.fullmatch(r"\w+", code_of(holder) or "") else \
            f"; clear the cache before each forward ({clear}), or do not cache it"
        fixes = [f"make `{{code}}` again every step instead of keeping it: it is made from "
                 f"{explain.leaf_names(trained, case.scope)}, whose updates a kept value misses (detached, it stays "
                 f"stale){cache}",
                 "if it is a state carried from step to step on purpose (an RNN's hidden state), detach it at the end "
                 "of each step (`{detached}`)"]
        return [_target_fix(""), *fixes] if self._compared(trained, case) else [*fixes, _target_fix("")]

    def _built_from_list(self, node, case: Case, start: int | None = None,
                         holder: str | None = None) -> str | None:
        """The name of ``node``'s tensor (or ``holder``, an item reaching it) in a list the loss is built from, else
        None. Such a list is filled several times in this step (since ``start``, the node counter at its start unless
        given: an episode's log-probs, an actor-critic's saved actions, whose items are tuples) and holds every way
        this step's nodes lead from the loss to a leaf. Not a baseline made of past values, one per step, nor a
        target stored in a replay buffer (DQN's), nor one the loss compares with the network's fresh output."""
        start = self.start_seq if start is None else start
        if not walk.HAS_SEQ or start is None or case.loss.grad_fn is None:
            return None
        found = [(name, t.grad_fn) for name, t in explain.candidates(case.scope, case.batch, deep=True)
                 if t.grad_fn is not None and _list_of(name) is not None]
        for holder in [holder] if holder is not None else dict.fromkeys(name for name, fn in found if fn is node):
            listed = _list_of(holder)
            if listed is None:
                continue
            held = [(name, fn) for name, fn in found if _list_of(name) == listed]
            made = {name[len(listed):].split("]")[0] for name, fn in held if sequence_nr(fn) >= start}
            nodes = {fn for _, fn in held}
            reached = walk.iter_nodes(case.loss.grad_fn, stop=lambda n: n in nodes or sequence_nr(n) < start)
            if len(made) > 1 and not any(type(n) is walk.ACCUMULATE for n in islice(reached, 100_000)):
                return holder
        return None

    def _compared(self, trained: list, case: Case) -> bool:
        """Whether the loss also reaches some of ``trained`` (the parameters a kept value was made from) through this
        step's own nodes: it compares their new output with the kept one (PPO's ratio of new to old log-probabilities,
        a TD error against a stored target), which is then a target made without no_grad, not a stale cache."""
        if not walk.HAS_SEQ or self.start_seq is None or case.loss.grad_fn is None:
            return False
        fresh = walk.walk(case.loss.grad_fn, self.start_seq, case.step).leaves
        return not {id(t) for t in trained}.isdisjoint(id(n.variable) for n in fresh)

    def _reused(self, node, saver, leaves, case: Case) -> bool:
        """Built before training, saving tensors (in ``saver``, at or below ``node``) -> GraphReuseError
        with ``on_reuse=error`` (saying whether a saved tensor has changed since) or once its tensors are
        freed; else retained per ``on_reuse`` (returns True),
        said once per node type (``warn``: a GraphSharingWarning; ``retain``: the log). Not kept (see
        ``_kept``): no verdict."""
        unpacked = walk.unpack_error(saver)
        freed, changed = walk.is_freed(unpacked), walk.is_inplace(unpacked)
        # reused by a backward with create_graph=True, which keeps it (an inverse-Hessian-vector product's
        # torch.autograd.grad through a gradient taken before its loop): stale once what it was made from is updated
        then = node.metadata.setdefault(_BUILT_FROM, [(t, explain.mark(t)) for t in leaves]) if case.retains else None
        updated = explain.changed([node], then) if then is not None else []
        if then is not None and not (freed or changed or updated):
            return False
        if self.on_reuse == "error" or freed:
            # (freed below its first saver: the forwards under a statistic made by several, which their own
            # backwards ran, as EWC's Fisher information weighted with its graph)
            if freed or _freed_below(saver):
                state = "an earlier backward already freed its saved tensors, so this backward would fail"
            elif changed:
                state = f"a tensor it saved was since changed in place ({_WRITES}), so this backward would fail"
            elif updated:
                state = (f"{explain.leaf_names(updated, case.scope)}, which it was made from, were updated since a "
                         "backward that kept it first reused it: this backward would take the gradient at the values "
                         "from before the update")
            elif case.keeps:
                state = ("this step's backward keeps it (retain_graph=True), so every step would back-propagate the "
                         "same graph, with the values it was made from, and fail once an update changes a tensor it "
                         "saved")
            else:
                state = ("this step's backward will free its saved tensors, and the next step would fail with "
                         "'Trying to backward through the graph a second time'")
            self._remade(GraphReuseError, node, case, f"before the step ({self.words.before})", state)
            kept, holder = self._kept(node, case, freed=freed)
            if not kept:
                return False
            saves = f" (its graph saves tensors in {type(saver).__name__})" if saver is not node else ""
            fixes = self._rebuild_fixes(node, holder, leaves, case) + [
                "do not pass retain_graph=True: it would back-propagate the same stale graph every step"]
            raise self._error(GraphReuseError, node, case,
                f"the loss reaches {{node}}, built before the step ({self.words.before}) and held by {{holder}}"
                + saves + "; " + state, fixes, trace_hint=True, holder=holder)
        key = f"retain:{type(node).__name__}"
        if key not in self._warned:
            self._warned.add(key)
            msg = (f"reusing a graph built before the step ({type(node).__name__}); guard.on_reuse={self.on_reuse} "
                   "retains it: it stays in memory and receives gradient every step")
            if self.on_reuse == "warn":
                self._warn(GraphSharingWarning(msg, step=case.step, loss_name=case.name,
                                               node_name=type(node).__name__,
                                               holder=explain.find_holder(node, case.scope, case.batch, scan_gc=False)))
            else:  # said once: as a warning, or in the log
                log.info("step %d, loss '%s': %s", case.step, case.name, msg)
        return True

    def _rebuild_fixes(self, node, holder: str | None, leaves, case: Case) -> list[str]:
        """The fixes for a graph built before the step (``node``) and held by ``holder``: compute it inside the step,
        and if it is meant as a constant, detach it, said only where that is a tensor's own statement (a named tensor)
        or where it trains nothing; a tensor kept unnamed or inside an object (a torch.distributions object built from
        the model's output) and made from trained parameters is built again, not kept detached, which would stop
        their training, unless it is a target the loss compares with (a value target stored in a replay buffer):
        said so (``{code}``: see ``_error``). A named tensor that trains nothing, that the model made over several
        forwards (a statistic of the data), or that holds the responses to data the loss compares with their fresh
        ones (``_responses``), is told to be kept as a constant first."""
        # detaching stops the gradient into the leaves below: right only if that is what was meant
        into = f" (no gradient through it into {explain.leaf_names(leaves, case.scope)})" if leaves else ""
        if _trained(leaves, case.scope):
            constant = [_target_fix(into)]
        else:
            constant = [f"if it is meant as a constant{into}, build it under `torch.no_grad()`"]
        if isinstance(holder, explain.Inside) and code_of(holder.owner) != "self":
            return [f"build `{{code}}` inside {self.words.place} (it holds the graph in `{holder}`, made when it is "
                    "built), so every step builds its own graph"] + constant
        if code_of(holder) is None or isinstance(holder, explain.Inside):  # (inside `self`: the code calling the guard)
            tensor = f"`{holder.split(' ', 1)[-1]}`" if isinstance(holder, explain.Inside) else "the tensor"
            return [f"compute {tensor} inside {self.words.place}, with the object that keeps it (a "
                    "torch.distributions object built from the model's output, a cache), so every step builds its own "
                    "graph"] + constant
        code, detached = "{code}", "{code}.detach()"
        if isinstance(holder, explain.Element) and self._all_built_before(holder, case):
            # every item of the list keeps a graph built before the step (fast neural style's Gram matrices of the
            # style image): the list is made again, or stored detached, as a whole
            code = code_of(holder.list_of)
            detached = f"[t.detach() for t in {code}]"
        fixes = [f"recompute `{code}` inside {self.words.place}, so every step builds its own graph",
                 f"if it is meant as a constant{into}, store `{detached}` instead, or compute it under "
                 "`torch.no_grad()`"]
        # made only from modules' parameters that none of the loop's optimizers update (CoOp's prompt prefix, embedded
        # by CLIP's token embedding, which no optimizer holds; a pretrained encoder outside a GraphGuard's model), it
        # trains nothing: a constant (not so from a tensor of its own that requires grad, noise drawn once: drawn
        # again every step)
        leaves, held = list(leaves), _optimized_ids(case.scope)
        constant = held and leaves and all(isinstance(leaf, torch.nn.Parameter) for leaf in leaves) and \
            held.isdisjoint(map(id, leaves))
        return fixes[::-1] if constant or _several_forwards(node) or self._responses(node, leaves, case) else fixes

    def _responses(self, node, leaves, case: Case) -> bool:
        """Whether ``node`` (built before the step) holds the trained parameters' responses to data that this step's
        own forward of them reads a part of again (a slice of the same tensor: a batch), which the loss compares them
        with: Learning without Forgetting's responses of the original network, recorded once before training as
        distillation targets. Computed again, they would be the trained network's own outputs: a constant. (Not a
        value the loss reads alone, a GNN's full-graph output sliced as each step's prediction, nor one made from
        other data: a state run in time, a factor.)"""
        trained = _trained(leaves, case.scope)
        if not trained or not self._compared(trained, case):
            return False
        params = {p.untyped_storage().data_ptr() for p in trained}

        def data(nodes) -> list[tuple[int, int]]:  # the tensors they saved that are no parameter's: (storage, size)
            return [(t.untyped_storage().data_ptr(), t.numel()) for n in nodes if walk.holds_tensors(n)
                    for t in walk.saved_tensors(n) if not t.requires_grad and t.layout is torch.strided
                    and not t.is_nested and t.untyped_storage().data_ptr() not in params]
        kept = dict(data(islice(walk.iter_nodes(node), 10_000)))
        # a part of a tensor the kept value saved whole (not a module's buffer, which every forward saves as it is)
        return any(size < kept.get(ptr, 0) for ptr, size in
                   data(walk.walk(case.loss.grad_fn, self.start_seq, case.step).nodes) if ptr)

    def _all_built_before(self, holder: explain.Element, case: Case) -> bool:
        """Whether the list ``holder`` is an item of holds tensors only, more than one, each with a graph built
        before the step."""
        items = [t for name, t in explain.candidates(case.scope, case.batch) if _list_of(name) == holder.list_of]
        return len(items) > 1 and self.start_seq is not None and walk.HAS_SEQ and all(
            t.grad_fn is not None and sequence_nr(t.grad_fn) < self.start_seq for t in items)

    def _shared_stale(self, node, leaves, case: Case) -> None:
        """Built before training, saves nothing, from trained parameters -> GraphSharingWarning (once per node
        type). Backward through it works every step, but its value does not follow the parameters. (Built
        from inputs that require grad, it is a fixed input the program differentiates against; a view of a trained
        parameter, such as a tied decoder's ``encoder.weight.t()``, shares its memory and follows it; not kept (see
        ``_kept``), it may be another thread's: no verdict.)"""
        trained = _trained(leaves, case.scope)
        key = f"share:{type(node).__name__}"
        if not trained or key in self._warned or explain.view_of(node, trained, case.scope, case.batch):
            return
        kept, holder = self._kept(node, case)
        if not kept:
            return
        self._warned.add(key)
        code = code_of(holder)
        if _snapshot(node):
            self._warn(GraphSharingWarning(
                f"the loss reaches {type(node).__name__}, built before training started from the trained "
                f"{explain.leaf_names(trained, case.scope)} and held by "
                f"{f'`{holder}`' if holder else 'a tensor made outside the step'}; " + _SNAPSHOT_WHY,
                step=case.step, loss_name=case.name, node_name=type(node).__name__, holder=holder,
                fixes=[_snapshot_fix(holder)]))
            return
        self._warn(GraphSharingWarning(
            f"the loss reaches {type(node).__name__}, built before training started from the trained "
            f"{explain.leaf_names(trained, case.scope)} and held by "
            f"{f'`{holder}`' if holder else 'a tensor made outside the step'}; its value does not follow their "
            "updates. It saves no tensors, so backward works, but it is not recomputed",
            step=case.step, loss_name=case.name, node_name=type(node).__name__, holder=holder,
            fixes=[f"compute `{code or 'it'}` inside {self.words.place}, so it follows the parameters it is made "
                   "from"]))

    def _kept(self, node, case: Case, freed: bool = False) -> tuple[bool, str | None]:
        """Whether ``node``, numbered before the step, really outlived an earlier step; and its holder.

        Node numbers are per thread: a node another thread made in this step (a thread pool,
        ``torch.jit.fork``) can carry any number. One that no earlier step reached and that no
        tensor outside the step holds is taken for such a node; a later step reaching it again
        shows it was kept after all. (Only a named holder counts, and not a plain loop's local variable
        holding ``loss``: the garbage collector also finds tensors of this step that are about to die; nor any
        variable holding a loss this thread made in this step, a script's `global loss` of a pool's outputs; nor a
        variable that the loop sets on every way to the backward to what a call returns (``outs =
        list(pool.map(...))``, see ``bytecode.set_every_time``), for a node that no backward ran (the last one ran
        ``h = cell(x, h)`` with retain_graph=True).)
        ``freed``: its saved tensors are freed, so an earlier backward ran it (one of this step's would have been
        found by ``_check_ran``): it outlived that backward, whether anything but the loss holds it or not (a
        value kept on ``self`` and replaced by this step's before the backward: HF's ``compute_loss``).
        """
        new = case.loss.grad_fn is not None and self.start_seq is not None and walk.HAS_SEQ \
            and sequence_nr(case.loss.grad_fn) >= self.start_seq
        first = node.metadata.setdefault(_FIRST_SEEN, case.step) == case.step
        start = self.start_seq if walk.HAS_SEQ else None
        frame = self.frame  # (read only where a holder is chosen among values of the step: a walk of the code)
        remade = functools.cache(lambda: bytecode.set_first(frame)) if frame is not None and start is not None else None
        holder = explain.find_holder(node, case.scope, case.batch, scan_gc=False, loss=case.loss, new_loss=new,
                                     start=start, remade=remade)
        if first and not freed and holder is not None and self._held_by_this_iteration(node, case, new):
            holder = None
        if first and holder is None and not freed:
            return False, None
        return True, holder or explain.find_holder(node, case.scope, case.batch, loss=case.loss, start=start,
                                                   remade=remade) or _loss_added_to(node, case)

    def _held_by_this_iteration(self, node, case: Case, new: bool) -> bool:
        """Whether only the variables that the plain loop sets in each iteration from a call hold ``node`` (see
        ``_kept``), and the last backward did not run it. (Only the verdict: a holder found beside them names it,
        `batch[i]['target']` of ``batch = [t[0] for t in buffer.sample(8)]`` rather than the buffer it came from.)"""
        if self.frame is None or (walk.HAS_SEQ and sequence_nr(node) in self._ran_last):
            return False
        fresh = bytecode.set_every_time(self.frame, by_calls=True)[1]
        return explain.find_holder(node, case.scope, case.batch, scan_gc=False, loss=case.loss, new_loss=new,
                                   fresh=fresh) is None

    def backward_done(self, retained: bool | None, inputs=None, captured: bool = False) -> None:
        """The loss pre-flighted last was back-propagated (with ``inputs``; ``captured``: by ``torch.autograd.grad``,
        which does not run the nodes that made its inputs): without retaining the graph, the nodes that backward ran
        are freed for the rest of the step (manual mode). ``retained`` None: a backward the guard does not run
        (``GraphGuard.check``): whether it freed them is read from the graph."""
        if self.checking and self._walked is not None:
            name, root, nodes, leaves, where = self._walked
            if not retained:  # the leaves' versions now: a parameter written in place since makes the graph stale
                self._consumed.append((name, root, set(nodes), inputs, explain.versions(leaves), where,
                                       retained is None, captured))
            elif walk.HAS_SEQ and (inputs is None or captured):
                self._ran_now.update(sequence_nr(n) for n in nodes)
        self._walked = None
        if self._giving and retained is not None and not captured:  # the gradients it wrote are there
            self.unused.order.after_backward()
        self._giving = False

    def _check_ran(self, nodes, name, loss, step, scope) -> None:
        """A node that an earlier non-retaining backward of this step ran: backward would find it freed."""
        t0 = time.perf_counter()
        for earlier, root, ran, inputs, versions, where, unknown, captured in self._consumed:
            shared = [n for n in nodes if n in ran and walk.holds_tensors(n) and not self.is_off("consumed", n)]
            if shared and inputs is not None:  # backward(inputs=...) runs only the paths to its inputs
                ran = walk.runs(root, inputs, captured=captured)
                shared = [n for n in shared if n in ran]
            if unknown:  # someone else's backward: the nodes it freed
                shared = [n for n in shared if walk.is_freed(walk.unpack_error(n, first=True))]
            if shared:
                self.spent += time.perf_counter() - t0
                # the earlier loss's update ran since its backward
                updated = any(explain.mark(t) != v for t, v in versions)
                if updated:  # named by a part that update left as it was, where this loss enters one (see _unchanged)
                    shared = _unchanged(nodes, shared, versions) or shared
                call = "the torch.autograd.grad" if captured else "the backward"
                backward = f"{call} of '{earlier}'{explain.at(where)}"
                holder = explain.find_holder(shared[0], scope, None, scan_gc=False, loss=loss)  # what it shares
                holder = holder or explain.find_holder(shared[0], scope, None)
                held = ", held by {holder}" if holder else ""  # none found: a local of the step, most likely
                detail = (f"the loss reaches {{node}}{held}, which {backward} in this step already ran without "
                          "retain_graph, freeing its saved tensors: both losses share that graph")
                shared_part = '`{code}`' if code_of(holder) else 'the shared part'
                retain = "torch.autograd.grad(..., retain_graph=True)" if captured else _retained_call(
                    where, self.words.retain)
                fixes = [f"pass retain_graph=True to {backward} ({retain}), as every backward through a "
                         "shared graph but the last needs",
                         f"compute {shared_part} again (a fresh forward) for the second loss, if it must see the "
                         "updated parameters"]
                if captured:  # the gradient it returned has no graph: in the loss, retain_graph=True drops its term
                    fixes.insert(0, f"if this loss uses the gradient {backward} returned (a gradient penalty, a score "
                                 "matching term), pass create_graph=True to it, so that the term trains the parameters "
                                 "(retain_graph=True alone would let this backward run without that term's gradient)")
                if updated:
                    fixes = [f"if the earlier loss ('{earlier}'{explain.at(where)}) must not reach {shared_part} (its "
                             "update is done: a GAN's discriminator loss on the generator's output), detach it where "
                             f"that loss uses it ({'`{code}.detach()`' if code_of(holder) else '.detach()'}); with "
                             "retain_graph=True its gradient would stay in the .grad of the parameters below and be "
                             "added to their next update",
                             f"if both losses need its gradient, pass retain_graph=True to {backward}"]
                # the same loss again (its top node may save nothing, a mean's): retaining would add its gradient twice
                if loss.grad_fn is root:
                    detail = (f"this loss ({{node}}{held}) was already back-propagated by {backward} in this step, "
                              "without retain_graph, which freed its saved tensors")
                    fixes = [self.words.twice, self.words.shared]
                elif any(n is root for n in nodes):  # made from that loss (`errD = errD_real + errD_fake` after both)
                    made_from = explain.find_holder(root, scope, None, scan_gc=False, loss=loss)  # that loss
                    term = f"`{code_of(made_from)}`" if code_of(made_from) else f"the loss '{earlier}'"
                    detail = (f"this loss is made from {term} ({{node}}), which {backward} in this step already "
                              "back-propagated without retain_graph, freeing its saved tensors: its gradient is in "
                              ".grad already, and with retain_graph=True there it would be added twice")
                    fixes = [f"back-propagate it once: delete this backward, or {backward} (a library's backward "
                             "of the loss you give it, accelerator.backward or mmengine's update_params, "
                             "back-propagates the loss itself)",
                             "for a sum, back-propagate the sum alone or each of its terms, not both"]
                elif code_of(holder) and (statistic := _statistic(holder, ran, scope)) is not None:
                    into = explain.leaf_names(walk.below(statistic.grad_fn)[1], scope)
                    fixes = [_STATISTIC.format(into)]
                changed = explain.changed(shared, versions)
                if changed:  # retaining it cannot help: its values, and the tensors it saved, are from before
                    unseen = explain.through_data(changed, versions)
                    detail += (_CHANGED_DATA if unseen else _CHANGED).format(explain.leaf_names(changed, scope))
                    again = f"`{code_of(holder)}`" if code_of(holder) else "the loss"
                    fixes = [f"compute {again} again after the change (a fresh forward) for this backward, so that "
                             "its gradient is taken at the parameters as they are now"]
                    if root is not loss.grad_fn:  # another loss through the graph: it could have come first
                        fixes.append("if this loss is meant for the parameters as they were, run its backward "
                                     f"before changing them, and pass retain_graph=True to {backward}")
                    if code_of(holder) and _only_changed_below(shared[0], changed, scope):
                        fixes.insert(1, _DETACH_STALE)
                    if isinstance(holder, (explain.Item, explain.Element, explain.Entry)) and \
                            not explain.holds_as_made(shared[0], holder, scope):  # a state each forward makes again
                        fixes.insert(0, "detach the carried state after each backward (`{detached}`), as a "
                                     "truncated BPTT does (an L-BFGS closure's model keeping its LSTM states between "
                                     "calls), or start it again in each forward")
                raise self._error(DoubleBackwardError, shared[0], Case(name, loss, step, scope), detail, fixes,
                                  holder=holder)
        self.spent += time.perf_counter() - t0

    def _freed_statistic(self, case: Case) -> GraphLifecycleError | None:
        """For backward's error on a freed graph: the error naming a statistic of the data (made over several
        forwards: ``_several_forwards``) that the loss reaches and whose graph a backward the guard was not shown freed
        (EWC's Fisher information weighted by the model's probabilities outside ``torch.no_grad()``, estimated by
        backwards of its own), if one is held by name; else None."""
        nodes = set(walk.walk(case.loss.grad_fn, 0, case.step).nodes)
        for name, tensor in explain.candidates(case.scope, case.batch):
            fn = tensor.grad_fn
            if tensor is case.loss or fn not in nodes or not code_of(name) or not _several_forwards(fn):
                continue
            if _freed_below(fn):
                return self._error(DoubleBackwardError, fn, case,
                    "the loss reaches {node}, held by {holder}, a graph that an earlier backward already ran, freeing "
                    "its saved tensors",
                    [_STATISTIC.format(explain.leaf_names(walk.below(fn)[1], case.scope))], holder=name)
        return None

    def _check_consumed(self, nodes, name, loss, step, scope) -> None:
        """A graph a non-retaining backward already consumed (within this step)."""
        for node in nodes:
            if walk.holds_tensors(node):
                err = walk.unpack_error(node, first=True)
                if walk.is_freed(err):
                    raise self._error(DoubleBackwardError, node, Case(name, loss, step, scope),
                        "its graph was already back-propagated without retain_graph (its saved tensors are "
                        f"freed): {self.words.consumed_by}", [self.words.once, self.words.shared])
                return  # the first node that saves tensors tells: a backward frees them all

    def check_again(self, name: str, loss: torch.Tensor, step: int, scope: Scope | None, done: int) -> None:
        """Before another backward on ``loss``, whose graph a backward without retain_graph ran in step
        ``done``: a DoubleBackwardError when that backward freed tensors the graph saved (nothing saved,
        nothing freed: a second backward through it works)."""
        saver, _ = walk.below(loss.grad_fn)
        if saver is None or self.is_off("consumed") or not walk.is_freed(walk.unpack_error(saver, first=True)):
            return
        when = "earlier in this step" if done == step else f"in step {done}"
        first = next((c for c in self._consumed if c[1] is loss.grad_fn), None) if done == step else None
        detail = (f"this loss ({{node}}, held by {{holder}}) was already back-propagated {when} by a backward "
                  f"without retain_graph{explain.at(first[5]) if first else ''}, which freed the saved tensors of "
                  "its graph")
        fixes = [self.words.twice, self.words.shared]
        here = explain.where(self.caller or self.frame)
        if first and first[5] and here and here[0] != first[5][0]:  # this backward is another file's: a library's
            caller = os.path.join(*Path(here[0]).parts[-2:]) if here[0].endswith("__init__.py") else \
                os.path.basename(here[0])
            fixes = [f"delete the backward{explain.at(first[5])}: the code calling this one ({caller}, a library's "
                     "training step say) runs backward on the loss itself"]
        changed = explain.changed([loss.grad_fn], first[4]) if first else []
        if changed:  # SAM's second pass on the first pass's loss: the loss at the changed parameters is another
            detail += _CHANGED.format(explain.leaf_names(changed, scope))
            fixes = ["compute `{code}` again after the change (a fresh forward) for this backward, so that its "
                     "gradient is taken at the parameters as they are now"]
        raise self._error(DoubleBackwardError, loss.grad_fn, Case(name, loss, step, scope), detail, fixes)

    # -- loss without a graph --------------------------------------------------------
    def no_graph(self, name, loss, step, scope=None, batch=None, among: bool = False) -> NoGraphError:
        """``among``: ``loss`` is one of several returned, some of which have a graph (a metric returned with them)."""
        params = list(scope.parameters()) if scope is not None else []
        if loss.is_inference():
            why = "it was computed under torch.inference_mode()"
            fixes = [f"remove torch.inference_mode() from {self.words.place} (keep it for evaluation)"]
        elif loss.requires_grad:  # a leaf: torch.tensor(x.item(), requires_grad=True)
            why = ("it is a leaf tensor made with requires_grad=True (torch.tensor(loss.item(), requires_grad=True), "
                   "say), whose graph begins and ends at itself")
            fixes = ["compute the loss from the model's output and keep it a tensor: no .item(), no torch.tensor() "
                     "around it"]
        elif any(p.grad is loss for p in params):  # differentiated by a Hessian-based optimizer's step
            why = "it is a parameter's gradient (.grad), made by a backward without create_graph=True"
            fixes = ["pass create_graph=True to the backward before the optimizer step (`loss.backward(create_graph="
                     "True)`): an optimizer that differentiates the gradients (AdaHessian, SophiaH) needs their graph"]
        elif params and not any(p.requires_grad for p in params):
            why = "every parameter of the model has requires_grad=False (all frozen)"
            fixes = ["unfreeze the parameters you want to train (p.requires_grad_(True))",
                     "leave the frozen model out of training"]
            if shared := explain.aliases(scope, params):  # `teacher = student`, then the teacher frozen
                named = " and ".join(f"`{key}`" for key in shared)
                why += f"; {named} are one module, not copies: freezing one froze the other"
                fixes.insert(0, f"if `{shared[-1]}` is meant as a copy (a teacher, a target network), make it one: "
                                f"`{shared[-1]} = copy.deepcopy({shared[0]})`, then freeze it")
        elif not torch.is_grad_enabled():  # its backward is called inside no_grad (a caller's: an evaluation's)
            why = ("grad mode is off where its backward is called: it was computed inside torch.no_grad() (perhaps a "
                   "caller's, as an evaluation loop's)")
            fixes = ["compute the loss outside torch.no_grad(), or inside `with torch.enable_grad():` (or under the "
                     "`@torch.enable_grad()` decorator of the function that computes it and steps, as Tent's "
                     "`forward_and_adapt`) where a caller's no_grad cannot be left"]
        else:
            seen = scope.rerun(batch) if scope is not None and scope.rerun is not None and batch is not None else None
            why, fixes = _why_detached(seen, self.words)
            rebound = _rebound_variable(scope, batch)
            if rebound is not None:
                why = (f"`{rebound}` was rebound to a value without a graph (made under torch.no_grad(), or "
                       "detached), and the tensor the optimizer updates, which it held, is no variable's any more")
                fixes = [_REBOUND_FIX.format(code=rebound), *fixes]
            # a gradient of parameters this step took without create_graph=True (seen under watch): what a loss made
            # of gradients (gradient matching's, a penalty) lacks, most likely
            taken = [(earlier, where) for earlier, _, _, inputs, _, where, _, captured in self._consumed
                     if captured and any(isinstance(t, torch.nn.Parameter) for t in inputs or ())]
            if taken and not seen:
                fixes.insert(0, f"if the loss is made of the gradients that the torch.autograd.grad of '{taken[-1][0]}'"
                                f"{explain.at(taken[-1][1])} returned (a matched gradient, a gradient penalty), pass "
                                "create_graph=True to it: without it they carry no graph")
        if among:  # every entry of a returned dict is trained (Lightning's {"loss": ..., "acc": ...} trains "loss")
            fixes = [f"if {name!r} is a metric, log it with self.log({name!r}, value) rather than return it: every "
                     "entry of the dict training_step returns is a loss the Trainer back-propagates", *fixes]
        return NoGraphError(
            f"{why}, so backward has no parameter to differentiate (loss is a {loss.dtype} tensor with "
            f"requires_grad={loss.requires_grad} and no grad_fn)", step=step, loss_name=name, fixes=fixes)

    # -- after a backward raised -------------------------------------------------------
    def _explained_before(self, before: list, case: Case, iteration: int | None) -> GraphLifecycleError | None:
        """What the pre-flight check says of ``before``, the loss's nodes made before the step, if anything."""
        if not before:
            return None
        checking, self.checking = self.checking, True
        try:
            self._before_step(before, case, iteration)
        except GraphLifecycleError as explained:
            return explained
        finally:
            self.checking = checking
        return None

    def explain(self, err: RuntimeError, name: str, loss: torch.Tensor, step: int,
                scope: Scope | None = None, batch: Any = None, stepped: list[str] | None = None,
                iteration: int | None = None):
        """Turn an autograd RuntimeError into a GraphLifecycleError (or None if unrelated); ``iteration``: see
        ``preflight``."""
        text = str(err)
        start = self.start_seq
        before = walk.walk(loss.grad_fn, start, step).before if start is not None else []
        case = Case(name, loss, step, scope, batch)
        if walk.is_freed(err):
            explained = self._explained_before(before, case, iteration)
            if explained is not None:
                return explained
            statistic = self._freed_statistic(case)
            if statistic is not None:
                return statistic
            return self._error(DoubleBackwardError, None, case,
                "backward reached a graph whose saved tensors an earlier backward already freed (" +
                text.split(".")[0] + ")",
                [self.words.twice, self.words.shared,
                 f"compute tensors used by every step inside {self.words.place}, or store them detached"])
        if walk.is_inplace(err):
            tensor = text.split("inplace operation: ")[-1].split(", which is")[0].split(" is at version")[0]
            # "output 0 of SigmoidBackward0" (torch 2.11) or "output 0 of Sigmoid" (2.13): the operation's name
            node_name = (re.sub(r"Backward\d*$", "", text.split("output 0 of ")[-1].split(",")[0])
                         if "output 0 of " in text else None)
            # (what backward meets first under a node made before the step: an add over a matmul)
            saving = [n for n in before if (iteration is None or sequence_nr(n) < iteration)
                      and walk.below(n)[0] is not None and walk.is_inplace(walk.unpack_error(walk.below(n)[0]))]
            if saving:  # a graph kept across steps (on_reuse=retain), or built before training, saw its weights change
                holder = explain.find_holder(saving[0], scope, batch)
                return self._error(InplaceModificationError, saving[0], case,
                    "the loss reaches {node}, built before the step and held by {holder}; a tensor that graph "
                    f"saved ({tensor}) was since changed in place ({_WRITES}), so a graph kept across steps goes "
                    "stale and retain_graph cannot help",
                    self._rebuild_fixes(saving[0], holder, walk.below(saving[0])[1], case), holder=holder)
            # an update that came after a graph the loss reaches was made, in an earlier loop iteration (TGN's memory,
            # written by its GRU and not detached, saved the weights the last iteration's update changed): the carried
            # graph is what to explain, not an optimizer stepped between this step's loss and its backward. Not on a
            # checked step, whose pre-flight judged that graph already, nor for a graph of this iteration (a GAN's
            # D(fake) from before D's step)
            older = [n for n in before if iteration is None or sequence_nr(n) < iteration]
            self._failed_inplace = True  # (the nodes it ran before stopping look freed)
            try:
                explained = self._explained_before(older, case, iteration) if stepped and not self.checking else None
            finally:
                self._failed_inplace = False
            if explained is not None:
                return explained
            written = _written_leaf(loss, text, tensor)
            if written is not None and not stepped:
                node, leaf = written
                holder = explain.find_holder(node, scope, batch)
                code = f"`{code_of(holder)}`" if code_of(holder) else "the tensors made from it"
                names = explain.leaf_names([leaf], scope)
                renorm = _max_norm_of(leaf, scope)
                if renorm is not None:  # nn.Embedding's own documented case
                    return self._error(InplaceModificationError, node, case,
                        f"the loss reaches {{node}}, held by {{holder}}, whose graph saved {names} ({tensor}); it "
                        f"was written in place since by the lookup of its nn.Embedding, whose max_norm={renorm} "
                        "renormalizes the rows it reads in place, in forward",
                        [f"compute {code} from a copy of the weight ({names.strip('`')}.clone()), as "
                         "nn.Embedding's documentation says for max_norm, or after the lookups",
                         "renormalize the rows yourself, out of place (F.normalize or torch.renorm of the looked-up "
                         "rows), and leave max_norm=None"],
                        holder=holder)
                return self._error(InplaceModificationError, node, case,
                    f"the loss reaches {{node}}, held by {{holder}}, whose graph saved "
                    f"{names} ({tensor}); it was written in place since, by no "
                    f"optimizer step the guard was told of ({_WRITES})",
                    [f"compute {code} inside {self.words.place}, after the weights are written, so that its graph "
                     "saves them as they are",
                     "write the weights (load, initialize, wrap in DDP) before computing anything from them",
                     "if an optimizer step wrote them (a GAN's discriminator step before the generator's loss), "
                     "compute the loss after that step"],
                    holder=holder)
            # an optimizer's step is blamed only for a parameter it wrote: a tensor the program made (a generator's
            # `fake` written in place after the discriminator's step) is the program's own in-place write
            if stepped and written is not None:  # named by what alone holds the node that saved it (`errG`)
                holder = explain.sole_holder(written[0], scope)
                loss_code = f"`{code_of(holder)}`" if code_of(holder) else "the loss"
                detail = (f"optimizer {', '.join(repr(s) for s in stepped)} stepped after this loss was built and "
                          f"before its backward, changing parameters its graph saved ({tensor})")
                fixes = [f"recompute {loss_code} after the optimizer step (in a GAN: the generator loss from a fresh "
                         "D(fake) after the discriminator step; a gradient penalty from a fresh D(real))",
                         "step the optimizer after this backward"]
            else:
                made_by = f", the output of {node_name}" if node_name else ""
                held = _written_tensor(text, tensor, scope, batch, loss)  # MoCo's queue, enqueued into before backward
                made_by += f": `{held}` or a view of it" if held else ""
                detail = (f"a tensor the graph saved for backward ({tensor}{made_by}) was changed in place "
                          "after it was used")
                fixes = ["use the out-of-place form (x = x + 1 rather than x += 1 or x.add_(1))",
                         ".clone() the tensor before changing it"]
                if held and not node_name:  # a tensor kept from step to step, no operation's output: a buffer
                    fixes.insert(0, f"read a copy of `{code_of(held)}` where the step uses it "
                                 f"(`{code_of(held)}.clone()`, as MoCo reads its queue), or write into it after the "
                                 "backward")
                if not self.trace:
                    fixes.append(f"{self.words.trace}: PyTorch then prints the traceback of the forward call whose "
                                 "saved tensor was changed")
            err = self._error(InplaceModificationError, None, case, detail, fixes)
            err.node_name = node_name
            return err
        if "does not require grad" in text:
            return self.no_graph(name, loss, step, scope, batch)
        return None

    def explain_outside(self, err: BaseException, step: int, stepped: Mapping[str, Any],
                        parameters: list[tuple[str, torch.Tensor, int]],
                        undone: str) -> InplaceModificationError | None:
        """An autograd error raised outside the Trainer's backward (``torch.autograd.grad`` in training_step)
        after optimizers ``stepped`` (name -> optimizer) updated in this step: a graph built before an update
        saved a parameter it changed in place. ``parameters``: ``(name, parameter, version when the error was
        raised)``; the tensor PyTorch names is taken for one of them (or a view of it: a transposed weight)
        when a parameter a stepped optimizer updates has its version and size. ``undone``: what abandoning the
        step left as it was. None for any other error, or when no such parameter is found."""
        if not stepped or not isinstance(err, RuntimeError) or not walk.is_inplace(err):
            return None
        text = str(err)
        version, size = re.search(r"is at version (\d+)", text), re.search(r"\[\w+\.\w+ \[([\d, ]*)\]\]", text)
        if version is None or size is None:
            return None
        shape = tuple(int(n) for n in re.findall(r"\d+", size.group(1)))
        owner = {id(p): name for name, opt in stepped.items() for g in opt.param_groups for p in g["params"]}
        candidates = [(name, p) for name, p, seen in parameters if id(p) in owner and seen == int(version.group(1))]
        found = [(name, p) for name, p in candidates if tuple(p.shape) in (shape, shape[::-1])] or \
            [(name, p) for name, p in candidates if p.numel() == math.prod(shape)]
        if not found:
            return None
        which = " or ".join(f"`{name}`" for name, _ in found)
        by = ", ".join(sorted({repr(owner[id(p)]) for _, p in found}))
        return InplaceModificationError(
            f"an autograd call outside self.backward (torch.autograd.grad in training_step, say) went through a "
            f"graph built before optimizer {by} stepped in this step; that update changed {which} in place, and the "
            f"graph had saved it ({size.group(0)}, now at version {version.group(1)}). The step was abandoned "
            f"({undone})", step=step,
            fixes=["differentiate a fresh forward made after the optimizer step (for a gradient penalty: compute "
                   "D(real) again, then its gradient)", "take that gradient before the optimizer step"])

    def inplace_check(self, loss: torch.Tensor, stepped: Mapping[str, int], start_seq: int,
                      inputs=None) -> tuple[RuntimeError, list[str]] | None:
        """Before a manual backward: a saved tensor that an optimizer step of this step changed.

        ``stepped`` maps each optimizer that already stepped in this step to the node counter
        at its step. Only this step's nodes (counter >= ``start_seq``) made before the newest
        of those steps can hold a stale tensor, so only their saved tensors are unpacked, and
        with ``inputs`` only those backward will run (on a path to an input). ``stepped`` empty: every node of the
        step's is looked at (for a backward someone else runs, whose error the guard cannot explain afterwards).
        Returns PyTorch's error and the optimizers that stepped after that node was made.
        """
        if self.is_off("inplace"):
            return None
        newest = max(stepped.values(), default=math.inf)
        t0 = time.perf_counter()
        try:
            ran = None
            for node in walk.walk(loss.grad_fn, start_seq, 0).nodes:
                made = sequence_nr(node)
                if made < newest and walk.holds_tensors(node) and not self.is_off("inplace", node):
                    if inputs is not None:
                        ran = walk.runs(loss.grad_fn, inputs) if ran is None else ran
                        if node not in ran:
                            continue
                    err = walk.unpack_error(node)
                    if walk.is_inplace(err):
                        return err, [name for name, seq in stepped.items() if seq > made]
            return None
        finally:
            self.spent += time.perf_counter() - t0

    # -- after the step ------------------------------------------------------------------
    def _forget_consumed(self) -> None:
        """Drop the step's consumed graphs (they hold its nodes), keeping their leaves' versions: a graph of the step
        that a later step's loss reaches, under parameters an update changed since, cannot be retained (see
        ``_freed_in_iteration``)."""
        self._last_versions = [v for consumed in self._consumed for v in consumed[4]]
        self._consumed, self._walked = [], None

    def end_step(self, step: int, scope: Scope | None = None) -> None:
        """A timed step of the Trainer is over: what it consumed is dropped, and its graphs are left to the leak checks
        (``leaks.Leaks.step_over``)."""
        self._forget_consumed()
        self._printed = {}  # it holds the step's nodes
        self.leaks.step_over(step, scope, self.start_seq, self.thorough)

    # -- messages ------------------------------------------------------------------------
    def _error(self, cls, node, case: Case, detail: str, fixes: list[str], trace_hint: bool = False,
               holder: str | None = ..., what: str | None = None) -> GraphLifecycleError:
        """The error ``cls`` (titled ``what`` when given) about ``node`` (None: no node in particular) in ``case``'s
        loss, with its picture.
        ``detail`` and ``fixes`` may name ``{node}``, ``{holder}`` (``holder``: found when not given),
        ``{code}`` (the holder's expression) and ``{detached}`` (the statement that detaches it)."""
        if holder is ...:
            holder = explain.find_holder(node, case.scope, case.batch) if node is not None else None
        node_name = type(node).__name__ if node is not None else None
        code = code_of(holder) or "tensor"
        # code in backticks
        described = f"`{holder}`" if code_of(holder) else holder or "a tensor made outside the step"
        names = {"node": node_name, "holder": described, "code": code, "detached": f"{code} = {code}.detach()"}
        if isinstance(holder, explain.Entry):  # a dict of tensors: every value detached, in the same dict
            whole = code_of(holder.whole)
            names["detached"] = f"{whole}.update({{k: v.detach() for k, v in {whole}.items()}})"
        elif isinstance(holder, (explain.Item, explain.Element)) and holder.whole:  # inside a tuple in a tuple
            whole = code_of(holder.whole)
            names["detached"] = f"{whole} = {holder.rebuilt.format(whole)}"
        elif isinstance(holder, explain.Item):  # an item of a tuple: the tuple is replaced, every tensor detached
            whole = code_of(holder.tuple_of)
            names["detached"] = f"{whole} = tuple(t.detach() for t in {whole})"
        elif isinstance(holder, explain.Element):  # of a list: likewise
            whole = code_of(holder.list_of)
            names["detached"] = f"{whole} = [t.detach() for t in {whole}]"
        elif isinstance(holder, explain.Inside):  # inside an object (`dist.loc`): that tensor, not the object
            names["detached"] = f"{holder} = {holder}.detach()"
        line = explain.traceback_of(node) if node is not None else None
        detail = detail.format(**names)
        if line:
            detail += f"; it was created at {line}"
        elif trace_hint and not self.trace:
            fixes = fixes + [f"{self.words.trace} to have the error name the line that created it"]
        picture = None
        if self.out_dir is not None:
            with suppress(OSError):  # an unwritable directory costs the picture, never the error itself
                picture = render(case.loss.grad_fn, self.out_dir / f"step{case.step}_{case.name}.dot",
                                 [node] if node is not None else (), holder)
        return cls(detail, step=case.step, loss_name=case.name, node_name=node_name, holder=holder,
                   fixes=[f.format(**names) for f in fixes], picture=picture, what=what)


def _placeholder(loss: torch.Tensor) -> bool:
    """A zero made to require grad, ``torch.tensor(0., requires_grad=True)``: a step's way of saying that its batch
    has nothing to learn from (an empty mask, no valid pair). Its backward changes nothing, as in a plain loop.
    Read only for a loss without a graph (one host sync, on that path alone)."""
    return loss.requires_grad and loss.numel() == 1 and not loss.is_inference() and float(loss.detach()) == 0.0


def _hooked(loss: torch.Tensor) -> bool:
    """A leaf whose backward runs hooks registered on it (``loss.register_hook``): GradCache's loss
    (sentence-transformers' ``Cached*`` losses return ``loss.detach().requires_grad_()`` with a hook that embeds the
    batch again and back-propagates the gradients cached for the embeddings), whose graph is made in its backward."""
    return loss.requires_grad and bool(loss._backward_hooks)


def _check_names(names) -> frozenset:
    unknown = [n for n in names if n not in GUARD_CHECKS]
    if unknown:
        raise ConfigError([f"guard.ignore: {name!r} is not one of {', '.join(GUARD_CHECKS)}" for name in unknown])
    return frozenset(names)


def _optimized_ids(scope) -> set[int]:
    """The ids of the parameters the loop's optimizers update, those in its variables and those known to step; empty
    while none is known."""
    held = {id(p) for opt in explain.optimizers(scope) for g in opt.param_groups for p in g["params"]}
    held.update(map(id, (scope.optimized() if scope is not None else None) or ()))
    return held


def _rebound_leaf(node, held: list[torch.Tensor], case: Case) -> torch.Tensor | None:
    """The tensor an optimizer updates, of the shape of ``held`` (the carried state), that ``node``'s graph reaches and
    that no variable holds any more: the variable that held it was rebound to a value made from it (VQGAN+CLIP's latent
    clamped out of place after each step, `z = z.clamp(...)`). The optimizer keeps updating that old tensor."""
    optimized = _optimized_ids(case.scope)
    if not optimized or not held:
        return None
    leaves = [n.variable for n in islice(walk.iter_nodes(node), 10_000) if type(n) is walk.ACCUMULATE
              and id(n.variable) in optimized and n.variable.shape == held[0].shape
              and not isinstance(n.variable, torch.nn.Parameter)]
    named = _named_ids(case.scope, case.batch) if leaves else set()
    return next((leaf for leaf in leaves if id(leaf) not in named), None)


def _rebound_variable(scope, batch) -> str | None:
    """A variable holding a tensor without a graph, of the shape of one an optimizer updates that no variable holds
    any more: rebound to a value made from it under torch.no_grad() (VQGAN+CLIP's latent clamped out of place there).
    As code, or None."""
    plain = [p for opt in explain.optimizers(scope) for g in opt.param_groups for p in g["params"]
             if not isinstance(p, torch.nn.Parameter)]
    if scope is None or not plain:
        return None
    named = _named_ids(scope, batch)
    lost = [p for p in plain if id(p) not in named]
    return next((code_of(name) for name, t in explain.candidates(scope, batch) if lost and not t.requires_grad
                 and re.fullmatch(r"(local|global) \w+", name) and any(t.shape == p.shape for p in lost)), None)


def _named_ids(scope, batch) -> set[int]:
    """The ids of the tensors the scope's variables hold, and of its modules' parameters (a Parameter is its module's,
    whatever the variables hold: never a latent or an input a variable let go of)."""
    named = {id(t) for _, t in explain.candidates(scope, batch)}
    if scope is not None:
        named.update(id(p) for module in _modules_of(scope) for p in module.parameters())
    return named


_REBOUND_FIX = ("write the new value into `{code}` in place under `torch.no_grad()` (`with torch.no_grad(): "
                "{code}.copy_(...)` where `{code} = ...` is written), so that `{code}` stays the tensor the optimizer "
                "updates (detached, it would not be trained at all)")


def _retained_call(where: tuple[str, int] | None, default: str) -> str:
    """The backward call on the line ``where`` with retain_graph=True added, as code (`latents.backward(gradient=grad,
    retain_graph=True)` of score distillation's gradient given by hand), or ``default`` where that line is not one
    call of a tensor's ``backward`` alone."""
    line = linecache.getline(where[0], where[1]).strip() if where is not None else ""
    call = re.fullmatch(r"([\w.\[\]]+)\.backward\((.*)\)", line)
    if call is None or "retain_graph" in call[2] or "(" in call[2]:
        return default
    args = f"{call[2]}, " if call[2] else ""
    return f"{call[1]}.backward({args}retain_graph=True)"


def _trained(leaves, scope) -> list:
    """The leaves that are trained parameters."""
    if scope is None or not leaves:
        return []
    ids = {id(p) for p in scope.parameters()}
    return [leaf for leaf in leaves if id(leaf) in ids]


def _snapshot(node) -> bool:
    """Whether ``node`` clones one leaf (``p.clone()``): kept, it is a snapshot of a parameter's values, with its graph
    (FedProx's global weights taken as ``[p.clone() for p in model.parameters()]``). (Not a copy to another dtype:
    ``torch.autocast``'s cached weights, see ``_cached_weight``.)"""
    if type(node).__name__ != "CloneBackward0":
        return False
    nexts = [fn for fn, _ in node.next_functions if fn is not None]
    return len(nexts) == 1 and type(nexts[0]).__name__ == "AccumulateGrad"


_SNAPSHOT_WHY = ("it is a copy of that parameter's values kept with its graph: a term comparing the parameter with it "
                 "(FedProx's proximal term `(w - w_t).norm()`) gets no gradient for the parameter, the copy's path "
                 "cancelling the parameter's own")


def _snapshot_fix(holder: str | None) -> str:
    """Store a snapshot of the weights detached (the whole list, where it is an item of one); made again inside the
    loop, it would be the weights themselves."""
    listed, code = code_of(_list_of(holder)), code_of(holder) or "it"
    whole = code_of(holder.whole) if isinstance(holder, explain.Entry) else None
    stored = f"{listed} = [t.detach() for t in {listed}]" if listed else \
        f"{whole} = {{k: v.detach() for k, v in {whole}.items()}}" if whole else f"{code} = {code}.detach()"
    return (f"store the copy detached (`{stored}`, or make it with `p.detach().clone()`), so that it stays the "
            "weights as they were; made again inside the loop, it would be the weights themselves")


_COPIED_FIX = ("detach what is copied into `{code}` where it is written (`{code}.copy_(x.detach())`), or write it "
               "under `torch.no_grad()`, so that it keeps a value, not the graph of the step that made it")
def _modules_of(scope: Scope) -> list[torch.nn.Module]:
    """The modules a scope holds: its roots, their attributes, the variables it reads (by type only)."""
    values = list(scope.roots.values()) + [v for _, space in scope.namespaces() for v in list(space.values())]
    for root in list(scope.roots.values()):
        with suppress(TypeError):
            values += [v for k, v in vars(root).items() if not k.startswith("_")]
    return list({id(v): v for v in values if issubclass(type(v), torch.nn.Module)}.values())


def _backward_reads(fn, key: str) -> bool:
    """Whether the ``backward`` of autograd Function node ``fn`` names attribute ``key`` (``ctx.x``) in its code or
    in the functions defined in it; False when its code cannot be read (a helper it hands ``ctx`` to is not read:
    a miss, never a false alarm)."""
    return _reads(type(fn), key)


@functools.lru_cache(maxsize=1024)
def _reads(node_type: type, key: str) -> bool:
    backward = getattr(getattr(node_type, "_forward_cls", None), "backward", None)
    code = getattr(inspect.unwrap(backward), "__code__", None) if backward is not None else None
    codes = [code] if code is not None else []
    while codes:
        code = codes.pop()
        if key in code.co_names:
            return True
        codes += [c for c in code.co_consts if isinstance(c, types.CodeType)]
    return False


def _changed_after(fn, tensor, used: int, depth: int = 8) -> str | None:
    """How ``tensor``, kept on the ctx of autograd Function node ``fn``, was changed in place after node counter
    ``used`` (the first use of the Function's output): its grad_fn's name when that grad_fn was made since and its
    first inputs lead back, within ``depth`` in-place nodes, to ``fn`` or to one of ``fn``'s inputs. None otherwise
    (unchanged; a tensor without a graph, whose changes leave no trace; one made by the Function's forward)."""
    if not isinstance(tensor, torch.Tensor) or tensor.grad_fn is None or tensor._version == 0:
        return None
    now = tensor.grad_fn
    if now is fn or sequence_nr(now) < used:
        return None
    inputs = {n for n, _ in fn.next_functions if n is not None}
    node = now
    for _ in range(depth):
        if not node.next_functions or node.next_functions[0][0] is None:
            return None
        node = node.next_functions[0][0]
        if node is fn or node in inputs:
            return f"its grad_fn is now {type(now).__name__}, made after the Function's output was used"
        if type(node) is walk.ACCUMULATE or sequence_nr(node) <= used:
            return None
    return None


def _loss_added_to(node, case: Case) -> str | None:
    """The variable holding the loss itself where the loss is a tensor added to in place over ``node`` (``loss +=
    term``, the sum started once for several backwards: gradient matching's ``loss = torch.tensor(0.0)`` once per
    iteration, not once per outer step): nothing else holds that node, an earlier sum's last term."""
    loss, fn = case.loss, case.loss.grad_fn
    if loss._version == 0:
        return None
    for _ in range(1_000):  # down the chain of in-place writes, each the next one's first input
        fn = fn.next_functions[0][0] if fn is not None and fn.next_functions else None
        if fn is None or fn is node:
            break
    return next((name for name, t in explain.candidates(case.scope, case.batch) if t is loss), None) \
        if fn is node else None


def _list_of(holder: str | None) -> str | None:
    """The list a holder is an element of, directly or inside tuples (an actor-critic's (log-prob, value) pairs)."""
    return holder.list_of if isinstance(holder, explain.Element) else getattr(holder, "in_list", None)


_START_AGAIN = ("start the sum again after each backward (`{code} = 0`), so that each backward takes the losses added "
                "since the last one (the GFlowNet tutorial's `minibatch_loss`)")


# formatted twice (here, then with the holder's names): its braces doubled twice
_STALE_TERM_FIX = ("make `{mapping}` anew every step (`{mapping} = {{{{}}}}` at the start of each step, or "
                   "`{mapping} = ...` from what the step computes, not `.update(...)` of the dict made before the "
                   "loop): it still holds `{key}`, a loss of an earlier step that this step did not write again, and "
                   "the sum of its values takes it")


def _stale_term(node, holder: str | None, held: list[torch.Tensor], case: Case) -> tuple[str, str] | None:
    """(the dict, the key) when ``holder`` is a dict's entry (``loss_dict['loss_mask']``) holding a loss of an earlier
    step, ``node`` (a scalar, ``held``), that the loss adds as one of its terms: a loss dict made before the loop and
    updated every step from a model that writes that entry on some steps only (a head whose targets some batches
    lack). Not a cached tensor that the step adds to its activations (a positional embedding): no scalar."""
    keyed = re.fullmatch(r"(?:\w+ )?(.+)\[((['\"]).*\3)\]", str(holder))
    if keyed is None or not held or any(t.dim() for t in held):
        return None
    takers = [n for n in islice(walk.iter_nodes(case.loss.grad_fn), 100_000)
              if any(m is node for m, _ in n.next_functions)]
    return (keyed.group(1), keyed.group(2)) if takers and all(
        type(n).__name__.startswith("AddBackward") for n in takers) else None


def _summed(node, held: list[torch.Tensor], case: Case) -> bool:
    """Whether ``held`` are sums of losses kept across steps (``value_loss += current_value_loss`` started once,
    before the loop): each made by an addition, as ``node``, its value at an earlier step, that in the loss's graph
    only additions of a loss take (a reduction: ``.sum(1)``, ``.mean()``, ``F.mse_loss``). Not a recurrent state,
    which goes through its cell too (`h = h + f(h)`), nor an integrated one (`pos = pos + dt * vel`)."""
    if not held or type(node).__name__ != "AddBackward0" or \
            any(type(t.grad_fn).__name__ != "AddBackward0" for t in held):
        return False
    takers = [n for n in islice(walk.iter_nodes(case.loss.grad_fn), 100_000)
              if any(m is node for m, _ in n.next_functions)]
    terms = [m for n in takers for m, _ in n.next_functions if m is not None and m is not node]
    return bool(takers) and bool(terms) and all(type(n).__name__ == "AddBackward0" for n in takers) and all(
        type(m).__name__.startswith(("Sum", "Mean")) or "Loss" in type(m).__name__ for m in terms)


def _is_held(holder: str | None, tensor: torch.Tensor, case: Case) -> bool:
    """Whether the variable or attribute named ``holder`` holds ``tensor`` itself."""
    return any(t is tensor for name, t in explain.candidates(case.scope, case.batch) if name == holder)


def _statistic(holder: str, ran: set, scope) -> torch.Tensor | None:
    """The tensor ``holder`` names, if it is a statistic of the data that an earlier backward's graph is under but
    that backward did not go through: made over several forwards (``_several_forwards``) beside the losses back-
    propagated one per sample, as EWC's Fisher information is (weighted by the model's own probabilities, taken
    outside ``torch.no_grad()``). It is meant as a constant: retaining that graph for it would keep it, and the next
    update of the weights it saved would break it."""
    held = next((t for name, t in explain.candidates(scope) if name == holder), None)
    fn = getattr(held, "grad_fn", None)
    return held if fn is not None and fn not in ran and _several_forwards(fn) else None


def _several_forwards(node) -> bool:
    """Whether the graph below ``node`` reaches a leaf from several places side by side, none below another, and
    combines them into one value (a sum, a mean): a value the model made over several forwards of different data, a
    statistic of the data (Deep SVDD's center, the mean of the network's outputs over the training set, computed once
    before training), meant as a constant: computing it again every step would run the model over the data each time.
    Not one made by steps in time, each using the last one's output (an ODE or SDE solved, an RNN run over a
    sequence), nor values kept apart (DreamBooth's prompt embeddings, stacked, of a text encoder it trains): the
    model's forwards, computed again."""
    uses: dict[int, list] = {}
    for n in islice(walk.iter_nodes(node), 100_000):
        for nxt, _ in n.next_functions:
            if type(nxt) is walk.ACCUMULATE:
                uses.setdefault(id(nxt), []).append(n)
    first = next((found[:2] for found in uses.values() if len(found) > 1), None)
    if first is None or walk.reachable(*first, limit=10_000) or walk.reachable(*first[::-1], limit=10_000):
        return False
    return any(_REDUCTION.fullmatch(type(n).__name__) and all(walk.reachable(n, f, limit=10_000) for f in first)
               for n in islice(walk.iter_nodes(node), 200))


_REDUCTION = re.compile(r"(Add|Sub|Sum|Mean|Std|Var|StdMean|VarMean)Backward\d")  # nodes combining values into one


def _list_fixes(holder: explain.Element, built: str | None) -> list[str]:
    """The fixes for a list keeping earlier steps' graphs, whose item ``holder`` is; ``built``: the loss is built from
    it (see ``Guard._built_from_list``), and detaching what is added would leave the loss without its graph."""
    listed = code_of(_list_of(holder))
    if built:
        return [f"empty `{listed}` after each backward (`del {listed}[:]`): the loss is built from it (REINFORCE's "
                "log-probs of an episode, an actor-critic's saved actions), so no earlier step's values may stay in it"]
    if holder.filled_by:  # a library's list, which it keeps and empties itself
        return [detach_what_is_added(holder)]
    return [detach_what_is_added(holder), f"if the loss is built from `{listed}` (REINFORCE's log-probs of an "
            f"episode, losses stacked over several iterations), empty it after each backward (`del {listed}[:]`), "
            "and let one step span the iterations that add to it"]


_WRITTEN_BELOW = ("make the writes that grew its graph under `torch.no_grad()` (or from `p.detach()`): values made "
                  "from the parameters and added step after step to a tensor outside any loss (a running sum such as "
                  "Synaptic Intelligence's path integral, `W[n].add_(-p.grad * (p.detach() - p_old[n]))`; an EMA's "
                  "shadow copy, `ema[k] = d * ema[k] + (1 - d) * p`), which {holder} is made from; it then holds no "
                  "graph")
_WRITES = ("optimizer steps update parameters in place, and so do writes under torch.no_grad() or through .data, "
           "such as DDP's broadcast of the weights at start-up")


def _max_norm_of(leaf: torch.Tensor, scope: Scope | None) -> float | None:
    """The ``max_norm`` of the ``nn.Embedding`` or ``nn.EmbeddingBag`` among the scope's modules whose weight is
    ``leaf``: its lookups renormalize the rows they read in place (under ``no_grad``), so a graph that saved the
    whole weight before a lookup fails in backward. None when no such module is found."""
    if scope is None:
        return None
    for root in _modules_of(scope):
        for module in root.modules():
            if isinstance(module, (torch.nn.Embedding, torch.nn.EmbeddingBag)) and module.weight is leaf:
                return module.max_norm
    return None


def _written_leaf(loss, text: str, tensor: str, limit: int = 100_000) -> tuple[Any, torch.Tensor] | None:
    """For PyTorch's in-place error ``text`` naming ``tensor``: the first node of the loss's graph whose saved
    tensors fail so, and a leaf it takes as input (directly or through a view, a transposed weight) whose
    version and size are those PyTorch names: a parameter written in place after the graph saved it. None
    when there is no such pair: then it was a tensor the program made."""
    version, sizes = re.search(r"is at version (\d+)", text), re.search(r"\[([\d, ]*)\]\]$", tensor)
    if version is None or sizes is None:
        return None
    shape = tuple(int(n) for n in re.findall(r"\d+", sizes.group(1)))
    for node in islice(walk.iter_nodes(loss.grad_fn), limit):
        if type(node) is walk.ACCUMULATE or not walk.holds_tensors(node):
            continue
        if not walk.is_inplace(walk.unpack_error(node)):
            continue
        inputs = [n for n, _ in node.next_functions if n is not None]
        inputs += [m for n in inputs for m, _ in n.next_functions if m is not None]
        for leaf in (n.variable for n in inputs if type(n) is walk.ACCUMULATE):
            if leaf._version == int(version.group(1)) and tuple(leaf.shape) in (shape, shape[::-1]):
                return node, leaf
        return None
    return None


def _written_tensor(text: str, tensor: str, scope: Scope | None, batch: Any, loss=None) -> str | None:
    """For PyTorch's in-place error ``text`` naming ``tensor``: the name of the tensor the scope holds (a module's
    buffer or attribute, a variable) whose version is the one PyTorch names and whose number of elements ``tensor``
    has (the saved tensor may be a view of it: an unsqueezed queue), or, failing that, more (a slice of it: the view
    ``fake[:3]`` an augmentation saved), searched nearest first: the first variable that holds such tensors must hold
    one alone (None if none does, or if it holds several: two buffers alike), or of those it holds, one alone in a
    module whose parameters the ``loss`` reaches (the model's queue, not its copy in a deep copy of the model made for
    an EMA, whose parameters the loss does not reach). An operation's output ("output 0 of Sigmoid") is in the graph:
    a tensor that requires no grad (a deep copy of a state dict) is not it."""
    version, sizes = re.search(r"is at version (\d+)", text), re.search(r"\[([\d, ]*)\]\]$", tensor)
    if version is None or sizes is None:
        return None
    numel = math.prod(int(n) for n in re.findall(r"\d+", sizes.group(1)))
    output = "output 0 of " in text
    alike = [(name, t) for name, t in explain.candidates(scope, batch)
             if t._version == int(version.group(1)) and t.numel() >= numel and (t.requires_grad or not output)]
    # the one whose graph from before its write a node of the loss's failed to unpack reads (a view of it saved:
    # `mac_out[:, :-1]`), not another tensor of that size written before its own graph saved it (double Q's targets)
    if output and loss is not None and loss.grad_fn is not None:
        alike = _written_after_saving(loss, alike) or alike
    alike = [(name, t) for name, t in alike if t.numel() == numel] or alike
    found = [(re.split(r"[.\[]", name)[0], name, t) for name, t in alike]
    nearest = {id(t): name for holder, name, t in found if holder == found[0][0]} if found else {}
    if len(nearest) > 1 and loss is not None and loss.grad_fn is not None:
        names = explain.parameter_names(scope)
        reached = [names[id(n.variable)][0] for n in islice(walk.iter_nodes(loss.grad_fn), 100_000)
                   if type(n) is walk.ACCUMULATE and id(n.variable) in names]

        def owns(name: str, params) -> bool:  # whether the module that holds ``name`` holds one of ``params``
            owner = name.rpartition(".")[0]
            return bool(owner) and any(p.startswith(owner + ".") for p in params)
        used = {i: name for i, name in nearest.items() if owns(name, reached)}
        # the others in modules of their own whose parameters the loss does not reach (a deep copy of the model)
        if all(owns(name, [n for n, _ in names.values()]) for i, name in nearest.items() if i not in used):
            nearest = used
    return next(iter(nearest.values())) if len(nearest) == 1 else None


def _written_after_saving(loss, alike: list) -> list:
    """Of ``alike`` (name, tensor), those written in place after a node of ``loss``'s graph saved them or a view of
    them: the node whose saved tensors fail to unpack for an in-place write reads, through views, from the grad_fn
    the tensor had before that write, which the write's node goes on to (or which it still has: written through a
    detached alias, `mac_out.detach()`)."""
    read = set()
    for node in islice(walk.iter_nodes(loss.grad_fn), 100_000):
        if walk.is_inplace(walk.unpack_error(node)):
            todo = [fn for fn, _ in node.next_functions if fn is not None]
            while todo:
                fn = todo.pop()
                read.add(fn)
                if _VIEW.match(type(fn).__name__):
                    todo.extend(f for f, _ in fn.next_functions if f is not None and f not in read)
    return [(name, t) for name, t in alike if t.grad_fn is not None
            and (t.grad_fn in read or any(fn in read for fn, _ in t.grad_fn.next_functions))]


_VIEW = re.compile(r"(Slice|Select|View|UnsafeView|ViewAs|AsStrided|Expand|Unsqueeze|Squeeze|Transpose|T|Permute|"
                   r"Alias|Narrow|Diagonal|Unfold|Split|SplitWithSizes|UnsafeSplit|Unbind|Reshape|ReshapeAlias)"
                   r"Backward\d*$")


_CHANGED = ("; since that backward, {} under that graph were changed in place (by an optimizer step, or by hand as "
            "SAM's first step moves the weights), so the graph holds values from before the change: retain_graph=True "
            "cannot help (PyTorch refuses a graph whose saved tensors were written in place)")
_CHANGED_DATA = ("; since that backward, {} under that graph were written through `.data` (as an adversarial "
                 "attack perturbs an embedding weight), so the graph holds values from before the change: with "
                 "retain_graph=True this backward would run on them without a word")
_FREED = ("an earlier backward already freed the saved tensors of its graph: going through it again is what makes "
          "PyTorch fail with 'Trying to backward through the graph a second time'")
_AGAIN = "the same graph is back-propagated again by every step since it was made"
_SAVED_CHANGED = (f"a tensor its graph saved was changed in place since it was made ({_WRITES}), so this backward "
                  "would fail")
_RAN_AGAIN = ("the last step's backward already ran its graph (retain_graph=True kept it), so this backward runs it "
              "again: its gradient is added a second time, through weights the update has since changed")
# the fix for a loss reaching, through a graph an update made stale, no trained parameter but those updated
_STATISTIC = ("if it is meant as a constant (a statistic of the data made over several forwards, as EWC's Fisher "
              "information), compute what it is made of under `torch.no_grad()`, or store `{{code}}.detach()` (no "
              "gradient through it into {}): retain_graph=True would keep its graph, whose saved weights the next "
              "update changes")
_DETACH_STALE = ("if this loss must not reach it and is meant for its values as they were (a critic's loss on the "
                 "actor's imagined features, a discriminator's loss on fakes made before the generator's update, as "
                 "CycleGAN's), detach it where this loss uses it (`{code}.detach()`)")


def _cached_weight(node) -> str | None:
    """The cache that keeps ``node``'s output across forwards: "autocast" where it copied a leaf (a weight) to another
    dtype, as ``torch.autocast`` does once per region; "parametrize" where it computed a parametrized weight that
    ``torch.nn.utils.parametrize.cached()`` keeps for its region (read afresh: the region's exit replaces the dict);
    else None."""
    if type(node).__name__ == "ToCopyBackward0" and any(type(n) is walk.ACCUMULATE for n, _ in node.next_functions):
        return "autocast"
    if any(t is not None and t.grad_fn is node for t in parametrize._cache.values()):
        return "parametrize"
    return None


def _unchanged(nodes, shared, versions) -> list:
    """The nodes of ``shared`` (parts of a graph an earlier backward ran) where this loss's own ``nodes`` enter that
    graph and below which no leaf was written since that backward (``versions``): in deep mutual learning, the second
    peer's loss enters the first peer's output, whose weights its update changed, and its own output, which the first
    peer's loss reached without ``.detach()``: the second is what to detach there, not what to compute again."""
    ran = set(shared)
    entries = {nxt for n in nodes if n not in ran for nxt, _ in n.next_functions if nxt in ran}
    return [n for n in shared if n in entries and not explain.changed([n], versions)]


def _target_fix(into: str) -> str:
    """The fix for a value made from trained parameters that the loss only compares with (``into``: where its
    gradient would have gone)."""
    return ("if it is a target the loss compares with, not a value to train through (a value target or an advantage "
            "computed with the critic and stored in a replay buffer, a rollout's log-probabilities kept for several "
            f"updates), compute it under `torch.no_grad()`{into}")


def _why_carried(nodes, prev_seq: int | None, iteration: int | None = None, limit: int = 10_000) -> str | None:
    """Why a graph made during an earlier step is a mistake: its saved tensors are freed (``_FREED``), it grows
    every step, or every step back-propagates it again, or a tensor it saved was changed in place since it was made
    before this loop iteration (an optimizer step after a rollout stored with its graph; one made in this iteration
    before an update of it is told as that update, see ``Guard.explain``). None for a one-step lag, which is fine: made
    during the last step (after its update, say: soft actor-critic's ``alpha = log_alpha.exp()``), from nothing
    older, with no buffer freed or changed yet, so this step's backward is its first and only one. ``iteration``:
    see ``preflight``."""
    old = prev_seq is None or any(sequence_nr(n) < prev_seq for n in nodes)
    grows = changed = False
    for node in islice(walk.iter_nodes(*nodes), limit):
        if type(node) is walk.ACCUMULATE:
            continue
        if _freed(node):
            return _FREED
        grows = grows or (prev_seq is not None and sequence_nr(node) < prev_seq and node not in nodes)
        changed = changed or (iteration is None or sequence_nr(node) < iteration) and walk.holds_tensors(node) \
            and walk.is_inplace(walk.unpack_error(node))
    if grows:
        return ("its graph extends the graphs of the steps before it, so it grows every step (memory and backward "
                "time with it)")
    if old:
        return _AGAIN
    return _SAVED_CHANGED if changed else None


def _freed(node) -> bool:
    """Whether a backward already freed the tensors ``node`` saved."""
    return walk.holds_tensors(node) and walk.is_freed(walk.unpack_error(node, first=True))


def _freed_below(node, limit: int = 10_000) -> bool:
    """Whether a backward already freed the tensors some node of the graph below ``node`` saved."""
    return any(_freed(n) for n in islice(walk.iter_nodes(node), limit))


def _warn_where(frame) -> tuple | None:
    """Where ``warn_at`` puts a warning about ``frame``'s line, now: its file, line and module globals."""
    return None if frame is None else (frame.f_code.co_filename, frame.f_lineno, frame.f_globals)


class Recorder(TorchFunctionMode):
    """Records how a training_step lost its graph: no_grad, detach, .item()."""

    def __init__(self):
        super().__init__()
        self.seen: set[str] = set()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        grads = any(isinstance(a, torch.Tensor) and a.requires_grad for a in args)
        out = func(*args, **(kwargs or {}))
        if grads:
            if name in ("detach", "detach_"):
                self.seen.add("detach")
            elif name in ("item", "tolist", "numpy"):
                self.seen.add("item")
            elif not torch.is_grad_enabled():
                self.seen.add("no_grad")
            elif isinstance(out, torch.Tensor) and not out.requires_grad:  # argmax, a comparison, .long()
                self.seen.add(f"op:{name}")
        return out


def _why_detached(seen: set[str] | None, words: Words) -> tuple[str, list[str]]:
    if seen and "no_grad" in seen:
        return ("it was computed under torch.no_grad() (or with grad mode disabled)",
                ["compute the loss outside torch.no_grad(); keep no_grad for evaluation only"])
    if seen and "item" in seen:
        return ("it was rebuilt from Python numbers (.item() / .tolist() / .numpy()), which cuts the graph",
                ["keep the computation in tensors: use the tensor itself, not tensor.item()"])
    if seen and "detach" in seen:
        return ("it was built from detached tensors (.detach()), which cuts the graph",
                ["remove .detach() on the path from the parameters to the loss "
                 "(detach only what must not receive gradient, e.g. fake samples in a GAN's D step)"])
    cut = sorted(n[3:] for n in seen or () if n.startswith("op:"))
    if cut:
        return (f"it was computed through {cut[0]}, whose result has no gradient (an index, a comparison, an "
                "integer), which cuts the graph",
                [f"use a differentiable form on the way to the loss (the logits with cross_entropy rather than "
                 f"argmax, a sigmoid rather than a hard comparison); keep {cut[0]} for metrics"])
    return ("it does not depend on any tensor that requires grad (computed under no_grad, from detached "
            "or .item() values, from gradients torch.autograd.grad returned without create_graph=True, or from "
            "inputs only)",
            [f"make sure the loss is computed from the model's output inside {words.place}, with grad enabled",
             "for a penalty on gradients (a gradient penalty, R1), pass create_graph=True to torch.autograd.grad"])


def _only_changed_below(node, changed, scope) -> bool:
    """Whether every trained parameter below ``node`` is among the ``changed`` ones: the loss reaching it may not be
    meant to train them (a fresh forward first, though: SAC's temperature loss recomputes log_pi at the new weights)."""
    moved = {id(t) for t in changed}
    return all(id(leaf) in moved for leaf in _trained(walk.below(node)[1], scope))
