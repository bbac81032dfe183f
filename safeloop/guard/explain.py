"""Finding the Python name of the tensor that holds an offending graph node.

Searched in order: the trainer's attributes, the model's attributes, the batch,
the globals and closure of ``training_step``; the garbage collector last. Only
runs on the error path.
"""
from __future__ import annotations

import gc
from contextlib import suppress
import warnings
from collections.abc import Mapping
from typing import Any, Iterator

import torch

from .walk import reachable


def _items(obj: Any, prefix: str, depth: int = 2) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) pairs inside ``obj``: attributes, mapping values, list items."""
    if isinstance(obj, torch.Tensor):
        yield prefix, obj
    elif depth <= 0:
        return
    elif isinstance(obj, Mapping):
        for key, val in list(obj.items()):
            yield from _items(val, f"{prefix}[{key!r}]", depth - 1)
    elif isinstance(obj, (list, tuple)):
        for i, val in enumerate(obj):
            yield from _items(val, f"{prefix}[{i}]", depth - 1)


def _attributes(obj: Any, prefix: str) -> Iterator[tuple[str, torch.Tensor]]:
    if isinstance(obj, torch.nn.Module):  # plain attributes, then submodules' (not parameters)
        for mod_name, mod in obj.named_modules():
            base = f"{prefix}.{mod_name}" if mod_name else prefix
            for key, val in vars(mod).items():
                if not key.startswith("_"):
                    yield from _items(val, f"{base}.{key}")
            for key, val in mod._buffers.items():
                if val is not None:
                    yield f"{base}.{key}", val
        return
    fields = dict(vars(obj))
    for cls in type(obj).__mro__[:-1]:  # class-level state too (``history = []`` in the class body)
        if cls.__module__.startswith("safeloop"):
            break
        for key, val in vars(cls).items():
            if not callable(val) and not isinstance(val, (property, staticmethod, classmethod)):
                fields.setdefault(key, val)
    for key, val in fields.items():
        if key.startswith("__"):
            continue
        yield from _items(val, f"{prefix}.{key}")
        if isinstance(val, torch.nn.Module) and key not in ("model",):
            yield from _attributes(val, f"{prefix}.{key}")


def candidates(trainer: Any = None, batch: Any = None) -> Iterator[tuple[str, torch.Tensor]]:
    if trainer is not None:
        yield from _attributes(trainer, "self")
        model = getattr(trainer, "model", None)
        if isinstance(model, torch.nn.Module):
            yield from _attributes(model, "self.model")
        fn = getattr(type(trainer), "training_step", None)
        code = getattr(fn, "__code__", None)
        if code is not None:
            names = set(code.co_names)
            for key, val in fn.__globals__.items():
                if key in names:
                    yield from _items(val, f"global {key}")
            for key, cell in zip(code.co_freevars, fn.__closure__ or ()):
                with suppress(ValueError):  # an empty cell
                    yield from _items(cell.cell_contents, f"closure {key}")
    if batch is not None:
        yield from _items(batch, "batch", depth=3)


def find_holder(node, trainer: Any = None, batch: Any = None, scan_gc: bool = True) -> str | None:
    """Name of a tensor whose ``grad_fn`` is ``node`` (or whose graph reaches it)."""
    near = None
    for name, tensor in candidates(trainer, batch):
        fn = tensor.grad_fn
        if fn is None:
            continue
        if fn is node:
            return name
        if near is None and reachable(fn, node, limit=2_000):
            near = name
    if near is not None:
        return near
    if scan_gc:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # isinstance on some module objects warns
            for obj in gc.get_objects():
                try:
                    if isinstance(obj, torch.Tensor) and obj.grad_fn is node:
                        return "an unnamed tensor (found by the garbage collector)"  # starts with "a": no code
                except ReferenceError:  # a dead weakref.proxy
                    continue
    return None


def traceback_of(node) -> str | None:
    """The line that created ``node``, when anomaly mode (``guard.trace=true``) was on."""
    stack = node.metadata.get("traceback_")
    if not stack:
        return None
    frames = [line for line in stack if "site-packages/torch" not in line and "safeloop/" not in line]
    return (frames or stack)[-1].strip()
