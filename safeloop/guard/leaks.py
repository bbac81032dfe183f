"""Graphs kept alive after their step (``GraphLeakWarning``), looked at after the steps that run the guard's secondary
checks (every warm-up step, then every 4th check: a leak repeats every step):

- a holder that keeps the graphs of two steps at once (``running_loss += loss``, ``history.append(loss)``): a
  ``Sentinel`` is put on every node a loss's walk met; one still alive once the next step is over names its holder
  (``piled``); one that keeps only the last of them (``self.last_loss = loss``, replaced every step) is no leak;
- a list a plain loop's variable holds that keeps one more graph every step, outside any loss (evaluation outputs
  appended without ``torch.no_grad()``: ``growing_lists``);
- parameters, and copies of them kept as tensors, written in place outside ``torch.no_grad()`` (an EMA update), whose
  graph every write extends (``written_parameters``).

Each is said once per holder. The holder's kind (``Slots``, ``Buffer``, ``Statistic``, ``GradOf``, a list's
``explain.Element``) chooses the fix.
"""
from __future__ import annotations

import re
import weakref
from itertools import islice
from typing import Any, Callable, Iterable, Mapping

import torch

from ..errors import GraphLeakWarning
from . import explain, walk
from .explain import Scope, code_of
from .walk import sequence_nr

SENTINEL = "safeloop_sentinel"
_LOOKED = "safeloop_looked"  # node.metadata: (id, {name: first look}) of the tensor whose graph it was at looks


class Sentinel:
    """Put in the metadata of a step's nodes: it dies with the last of them, so a live one means some of
    that step's graph outlived it. ``fed_by``: the ids of the sentinels of earlier steps whose nodes this step's
    losses reached (a tensor made in one step and back-propagated through in the next: WGAN's ``fake``)."""

    __slots__ = ("__weakref__", "fed_by")

    def __init__(self, fed_by: frozenset[int] = frozenset()):
        self.fed_by = fed_by


