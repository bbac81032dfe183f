"""How the tests of public loops run them: with every warning an error, with a ``GraphGuard`` or under ``watch`` in
process."""
import warnings

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
