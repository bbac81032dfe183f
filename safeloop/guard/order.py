"""The order of ``zero_grad()``, ``backward()`` and ``step()``, read from the optimizers' gradients: at each checked
backward that writes them (before it runs and after) and at each update. Two mistakes leave every update wrong without
an error:

- gradients cleared before the update that should use them (``zero_grad()`` between ``backward()`` and ``step()``, or
  before ``step()`` with ``backward()`` after it): at the update no parameter has a gradient, and nothing changes;
- gradients never cleared (no ``zero_grad()``): each backward adds to the gradient an earlier update applied, so every
  update applies the sum of every gradient so far.

A gradient counts as cleared when it is None, or another tensor, or the same tensor at another version than the one
last seen (``zero_()``, and anything else written into it in place), or, where an update applied it and it looks
untouched since, all zeros (``p.grad.data.zero_()`` writes through ``.data``, which no version counts): so a backward
the guard did not check, or a gradient changed by hand, reads as cleared, and nothing is said of it; an update finds
the gradients kept where every one it applies was added to by a backward and at least one of those was not changed
since (a sparse autoencoder's decoder gradient projected by hand, the others never cleared). One exception: a
gradient that a backward added to an applied one, then only multiplied by a positive factor before the update
(``clip_grad_norm_``, GradScaler's ``unscale_``), still holds the sum, and is still kept at that update. Gradients
zeroed in place right before the update (``zero_grad(set_to_none=False)`` between ``backward()`` and ``step()``)
cannot be told from gradients that are zero.

A third: an optimizer whose parameters never get a gradient (a loss that reaches them only through a gradient taken
without ``create_graph=True``, or through ``.item()``): none of them requiring grad has had one at a checked backward or
at an update after one, so far, at two of its updates in a row, each after a checked backward. Its steps change
nothing.

A fourth mistake is read from the plain tensors (no optimizer holds them, not Parameters) whose gradients a checked
backward writes: an attack's input kept across steps, its gradient never cleared. A backward counts as an attack's when
every gradient it gave the optimizers' parameters is cleared (None or all zeros) before the next checked backward with
no update in between (FGSM's `model.zero_grad()` after reading `data.grad`). A later step's backward that adds to that
input's gradient, the very tensor at the version the attack left and not all zeros, while a checked step in between
left it alone (a batch kept in a list, met again at the next epoch), makes the next attack read the sum of both.
"""
from __future__ import annotations

import itertools
import weakref

import torch

from .. import fsdp

# No weak reference to a parameter or its gradient is kept: a module whose parameters are tensor subclasses (FSDP2's
# DTensors) swaps them in ``.to()`` (torch.utils.swap_tensors), which refuses a tensor with one. A gradient seen is
# marked instead, with a number of its own in an attribute.
_MARK = "_safeloop_seen"
_marks = itertools.count(1)


def _state(p: torch.Tensor) -> tuple | None:
    """``p``'s gradient as it is now: its mark and its version; None for none."""
    grad = p.grad
    if grad is None:
        return None
    if _MARK not in grad.__dict__:
        grad.__dict__[_MARK] = next(_marks)
    return grad.__dict__[_MARK], grad._version


def _elements(grad: torch.Tensor) -> torch.Tensor:
    """The elements ``grad`` holds, flat: this rank's shard of a sharded one (no collective); a sparse one's values
    (``nn.Embedding(sparse=True)``'s), coalesced first (a copy: the gradient itself is left as it is), so that values
    of one index that cancel read as the zero they sum to."""
    grad = fsdp.local(grad.detach())
    if grad.layout is torch.sparse_coo:
        grad = grad.coalesce()
    return grad.flatten() if grad.layout is torch.strided else grad.values().flatten()


def _measure(p: torch.Tensor) -> torch.Tensor:
    """A few numbers of ``p``'s gradient that multiplying it by a factor multiplies alike: its norm, its sum, its first
    and last element (see ``_elements``)."""
    flat = _elements(p.grad)
    return torch.stack((flat.norm(), flat.sum(), flat[:1].sum(), flat[-1:].sum())).float()


