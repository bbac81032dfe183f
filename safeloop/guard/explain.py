"""Finding the Python name of the tensor that holds an offending graph node.

Searched in order: the ``Scope``'s roots (for a Trainer: its attributes, then the
model's), its namespaces (for a plain loop: the caller's local and global variables), the
globals and closure of its functions (``training_step``), the batch; the garbage collector last.
Only runs on the error path.
"""
from __future__ import annotations

import gc
import inspect
import os
import re
import sys
import sysconfig
import types
from contextlib import suppress
from itertools import islice
from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import torch

import safeloop

from .. import fsdp
from . import walk
from .walk import reachable, sequence_nr


@dataclass
class Scope:
    """What the guard may look at to explain a mistake; it reaches no further.

    Attributes:
        roots: named objects whose attributes, items and submodules may hold the tensor at
            fault, searched in order (a Trainer gives ``{"self": trainer, "self.model": model}``).
        namespaces: returns ``(prefix, {name: value})`` pairs read when a search runs, so that the
            values are those of that moment (a plain loop: ``("local", frame.f_locals)``); a tensor
            is named ``local y``, a module's attributes ``model.h``.
        functions: whose globals and closure variables are searched too (``training_step``).
        parameters: the trained parameters (none requiring grad: a frozen model; gradients on
            them before the first backward: the step ran backward itself).
        rerun: re-runs the step on a batch recording how its graph was lost (a set of
            ``no_grad``, ``detach``, ``item``), changing nothing; None when it cannot.
        optimized: the parameters the optimizers update, or None while the optimizers are not known (a plain
            loop given none, before one steps): a loss's leaves are judged against them only when known.
        data: a Trainer's training data when it is a list of batches, which the steps get as they are: searched
            last, for a graph a step left in a batch (written into in place), as ``self.train_data``.
    """

    roots: Mapping[str, Any] = field(default_factory=dict)
    functions: tuple[Callable, ...] = ()
    namespaces: Callable[[], Iterable[tuple[str, Mapping[str, Any]]]] = tuple
    parameters: Callable[[], Iterable[torch.Tensor]] = tuple
    rerun: Callable[[Any], set[str] | None] | None = None
    optimized: Callable[[], Iterable[torch.Tensor] | None] = lambda: None
    data: list | tuple | None = None

    @classmethod
    def of_trainer(cls, trainer: Any, model: Any, training_step: Callable, optimizers: Mapping) -> Scope:
        """A Trainer's: ``self`` and ``self.model``, ``training_step``, and the parameters its optimizers hold, listed
        once per fit (a parameter ``add_param_group`` adds later may hold gradients nothing cleared)."""
        trained = list({id(p): p for opt in optimizers.values() for g in opt.param_groups
                        for p in g["params"]}.values())
        data = trainer.train_data if isinstance(trainer.train_data, (list, tuple)) else None
        return cls(roots={"self": trainer, "self.model": model}, functions=(training_step,), parameters=lambda: trained,
                   data=data)

    def named_roots(self) -> list[tuple[str, Any]]:
        """The roots, each named by the first variable of the namespaces that holds it, as the loop's code names it
        (``net.memory`` for ``GraphGuard(net)``, not ``model.memory``), else by its own name."""
        spaces = [space for _, space in self.namespaces()]
        return [(next((key for space in spaces for key, val in list(space.items())
                       if root is not None and val is root and not key.startswith("__")), name), root)
                for name, root in self.roots.items()]


class Item(str):
    """A holder's name that is an item of a tuple (an LSTM's ``(h, c)``, or a namedtuple): ``tuple_of`` names the
    tuple, which a fix must replace as a whole. ``whole``: where that tuple (or list) is itself inside a tuple, which
    cannot be assigned to (a Neural Turing Machine's ``(reads, (h, c), head_weights)``), the outermost such tuple's
    name, and ``rebuilt`` the code that makes it again with every tensor detached (``{0}`` standing for that name).
    ``in_list``: where the tuple is an element of a list, through tuples only (an actor-critic's ``saved_actions``
    of (log-prob, value) pairs), that list's name."""

    tuple_of: str
    whole: str | None = None
    rebuilt: str = "{0}"
    in_list: str | None = None


class Element(str):
    """A holder's name that is an element of a list (``losses[0]``): ``list_of`` names the list, where a fix
    detaches what is added, since the next element would hold the next step's graph; ``filled_by`` names the object
    of an installed library whose own code adds to it (torchmetrics' ``auroc``, whose ``update`` appends to
    ``auroc.preds``): there the fix detaches what is handed to it. ``whole`` and ``rebuilt``: as ``Item``'s."""

    list_of: str
    filled_by: str | None = None
    whole: str | None = None
    rebuilt: str = "{0}"


class Entry(str):
    """A holder's name that is a value of a dict whose values are all tensors (a memory network's state
    ``mhx['memory']`` beside ``mhx['usage']``): ``whole`` names the dict, whose values a fix detaches all at once, in
    place (another name may hold the same dict: kornia's ``params`` replaying an augmentation's ``_params``)."""

    whole: str


class Inside(str):
    """A holder's name that is a tensor deep inside an object a variable holds (``dist.loc`` of a torch.distributions
    object built from the model's output, ``dist.transform.transforms[0].base.shift`` of zuko's): ``owner`` names that
    variable, which a fix builds again (the tensor is made when the object is built)."""

    owner: str


