"""``GraphGuard``: the guard for a hand-written loop, a Lightning or Accelerate script.

The Trainer's step drives ``Guard`` itself; ``GraphGuard`` drives the same ``Guard`` from a
plain loop, with the same checks, errors, fields, pictures and check schedule::

    guard = safeloop.GraphGuard(model)
    for x, y in loader:
        with guard.step():                  # where a step starts and ends
            loss = F.mse_loss(model(x), y)
            guard.backward(loss)            # pre-flight, backward, errors explained
            opt.step()
            opt.zero_grad()

``guard.check(loss)`` runs the pre-flight only, for code whose backward someone else calls.
Outside ``with guard.step()``, a ``backward``/``check`` on a new loss where the step's first
backward was called starts a step; with ``optimizers=...`` given, a step ends at their step
instead. The tensor at fault is searched in the variables of the function that opened the step
(``global y``, ``local h``), then in ``model``. ``python -m safeloop.watch`` runs an unmodified
script through one of these.
"""
from __future__ import annotations

import os
import sys
import time
import weakref
from collections.abc import Callable, Iterable, Mapping
from itertools import islice
from typing import Any

import torch

from ..errors import ConfigError, StepError
from ..settings import GUARD_DEFAULTS, GuardSettings, read
from . import explain, walk
from .before import elements, loop_start, training_loop
from .bytecode import set_by_outer_loop, set_every_time, stack
from .explain import Scope
from .guard import Guard
from .words import LOOP

_perf_counter = time.perf_counter
_SEEN = "safeloop_backward_step"  # node.metadata of a loss's root: the last step that back-propagated it
_DONE = "safeloop_freed_step"  # ... the step whose backward ran without retaining its graph
# where an optimizer wrapper that keeps no step hooks holds the optimizer it steps: accelerate's, opacus's
# DPOptimizer, nfnets-pytorch's AGC (which clips the gradients, then steps its `.optim`)
WRAPPED = ("optimizer", "original_optimizer", "optim")

