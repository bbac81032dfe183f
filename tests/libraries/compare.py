"""What the library tests compare with: every bit of what two runs end with."""
import math

import torch
import torch.nn as nn


def same(ours, ref, where="result") -> None:
    """``ours`` equals ``ref`` bit for bit: modules (every parameter and buffer), tensors (their bits: a NaN equals
    the same NaN), dicts, lists and numbers."""
    if isinstance(ref, nn.Module):
        for kind in ("named_parameters", "named_buffers"):
            same(dict(getattr(ours, kind)()), dict(getattr(ref, kind)()), f"{where}.{kind[6:]}")
    elif isinstance(ref, torch.Tensor):
        assert ours.dtype == ref.dtype and ours.shape == ref.shape, where
        if ref.is_floating_point():
            assert torch.equal(ours.detach().reshape(-1).view(torch.uint8),
                               ref.detach().reshape(-1).view(torch.uint8)), where
        else:
            assert torch.equal(ours, ref), where
    elif isinstance(ref, dict):
        assert ours.keys() == ref.keys(), where
        for k in ref:
            same(ours[k], ref[k], f"{where}[{k!r}]")
    elif isinstance(ref, (list, tuple)):
        assert len(ours) == len(ref), where
        for i, (a, b) in enumerate(zip(ours, ref)):
            same(a, b, f"{where}[{i}]")
    elif isinstance(ref, float) and math.isnan(ref):
        assert isinstance(ours, float) and math.isnan(ours), where
    else:
        assert ours == ref, where
