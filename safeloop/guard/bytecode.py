"""Reading a function's code: where the loop around a line is, and what the loop's body assigns (the guard's
plain loops and ``watch``: a variable the loop does not assign holds what was made before it)."""
from __future__ import annotations

import dis
import functools
from collections.abc import Iterator

# instructions after which the next one does not run
FLOW_ENDS = {"JUMP_BACKWARD", "JUMP_BACKWARD_NO_INTERRUPT", "JUMP_ABSOLUTE", "JUMP_FORWARD", "RETURN_VALUE",
             "RETURN_CONST", "RAISE_VARARGS", "RERAISE"}
COMPREHENSIONS = {"<listcomp>", "<dictcomp>", "<setcomp>", "<genexpr>"}
STORES = {"STORE_NAME", "STORE_FAST", "STORE_GLOBAL", "STORE_DEREF", "DELETE_NAME", "DELETE_FAST",
          "DELETE_GLOBAL", "DELETE_DEREF"}


def stored(ins: dis.Instruction) -> tuple[str, ...]:
    """The variable names an instruction assigns or deletes (Python 3.13 stores two at once: ``a, b = ...``)."""
    if ins.opname in STORES:
        return (ins.argval,)
    if ins.opname == "STORE_FAST_STORE_FAST":
        return ins.argval
    return (ins.argval[0],) if ins.opname == "STORE_FAST_LOAD_FAST" else ()


def loop_around(code, offset: int, innermost: bool = False) -> set[int] | None:
    """The offsets of the outermost loop's body that holds ``offset`` (``innermost``: the innermost's): a tensor that
    an outer loop makes (WGAN-GP's ``fake``, made once per generator step around ``n_critic`` critic steps) is not
    built before the loop. A loop is a backward jump whose source its target reaches without an exception (since
    Python 3.12 the handlers of ``with`` and ``except`` sit at the function's end and jump back to the code after
    them: no loop); its body, the offsets from its target to the jump and the handlers of the ``try`` blocks among
    them (3.12 puts them after the end)."""
    flow = Flow(code)
    best = None
    for ins in flow.instructions:
        target = flow.jump(ins)
        if target is not None and target <= ins.offset and ins.offset in flow.reached([target]):
            body = flow.body(target, ins.offset)
            if offset in body and (best is None or (len(body) < len(best) if innermost else len(body) > len(best))):
                best = body
    return best


def set_every_time(frame, by_calls: bool = False) -> tuple:
    """(the frame whose loop runs ``frame``: its own or a caller's in its file, the variables that loop sets on every
    way from its top to the line the frame runs); (None, empty) outside a loop. ``by_calls``: only those set to what a
    call returns (``outs = list(pool.map(...))``): values made in this iteration. Never one set in a branch (``if fix:
    adv = fgm(...)``); with ``by_calls``, not a ``for`` target, an item unpacked, nor a value read from a name, an
    attribute or an index (``x = augmented[i][0]``) either: those may hand on a tensor made before the loop."""
    filename = frame.f_code.co_filename
    while frame is not None and frame.f_code.co_filename == filename:
        code = frame.f_code
        body = loop_around(code, frame.f_lasti) if code.co_name not in COMPREHENSIONS else None
        if body is not None:
            return frame, _every_way(code, frame.f_lasti, body, by_calls)
        frame = frame.f_back
    return None, frozenset()


def carried(frame) -> frozenset[str]:
    """The variables that the loop running ``frame`` (see ``set_every_time``) reads before it sets them, in the order
    of its code: a state carried from one iteration to the next (`pos` of `pos = pos + dt * vel`); not one it sets
    in a line that detaches (`rv = rv.detach()`: carried without its graph)."""
    return frozenset(name for name, read in _first_use(frame).items() if read)


def set_first(frame) -> frozenset[str]:
    """The variables that the loop running ``frame`` sets before it reads them, in the order of its code: values of
    the running iteration (`z_q` of `z_q = quantize(z)`), never a state the next iteration reads."""
    return frozenset(name for name, read in _first_use(frame).items() if not read)


def _first_use(frame) -> dict[str, bool]:
    """Each variable that the loop running ``frame`` reads or sets -> whether its code reads it first (a variable set
    in a line that detaches counts as set first)."""
    frame = set_every_time(frame)[0]
    if frame is None:
        return {}
    body = loop_around(frame.f_code, frame.f_lasti)
    instructions = [ins for ins in dis.get_instructions(frame.f_code) if ins.offset in body]
    detaching = {ins.positions.lineno for ins in instructions if ins.argval in ("detach", "detach_")}
    first: dict[str, bool] = {name: False for ins in instructions if ins.positions.lineno in detaching
                              for name in stored(ins)}
    for ins in instructions:
        for name in stored(ins):
            first.setdefault(name, False)
        if ins.opname.startswith(("LOAD_FAST", "LOAD_GLOBAL", "LOAD_NAME", "LOAD_DEREF")):
            for name in ins.argval if type(ins.argval) is tuple else [ins.argval]:  # (3.13's LOAD_FAST_LOAD_FAST)
                first.setdefault(name, True)
    return first


