"""Device and precision resolution, checked at start-up."""
from __future__ import annotations

from contextlib import nullcontext
from itertools import chain

import torch

from .errors import ConfigError

PRECISIONS = ("32", "bf16", "16")


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


def resolve_precision(precision: str | int, device: torch.device) -> str:
    precision = str(precision)
    if precision in ("32-true", "fp32"):
        precision = "32"
    if precision not in PRECISIONS:
        raise ConfigError(f"precision={precision!r} is not one of 32, bf16, 16")
    if precision == "16" and device.type != "cuda":
        raise ConfigError("precision=16 needs CUDA (it uses a GradScaler); on CPU use precision=bf16 or 32")
    return precision


def resolve(device: str | torch.device | None, precision: str | int) -> tuple[torch.device, str, list[str]]:
    """``resolve_device`` and ``resolve_precision``, their problems returned (for a start-up check that reports
    every problem at once) rather than raised."""
    try:
        resolved = resolve_device(device)
        return resolved, resolve_precision(precision, resolved), []
    except ConfigError as err:
        return torch.device("cpu"), "32", err.problems


_NO_AUTOCAST = nullcontext()  # stateless, so one instance serves every step


def autocast(precision: str, device: torch.device):
    """The forward's autocast context for ``precision`` (none for 32)."""
    if precision == "32":
        return _NO_AUTOCAST
    dtype = torch.bfloat16 if precision == "bf16" else torch.float16
    return torch.autocast(device_type=device.type, dtype=dtype)
