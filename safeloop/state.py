"""TrainState: where training stands. Numbers and detached tensors only, never a graph."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field

import torch


@dataclass
class TrainState:
    """Documented, checkpointed progress of a run.

    Attributes:
        step: optimizer steps completed.
        epoch: passes over ``train_data`` started (0-based).
        batch_in_epoch: batches consumed in the current epoch (micro-batches included; in training_step, those up to
            the micro-batch it runs: Lightning's batch_idx + 1).
        losses: the last step's losses, detached (turned into floats only when logged,
            so that CUDA runs do not sync every step).
        skipped: steps skipped for non-finite values so far (``on_nonfinite: skip``).
        skipped_in_row: of those, how many the last steps skipped in a row (``trainer.max_skipped`` stops
            the run when the next one would exceed it); kept across ``fit()`` calls and resumes.
        val_history: ``(step, {metric: float})`` for every validation run.
    """

    step: int = 0
    epoch: int = 0
    batch_in_epoch: int = 0
    losses: dict[str, torch.Tensor] = field(default_factory=dict)
    skipped: int = 0
    skipped_in_row: int = 0
    val_history: list[tuple[int, dict[str, float]]] = field(default_factory=list)

    def reached(self, max_steps: int | None) -> bool:
        return max_steps is not None and self.step >= max_steps

    @property
    def validated(self) -> bool:
        """Whether the last validation was at this step."""
        return bool(self.val_history) and self.val_history[-1][0] == self.step

    def where(self) -> str:
        return f"step {self.step}, epoch {self.epoch}, {self.batch_in_epoch} batches into it"

    def floats(self) -> dict[str, float]:
        """The last losses as Python floats (a device sync on CUDA)."""
        return {name: float(value) for name, value in self.losses.items()}

    def metrics(self, logged: dict[str, torch.Tensor | float]) -> dict[str, float]:
        """What a log point writes, as floats: the last losses, the values ``Trainer.log`` kept in ``logged``
        (which this empties), and the steps skipped so far, if any."""
        out = {**self.floats(), **{name: float(value) for name, value in logged.items()}}
        logged.clear()
        return {**out, "skipped": self.skipped} if self.skipped else out

    def state_dict(self) -> dict:
        out = asdict(self)
        out["losses"] = self.floats()
        return out

    def load_state_dict(self, data: dict) -> None:
        for key, value in data.items():
            if key == "losses":
                value = {k: torch.tensor(v) for k, v in value.items()}
            elif key == "val_history":
                value = [(int(s), dict(m)) for s, m in value]
            setattr(self, key, value)