class Leaks:
    """The leak checks' state from step to step (see the module docstring). ``warn``: how a warning is shown (the
    guard's: at the user's frame); ``is_off``: whether a check is turned off (the guard's, for a node or the run)."""

    def __init__(self, warn: Callable[..., None], is_off: Callable[..., bool]) -> None:
        self._warn, self._is_off = warn, is_off
        self._sentinels: list[weakref.ref] = []  # this checked step's, one per loss walked (see ``mark``)
        # a thorough check's graphs, looked at when the next step is over: (step, weak references, scope,
        # whether that step is over) (see ``step_over``)
        self._held: tuple | None = None
        # per holder (``key``): the earliest step whose graph it was found keeping, and that graph
        self._keeping: dict[str, tuple[int, str, weakref.ref, int | None]] = {}
        # per list a plain loop's variable holds: its first item when looked at, with its graph, and its length then
        self._lists: dict[str, tuple[weakref.ref, int]] = {}
        self._warned: set[str] = set()
        self._looks = 0  # the looks of ``_written_copies`` so far

    @property
    def marked(self) -> int:
        """How many of this step's losses were marked so far."""
        return len(self._sentinels)

    def mark(self, root, nodes, before=()) -> None:
        """One sentinel on ``root`` and ``nodes`` (a loss's walk: the guard leaves out the nodes whose carried check is
        off): a holder may keep any of them, not only the loss back-propagated (the loss itself while the step
        back-propagates ``loss / n``, as gradient accumulation does; an output; a running sum). ``before``: the nodes
        of earlier steps the loss reached, whose sentinels it was fed by."""
        sentinel = Sentinel(frozenset(id(s) for n in before if (s := n.metadata.get(SENTINEL)) is not None))
        root.metadata[SENTINEL] = sentinel
        for node in nodes:
            node.metadata[SENTINEL] = sentinel
        self._sentinels.append(weakref.ref(sentinel))

    def step_graphs(self) -> list[weakref.ref]:
        """The checked step's graphs (weak references to their sentinels), handed over to a later ``piled``."""
        refs, self._sentinels = self._sentinels, []
        return refs

    def step_over(self, step: int, scope: Scope | None, start: int | None, thorough: bool) -> None:
        """A timed step of the Trainer is over (``thorough``: it ran the secondary checks). A graph of this step still
        alive once the next step is over is looked at (see ``piled``): a holder that keeps graphs of two steps at once
        (``running_loss += loss``, ``history.append(loss)``) is a leak; one that keeps the last of them
        (``self.last_loss = loss``, replaced every step or every few) is not."""
        if thorough:  # a graph that grows every step is a mistake that repeats
            self.written_parameters(step, scope)
        self.look_back(start)
        refs = self.step_graphs()
        if refs:
            self._held = (step, refs, scope, False)

    def look_back(self, start: int | None) -> None:
        """Warn about the held graphs of the step before this one once this one is over (see ``step_over``); ``start``:
        the node counter where the step now over began."""
        if self._held is None:
            return
        step, refs, scope, over = self._held
        if not over:  # the held step itself is just over
            self._held = (step, refs, scope, True)
            return
        self._held = None
        for first, holder in self.piled(step, refs, scope, start=start):
            self.warn(first, step, holder)

    def piled(self, step: int, refs: list[weakref.ref], scope: Scope | None = None,
              iteration: int | None = None, start: int | None = None) -> list[tuple[int, str | None]]:
        """The holders that keep a graph of ``step`` (``refs``: ``step_graphs``) while the graph of an earlier
        step they were found keeping is alive too: graphs piling up. Returns (that earlier step, how the
        holder was named then, None when unnamed). A holder whose earlier graph is gone replaced it: this
        step's is its new one; so did one whose earlier graph this step's loss went through (a tensor made in
        one step, back-propagated in the next, and held until the next one replaces it: no pile). ``iteration``:
        the loop iteration of ``step``, where one has several (a step per optimizer): a holder of two steps of
        one iteration (mmengine's `log_vars` of a GAN's D and G losses) keeps no more than that iteration's.
        ``start``: the node counter where the running step began (see ``_holder``)."""
        if not refs or self._is_off("leak"):
            return []
        out = []
        for ref in refs:
            sentinel = ref()
            if sentinel is None:
                continue
            holder = _holder(sentinel, scope, start=start)
            key = self.key(holder)
            earlier = self._keeping.get(key)
            alive = earlier[2]() if earlier is not None else None
            # two graphs of one step (a backward each, the losses of a dict) held together are no pile
            if alive is not None and earlier[0] != step and id(alive) not in sentinel.fed_by \
                    and (iteration is None or earlier[3] != iteration):
                # unnamed: looked for deeper, now that it piles up (a callback's list in a library's list of them),
                # once: found later under another name (a metric logger returned by its epoch's function), it is
                # the same pile
                if earlier[1] is None and "unnamed pile" in self._warned:
                    continue
                if earlier[1] is None:
                    self._warned.add("unnamed pile")  # (not a holder's ``key``: ``warn`` says it)
                out.append((earlier[0], earlier[1] or _holder(sentinel, scope, deep=True, start=start)))
            elif alive is None or earlier[3] != iteration:  # (of one iteration: the earlier step's is kept)
                self._keeping[key] = (step, holder, ref, iteration)
        return out

    def growing_lists(self, step: int, namespaces: Iterable[tuple[str, Mapping[str, Any]]], frame=None) -> None:
        """Warn about a list a loop's variable holds, or an object of its own class that it holds keeps
        (``explain.held_lists``), that keeps one more graph every step, outside any loss: its first and last items
        tensors with graphs, the first the same as when last looked at, with its graph, and the list longer since
        (evaluation outputs appended without ``torch.no_grad()``: ``val_outputs.append(model(x))``). Looked at after
        thorough steps, through the first and last items alone. A list of loss graphs is ``piled``'s."""
        if self._is_off("leak"):
            return
        named = set()  # a list two variables reach (`self.outputs`, `trainer.outputs`) is named once, by the nearest
        for holder, val in explain.held_lists(namespaces):
            if id(val) in named:
                continue
            named.add(id(val))
            if len(val) < 2 or not all(issubclass(type(t), torch.Tensor) and t.grad_fn is not None
                                       for t in (val[0], val[-1])):
                continue
            first, length = self._lists.get(holder.list_of, (None, 0))
            if first is not None and first() is val[0] and len(val) > length:
                # made from a loss's graph (a GAN's fakes kept in an image pool), or the losses themselves: no
                # torch.no_grad() for them. The first item too: the last may be a loss its backward has yet to walk
                # (`train_losses.append(loss)` before `loss.backward()`)
                used = any(node.metadata.get(SENTINEL) is not None for item in (val[-1], val[0])
                           for node in islice(walk.iter_nodes(item.grad_fn), 1_000))
                self._warn_growing(step, holder, len(val), frame, used)
            self._lists[holder.list_of] = (weakref.ref(val[0]), len(val))

    def _warn_growing(self, step: int, holder: explain.Element, length: int, frame, used: bool) -> None:
        """``used``: the tensors are made from a graph a loss goes through (a GAN's fakes kept in an image pool, the
        losses themselves), not one that no loss uses (an evaluation's outputs): they are detached, never computed
        under torch.no_grad()."""
        key = self.key(holder)
        if key in self._warned:
            return
        self._warned.add(key)
        listed, owner = code_of(holder.list_of), code_of(holder.filled_by)
        added = f"the tensors the loop hands to `{owner}`" if owner else f"what is added to `{listed}`"
        if owner:
            detach = f"detach them where it calls `{owner}`"
        else:
            detach = detach_what_is_added(holder) if used else \
                f"detach it where it is added (`{listed}.append(x.detach())`)"
        fix = detach if used else \
            f"compute {added} under torch.no_grad() (`with torch.no_grad(): out = model(x)`), or {detach}"
        whose = ("made from the graph of a loss of their step, or that loss itself (a GAN's fakes kept in an image "
                 "pool, the losses kept for an epoch's mean)" if used else
                 "graphs that no loss uses (an evaluation's outputs, made without torch.no_grad())")
        self._warn(GraphLeakWarning(
            f"the tensors added to `{listed}` keep their autograd graphs ({length} now, more every step; the first "
            f"held by `{holder}`), {whose}: they pile up step after step (their nodes, and the tensors they saved)",
            step=step, holder=holder, fixes=[fix]), frame)

    def written_parameters(self, step: int, scope: Scope | None, frame=None, start: int | None = None) -> None:
        """Warn once about the parameters holding a graph (``explain.written_parameters``) after a thorough step, where
        no loss reaches them (a generator's EMA copy, sampled from under torch.no_grad()): each write adds to it; and
        once about the tensors written so (``_written_copies``: diffusers' EMA shadow parameters, kept in a list).
        With ``start``, the node counter where the running step began, only a graph that reaches a node made before
        it: not one this step's forward wrote and that the loop cuts after its update (twitter-research/tgn's memory,
        a Parameter written by the GRU in forward, then ``detach_memory()``)."""
        if self._is_off("leak"):
            return
        written_in_place, remade = self._written_copies(scope)
        params = [name for name, p in explain.written_parameters(scope) if start is None or any(
            type(n) is not walk.ACCUMULATE and sequence_nr(n) < start
            for n in islice(walk.iter_nodes(p.grad_fn), 1_000))]
        for kind, names, example, fix in (
                ("parameters", params, WRITTEN_EXAMPLE, WRITTEN_FIX),
                ("tensors", written_in_place, "an EMA's shadow copies of the parameters kept as tensors, "
                                              "`s.sub_((1 - d) * (s - p))`", WRITTEN_FIX),
                ("tensors", remade, None, _REMADE_FIX)):
            written = [name for name in names if self.key(name) not in self._warned]
            if not written:
                continue
            self._warned.update(self.key(name) for name in written)
            named = ", ".join(f"`{name}`" for name in written[:3])
            named += f" and {len(written) - 3} more" * (len(written) > 3)
            how = (f"written in place outside torch.no_grad() from tensors that require grad ({example}), they now "
                   "require grad, and each write adds to their graph") if example else \
                ("made again from their last value outside torch.no_grad(), with tensors that require grad (a running "
                 "statistic no loss reads, DINO's `center = center * m + batch_center * (1 - m)`), each value holds "
                 "the graph of the last one")
            self._warn(GraphLeakWarning(f"the {kind} {named} hold an autograd graph: {how}, which grows step after "
                                        "step", step=step, holder=written[0], fixes=[fix]), frame)

    def _written_copies(self, scope: Scope | None) -> tuple[list[str], list[str]]:
        """The names of the tensors the scope holds, not parameters, with a graph that reaches a parameter, that no
        loss's walk met, and that grew over the graph held at an earlier look: by the same tensor, for those written in
        place (their version moved), copies of the parameters updated outside torch.no_grad() (an EMA's shadow
        parameters, kept as tensors in a list), whose graph every update extends; by the same name, for those made
        again from their last value (a running statistic no loss reads, DINO's center of a teacher left requiring grad,
        a BatchNorm's running mean written by hand), whose graph every value extends. (A tensor made anew may have the
        id of one gone, and a graph made from it: Grad-CAM's map made from the activations a library's variable held
        at a look inside its `autograd.grad`.) A state the loss reads is met by
        its walk (a state carried on purpose, its `carried` check off, is left alone); a sum made again (`val_loss = 0`,
        then `+=`) is made from another tensor; one written once and kept (`best = val_loss`) does not grow. Only an
        earlier look counts: in one look, two variables of one name may hold a loss and the loss scaled from it (the
        loop's `loss`, and a library's `loss = loss / n` in the backward it calls)."""
        self._looks += 1
        found, remade, graphs = {}, {}, {}
        for name, tensor in explain.candidates(scope):
            fn = tensor.grad_fn
            if fn is None or isinstance(tensor, torch.nn.Parameter) or fn.metadata.get(SENTINEL) is not None:
                continue
            if not tensor._version and self._is_off("carried", fn):  # a state carried on purpose: no sentinel on it
                continue
            nodes = list(islice(walk.iter_nodes(fn), 1_000))
            if any(n.metadata.get(SENTINEL) is not None for n in nodes):
                continue
            looked = [m for n in nodes if n is not fn and (m := n.metadata.get(_LOOKED))]
            if any(m[0] == id(tensor) and min(m[1].values()) < self._looks if tensor._version else
                   m[1].get(name, self._looks) < self._looks for m in looked) and \
                    any(type(n) is walk.ACCUMULATE and isinstance(n.variable, torch.nn.Parameter) for n in nodes):
                (found if tensor._version else remade).setdefault(id(tensor), name)
                graphs[id(tensor)] = fn, nodes
            # every name a tensor was held by, with the first look that saw it so: a state carried as `hidden` is
            # also `nh` of `nh, nc = next_hidden`, then `h` of `h, c = hidden` one step later
            mark = fn.metadata.get(_LOOKED)
            names = mark[1] if mark is not None and mark[0] == id(tensor) else {}
            fn.metadata[_LOOKED] = (id(tensor), {name: self._looks, **names})
        # not an older value of another one made again, kept by a second variable (`h` of `h, c = hidden`, the
        # state of one step ago): the one made again is named
        remade = {key: name for key, name in remade.items()
                  if not any(graphs[key][0] in nodes for other, (_, nodes) in graphs.items() if other != key)}
        return list(found.values()), list(remade.values())

    @staticmethod
    def key(holder: str | None) -> str:
        # self.history[3] is self.history[0] again, and history[3]['loss'] history[0]['loss'] (not model.layers[0].out
        # and model.layers[1].out: two holders)
        return "leak:" + re.sub(r"(\[\d+\])+(?=(\[[^\]]*\])*$)", "[]", holder or "")

    def warn(self, first: int, step: int, holder: str | None, frame=None) -> None:
        """Warn once per holder (None: not found by name); ``frame``: the user's code to point at (default:
        the Trainer's caller). The warning's ``step`` is the later of the two steps, its ``holder`` the name."""
        key = self.key(holder)
        if key in self._warned:
            return
        self._warned.add(key)
        held = f"`{holder}`" if holder else "a reference kept outside the step (a list, a global, a closure)"
        detail = (f"steps {first} and {step}: the autograd graphs of both steps are still alive, held by {held}: such "
                  "graphs pile up step after step (their nodes, and any tensors they still hold)")
        fixes: list[str] = []
        if isinstance(holder, explain.Element):  # a list that keeps one more step's graph every step
            listed = code_of(holder.list_of)
            detail += f", one more in `{listed}` every step"
            fixes = [detach_what_is_added(holder)]
        elif isinstance(holder, explain.Entry) and (listed := re.fullmatch(r"(.*)\[\d+\]", holder.whole)):
            # a list of dicts of tensors, one more each step (a detector's loss dict appended whole for logging)
            listed = code_of(listed[1])
            detail += f", one more dict in `{listed}` every step"
            fixes = [f"detach the dict's values where it is added to `{listed}` (`{listed}.append({{k: v.detach() "
                     f"for k, v in d.items()}})`; `v.item()` for numbers to log), so that no step's graph stays alive "
                     "in it"]
        elif isinstance(holder, Slots):  # a queue of past embeddings written outside torch.no_grad() (SwAV's)
            detail += "; values were written into its slots in place with their graphs"
            others = ", ".join(f"`{code_of(other)}`" for other in holder.others)
            fixes = [(COPY_FIX if holder.through else SLOTS_FIX).format(code=code_of(holder))
                     + f" (and alike for {others}, written so beside it)" * bool(others and not holder.through)]
        elif isinstance(holder, Buffer):  # module state updated in forward from the batch, outside torch.no_grad()
            others = ", ".join(f"`{other}`" for other in holder.others[:3])
            detail += ("; it is a buffer of a module (state such as running statistics or an EMA codebook), written "
                       f"with values that have a graph{f' (and so are {others})' if others else ''}")
            fixes = [_BUFFER_FIX.format(code=code_of(holder), more=" and the other buffers named" if others else "")]
        elif isinstance(holder, GradOf):  # backward(create_graph=True): the reference cycle its docs warn about
            detail += (f"; backward(create_graph=True) gave the gradient a graph, which keeps the parameter and its "
                       f"graph alive in a reference cycle; zeroing `.grad` in place or adding to it keeps it "
                       f"growing{holder.others}")
            fixes = ["set the gradients to None before each backward (`optimizer.zero_grad(set_to_none=True)`, or "
                     "`p.grad = None` for each parameter) instead of `p.grad.zero_()` or `p.grad.data.zero_()`",
                     "if the second-order graph serves a penalty or a Hessian product, take the gradients with "
                     "`torch.autograd.grad(loss, params, create_graph=True)`, which writes no `.grad`"]
        elif holder and (cache := re.match(r"(.*?)\[\(?<tensor of shape ", holder)):
            # a mapping keyed by each step's tensors (a cache of derivatives: DeepXDE's `dde.grad`) gets a new entry
            cached = code_of(cache[1])
            detail += f", one more entry in `{cached}` every step (it is keyed by the tensors of each step)"
            fixes = [f"clear `{cached}` at the end of each step (`{cached}.clear()`), or key it by something that "
                     "stays the same from step to step"]
        elif isinstance(holder, Statistic):  # a moving mean written by hand outside torch.no_grad()
            detail += ("; it holds several values made from the steps' graphs (a running statistic, outputs gathered "
                       "by torch.cat), not a loss")
            fixes = [_STATISTIC_FIX.format(code=code_of(holder))]
        else:
            detail += ". Store loss.item() or loss.detach() instead of the loss tensor"
        self._warn(GraphLeakWarning(detail, step=step, holder=holder, fixes=fixes), frame)


