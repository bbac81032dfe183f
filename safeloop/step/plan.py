"""Turning what ``training_step`` returned into an ordered list of backwards."""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from ..errors import StepError


@dataclass(slots=True)
class Backward:
    """One backward of the step: which loss, into which parameters, retaining or not."""

    name: str
    loss: torch.Tensor
    optimizer: str | None  # the optimizer this loss's gradient is for (None: the only one)
    inputs: list[torch.Tensor] | None  # backward(inputs=...) when losses are routed
    retain: bool


def named_losses(output, step: int, optimizer_names) -> dict[str, torch.Tensor]:
    """Check ``training_step``'s return value; a single tensor becomes ``{'loss': tensor}``."""
    if type(output) is torch.Tensor and output.numel() == 1 and len(optimizer_names) <= 1:  # the common case
        return {"loss": output}
    hint = "training_step must return the loss tensor, or a dict {name: loss tensor}"
    if output is None:
        raise StepError(f"step {step}: training_step returned None; {hint} (did you forget `return loss`?)", step)
    if isinstance(output, torch.Tensor):
        if len(optimizer_names) > 1:
            raise StepError(
                f"step {step}: training_step returned one loss tensor, and there are several optimizers "
                f"({sorted(optimizer_names)}): return a dict {{optimizer name: loss}}, so that each loss's "
                "gradient goes to its optimizer's parameters", step)
        output = {"loss": output}
    elif not isinstance(output, Mapping):
        raise StepError(f"step {step}: training_step returned a {type(output).__name__}; {hint}", step)
    losses = {}
    for name, value in output.items():
        if not isinstance(value, torch.Tensor):
            raise StepError(
                f"step {step}: training_step returned {name!r} = {type(value).__name__}, not a tensor; {hint}", step)
        if value.numel() != 1:
            raise StepError(
                f"step {step}: loss {name!r} has shape {tuple(value.shape)}; a loss must be a scalar "
                "(reduce it with .mean() or .sum())", step)
        losses[str(name)] = value
    if not losses:
        raise StepError(f"step {step}: training_step returned an empty dict; {hint}", step)
    if len(optimizer_names) > 1:
        unknown = [n for n in losses if n not in optimizer_names]
        if unknown:
            raise StepError(
                f"step {step}: loss {unknown[0]!r} names no optimizer; with several optimizers each loss "
                f"key must be one of {sorted(optimizer_names)} (the names configure_optimizers returned)", step)
    return losses


def plan(
    losses: Mapping[str, torch.Tensor],
    optimizers: Mapping[str, torch.optim.Optimizer],
    retain: list[bool] | None,
    mode: str = "sequential",
    weights: Mapping[str, float] | None = None,
) -> list[Backward]:
    """The ordered backwards for one micro-batch.

    ``retain`` comes from the guard's walk (a backward retains only when a later loss
    shares its graph); without a walk every backward but the last retains.
    """
    routed = len(optimizers) > 1
    if len(losses) == 1 and not routed and not weights:  # the common step: one loss, one optimizer
        (name, loss), = losses.items()
        return [Backward(name, loss, None, None, bool(retain and retain[0]))]
    weights = weights or {}
    if mode == "sum" and not routed and len(losses) > 1:
        total = None
        for name, loss in losses.items():  # no 0 + and no * 1.0: as cheap as adding them by hand
            loss = loss * weights[name] if name in weights else loss
            total = loss if total is None else total + loss
        return [Backward("sum", total, None, None, False)]
    names = list(losses)
    if retain is None:
        retain = [True] * (len(names) - 1) + [False]
    out = []
    for i, name in enumerate(names):
        loss = losses[name] * weights[name] if name in weights else losses[name]
        inputs = None
        if routed:
            inputs = [p for g in optimizers[name].param_groups for p in g["params"] if p.requires_grad]
        out.append(Backward(name, loss, name if routed else None, inputs, retain[i]))
    return out
