"""Evaluation loops: a model's mean loss(es) per sample over a data set, without gradients, in eval mode.

Each batch's losses count as many times as the batch has samples, so that the result is the mean over
samples whatever the batch sizes (a smaller last batch weighs less). A batch's number of samples is the
leading size of its first tensor, as Lightning infers ``batch_size``; a ``validation_step`` that knows
better returns ``(losses, n)``. Under torchrun each rank evaluates its own share of the data
(``Distributed.shard_val``) and one all-reduce adds up the ranks' sums and counts, so that every rank
gets the same metrics over the whole set.
"""
from __future__ import annotations

import math
import numbers
import warnings
from collections.abc import Callable, Iterable, Mapping
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING

import torch
from lightning_utilities.core.apply_func import apply_to_collection

from .checkpoint import rng_state, set_rng_state
from .errors import ConfigError, ConfigWarning, SafeloopError, StepError

if TYPE_CHECKING:
    from .distributed import Distributed


@torch.no_grad()
def mean_losses(model: torch.nn.Module | None, data: Iterable, step_fn: Callable[[object], torch.Tensor | Mapping],
                autocast: Callable[[], AbstractContextManager], move: Callable, step: int,
                dist: Distributed | None = None) -> dict[str, float]:
    """``step_fn``'s loss (or dict of losses) over the samples of ``data`` (each batch moved by ``move``),
    ``model`` in eval mode meanwhile; under torchrun (``dist``) over every rank's share. Each module's own
    mode comes back afterwards: a part frozen in eval (BatchNorm statistics) stays frozen. So do the global
    random generators: a DataLoader's iterator draws a seed from torch's, a step may use dropout or
    Python's and numpy's, and training must draw what it would have drawn without this evaluation.
    A failure is a ``StepError`` naming the batch (``step``: the training step it follows)."""
    modes = [(m, m.training) for m in model.modules()] if model is not None else []
    if model is not None:
        model.eval()
    rng = rng_state()
    totals: dict[str, list[float]] = {}  # name: [sum of loss * samples, samples]
    done = 0
    try:
        for batch in dist.shard_val(data) if dist is not None else data:
            with autocast():
                out = step_fn(move(batch))
            losses, n = counted(out) if isinstance(out, tuple) else (out, samples(batch))
            losses = {"loss": losses} if isinstance(losses, torch.Tensor) else dict(losses)
            for name, value in losses.items():
                total = totals.setdefault(name, [0.0, 0.0])
                total[0] += float(value) * float(n)
                total[1] += float(n)
            done += 1
        if not done and dist is None:  # (under torchrun a rank may have none of a small val_data)
            raise ConfigError("val_data yielded no batches: check the dataset and batch size, or pass no val_data")
    except Exception as err:
        if isinstance(err, SafeloopError):
            raise
        raise StepError(f"validation at step {step} failed on batch {done + 1} of val_data (training is "
                        f"unchanged): {type(err).__name__}: {err}", step) from err
    finally:
        for module, training in modes:
            module.training = training
        set_rng_state(rng)
    if dist is not None:
        totals = summed(totals, done, dist)
    return {name: total / count if count else math.nan for name, (total, count) in totals.items()}


def counted(out: tuple) -> tuple:
    """``validation_step``'s ``(losses, n)``, checked: a tuple of two losses would pass for one loss counted
    by the other's value."""
    losses, n = out if len(out) == 2 else (None, None)
    if isinstance(n, torch.Tensor) and n.numel() == 1 and not n.is_floating_point():
        n = int(n)
    if not isinstance(n, numbers.Integral):  # an int, or numpy's
        raise TypeError(f"validation_step returned a tuple of {', '.join(type(v).__name__ for v in out)}: a tuple "
                        "is (losses, number of samples), the number an int; several losses go in a dict")
    return losses, n


def samples(batch) -> int:
    """The number of samples in ``batch``: the leading size of its first tensor (of any nesting of lists,
    tuples, dicts, dataclasses). Tensors of other leading sizes beside it get a warning: the count may be
    wrong, and only ``validation_step`` can say."""
    sizes: list[int] = []
    apply_to_collection(batch, torch.Tensor, lambda t: sizes.append(t.shape[0]) if t.dim() else None)
    if not sizes:
        raise ValueError("the batch holds no tensor to count its samples by (each batch's losses count as many "
                         "times as it has samples: the leading size of its first tensor); return (losses, number "
                         "of samples) from validation_step")
    if len(set(sizes)) > 1:
        warnings.warn("a val_data batch holds tensors of different leading sizes: its losses count as many times as "
                      "the first tensor's leading size; if that is not its number of samples, return (losses, "
                      "number of samples) from validation_step", ConfigWarning, stacklevel=3)
    return sizes[0]


def summed(totals: dict[str, list[float]], batches: int, dist: Distributed) -> dict[str, list[float]]:
    """Every rank's ``totals`` added up, in one all-reduce: the same on every rank."""
    if not batches:  # its all-reduce would not match the others' (it knows no loss names)
        raise SafeloopError(f"val_data gave rank {dist.rank} of {dist.world} no batch to validate: each rank "
                            "validates its own share, so give val_data at least one batch per rank")
    names = sorted(totals)  # the same order on every rank
    flat = dist.sum(torch.tensor([totals[name] for name in names], dtype=torch.float64))
    return dict(zip(names, flat.tolist()))
