"""safeloop: a PyTorch training loop that keeps the autograd graph's lifecycle safe."""
import warnings

from .callbacks import Callback, EarlyStopping
from .errors import (
    CarriedGraphError,
    CheckpointError,
    ConfigError,
    ConfigWarning,
    DoubleBackwardError,
    GraphLeakWarning,
    GraphLifecycleError,
    GraphLifecycleWarning,
    GraphReuseError,
    GraphSharingWarning,
    InplaceModificationError,
    Interrupted,
    NoGraphError,
    NonFiniteError,
    SafeloopError,
    StepError,
    UnusedGradientWarning,
)
from .guard import GraphGuard
from .seed import seed_everything, seed_worker
from .state import TrainState
from .trainer import Trainer

__all__ = [
    "Callback", "EarlyStopping", "GraphGuard", "Trainer", "TrainState", "seed_everything", "seed_worker",
    "SafeloopError", "ConfigError", "ConfigWarning", "StepError", "NonFiniteError", "CheckpointError", "Interrupted",
    "GraphLifecycleError", "GraphLifecycleWarning", "GraphReuseError", "DoubleBackwardError", "CarriedGraphError",
    "NoGraphError", "InplaceModificationError", "GraphSharingWarning", "GraphLeakWarning",
    "UnusedGradientWarning",
]
__version__ = "0.1.0"


def __getattr__(name: str):
    if name == "Guard":  # the guard's engine, once exported here
        from .guard.guard import Guard

        warnings.warn("safeloop.Guard is the guard's internal engine: use safeloop.GraphGuard in a plain loop, "
                      "or Trainer(guard={...}) (or Trainer(guard=GraphGuard(...))) with the Trainer",
                      DeprecationWarning, stacklevel=2)
        return Guard
    raise AttributeError(f"module 'safeloop' has no attribute {name!r}")
