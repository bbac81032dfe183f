"""What a training loop made before it began: the graphs that the variables it does not assign hold (``y = t @ a``
above the loop, ``self.x`` of an object whose method runs the loop), read from its code and its frame. The first
step starts after them, under ``watch`` and at a ``GraphGuard``'s first ``with guard.step()`` inside a loop."""
from __future__ import annotations

import dis
import functools
import inspect
import itertools
import types
from collections.abc import Callable, Iterator
from operator import attrgetter

import torch
from torch.distributions.utils import lazy_property

from . import walk
from .bytecode import COMPREHENSIONS, loop_around, stack, stored
from .explain import fields

_LOADS = {"LOAD_NAME", "LOAD_FAST", "LOAD_GLOBAL", "LOAD_DEREF", "LOAD_FAST_CHECK", "LOAD_FAST_AND_CLEAR"}
_READERS = {"zip", "enumerate", "len", "range", "reversed", "iter", "sorted", "list", "tuple", "min", "max"}


def loop_start(frame, filename: str, variables: Callable = attrgetter("f_locals"),
               outside: int | None = None) -> int | None:
    """One past the node counter of the newest graph held, before the loop running ``frame`` (or a
    caller's loop in ``filename``, outside any module's forward and not inside one update; the outermost loop of
    that function) began, by a variable that the loop
    does not assign (or an attribute, assigned neither in the loop nor by a method of its object other than
    ``__init__``, of an object such a variable holds); None if none; ``outside`` if no loop of ``filename``
    runs ``frame``. ``variables``: reads a frame's variables (``GraphGuard.variables``)."""
    if not walk.HAS_SEQ:
        return None
    frames = list(stack(frame))
    module = next((f.f_code for f in frames if f.f_code.co_filename == filename and f.f_code.co_name == "<module>"),
                  None)
    found = _training_loop(frames, filename, variables)
    forwards = _forwards(frames)
    if found is None and outside is None:
        found = _library_call(frames, filename, forwards[-1] if forwards else -1)
    del frames
    if found is None:
        return outside
    frame, offsets = found
    body = [i for i in dis.get_instructions(frame.f_code) if i.offset in offsets]
    assigned = {name for i in body for name in stored(i)}
    attributes = {i.argval for i in body if i.opname == "STORE_ATTR"}  # `self.h = ...` in the loop
    # and in the functions the loop defines, which it runs (an L-BFGS closure's `stats.loss = loss`)
    attributes.update(i.argval for made in body if made.opname == "LOAD_CONST" and hasattr(made.argval, "co_code")
                      for code in _codes(made.argval) for i in dis.get_instructions(code) if i.opname == "STORE_ATTR")
    # `global y` / `nonlocal y` assigned anywhere else (the loop's own function stores a variable a closure reads,
    # `prompt` of `lambda x: model(x + prompt)`, as STORE_DEREF: outside the loop, that is before it)
    for code in _codes(module) if module is not None else ():
        assigned.update(i.argval for i in dis.get_instructions(code) if code is not frame.f_code
                        and i.opname in ("STORE_GLOBAL", "STORE_DEREF", "DELETE_GLOBAL", "DELETE_DEREF"))
    values = list(variables(frame).items())
    # (not a tensor the loop writes into in place, `outputs[i * bs:(i + 1) * bs] = out` of temporal ensembling: its
    # graph may be this step's, as a buffer's in ``_state``)
    written = _written_into(body)
    held = [v for k, v in values if k not in assigned
            and not (issubclass(type(v), torch.Tensor) and v._version and k in written)]
    # and the tensors of the objects those variables hold (`self.x` of a model class whose method runs the loop; of
    # a module's submodules too: `model[0].scaled`), but not those the loop, the object's own methods or a forward
    # hook assign (spectral_norm's `weight`, made anew by a hook before each forward)
    # nor those of a module that a module holding it sets by name (`setattr(self.module, name, w)` in a method: the
    # weight dropout of AWD-LSTM's WeightDrop, made anew by every forward)
    models = [v for v in held if issubclass(type(v), torch.nn.Module)]
    renamed = {id(m) for v in models for wrapper in v.modules() if _calls_setattr(wrapper) for m in wrapper.modules()}
    objects = held + [m for v in models for m in list(v.modules())[1:]
                      if not (m._forward_pre_hooks or m._forward_hooks)]
    held += [a for o in objects if id(o) not in renamed
             for k, a in _state(o).items() if k not in attributes and k not in _set_by_methods(o)]
    # and those deeper inside a torch.distributions object held so (zuko's `dist = flow(c)`: the graph of each of its
    # transforms, `dist.transform.transforms[0].base.shift`), which the loop's `dist.log_prob(x)` reads every step
    budget = [_DIST_OBJECTS]
    held += [t for v in held if issubclass(type(v), torch.distributions.Distribution)
             for t in _inside_distribution(v, _DIST_DEPTH, budget, attributes)]
    seqs = [walk.sequence_nr(v.grad_fn) for v in held if issubclass(type(v), torch.Tensor) and v.grad_fn is not None]
    # and the tensors of a tuple such a variable holds (`z_loc, z_scale` of an encoder, kept as one): nothing can
    # add to a tuple, so they were made before the loop, even when the loop's own variables hold no graph to
    # compare them with (a library's step returning a float: pyro's `svi.step`)
    seqs += [walk.sequence_nr(item.grad_fn) for k, v in values if k not in assigned and type(v) is tuple
             for item in v if issubclass(type(item), torch.Tensor) and item.grad_fn is not None]
    # and the items of a list, tuple or dict held so (fast_neural_style's `gram_style`) that the loop does not add to,
    # older than every graph the loop's own variables hold: an item added this iteration (by a call the loop makes)
    # is newer than the iteration's first graph; nor does a forward hook (`activation[name] = output`), whose item
    # is older than the loss made from the forward's output
    filled, hooked = _filled(body), _hook_targets(models)
    # (and those of the tuples it holds: a data set augmented once, `[(policy(x), y) for x, y in data]`)
    items = [item for k, v in values if k not in assigned and k not in filled and id(v) not in hooked
             for pair in elements(v) for item in (elements(pair) if type(pair) is tuple else [pair])
             if issubclass(type(item), torch.Tensor) and item.grad_fn is not None]
    # (`target = grams[0]`: not ours; but an item the loop wrote its graph into, in place, is: an adversarial patch
    # placed into each batch of a list by slice assignment, `img[i, :, h:h + ph, w:w + pw] = patch_forward(patch)`)
    ours = [walk.sequence_nr(v.grad_fn) for k, v in values if k in assigned and issubclass(type(v), torch.Tensor)
            and v.grad_fn is not None and (v._version or not any(v is item for item in items))]
    seqs += [seq for item in items if ours and (seq := walk.sequence_nr(item.grad_fn)) < min(ours)]
    return max(seqs) + 1 if seqs else None