def _every_way(code, offset: int, body: set[int], by_calls: bool) -> frozenset[str]:
    """The variables that the loop whose ``body`` holds ``offset`` sets on every way from its top to it (see
    ``set_every_time``)."""
    flow = Flow(code)
    before = [ins for ins in flow.instructions if ins.offset in body and ins.offset <= offset]
    here, top = before[-1].offset, min(body)  # (the line's instruction: f_lasti may be in its inline caches)
    return frozenset(name for call, ins in zip(before, before[1:]) if (call.opname.startswith("CALL") or not by_calls)
                     and here not in flow.reached([top], within=lambda offset: offset != ins.offset)
                     for name in stored(ins))


def set_by_outer_loop(frame) -> tuple:
    """(the frame whose loop runs ``frame``, as ``set_every_time`` finds it; the variables that the outermost loop
    around its line sets on every way to it and the innermost does not set: what an enclosing loop made for every pass
    of an inner one, such as the peers' outputs of deep mutual learning, each peer's loss back-propagated in a loop
    over the peers; or, in a function whose one loop runs it and that a loop of a caller in its file calls, what the
    function sets before that loop); (None, empty) where no loop there is inside another."""
    filename = frame.f_code.co_filename
    while frame is not None and frame.f_code.co_filename == filename:
        found = _set_by_outer_loop(frame.f_code, frame.f_lasti) if frame.f_code.co_name not in COMPREHENSIONS \
            else None
        if found is not None:
            names, nested = found
            caller = frame.f_back
            while not nested and caller is not None and caller.f_code.co_filename == filename:
                nested = _set_by_outer_loop(caller.f_code, caller.f_lasti) is not None
                caller = caller.f_back
            return (frame, names) if names and nested else (None, frozenset())
        frame = frame.f_back
    return None, frozenset()


@functools.lru_cache(maxsize=256)
def _set_by_outer_loop(code, offset: int) -> tuple[frozenset[str], bool] | None:
    """``set_by_outer_loop`` for one function: (the variables, whether a loop of its own holds the inner one; if not,
    what the function sets before its loop), None where no loop holds ``offset``. Read once per call site: a loop run
    at a script's top level is read from the whole module's code (some milliseconds), and this is asked at every step
    that begins there."""
    outer = loop_around(code, offset)
    if outer is None:
        return None
    inner = loop_around(code, offset, innermost=True)
    inside = {name for ins in Flow(code).instructions if ins.offset in inner for name in stored(ins)}
    if inner != outer:
        return _every_way(code, offset, outer, by_calls=False) - inside, True
    if code.co_name == "<module>":
        return frozenset(), False
    return _every_way(code, offset, set(range(max(outer) + 1)), by_calls=False) - inside, False


def stack(frame) -> Iterator:
    """``frame`` and its callers, the nearest first."""
    while frame is not None:
        yield frame
        frame = frame.f_back


class Flow:
    """A code object's instructions and where each goes when nothing raises."""

    def __init__(self, code):
        self.instructions = list(dis.get_instructions(code))
        self.index = {ins.offset: k for k, ins in enumerate(self.instructions)}
        # (where a try begins, its handler): the exception table (3.11 on), or 3.10's SETUP_* instructions
        self.handlers = [(e.start, e.target) for e in getattr(dis.Bytecode(code), "exception_entries", ())] \
            + [(ins.offset, ins.argval) for ins in self.instructions if ins.opname.startswith("SETUP_")]

    def jump(self, ins: dis.Instruction) -> int | None:
        """Where ``ins`` jumps to (not ``SETUP_*``'s handler, 3.10's exception edge), else None."""
        if (ins.opcode in dis.hasjrel or ins.opcode in dis.hasjabs) and not ins.opname.startswith("SETUP_") \
                and ins.argval in self.index:
            return ins.argval
        return None

    def reached(self, starts: list[int], within=lambda offset: True) -> set[int]:
        """The offsets reached from ``starts`` by falling through and jumps, staying ``within``."""
        seen: set[int] = set()
        todo = [self.index[s] for s in starts]
        while todo:
            k = todo.pop()
            if k >= len(self.instructions) or k in seen or not within(self.instructions[k].offset):
                continue
            seen.add(k)
            ins = self.instructions[k]
            if (target := self.jump(ins)) is not None:
                todo.append(self.index[target])
            if ins.opname not in FLOW_ENDS:
                todo.append(k + 1)
        return {self.instructions[k].offset for k in seen}

    def body(self, first: int, last: int) -> set[int]:
        """The offsets from ``first`` to ``last``, and the handler code of the ``try`` blocks among them up to where
        it goes back between the two; every byte of their instructions (a frame's ``f_lasti`` may be inside one's
        inline caches)."""
        handlers = [target for start, target in self.handlers if first <= start <= last and not first <= target <= last]
        code = sorted(self.reached(handlers, within=lambda offset: not first <= offset <= last))
        ends = {ins.offset: after.offset for ins, after in zip(self.instructions, self.instructions[1:])}
        return set(range(first, last + 2)).union(*(range(offset, ends.get(offset, offset + 2)) for offset in code))