def code_of(holder: str | None) -> str | None:
    """The expression a holder names, for a fix: "global y" -> "y"; None for "an unnamed tensor"."""
    if isinstance(holder, Inside):  # the variable holding the object that holds it: built again whole
        return code_of(holder.owner)
    return holder.split(" ", 1)[-1] if holder and not holder.startswith(("a ", "an ")) else None


def key_text(key: Any) -> str:
    """A mapping's key as a holder's name writes it: its repr, but a tensor as its shape (a cache keyed by the step's
    tensors, DeepXDE's ``dde.grad`` Jacobians keyed by (output, input)): its values would fill the message, and
    differ from step to step, so that the same holder would look new every step (see ``leaks.Leaks.key``)."""
    if issubclass(type(key), torch.Tensor):
        return f"<tensor of shape {list(key.shape)}>"
    if type(key) is tuple:
        return "(" + ", ".join(key_text(k) for k in key) + ("," if len(key) == 1 else "") + ")"
    return repr(key)


def _items(obj: Any, prefix: str, depth: int = 2, outer: tuple[str, tuple] | None = None,
           listed: str | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) pairs inside ``obj``: attributes, mapping values, list items. ``outer``: the name and value of
    the outermost tuple that ``obj`` is inside through tuples only (see ``Item.whole``); ``listed``: the name of the
    list that ``obj`` is an element of through tuples only (see ``Item.in_list``)."""
    if isinstance(obj, torch.Tensor):
        yield prefix, obj
    elif depth <= 0:
        return
    elif isinstance(obj, Mapping):
        whole = type(obj) is dict and len(obj) > 1 and all(isinstance(val, torch.Tensor) for val in obj.values())
        for key, val in list(obj.items()):
            if whole:
                held = Entry(f"{prefix}[{key_text(key)}]")
                held.whole = prefix
                yield held, val
            else:
                yield from _items(val, f"{prefix}[{key_text(key)}]", depth - 1)
    elif isinstance(obj, (list, tuple)):
        tupled = isinstance(obj, tuple)  # a namedtuple too
        for i, val in enumerate(obj):
            if isinstance(val, torch.Tensor):
                if tupled:
                    held = Item(f"{prefix}[{i}]")
                    held.tuple_of, held.in_list = prefix, listed
                else:
                    held = Element(f"{prefix}[{i}]")
                    held.list_of = prefix
                # a namedtuple is made again by its own class (`tuple(...)` would lose its fields' names)
                top = outer or ((prefix, obj) if tupled and type(obj) is not tuple else None)
                if top is not None:
                    held.whole, held.rebuilt = top[0], _rebuilt(top[1])
                yield held, val
            else:
                inside = (outer or (prefix, obj)) if tupled else None
                yield from _items(val, f"{prefix}[{i}]", depth - 1, inside, listed if tupled else prefix)


def _rebuilt(obj: Any, name: str = "{0}") -> str:
    """Code that makes ``obj`` (named ``name``) again with every tensor in its tuples and lists detached."""
    if isinstance(obj, torch.Tensor):
        return f"{name}.detach()"
    named = isinstance(obj, tuple) and type(obj) is not tuple  # a namedtuple
    if not named and type(obj) not in (tuple, list):
        return name
    if obj and all(isinstance(val, torch.Tensor) for val in obj):
        each = f"t.detach() for t in {name}"
        return f"type({name})(*({each}))" if named else f"tuple({each})" if type(obj) is tuple else f"[{each}]"
    parts = ", ".join(_rebuilt(val, f"{name}[{i}]") for i, val in enumerate(obj))
    if named:
        return f"type({name})({parts})"
    return f"({parts}{',' * (len(obj) == 1)})" if type(obj) is tuple else f"[{parts}]"


_MODULE_STATE = frozenset(vars(torch.nn.Module()))  # what every module keeps: its parameters, buffers, hooks...


def _attributes(obj: Any, prefix: str, roots: set[int] = frozenset(),
                depth: int = 2) -> Iterator[tuple[str, torch.Tensor]]:
    if isinstance(obj, torch.nn.Module):  # plain attributes, then submodules' (not parameters)
        for mod_name, mod in obj.named_modules():
            base = _module_path(prefix, mod_name)
            for key, val in vars(mod).items():
                served = _served(mod, val) if key.startswith("_") and type(val) is dict else ()
                for name in served:  # named as the module serves it: spikingjelly's `lif.v`, not `lif._memories['v']`
                    yield from _filled(_items(val[name], f"{base}.{name}"), mod, base)
                # a layer's own private cache too (PyG's `conv._cached_edge_index`)
                if key not in _MODULE_STATE and not served:
                    yield from _filled(_items(val, f"{base}.{key}"), mod, base)
            for key, val in mod.named_buffers(recurse=False):
                yield f"{base}.{key}", val
            for key, val in mod.named_parameters(recurse=False):
                if val.grad_fn is not None:  # a parameter's slot set to a computed tensor (gdtuo's updated weights)
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
        yield from _filled(_items(val, f"{prefix}.{key}"), obj, prefix)
        if isinstance(val, torch.nn.Module) and id(val) not in roots:  # a root is searched under its own name
            yield from _attributes(val, f"{prefix}.{key}")
        elif depth > 1 and not key.startswith("_") and _own_object(val) and hasattr(val, "__dict__"):
            yield from _attributes(val, f"{prefix}.{key}", roots, depth - 1)  # ignite's `engine.state.hidden`
        elif depth > 1 and not key.startswith("_") and type(val) in (list, tuple):  # mmengine's `runner.hooks[3].x`
            for i, item in enumerate(val):
                if _own_object(item) and hasattr(item, "__dict__"):
                    yield from _attributes(item, f"{prefix}.{key}[{i}]", roots, depth - 1)


def _served(module: torch.nn.Module, private: dict) -> list[str]:
    """The keys of a module's private dict that its ``__getattr__`` serves as attributes (spikingjelly's
    ``MemoryModule`` keeps its neurons' states in ``_memories``: ``lif.v``), when all of them are."""
    if type(module).__getattr__ is torch.nn.Module.__getattr__ or not private:
        return []
    served = []
    for key, val in private.items():
        if not (isinstance(key, str) and key.isidentifier()) or key in vars(module) or hasattr(type(module), key):
            return []
        try:
            if getattr(module, key) is not val:
                return []
        except Exception:  # noqa: BLE001 (a __getattr__ of any kind)
            return []
        served.append(key)
    return served


