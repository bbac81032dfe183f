"""Seed 001: ``y = t @ a`` built once, outside the loop, and used by every step's loss."""
import copy
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
        # the model stays fixed (the seed trains t and a, tensors of its own)
        fit(Seed, model=torch.nn.Linear(4, 2).requires_grad_(False), optimizer=lambda p: torch.optim.SGD([t, a], lr=0.1))


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


def test_warn_policy_warns_once_and_trains(fit, caplog):
    with pytest.warns(GraphSharingWarning, match="reusing a graph built before the step") as record, \
            caplog.at_level(logging.INFO, logger="safeloop"):
        trainer = fit(ReusesYOfConstantT, model=Seed001(), steps=4, guard={"on_reuse": "warn", "check": "always"})
    assert trainer.state.step == 4
    assert len([w for w in record if issubclass(w.category, GraphSharingWarning)]) == 1
    assert "reusing a graph" not in caplog.text  # said once: the warning, not a log line too


def test_graph_without_saved_tensors_is_a_warning_not_an_error(fit):
    """Seed 002's addition case: nothing to free, so it works, but the sharing is fragile."""
    class AddOnly(Trainer):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.offset = self.model.bias + 1  # AddBackward0 saves no tensor

        def training_step(self, batch):
            return (self.model(batch) + self.offset).sum()

    with pytest.warns(GraphSharingWarning, match=r"reaches AddBackward0, built before training started from the "
                      r"trained `self.model.bias` and held by `self.offset`; its value does not follow") as record:
        trainer = fit(AddOnly, steps=3)
    assert trainer.state.step == 3
    [warning] = [w.message for w in record if isinstance(w.message, GraphSharingWarning)]
    assert (warning.step, warning.loss_name, warning.node_name, warning.holder) == (1, "loss", "AddBackward0",
                                                                                     "self.offset")
    assert warning.fixes == ["compute `self.offset` inside training_step, so it follows the parameters it is made from"]


def test_a_graph_that_saves_tensors_below_one_that_does_not_is_caught_at_the_first_step(fit):
    """With a vector t, ``y = t @ a`` reaches the step through SqueezeBackward4 (saves nothing) over
    MmBackward0 (saves t and a): judged by the whole graph below, it is the headline mistake."""
    class VectorT(Trainer):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.y = (self.model.t[:1] @ self.model.a.unsqueeze(1)).squeeze(1) + 1  # Add over Squeeze over Mm

        def training_step(self, batch):
            return measure(self.model.t @ (x + self.y), x)

    model = Seed001()
    with pytest.raises(GraphReuseError, match=r"step 1.*reaches AddBackward0, built before the step.*held by "
                       r"`self.y` \(its graph saves tensors in MmBackward0\); this step's backward will free") as info:
        fit(VectorT, model=model)
    assert (info.value.node_name, info.value.holder) == ("AddBackward0", "self.y")
    assert all(p.grad is None for p in model.parameters())


def test_an_input_that_requires_grad_made_before_training_is_fine(fit):
    """``x = torch.tensor(X, requires_grad=True).float()``: the input idiom of physics-informed nets, which
    differentiate the output with respect to x. Its graph saves nothing and feeds no trained parameter:
    no warning (advice to detach it would break the program), and the same result as the hand loop."""
    X = [[0.1 * i, 0.2] for i in range(8)]
    xs = torch.tensor(X, dtype=torch.float64, requires_grad=True).float()  # ToCopyBackward0, built once

    def pde_loss(net):
        u = net(xs)
        du = torch.autograd.grad(u.sum(), xs, create_graph=True)[0]
        return (du[:, 0] - u[:, 0]).pow(2).mean() + u.pow(2).mean()

    class Pinn(Trainer):
        def training_step(self, batch):
            return pde_loss(self.model)

    torch.manual_seed(0)
    ref = torch.nn.Sequential(torch.nn.Linear(2, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    ours = copy.deepcopy(ref)
    opt = torch.optim.Adam(ref.parameters(), 1e-2)
    for _ in range(4):
        opt.zero_grad()
        pde_loss(ref).backward()
        opt.step()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fit(Pinn, model=ours, steps=4, optimizer=lambda p: torch.optim.Adam(p, 1e-2), guard={"check": "always"})
    assert all(torch.equal(a, b) for a, b in zip(ours.parameters(), ref.parameters()))


def test_retain_policy_keeps_a_reused_graph_that_two_losses_reach(fit):
    """Every backward through the kept graph retains it, the last loss's included."""
    class TwoLossesOnY(ReusesYOfConstantT):
        def training_step(self, batch):
            t = self.model.t
            return {"first": measure(t @ (x + self.y), x), "second": (t @ self.y).pow(2).sum()}

    trainer = fit(TwoLossesOnY, model=Seed001(), steps=3, guard={"on_reuse": "retain", "check": "always"})
    assert trainer.state.step == 3


def test_a_graph_guard_handed_to_the_trainer_speaks_of_training_step():
    """``Trainer(guard=GraphGuard(...))``: the same engine, and its messages in the Trainer's words."""
    from safeloop import GraphGuard

    model = Seed001()
    trainer = ReusesY(model=model, train_data=[0] * 3, optimizer=lambda p: torch.optim.SGD(p, lr=0.1), max_steps=3,
                      device="cpu", progress=False, guard=GraphGuard(model, check="always"))
    with pytest.raises(GraphReuseError) as info:
        trainer.fit()
    assert "recompute `self.y` inside training_step" in info.value.fixes[0]
    assert "in __init__, at module level or before fit" in str(info.value)
