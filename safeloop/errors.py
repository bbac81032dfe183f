"""The exceptions and warnings users catch.

Every graph-lifecycle error carries where it happened (``step``, ``loss_name``),
what it found (``node_name``, ``holder``) and what to do (``fixes``); its message
is one paragraph built from those fields.
"""
from __future__ import annotations

import signal
import sys
import warnings
from pathlib import Path


class SafeloopError(RuntimeError):
    """Base of everything safeloop raises on purpose."""


class ConfigError(SafeloopError, ValueError):
    """Bad configuration or bad arguments, found at start-up. Lists every problem."""

    def __init__(self, problems: list[str] | str):
        self.problems = [problems] if isinstance(problems, str) else list(problems)
        head = "invalid configuration" if len(self.problems) > 1 else "invalid configuration:"
        body = "\n".join(f"  - {p}" for p in self.problems) if len(self.problems) > 1 else " " + self.problems[0]
        super().__init__(head + (":\n" if len(self.problems) > 1 else "") + body)


class StepError(SafeloopError):
    """A training step failed; the step was abandoned and nothing was changed."""

    def __init__(self, message: str, step: int | None = None):
        self.step = step
        super().__init__(message)


class NonFiniteError(StepError):
    """A loss or gradient was NaN or Inf; the step was abandoned before the optimizer step."""


class CheckpointError(SafeloopError):
    """A checkpoint cannot be written, read, or used for this run; ``path`` names the file."""

    def __init__(self, message: str, path=None):
        self.path = path
        super().__init__(message)


class Interrupted(KeyboardInterrupt):
    """A second SIGTERM or SIGINT stopped the run at once, without saving (the first asks for a save).
    ``code`` is 128 + the signal's number (143, 130): ``python -m safeloop`` exits with it, so that a
    job script can tell a preempted run from a failed one."""

    def __init__(self, signum: int):
        self.signum, self.code = signum, 128 + signum
        super().__init__(f"{signal.Signals(signum).name} received a second time: stopped at once, without saving; "
                         "the checkpoints saved before are intact (resume=auto continues from the newest)")


class _Report:
    """Where (``step``, ``loss_name``), what (``node_name``, ``holder``) and what to do (``fixes``):
    the fields of every guard error and warning; the message is one paragraph built from them. Raised from
    a Trainer's step, ``abandoned`` says what abandoning the step left as it was."""

    what = "autograd graph problem"

    def __init__(
        self,
        detail: str,
        *,
        step: int | None = None,
        loss_name: str | None = None,
        node_name: str | None = None,
        holder: str | None = None,
        fixes: list[str] | None = None,
        picture: str | None = None,
        abandoned: str | None = None,
        what: str | None = None,
    ):
        if what is not None:  # a case of the class's mistake told in its own words
            self.what = what
        self.detail = detail
        self.step = step
        self.loss_name = loss_name
        self.node_name = node_name
        self.holder = holder
        self.fixes = list(fixes or [])
        self.picture = picture
        self.abandoned = abandoned
        super().__init__(self._message())

    def _message(self) -> str:
        where = []
        if self.step is not None:
            where.append(f"step {self.step}")
        if self.loss_name is not None:
            where.append(f"loss '{self.loss_name}'")
        text = f"{self.what} ({', '.join(where)}): " if where else f"{self.what}: "
        text += self.detail.rstrip(".") + "."
        if self.abandoned:
            text += f" The step was abandoned ({self.abandoned})."
        if self.fixes:
            text += " To fix: " + "; or ".join(f.rstrip(".") for f in self.fixes) + "."
        if self.picture:
            text += f" Graph picture: {self.picture}"
        return text

    def abandon(self, report: str) -> None:
        """Say what abandoning the step it was raised in left as it was (``report``), in the message too."""
        self.abandoned = report
        self.args = (self._message(),)

    def __reduce__(self):  # keep fields across pickling (torchrun, multiprocessing)
        return (_rebuild, (type(self), self.detail, self.__dict__))


def _rebuild(cls, detail, fields):
    err = cls.__new__(cls)
    err.__dict__.update(fields)
    Exception.__init__(err, err._message())
    return err


class GraphLifecycleError(_Report, SafeloopError):
    """An autograd-graph mistake, seen before it could corrupt the step."""


class GraphLifecycleWarning(_Report, UserWarning):
    """Something in the graph that works today but is likely not what was meant."""