def _module_path(prefix: str, name: str) -> str:
    """A submodule's name as Python spells it, so that a fix applies as written: ``model.blocks[0].rot``, not
    ``model.blocks.0.rot``; a compiled module's (``torch.compile(m)``) as its attributes read through it: ``model.h``,
    not ``model._orig_mod.h``."""
    return prefix + "".join(f"[{part}]" if part.isdigit() else f".{part}" for part in name.split(".")
                            if part and part != "_orig_mod")


_INSTALLED = tuple({sysconfig.get_paths()[kind] for kind in ("purelib", "platlib")})  # where pip puts packages


def _filled(pairs: Iterator[tuple[str, torch.Tensor]], owner: Any, name: str) -> Iterator[tuple[str, torch.Tensor]]:
    """``pairs`` of ``owner``'s attributes (``_items``'), their list elements marked ``filled_by`` ``name`` where
    ``owner``'s class is an installed package's (not the script's nor the user's own package)."""
    for item, tensor in pairs:
        if isinstance(item, Element) and _installed(owner):
            item.filled_by = name
        yield item, tensor


def _installed(obj: Any) -> bool:
    """Whether ``obj``'s class comes from an installed package."""
    return (getattr(sys.modules.get(type(obj).__module__), "__file__", None) or "").startswith(_INSTALLED)


def held_lists(namespaces: Iterable[tuple[str, Mapping[str, Any]]]) -> Iterator[tuple[Element, list]]:
    """The lists the variables of ``namespaces`` ((prefix, variables) pairs) hold, and those that the objects of a
    class of their own they hold keep as attributes (a hand-written trainer's ``self.val_outputs``, a metric's
    ``auroc.preds``): (the name of the list's first element, the list)."""
    for prefix, space in namespaces:
        for key, val in list(space.items()):
            if type(val) is list:
                lists = [(f"{prefix} {key}", val, None)]
            elif _own_object(val) and type(getattr(val, "__dict__", None)) is dict:  # named as ``candidates`` does
                owner = key if _installed(val) else None
                lists = [(f"{key}.{attr}", held, owner) for attr, held in list(vars(val).items())
                         if type(held) is list]
            else:
                continue
            for name, held, owner in lists:
                first = Element(f"{name}[0]")
                first.list_of, first.filled_by = name, owner
                yield first, held


def _own_object(obj: Any) -> bool:
    """An instance of a class of the script's or a training library's own (fastai's ``SmoothenValue`` keeping a
    moving average), not of Python's, torch's, NumPy's or safeloop's, nor a dataset or a loader: its attributes are
    searched."""
    kind = type(obj)
    return not isinstance(obj, (type, types.ModuleType, types.FunctionType, types.MethodType,
                                torch.utils.data.Dataset, torch.utils.data.DataLoader)) \
        and kind.__module__.split(".")[0] not in ("builtins", "torch", "numpy", "safeloop", "collections", "typing")


# how far ``_within`` looks into the objects the variables hold: levels of attributes and items, objects in all
_DEEP, _DEEP_OBJECTS = 6, 500


def _within(owners: list[tuple[str, Any]], budget: list[int]) -> Iterator[tuple[Inside, torch.Tensor]]:
    """(name, tensor) pairs deeper inside the objects ``owners`` (name, value) hold than ``candidates`` looks: a
    torch.distributions object (its transforms too) or an object of the script's or a library's own class, through
    their attributes, dicts, lists and tuples (not a module's: ``candidates`` searches those). Bounded: ``_DEEP``
    levels, ``budget[0]`` objects."""
    seen: set[int] = set()
    # and the objects the submodules of a module keep (a distribution kornia's augmentation keeps as its sampler)
    owners = [*owners, *((f"{_module_path(owner, name)}.{key}", attr) for owner, val in owners
                         if issubclass(type(val), torch.nn.Module) for name, mod in val.named_modules()
                         for key, attr in vars(mod).items() if key not in _MODULE_STATE)]
    for owner, val in owners:
        if not owner.startswith("__") and _nested_object(val):
            for path, tensor in _nested(val, owner, _DEEP, budget, seen):
                inside = Inside(path)
                inside.owner = owner
                yield inside, tensor


def _nested_object(obj: Any) -> bool:
    """A distribution, a distribution's transform or an object of the script's or a library's own class (not a
    module)."""
    kind = type(obj)
    return issubclass(kind, (torch.distributions.Distribution, torch.distributions.Transform)) \
        or (_own_object(obj) and not issubclass(kind, torch.nn.Module))


