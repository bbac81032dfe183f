"""The non-finite check: NaN or Inf in a step's losses or gradients, found before the optimizer step.

One fused test per step with one host sync, the way ``GradScaler`` looks for overflow:
``_amp_foreach_non_finite_check_and_unscale_`` with a scale of 1 visits every element of
the losses and gradients in one call and raises a flag, on CPU and CUDA alike. It is exact
(a 2-norm of large finite gradients can overflow to Inf; this cannot) and, measured on CPU,
5 µs for a tiny MLP's 8 gradients and 0.5 ms for an 8 x 512 MLP's, 10 to 20 times cheaper
than ``_foreach_norm``. Only when the flag is up is the finer, slower diagnosis run.
"""
from __future__ import annotations

import math
from collections.abc import Iterable, Mapping

import torch

POLICIES = ("error", "skip", "off")


def gradients(optimizers: Iterable[torch.optim.Optimizer]) -> list[torch.Tensor]:
    grads = []
    for opt in optimizers:
        for group in opt.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    grads.append(p.grad._values() if p.grad.is_sparse else p.grad)
    return grads


def all_finite(losses: Iterable[torch.Tensor], grads: list[torch.Tensor]) -> bool:
    """True when every loss and every gradient element is finite. One host sync."""
    values = torch.stack([loss.detach().float().reshape(()) for loss in losses])  # a copy: the test writes
    by_device: dict[torch.device, list[torch.Tensor]] = {values.device: [values]}
    for g in grads:
        by_device.setdefault(g.device, []).append(g)
    flags = []
    for device, tensors in by_device.items():
        found = torch.zeros(1, device=device)
        # multiplies in place by exactly 1.0, which leaves every value (NaN and -0.0 included) as it was
        torch._amp_foreach_non_finite_check_and_unscale_(tensors, found, torch.ones((), device=device))
        flags.append(found.to(values.device))
    found = flags[0] if len(flags) == 1 else torch.stack(flags).sum()
    return not found.item()


def describe(losses: Mapping[str, torch.Tensor], named_params: Iterable[tuple[str, torch.nn.Parameter]]) -> str:
    """What is not finite, for the message (error path only: syncs per tensor)."""
    bad = [f"loss {name!r} is {float(value)}" for name, value in losses.items() if not math.isfinite(float(value))]
    if bad:
        return "; ".join(bad) + " (a non-finite loss makes every gradient non-finite)"
    grads = [name for name, p in named_params if p.grad is not None and not bool(torch.isfinite(p.grad).all())]
    shown = ", ".join(grads[:5]) + (f" and {len(grads) - 5} more" if len(grads) > 5 else "")
    finite = ", ".join(f"{name!r} = {float(value):.4g}" for name, value in losses.items())
    return f"the losses are finite ({finite}) but the gradients of {shown or 'some parameters'} hold NaN or Inf"
