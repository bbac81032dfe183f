"""Fingerprints of parameters, taken when a module's forward has used them (``guard.check=always`` only).

A write through ``.data`` (``p.data.clamp_(-c, c)``) moves no version counter, so PyTorch cannot tell that a
graph saved a parameter whose values changed before its backward. A fingerprint can. Hooks on the modules the
guard can name (the model, the modules in the loop's variables), put there at the first checked step, read the
parameters a module holds directly after each of its forwards with grad enabled: version, data pointer, and the
L2 norm of their values (float32, left on the device: no sync there; the comparison syncs). The norm, not the sum:
weight clipping moves values at both ends towards zero, which a sum can cancel out (as many raised as lowered by
the same amount) and a norm cannot. Before a checked backward, a reached parameter with the same version but another
data pointer or norm was written since, unseen by autograd. Reading every parameter at every forward costs one
pass over the weights: beyond the guard's budget, so only ``check=always`` takes them.

The hook never changes what the model computes: it reads detached parameters, outside autograd, and records
nothing while torch.compile traces, under ``torch.func`` transforms, or for tensors it cannot read.
"""
from __future__ import annotations

import weakref
from collections.abc import Iterable, Iterator
from typing import Any

import torch


class Prints:
    """The parameters' fingerprints since the last ``clear``, taken by forward hooks on the modules ``watch``-ed
    until ``stop``. Per-module hooks, not a global one: torch.compile warns about global module hooks, and a
    compiled module (``torch.compile(model)``) is left alone."""

    def __init__(self):
        self._seen: dict[int, tuple] = {}  # id -> (weak reference, version, data pointer, norm)
        self._handles: dict[int, Any] = {}  # id(module) -> its hook's handle
        self._renewable: set[int] = set()  # fingerprints the next forward takes again (``renew``)

    def watch(self, modules: Iterable[torch.nn.Module]) -> None:
        """Take fingerprints at every forward of these modules and their submodules from now on."""
        me = weakref.ref(self)

        def hook(module, args, output):
            prints = me()
            if prints is not None and torch.is_grad_enabled() and not torch.compiler.is_compiling():
                prints.record(module)

        for root in modules:
            for module in _uncompiled(root):
                if id(module) not in self._handles:
                    self._handles[id(module)] = module.register_forward_hook(hook)

    def stop(self) -> None:
        for handle in self._handles.values():
            handle.remove()
        self._handles.clear()
        self._seen.clear()

    def clear(self) -> None:
        """A step is over: its fingerprints are of no use to the next."""
        self._seen.clear()
        self._renewable.clear()

    def renew(self) -> None:
        """The losses checked so far go to their backward: a later forward makes a new graph, from the values it
        sees, and its fingerprints replace theirs (an update through ``.data`` in between is no mistake)."""
        self._renewable = set(self._seen)

    def record(self, module: torch.nn.Module) -> None:
        """After a forward of ``module``: a fingerprint of each of its parameters, unless one was taken in this step
        at the same version and not checked since (a module called twice before a backward: the first forward's
        graph holds the values it saw, so a write between the two is compared with those)."""
        try:  # the module's own parameters (``parameters()`` may be overridden with another signature)
            params = list(vars(module).get("_parameters", {}).values())
        except TypeError:
            return
        for param in params:
            if param is not None and param.requires_grad and type(param) in (torch.nn.Parameter, torch.Tensor):
                seen = self._seen.get(id(param))
                if seen is not None and seen[0]() is param and seen[1] == param._version \
                        and id(param) not in self._renewable:
                    continue
                self._renewable.discard(id(param))
                try:
                    self._seen[id(param)] = (weakref.ref(param), param._version, param.data_ptr(), _norm(param))
                except (RuntimeError, TypeError):  # a tensor without storage (functorch, meta): no fingerprint
                    continue

    def changed(self, leaves) -> list[torch.Tensor]:
        """The ``leaves`` written since their module's first forward of the step without moving their version
        (``.data``)."""
        out = []
        for leaf in leaves:
            seen = self._seen.get(id(leaf))
            if seen is None or seen[0]() is not leaf or leaf._version != seen[1]:
                continue
            total = _norm(leaf)
            if not bool(torch.isfinite(seen[3])) or not bool(torch.isfinite(total)):
                continue  # an overflowing or non-finite norm tells nothing
            if leaf.data_ptr() != seen[2] or not torch.equal(total, seen[3]):
                out.append(leaf)
        return out


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