def _nested(obj: Any, prefix: str, depth: int, budget: list[int],
            seen: set[int]) -> Iterator[tuple[str, torch.Tensor]]:
    """The tensors in ``obj`` (see ``_within``), by name."""
    kind = type(obj)  # by type: see find_holder
    if issubclass(kind, torch.Tensor):
        yield prefix, obj
        return
    if depth <= 0 or budget[0] <= 0 or id(obj) in seen:
        return
    if issubclass(kind, dict):  # a defaultdict too (a metric logger's meters); the first 64 items: a data set
        # kept as a list is no holder's place
        pairs = [(f"{prefix}[{key_text(key)}]", val) for key, val in list(islice(obj.items(), 64))]
    elif kind in (list, tuple):
        pairs = [(f"{prefix}[{i}]", val) for i, val in enumerate(obj[:64])]
    elif _nested_object(obj):
        pairs = [(f"{prefix}.{key}", val) for key, val in fields(obj).items() if not key.startswith("__")]
    else:
        return
    budget[0] -= 1
    seen.add(id(obj))
    for name, val in pairs:
        yield from _nested(val, name, depth - 1, budget, seen)


def candidates(scope: Scope | None = None, batch: Any = None,
               deep: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) pairs the scope holds, in the order of the module docstring. ``deep`` (``find_holder``'s, on
    the error path alone): also those deeper inside the objects of the roots' attributes and of each namespace's
    variables (``_within``), after that namespace's own: a torch.distributions object a script's variable holds is
    named before a library's ``self`` running below it."""
    budget = [_DEEP_OBJECTS]
    if scope is not None:
        roots, named = {id(root) for root in scope.roots.values()}, scope.named_roots()
        for name, root in named:
            if root is not None:
                yield from _attributes(root, name, roots)
        if deep:
            yield from _within([(f"{name}.{key}", val) for name, root in named for key, val in fields(root).items()],
                               budget)
        for prefix, space in scope.namespaces():
            for key, val in list(space.items()):
                if key.startswith("__"):
                    continue
                yield from _items(val, f"{prefix} {key}")
                searched = isinstance(val, torch.nn.Module) or key == "self" or _own_object(val)
                if searched and id(val) not in roots and hasattr(val, "__dict__"):
                    yield from _attributes(val, key, roots)
            if deep:
                yield from _within(list(space.items()), budget)
        for fn in scope.functions:
            code = getattr(fn, "__code__", None)
            if code is None:
                continue
            names = set(code.co_names)
            for key, val in fn.__globals__.items():
                if key in names:
                    yield from _items(val, f"global {key}")
            for key, cell in zip(code.co_freevars, fn.__closure__ or ()):
                with suppress(ValueError):  # an empty cell
                    yield from _items(cell.cell_contents, f"closure {key}")
    if batch is not None:
        yield from _items(batch, "batch", depth=3)