def _state(obj) -> dict:
    """``fields(obj)``, and a module's own buffers, which it keeps apart from its ``__dict__``: one registered with a
    graph (CoOp's ``token_prefix``, embedded without ``torch.no_grad()``) was built before the loop too; not one
    written in place since it was made (a running statistic a forward updates outside ``torch.no_grad()``), whose
    graph may be this step's."""
    own = fields(obj)
    if issubclass(type(obj), torch.nn.Module):
        own.update((name, b) for name, b in obj.named_buffers(recurse=False) if not b._version)
    return own


def _hook_targets(models: list[torch.nn.Module]) -> set[int]:
    """The ids of the objects the forward hooks of ``models``' modules can add to: what their closures hold, the
    globals they name, the attributes of the object a bound method hook belongs to (the forum's ``get_activation``
    recipe: ``activation[name] = output``; a visualization's ``grads.append((name, output))``)."""
    targets = set()
    for module in (m for model in models for m in model.modules()):
        for hook in [*module._forward_hooks.values(), *module._forward_pre_hooks.values()]:
            owner = getattr(hook, "__self__", None)
            fn = getattr(hook, "__func__", hook)
            code = getattr(fn, "__code__", None)
            if code is None:
                continue
            cells = [cell.cell_contents for cell in fn.__closure__ or () if cell.cell_contents is not None]
            named = [fn.__globals__[name] for name in code.co_names if name in fn.__globals__]
            targets.update(id(v) for v in [*cells, *named, *fields(owner).values()])
    return targets


def _forwards(frames: list) -> list[int]:
    """The indices of the frames running a module's ``forward``."""
    return [i for i, f in enumerate(frames) if f.f_code.co_name == "forward"
            and issubclass(type(f.f_locals.get("self")), torch.nn.Module)]


def training_loop(frame, filename: str, variables: Callable = attrgetter("f_locals")) -> tuple | None:
    """The training loop of ``filename`` running ``frame`` (the one ``loop_start`` looks before): its code and first
    offset; None where no loop of the script runs it."""
    found = _training_loop(list(stack(frame)), filename, variables)
    return None if found is None else (found[0].f_code, min(found[1]))


