"""What every parity test shares: Lightning's info lines off, one thread, the seeding variables put back."""
import logging

import pytest


@pytest.fixture(autouse=True)
def _quiet(one_thread, monkeypatch):
    """Lightning's info lines ("GPU available", tips) off; one thread, so that both sides run the same kernels; the
    variables both ``seed_everything`` set put back after."""
    for name in ("PL_GLOBAL_SEED", "PL_SEED_WORKERS", "SAFELOOP_SEED_WORKERS"):
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)
    names = ("pytorch_lightning", "lightning_fabric", "lightning.pytorch", "lightning.fabric")
    levels = {name: logging.getLogger(name).level for name in names}
    for name in names:
        logging.getLogger(name).setLevel(logging.ERROR)
    yield
    for name, level in levels.items():
        logging.getLogger(name).setLevel(level)
