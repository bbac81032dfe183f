"""Each test starts from the process state the one before it found (``tests/conftest.py``): these two run in
this order, the first changing that state as a test may, the second finding it as the first did."""
import logging
import sys

import torch
from lightning_utilities.core.rank_zero import rank_zero_only

FOUND = {}


def process_state() -> dict:
    logger = logging.getLogger("safeloop")
    return {"anomaly": (torch.is_anomaly_enabled(), torch.is_anomaly_check_nan_enabled()), "level": logger.level,
            "handlers": list(logger.handlers), "argv": list(sys.argv), "rank": getattr(rank_zero_only, "rank", None)}


def test_a_test_changes_the_process_state():
    FOUND.update(process_state())
    torch.autograd.set_detect_anomaly(True, check_nan=False)  # as a guard with trace=True, never closed
    logging.getLogger("safeloop").setLevel(logging.DEBUG)
    logging.getLogger("safeloop").addHandler(logging.StreamHandler())
    sys.argv[1:] = ["trainer.max_steps=3"]
    rank_zero_only.rank = 1
    assert process_state() != FOUND


def test_the_next_test_finds_it_as_the_test_before_found_it():
    assert FOUND and process_state() == FOUND