class GraphReuseError(GraphLifecycleError):
    what = "graph built before the step is reused"


class DoubleBackwardError(GraphLifecycleError):
    what = "backward through a graph that was already consumed"


class CarriedGraphError(GraphLifecycleError):
    what = "graph carried over from an earlier step"


class NoGraphError(GraphLifecycleError):
    what = "loss has no autograd graph"


class InplaceModificationError(GraphLifecycleError):
    what = "a tensor saved for backward was modified in place"


class GraphSharingWarning(GraphLifecycleWarning):
    """The step's loss reaches a graph built before training: backward works through it (it saves no
    tensors, or ``guard.on_reuse`` retains it), but every step shares it."""

    what = "graph built before training is shared by every step"


class ConfigWarning(UserWarning):
    """A setup that runs but is most likely not what was meant (an optimizer nothing reaches, an
    unused loss weight); said once."""


class UnusedGradientWarning(GraphLifecycleWarning):
    """A loss reaches parameters that require grad but that no optimizer updates, so their gradient goes nowhere
    (layers kept in a plain list, a Parameter made in ``forward``, an optimizer built before a layer was
    replaced); or it reaches none of the optimizers' parameters, so it trains nothing (a meta-loss through
    detached copies of the weights). Said once per loss and per parameter."""

    what = "gradient that no optimizer uses"


class GraphLeakWarning(GraphLifecycleWarning):
    """A step's autograd graph is still alive after the step ended."""

    what = "autograd graph kept alive after its step"


_PACKAGE = str(Path(__file__).resolve().parent)  # safeloop's own directory


_PASSED = ("contextlib.py", "_contextlib.py")  # a `with` statement's exit, torch.no_grad() as a decorator


def user_stacklevel() -> int:
    """The ``stacklevel`` at which ``warnings.warn``, called by this function's caller, names the innermost frame
    outside safeloop (and outside the context managers that wrap its calls): the user's own line, where their
    warning filters and file name apply (``trainer.fit()`` for what the Trainer warns during a step)."""
    frame, level = sys._getframe(2), 2
    while frame.f_back is not None and (frame.f_code.co_filename.startswith(_PACKAGE)
                                        or Path(frame.f_code.co_filename).name in _PASSED):
        frame, level = frame.f_back, level + 1
    return level


def warn_at(warning: Warning, where: tuple | None = None, heeded: list | None = None) -> None:
    """Warn at ``where`` (file name, line, module globals), else at the user's line that called into safeloop (see
    ``user_stacklevel``): there the user's warning filters and file name apply.

    ``heeded``: under watch, the warning filters set before the script ran (``-W``, ``PYTHONWARNINGS``). A filter
    the script added since that names no message, module, line or safeloop warning class (a blanket
    ``warnings.filterwarnings("ignore")``, common at the top of public scripts, meant for its libraries' noise)
    does not hide the guard's warnings, which are what the script is watched for: they are shown as the filters
    after it say. A filter naming a safeloop warning class, or a message or module, still applies."""
    if heeded is None:
        _warn(warning, where)
        return
    if where is None:
        frame = sys._getframe(user_stacklevel() - 1)  # what warnings.warn(stacklevel=...) would name from here
        filename, lineno, module = frame.f_code.co_filename, frame.f_lineno, frame.f_globals.get("__name__", "")
    else:
        filename, lineno, module = where[0], where[1], where[0][:-3] if where[0].endswith(".py") else where[0]
    blanket = False
    for item in warnings.filters:  # the first filter that matches decides, as in warnings.warn_explicit
        action, message, category, mod, line = item
        if (message is None or message.match(str(warning))) and isinstance(warning, category) \
                and (mod is None or mod.match(module)) and line in (0, lineno):
            if not (action == "ignore" and message is mod is None and line == 0 and item not in heeded
                    and not issubclass(category, GraphLifecycleWarning)):
                break
            blanket = True
    else:
        action = warnings.defaultaction
    if not blanket:
        _warn(warning, where)
    elif action == "error":
        raise warning
    elif action != "ignore":
        warnings.showwarning(warning, type(warning), filename, lineno)


def _warn(warning: Warning, where: tuple | None) -> None:
    if where is None:
        warnings.warn(warning, stacklevel=user_stacklevel())
    else:
        warnings.warn_explicit(warning, type(warning), where[0], where[1], module_globals=where[2])
