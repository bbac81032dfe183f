"""``python -m safeloop.watch [--check auto] [--on-reuse error] [--trace] [--ignore CHECK] script.py [args]``
(also ``safeloop watch ...``)

Runs an unmodified training script (as ``__main__``, with ``sys.argv`` set, as ``python
script.py args`` would) with the graph-lifecycle guard attached to every ``Tensor.backward``,
``torch.autograd.backward`` and ``torch.autograd.grad`` call. A step ends at each optimizer
step (PyTorch's global optimizer step hooks; the backwards of an L-BFGS closure, run inside
``step()``, are that step's); until an optimizer has begun to step, a backward on a new loss where
the step's first backward was called starts a step, unless the loss reaches the graph the last
backward kept (``retain_graph=True``: per-task backwards over one trunk). The tensor at fault is
searched in the variables of the function that called backward, of its callers in the script, and in the
script's globals.
The script's output, exit code and traceback are its own; a graph mistake raises the Trainer's
error, naming the tensor and the fix. The Python scripts it starts (the ranks of Lightning's DDP
launcher) and its multiprocessing workers (``torch.multiprocessing.spawn``'s ranks) run under watch too, with the
same options.
"""
from __future__ import annotations

import argparse
import importlib.machinery
import json
import os
import sys
import types
import warnings
from pathlib import Path

import torch
from torch.autograd.graph import GradientEdge
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

from .guard import walk
from .guard.before import elements, inside_one_update, loop_start, training_loop
from .guard.bytecode import COMPREHENSIONS, loop_around, stack
from .guard.explain import fields
from .guard.loop import WRAPPED, GraphGuard
from .settings import CHECKS, GUARD_CHECKS, GUARD_DEFAULTS, REUSE_POLICIES

STARTUP = str(Path(__file__).parent / "guard" / "startup")  # the sitecustomize of the processes a script starts


