"""The step: what ``training_step`` returned as backwards (``plan``), the one step cycle
(``runner``), and undoing a failed step (``undo``)."""
from .plan import MULTI_LOSS, Backward, named_losses, plan
from .runner import Runner, SkipStep
from .undo import UNDO_MODES, Snapshot, Undo

__all__ = ["MULTI_LOSS", "UNDO_MODES", "Backward", "Runner", "SkipStep", "Snapshot", "Undo", "named_losses", "plan"]
