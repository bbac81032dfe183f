import logging
import os
import random
import sys
from pathlib import Path

import pytest
import torch
from lightning_utilities.core.rank_zero import rank_zero_only

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # recipes/ and benchmarks/ importable from the checkout
if os.environ.get("PYTEST_XDIST_WORKER"):
    # one worker per core already: torch's own thread per core would have each worker's ops wait for cores the
    # others hold (a 200-step test took 12 s instead of 1); subprocesses get OMP_NUM_THREADS=1 (subprocess_env)
    torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _fresh_state(tmp_path, tmp_path_factory, monkeypatch):
    """Every test starts from the same RNG state, in its own directory, grad mode on; the modules it imported
    from a test's directory (a user's ``cnn.py``, its own or a module fixture's) are forgotten after it, so that
    another test's are found afresh."""
    torch.manual_seed(0)
    random.seed(0)
    monkeypatch.chdir(tmp_path)
    torch.set_grad_enabled(True)
    yield
    torch.set_grad_enabled(True)
    for name, module in list(sys.modules.items()):
        if str(getattr(module, "__file__", None) or "").startswith(str(tmp_path_factory.getbasetemp())):
            del sys.modules[name]


@pytest.fixture(autouse=True)
def _process_state_put_back():
    """What a test changes for the whole process is put back after it, so that no test passes or fails for
    what an earlier one left: anomaly mode (``GraphGuard(trace=True)``), the "safeloop" logger's level and
    handlers (a fit shows its logs), ``sys.argv`` (a CLI run), the rank ``rank_zero_only`` prints from, and
    ``os.environ`` (a fit's seed sets ``SAFELOOP_SEED_WORKERS``, its determinism ``CUBLAS_WORKSPACE_CONFIG``: left
    there, a later command would differ from the fork server's and run as a slow real subprocess)."""
    environ = dict(os.environ)
    anomaly = torch.is_anomaly_enabled(), torch.is_anomaly_check_nan_enabled()
    logger = logging.getLogger("safeloop")
    level, handlers = logger.level, list(logger.handlers)
    argv = sys.argv
    argv_items = list(argv)
    rank = getattr(rank_zero_only, "rank", None)
    yield
    if os.environ != environ:
        os.environ.clear()
        os.environ.update(environ)
    torch.autograd.set_detect_anomaly(*anomaly)
    logger.setLevel(level)
    logger.handlers[:] = handlers
    sys.argv = argv
    argv[:] = argv_items
    if rank is None:
        vars(rank_zero_only).pop("rank", None)
    else:
        rank_zero_only.rank = rank


@pytest.fixture
def one_thread():
    """Bit-identical comparisons with a subprocess need the same thread count on both sides."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def repo_root() -> Path:
    return ROOT


def subprocess_env() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


def manual(cls):
    """``cls`` in manual mode: the loss its training_step makes, back-propagated and stepped by the step itself."""
    class Manual(cls):
        automatic = False

        def training_step(self, batch):
            loss = super().training_step(batch)
            self.backward(loss)
            self.step()
            return loss

    return Manual


def unchecked(cls):
    """``cls`` with the guard off unless a test sets it: no step is walked, so each mistake must be explained
    from backward's own error (or caught by checks that need no walk)."""
    class Unchecked(cls):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **{"guard": {"check": "off"}, **kwargs})

    return Unchecked