def _rescaled(p: torch.Tensor, state: tuple, measure: torch.Tensor) -> bool:
    """Whether ``p``'s gradient is the tensor that ``state`` saw and ``measure`` measured, since multiplied in place by
    a positive factor only (clipping by norm, unscaling): what the backward left is still in it."""
    if p.grad is None or p.grad.__dict__.get(_MARK) != state[0]:
        return False
    now = _measure(p)
    factor = now[0] / measure[0]
    return bool(torch.isfinite(factor) and factor > 0) and torch.allclose(now, measure * factor, rtol=1e-4,
                                                                          atol=1e-6 * float(now[0]))


def _same(p: torch.Tensor, state: tuple | None) -> bool:
    """Whether ``p``'s gradient is still the tensor, at the version, that ``state`` saw."""
    grad = p.grad
    return state is not None and grad is not None and grad.__dict__.get(_MARK) == state[0] \
        and grad._version == state[1]


def _zeroed(params: list[torch.Tensor]) -> list[torch.Tensor]:
    """Those of ``params`` whose gradient is all zeros: one read per device (a host sync on a GPU)."""
    by_device: dict[torch.device, list[tuple[torch.Tensor, torch.Tensor]]] = {}
    for p in params:
        elements = _elements(p.grad)
        by_device.setdefault(elements.device, []).append((p, elements.ne(0).any()))
    out = []
    for pairs in by_device.values():
        nonzero = torch.stack([flag for _, flag in pairs]).tolist()
        out.extend(p for (p, _), keeps in zip(pairs, nonzero) if not keeps)
    return out


