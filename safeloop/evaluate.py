"""Evaluation loops: a model's mean loss(es) over a data set, without gradients, in eval mode."""
from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from contextlib import AbstractContextManager

import torch

from .errors import SafeloopError, StepError


@torch.no_grad()
def mean_losses(model: torch.nn.Module | None, data: Iterable, step_fn: Callable[[object], torch.Tensor | Mapping],
                autocast: Callable[[], AbstractContextManager], move: Callable, step: int) -> dict[str, float]:
    """``step_fn``'s loss (or dict of losses) averaged over the batches of ``data`` (each moved by ``move``),
    ``model`` in eval mode meanwhile. Each module's own mode comes back afterwards: a part frozen in eval
    (BatchNorm statistics) stays frozen. A failure is a ``StepError`` naming the batch (``step``: the
    training step it follows)."""
    modes = [(m, m.training) for m in model.modules()] if model is not None else []
    if model is not None:
        model.eval()
    sums: dict[str, float] = {}
    count = 0
    try:
        for batch in data:
            with autocast():
                out = step_fn(move(batch))
            out = {"loss": out} if isinstance(out, torch.Tensor) else dict(out)
            for name, value in out.items():
                sums[name] = sums.get(name, 0.0) + float(value)
            count += 1
    except Exception as err:
        if isinstance(err, SafeloopError):
            raise
        raise StepError(f"validation at step {step} failed on batch {count + 1} of val_data (training is "
                        f"unchanged): {type(err).__name__}: {err}", step) from err
    finally:
        for module, training in modes:
            module.training = training
    return {name: total / max(count, 1) for name, total in sums.items()}
