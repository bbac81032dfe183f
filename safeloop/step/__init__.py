"""The step: what ``training_step`` returned as backwards (``plan``), the one step cycle
(``runner``), and undoing a failed step (``undo``)."""
from .plan import Backward, named_losses, plan
from .runner import Runner, SkipStep, StepConfig
from .undo import Snapshot, Undo

__all__ = ["Backward", "Runner", "SkipStep", "Snapshot", "StepConfig", "Undo", "named_losses", "plan"]