def _training_loop(frames: list, filename: str, variables: Callable) -> tuple | None:
    """(frame, the offsets of its loop's body) of the nearest of ``_loops`` not inside one update (a loss per decoded
    word: a caller's loop is the training loop)."""
    return next(((f, body) for f, body in _loops(frames, filename) if not _inside_one_update(f, body, variables)),
                None)


def _loops(frames: list, filename: str) -> Iterator[tuple]:
    """(frame, the offsets of its outermost loop's body) for each of ``frames`` (the nearest first) of ``filename``
    that runs a loop, past the outermost ``forward``: a loop inside a module's forward (and what it calls) is the
    model's own computation (an invertible ResNet's power series of autograd.grad calls), a comprehension's own loop
    (3.11 runs it as a function: `<listcomp>`) no training loop either."""
    forwards = _forwards(frames)
    for i, frame in enumerate(frames):
        code = frame.f_code
        if code.co_filename == filename and (not forwards or i > forwards[-1]) and code.co_name not in COMPREHENSIONS:
            body = loop_around(code, frame.f_lasti)
            if body is not None:
                yield frame, body


def inside_one_update(frame, filename: str, variables: Callable = attrgetter("f_locals")) -> bool:
    """Whether the innermost loop around the line of the nearest frame of ``filename`` that runs one runs inside one
    update (see ``_inside_one_update``; a loop over decoded words nested in the training loop's body too): its
    backwards, before any optimizer step, are one step's, not each an iteration of the training loop."""
    found = next(_loops(list(stack(frame)), filename), None)
    if found is None:
        return False
    frame = found[0]
    return _inside_one_update(frame, loop_around(frame.f_code, frame.f_lasti, innermost=True), variables)


_STEPPERS = (torch.optim.Optimizer, torch.amp.GradScaler)  # what steps an optimizer: `opt.step()`, `scaler.step(opt)`


def _inside_one_update(frame, body: set[int], variables: Callable) -> bool:
    """Whether the loop ``body`` of the function ``frame`` runs is inside one update: that function steps an
    optimizer after the loop, never inside it (the chatbot tutorial's ``train``: a loss per decoded word, summed or
    back-propagated word by word, then each optimizer steps once, itself or through a GradScaler), or steps none and
    is called from a loop of the script that steps one (a function back-propagating a loss per decoded word, the
    training loop stepping after it), or the loop goes over optimizers (``for opt, loss in zip(optimizers, losses)``:
    one update of each). The training loop is then a caller's: what the function made before this loop (the
    encoder's outputs, the features the losses share) is the update's own."""
    code = list(dis.get_instructions(frame.f_code))
    names = {**frame.f_globals, **variables(frame)}
    if _over_optimizers(code, body, names):
        return True
    steps = [ins.offset for k, ins in enumerate(code) if _steps(code, k, names, frame.f_code.co_filename)]
    if steps:
        return not body.intersection(steps) and max(steps) > max(body)
    caller = next((f for f in stack(frame.f_back) if f.f_code.co_filename == frame.f_code.co_filename), None)
    around = loop_around(caller.f_code, caller.f_lasti, innermost=True) if caller is not None else None
    if not around:
        return False
    code = list(dis.get_instructions(caller.f_code))
    names = {**caller.f_globals, **variables(caller)}
    return any(ins.offset in around and _steps(code, k, names, caller.f_code.co_filename) for k, ins in enumerate(code))


def _over_optimizers(code: list[dis.Instruction], body: set[int], names: dict) -> bool:
    """Whether the ``for`` loop whose ``body`` starts at its ``FOR_ITER`` goes over optimizers: its header reads one,
    or a list, tuple or dict holding one (``zip(optimizers, losses)``, ``(opt_d, opt_g)``, ``self.optimizers``)."""
    top = next(k for k, ins in enumerate(code) if ins.offset == min(body))
    if code[top].opname != "FOR_ITER":
        return False
    line = _line(code[top])
    header = itertools.takewhile(lambda k: _line(code[k]) == line, range(top - 1, -1, -1))
    for k in header:
        ins, then = code[k], code[k + 1]
        if then.opname == "LOAD_ATTR" and then.argval not in ("items", "values"):
            continue  # read for an attribute of it (`optimizer.param_groups`)
        value = names.get(ins.argval) if ins.opname in _LOADS else \
            fields(_receiver(code, k, names)).get(ins.argval) if ins.opname == "LOAD_ATTR" else None
        if any(issubclass(type(v), _STEPPERS) for v in [value, *elements(value)]):
            return True
    return False


