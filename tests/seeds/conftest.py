import pytest
import torch

from safeloop import Trainer


@pytest.fixture
def fit():
    """Build a Trainer subclass with a small model and fit it for a few steps; returns the trainer."""
    def run(cls=Trainer, model=None, steps=3, data=None, optimizer=None, **kwargs):
        model = model if model is not None else torch.nn.Linear(4, 2)
        trainer = cls(model=model, train_data=data if data is not None else [torch.randn(3, 4)] * 8,
                      optimizer=optimizer or (lambda p: torch.optim.SGD(p, lr=0.1)), max_steps=steps,
                      device="cpu", progress=False, loggers=(), **kwargs)
        trainer.fit()
        return trainer
    return run
