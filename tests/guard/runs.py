"""How the tests of public loops run them: with every warning an error, with a ``GraphGuard`` or under ``watch`` in
process, and compare what they end with."""
import functools
import warnings

import torch

from safeloop import GraphGuard
from safeloop.watch import Watch


def quietly(run, *args, **kwargs):
    """``run(*args, **kwargs)``, every warning an error."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        return run(*args, **kwargs)


def watched(run, check: str, **kwargs):
    """``run(**kwargs)`` under ``watch`` in process (the file ``run`` is written in is the script), every warning an
    error."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with Watch(GraphGuard(check=check), run.__code__.co_filename):
            return run(**kwargs)


def same(a, b) -> bool:
    """Whether two runs ended with the same tensors, bit for bit."""
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


@functools.cache
def bare(loop, *args) -> list[torch.Tensor]:
    """``loop(None, *args)``: the loop without a guard, run once for all the tests that compare with it."""
    return loop(None, *args)