class GraphGuard:
    """Checks the autograd graph of the losses a plain training loop back-propagates.

    Args:
        model: the trained module (optional): names its parameters and attributes in messages,
            and tells a loss of a frozen model apart.
        optimizers: an optimizer, a list or a dict of them (optional): a step then ends at their
            step when no ``with guard.step()`` marks it, and an update between a loss and its
            backward is named (a list's optimizers by the caller's variables that hold them).
        check / on_reuse / trace / warmup / budget / ignore: as ``guard.*`` for the Trainer
            (``safeloop.settings.GuardSettings``). ``trace=True`` turns anomaly mode on from here until
            ``close()``.
        out_dir: where graph pictures are written on error (default ``safeloop_graphs``; a Trainer handed
            this guard writes them where its own would, under its run directory or nowhere, unless given).

    The ``Guard`` it drives is ``graph_guard.guard``; ``Trainer(guard=graph_guard)`` uses it too.
    Its messages speak of the loop (``words.LOOP``).
    """

    def __init__(self, model: torch.nn.Module | None = None, optimizers: Any = None, *,
                 check: str = GUARD_DEFAULTS.check, on_reuse: str = GUARD_DEFAULTS.on_reuse,
                 trace: bool = GUARD_DEFAULTS.trace, warmup: int = GUARD_DEFAULTS.warmup,
                 budget: float = GUARD_DEFAULTS.budget, ignore: Iterable[str] = (), out_dir=None):
        ignore = ignore if isinstance(ignore, str) else list(ignore)  # a str: refused whole, not letter by letter
        settings, problems = read(GuardSettings, {"check": check, "on_reuse": on_reuse, "trace": trace,
                                                  "warmup": warmup, "budget": budget, "ignore": ignore}, "guard")
        if model is not None and not isinstance(model, torch.nn.Module):
            problems.append(f"model must be a torch.nn.Module, got {type(model).__name__}")
        if out_dir is not None and not isinstance(out_dir, (str, os.PathLike)):
            problems.append(f"out_dir={out_dir!r} is of type {type(out_dir).__name__}: give a directory path (a str "
                            "or Path)")
        if isinstance(optimizers, torch.optim.Optimizer):
            optimizers = {"optimizer": optimizers}
        elif optimizers is not None and not isinstance(optimizers, Mapping):
            if not isinstance(optimizers, Iterable) or isinstance(optimizers, str):
                problems.append(f"optimizers={optimizers!r} is of type {type(optimizers).__name__}: give a "
                                "torch.optim.Optimizer, a list or a dict of them")
                optimizers = ()
            optimizers = _named(list(optimizers), sys._getframe(1))
        optimizers = dict(optimizers or {})
        problems += [f"optimizers[{name!r}] must be a torch.optim.Optimizer, got {type(opt).__name__}"
                     for name, opt in optimizers.items() if not isinstance(opt, torch.optim.Optimizer)]
        if problems:
            raise ConfigError(problems)
        self.out_dir = out_dir  # as given (None: the default)
        self.guard = Guard(**{k: v for k, v in vars(settings).items() if k != "ignore"},
                           ignore=tuple(settings.ignore), out_dir=out_dir or "safeloop_graphs", words=LOOP)
        if settings.trace:  # on now: the line that builds a tensor is recorded only while it is on
            _ANOMALY.on(self)
        self.model = model
        self.optimizers = optimizers
        self.steps = 0  # steps begun
        self.scope = Scope(roots={"model": model} if model is not None else {}, namespaces=self._namespaces,
                           parameters=self._parameters, optimized=self._optimized)
        self._open = self._explicit = False
        self._frame = None  # the frame whose variables name tensors in this step's messages
        # Steps ended by optimizer steps: how many began at each backward call site; the loop's first (a step
        # beginning there begins an iteration: the site of the first step, until another begins more steps, as
        # the loop's does past a backward run once before the loop) and the node counter when it last began one
        self._begun: dict[tuple | None, int] = {}
        self._first_site: tuple | None = None
        self._kept: bool | None = False  # the last backward kept its graph (retain_graph); None: someone else's
        self._iteration_seq: int | None = None
        self._iterations = 0  # loop iterations begun, where steps end at optimizer steps (several per iteration)
        self._made: tuple = ()  # the graphs an outer loop made for the inner one where the last such step began
        self._again = False  # this step began where the iteration's first did, in the same pass of the outer loop
        self._script: str | None = None  # the script whose functions' variables are searched first (under watch)
        self._globals: dict | None = None  # more globals to search (the script's, under watch)
        self._read: set = set()  # the code of the functions whose variables the guard read (see ``variables``)
        self._timed, self._started, self._ended = False, 0.0, 0.0
        self._opened: set[tuple] = set()  # the lines that opened a ``with guard.step()``: (code, offset)
        self._loop: tuple | None = None  # the training loop running the last new one (``before.training_loop``)
        # Checked steps' graphs (step, its loop iteration, weak references), looked at two steps later: a loop's
        # variables hold the last step's loss until the next step replaces it, and a script's variables hold its
        # last losses to the end, which is no leak. A leak is one holder keeping the graphs of several
        # iterations at once (``running_loss += loss``, ``history.append(loss)``; see ``Leaks.piled``).
        self._graphs: list[tuple[int, int | None, list]] = []
        self._recent: dict[str, int] = {}  # optimizer -> node counter at its last step
        self._stepping: weakref.WeakSet = weakref.WeakSet()  # the optimizers seen stepping (under watch)
        self._expected = len(optimizers)  # the optimizers the loop will step (``expect_optimizers``)
        self._awaited: weakref.WeakSet = weakref.WeakSet()  # those found in the script's variables (under watch)
        # Until a step's end is known (an optimizer step), a backward on a new loss where the step's first
        # backward was called starts a step.
        self._by_optimizer = bool(optimizers)
        unhooked = [name for name, opt in optimizers.items()
                    if not _step_post_hook(opt, lambda o, *_, _name=name: self.optimizer_stepped(_name, given=o))]
        if unhooked:
            raise ConfigError([f"optimizers[{name!r}] ({type(optimizers[name]).__name__}) keeps no step hooks (it "
                               "never ran torch.optim.Optimizer.__init__) and wraps none in .optimizer, "
                               ".original_optimizer or .optim that does: pass the optimizer it wraps"
                               for name in unhooked])
        # Before the first step: anything made until then was built before training. The first
        # ``with guard.step()`` moves this to where it opens, or where its loop began (``_start``).
        self.guard.start_fit()

    def close(self) -> None:
        """Anomaly mode back as it was before ``trace=True`` turned it on, unless another open ``GraphGuard``
        traces. The checks go on; errors no longer name the line that made a tensor, and ``check=always`` no longer
        takes the parameters' fingerprints (a write through ``.data`` goes unseen)."""
        if self.guard.trace:
            _ANOMALY.off(self)
            self.guard.trace = False
        self.guard.stop_prints()

    # -- steps -------------------------------------------------------------------------------
    def step(self) -> GraphGuard:
        """``with guard.step():`` around one training step (forward, backward(s), optimizer step)."""
        self._entering = sys._getframe(1)
        return self

    def __enter__(self) -> GraphGuard:
        frame, self._entering = self._entering, None
        if self._open:
            if self._explicit:
                raise StepError("guard.step() is already open: steps do not nest (one `with guard.step():` "
                                "around each training step)", self.steps)
            self._end()
        if self._another_loop(frame) or self.steps == 0:
            self._start(frame)
        self._begin(frame, explicit=True)
        return self

    def __exit__(self, kind, value, tb) -> None:
        if self._open:
            self._end(failed=kind is not None)

    def _another_loop(self, frame) -> bool:
        """Whether ``with guard.step()`` opens, from a line not seen before, in another training loop than the last
        (a second phase: a student trained after its teacher): training starts again there (``_start``)."""
        site = None if frame is None else (frame.f_code, frame.f_lasti)
        if site is None or site in self._opened:
            return False
        self._opened.add(site)
        loop, last = training_loop(frame, frame.f_code.co_filename, self.variables), self._loop
        self._loop = loop or last
        return loop is not None and loop != last

    def _start(self, frame) -> None:
        """Training starts at the first ``with guard.step()``; where a variable of the loop running it, set on every way
        from the loop's top to the ``with``, holds a graph there, or a list, tuple or dict of them (an episode played
        above the ``with``: ``log_probs``; a batch embedded by a trained module), it started where that loop began,
        as under ``watch``: after the newest graph held by a variable the loop does not assign (``before.loop_start``),
        and not before the guard was made. Those graphs are the first step's own, as they are every later step's."""
        start = walk.sequence_now()
        looping, names = set_every_time(frame) if frame is not None else (None, ())
        if looping is not None:
            values = self.variables(looping)
            if any(issubclass(type(t), torch.Tensor) and t.grad_fn is not None
                   for k in names for t in [values.get(k), *elements(values.get(k))]):
                start = max(loop_start(frame, frame.f_code.co_filename, self.variables) or 0, self.guard.fit_seq or 0)
        self.guard.start_fit(at=start)

    def _begin(self, frame, explicit: bool) -> None:
        self.steps += 1
        self._frame, self._explicit, self._open = frame, explicit, True
        self._site = None if explicit else _site(frame)  # where the step's first backward was called
        self._timed = self.guard.begin_step(self.steps)
        guard = self.guard
        waiting = self._expected > len(self._recent)  # an optimizer that has not stepped yet
        if not explicit:
            begun = self._begun[self._site] = self._begun.get(self._site, 0) + 1
            if self._first_site is None or begun > self._begun[self._first_site]:
                self._first_site = self._site
            if self._site == self._first_site:
                # several optimizers, each stepped in a loop inside the training loop (one per peer, deep mutual
                # learning): a step there is the iteration's next while the graphs the outer loop made for the inner
                # one are still those the last step began with
                several = walk.HAS_SEQ and max(self._expected, len(self._recent)) > 1
                made, ran = self._made_outside(frame) if several else ((), False)
                self._again, self._made = ran and made == self._made, made
                if not self._again:
                    self._iteration_seq = guard.start_seq
                    self._iterations += 1
        if not explicit and len(self._recent) + waiting > 1:
            # Several optimizers, a step ending at each one's update: the "last step" a value may come from
            # with its graph (see Guard's one-step lag: SAC's alpha = log_alpha.exp(), made after the last
            # update of an iteration, used by the next iteration's second loss) is the last loop iteration,
            # since the earliest of their last updates; one that has not stepped yet, since the loop began
            # (WGAN-GP's fake, made before the critic's steps, used by the generator's first step).
            guard.last_step_from(min([*self._recent.values(), *([guard.fit_seq] if waiting else [])]))
        if self._timed:
            self._started = self._ended = _perf_counter()

    def _end(self, failed: bool = False, lazily: bool = False) -> None:
        """Close the step; ``lazily``: at the start of the next one, so it ended at its last backward
        (``_ended``, and the guard's ``step_done`` already called there)."""
        guard, step = self.guard, self.steps
        self._open = False
        self._frame = None  # a frame holds every variable of its function: never kept past the step
        if self._timed and not failed:
            if guard.thorough:  # the leak checks look back at the steps that ran the secondary checks
                self._graphs.append((step, None if self._explicit else self._iterations, guard.leaks.step_graphs()))
            guard.record_step_time(step, (self._ended if lazily else _perf_counter()) - self._started)
        if not lazily:
            guard.step_done()

    def steps_end_at_updates(self) -> None:
        """The loop's steps end at optimizer steps, from its first (under watch: the loop around the first backward
        runs inside one update, ``before.inside_one_update``): until then a new loss where the step's first backward
        was called is the same step's."""
        self._by_optimizer = True

    def optimizer_stepping(self, optimizer: torch.optim.Optimizer) -> None:
        """An optimizer's ``step()`` begins: from now on a step ends at optimizer steps (python -m safeloop.watch)."""
        self._by_optimizer = True
        self.guard.at_update(_trained(optimizer))

    def optimizer_stepped(self, name: str, optimizer: torch.optim.Optimizer | None = None, given=None) -> None:
        """Optimizer ``name`` stepped (``optimizer``: one seen stepping under watch; ``given``: one of the loop's,
        or the optimizer it wraps): a step not marked by ``with guard.step()`` ends here."""
        self.guard.at_update(_trained(optimizer or given))  # (under watch, done as it began)
        self._recent[name] = walk.sequence_now()
        if optimizer is not None:
            self._stepping.add(optimizer)
        self._by_optimizer = True
        if self._open and not self._explicit:
            self._end()

    # -- backward ---------------------------------------------------------------------------
    def backward(self, loss: torch.Tensor, gradient=None, retain_graph: bool | None = None,
                 create_graph: bool = False, inputs=None) -> None:
        """``loss.backward(...)`` after the pre-flight checks; an autograd error comes back explained."""
        if not isinstance(loss, torch.Tensor):
            _need_tensors("backward", {"loss": loss})
        if self._open and self._explicit and not self.guard.checking and loss.grad_fn is not None \
                and not self._graphs:
            # most steps: inside ``with guard.step()`` and unchecked, where every check would pass
            try:
                return torch.Tensor.backward(loss, gradient, retain_graph, create_graph, inputs)
            except RuntimeError as err:
                raise self._explained(err, {"loss": loss}, self.steps, sys._getframe(1))
        self.run({"loss": loss}, sys._getframe(1), lambda retain: torch.Tensor.backward(
            loss, gradient, retain, create_graph, inputs), retain_graph, create_graph, inputs)

    def check(self, loss: torch.Tensor | Mapping[str, torch.Tensor]) -> None:
        """The pre-flight checks only, for a backward someone else runs (a Lightning ``on_before_backward``
        hook, before ``accelerator.backward(loss)``). ``loss``: a tensor, or a dict of named losses."""
        losses = dict(loss) if isinstance(loss, Mapping) else {"loss": loss}
        _need_tensors("check", losses)
        losses = self._checked(losses)
        if not losses:
            return
        self._preflight(losses, sys._getframe(1))
        guard = self.guard
        if guard.thorough and guard.start_seq is not None and walk.HAS_SEQ:
            # PyTorch's error for a saved tensor changed in place would come from someone else's backward, unexplained
            for name, loss in losses.items():
                found = guard.inplace_check(loss, {}, guard.start_seq)
                explained = found and guard.explain(found[0], name, loss, self.steps, self.scope)
                if explained:
                    raise explained from found[0]
        guard.backward_done(None)  # the backward that follows may free the graph: a later check looks
        self._mark(losses, retained=None)

    def _checked(self, losses: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The losses to pre-flight: no leaf that requires grad (a backward on a parameter itself, or on several leaves:
        nothing to check), but a lone scalar one that is no parameter (a loss remade from ``.item()`` with
        ``requires_grad=True``, which reaches no parameter: the pre-flight says so)."""
        if len(losses) == 1:
            (loss,) = losses.values()
            return {} if loss.grad_fn is None and loss.requires_grad and (loss.dim() > 0 or self._trained(loss)) \
                else losses
        return {n: t for n, t in losses.items() if t.grad_fn is not None or not t.requires_grad}

    def ignore(self, *checks: str):
        """``with guard.ignore("carried"): ...``: those checks off for the code and graphs inside."""
        return self.guard.ignore(*checks)

    def run(self, losses: dict[str, torch.Tensor], frame, call: Callable[[bool | None], Any],
            retain_graph: bool | None, create_graph: bool = False, inputs=None, updates: bool = True,
            caller=None) -> Any:
        """Pre-flight ``losses``, then ``call(retain_graph)`` (the backward; ``updates``: False for
        ``torch.autograd.grad``, which writes no ``.grad``); its autograd error explained. ``frame``: the loop's
        line; ``caller``: the frame that called backward, where that is a library's below it (under watch)."""
        guard = self.guard
        losses = self._checked(losses)
        if not losses:
            return call(retain_graph)
        retain = self._preflight(losses, frame, updates, caller, retains=create_graph and retain_graph is not False,
                                 keeps=bool(retain_graph))
        step = self.steps
        if retain_graph is None and retain is not None and any(retain) and len(losses) == 1:
            retain_graph = True  # on_reuse=warn/retain keeps a graph built before training
        if len(losses) == 1 and guard.checking and walk.HAS_SEQ and self._recent and guard.start_seq is not None:
            stepped = {n: s for n, s in self._recent.items() if s > guard.start_seq}  # updated inside this step
            if stepped:
                (name, loss), = losses.items()
                found = guard.inplace_check(loss, stepped, guard.start_seq, _tensors(inputs))
                if found is not None:
                    raise guard.explain(found[0], name, loss, step, self.scope, None, found[1]) from found[0]
        try:
            out = call(retain_graph)
        except RuntimeError as err:
            raise self._explained(err, losses, step, frame)
        retained = retain_graph if retain_graph is not None else create_graph
        if guard.checking:
            guard.backward_done(bool(retained), _tensors(inputs), captured=not updates)
        self._mark(losses, retained)
        return out

    def _preflight(self, losses: dict[str, torch.Tensor], frame, updates: bool = True,
                   caller=None, retains: bool = False, keeps: bool = False) -> list[bool] | None:
        if not self._open:
            self._begin(frame, explicit=False)
        elif not self._explicit and not self._by_optimizer and _site(frame) == self._site and not any(
                loss.grad_fn is not None and loss.grad_fn.metadata.get(_SEEN) == self.steps
                for loss in losses.values()) and updates and not self._same_iteration(losses):
            # a new loss where the step's first backward was called, and no optimizer: the loop came round
            # (backwards called elsewhere, several autograd.grad building one loss say, are the same step's); the
            # last step ended at its last backward. An autograd.grad, which writes no .grad, is no sign of it: MAML
            # adapts each task of a meta-batch from one line, then back-propagates their query losses together
            self._end(lazily=True)
            self._begin(frame, explicit=False)
        elif not self._explicit:
            self._frame = frame
        guard, step = self.guard, self.steps
        if self._graphs and self._graphs[0][0] <= step - 2 and sys.version_info < (3, 13):
            # Before 3.13 reading a function's variables (a search for a name did) leaves a copy of them
            # on its frame, whose references outlive the variables: read afresh, the copies on the frames
            # still running (the loop's, when backward is called in a function it calls) hold no old graph
            running = frame
            while running is not None:
                if running is frame or running.f_code in self._read:
                    running.f_locals  # noqa: B018
                running = running.f_back
        while self._graphs and self._graphs[0][0] <= step - 2:
            done, iteration, refs = self._graphs.pop(0)
            # shown at the script's line under watch (a library's backward called the guard)
            shown = next((f for f in stack(frame) if f.f_code.co_filename == self._script), frame)
            leaks = guard.leaks
            for first, holder in leaks.piled(done, refs, self.scope, iteration, start=guard.start_seq):
                leaks.warn(first, done, holder, shown)
            leaks.growing_lists(done, self._namespaces(), shown)
            leaks.written_parameters(done, self.scope, shown, guard.start_seq if walk.HAS_SEQ else None)
        guard.frame, guard.caller = frame, caller
        try:
            if guard.checking:  # marks are made on checked steps (see _mark)
                for name, loss in losses.items():
                    done = loss.grad_fn.metadata.get(_DONE) if loss.grad_fn is not None else None
                    if done is not None:
                        guard.check_again(name, loss, step, self.scope, done)
            return guard.preflight(losses, step, self.scope, iteration=self._iteration_start(), updates=updates,
                                   retains=retains, keeps=keeps)
        finally:
            guard.frame = guard.caller = None  # a frame holds every variable of its function: never kept

    def _same_iteration(self, losses: Mapping[str, torch.Tensor]) -> bool:
        """Whether new ``losses`` at the step's first call site reach a node the step made before its last backward
        ended, which kept its graph: the same iteration's next backward through that graph (PCGrad's per-task losses
        over one trunk, each ``backward(retain_graph=True)`` from one line; a second-order adaptation's next inner
        loss), not the loop come round, whose new graph is made after."""
        start, end = self.guard.start_seq, self.guard.next_start
        if not (walk.HAS_SEQ and start is not None and end is not None) or self._kept is False and not self._expected:
            return False

        def older(node) -> bool:  # a leaf, or made before the step: not the step's own
            return type(node) is walk.ACCUMULATE or walk.sequence_nr(node) < start

        reached = [node for loss in losses.values() if loss.grad_fn is not None
                   for node in islice(walk.iter_nodes(loss.grad_fn, stop=older), 100_000)
                   if walk.sequence_nr(node) < end]
        if self._kept is None:  # the backward after ``check`` was someone else's: did it keep the graph?
            saver = next((node for node in reached if walk.holds_tensors(node)), None)
            return saver is not None and not walk.is_freed(walk.unpack_error(saver, first=True))
        if self._kept is False:
            # An optimizer the loop will step has not stepped yet, and the last backward freed nothing this loss
            # reaches: the same iteration's loss, in chunks back-propagated one by one over a graph that saves
            # nothing (sentence-transformers' CachedMultipleNegativesRankingLoss: each chunk's scores against one
            # torch.cat of all the embeddings). A state carried with a graph that saves nothing is seen once the
            # optimizer steps; one whose saved tensors that backward freed is the carried graph it was.
            saver = next((node for node in reached if walk.holds_tensors(node)), None)
            return bool(reached) and (saver is None or not walk.is_freed(walk.unpack_error(saver, first=True)))
        return bool(reached)

    def _mark(self, losses: Mapping[str, torch.Tensor], retained: bool | None) -> None:
        """Remember the losses of this step: another backward on one stays in the step; one that freed
        its graph is looked at again before a later backward (``retained`` None: not known, someone else's)."""
        bounded = self._explicit or self._by_optimizer  # the step's end is known: the marks only serve checks
        self._kept = retained
        if bounded and not self.guard.checking:  # an unchecked step's second backward is explained if it fails
            return
        step = self.steps
        for loss in losses.values():
            root = loss.grad_fn
            if root is not None:
                meta = root.metadata
                meta[_SEEN] = step
                if retained is False:
                    meta[_DONE] = step
        if not bounded:  # the step may end here: the next starts here
            self.guard.step_done()
            if self._timed:
                self._ended = _perf_counter()

    def _explained(self, err: RuntimeError, losses: Mapping[str, torch.Tensor], step: int, frame=None) -> Exception:
        """What to raise for backward's ``err``: the guard's explanation (caused by ``err``), or ``err``; ``frame``:
        the plain loop's that called the backward, whose variables the explanation reads as the pre-flight does."""
        name, loss = next((n, t) for n, t in losses.items() if t.grad_fn is not None or not t.requires_grad)
        stepped = []
        if self._recent and loss.grad_fn is not None and walk.HAS_SEQ:  # updates after the loss's graph began
            nodes = walk.walk(loss.grad_fn, 0, step).nodes
            oldest = min(walk.sequence_nr(n) for n in nodes)
            stepped = [n for n, seq in self._recent.items() if seq > oldest]
        # A step that an update ended inside a loop iteration (StyleGAN2's lazy R1: D steps, then the penalty
        # goes through the D(real) built before that step): the iteration's earlier graphs are not "kept across
        # steps", the update came between the loss and its backward
        self.guard.frame = frame
        try:
            explained = self.guard.explain(err, name, loss, step, self.scope, None, stepped, self._iteration_start())
        finally:
            self.guard.frame = None  # a frame holds every variable of its function: never kept
        if explained is None:
            return err
        explained.__cause__ = err
        return explained

    def _iteration_start(self) -> int | None:
        """The node counter where this step's loop iteration began, when the step is not its first (steps
        ended by optimizer steps); else None."""
        return self._iteration_seq if not self._explicit and (self._site != self._first_site or self._again) else None

    def _made_outside(self, frame) -> tuple[tuple, bool]:
        """The graphs (their nodes' numbers) that the variables an outer loop sets for an inner one running ``frame``
        hold, or the lists, tuples and dicts they hold (``bytecode.set_by_outer_loop``; () where no loop nests), and
        whether an earlier backward ran one of them (a graph made for display, that no loss uses, does not make the
        steps one iteration)."""
        looping, names = set_by_outer_loop(frame) if frame is not None else (None, ())
        values = self.variables(looping) if looping is not None else {}
        made = [t.grad_fn for name in sorted(names) for v in [values.get(name)] for t in [v, *elements(v)]
                if issubclass(type(t), torch.Tensor) and t.grad_fn is not None]
        # (not walk.below, which caches in the node's metadata what it finds: a graph of this step would never die)
        savers = [next((n for n in islice(walk.iter_nodes(node), 1_000) if type(n) is not walk.ACCUMULATE
                        and walk.holds_tensors(n)), None) for node in made]
        ran = any(walk.is_freed(walk.unpack_error(saver, first=True)) for saver in savers if saver is not None)
        return tuple(map(walk.sequence_nr, made)), ran

    def expect_optimizers(self, optimizers: Iterable[torch.optim.Optimizer]) -> None:
        """The loop steps ``optimizers`` (found in a script's variables, under watch), some perhaps not yet
        stepped."""
        optimizers = list(optimizers)
        self._expected = max(self._expected, len(optimizers))
        self._awaited.update(optimizers)

    # -- what messages may search --------------------------------------------------------------
    def search_script(self, script: str, namespace: Mapping[str, Any]) -> None:
        """Search the variables of ``script``'s functions running when a search runs, first, and ``namespace`` (its
        globals): under ``python -m safeloop.watch``, where a library's code may call backward (ignite's
        ``create_supervised_trainer``, ``accelerator.backward``), the names a fix can use are the script's."""
        self._script, self._globals = script, namespace

    def variables(self, frame) -> Mapping[str, Any]:
        """The variables of the function running ``frame``, read for a search. Before 3.13 reading them
        leaves a copy on the frame, which the guard reads afresh before it looks for kept graphs."""
        self._read.add(frame.f_code)
        return frame.f_locals

    def _namespaces(self) -> list[tuple[str, Mapping[str, Any]]]:
        """The variables searched: those of the function that called backward and of every function of its file
        running (the loop around a `train_step(x, y)` closure; a `main()` around a library's loop that calls a loss
        function of the same file), the script's before them under watch; then their globals. Inside ``with
        guard.step()``, the function that called the guard below the one that opened the step comes first (a
        ``train_step(model, optimizer, ...)`` the loop calls, whose ``regularization`` the loss adds), unless it is a
        method (an mmengine model's own ``train_step``, whose ``losses`` are the model's business: its ``self``
        named, not the loop's ``model``)."""
        frame, out, spaces = self._frame, [], []
        called = self.guard.frame
        if called is not None and frame is not None and called is not frame and not _method(called) and any(
                f is frame for f in stack(called)):
            frame = called
        if frame is not None:
            files = (self._script, frame.f_code.co_filename)
            frames = [f for f in stack(frame) if f.f_code.co_filename in files]
            frames.sort(key=lambda f: f.f_code.co_filename != self._script)  # (stable: the nearest first)
            spaces = [running.f_globals for running in frames]
            # then those a library's code runs below them (mmengine's OptimWrapper that called backward, holding
            # the optimizer), neither torch's nor safeloop's
            for running in stack(sys._getframe(1)):
                if running.f_code.co_filename in files:
                    break
                if not explain.library_file(running.f_code.co_filename):
                    frames.append(running)
            for running in frames:
                variables = self.variables(running)
                # a module's code (not its copy of them while 3.12 runs a comprehension inlined: PEP 709) has no
                # locals
                if variables is not running.f_globals and running.f_code.co_name != "<module>":
                    out.append(("local", variables))
        for space in ([self._globals] if self._globals is not None else []) + spaces:
            if all(space is not seen for _, seen in out):
                out.append(("global", space))
        return out

    def _trained(self, leaf: torch.Tensor) -> bool:
        """Whether ``leaf`` is a parameter the model or an optimizer holds (a scalar leaf that is not is a loss
        made with requires_grad=True: backward reaches no parameter from it)."""
        return isinstance(leaf, torch.nn.Parameter) or any(p is leaf for p in self._parameters())

    def _optimized(self) -> list[torch.Tensor] | None:
        """The parameters of the loop's optimizers: those given, else (python -m safeloop.watch) those seen
        stepping once they are all the loop's optimizers update (``_all_known``); None before: not known."""
        held = list(self.optimizers.values())
        if not held and self._stepping:
            held = list(self._stepping)
            stepped = [p for opt in held for g in opt.param_groups for p in g["params"]]
            return stepped if self._all_known(stepped) else None
        return [p for opt in held for g in opt.param_groups for p in g["params"]] if held else None

    def _all_known(self, stepped: list[torch.Tensor]) -> bool:
        """Whether the optimizers seen stepping hold every parameter the loop's optimizers update (under watch).

        Until then a correct loss may look unused: one for an optimizer that has not stepped yet (a GAN's
        generator stepped every n-th iteration, a second phase's), whose parameters only its first step makes
        known. So the check waits until as many optimizers have stepped as the script's variables hold, or until
        each one found there that has not stepped holds only parameters those that stepped hold too: its step
        would add none (higher's ``inner_opt``, built on the model's parameters only for ``innerloop_ctx`` to
        read its settings, never steps; waiting for it would silence the check for the whole run). One no
        longer alive never steps either."""
        if len(self._recent) >= self._expected:
            return True
        held = set(map(id, stepped))
        return all(id(p) in held for opt in list(self._awaited) for g in opt.param_groups for p in g["params"])

    def _parameters(self) -> list[torch.Tensor]:
        """The trained parameters: the model's and the optimizers' (an optimizer may train more than the model: a
        value head beside the policy given as ``model``), else those of the modules and optimizers in the step's
        variables and of the optimizers seen stepping (under watch: a library's object, no module itself, may hold
        the model and its optimizer; only read when explaining)."""
        holders = [*([self.model] if self.model is not None else []), *self.optimizers.values()]
        if not holders:
            holders = [v for _, space in self._namespaces() for v in list(space.values())
                       if isinstance(v, (torch.nn.Module, torch.optim.Optimizer))] + list(self._stepping)
        params = {}
        for h in holders:
            ps = h.parameters() if isinstance(h, torch.nn.Module) else \
                (p for g in h.param_groups for p in g["params"])
            params.update((id(p), p) for p in ps if p.is_leaf)  # (not a frozen copy's, written outside no_grad)
        return list(params.values())


class _Anomaly:
    """Anomaly mode is the whole process's: on from the first ``GraphGuard(trace=True)``; at the close of a
    guard when no other is open (neither closed nor garbage), back as it was before that first one."""

    def __init__(self):
        self.open: weakref.WeakSet = weakref.WeakSet()
        self.before: tuple[bool, bool] | None = None  # None: as it was, no tracing guard since

    def on(self, guard: GraphGuard) -> None:
        if self.before is None:
            self.before = torch.is_anomaly_enabled(), torch.is_anomaly_check_nan_enabled()
        self.open.add(guard)
        torch.autograd.set_detect_anomaly(True, check_nan=False)

    def off(self, guard: GraphGuard) -> None:
        self.open.discard(guard)
        if not self.open and self.before is not None:
            torch.autograd.set_detect_anomaly(*self.before)
            self.before = None


_ANOMALY = _Anomaly()


def _site(frame) -> tuple | None:
    """Where ``frame`` is: its code and instruction, and those of its callers in its file (a backward's call site; no
    frame is kept). A helper of the script that every loss goes through (dreamerv3-torch's ``Optimizer.__call__``,
    called for the world model, the actor and the critic) is at as many sites as the lines calling it."""
    if frame is None:
        return None
    return tuple((f.f_code, f.f_lasti) for f in stack(frame) if f.f_code.co_filename == frame.f_code.co_filename)


def _tensors(inputs) -> list | None:
    """``inputs`` of backward as a list of tensors (None: all leaves)."""
    if inputs is None:
        return None
    if isinstance(inputs, torch.Tensor):
        return [inputs]
    return list(inputs.values()) if isinstance(inputs, Mapping) else list(inputs)


def _need_tensors(method: str, losses: Mapping[str, Any]) -> None:
    """``guard.backward(loss)`` takes a tensor, ``guard.check`` a tensor or a dict of them."""
    for name, loss in losses.items():
        if not isinstance(loss, torch.Tensor):
            what = "loss" if method == "backward" else "loss (a tensor, or a dict of named loss tensors)"
            raise StepError(f"guard.{method}() takes the {what}, got {'' if name == 'loss' else f'{name!r}: '}"
                            f"{type(loss).__name__}: pass the tensor your loss computation returned")


def _trained(optimizer: torch.optim.Optimizer | None) -> list[torch.Tensor] | None:
    """The parameters ``optimizer`` updates (None for none)."""
    return None if optimizer is None else [p for g in optimizer.param_groups for p in g["params"]]


def _step_post_hook(opt: torch.optim.Optimizer, fn: Callable) -> bool:
    """Registers ``fn`` to run after each of ``opt``'s steps: on ``opt``, or for a wrapper that never ran
    ``Optimizer.__init__`` and keeps no hooks (accelerate's ``AcceleratedOptimizer``, whose steps while accumulating
    do nothing; opacus's ``DPOptimizer``, whose steps skipped by ``BatchMemoryManager`` do not step the optimizer in
    its ``.original_optimizer``) on the optimizer it wraps, whose steps are the updates; False if none keeps hooks."""
    for candidate in (opt, *(getattr(opt, name, None) for name in WRAPPED)):
        try:
            candidate.register_step_post_hook(fn)
            return True
        except AttributeError:
            continue
    return False


def _named(optimizers: list, caller) -> dict[str, Any]:
    """A list of optimizers by the names the caller's variables give them (`[opt_g, opt_d]`: 'opt_g' and 'opt_d',
    as watch names them), else by position ('optimizer 0') where no single variable holds one."""
    def name(i: int, opt: Any) -> str:
        held = [key for key, val in caller.f_locals.items() if val is opt and not key.startswith("_")]
        return held[0] if len(held) == 1 else f"optimizer {i}"
    names = [name(i, opt) for i, opt in enumerate(optimizers)]
    if len(set(names)) < len(names):
        names = [f"optimizer {i}" for i in range(len(optimizers))]
    return dict(zip(names, optimizers))


def _method(frame) -> bool:
    """Whether ``frame`` runs a method (its first argument is ``self``)."""
    code = frame.f_code
    return code.co_argcount > 0 and code.co_varnames[0] == "self"