class Watch:
    """While entered: every backward goes through ``guard``, every optimizer step ends a step."""

    def __init__(self, guard: GraphGuard, script: str):
        self.guard, self.script = guard, script  # as compiled: frames carry this file name
        self.busy = False  # inside a guarded call: backward calls made by it (Tensor.backward's own) pass
        self.names: dict[int, str] = {}  # optimizer -> its name in messages
        self.started = False
        self.first_update: int | None = None  # the node counter when an optimizer step began before any backward
        self.sites: set[tuple] = set()  # the script's lines that called a backward: (code, offset)
        self.loop: tuple | None = None  # the training loop running the last new one (``training_loop``)

    def __enter__(self) -> Watch:
        self.saved = torch.Tensor.backward, torch.autograd.backward, torch.autograd.grad
        tensor_backward, autograd_backward, autograd_grad = self.saved
        watch = self

        def backward(self, gradient=None, retain_graph=None, create_graph=False, inputs=None):
            return watch.call(self, sys._getframe(1), lambda retain: tensor_backward(
                self, gradient, retain, create_graph, inputs), retain_graph, create_graph, inputs)

        def backward_fn(tensors, grad_tensors=None, retain_graph=None, create_graph=False, grad_variables=None,
                        inputs=None):
            return watch.call(tensors, sys._getframe(1), lambda retain: autograd_backward(
                tensors, grad_tensors, retain, create_graph, grad_variables, inputs), retain_graph, create_graph,
                inputs)

        def grad(outputs, inputs, grad_outputs=None, retain_graph=None, create_graph=False, only_inputs=True,
                 allow_unused=None, is_grads_batched=False, materialize_grads=False):
            # read once (``model.parameters()`` is a generator); the guard follows them unless one is a GradientEdge
            inputs = (inputs,) if isinstance(inputs, (torch.Tensor, GradientEdge)) else tuple(inputs)
            followed = inputs if all(isinstance(t, torch.Tensor) for t in inputs) else None
            return watch.call(outputs, sys._getframe(1), lambda retain: autograd_grad(
                outputs, inputs, grad_outputs, retain, create_graph, only_inputs, allow_unused, is_grads_batched,
                materialize_grads), retain_graph, create_graph, followed, updates=False)

        for new, old in zip((backward, backward_fn, grad), self.saved):
            new.__doc__, new.__wrapped__ = old.__doc__, old
        torch.Tensor.backward, torch.autograd.backward, torch.autograd.grad = backward, backward_fn, grad
        # from an optimizer's step() on, a step ends at each optimizer step: the backwards an L-BFGS closure runs
        # inside step() are that step's (the post hook ends it)
        self.hooks = (register_optimizer_step_pre_hook(self.stepping), register_optimizer_step_post_hook(self.stepped))
        self.guard.guard.heeded = list(warnings.filters)  # a blanket filter the script adds hides no finding (warn_at)
        return self

    def __exit__(self, *exc) -> None:
        for hook in self.hooks:
            hook.remove()
        torch.Tensor.backward, torch.autograd.backward, torch.autograd.grad = self.saved

    def call(self, outputs, frame, run, retain_graph, create_graph, inputs, updates=True):
        if self.busy:
            return run(retain_graph)
        tensors = [outputs] if isinstance(outputs, torch.Tensor) else list(outputs)
        if not all(isinstance(t, torch.Tensor) for t in tensors):  # GradientEdge outputs: not ours to check
            return run(retain_graph)
        losses = {"loss": tensors[0]} if len(tensors) == 1 else {f"outputs[{i}]": t for i, t in enumerate(tensors)}
        if not self.started:
            # a derivative the script takes once, before its training loop (one of a tensor without a graph fails:
            # the guard explains it)
            if not updates and self.first_update is None and all(t.grad_fn is not None for t in tensors) \
                    and _set_up(frame, self.script):
                result = run(retain_graph)
                self.guard.guard.start_fit()  # what the script made until now, it made before training
                return result
        # a library's backward (accelerator.backward, mmengine's update_params) is told by the script's line calling
        # it: where a step begins, the line messages show, the variables searched first
        line = next((f for f in stack(frame) if f.f_code.co_filename == self.script), frame)
        site = (line.f_code, line.f_lasti)
        if not self.started:
            self.started = True
            self.first_step(frame)
        elif site not in self.sites:
            self.another_loop(frame)
        self.sites.add(site)
        self.busy = True
        try:
            return self.guard.run(losses, line, run, retain_graph, create_graph, inputs, updates,
                                  caller=frame if line is not frame else None)
        finally:
            self.busy = False

    def stepping(self, optimizer, *_) -> None:
        """An optimizer's step() begins (before any backward: where the first step may begin, see ``first_step``)."""
        if not self.started and self.first_update is None:
            self.first_update = walk.sequence_now()
        self.guard.optimizer_stepping(optimizer)

    def stepped(self, optimizer, args, kwargs) -> None:
        name = self.names.get(id(optimizer))
        if name is None:  # its variable's name in the script (or a wrapper's: accelerate's prepared one), once
            script = [f for f in stack(sys._getframe(1)) if f.f_code.co_filename == self.script]
            spaces = [*map(self.guard.variables, script), vars(sys.modules["__main__"])]  # the nearest first
            # (not `self` of a wrapper's own step method in the script)
            name = next((k for space in spaces for k, v in space.items() if _optimizer(v) is optimizer and k != "self"),
                        f"{type(optimizer).__name__} #{len(self.names) + 1}")
            self.names[id(optimizer)] = name
        self.guard.optimizer_stepped(name, optimizer)

    def first_step(self, frame) -> None:
        """Where the first step began: after the tensors the script's training loop did not make.

        A script has no ``with guard.step()``; the loop around the first backward tells. Tensors
        with a graph held by variables that its body never assigns were built before it (``y = t @ a``
        above the loop): the first step starts after the newest of them. Without such a loop the training
        loop is a library's (Lightning's): when the first backward runs inside an optimizer step begun before
        it, that step's closure builds the step's graph (Lightning's automatic optimization runs training_step
        there), so the first step starts with that optimizer step; otherwise it is all the script did before
        its first backward.
        """
        namespace = vars(sys.modules["__main__"])
        self.guard.search_script(self.script, namespace)
        start = loop_start(frame, self.script, self.guard.variables, outside=self.first_update)
        # read through the guard, which reads them afresh later: before 3.13 a read leaves a copy on the frame
        seen = [namespace, *(self.guard.variables(f) for f in stack(frame) if f.f_code.co_filename == self.script)]
        values = [v for names in seen for v in names.values()]
        values += [a for v in values for a in fields(v).values()]  # a trainer class's `self.opt` too
        values += [a for v in values for a in elements(v)]  # and a dict or list of them (`optims = {"actor": ...}`)
        # and those a module keeps as an attribute (stable-baselines3's `policy.optimizer`, `actor.optimizer`)
        values += [a for v in values if issubclass(type(v), torch.nn.Module) for m in v.modules()
                   for a in vars(m).values() if _optimizer(a) is not None]
        self.guard.expect_optimizers({id(o): o for o in map(_optimizer, values) if o is not None}.values())
        if inside_one_update(frame, self.script, self.guard.variables):
            self.guard.steps_end_at_updates()
        self.loop = training_loop(frame, self.script, self.guard.variables)
        self.start_at(start)

    def another_loop(self, frame) -> None:
        """A backward from a line of the script not seen before: where a training loop other than the last one runs
        it (a second phase: a student trained after its teacher, a fine-tuning after a pre-training), training starts
        again there. What the script made before that loop was built before its steps, as for the first loop."""
        loop = training_loop(frame, self.script, self.guard.variables)
        if loop is not None and loop != self.loop:
            self.loop = loop
            self.start_at(loop_start(frame, self.script, self.guard.variables))

    def start_at(self, start: int | None) -> None:
        """Training starts at node counter ``start`` (None: where it started), unless it started later."""
        engine = self.guard.guard
        if start is not None and start > engine.fit_seq:
            engine.start_fit(at=start)


