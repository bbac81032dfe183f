"""Fingerprints of parameters, taken when a module's forward has used them (``guard.check=always`` only).

A write through ``.data`` (``p.data.clamp_(-c, c)``) moves no version counter, so PyTorch cannot tell that a
graph saved a parameter whose values changed before its backward. A fingerprint can. Hooks on the modules the
guard can name (the model, the modules in the loop's variables), put there at the first checked step, read the
parameters a module holds directly after each of its forwards with grad enabled: version, data pointer, and the
L2 norm of their values (float32, left on the device: no sync there; the comparison syncs once). The norm, not the sum:
weight clipping moves values at both ends towards zero, which a sum can cancel out (as many raised as lowered by
the same amount) and a norm cannot. Before a checked backward, a reached parameter with the same version but another
data pointer or norm than at a forward whose output the loss's graph holds was written since, unseen by autograd.
A forward the loss does not hold (one whose graph went to ``torch.autograd.grad`` only, or was dropped) says nothing:
a write after it is no mistake. Reading every parameter at every forward costs one pass over the weights: beyond
the guard's budget, so only ``check=always`` takes them.

The hook never changes what the model computes: it reads detached parameters, outside autograd, and records
nothing while torch.compile or torch.jit.trace traces, under ``torch.func`` transforms, or for tensors it cannot
read.
"""
from __future__ import annotations

import weakref
from collections import OrderedDict
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import torch

from . import walk