def _holder(sentinel, scope, deep: bool = False, start: int | None = None) -> str | None:
    """The name of the tensor whose graph holds ``sentinel``'s node, else of a batch of the Trainer's list of them
    (``Scope.data``), else a parameter's ``.grad`` whose graph does (``backward(create_graph=True)``); None when none
    is found. ``deep``: ``explain.candidates``'. ``start``: the node counter at the start of the running step: a tensor
    made since holds the old graph through what it was made from, which is named first when a name holds it (a replay
    buffer, not `old = torch.cat(buffer)` drawn from it)."""
    made_now = None
    for name, tensor in explain.candidates(scope, deep=deep):
        if _holds(tensor, sentinel):
            if type(name) in (str, explain.Item, explain.Entry) and written_in_slots(tensor):
                name = slots(name, tensor)
                # the tensors written so beside it (PPO's pg_loss_stats beside its approxkl_stats, written outside
                # torch.no_grad()): the fix of one alone would have the next run warn about the next
                # (written by an earlier step too: not a model output a step divides in place through a view)
                name.others = [] if start is None else list(dict.fromkeys(
                    other for other, t in explain.candidates(scope) if t is not tensor and type(other) is str
                    and written_in_slots(t) and written_before(t, start)))[:3]
            elif type(name) is str and id(tensor) in (buffers := explain.graph_buffers(scope)):
                name = Buffer(name)
                name.others = [other for key, other in buffers.items() if key != id(tensor)]
            elif type(name) is str and tensor.numel() > 1:
                name = Statistic(name)
            if start is None or tensor.grad_fn is None or not walk.HAS_SEQ or sequence_nr(tensor.grad_fn) < start:
                return name
            made_now = made_now or name
    if made_now is not None:
        return made_now
    if scope is None:
        return None
    for name, tensor in explain.data_items(scope):  # a batch of the Trainer's list that a step wrote into
        if _holds(tensor, sentinel):
            return slots(name, tensor) if written_in_slots(tensor) else name
    graded = [p for p in scope.parameters() if p.grad is not None and p.grad.grad_fn is not None]
    for param in graded:
        if _holds(param.grad, sentinel):
            name = explain.parameter_names(scope).get(id(param), (None,))[0]
            holder = GradOf(f"{name}.grad" if name else "a parameter's .grad")
            if len(graded) > 1:
                holder.others = f" (and the .grad of {len(graded) - 1} more parameters)"
            return holder
    return None