def _line(ins: dis.Instruction) -> int | None:
    """The line an instruction runs for (its expression's first, from Python 3.11 on)."""
    at = getattr(ins, "positions", None)
    return at.lineno if at is not None else ins.starts_line


def _steps(code: list[dis.Instruction], k: int, names: dict, filename: str, deep: bool = True) -> bool:
    """Whether ``code[k]`` steps an optimizer: it loads ``step`` of one (``opt.step``, ``self.opt.step``,
    ``scaler.step``) or of an object it cannot read, taken for one (``optimizers[name].step``, ``o.step`` of a loop
    over optimizers yet to run, a function's argument), or (``deep``) loads a function of the script (``filename``)
    that does so itself, one call deep (the chatbot tutorial's clipping and optimizer steps moved into
    ``update(encoder_optimizer, ...)``; a method's ``self.opt.step()``)."""
    ins = code[k]
    attribute = ins.opname in ("LOAD_ATTR", "LOAD_METHOD")
    if attribute and ins.argval == "step":
        receiver = _receiver(code, k, names)
        return receiver is None or issubclass(type(receiver), _STEPPERS)
    if not deep or not (attribute or ins.opname in _LOADS):
        return False
    owner = _receiver(code, k, names) if attribute else None
    function = inspect.getattr_static(owner, ins.argval, None) if owner is not None else names.get(ins.argval)
    if type(function) is not types.FunctionType or function.__code__.co_filename != filename:
        return False
    inner = function.__code__
    bound = {inner.co_varnames[0]: owner} if owner is not None and inner.co_argcount else {}  # a method's `self`
    inside = list(dis.get_instructions(inner))
    return any(_steps(inside, j, {**function.__globals__, **bound}, filename, deep=False) for j in range(len(inside)))


def _receiver(code: list[dis.Instruction], k: int, names: dict):
    """The object whose attribute ``code[k]`` loads, where it is a variable or an attribute chain of one
    (``opt.step``, ``self.opt.step``), read through ``fields``; else None."""
    attrs = []
    while k > 0 and code[k - 1].opname == "LOAD_ATTR":
        k -= 1
        attrs.append(code[k].argval)
    value = names.get(code[k - 1].argval) if k > 0 and code[k - 1].opname in _LOADS else None
    for attr in reversed(attrs):
        value = fields(value).get(attr)
    return value


_DIST_DEPTH, _DIST_OBJECTS = 6, 200  # how far ``_inside_distribution`` looks: levels of attributes and items, objects


def _inside_distribution(obj, depth: int, budget: list[int], attributes: set[str]) -> list[torch.Tensor]:
    """The tensors inside a distribution, through the public attributes of it and of the distributions and transforms
    it holds, in lists, tuples and dicts: what it was built from. Not what it computes when read and keeps
    (a ``lazy_property``: a Categorical's ``probs`` made from its logits in the loop), a transform's cache of its last
    call (``_cached_x_y``: private) nor what its methods other than ``__init__`` and ``expand`` or the loop
    (``attributes``) assign. ``depth`` levels and ``budget[0]`` objects at most."""
    kind = type(obj)
    if issubclass(kind, torch.Tensor):
        return [obj]
    if depth <= 0 or budget[0] <= 0:
        return []
    if kind in (list, tuple, dict):
        values = elements(obj)
    elif issubclass(kind, (torch.distributions.Distribution, torch.distributions.Transform)):
        lazy = {k for cls in kind.__mro__ for k, v in vars(cls).items() if issubclass(type(v), lazy_property)}
        assigned = _methods_of(kind, ("__init__", "expand"))[0]  # (`expand` builds a new one, as `__init__` does)
        values = [v for k, v in fields(obj).items()
                  if not k.startswith("_") and k not in lazy and k not in assigned and k not in attributes]
    else:
        return []
    budget[0] -= 1
    return [t for v in values for t in _inside_distribution(v, depth - 1, budget, attributes)]


def _library_call(frames: list, filename: str, forward: int) -> tuple | None:
    """When no loop of ``filename`` runs the backward, a library's does (ignite's ``trainer.run(loader)``, mmengine's
    ``runner.train()``): (the outermost frame of ``filename`` calling into another file, past the outermost
    ``forward``; the offsets of the line it runs), that call taken as the loop, else None."""
    for i in range(len(frames) - 1, max(forward, 0), -1):
        frame = frames[i]
        if frame.f_code.co_filename == filename and frames[i - 1].f_code.co_filename != filename:
            return frame, {ins.offset for ins in dis.get_instructions(frame.f_code)
                           if ins.positions.lineno == frame.f_lineno}
    return None


