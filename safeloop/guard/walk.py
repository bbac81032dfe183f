"""Walking an autograd graph from a loss, bounded to the nodes of the current step.

Facts this rests on (torch >= 2.4, tested on 2.13; each private API has a fallback, tested with
the API hidden, so that a torch without it gets a less precise guard, not a crash):
- ``node._sequence_nr()`` is a per-thread counter taken when the node is created, so
  a node whose number is below the counter read at step start was made before the
  step. AccumulateGrad nodes (parameters and other leaves) carry 2**64-1 and are
  never reported. The method is private: without it, nodes are told apart by the
  step number written into ``node.metadata`` when an earlier walk saw them.
  ``torch._C._autograd._get_sequence_nr()`` reads the counter without making a node
  (without it, a probe node is made and read).
- Reading a ``_saved_*`` attribute unpacks the saved tensor: it raises when
  backward already freed it, and when the tensor was modified in place since.
  ``_raw_saved_*`` tells that a node saves a tensor without unpacking it, and its
  ``unpack_hook`` whether unpacking runs user code: under non-reentrant
  ``torch.utils.checkpoint`` it re-runs the checkpointed forward (BatchNorm statistics
  move). Backward frees the hooks with the tensors.
"""
from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from itertools import islice
from typing import Any

import torch
from torch.autograd.function import BackwardCFunction

MARK = "safeloop_step"  # node.metadata key: the step whose walk first saw the node
BELOW = "safeloop_below"  # node.metadata key: what ``below`` found under a node made before the step
with torch.enable_grad():  # imported under no_grad, it still needs a node to look at
    _leaf_node = torch.ones(1, requires_grad=True).view(1).grad_fn
ACCUMULATE = type(_leaf_node.next_functions[0][0])  # AccumulateGrad, found without naming a private class
HAS_SEQ = hasattr(_leaf_node, "_sequence_nr")
# the nodes of a write into some of a tensor's slots in place (`x[:n] = v`, `x[idx] = v`, `x.index_copy_(0, idx, v)`),
# whose first input is the tensor's value before the write
SLOT_WRITES = ("CopySlices", "IndexPutBackward0", "IndexCopyBackward0")
# ... and of a write over the whole tensor (`x.copy_(v)`): its first input too is the value before the write
WRITES = (*SLOT_WRITES, "CopyBackwards")
del _leaf_node
_probe = torch.zeros((), requires_grad=True)
_saved_attrs: dict[type, tuple[tuple[str, str], ...]] = {}
_FUNCTION: dict[type, bool] = {}  # node type -> whether it is a Python autograd Function's node (a ctx)


def _probe_sequence_nr() -> int:
    with torch.enable_grad():  # make a node and read its number (older torch)
        return _probe.view(()).grad_fn._sequence_nr() + 1


def _no_sequence_nr() -> int:
    return 0  # no node numbers: nodes are told apart by the marks walks leave (see ``walk``)


# sequence_now(): the autograd node counter of this thread now (the number the next node will get):
# nodes made earlier have smaller numbers. Read directly where PyTorch offers it: 0.3 µs, against ~5 µs
# for a probe node.
CHEAP_PEEK = HAS_SEQ and hasattr(torch._C._autograd, "_get_sequence_nr")
if CHEAP_PEEK:
    sequence_now = torch._C._autograd._get_sequence_nr
elif HAS_SEQ:
    sequence_now = _probe_sequence_nr
else:
    sequence_now = _no_sequence_nr


def _saved(node) -> tuple[tuple[str, str], ...]:
    """(unpacking name, raw name) of each tensor the node's type saves for backward (cached per type)."""
    kind = type(node)
    pairs = _saved_attrs.get(kind)
    if pairs is None:
        raws = [n for n in dir(node) if n.startswith("_raw_saved_")]
        # nodes of Python autograd Functions expose ``saved_tensors`` instead of ``_saved_tensors``
        pairs = tuple(("saved_tensors" if n == "_raw_saved_tensors" else n[len("_raw"):], n) for n in raws)
        _saved_attrs[kind] = pairs
    return pairs


def holds_tensors(node) -> bool:
    """Whether backward through ``node`` needs buffers that a non-retaining backward frees."""
    return bool(_saved(node))


def _hooked(raw) -> bool:
    """Whether unpacking this saved tensor (or tuple of them) would run an unpack hook."""
    if isinstance(raw, (tuple, list)):
        return any(_hooked(r) for r in raw)
    return getattr(raw, "unpack_hook", None) is not None


def unpack_error(node, first: bool = False) -> RuntimeError | None:
    """Unpack the node's saved tensors (``first``: up to the first one that was given); return the error
    PyTorch raises, if any.

    A tensor whose unpacking would run a hook is left packed: it cannot have been freed (backward
    drops the hook with the tensor), and whether it changed in place is left to backward to say. An
    optional tensor that was not given (layer_norm's bias, a GRU's cell state) unpacks as None even
    after backward freed the node's buffers: it says nothing, so ``first`` goes on to the next one.
    """
    for name, raw_name in _saved(node):
        try:
            if _hooked(getattr(node, raw_name)):
                continue
            value = getattr(node, name)
        except RuntimeError as err:
            return err
        if first and value is not None and not (isinstance(value, (tuple, list)) and not value):
            return None
    return None