def _holds(tensor, sentinel) -> bool:
    fn = tensor.grad_fn
    if fn is None and tensor._is_view():  # a view made under no_grad keeps its base, graph and all (torchmetrics'
        fn = tensor._base.grad_fn  # AUROC stores its preds reshaped under no_grad)
    return any(node.metadata.get(SENTINEL) is sentinel for node in islice(walk.iter_nodes(fn), 20_000))


class Slots(str):
    """A holder's name that is a tensor whose slots were written in place with values that keep their graphs
    (``queue[:bs] = emb``: the last write's ``CopySlices`` node, over the writes of earlier steps). ``through``: a
    loss of the step that wrote it went back through the write (an adversarial patch written into each image of
    batches the loop takes from a list): the write carries a gradient, which detaching what is written would stop."""

    through: bool = False
    others: list[str] = []


def slots(name: str, tensor: torch.Tensor) -> Slots:
    """``name`` as a ``Slots`` holder of ``tensor``, written in its slots (``written_in_slots``)."""
    held = Slots(name)
    held.through = tensor.grad_fn.metadata.get(SENTINEL) is not None
    return held


def written_below(node, limit: int = 1_000) -> bool:
    """Whether a node under ``node`` was, at a look of ``Leaks._written_copies``, the graph of a tensor written in
    place outside any loss from the parameters (Synaptic Intelligence's path integral taken without ``p.detach()``)."""
    return any(n.metadata.get(_LOOKED) is not None for n in islice(walk.iter_nodes(node), limit))


