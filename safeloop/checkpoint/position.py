"""Where a run's randomness and data stand: the RNG states a checkpoint holds, and the interrupted epoch going on
where it stopped (from a data iterable's own state, or re-drawn and fast-forwarded past the batches consumed)."""
from __future__ import annotations

import itertools
import logging
import random
from collections.abc import Iterable, Iterator
from typing import Any

import torch

try:
    import numpy as np
except ImportError:  # NumPy is optional
    np = None

log = logging.getLogger("safeloop")


def rng_state() -> dict:
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate(), "cuda": [], "numpy": None}
    if torch.cuda.is_available() and torch.cuda.is_initialized():  # never create a CUDA context to save
        state["cuda"] = torch.cuda.get_rng_state_all()
    if np is not None:
        kind, keys, pos, has_gauss, gauss = np.random.get_state()
        state["numpy"] = {"kind": kind, "keys": keys.tolist(), "pos": pos, "has_gauss": has_gauss, "gauss": gauss}
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    if state["cuda"] and torch.cuda.is_available() and len(state["cuda"]) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(state["cuda"])
    if state["numpy"] is not None and np is not None:
        s = state["numpy"]
        np.random.set_state((s["kind"], np.array(s["keys"], dtype=np.uint32), s["pos"], s["has_gauss"], s["gauss"]))


RANDOM = (torch.Generator, random.Random) + ((np.random.RandomState, np.random.Generator) if np is not None else ())


def _generators(data: Iterable) -> list:
    """The random generators a pass of ``data`` draws from, besides the global ones: the DataLoader's, its
    samplers' and batch sampler's, and those its dataset keeps in attributes, a few levels down (a transform's own
    ``np.random.RandomState``, as MONAI's ``Randomizable`` keeps ``self.R``; a ``random.Random``; a
    ``torch.Generator``). With ``num_workers`` the dataset's run in the workers, each pass from their first state:
    the training process's copies never move, and keeping their state changes nothing."""
    found: list = []
    seen: set[int] = set()

    def visit(obj: Any, depth: int) -> None:
        if id(obj) in seen or obj is None:
            return
        seen.add(id(obj))
        if isinstance(obj, RANDOM):
            found.append(obj)
        elif depth and isinstance(obj, (list, tuple)) and len(obj) <= 64:  # a list of transforms, not of samples
            for item in obj:
                visit(item, depth - 1)
        elif depth and isinstance(obj, dict) and len(obj) <= 64:
            for item in obj.values():
                visit(item, depth - 1)
        elif depth and hasattr(obj, "__dict__") and not isinstance(obj, (torch.Tensor, torch.nn.Module, type)):
            for item in vars(obj).values():
                visit(item, depth - 1)

    visit(getattr(data, "dataset", None), 4)  # the dataset, its transform, a Compose's list, a transform's R
    batch_sampler = getattr(data, "batch_sampler", None)
    for part in (getattr(data, "generator", None), getattr(data, "sampler", None), batch_sampler,
                 getattr(batch_sampler, "sampler", None)):
        visit(part, 2)  # (a sampler's data_source, the dataset, was seen first, to its depth)
    return found


def _state(gen) -> Any:
    """A generator's state as plain values (``torch.load(weights_only=True)`` reads them)."""
    if isinstance(gen, torch.Generator):
        return gen.get_state()
    if isinstance(gen, random.Random):
        return gen.getstate()
    if isinstance(gen, np.random.RandomState):
        kind, keys, pos, has_gauss, gauss = gen.get_state()
        return {"kind": kind, "keys": keys.tolist(), "pos": pos, "has_gauss": has_gauss, "gauss": gauss}
    return gen.bit_generator.state  # np.random.Generator: a dict of numbers


def _set_state(gen, state: Any) -> None:
    if isinstance(gen, torch.Generator):
        gen.set_state(state)
    elif isinstance(gen, random.Random):
        version, internal, gauss = state
        gen.setstate((version, tuple(internal), gauss))
    elif isinstance(gen, np.random.RandomState):
        gen.set_state((state["kind"], np.array(state["keys"], dtype=np.uint32), state["pos"], state["has_gauss"],
                       state["gauss"]))
    else:
        gen.bit_generator.state = state


def epoch_start(data: Iterable) -> dict:
    """The RNG states an epoch of ``data`` is about to draw its order and its random transforms from: its own
    generators (``_generators``), and the global ones (``rng_state``): a shuffling sampler without a generator
    seeds itself from torch's, and an iterable of your own may draw from Python's ``random`` or NumPy's (a shuffle,
    a window length). A list or tuple draws nothing: none."""
    if isinstance(data, (list, tuple)):
        return {"generators": []}
    return {"generators": [_state(g) for g in _generators(data)], **rng_state()}


def set_generators(data: Iterable, states: dict) -> bool:
    """Put ``data``'s own generators (``epoch_start``'s, not the global ones) as ``states`` has them; False where
    their number or kinds differ."""
    gens = _generators(data)
    if len(gens) != len(states["generators"]):
        return False
    for gen, state in zip(gens, states["generators"]):
        try:
            _set_state(gen, state)
        except (TypeError, ValueError, KeyError, RuntimeError):  # another kind at that place (another pipeline)
            return False
    return True


def fast_forward(data: Iterable, start: dict | None, consumed: int) -> Iterator:
    """An iterator over the interrupted epoch of ``data``, past its first ``consumed`` batches.

    The epoch's order is re-drawn from the RNG states it started with (``start``: its generators and the global
    torch, Python and NumPy ones); the
    consumed batches are loaded and dropped (the only way to get past them for any
    iterable), and the global RNG states are put back afterwards, so the next step draws
    exactly what it would have drawn without the interruption. A list or tuple draws nothing:
    it is only stepped past them.
    """
    if isinstance(data, (list, tuple)):
        return itertools.islice(data, consumed, None)
    now = rng_state()
    if start is not None:
        if not set_generators(data, start):
            log.warning("resume: the data loader has %d generators, the checkpoint %d; the interrupted epoch "
                        "continues in a different order", len(_generators(data)), len(start["generators"]))
        if "python" in start:
            set_rng_state(start)
        elif "torch" in start:  # a checkpoint of an earlier safeloop kept torch's alone
            torch.set_rng_state(start["torch"])
    it = iter(data)
    for _ in range(consumed):
        if next(it, _END) is _END:
            break
    set_rng_state(now)
    return it


_END = object()


def stateful(data) -> bool:
    """Whether ``data`` keeps its own position (``state_dict()`` and ``load_state_dict()``)."""
    return callable(getattr(data, "state_dict", None)) and callable(getattr(data, "load_state_dict", None))


def load_data(data, saved: dict | None) -> None:
    """Put a stateful ``data`` back where the checkpoint's stood (see the module docstring)."""
    if stateful(data) and saved is not None:
        data.load_state_dict(saved)
    elif stateful(data):
        log.warning("resume: the checkpoint holds no state for train_data (a %s with state_dict()): it goes on "
                    "from its own state, not from where the interrupted epoch stopped", type(data).__name__)
    elif saved is not None:
        log.warning("resume: the checkpoint holds the state of a data iterable and train_data (a %s) has no "
                    "load_state_dict(): the interrupted epoch is re-drawn and fast-forwarded instead",
                    type(data).__name__)
