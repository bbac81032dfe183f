"""Seed 004: detached tensors, requires_grad never set, in-place edits, repeated backward."""
import warnings

import pytest
import torch

from safeloop import NoGraphError, Trainer


def test_all_parameters_frozen(fit):
    model = torch.nn.Linear(4, 2).requires_grad_(False)

    class Step(Trainer):
        def training_step(self, batch):
            return (self.model(batch) * 2).sum()

    with pytest.raises(NoGraphError, match=r"every parameter of the model has requires_grad=False.*To fix: "
                       r"unfreeze the parameters you want to train"):
        fit(Step, model=model, optimizer=lambda p: torch.optim.SGD(list(p), lr=0.1))


def test_loss_from_inputs_only(fit):
    class Step(Trainer):
        def training_step(self, batch):
            x = torch.randn(3)  # requires_grad defaults to False
            return (x * 2).sum()

    with pytest.raises(NoGraphError, match="does not depend on any tensor that requires grad"):
        fit(Step)


def test_item_round_trip(fit):
    class Step(Trainer):
        def training_step(self, batch):
            return torch.tensor(self.model(batch).pow(2).mean().item())

    with pytest.raises(NoGraphError, match=r"rebuilt from Python numbers \(.item\(\).*use the tensor itself"):
        fit(Step)


def test_inference_mode(fit):
    class Step(Trainer):
        def training_step(self, batch):
            with torch.inference_mode():
                return self.model(batch).sum()

    with pytest.raises(NoGraphError, match=r"computed under torch.inference_mode\(\)"):
        fit(Step)


def test_diagnosis_rerun_changes_nothing(fit):
    """Finding the cause re-runs training_step once; RNG state and buffers come back as they were."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4))
    after_first = []

    class Step(Trainer):
        def training_step(self, batch):
            torch.rand(1)
            out = self.model(batch).detach().sum()
            if not after_first:
                after_first.append((torch.get_rng_state(), self.model[1].running_mean.clone()))
            return out

    with pytest.raises(NoGraphError):
        fit(Step, model=model)
    rng, running_mean = after_first[0]
    assert torch.equal(torch.get_rng_state(), rng)
    assert torch.equal(model[1].running_mean, running_mean)


def test_fixed_examples_run_clean(fit):
    class Step(Trainer):
        def training_step(self, batch):
            y = self.model(batch) * 2
            y += 1  # in place, but nothing saved it
            return y.pow(2).mean()

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        trainer = fit(Step, steps=5, guard={"check": "always"})
    assert trainer.state.step == 5