def find_holder(node, scope: Scope | None = None, batch: Any = None, scan_gc: bool = True,
                loss: torch.Tensor | None = None, new_loss: bool = False, fresh: Collection[str] = (),
                start: int | None = None, remade: Callable[[], Collection[str]] | None = None) -> str | None:
    """Name of a tensor whose ``grad_fn`` is ``node``, or whose graph reaches it. Of those: the nearest, then the
    first of the shape ``node`` made, as a state carried from step to step keeps its shape (`h` rather than the
    `out` of ``out, h = rnn(x, h)``). With ``start`` (the node counter at the running step's start): the nearest of
    those held since before the step; when this step made every one of them and none straight from ``node``, the
    latest of the shape ``node`` made (if any): the value of a state that the next step reads (a Neural Turing
    Machine's ``memory``, written by every forward, rather than its ``prev_mem``, which each write sets to the last
    ``memory``). A local variable holding ``loss`` (a plain loop's ``loss = ...``, made in the step) does not count,
    nor, with ``new_loss``, any variable holding it, nor the tensors in the variables named in ``fresh`` (``outs``
    of ``local outs[0]``). Deeper inside the objects the variables hold (``candidates``' ``deep``: a
    torch.distributions object built before the loop), one made by ``node`` counts in the order searched, one
    reaching it only if no nearer name does; the fix builds that object again. A dict's entry made by ``node`` gives
    way to a variable holding the same tensor. Of the latest: not a variable named by ``remade()``, that the loop
    sets before it reads it (`z_q = quantize(z)`, made from the state `z`): the next step does not read it."""
    near, deep, entry = [], [], None
    for name, tensor in candidates(scope, batch, deep=True):
        if entry is not None:  # a variable holding the very tensor a dict's entry holds is what the code reads
            if tensor is entry[1] and re.fullmatch(r"(local|global) \w+", name):
                return name
            continue
        fn = tensor.grad_fn
        if fn is None or (tensor is loss and (new_loss or name.startswith("local "))) or _variable(name) in fresh:
            continue
        if fn is node and type(name) in (str, Entry) and name.endswith("]"):
            # SentenceTransformer's forward stores its output in the dict of features it is handed:
            # `emb = model(features)['sentence_embedding']` leaves it in `features` too
            entry = name, tensor
        elif fn is node:
            return start is not None and _written_again(name, tensor, scope, batch, start) or name
        if reachable(fn, node, limit=2_000):
            (deep if isinstance(name, Inside) else near).append((name, tensor))
    if entry is not None:
        return entry[0]
    # an earlier write into a tensor's slots, held by the tensor written again since (temporal ensembling's
    # `outputs[i * bs:(i + 1) * bs] = out` every step, read by the targets made from it): the tensor keeping the
    # graphs, not a value made from it
    written = next((name for name, t in near if _writes_over(t.grad_fn, node)), None)
    if written is not None:
        return written
    near = near or deep
    if near:
        made = [tuple(m.shape) for m in getattr(node, "_input_metadata", ())[:1]]  # the shape of what node made
        kept = [(name, t) for name, t in near if start is None or sequence_nr(t.grad_fn) < start]
        # (not a variable reaching it only through holders of another shape: an output made from a cache that the
        # forward extends, `out` from `cache.key_cache[0]`, holds the node through the cache)
        other = [t for _, t in near if [tuple(t.shape)] != made]
        alike = [(name, t) for name, t in near if [tuple(t.shape)] == made and not (
            other and re.fullmatch(r"(local|global|closure) \w+", name) and _through(t, node, other))]
        if not kept and alike and not any(nxt is node for _, t in near for nxt, _ in t.grad_fn.next_functions):
            # every holder made in this step, none straight from the node (as `y0 = pred_y[-1]`, taken after the
            # update, is): a state the step wrote again holds the node as the latest value of its shape, the one the
            # next step reads (NTM's `memory` written by each forward, `prev_mem` set to the last `memory`)
            fresh_names = remade() if remade is not None else ()
            alike = [(name, t) for name, t in alike if not (re.fullmatch(r"(local|global) \w+", name)
                                                            and _variable(name) in fresh_names)] or alike
            return next((name for name, t in alike if not any(_made_from(o, t) for _, o in alike)), alike[0][0])
        # a tensor made from another that reaches ``node`` holds it through that one: ``pred`` of this step, made
        # from ``y0 = pred[-1]`` kept from the last step, holds that step's ``pred`` through ``y0``
        kept = kept or near
        nearest = [(name, t) for name, t in kept if not any(_made_from(t, other) for _, other in kept)]
        near = [(name, tuple(t.shape)) for name, t in nearest or kept]
        return next((name for name, shape in near if [shape] == made), near[0][0])
    if scan_gc:
        # by type only: isinstance looks an object's __class__ up, which some deprecated objects answer with a
        # warning (and silencing warnings would show the program's own ones again: see fields)
        for obj in gc.get_objects():
            if issubclass(type(obj), torch.Tensor) and obj.grad_fn is node:
                return "an unnamed tensor (found by the garbage collector)"  # starts with "a": no code
    return None


def _writes_over(fn, node) -> bool:
    """Whether ``fn`` is a chain of writes into a tensor (into its slots, or over it whole with ``copy_``: StyleGAN2-
    ADA's `self.pl_mean.copy_(pl_mean)`) down to ``node``, an earlier write into it."""
    while fn is not node and type(fn).__name__ in walk.WRITES and type(node).__name__ in walk.WRITES:
        fn = fn.next_functions[0][0]
    return fn is node and type(node).__name__ in walk.WRITES


def _written_again(name: str, tensor: torch.Tensor, scope: Scope | None, batch: Any, start: int) -> str | None:
    """The attribute beside ``name`` (of the same object) that this step made straight from ``tensor``, of its
    shape: an object keeping a state's last value next to its current one (a Neural Turing Machine's memory written
    once a step: ``self.prev_mem = self.memory``, then ``self.memory = f(self.prev_mem)``). The current value is the
    one the next step reads; detaching the last one would not help, as the next write sets it again."""
    owner = name.rpartition(".")[0]
    if type(name) is not str or not owner:
        return None
    return next((other for other, t in candidates(scope, batch) if type(other) is str and t.grad_fn is not None
                 and other.rpartition(".")[0] == owner and t.shape == tensor.shape
                 and sequence_nr(t.grad_fn) >= start and _made_from(t, tensor)), None)


def data_items(scope: Scope) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) pairs of the scope's ``data`` (a Trainer's list of batches), named from ``self.train_data``."""
    return _items(scope.data, "self.train_data", depth=3) if scope.data is not None else iter(())


def _variable(name: str) -> str:
    """The variable a holder's name starts from: `outs` of `local outs[0]`, and of `outs[0].x` inside an object."""
    return re.match(r"(?:(?:local|global|closure) )?(\w*)", name.owner if isinstance(name, Inside) else name).group(1)


def _through(tensor: torch.Tensor, node, others: list[torch.Tensor], limit: int = 2_000) -> bool:
    """Whether ``tensor``'s graph reaches ``node`` only through the graphs of ``others``."""
    stops = {o.grad_fn for o in others if o.grad_fn is not tensor.grad_fn}
    return not any(n is node for n in islice(walk.iter_nodes(tensor.grad_fn, stop=lambda n: n in stops), limit))


def _made_from(tensor: torch.Tensor, other: torch.Tensor, limit: int = 2_000) -> bool:
    """Whether ``other``'s value went into ``tensor``: ``tensor``'s graph reaches ``other``'s output of its grad_fn,
    not only another output of that node (``h`` and ``out`` of one LSTM call are made side by side)."""
    fn, nr = other.grad_fn, other.output_nr
    nodes = islice(walk.iter_nodes(tensor.grad_fn), limit)
    return fn is not tensor.grad_fn and any(nxt is fn and i == nr for node in nodes for nxt, i in node.next_functions)


