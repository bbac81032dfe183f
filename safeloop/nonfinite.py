"""The non-finite check: NaN or Inf in a step's losses or gradients, found before the optimizer step.

One fused test per step with one host sync, the way ``GradScaler`` looks for overflow:
``_amp_foreach_non_finite_check_and_unscale_`` with a scale of 1 visits every gradient
element in one call and raises a flag, on CPU and CUDA alike. It is exact, where a 2-norm
of large finite gradients can overflow to Inf; the max-norm, also exact, was 20 times
slower on CPU. Measured alone on one CPU thread: ~18 µs per step for a tiny MLP, ~0.35 ms
for an 8 x 512 MLP (``benchmarks/bench_nonfinite.py`` times it inside the Trainer).
Only when the flag is up is the finer, slower diagnosis run.
"""
from __future__ import annotations

import math
from collections.abc import Iterable, Mapping

import torch

from .fsdp import local


def gradients(optimizers: Iterable[torch.optim.Optimizer]) -> list[torch.Tensor]:
    grads = []
    for opt in optimizers:
        for group in opt.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    grads.append(p.grad._values() if p.grad.is_sparse else local(p.grad))  # a shard under FSDP2
    return grads


class FiniteCheck:
    """The fused test; its flag and scale tensors are kept from step to step, so a step allocates nothing."""

    def __init__(self):
        self._flags: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}

    def __call__(self, losses: Iterable[torch.Tensor], grads: list[torch.Tensor]) -> bool:
        """True when every loss and every gradient element is finite. One host sync."""
        losses = list(losses)
        by_device: dict[torch.device, list[torch.Tensor]] = {losses[0].device: []} if losses else {}
        for g in grads:  # a complex gradient as its real and imaginary parts (no complex kernel for the check)
            by_device.setdefault(g.device, []).append(torch.view_as_real(g) if g.is_complex() else g)
        if not by_device:
            return True
        flags = []
        for device, tensors in by_device.items():
            if device not in self._flags:
                self._flags[device] = torch.zeros(1, device=device), torch.ones((), device=device)
            found, one = self._flags[device]
            found.zero_()
            if tensors:  # multiplies in place by exactly 1.0: every value (NaN, -0.0) stays as it was
                torch._amp_foreach_non_finite_check_and_unscale_(tensors, found, one)
            flags.append(found)
        found = flags[0]
        for loss in losses:  # 0 * a finite loss is 0; 0 * NaN or Inf is NaN, which stays in the flag
            found.add_(loss.detach() * 0)
        if len(flags) > 1:
            found = found + sum(f.to(found.device) for f in flags[1:])
        return found.item() == 0


def describe(losses: Mapping[str, torch.Tensor], named_params: Iterable[tuple[str, torch.nn.Parameter]]) -> str:
    """What is not finite, for the message (error path only: syncs per tensor)."""
    bad = [f"loss {name!r} is {float(value)}" for name, value in losses.items() if not math.isfinite(float(value))]
    named_params = list(named_params)
    grads = [name for name, p in named_params if p.grad is not None and not bool(torch.isfinite(local(p.grad)).all())]
    if bad and (grads or not any(p.grad is not None for _, p in named_params)):
        return "; ".join(bad) + " (a non-finite loss makes every gradient non-finite)"
    if bad:  # a mean over an empty batch (opacus's Poisson sampling draws them) is NaN, its gradients zero
        return "; ".join(bad) + " but every gradient is finite (a mean over an empty batch is NaN with zero gradients)"
    shown = ", ".join(grads[:5]) + (f" and {len(grads) - 5} more" if len(grads) > 5 else "")
    where = f"the gradients of {shown or 'some parameters'} hold NaN or Inf"
    if not losses:  # manual mode, gradients written by hand (no self.backward in the step)
        return f"{where} (no loss was back-propagated in this step, so no loss was checked)"
    finite = ", ".join(f"{name!r} = {float(value):.4g}" for name, value in losses.items())
    return f"the losses are finite ({finite}) but {where}"