def _filled(body: list[dis.Instruction]) -> set[str]:
    """The variables a loop's ``body`` may add to: those read in a statement (a line) that stores or deletes an item
    (``d[k] = ...``) or calls anything but a builtin that only reads (``xs.append(out)``, ``record(xs, out)``; not
    ``zip(ys, xs)``). A variable read only to index or iterate is not added to."""
    lines: dict[int, list[dis.Instruction]] = {}
    for ins in body:
        lines.setdefault(ins.positions.lineno, []).append(ins)
    filled = set()
    for line in lines.values():
        calls = sum(ins.opname == "CALL" for ins in line)
        reading = sum(ins.opname in ("LOAD_GLOBAL", "LOAD_NAME") and ins.argval in _READERS for ins in line)
        if calls > reading or any(ins.opname in ("STORE_SUBSCR", "DELETE_SUBSCR") for ins in line):
            filled.update(ins.argval for k, ins in enumerate(line) if ins.opname in _LOADS and not _indexed(line, k))
    return filled


def _written_into(body: list[dis.Instruction]) -> set[str]:
    """The variables whose items a loop's ``body`` stores (``outputs[i * bs:(i + 1) * bs] = out``): the name loaded
    as the container of each item store, found by going back over the stack from the store."""
    written = set()
    for k, ins in enumerate(body):
        depth = {"STORE_SUBSCR": 2, "STORE_SLICE": 3}.get(ins.opname)  # the container's place below the top
        for before in reversed(body[:k] if depth else []):
            depth -= dis.stack_effect(before.opcode, before.arg) if before.opcode >= dis.HAVE_ARGUMENT else \
                dis.stack_effect(before.opcode)
            if depth <= 0:
                if depth == 0 and before.opname in _LOADS:
                    written.add(before.argval)
                break
    return written


def _indexed(line: list[dis.Instruction], k: int) -> bool:
    """Whether the variable ``line[k]`` loads is read there through an index that is a name or a constant
    (``augmented[i][0]``), which adds nothing to it."""
    nxt = line[k + 1:k + 3]
    return len(nxt) == 2 and (nxt[0].opname in _LOADS or nxt[0].opname == "LOAD_CONST") \
        and (nxt[1].opname == "BINARY_SUBSCR" or (nxt[1].opname == "BINARY_OP" and nxt[1].argrepr == "[]"))


def elements(obj) -> list:
    """The items of a plain list or tuple, the values of a plain dict (at most 64: a dataset held as a list of
    samples is not searched), else []. Exact types only: a container class of the script's own may compute them."""
    if type(obj) in (list, tuple):
        return list(obj[:64])
    return list(itertools.islice(obj.values(), 64)) if type(obj) is dict else []


def _set_by_methods(obj) -> frozenset[str]:
    """The attributes that methods of ``obj``'s class, other than ``__init__``, assign (classes of torch
    itself left out): a ``forward`` that keeps its last output (``self.last_out = out``) sets one every step."""
    return _methods_of(type(obj))[0]


def _calls_setattr(obj) -> bool:
    """Whether a method of ``obj``'s class other than ``__init__`` (classes of torch itself left out) calls
    ``setattr`` or ``register_buffer``: it sets attributes whose names ``_set_by_methods`` cannot read."""
    return _methods_of(type(obj))[1]


@functools.lru_cache(maxsize=None)
def _methods_of(kind: type, builders: tuple[str, ...] = ("__init__",)) -> tuple[frozenset[str], bool]:
    """What the methods of ``kind`` other than ``builders`` (torch's own classes left out) do: the attributes they
    assign, whether they call ``setattr`` (or ``register_buffer``: vector-quantize-pytorch's codebook registers its
    statistics anew at every forward). Read once per class: a library's objects (accelerate's ``Accelerator``)
    have classes of thousands of instructions, met at every step's search."""
    stores, calls = set(), False
    for cls in kind.__mro__:
        if cls is object or cls.__module__.split(".")[0] == "torch":
            continue
        for name, member in vars(cls).items():
            code = getattr(member, "__code__", None)
            if code is not None and name not in builders:
                for c in _codes(code):
                    for i in dis.get_instructions(c):
                        if i.opname == "STORE_ATTR":
                            stores.add(i.argval)
                        calls = calls or (i.opname in ("LOAD_GLOBAL", "LOAD_NAME") and i.argval == "setattr") or (
                            i.opname in ("LOAD_ATTR", "LOAD_METHOD") and i.argval == "register_buffer")
    return frozenset(stores), calls


def _codes(code):
    yield code
    for const in code.co_consts:
        if hasattr(const, "co_code"):
            yield from _codes(const)