class Unsaved(OrderedDict):
    """A module's forward hooks, the fingerprints' among them (``ours``: their ids): pickled (``torch.save(model)``,
    ``copy.deepcopy``) as the plain ``OrderedDict`` of the others, as the module would pickle without the guard, so
    that a saved model holds nothing of safeloop (a local function pickle cannot save, besides). ``values()``, which
    ``torch.jit.script`` compiles and a module's own call does not read (it reads ``items()``), are the others too:
    a model scripted for export after training is the model without the guard."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.ours: set[int] = set()

    def __reduce__(self):
        return OrderedDict, (), None, None, iter([(k, v) for k, v in self.items() if k not in self.ours])

    def values(self):
        return [v for k, v in self.items() if k not in self.ours]


class Prints:
    """The parameters' fingerprints since the last ``clear``, taken by forward hooks on the modules ``watch``-ed
    until ``stop``: one per forward of a parameter's module, kept with the forward's output nodes, so that a loss is
    compared with the forwards its graph holds only. Per-module hooks, not a global one: torch.compile warns about
    global module hooks, and a compiled module (``torch.compile(model)``) is left alone."""

    def __init__(self):
        # id(parameter) -> (the parameter, [(version, data pointer, norm, the forward's output nodes), ...]), for one
        # step (no weak reference to a parameter: see order.py)
        self._seen: dict[int, tuple[Any, list[tuple]]] = {}
        self._handles: dict[int, Any] = {}  # id(module) -> its hook's handle

    def watch(self, modules: Iterable[torch.nn.Module]) -> None:
        """Take fingerprints at every forward of these modules and their submodules from now on."""
        me = weakref.ref(self)

        def hook(module, args, output):
            prints = me()
            if prints is not None and torch.is_grad_enabled() and not torch.compiler.is_compiling() \
                    and not torch.jit.is_tracing():  # torch.jit.trace records what the model computes, not this
                prints.record(module, output)

        for root in modules:
            for module in _uncompiled(root):
                if id(module) not in self._handles:
                    if type(module._forward_hooks) is OrderedDict and not module._forward_hooks:
                        # torch's own attribute (set by name: not a name of safeloop's); no hook of the module's own
                        # is in it yet, so no handle refers to the dict it replaces
                        setattr(module, "_forward_hooks", Unsaved())
                    handle = self._handles[id(module)] = module.register_forward_hook(hook)
                    if isinstance(module._forward_hooks, Unsaved):
                        module._forward_hooks.ours.add(handle.id)

    def stop(self) -> None:
        for handle in self._handles.values():
            handle.remove()
        self._handles.clear()
        self._seen.clear()

    def clear(self) -> None:
        """A step is over: its fingerprints are of no use to the next."""
        self._seen.clear()

    def record(self, module: torch.nn.Module, output: Any) -> None:
        """After a forward of ``module``: a fingerprint of each of its parameters, with the sequence numbers of the
        nodes that made the forward's output (nothing when none has one: no loss can reach this forward)."""
        made = _output_nodes(output)
        if not made:
            return
        try:  # the module's own parameters (``parameters()`` may be overridden with another signature)
            params = list(vars(module).get("_parameters", {}).values())
        except TypeError:
            return
        for param in params:
            if param is not None and param.requires_grad and type(param) in (torch.nn.Parameter, torch.Tensor):
                try:
                    taken = (param._version, param.data_ptr(), _norm(param), made)
                except (RuntimeError, TypeError):  # a tensor without storage (functorch, meta): no fingerprint
                    continue
                seen = self._seen.get(id(param))
                if seen is None or seen[0] is not param:
                    seen = self._seen[id(param)] = (param, [])
                seen[1].append(taken)

    def changed(self, leaves, nodes) -> list[torch.Tensor]:
        """The ``leaves`` written, without moving their version (``.data``), since a forward whose output nodes are
        among ``nodes`` (a loss's graph): that forward's graph saved values they no longer hold. Without node
        sequence numbers (an older torch) nothing is said: which forwards a loss holds cannot be told. The
        comparisons stay on the parameters' device until one read per device at the end: one host sync a call."""
        if not walk.HAS_SEQ:
            return []
        held = {walk.sequence_nr(node) for node in nodes}
        compared: dict[torch.device, list[tuple[torch.Tensor, torch.Tensor]]] = {}  # device -> [(leaf, written?)]
        for leaf in leaves:
            seen = self._seen.get(id(leaf))
            if seen is None or seen[0] is not leaf:
                continue
            used = [(ptr, norm) for version, ptr, norm, made in seen[1] if version == leaf._version and made & held]
            if not used:
                continue
            total = _norm(leaf)
            norms = torch.stack([norm for _, norm in used])
            moved = any(ptr != leaf.data_ptr() for ptr, _ in used)
            finite = torch.isfinite(total) & torch.isfinite(norms).all()  # an overflowing norm tells nothing
            compared.setdefault(total.device, []).append((leaf, finite & ((norms != total).any() | moved)))
        out = []
        for pairs in compared.values():
            written = torch.stack([flag for _, flag in pairs]).tolist()
            out.extend(leaf for (leaf, _), yes in zip(pairs, written) if yes)
        return out


def _output_nodes(output: Any) -> frozenset[int]:
    """The sequence numbers of the nodes that made the tensors of a forward's output."""
    if not walk.HAS_SEQ:
        return frozenset()
    return frozenset(walk.sequence_nr(t.grad_fn) for t in _tensors(output) if t.grad_fn is not None)


def _tensors(value: Any, depth: int = 4) -> Iterator[torch.Tensor]:
    """The tensors in ``value``, through tuples (a ``PackedSequence`` too), lists and mappings a few levels deep;
    nothing is rebuilt."""
    if isinstance(value, torch.Tensor):
        yield value
    elif depth and isinstance(value, (tuple, list)):
        for item in value:
            yield from _tensors(item, depth - 1)
    elif depth and isinstance(value, Mapping):
        for item in value.values():
            yield from _tensors(item, depth - 1)


def _norm(param: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return torch.linalg.vector_norm(param.detach(), dtype=torch.float32)


def _uncompiled(module: torch.nn.Module) -> Iterator[torch.nn.Module]:
    """``module`` and its submodules, leaving out a compiled one (``torch.compile(m)``) and all it holds."""
    if type(module).__name__ == "OptimizedModule":
        return
    yield module
    for child in module.children():
        yield from _uncompiled(child)
