"""safeloop: a PyTorch training loop that keeps the autograd graph's lifecycle safe."""
from .callbacks import Callback
from .errors import (
    CarriedGraphError,
    CheckpointError,
    ConfigError,
    DoubleBackwardError,
    GraphLeakWarning,
    GraphLifecycleError,
    GraphLifecycleWarning,
    GraphReuseError,
    GraphSharingWarning,
    InplaceModificationError,
    NoGraphError,
    NonFiniteError,
    SafeloopError,
    StepError,
)
from .guard import GraphGuard, Guard
from .state import TrainState
from .trainer import Trainer

__all__ = [
    "Callback", "GraphGuard", "Guard", "Trainer", "TrainState",
    "SafeloopError", "ConfigError", "StepError", "NonFiniteError", "CheckpointError",
    "GraphLifecycleError", "GraphLifecycleWarning", "GraphReuseError", "DoubleBackwardError", "CarriedGraphError",
    "NoGraphError", "InplaceModificationError", "GraphSharingWarning", "GraphLeakWarning",
]
__version__ = "0.1.0"