class GradientOrder:
    """What the checked backwards and the updates saw of the optimizers' gradients (see the module docstring), per
    parameter (by id): an update of one optimizer judges its own parameters (a predictive-coding loop steps the value
    nodes' optimizer at every inference step while the weights' gradients add up until theirs steps)."""

    def __init__(self) -> None:
        self._seen: dict[int, tuple | None] = {}  # their gradients after the last checked backward or their update
        self._applied: set[int] = set()  # those with a gradient at their optimizer's last update, not cleared since
        # of those, the ones a checked backward added to since (never cleared), with what it left (``_measure``)
        self._added: dict[int, torch.Tensor] = {}
        # those with a gradient after a checked backward since their optimizer's last update: the first such
        # backward's (step, loss name, where to warn)
        self._given: dict[int, tuple] = {}
        self._current: list[torch.Tensor] = []  # the parameters of the backward about to run (until it ran)
        self._leaves: list[torch.Tensor] = []  # and the plain leaves it writes
        self._by: tuple | None = None  # its step, loss name and where to warn
        self._before: dict[int, tuple | None] = {}  # its parameters' applied gradients before it ran
        self._found: dict[tuple, int] = {}  # (mistake, optimizer) -> the updates in a row that found it
        # the last checked backward's plain leaves (weak references, with their gradients' states), the parameters it
        # gave gradients and its step, until the next checked backward tells whether it was an attack's (see the module
        # docstring)
        self._last: tuple[list, list, int] | None = None
        # plain leaf (by id) -> its gradient's state after an attack's backward, that step, a weak reference to it
        # (whose end drops the entry: a batch of a data loader's is a new tensor every step)
        self._attacked: dict[int, tuple] = {}
        self._steps: tuple = (None, None)  # the last two steps with a checked backward
        self._had: set[int] = set()  # the optimizers' parameters seen with a gradient (by id; see ``_starved``)
        self._backwards = 0  # the checked backwards so far, and the last one's ``by``
        self._last_by: tuple | None = None
        self._counted: dict[int, int] = {}  # optimizer (by its first parameter's id) -> ``_backwards`` at its update

    def before_backward(self, params, by: tuple, leaves=()) -> list[torch.Tensor]:
        """A checked backward is about to write the gradients of ``params`` (the optimizers') and of ``leaves`` (plain
        tensors that require grad); ``by``: its step, loss name and where to warn. Returns those of ``leaves`` whose
        gradient an attack of an earlier step left, which this backward adds to (see the module docstring)."""
        self._judge_last(by[0])
        self._current, self._by, self._before, self._leaves = list(params), by, {}, list(leaves)
        kept = [p for p in self._current if id(p) in self._applied and _same(p, self._seen.get(id(p)))]
        for p in _zeroed(kept):  # zeroed through ``.data``, which no version counts
            self._seen[id(p)] = None
        for p in self._current:
            i = id(p)
            if not _same(p, self._seen.get(i)):  # cleared (or written) since last seen
                self._applied.discard(i)
                self._added.pop(i, None)
            elif i in self._applied:
                self._before[i] = self._seen[i]
        earlier = self._steps[0]
        kept = [t for t in self._leaves if (then := self._attacked.get(id(t))) is not None and earlier is not None
                and then[1] < earlier and _same(t, then[0])]
        zeroed = set(map(id, _zeroed(kept))) if kept else set()
        return [t for t in kept if id(t) not in zeroed]

    def after_backward(self) -> None:
        """That backward ran: the gradients it left; those it added to a gradient an update applied."""
        for p in self._current:
            i = id(p)
            if i in self._before and not _same(p, self._before[i]):
                self._added[i] = _measure(p)
            self._seen[i] = _state(p)
            if p.grad is not None:
                self._given.setdefault(i, self._by)
                self._had.add(i)
        self._backwards, self._last_by = self._backwards + 1, self._by
        given = [p for p in self._current if p.grad is not None]
        self._last = ([(weakref.ref(t), _state(t)) for t in self._leaves if t.grad is not None], given, self._by[0])
        self._current, self._before, self._leaves = [], {}, []

    def _judge_last(self, step: int) -> None:
        """Before a checked backward of ``step``: whether the last one was an attack's (the gradients it gave the
        parameters all cleared since, with no update in between)."""
        if step != self._steps[1]:
            self._steps = (self._steps[1], step)
        if self._last is not None:
            written, given, at = self._last
            present = [p for p in given if p.grad is not None]
            if written and given and len(_zeroed(present)) == len(present):
                for t, state in ((ref(), state) for ref, state in written):
                    if t is not None:  # its entry goes with it
                        self._attacked[id(t)] = (state, at, weakref.ref(t, lambda _, i=id(t): self._forget(i)))
            self._last = None

    def _forget(self, i: int) -> None:
        """The plain leaf ``i`` (by id) is gone."""
        self._attacked.pop(i, None)

    def at_update(self, params) -> tuple[str, tuple] | None:
        """An update of ``params`` (an optimizer's; None: not known, nothing judged): ("cleared", "kept" or "starved",
        the first checked backward's ``by``, for "starved" the last one's) where the second of that optimizer's updates
        in a row finds that mistake, else None. Updates with no checked backward since the last one are not counted."""
        self._last = None  # an update used the last backward's gradients: not an attack's
        params = [p for p in params or () if id(p) in self._seen]
        given = [self._given[id(p)] for p in params if id(p) in self._given]
        with_grad = [p for p in params if p.grad is not None]
        found, starved = None, self._starved(params, with_grad)
        if given:
            if not any(id(p) in self._given for p in with_grad):
                found = "cleared"
            elif all(id(p) in self._added for p in with_grad) and any(
                    _same(p, self._seen.get(id(p))) or _rescaled(p, self._seen[id(p)], self._added[id(p)])
                    for p in with_grad):
                found = "kept"  # (not where every gradient changed since that backward otherwise: cleared, replaced)
            key = id(params[0])
            for kind in ("cleared", "kept"):
                self._found[kind, key] = self._found.get((kind, key), 0) + 1 if kind == found else 0
        if starved is not None:
            key, found = id(params[0]), "starved" if starved else found
            self._found["starved", key] = self._found.get(("starved", key), 0) + 1 if starved else 0
        for p in params:
            i = id(p)
            self._seen[i] = _state(p)
            (self._applied.add if p.grad is not None else self._applied.discard)(i)
            self._added.pop(i, None)
            self._given.pop(i, None)
        if found is None or self._found[found, id(params[0])] != 2:
            return None
        return found, given[0] if given else self._last_by

    def _starved(self, params: list[torch.Tensor], with_grad: list[torch.Tensor]) -> bool | None:
        """Whether none of ``params`` (an optimizer's, updating now; ``with_grad``: those with a gradient) that require
        grad has ever been seen with a gradient, at a checked backward or an update judged here (see the module
        docstring); None where nothing is judged: no checked backward since its last update."""
        if not params:
            return None
        counted, self._counted[id(params[0])] = self._counted.get(id(params[0]), 0), self._backwards
        if self._backwards == counted:
            return None
        self._had.update(id(p) for p in with_grad)
        return any(p.requires_grad for p in params) and not any(id(p) in self._had for p in params)