def written_in_slots(tensor: torch.Tensor) -> bool:
    """Whether ``tensor``'s last change wrote some of its slots in place: ``x[:n] = v`` (``CopySlices``),
    ``x[idx] = v`` with a tensor of indices or a mask (``index_put_``: a memory bank's rows of the batch), or
    ``x.index_copy_(dim, idx, v)``."""
    return type(tensor.grad_fn).__name__ in walk.SLOT_WRITES


def written_before(tensor: torch.Tensor, start: int, limit: int = 10_000) -> bool:
    """Whether a write into ``tensor``'s slots, down the chain of its writes (each one's first input is the tensor
    before it), was made before node counter ``start``: by an earlier step."""
    fn = tensor.grad_fn
    for _ in range(limit):
        if fn is None or type(fn).__name__ not in walk.SLOT_WRITES:
            return False
        if sequence_nr(fn) < start:
            return True
        fn = fn.next_functions[0][0] if fn.next_functions else None
    return False


COPY_FIX = ("write into a copy: clone the tensor before writing into it (`x = x.clone()` where the loop takes "
            "`{code}`, before the write), so that `{code}` keeps its values and each step's writes and graph stay its "
            "own; detaching what is written would stop the gradient through the write")
SLOTS_FIX = ("detach what is written into `{code}` where it is written (`{code}[i] = x.detach()`, or the tensor "
             "handed to the code that writes it), or write it under `torch.no_grad()`, so that its slots keep "
             "values, not the graphs of the steps that made them")