def _set_up(frame, filename: str) -> bool:
    """Whether ``frame`` runs the script's set-up, not its training: no loop of ``filename`` runs it (a
    comprehension's own aside), and no other file's code called ``filename``'s between the script's outermost frame
    and its innermost (a library's loop calling the script's update function is training). A ``torch.autograd.grad``
    there before any backward or optimizer step (a PINN's derivative at points that never change, FGM embeddings made
    once) starts no step: a step reusing its graph finds it built before the step."""
    frames = list(stack(frame))
    mine = [i for i, f in enumerate(frames) if f.f_code.co_filename == filename]
    return bool(mine) and all(frames[i].f_code.co_filename == filename for i in range(mine[0], mine[-1])) and all(
        frames[i].f_code.co_name in COMPREHENSIONS or loop_around(frames[i].f_code, frames[i].f_lasti) is None
        for i in mine)


def _optimizer(value):
    """The optimizer ``value`` is, or wraps (accelerate's prepared ``AcceleratedOptimizer``, opacus's ``DPOptimizer``:
    their inner optimizer's steps are the ones PyTorch's global step hooks see), else None; by type only (see
    ``fields``)."""
    if not issubclass(type(value), torch.optim.Optimizer):
        return None
    attrs = fields(value)
    inner = next((attrs[name] for name in WRAPPED if issubclass(type(attrs.get(name)), torch.optim.Optimizer)), None)
    return inner if inner is not None else value


def watch_children(options: list[str], script: str) -> None:
    """The Python processes the script starts (and theirs) run their scripts under watch too, with ``options``:
    Lightning's DDP launcher starts rank 1 as ``python script.py``; multiprocessing's spawn and forkserver workers
    run ``script``'s functions (see ``guard/startup/sitecustomize.py``)."""
    os.environ["SAFELOOP_WATCH"] = json.dumps(options)
    os.environ["SAFELOOP_WATCH_SCRIPT"] = script
    path = os.environ.get("PYTHONPATH", "")
    if STARTUP not in path.split(os.pathsep):
        os.environ["PYTHONPATH"] = os.pathsep.join([STARTUP, path]) if path else STARTUP


