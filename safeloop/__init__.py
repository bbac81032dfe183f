"""safeloop: a PyTorch training loop that keeps the autograd graph's lifecycle safe."""
from .callbacks import Callback
from .errors import (
    CarriedGraphError,
    ConfigError,
    DoubleBackwardError,
    GraphLeakWarning,
    GraphLifecycleError,
    GraphReuseError,
    GraphSharingWarning,
    InplaceModificationError,
    NoGraphError,
    SafeloopError,
    StepError,
)
from .guard import Guard
from .state import TrainState
from .trainer import Trainer

__all__ = [
    "Callback", "Guard", "Trainer", "TrainState",
    "SafeloopError", "ConfigError", "StepError",
    "GraphLifecycleError", "GraphReuseError", "DoubleBackwardError", "CarriedGraphError",
    "NoGraphError", "InplaceModificationError", "GraphSharingWarning", "GraphLeakWarning",
]
__version__ = "0.1.0"