class Buffer(str):
    """A holder's name that is a buffer of a module, written with values that keep their graphs (VQ-VAE's EMA codebook
    updated in forward without ``.data``): its writes, not a loss kept, are what to make without a graph. ``others``:
    the names of the scope's other buffers that hold a graph (the codebook's running sums beside it)."""

    others: list[str] = []


_BUFFER_FIX = ("write it{more} under `torch.no_grad()`, or through `.data` as VQ-VAE's EMA codebook does "
               "(`{code}.data.mul_(d).add_(x, alpha=1 - d)`), so that it keeps values, not the graphs of the steps "
               "that made them")


class Statistic(str):
    """A holder's name that is a plain tensor of several values (no loss, which is one value) keeping the graphs of
    the steps it was made from: a running statistic made from each batch (d2l's BatchNorm written from scratch, its
    moving mean returned without ``.data``), to be kept detached rather than stored as ``loss.item()``."""


_STATISTIC_FIX = ("store `{code}` detached, or make it under `torch.no_grad()` where no loss needs its graph (d2l's "
                  "BatchNorm returns its moving statistics as `moving_mean.data`), so that it keeps values, not the "
                  "graphs of the steps that made them")


class GradOf(str):
    """A holder's name that is a parameter's ``.grad`` with a graph (``backward(create_graph=True)``); ``others``:
    what the message adds about other parameters whose ``.grad`` has one too."""

    others: str = ""


