"""Precisions on the CPU, by each of their names: each trains, an alias trains as its canonical name does,
and the guard, the undo of a failed step and the non-finite policy work in each (tests/test_cuda.py: on CUDA)."""
import re

import pytest
import torch

from safeloop import CarriedGraphError, ConfigError, StepError, Trainer

from .test_errors import FailsAfterBackward, Poisoned, data, same, snapshot

NAMES = [("32", "32-true"), ("bf16", "bf16-mixed"), ("bf16-true",), ("16", "16-mixed")]


def trainer(cls=Trainer, **settings) -> Trainer:
    torch.manual_seed(0)
    settings = {"max_steps": 6, "device": "cpu", "progress": False, "loggers": (), **settings}
    return cls(torch.nn.Linear(3, 1), data(), lambda p: torch.optim.Adam(p, lr=0.1), **settings)


@pytest.mark.parametrize("names", NAMES, ids=lambda names: names[0])
def test_each_precision_trains_and_its_lightning_name_trains_the_same(names):
    runs = [trainer(precision=name) for name in names]
    start = [p.detach().float().clone() for p in runs[0].model.parameters()]
    for t in runs:
        t.fit()
    first = runs[0]
    assert first.precision == names[0] and all(t.precision == names[0] for t in runs)
    assert torch.isfinite(first.state.losses["loss"]) and first.state.step == 6
    assert any(not torch.equal(a, b.float()) for a, b in zip(start, first.model.parameters()))
    for t in runs[1:]:  # bit-identical
        assert all(torch.equal(a, b) for a, b in zip(first.model.parameters(), t.model.parameters()))
    dtype = torch.bfloat16 if names[0] == "bf16-true" else torch.float32
    assert all(p.dtype == dtype for t in runs for p in t.model.parameters())
    assert all((t.scaler is not None) == (names[0] == "16") for t in runs)
    if names[0] == "16":  # the losses went through the GradScaler on the CPU (it makes its scale at the first scale())
        assert first.scaler._scale is not None and first.scaler._scale.device.type == "cpu"


def test_bf16_true_casts_the_model_and_the_batches_for_predict_before_any_fit():
    t = trainer(precision="bf16-true")
    outputs = t.predict(data(2))
    assert t.model.weight.dtype == torch.bfloat16 and all(out.dtype == torch.bfloat16 for out in outputs)


@pytest.mark.parametrize("precision", ["32", "bf16", "bf16-true", "16"])
def test_the_guard_the_undo_and_the_nonfinite_policy_work_in_each_precision(precision):
    class Carries(Trainer):
        held = None

        def training_step(self, batch):
            loss = super().training_step(batch)
            self.held = loss = loss if self.held is None else loss + self.held
            return loss

    with pytest.raises(CarriedGraphError, match=r"graph carried over from an earlier step \(step 2"):
        trainer(Carries, precision=precision).fit()
    failed = trainer(FailsAfterBackward, precision=precision)
    with pytest.raises(StepError, match="step 3 failed and was abandoned"):
        failed.fit()
    assert same(snapshot(failed), failed.before)

    class NaNAt3(Poisoned):  # the GradScaler's state is part of what a skipped step must leave as it was
        nan_at = (3,)

        def training_step(self, batch):
            self.scale = self.scaler.state_dict() if self.scaler is not None else None
            return super().training_step(batch)

    skipped = trainer(NaNAt3, precision=precision, on_nonfinite="skip", max_steps=3)
    skipped.fit()
    assert skipped.state.skipped == 1 and same(snapshot(skipped), skipped.before)
    assert skipped.scale == (skipped.scaler.state_dict() if precision == "16" else None)


def test_an_unknown_precision_lists_the_names():
    with pytest.raises(ConfigError, match=re.escape(
            "precision='fp16' is not one of 32, 32-true, fp32, bf16, bf16-mixed, bf16-true, 16, 16-mixed")):
        trainer(precision="fp16")