def replaced_holder(node, scope: Scope | None = None, batch: Any = None) -> str | None:
    """The name of an attribute (``self.prev``) holding a tensor made as ``node`` was, by the same operation from the
    same leaves, and not from ``node``: this step's value of a state kept from step to step, stored in place of the
    last one after the loss read it (transformers' ``compute_loss`` overridden to keep ``self.prev_hidden``). Only
    attributes: a local variable of the same making is a value of this step, not a place kept across steps."""
    leaves = {id(v) for v in walk.below(node)[1]}
    if not leaves:
        return None
    for name, tensor in candidates(scope, batch):
        fn = tensor.grad_fn
        if "." in name and fn is not None and fn is not node and type(fn) is type(node) \
                and {id(v) for v in walk.below(fn)[1]} == leaves and not reachable(fn, node, limit=2_000):
            return name
    return None


def sole_holder(node, scope: Scope | None) -> str | None:
    """The variable of the first running function (the script's first) that holds a tensor whose graph reaches
    ``node``, if it is the only one there; None for none or several (a fix naming one of several names may name the
    wrong one: ``pred``, ``kept`` and ``stale_pred`` all one tensor)."""
    for prefix, space in scope.namespaces() if scope is not None else ():
        names = [f"{prefix} {key}" for key, val in list(space.items())
                 if isinstance(val, torch.Tensor) and val.grad_fn is not None
                 and (val.grad_fn is node or reachable(val.grad_fn, node, limit=2_000))]
        if names:
            return names[0] if len(names) == 1 else None
    return None


def holds(node, scope: Scope | None = None, batch: Any = None) -> bool:
    """Whether a tensor the scope can name was made by ``node`` itself."""
    return any(tensor.grad_fn is node for _, tensor in candidates(scope, batch))


def remade_attribute(node, scope: Scope | None) -> str | None:
    """The name of a module's tensor attribute (not a parameter or buffer) that each forward makes again (a forward
    pre-hook sets it: ``torch.nn.utils.prune``, the old ``weight_norm``) and whose value now is made as ``node``
    was, by the same operation from the same leaves, not from ``node`` (a state carried from forward to forward,
    ``self.memory = f(x, self.memory)``, is made from its last value): ``node`` is an earlier forward's value of it,
    read before this step's forward made the new one. None when there is none."""
    leaves = {id(v) for v in walk.below(node)[1]}
    if not leaves:
        return None
    for name, root in _modules(scope):
        for mod_name, mod in root.named_modules():
            for key, val in vars(mod).items():
                fn = val.grad_fn if issubclass(type(val), torch.Tensor) else None  # by type: see find_holder
                if fn is not None and fn is not node and type(fn) is type(node) \
                        and {id(v) for v in walk.below(fn)[1]} == leaves and not reachable(fn, node, limit=2_000):
                    return f"{name}.{mod_name}.{key}" if mod_name else f"{name}.{key}"
    return None


def view_of(node, leaves: list, scope: Scope | None = None, batch: Any = None) -> bool:
    """Whether the tensor ``node`` made, held in ``scope``, is a view of one of ``leaves`` (``weight.t()``): its
    values are theirs, whatever updates them."""
    bases = {id(leaf) for leaf in leaves}
    return any(t.grad_fn is node and t._is_view() and id(t._base) in bases for _, t in candidates(scope, batch))


def holds_as_made(node, holder: str | None, scope: Scope | None = None, batch: Any = None) -> bool:
    """Whether ``holder`` (a name ``find_holder`` gave) holds the very tensor that ``node`` made: a value kept as it
    was (a cache), not one made again from it every step. An RNN's state is made again: ``out, h = rnn(x, h)``
    holds the new value, whose graph reaches the old; ``out, h_new = rnn(x, h)`` with ``h = h_new`` written after
    backward still holds the old, but a new value of its shape, ``h_new``, reaches it (a state is never a scalar:
    the step's loss, made from a cached scalar, is no new value of it). A new value is made as the old one was, by a
    node of its type: not a value the step only computes from it (PPO's ratio `exp(new_logprobs - old_logprobs)`, a
    rollout's `kl = logprobs - ref_logprobs`, alike in shape to the old log-probabilities)."""
    if holder is None:
        return False
    found = list(candidates(scope, batch, deep=True))  # (as find_holder searched)
    held = next((t for name, t in found if name == holder and t.grad_fn is node), None)
    return held is not None and not any(
        held.dim() > 0 and t.shape == held.shape and type(t.grad_fn) is type(node) and t.grad_fn is not node
        and any(n is node for n in walk.iter_nodes(t.grad_fn)) for _, t in found)


def _modules(scope: Scope | None) -> list[tuple[str, torch.nn.Module]]:
    """The modules of the scope by name: its roots, those in its variables, and those the attributes of a variable's
    own object hold (yolov5's ``ModelEMA``, a plain object, keeps the EMA model as ``ema.ema``)."""
    if scope is None:
        return []
    roots = scope.named_roots()
    held = [(key, val) for _, space in scope.namespaces() for key, val in list(space.items())]
    found = roots + held + [(f"{key}.{name}", sub) for key, val in held if not key.startswith("__")
                            and not issubclass(type(val), torch.nn.Module) and _own_object(val)
                            for name, sub in fields(val).items() if not name.startswith("_")]
    found += [(f"{name}.{key}", val) for name, root in roots for key, val in fields(root).items()
              if not key.startswith("_")]  # a Trainer's other modules (self.critic)
    return [(name, getattr(mod, "_orig_mod", mod)) for name, mod in found  # a compiled module: named through it
            if issubclass(type(mod), torch.nn.Module)]  # by type: see find_holder