def detach_what_is_added(holder: explain.Element) -> str:
    """The fix for a list keeping one more step's graph every step: where the user's code adds to it."""
    listed = code_of(holder.list_of)
    if holder.filled_by:  # a library's object adds what it is handed (torchmetrics' `auroc.update(preds, target)`)
        owner = code_of(holder.filled_by)
        return (f"detach the tensors the loop hands to `{owner}` where it calls it (`.detach()` on each tensor "
                f"argument): `{owner}`'s own code adds them to `{listed}`, graphs and all")
    return (f"detach what is added to `{listed}` where it is added (`{listed}.append(x.detach())`, and "
            f"`{listed}[i] = x.detach()` where an item is replaced, as an image pool does; `x.item()` for a number to "
            "log), so that no step's graph stays alive in it")


WRITTEN_EXAMPLE = "an EMA update `ema_p.mul_(d).add_(p, alpha=1 - d)` of a copy whose parameters are frozen"
WRITTEN_FIX = ("make that write under `torch.no_grad()`, or write into `ema_p.detach()`, as EMA updates do (the "
               "parameter then keeps its value and holds no graph)")
_REMADE_FIX = ("make them under `torch.no_grad()` (DINO's `update_center` is a `@torch.no_grad()` method), or from "
               "detached values (`c = c * m + batch_center.detach() * (1 - m)`): a statistic no loss reads needs no "
               "graph, and keeps its values")
