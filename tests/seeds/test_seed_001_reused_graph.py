"""Seed 001: ``y = t @ a`` built once, outside the loop, and used by every step's loss."""
import logging
import warnings

import pytest
import torch

from safeloop import GraphReuseError, GraphSharingWarning, InplaceModificationError, Trainer

measure = torch.nn.MSELoss()
x = torch.tensor([1, 0], dtype=torch.float64)


class Seed001(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.t = torch.nn.Parameter(torch.eye(2, dtype=torch.float64))
        self.a = torch.nn.Parameter(torch.ones(2, dtype=torch.float64))


class ReusesY(Trainer):
    """The user's code: y computed once in __init__ (as at module level in the seed)."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.y = self.model.t @ self.model.a

    def training_step(self, batch):
        t = self.model.t
        return measure(t @ (x + self.y), x)


class RecomputesY(Trainer):
    def training_step(self, batch):
        t, a = self.model.t, self.model.a
        return measure(t @ (x + t @ a), x)


class DetachedY(ReusesY):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.y = self.y.detach()  # a constant input: no gradient flows into y's graph


def test_reuse_is_caught_at_the_first_step_before_any_grad_changes(fit):
    model = Seed001()
    with pytest.raises(GraphReuseError) as info:
        fit(ReusesY, model=model)
    err = info.value
    assert (err.step, err.loss_name, err.node_name, err.holder) == (1, "loss", "MvBackward0", "self.y")
    assert "built before the step" in str(err) and "the next step would fail" in str(err)
    assert "recompute `self.y` inside training_step" in err.fixes[0]
    assert "store `self.y.detach()` instead" in err.fixes[1]
    assert any("do not pass retain_graph=True" in f for f in err.fixes)
    assert all(p.grad is None for p in model.parameters())
    assert torch.equal(model.t, torch.eye(2, dtype=torch.float64))


def test_module_level_tensor_is_named_as_a_global(fit):
    t = torch.eye(2, dtype=torch.float64, requires_grad=True)
    a = torch.ones(2, dtype=torch.float64, requires_grad=True)
    global y
    y = t @ a

    class Seed(Trainer):
        def training_step(self, batch):
            return measure(t @ (x + y), x)

    with pytest.raises(GraphReuseError, match=r"held by `global y`.*recompute `y` inside training_step"):
        fit(Seed, optimizer=lambda p: torch.optim.SGD([t, a], lr=0.1))


def test_the_fixed_versions_train_cleanly(fit):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fit(RecomputesY, model=Seed001(), steps=5, guard={"check": "always"})
        fit(DetachedY, model=Seed001(), steps=5, guard={"check": "always"})


class ReusesYOfConstantT(Trainer):
    """y = t @ a with t constant: the reused graph saves only t, which nothing changes."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.t = torch.eye(2, dtype=torch.float64) * 2
        self.y = self.t @ self.model.a

    def training_step(self, batch):
        return measure(self.model.t @ (x + self.y), x)


def test_retain_policy_back_propagates_the_shared_graph_every_step(fit, caplog):
    caplog.set_level(logging.INFO, logger="safeloop")
    model = Seed001()
    before = model.a.detach().clone()
    trainer = fit(ReusesYOfConstantT, model=model, steps=4, guard={"on_reuse": "retain"})
    assert trainer.state.step == 4
    assert not torch.equal(model.a, before)  # a still receives gradient through the kept graph
    assert "guard.on_reuse=retain retains it" in caplog.text


def test_retain_policy_cannot_keep_a_graph_whose_parameters_the_optimizer_changed(fit):
    """What users get from retain_graph=True in seed 001: the next step finds t updated in place."""
    model = Seed001()
    with pytest.raises(InplaceModificationError, match=r"step 2.*reaches MvBackward0, built before the step and "
                       r"held by `self.y`.*goes stale and retain_graph cannot help") as info:
        fit(ReusesY, model=model, steps=4, guard={"on_reuse": "retain"})
    assert info.value.holder == "self.y" and info.value.step == 2


def test_warn_policy_warns_once_and_trains(fit):
    with pytest.warns(GraphSharingWarning, match="reusing a graph built before the step") as record:
        trainer = fit(ReusesYOfConstantT, model=Seed001(), steps=4, guard={"on_reuse": "warn", "check": "always"})
    assert trainer.state.step == 4
    assert len([w for w in record if issubclass(w.category, GraphSharingWarning)]) == 1


def test_graph_without_saved_tensors_is_a_warning_not_an_error(fit):
    """Seed 002's addition case: nothing to free, so it works, but the sharing is fragile."""
    class AddOnly(Trainer):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.offset = self.model.bias + 1  # AddBackward0 saves no tensor

        def training_step(self, batch):
            return (self.model(batch) + self.offset).sum()

    with pytest.warns(GraphSharingWarning, match=r"reaches AddBackward0.*held by self.offset.*saves no tensors"):
        trainer = fit(AddOnly, steps=3)
    assert trainer.state.step == 3


def test_retain_policy_keeps_a_reused_graph_that_two_losses_reach(fit):
    """Every backward through the kept graph retains it, the last loss's included."""
    class TwoLossesOnY(ReusesYOfConstantT):
        def training_step(self, batch):
            t = self.model.t
            return {"first": measure(t @ (x + self.y), x), "second": (t @ self.y).pow(2).sum()}

    trainer = fit(TwoLossesOnY, model=Seed001(), steps=3, guard={"on_reuse": "retain", "check": "always"})
    assert trainer.state.step == 3
