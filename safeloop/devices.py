"""Device and precision resolution, checked at start-up."""
from __future__ import annotations

from abc import ABC
from contextlib import nullcontext
from itertools import chain
from typing import Any

import torch
from lightning_utilities.core.apply_func import apply_to_collection

from .errors import ConfigError

# each accepted name -> the precision it stands for (Lightning's names, and the short ones)
PRECISIONS = {"32": "32", "32-true": "32", "fp32": "32", "bf16": "bf16", "bf16-mixed": "bf16",
              "bf16-true": "bf16-true", "16": "16", "16-mixed": "16"}
AUTOCAST = {"bf16": torch.bfloat16, "16": torch.float16}  # the mixed precisions: autocast's dtype


def resolve_device(spec: str | torch.device | None) -> torch.device:
    """``auto`` (CUDA when present), ``cpu``, ``cuda`` or ``cuda:N``; a clear error otherwise."""
    spec = "auto" if spec is None else str(spec)
    if spec == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(spec)
    except RuntimeError:
        raise ConfigError(f"device={spec!r} is not a device: use auto, cpu, cuda or cuda:N") from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError(
                f"device={spec!r} asks for CUDA, but torch.cuda.is_available() is False on this machine "
                f"(torch {torch.__version__}). Use device=cpu, or device=auto to take CUDA only when present")
        if device.index is not None and device.index >= torch.cuda.device_count():
            count = torch.cuda.device_count()
            raise ConfigError(f"device={spec!r}: this machine has {count} CUDA device{'s' * (count != 1)} "
                              f"(cuda:0..cuda:{count - 1}); choose one of them, or use device=cuda")
    elif device.type != "cpu":
        raise ConfigError(f"device={spec!r} is not supported: use auto, cpu, cuda or cuda:N")
    return device


def placed(module: torch.nn.Module, device: torch.device) -> bool:
    """Whether every parameter and buffer of ``module`` is on ``device`` already (then ``module.to`` has
    nothing to move: every ``fit()`` asks, and ``to`` costs ~70 µs even then on a small model)."""
    if device.type == "cuda" and device.index is None:  # what module.to("cuda") moves to
        device = torch.device("cuda", torch.cuda.current_device())
    return all(t.device == device for t in chain(module.parameters(), module.buffers()))


def resolve_precision(precision: str | int) -> str:
    """The precision ``precision`` names: ``32``, ``bf16`` (autocast), ``bf16-true`` (bf16 parameters) or ``16``
    (autocast and a GradScaler, on CPU or CUDA)."""
    if str(precision) not in PRECISIONS:
        raise ConfigError(f"precision={str(precision)!r} is not one of {', '.join(PRECISIONS)}")
    return PRECISIONS[str(precision)]


def resolve(device: str | torch.device | None, precision: str | int) -> tuple[torch.device, str, list[str]]:
    """``resolve_device`` and ``resolve_precision``, their problems returned (for a start-up check that reports
    every problem at once) rather than raised."""
    try:
        resolved = resolve_device(device)
        return resolved, resolve_precision(precision), []
    except ConfigError as err:
        return torch.device("cpu"), "32", err.problems


_NO_AUTOCAST = nullcontext()  # stateless, so one instance serves every step


def autocast(precision: str, device: torch.device):
    """The forward's autocast context for ``precision`` (none for 32 and bf16-true)."""
    if precision not in AUTOCAST:
        return _NO_AUTOCAST
    return torch.autocast(device_type=device.type, dtype=AUTOCAST[precision])


def place(module: torch.nn.Module, device: torch.device, precision: str) -> torch.nn.Module:
    """``module`` moved to ``device``; under bf16-true its floating parameters and buffers cast to bf16 as well
    (at every ``fit``, ``test`` and ``predict``, as Lightning does at their start)."""
    return module.to(device, dtype=torch.bfloat16 if precision == "bf16-true" else None)


def moved(tensor: torch.Tensor, device: torch.device, precision: str) -> torch.Tensor:
    """A batch's tensor on ``device``; under bf16-true a floating one in bf16, as the parameters are."""
    dtype = torch.bfloat16 if precision == "bf16-true" and tensor.is_floating_point() else None
    return tensor.to(device, dtype=dtype, non_blocking=True)


class MovesItself(ABC):
    """What has a ``to`` method of its own: a tensor, or Hugging Face's ``BatchEncoding``, whose tokenizer encodings
    (``word_ids()``) a copy rebuilt from its tensors would lose. Lightning's ``move_data_to_device`` and accelerate's
    ``send_to_device`` move such an object whole."""

    @classmethod
    def __subclasshook__(cls, subclass: type) -> bool:
        return callable(getattr(subclass, "to", None)) or NotImplemented


def to_device(batch: Any, device: torch.device, precision: str) -> Any:
    """Every tensor in ``batch`` (lists, tuples, dicts) on ``device`` (``moved``), an object with a ``to`` method of
    its own moved whole by it; under bf16-true the floating tensors inside such an object are cast too (it is then
    rebuilt from its items, as Lightning's precision plugin rebuilds it)."""
    kind = torch.Tensor if precision == "bf16-true" else MovesItself
    return apply_to_collection(batch, kind, lambda x: moved(x, device, precision) if isinstance(x, torch.Tensor)
                               else x.to(device))


def moves(device: torch.device, precision: str) -> bool:
    """Whether batches need ``moved``: DataLoader batches are on the CPU, in float32, already."""
    return device.type != "cpu" or precision == "bf16-true"
