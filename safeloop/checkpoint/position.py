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


def _generators(data: Iterable) -> list[torch.Generator]:
    """The generators an epoch of ``data`` draws its order from: the DataLoader's and its samplers'."""
    found: list[torch.Generator] = []
    batch_sampler = getattr(data, "batch_sampler", None)
    for obj in (data, getattr(data, "sampler", None), getattr(batch_sampler, "sampler", None)):
        gen = getattr(obj, "generator", None)
        if isinstance(gen, torch.Generator) and all(gen is not g for g in found):
            found.append(gen)
    return found


def epoch_start(data: Iterable) -> dict:
    """The RNG states an epoch of ``data`` is about to draw its order from: its own generators, and the global
    ones (``rng_state``): a shuffling sampler without a generator seeds itself from torch's, and an iterable of
    your own may draw from Python's ``random`` or NumPy's (a shuffle, a window length). A list or tuple draws
    nothing: none."""
    if isinstance(data, (list, tuple)):
        return {"generators": []}
    return {"generators": [g.get_state() for g in _generators(data)], **rng_state()}


def set_generators(data: Iterable, states: dict) -> bool:
    """Put ``data``'s own generators (``epoch_start``'s, not the global one) as ``states`` has them; False where
    their number differs."""
    gens = _generators(data)
    if len(gens) != len(states["generators"]):
        return False
    for gen, state in zip(gens, states["generators"]):
        gen.set_state(state)
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