def _parameters_of(name: str, module: torch.nn.Module, listed: bool = False) -> Iterator[tuple[str, Any, bool]]:
    """(name, parameter, whether a plain list or dict keeps its layer) of a module, and of the layers its attributes
    keep in plain lists and dicts (which ``named_parameters`` misses: they are not registered)."""
    yield from ((f"{name}.{key}", p, listed) for key, p in module.named_parameters())
    for mod_name, mod in module.named_modules():
        base = f"{name}.{mod_name}" if mod_name else name
        for key, val in vars(mod).items():
            items = val.items() if type(val) is dict else enumerate(val) if type(val) in (list, tuple) else ()
            for i, sub in items:
                if not key.startswith("_") and issubclass(type(sub), torch.nn.Module):
                    yield from _parameters_of(f"{base}.{key}[{i!r}]", sub, True)


def parameter_names(scope: Scope | None) -> dict[int, tuple[str, bool]]:
    """id -> (name, whether a plain list or dict keeps its layer) of every parameter of the scope's modules."""
    names: dict[int, tuple[str, bool]] = {}
    for root_name, root in _modules(scope):
        for name, param, listed in _parameters_of(root_name, root):
            names.setdefault(id(param), (name, listed))
    return names


def written_parameters(scope: Scope | None) -> list[tuple[str, torch.nn.Parameter]]:
    """(name, parameter) of the scope's modules' parameters that hold a graph. A ``Parameter`` is made a leaf; it gets
    a ``grad_fn`` only when written in place, outside ``torch.no_grad()``, from tensors that require grad (an EMA
    copy's `ema_p.mul_(d).add_(p, alpha=1 - d)`, its parameters frozen): then each write adds to that graph. The fast
    weights of a cloned module (learn2learn's) are tensors, not ``Parameter``s: not these."""
    found: dict[int, tuple[str, torch.nn.Parameter]] = {}
    for root_name, root in _modules(scope):
        for name, param in root.named_parameters():
            if param.grad_fn is not None and issubclass(type(param), torch.nn.Parameter):
                found.setdefault(id(param), (f"{root_name}.{name}", param))
    return list(found.values())


def aliases(scope: Scope | None, params: list[torch.Tensor]) -> list[str]:
    """The variables of a namespace that hold one module holding some of ``params``, in the order the namespace made
    them (``student``, then ``teacher = student``): a copy meant (a teacher, a target network) that is the module
    itself, so that freezing it froze the trained one. Empty when no such module is held twice."""
    if scope is None:
        return []
    wanted = {id(p) for p in params}
    for _, space in scope.namespaces():
        held: dict[int, list[str]] = {}
        for key, val in list(space.items()):
            if not key.startswith("__") and isinstance(val, torch.nn.Module):
                held.setdefault(id(val), []).append(key)
        for keys in held.values():
            if len(keys) > 1 and any(id(p) in wanted for p in space[keys[0]].parameters()):
                return keys
    return []


def graph_buffers(scope: Scope | None) -> dict[int, str]:
    """id -> name of the buffers registered on the scope's modules that hold a graph (a running statistic, an EMA
    codebook, written in forward outside ``torch.no_grad()``)."""
    found: dict[int, str] = {}
    for root_name, root in _modules(scope):
        for name, buf in root.named_buffers():
            if buf.grad_fn is not None:
                found.setdefault(id(buf), f"{root_name}.{name}")
    return found


def optimizers(scope: Scope | None) -> list[torch.optim.Optimizer]:
    """The optimizers the scope's roots and variables hold, directly, in a dict or list, or as an attribute of an
    object they hold (``trainer.opt_d``)."""
    if scope is None:
        return []
    values = list(scope.roots.values()) + [v for _, space in scope.namespaces() for v in list(space.values())]
    values += [a for v in values for a in fields(v).values()]
    values += [i for v in values for i in (v.values() if type(v) is dict else v if type(v) in (list, tuple) else ())]
    return list({id(v): v for v in values if issubclass(type(v), torch.optim.Optimizer)}.values())


def fields(obj) -> dict:
    """``vars(obj)`` of an object that is neither a tensor nor a Python module, else {}. Looked at through types only:
    an object's own attribute lookup (which ``isinstance`` calls) can warn (`torch.distributed.reduce_op` does,
    an attribute of the `dist` a script imports), and silencing it would show the script's own warnings a
    second time (changing the warning filters resets their once-only registry)."""
    if issubclass(type(obj), (torch.Tensor, type(os))):
        return {}
    try:
        own = object.__getattribute__(obj, "__dict__")
    except (AttributeError, TypeError):
        return {}
    return dict(own) if type(own) is dict else {}