def saved_tensors(node) -> list:
    """The tensors ``node`` saved for backward that unpack without running a hook and without an error."""
    out = []
    for name, raw_name in _saved(node):
        try:
            if _hooked(getattr(node, raw_name)):
                continue
            value = getattr(node, name)
        except RuntimeError:
            continue
        out += [t for t in (value if isinstance(value, (tuple, list)) else (value,)) if isinstance(t, torch.Tensor)]
    return out


def is_freed(err: BaseException | None) -> bool:
    return err is not None and "freed" in str(err)


def is_inplace(err: BaseException | None) -> bool:
    return err is not None and "modified by an inplace operation" in str(err)


def node_step(node) -> int | None:
    return node.metadata.get(MARK)


def sequence_nr(node) -> int:
    """The node counter when ``node`` was made (by its thread); needs ``HAS_SEQ``."""
    return node._sequence_nr()


def iter_nodes(*roots, stop: Callable[[Any], bool] | None = None, seen: set | None = None) -> Iterator:
    """Each node below ``roots`` (and the roots, even one ``seen`` has) once, depth first through
    ``next_functions``. A node for which ``stop`` is true is neither yielded nor walked below.
    ``seen``: the nodes met so far, shared with other walks (it grows); ``itertools.islice`` bounds a
    walk of a graph that may be huge."""
    seen = set() if seen is None else seen
    stack = [root for root in roots if root is not None]
    seen.update(stack)
    while stack:
        node = stack.pop()
        if stop is not None and stop(node):
            continue
        yield node
        for nxt, _ in node.next_functions:
            if nxt is not None and nxt not in seen:
                seen.add(nxt)
                stack.append(nxt)


@dataclass
class Walk:
    """What one walk of a loss's graph found."""

    nodes: list = field(default_factory=list)  # this step's nodes (AccumulateGrad excluded)
    before: list = field(default_factory=list)  # nodes made before the step, not descended into
    leaves: list = field(default_factory=list)  # the AccumulateGrad nodes met (their ``variable``: the leaf)
    functions: list = field(default_factory=list)  # this step's nodes of Python autograd Functions (their ctx)


def walk(root, start_seq: int | None, step: int, seen: set | None = None) -> Walk:
    """Visit the graph below ``root`` once, stopping at nodes made before the step.

    ``seen`` (a set of nodes) is shared between the walks of one step, so that a node two
    losses reach is visited once; holding the nodes also keeps their wrappers, and so
    their identities, stable for the step. The guard's hot path: about 1 µs per node on a
    fresh graph, most of it PyTorch making each node's Python wrapper.
    """
    found = Walk()
    before = found.before
    use_seq = HAS_SEQ and start_seq is not None

    def stop(node) -> bool:
        """A leaf (a parameter: shared by every step, by design) or a node made before the step."""
        kind = type(node)
        if kind is ACCUMULATE:
            found.leaves.append(node)
            return True
        function = _FUNCTION.get(kind)
        if function is None:
            function = _FUNCTION[kind] = issubclass(kind, BackwardCFunction)
        if use_seq:
            made_before = node._sequence_nr() < start_seq
        else:  # the fallback: the step whose walk first saw the node
            made_before = node.metadata.get(MARK, step) < step
            if not made_before:
                node.metadata[MARK] = step
        if made_before:
            before.append(node)
        elif function:
            found.functions.append(node)
        return made_before

    found.nodes = list(iter_nodes(root, stop=stop, seen=seen))
    return found


def below(node, limit: int = 10_000) -> tuple[object | None, tuple]:
    """What backward would meet under ``node``, a graph built before the step: the first node that
    saves tensors (None: none does) and the leaf tensors it reaches. Cached in the node's metadata,
    as such a graph does not change."""
    cached = node.metadata.get(BELOW)
    if cached is None:
        saver, leaves = None, []
        for n in islice(iter_nodes(node), limit):
            if type(n) is ACCUMULATE:
                leaves.append(n.variable)
            elif saver is None and holds_tensors(n):
                saver = n
        cached = node.metadata[BELOW] = (saver, tuple(leaves))
    return cached


def runs(root, inputs, limit: int = 1_000_000, captured: bool = False) -> set:
    """The nodes below ``root`` that ``backward(inputs=inputs)`` runs: those on a path to an input. ``captured``:
    ``torch.autograd.grad``'s inputs, whose gradient is taken where it reaches them: the node that made a non-leaf
    input runs only when it is on a path to another input (it keeps its saved tensors)."""
    leaves = {id(t) for t in inputs if t.grad_fn is None}
    tops = {t.grad_fn for t in inputs if t.grad_fn is not None}
    users: dict = {}  # node -> the nodes that take its output
    reached = set()
    for node in islice(iter_nodes(root), limit):
        if node in tops or (type(node) is ACCUMULATE and id(node.variable) in leaves):
            reached.add(node)
        for nxt, _ in node.next_functions:
            if nxt is not None:
                users.setdefault(nxt, []).append(node)
    ran = set() if captured else set(reached)
    todo = list(reached)  # and every node above one that runs
    while todo:
        for user in users.get(todo.pop(), ()):
            if user not in ran:
                ran.add(user)
                todo.append(user)
    return ran


def reachable(root, target, limit: int = 100_000) -> bool:
    """Whether ``target`` (a node) is in the graph below ``root``."""
    return any(node is target for node in islice(iter_nodes(root), limit))