def watch_process(options: list[str], script: str) -> None:
    """A multiprocessing worker of a watched ``script`` (spawn or forkserver: a new interpreter that runs the
    script's functions, as ``torch.multiprocessing.spawn``'s DDP ranks and Hogwild's trainers do): watched from now
    until it exits, with the script's ``options``."""
    Watch(_guard(_parser().parse_args([*options, script])), script).__enter__()


def _parser(prog: str = "python -m safeloop.watch") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[1],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", choices=CHECKS, default=GUARD_DEFAULTS.check)
    parser.add_argument("--on-reuse", choices=REUSE_POLICIES, default=GUARD_DEFAULTS.on_reuse)
    parser.add_argument("--trace", action="store_true", help="anomaly mode: errors name the line that made the tensor")
    parser.add_argument("--ignore", action="append", choices=GUARD_CHECKS, default=[], help="turn one check off")
    parser.add_argument("script", help="the training script")
    parser.add_argument("args", nargs=argparse.REMAINDER, help="its arguments")
    return parser


def _guard(args: argparse.Namespace) -> GraphGuard:
    return GraphGuard(check=args.check, on_reuse=args.on_reuse, trace=args.trace, ignore=args.ignore)


def main(argv: list[str] | None = None, prog: str = "python -m safeloop.watch") -> int:
    parser = _parser(prog)
    args = parser.parse_args(argv)
    script = args.script
    if not Path(script).is_file():
        parser.error(f"{script}: no such file (give the path of a Python script)")
    guard = _guard(args)
    sys.argv = [script, *args.args]
    script = str(Path(script).resolve())  # as `python script.py` names it in tracebacks
    watch_children(["--check", args.check, "--on-reuse", args.on_reuse, *(["--trace"] if args.trace else []),
                    *(word for name in args.ignore for word in ("--ignore", name))], script)
    sys.path[0] = str(Path(script).parent)
    # What `python script.py` does (runpy.run_path would change sys.argv[0] to the full path)
    main = types.ModuleType("__main__")
    # its loader too: Python 3.12's warnings (linecache) refuse module globals with neither loader nor spec
    main.__file__, main.__builtins__, main.__spec__ = script, __builtins__, None
    main.__loader__ = importlib.machinery.SourceFileLoader("__main__", script)
    sys.modules["__main__"] = main
    try:
        code = compile(Path(script).read_bytes(), script, "exec", dont_inherit=True)
    except SyntaxError as err:  # as python prints it: no traceback, the line and the caret
        sys.excepthook(type(err), err.with_traceback(None), None)
        return 1
    with Watch(guard, script):
        try:
            exec(code, vars(main))
        except SystemExit:
            raise
        except KeyboardInterrupt:
            # Left to python, which prints it (sys.excepthook: here from the script's first frame on, as `python
            # script.py` shows it) and then ends by SIGINT, after the usual clean-up
            hook = sys.excepthook
            sys.excepthook = lambda kind, value, tb: hook(kind, value.with_traceback(_from(script, tb)),
                                                          value.__traceback__)
            raise
        except BaseException as err:  # the script's own traceback, as python would print it
            sys.excepthook(type(err), err.with_traceback(_from(script, err.__traceback__)), err.__traceback__)
            return 1
        finally:
            guard.close()
    return 0


def _from(script: str, tb):
    """The traceback ``tb`` from the first frame of ``script`` on (all of it if none is)."""
    first = tb
    while first is not None and first.tb_frame.f_code.co_filename != script:
        first = first.tb_next
    return first if first is not None else tb


if __name__ == "__main__":
    sys.exit(main())