def leaf_names(leaves, scope: Scope | None = None, most: int = 3, batch: Any = None) -> str:
    """How to name leaf tensors in a message: the parameters' names where a root module has them, or a module
    in the scope's variables (``self.layer.weight`` in a LightningModule's hook; ``model.layers[0].weight`` for a
    layer kept in a plain list), else the variable that holds the tensor (``local fast[0]``), else a parameter of
    the same shape (of which it may be a copy)."""
    found = parameter_names(scope)
    names = {key: f"`{name}`" for key, (name, _) in found.items()}
    shown = leaves[:most]
    if any(id(t) not in names for t in shown):
        wanted = {id(t) for t in shown}
        for name, tensor in candidates(scope, batch):
            if id(tensor) in wanted:
                names.setdefault(id(tensor), f"`{name}`")
    shapes = {}
    for _, mod in _modules(scope):
        for param in mod.parameters():
            shapes.setdefault(tuple(param.shape), names[id(param)])
    said = [names.get(id(t)) or (f"an unnamed tensor shaped as {shapes[tuple(t.shape)]}" if tuple(t.shape) in shapes
                                 else f"a tensor of shape {list(t.shape)} with requires_grad=True") for t in shown]
    more = f" and {len(leaves) - most} more" if len(leaves) > most else ""
    return ", ".join(said) + more


# the frames of these packages are never the user's line (a user's own directory may be named safeloop: a clone)
_LIBRARIES = tuple(str(Path(package.__file__).parent) + os.sep for package in (torch, safeloop))
_FILE = re.compile(r'File "([^"]*)"')


def traceback_of(node) -> str | None:
    """The line that created ``node``, when anomaly mode (``guard.trace=true``) was on."""
    stack = node.metadata.get("traceback_")
    if not stack:
        return None
    frames = [line for line in stack if not _in_library(line)]
    return (frames or stack)[-1].strip()


def _in_library(frame: str) -> bool:
    found = _FILE.search(frame)
    return found is not None and library_file(found.group(1))


def library_file(filename: str) -> bool:
    """Whether ``filename`` is torch's or safeloop's (never the user's code)."""
    return filename.startswith(_LIBRARIES)


def mark(tensor: torch.Tensor) -> tuple[int, int]:
    """(version counter, address of its data): an in-place write moves the counter; a new tensor assigned to
    ``.data`` (PGD's attack projecting the embedding weight, ``param.data = backup + r``), which the counter does not
    see, moves the address. A write through ``.data`` in place alone (``param.data.add_(r)``) moves neither."""
    try:
        return tensor._version, fsdp.local(tensor).data_ptr()
    except (RuntimeError, TypeError):  # a tensor without storage (functorch, meta): the counter alone
        return tensor._version, 0


def versions(leaves) -> list[tuple[torch.Tensor, tuple[int, int]]]:
    """(tensor, ``mark``) of each AccumulateGrad node in ``leaves``: a write moves the mark."""
    return [(t, mark(t)) for t in (node.variable for node in leaves)]


def through_data(changed: list[torch.Tensor], then: list[tuple[torch.Tensor, tuple[int, int]]]) -> bool:
    """Whether every one of the ``changed`` leaves kept its version since ``then``: written through ``.data``, which
    autograd does not see (a backward through a graph that saved them runs on without a word)."""
    kept = {id(t) for t, (version, _) in then if t._version == version}
    return all(id(t) in kept for t in changed)


def changed(nodes, then: list[tuple[torch.Tensor, tuple[int, int]]], limit: int = 100_000) -> list[torch.Tensor]:
    """The leaves of the graph below ``nodes`` whose ``mark`` moved since ``then`` (``versions``): written in place
    since (SAM's ``p.add_(e_w)``), or given new values through ``.data``, in the order of ``then``."""
    moved = {id(t) for t, version in then if mark(t) != version}
    if not moved:
        return []
    below = {id(n.variable) for n in islice(walk.iter_nodes(*nodes), limit) if type(n) is walk.ACCUMULATE}
    # once each: ``then`` has a leaf once per earlier backward that reached it
    return list({id(t): t for t, _ in then if id(t) in moved and id(t) in below}.values())


def where(frame) -> tuple[str, int] | None:
    """The file and line ``frame`` runs (a plain loop's backward call), None for none."""
    return None if frame is None else (frame.f_code.co_filename, frame.f_lineno)


def at(where: tuple[str, int] | None) -> str:
    """" at train.py:14" for a ``where``, else ""; under watch every loss is 'loss': the line tells them apart."""
    return "" if where is None else f" at {os.path.basename(where[0])}:{where[1]}"


_RESETS = ("reset_mem", "reset_hidden", "reset_state", "reset_states", "reset")  # a stateful layer's own reset
_NETWORK_RESETS = {"snntorch": "snntorch.utils.reset({net})",
                   "spikingjelly": "spikingjelly.activation_based.functional.reset_net({net})"}


def module_at(code: str, scope: Scope | None) -> tuple[str, torch.nn.Module] | None:
    """(the name of the root it is in, the module) of the scope's module that ``code`` names (``net[1]``), or None."""
    for name, root in _modules(scope):
        for mod_name, mod in root.named_modules():
            if _module_path(name, mod_name) == code:
                return name, mod
    return None


def state_reset(module: torch.nn.Module) -> str | None:
    """The name of ``module``'s method that starts its state again, called with no argument (snntorch's
    ``Leaky.reset_mem``, spikingjelly's ``MemoryModule.reset``), or None."""
    for name in _RESETS:
        method = getattr(module, name, None)
        if callable(method) and not isinstance(method, torch.nn.Module):
            with suppress(TypeError, ValueError):
                inspect.signature(method).bind()
                return name
    return None


def network_reset(module: torch.nn.Module, root: str) -> str | None:
    """The call of ``module``'s library that resets every stateful layer of the network ``root`` at once, or None."""
    call = _NETWORK_RESETS.get(type(module).__module__.partition(".")[0])
    return call.format(net=root) if call else None
