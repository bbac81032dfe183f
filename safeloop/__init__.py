"""safeloop: a PyTorch training loop that keeps the autograd graph's lifecycle safe."""
from .callbacks import Callback
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
)
from .guard import GraphGuard, Guard
from .state import TrainState
from .trainer import Trainer

__all__ = [
    "Callback", "GraphGuard", "Guard", "Trainer", "TrainState",
    "SafeloopError", "ConfigError", "ConfigWarning", "StepError", "NonFiniteError", "CheckpointError", "Interrupted",
    "GraphLifecycleError", "GraphLifecycleWarning", "GraphReuseError", "DoubleBackwardError", "CarriedGraphError",
    "NoGraphError", "InplaceModificationError", "GraphSharingWarning", "GraphLeakWarning",
]
__version__ = "0.1.0"
