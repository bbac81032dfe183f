"""Multi-loss and multi-optimizer steps: the backward plan, auto retain, routing, manual mode, undo."""
import copy
import logging
import re
import warnings
from collections import defaultdict
from functools import partial

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from safeloop import (ConfigError, ConfigWarning, InplaceModificationError, NoGraphError, NonFiniteError, StepError,
                      Trainer)
from safeloop import step as steps

from .conftest import manual
from .ddp_cases import SAM


def batches(n=6, d=8, seed=1):
    gen = torch.Generator().manual_seed(seed)
    return [(torch.randn(16, d, generator=gen), torch.randn(16, 1, generator=gen), torch.randn(16, d, generator=gen))
            for _ in range(n)]


class ThreeHeads(nn.Module):
    def __init__(self, d=8, h=16):
        super().__init__()
        self.trunk = nn.Sequential(nn.Linear(d, h), nn.Tanh())
        self.a, self.b, self.recon = nn.Linear(h, 1), nn.Linear(h, 1), nn.Linear(h, d)


def three_losses(model, batch):
    """``other`` shares only parameters with the rest; ``a`` and ``b`` share one trunk pass."""
    x, y, x_u = batch
    other = F.mse_loss(model.recon(model.trunk(x_u)), x_u)
    h = model.trunk(x)
    return {"other": other, "a": F.mse_loss(model.a(h), y), "b": (model.b(h) - y).abs().mean()}


class ThreeLossTrainer(Trainer):
    def training_step(self, batch):
        return three_losses(self.model, batch)


def fit_three(model, data, **kwargs):
    trainer = ThreeLossTrainer(model=model, train_data=data, optimizer=partial(torch.optim.SGD, lr=0.1),
                               max_steps=len(data), device="cpu", progress=False, loggers=(), **kwargs)
    trainer.fit()
    return trainer


def hand_three(model, data, weights=None, total=False):
    """The hand-written step: retain_graph=True on every backward but the last (or one summed backward)."""
    weights = weights or {}
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for batch in data:
        opt.zero_grad(set_to_none=True)
        losses = [loss * weights.get(name, 1.0) for name, loss in three_losses(model, batch).items()]
        if total:
            sum(losses).backward()
        else:
            for i, loss in enumerate(losses):
                loss.backward(retain_graph=i < len(losses) - 1)
        opt.step()


def assert_same_params(m1, m2, exact=False):
    for (name, p), q in zip(m1.named_parameters(), m2.parameters()):
        if exact:
            assert torch.equal(p, q), name
        else:
            torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=name)


# -- the plan ------------------------------------------------------------------------------------
def test_plan_retains_all_but_last_without_a_walk_and_applies_weights():
    w = torch.ones(2, requires_grad=True)
    losses = {"x": (w * 2).sum(), "y": (w * 3).sum(), "z": (w * 4).sum()}
    opt = torch.optim.SGD([w], lr=0.1)
    plan = steps.plan(losses, {"optimizer": opt}, None, "sequential", {"y": 0.5})
    assert [(b.name, b.retain, b.inputs) for b in plan] == [("x", True, None), ("y", True, None), ("z", False, None)]
    assert float(plan[1].loss.detach()) == pytest.approx(3.0)  # 0.5 * 6
    summed = steps.plan(losses, {"optimizer": opt}, None, "sum", {"y": 0.5})
    assert [(b.name, b.retain) for b in summed] == [("sum", False)]
    assert float(summed[0].loss.detach()) == pytest.approx(4 + 3 + 8)


def test_plan_routes_each_loss_to_its_optimizer_parameters():
    g, d = nn.Linear(2, 2), nn.Linear(2, 1)
    opts = {"g": torch.optim.SGD(g.parameters(), lr=0.1), "d": torch.optim.SGD(d.parameters(), lr=0.1)}
    losses = {"d": d(torch.randn(3, 2)).mean(), "g": d(g(torch.randn(3, 2))).mean()}
    plan = steps.plan(losses, opts, [False, False], "sum")  # sum is per optimizer: routed losses stay apart
    assert [b.optimizer for b in plan] == ["d", "g"]
    assert plan[0].inputs == list(d.parameters()) and plan[1].inputs == list(g.parameters())


def test_a_loss_key_that_names_no_optimizer_is_reported():
    with pytest.raises(StepError, match=re.escape("loss 'gen' names no optimizer; with several optimizers each "
                                                  "loss key must be one of ['d', 'g']")):
        steps.named_losses({"gen": torch.ones(())}, 3, {"g": None, "d": None})


# -- automatic multi-loss: retain, gradients, logging ----------------------------------------------
def test_auto_retain_keeps_the_graph_only_where_a_later_loss_shares_it(caplog):
    torch.manual_seed(0)
    ref, ours = ThreeHeads(), ThreeHeads()
    ours.load_state_dict(ref.state_dict())
    with caplog.at_level(logging.INFO, logger="safeloop"):
        trainer = fit_three(ours, batches(), guard={"check": "always"})
    hand_three(ref, batches())
    assert_same_params(ref, ours)
    # 'other' shares only parameters with later losses: freed by its own backward; 'a' shares the trunk with 'b'
    assert trainer.retain_plans == {(("a",), True): 1}
    lines = [r.getMessage() for r in caplog.records if "retained the graph" in r.getMessage()]
    assert lines == ["step 1: backward retained the graph for a (a later loss shares nodes with it); freed it "
                     "for other (no later loss shares it) and for the last loss, b"]  # once, not every step
    assert set(trainer.state.losses) == {"other", "a", "b"}  # each loss logged by name


def test_the_retain_line_is_logged_once_when_steps_the_guard_does_not_walk_retain_the_same(caplog):
    class TwoHeads(Trainer):
        def training_step(self, batch):
            x, y, _ = batch
            h = self.model.trunk(x)
            return {"a": F.mse_loss(self.model.a(h), y), "b": F.mse_loss(self.model.b(h), y)}

    with caplog.at_level(logging.INFO, logger="safeloop"):
        trainer = TwoHeads(model=ThreeHeads(), train_data=batches(), optimizer=partial(torch.optim.SGD, lr=0.1),
                           max_steps=30, device="cpu", progress=False, loggers=(), guard={"budget": 1e-9})
        trainer.fit()
    assert trainer.retain_plans == {(("a",), True): 1, (("a",), False): 11}  # after the guard's 10 warm-up steps
    lines = [r.getMessage() for r in caplog.records if "retained the graph" in r.getMessage()]
    assert lines == ["step 1: backward retained the graph for a (a later loss shares nodes with it); freed it "
                     "for none (no later loss shares it) and for the last loss, b"]


def test_steps_not_walked_retain_on_all_but_last():
    torch.manual_seed(0)
    ref, ours = ThreeHeads(), ThreeHeads()
    ours.load_state_dict(ref.state_dict())
    trainer = fit_three(ours, batches(), guard={"check": "off"})
    hand_three(ref, batches())
    assert_same_params(ref, ours)
    assert trainer.retain_plans == {(("other", "a"), False): 1}


def test_sum_and_weights_match_the_hand_written_step():
    weights = {"other": 0.25, "b": 2.0}
    for total in (False, True):
        torch.manual_seed(0)
        ref, ours = ThreeHeads(), ThreeHeads()
        ours.load_state_dict(ref.state_dict())
        trainer = fit_three(ours, batches(), multi_loss="sum" if total else "sequential", loss_weights=weights)
        hand_three(ref, batches(), weights, total=total)
        assert_same_params(ref, ours)
        assert trainer.retain_plans == ({} if total else {(("a",), True): 1})


class GAN(nn.Module):
    def __init__(self):
        super().__init__()
        self.g = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 2))
        self.d = nn.Sequential(nn.Linear(2, 16), nn.ReLU(), nn.Linear(16, 1))


def gan_batches(n=4):
    gen = torch.Generator().manual_seed(5)
    return [(torch.randn(32, 2, generator=gen), torch.randn(32, 4, generator=gen)) for _ in range(n)]


def bce(logits, target: float):
    return F.binary_cross_entropy_with_logits(logits, torch.full_like(logits, target))


class RoutedGAN(Trainer):
    """Automatic mode: both losses returned at once, each routed to its optimizer."""

    def configure_optimizers(self):
        return {"d": torch.optim.SGD(self.model.d.parameters(), lr=0.1),
                "g": torch.optim.SGD(self.model.g.parameters(), lr=0.1)}

    def training_step(self, batch):
        real, z = batch
        fake = self.model.g(z)
        d_loss = bce(self.model.d(real), 1.0) + bce(self.model.d(fake.detach()), 0.0)
        return {"d": d_loss, "g": bce(self.model.d(fake), 1.0)}

    def on_before_optimizer_step(self, name, optimizer):
        self.grads[name] = [p.grad.clone() for g in optimizer.param_groups for p in g["params"]]


def test_a_routed_loss_never_adds_gradient_to_another_optimizers_parameters():
    torch.manual_seed(0)
    model = GAN()
    real, z = gan_batches(1)[0]
    expected_d = torch.autograd.grad(bce(model.d(real), 1.0) + bce(model.d(model.g(z).detach()), 0.0),
                                     list(model.d.parameters()))
    expected_g = torch.autograd.grad(bce(model.d(model.g(z)), 1.0), list(model.g.parameters()))
    trainer = RoutedGAN(model=model, train_data=gan_batches(1), max_steps=1, device="cpu", progress=False,
                        loggers=())
    trainer.grads = {}
    trainer.fit()
    # D's gradient is d_loss's alone, although g's loss also reaches D's parameters
    for got, want in zip(trainer.grads["d"], expected_d):
        torch.testing.assert_close(got, want)
    for got, want in zip(trainer.grads["g"], expected_g):
        torch.testing.assert_close(got, want)


# -- manual mode -----------------------------------------------------------------------------------
class ManualGAN(Trainer):
    """The standard alternating GAN step: D on fake.detach(), then G through a fresh D(fake)."""

    automatic = False
    fail_at = None  # (step, where) to raise inside training_step
    nan_at = None  # the step whose G loss is NaN

    def configure_optimizers(self):
        return {"d": torch.optim.Adam(self.model.d.parameters(), lr=0.01),
                "g": torch.optim.Adam(self.model.g.parameters(), lr=0.01)}

    def training_step(self, batch):
        real, z = batch
        fake = self.model.g(z)
        d_loss = bce(self.model.d(real), 1.0) + bce(self.model.d(fake.detach()), 0.0)
        self.backward(d_loss, optimizer="d")
        self.step("d")
        if self.fail_at == (self.state.step + 1, "after d"):
            raise RuntimeError("boom after the D step")
        g_loss = bce(self.model.d(fake), 1.0)
        if self.nan_at == self.state.step + 1:
            g_loss = g_loss * float("nan")
        self.backward(g_loss, optimizer="g")
        self.step("g")  # the non-finite check runs here, after D's update
        if self.fail_at == (self.state.step + 1, "after g"):
            raise RuntimeError("boom after both steps")
        return {"d": d_loss, "g": g_loss}


def manual_gan(model, n=4, **kwargs):
    return ManualGAN(model=model, train_data=gan_batches(n), max_steps=n, device="cpu", progress=False,
                     loggers=(), **kwargs)


def test_manual_gan_step_matches_the_hand_written_step():
    torch.manual_seed(0)
    ref, ours = GAN(), GAN()
    ours.load_state_dict(ref.state_dict())
    opt_d, opt_g = torch.optim.Adam(ref.d.parameters(), lr=0.01), torch.optim.Adam(ref.g.parameters(), lr=0.01)
    for real, z in gan_batches():
        fake = ref.g(z)
        opt_d.zero_grad()
        (bce(ref.d(real), 1.0) + bce(ref.d(fake.detach()), 0.0)).backward()
        opt_d.step()
        opt_g.zero_grad()
        bce(ref.d(fake), 1.0).backward()  # also leaves gradient on D: zeroed before D's next step
        opt_g.step()
    trainer = manual_gan(ours)
    trainer.fit()
    assert_same_params(ref, ours, exact=True)
    assert set(trainer.state.losses) == {"d", "g"}


class GFirst(ManualGAN):
    """G steps first; D's loss then goes through G's output without ``.detach()``. D's backward, routed to
    D's parameters, never runs the nodes of G that G's backward freed: correct code."""

    def training_step(self, batch):
        real, z = batch
        fake = self.model.g(z)
        g_loss = bce(self.model.d(fake), 1.0)
        self.backward(g_loss, optimizer="g")
        self.step("g")
        d_loss = bce(self.model.d(real), 1.0) + bce(self.model.d(fake), 0.0)
        self.backward(d_loss, optimizer="d")
        self.step("d")
        return {"g": g_loss, "d": d_loss}


@pytest.mark.parametrize("check", ["always", "auto", "off"])
def test_a_routed_manual_backward_is_checked_on_the_nodes_it_runs_only(check):
    torch.manual_seed(0)
    ref, ours = GAN(), GAN()
    ours.load_state_dict(ref.state_dict())
    opt_d, opt_g = torch.optim.Adam(ref.d.parameters(), lr=0.01), torch.optim.Adam(ref.g.parameters(), lr=0.01)
    for real, z in gan_batches():
        fake = ref.g(z)
        opt_g.zero_grad()
        bce(ref.d(fake), 1.0).backward(inputs=list(ref.g.parameters()))
        opt_g.step()
        opt_d.zero_grad()
        (bce(ref.d(real), 1.0) + bce(ref.d(fake), 0.0)).backward(inputs=list(ref.d.parameters()))
        opt_d.step()
    GFirst(model=ours, train_data=gan_batches(), max_steps=4, device="cpu", progress=False, loggers=(),
           guard={"check": check}).fit()
    assert_same_params(ref, ours, exact=True)


def test_manual_backward_and_step_need_the_optimizer_name_when_there_are_several():
    class NoName(ManualGAN):
        def training_step(self, batch):
            real, _ = batch
            self.backward(bce(self.model.d(real), 1.0))

    class NoStepName(ManualGAN):
        def training_step(self, batch):
            self.step()

    for cls, message in ((NoName, "self.backward(loss) needs optimizer=... when there are several optimizers"),
                         (NoStepName, "self.step() needs the optimizer's name when there are several; "
                                      "choose from ['d', 'g']")):
        with pytest.raises(StepError, match=re.escape(message)):
            cls(model=GAN(), train_data=gan_batches(1), max_steps=1, device="cpu", progress=False, loggers=()).fit()


@pytest.mark.parametrize("check", ["auto", "off"])
def test_stepping_d_between_building_and_back_propagating_g_loss_is_caught_and_undone(check):
    class Stale(ManualGAN):
        def training_step(self, batch):
            real, z = batch
            fake = self.model.g(z)
            g_loss = bce(self.model.d(fake), 1.0)  # built through D ...
            d_loss = bce(self.model.d(real), 1.0) + bce(self.model.d(fake.detach()), 0.0)
            self.backward(d_loss, optimizer="d")
            self.step("d")  # ... D's weights change in place ...
            self.backward(g_loss, optimizer="g")  # ... and g_loss's graph saved the old ones

        def on_before_backward(self, name, loss):
            self.backwards.append(name)

    torch.manual_seed(0)
    model = GAN()
    before = copy.deepcopy(model.state_dict())
    trainer = Stale(model=model, train_data=gan_batches(1), max_steps=1, device="cpu", progress=False, loggers=(),
                    guard={"check": check})
    trainer.backwards = []
    with pytest.raises(InplaceModificationError, match=re.escape(
            "(step 1, loss 'g'): optimizer 'd' stepped after this loss was built and before its backward, changing "
            "parameters its graph saved")) as err:
        trainer.fit()
    assert "recompute the loss after the optimizer step" in str(err.value)
    # a checked step raises before g's backward starts; otherwise backward's own error is explained
    assert trainer.backwards == (["d"] if check == "auto" else ["d", "g"])
    for key, value in model.state_dict().items():  # and D's step was undone
        assert torch.equal(value, before[key]), key


def test_a_step_abandoned_before_its_last_update_teaches_undo_nothing():
    """The first step fails after D's update, twice (a retry): D is undone both times. (The failed step's
    updates, D alone, are not its order: taken for it, D would look like the step's last update, which
    undo=auto does not snapshot.)"""
    torch.manual_seed(0)
    model = GAN()
    before = copy.deepcopy(model.state_dict())
    trainer = manual_gan(model, n=1)
    trainer.fail_at = (1, "after d")
    for _ in range(2):
        with pytest.raises(StepError, match=r"step 1 failed and was abandoned \(parameters and optimizer state are "
                                            r"unchanged\): RuntimeError: boom after the D step"):
            trainer.fit()
    for key, value in model.state_dict().items():
        assert torch.equal(value, before[key]), key


class HandPenalty(ManualGAN):
    """A gradient taken by hand in training_step (torch.autograd.grad) after D stepped: ``stale``, through
    D's graph built before the step; otherwise through a tensor of the user's own changed in place."""

    def training_step(self, batch):
        real, _ = batch
        real = real.clone().requires_grad_()
        out = self.model.d(real)
        self.backward(bce(out, 1.0), optimizer="d", retain_graph=True)
        self.step("d")
        if self.stale:
            grad, = torch.autograd.grad(out.sum(), real, create_graph=True)  # needs the weights d just changed
        else:
            x = torch.ones(3, requires_grad=True)
            y = x.exp()
            y.add_(1)  # exp saved its output
            grad, = torch.autograd.grad(y.sum(), x)
        self.backward(grad.pow(2).sum(), optimizer="d")
        self.step("d")


@pytest.mark.parametrize("check", ["auto", "off"])
def test_a_gradient_taken_by_hand_through_a_graph_an_update_made_stale_names_the_parameter(check):
    torch.manual_seed(0)
    model = GAN()
    before = copy.deepcopy(model.state_dict())
    trainer = HandPenalty(model=model, train_data=gan_batches(1), max_steps=1, device="cpu", progress=False,
                          loggers=(), guard={"check": check})
    trainer.stale = True
    with pytest.raises(InplaceModificationError, match=re.escape(
            "(step 1): an autograd call outside self.backward (torch.autograd.grad in training_step, say) went "
            "through a graph built before optimizer 'd' stepped in this step; that update changed `model.d.2.weight` "
            "in place, and the graph had saved it ([torch.FloatTensor [16, 1]], now at version 2). The step was "
            "abandoned (parameters and optimizer state are unchanged). To fix: differentiate a fresh forward made "
            "after the optimizer step")):
        trainer.fit()
    for key, value in model.state_dict().items():
        assert torch.equal(value, before[key]), key
    trainer.stale = False  # the user's own tensor: PyTorch's error as it is, not blamed on the update
    with pytest.raises(StepError, match=r"step 1 failed and was abandoned \(parameters and optimizer state are "
                                        r"unchanged\): RuntimeError: one of the variables needed for gradient "
                                        r"computation has been modified by an inplace operation: \[torch.FloatTensor "
                                        r"\[3\]\]") as err:
        trainer.fit()
    assert not isinstance(err.value, InplaceModificationError)


@pytest.mark.parametrize("where, undo", [("after d", "auto"), ("after g", "full")])
def test_a_failed_manual_step_leaves_parameters_and_optimizer_state_bit_identical(where, undo):
    torch.manual_seed(0)
    model = GAN()
    trainer = manual_gan(model, n=4, scheduler=partial(torch.optim.lr_scheduler.StepLR, step_size=1, gamma=0.5),
                         undo=undo)
    trainer.max_steps = 2
    trainer.fit()  # two good steps: Adam has state, the schedule has moved
    params = copy.deepcopy(model.state_dict())
    opt_states = {name: copy.deepcopy(opt.state_dict()) for name, opt in trainer.optimizers.items()}
    lrs = {name: opt.param_groups[0]["lr"] for name, opt in trainer.optimizers.items()}
    trainer.fail_at, trainer.max_steps = (3, where), 4
    with pytest.raises(StepError, match=r"step 3 failed and was abandoned \(parameters and optimizer state are "
                                        r"unchanged\): RuntimeError: boom"):
        trainer.fit()
    assert trainer.state.step == 2
    for key, value in model.state_dict().items():
        assert torch.equal(value, params[key]), key
    for name, opt in trainer.optimizers.items():
        assert opt.param_groups[0]["lr"] == lrs[name]
        saved, now = opt_states[name]["state"], opt.state_dict()["state"]
        assert saved.keys() == now.keys()
        for i in saved:
            for key in saved[i]:
                assert torch.equal(saved[i][key], now[i][key]), (name, i, key)
    assert all(p.grad is None for p in model.parameters())

    # and training goes on exactly as if the failed attempt had never happened
    torch.manual_seed(0)
    clean = GAN()
    fresh = manual_gan(clean, n=4, scheduler=partial(torch.optim.lr_scheduler.StepLR, step_size=1, gamma=0.5))
    fresh.fit()
    trainer.fail_at = None
    trainer.state.batch_in_epoch -= 1  # retry the batch of the failed step
    trainer.fit()
    assert_same_params(clean, model, exact=True)


def test_a_failed_first_manual_step_leaves_no_optimizer_state():
    torch.manual_seed(0)
    model = GAN()
    params = copy.deepcopy(model.state_dict())
    trainer = manual_gan(model, n=1)
    trainer.fail_at = (1, "after g")
    with pytest.raises(StepError, match="step 1 failed"):
        trainer.fit()
    for key, value in model.state_dict().items():
        assert torch.equal(value, params[key]), key
    assert all(len(opt.state) == 0 for opt in trainer.optimizers.values())


def test_automatic_mode_undoes_an_earlier_optimizer_when_a_later_one_fails():
    class FailsOnG(RoutedGAN):
        def on_before_optimizer_step(self, name, optimizer):
            if name == "g":
                raise ValueError("hook failed on g")

    torch.manual_seed(0)
    model = GAN()
    params = copy.deepcopy(model.state_dict())
    trainer = FailsOnG(model=model, train_data=gan_batches(1), max_steps=1, device="cpu", progress=False, loggers=())
    with pytest.raises(StepError, match="step 1 failed and was abandoned .*ValueError: hook failed on g"):
        trainer.fit()
    for key, value in model.state_dict().items():  # D had stepped before g's hook raised
        assert torch.equal(value, params[key]), key


# -- trainer.undo: what a failed step leaves, and what its error says -----------------------------
def state_of(model, trainer):
    """Parameters, optimizer states and learning rates, copied."""
    return (copy.deepcopy(model.state_dict()), {n: copy.deepcopy(o.state_dict()) for n, o in trainer.optimizers.items()})


def assert_state(model, trainer, saved, changed=()):
    """Every optimizer's parameters and state as ``saved``, except those of the optimizers in ``changed``."""
    params, opts = saved
    for name, opt in trainer.optimizers.items():
        same = name not in changed
        prefix = f"{name}."
        assert all(torch.equal(v, params[k]) == same for k, v in model.state_dict().items() if k.startswith(prefix)), name
        now = opt.state_dict()
        assert now["param_groups"] == opts[name]["param_groups"] or not same, name
        if same:
            assert now["state"].keys() == opts[name]["state"].keys(), name
            for i in now["state"]:
                for key, value in now["state"][i].items():
                    assert torch.equal(torch.as_tensor(value), torch.as_tensor(opts[name]["state"][i][key])), (name, key)


def test_auto_learns_which_optimizer_steps_last_and_says_its_update_was_not_undone():
    torch.manual_seed(0)
    model = GAN()
    trainer = manual_gan(model, n=4)
    trainer.max_steps = 2
    trainer.fit()  # g stepped last in both steps: auto stops snapshotting it
    saved = state_of(model, trainer)
    trainer.fail_at, trainer.max_steps = (3, "after g"), 4
    with pytest.raises(StepError, match=re.escape(
            "step 3 failed and was abandoned (optimizer 'g' had already updated its parameters or begun to, and is "
            "not undone; optimizer 'd' was restored; set trainer.undo=full to make such failures undoable): "
            "RuntimeError: boom after both steps")):
        trainer.fit()
    assert_state(model, trainer, saved, changed=("g",))


def test_undo_off_snapshots_nothing_and_says_so():
    torch.manual_seed(0)
    model = GAN()
    saved = state_of(model, manual_gan(model))
    trainer = manual_gan(model, n=1, undo="off")
    trainer.fail_at = (1, "after d")
    with pytest.raises(StepError, match=re.escape(
            "step 1 failed and was abandoned (optimizer 'd' had already updated its parameters, which "
            "trainer.undo=off leaves): RuntimeError: boom after the D step")):
        trainer.fit()
    assert not trainer._undo._snapshots
    params, _ = saved
    assert not torch.equal(model.state_dict()["d.0.weight"], params["d.0.weight"])
    assert torch.equal(model.state_dict()["g.0.weight"], params["g.0.weight"])


class OneCycle(Trainer):
    """OneCycleLR over ``total_steps``: its step() raises once stepped past them."""

    total_steps = 3

    def configure_schedulers(self, optimizers):
        return {n: torch.optim.lr_scheduler.OneCycleLR(o, max_lr=0.1, total_steps=self.total_steps)
                for n, o in optimizers.items()}


ManualOneCycle = manual(OneCycle)


# check=off: no step is walked; check=always: every step is
@pytest.mark.parametrize("cls, check", [(OneCycle, "off"), (OneCycle, "always"), (ManualOneCycle, "auto")],
                         ids=["automatic-unchecked", "automatic-checked", "manual"])
def test_a_failing_scheduler_step_is_undone_in_full_and_reported_in_auto(cls, check):
    def fit(undo, steps):
        torch.manual_seed(0)
        model = nn.Linear(3, 1)
        data = [(torch.randn(4, 3), torch.randn(4, 1)) for _ in range(6)]
        trainer = cls(model, data, lambda p: torch.optim.Adam(p, lr=0.1), max_steps=steps, device="cpu",
                      progress=False, loggers=(), undo=undo, guard={"check": check})
        if steps == 3:
            trainer.fit()
            return model, trainer
        with pytest.raises(StepError) as info:  # step 4, in the same fit as the three before it
            trainer.fit()
        return model, trainer, str(info.value)

    for undo in ("full", "auto"):
        model, trainer = fit(undo, 3)
        params, opt = copy.deepcopy(model.state_dict()), copy.deepcopy(trainer.optimizers["optimizer"].state_dict())
        schedule = copy.deepcopy(trainer.schedulers["optimizer"].state_dict())
        model, trainer, error = fit(undo, 4)
        assert trainer.state.step == 3
        if undo == "full":
            assert error.startswith("step 4 failed and was abandoned (parameters and optimizer state are unchanged): "
                                    "ValueError: Tried to step 4 times"), error
            assert all(torch.equal(v, params[k]) for k, v in model.state_dict().items())
            now = trainer.optimizers["optimizer"].state_dict()
            assert now["param_groups"] == opt["param_groups"]
            assert torch.equal(now["state"][0]["exp_avg"], opt["state"][0]["exp_avg"])
            assert trainer.schedulers["optimizer"].state_dict() == schedule
        else:
            assert error.startswith(
                "step 4 failed and was abandoned (optimizer 'optimizer' had already updated its parameters or "
                "begun to, and is not undone; set trainer.undo=full to make such failures undoable)"), error
            assert not torch.equal(model.weight, params["weight"])  # as the message says


def test_full_restores_a_tensor_learning_rate_a_scheduler_changed_in_place():
    class Fails(ManualGAN):
        def configure_optimizers(self):
            return {"d": torch.optim.Adam(self.model.d.parameters(), lr=torch.tensor(0.01)),
                    "g": torch.optim.Adam(self.model.g.parameters(), lr=torch.tensor(0.01))}

    torch.manual_seed(0)
    model = GAN()
    trainer = Fails(model=model, train_data=gan_batches(4), max_steps=1, device="cpu", progress=False, loggers=(),
                    undo="full", scheduler=partial(torch.optim.lr_scheduler.ExponentialLR, gamma=0.5))
    trainer.fit()
    lrs = {n: o.param_groups[0]["lr"].clone() for n, o in trainer.optimizers.items()}
    saved = state_of(model, trainer)
    trainer.fail_at, trainer.max_steps = (2, "after g"), 2
    with pytest.raises(StepError, match=r"step 2 failed and was abandoned \(parameters and optimizer state are "
                                        r"unchanged\)"):
        trainer.fit()
    for name, opt in trainer.optimizers.items():
        assert torch.equal(opt.param_groups[0]["lr"], lrs[name]), name  # ExponentialLR multiplied it in place
    assert_state(model, trainer, saved)


class BecomesTwoLosses(Trainer):
    """One loss tensor for its first steps (with the guard off, steps 2 and 3 are simple ones), then a dict of
    two losses from step 4 on."""

    def training_step(self, batch):
        loss = super().training_step(batch)
        if self.state.step + 1 < 4:
            return loss
        return {"mse": loss, "l2": self.model.weight.pow(2).sum()}


@pytest.mark.parametrize("check", ["off", "auto"])
def test_a_step_that_stops_being_plain_trains_as_the_hand_written_loop(check):
    torch.manual_seed(0)
    data = [(torch.randn(4, 3), torch.randn(4, 1)) for _ in range(6)]
    model, hand = nn.Linear(3, 1), nn.Linear(3, 1)
    hand.load_state_dict(model.state_dict())
    trainer = BecomesTwoLosses(model, data, lambda p: torch.optim.Adam(p, lr=0.1), max_steps=6, device="cpu",
                               progress=False, loggers=(), guard={"check": check})
    trainer.fit()
    opt = torch.optim.Adam(hand.parameters(), lr=0.1)
    for i, (x, y) in enumerate(data):
        loss = F.mse_loss(hand(x), y)
        loss.backward()
        if i >= 3:
            hand.weight.pow(2).sum().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), hand.parameters()))
    assert sorted(trainer.state.losses) == ["l2", "mse"]


def test_one_tensor_with_several_optimizers_asks_for_a_dict():
    class OneLoss(RoutedGAN):
        def training_step(self, batch):
            real, z = batch
            return bce(self.model.d(self.model.g(z)), 1.0)

    with pytest.raises(StepError, match=re.escape(
            "step 1: training_step returned one loss tensor, and there are several optimizers (['d', 'g']): return "
            "a dict {optimizer name: loss}, so that each loss's gradient goes to its optimizer's parameters (one "
            "loss that trains them all goes under each name: {'d': loss, 'g': loss})")):
        OneLoss(model=GAN(), train_data=gan_batches(1), max_steps=1, device="cpu", progress=False, loggers=()).fit()


@pytest.mark.parametrize("automatic", [True, False], ids=["automatic", "manual"])
def test_grad_clip_applies_in_both_modes_as_in_the_hand_written_loop(automatic):
    Step = Trainer if automatic else manual(Trainer)
    torch.manual_seed(0)
    ref, ours = nn.Linear(3, 1), nn.Linear(3, 1)
    ours.load_state_dict(ref.state_dict())
    data = [(torch.randn(8, 3), 10 * torch.randn(8, 1)) for _ in range(3)]
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for x, y in data:
        F.mse_loss(ref(x), y).backward()
        torch.nn.utils.clip_grad_norm_(list(ref.parameters()), 0.5)
        opt.step()
        opt.zero_grad()
    Step(ours, data, partial(torch.optim.SGD, lr=0.1), max_steps=3, grad_clip=0.5, device="cpu", progress=False,
         loggers=()).fit()
    assert_same_params(ref, ours, exact=True)


@pytest.mark.parametrize("policy", ["skip", "error"])
def test_a_nan_in_the_last_update_of_a_manual_step_undoes_the_earlier_one(policy, caplog):
    torch.manual_seed(0)
    model = GAN()
    trainer = manual_gan(model, on_nonfinite=policy)
    trainer.max_steps, trainer.nan_at = 2, 3
    trainer.fit()
    saved = state_of(model, trainer)
    trainer.max_steps = 3
    if policy == "error":
        with pytest.raises(NonFiniteError, match=re.escape(
                "step 3: loss 'g' is nan (a non-finite loss makes every gradient non-finite). The step was abandoned "
                "before optimizer 'g' stepped (parameters and optimizer state are unchanged)")):
            trainer.fit()
    else:
        with caplog.at_level(logging.WARNING, logger="safeloop"), warnings.catch_warnings():
            warnings.simplefilter("error")  # G updated in the first fit: a fit whose only step is skipped is no sign
            trainer.fit()
        assert trainer.state.step == 3 and trainer.state.skipped == 1
        assert "step 3 skipped, nothing updated: loss 'g' is nan" in caplog.text
    assert_state(model, trainer, saved)  # D's update of step 3 was undone too


def partitions(items):
    """Every way to split ``items`` into groups (set partitions), groups in order of first member."""
    if not items:
        yield []
        return
    first, rest = items[0], items[1:]
    for smaller in partitions(rest):
        for k in range(len(smaller)):
            yield smaller[:k] + [[first] + smaller[k]] + smaller[k + 1:]
        yield [[first]] + smaller


@pytest.mark.parametrize("n", [2, 3, 4, 5])
def test_every_sharing_pattern_of_losses_matches_retaining_on_all_but_the_last(n):
    """Losses computed from shared trunk passes in every pattern (all on one pass, some on their own, in
    every interleaving): with the guard walking every step, the Trainer retains only where needed and
    trains bit-identically to the hand-written loop that retains on every backward but the last."""
    class Heads(nn.Module):
        def __init__(self):
            super().__init__()
            self.trunk = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh())
            self.heads = nn.ModuleList(nn.Linear(8, 1) for _ in range(n))

    def losses(model, batch, passes):
        x, y = batch
        trunk = {}
        out = {}
        for k in range(n):
            which = passes[k]
            if which not in trunk:
                trunk[which] = model.trunk(x + which)  # one trunk pass per group
            out[f"l{k}"] = F.mse_loss(model.heads[k](trunk[which]), y)
        return out

    class Patterned(Trainer):
        def training_step(self, batch):
            return losses(self.model, batch, self.passes)

    data = [(torch.randn(8, 4), torch.randn(8, 1)) for _ in range(2)]
    for groups in partitions(list(range(n))):
        passes = {k: g for g, members in enumerate(groups) for k in members}
        torch.manual_seed(0)
        ref, ours = Heads(), Heads()
        ours.load_state_dict(ref.state_dict())
        opt = torch.optim.SGD(ref.parameters(), lr=0.1)
        for batch in data:
            values = list(losses(ref, batch, passes).values())
            for k, loss in enumerate(values):
                loss.backward(retain_graph=k < n - 1)
            opt.step()
            opt.zero_grad()
        trainer = Patterned(ours, data, partial(torch.optim.SGD, lr=0.1), max_steps=2, device="cpu", progress=False,
                            loggers=(), guard={"check": "always"})
        trainer.passes = passes
        trainer.fit()  # raised DoubleBackwardError for three losses on one pass before the fix
        assert_same_params(ref, ours, exact=True)
        (kept, walked), = trainer.retain_plans
        # every loss but the last of its trunk pass retains, and no other
        assert walked and set(kept) == {f"l{k}" for k in range(n) if any(passes[j] == passes[k] for j in range(k + 1, n))}, groups


@pytest.mark.parametrize("check", ["always", "off"])
def test_a_constant_term_is_fine_in_a_summed_step_and_named_in_a_sequential_one(check):
    class SkippedRegularizer(ThreeLossTrainer):
        def training_step(self, batch):
            losses = three_losses(self.model, batch)
            losses["reg"] = torch.zeros(())  # a regularizer skipped on this step: a constant
            return losses

    torch.manual_seed(0)
    model, ref = ThreeHeads(), ThreeHeads()
    ref.load_state_dict(model.state_dict())
    data = batches(3)
    hand_three(ref, data, total=True)
    trainer = SkippedRegularizer(model=model, train_data=data, optimizer=partial(torch.optim.SGD, lr=0.1),
                                 max_steps=3, device="cpu", progress=False, loggers=(), multi_loss="sum",
                                 guard={"check": check})
    trainer.fit()  # NoGraphError before: the sum has a graph
    assert_same_params(ref, model)
    trainer = SkippedRegularizer(model=ThreeHeads(), train_data=data, optimizer=partial(torch.optim.SGD, lr=0.1),
                                 max_steps=3, device="cpu", progress=False, loggers=(), guard={"check": check})
    with pytest.raises(NoGraphError, match=r"\(step 1, loss 'reg'\)"):  # back-propagated alone, it has no graph
        trainer.fit()


# -- autocast, closures, two-phase updates -----------------------------------------------------------
def regression_batches(n=4, seed=7):
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        x = torch.randn(32, 4, generator=gen)
        out.append((x, x.sum(1, keepdim=True).sin()))
    return out


def net():
    return nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 1))


def test_a_forward_after_self_step_sees_the_new_weights_under_bf16():
    class Probe(Trainer):
        automatic = False

        def training_step(self, batch):
            x, y = batch
            loss = F.mse_loss(self.model(x), y)
            self.backward(loss)
            self.step()
            self.after = self.model(x)  # the same autocast region, after the update
            return loss

    torch.manual_seed(0)
    model = net()
    batch = regression_batches(1)
    trainer = Probe(model=model, train_data=batch, optimizer=lambda p: torch.optim.SGD(p, lr=0.5), max_steps=1,
                    precision="bf16", device="cpu", progress=False, loggers=())
    trainer.fit()
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        expected = model(batch[0][0])  # the updated weights, cast afresh
    assert trainer.after.dtype == torch.bfloat16
    assert torch.equal(trainer.after.detach(), expected)


class ManualSAM(Trainer):
    """The documented two-phase update: the gradient at w, then SAM's step with the closure."""

    automatic = False
    fail_in_closure_at = None

    def training_step(self, batch):
        x, y = batch
        loss = F.mse_loss(self.model(x), y)
        self.backward(loss)

        def perturbed():  # the loss and its gradient at w + e, after SAM's first step
            if self.fail_in_closure_at == self.state.step + 1:
                raise RuntimeError("boom in the closure")
            again = F.mse_loss(self.model(x), y)
            self.backward(again)
            return again

        self.step(closure=perturbed)
        return loss


def hand_sam(model, data, clip=None, gamma=1.0):
    opt = SAM(model.parameters())
    sched = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=gamma)
    for x, y in data:
        opt.zero_grad()
        F.mse_loss(model(x), y).backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)

        def closure():
            opt.zero_grad()
            F.mse_loss(model(x), y).backward()
            if clip is not None:
                torch.nn.utils.clip_grad_norm_(model.parameters(), clip)

        opt.step(closure)
        sched.step()


@pytest.mark.parametrize("automatic", [False, True], ids=["manual", "automatic"])
def test_a_two_phase_update_runs_through_the_trainer_with_clipping_and_its_scheduler(automatic):
    torch.manual_seed(0)
    ref, ours = net(), net()
    ours.load_state_dict(ref.state_dict())
    hand_sam(ref, regression_batches(), clip=0.05, gamma=0.5)
    # SAM's step needs a closure: in automatic mode the Trainer gives it one, in manual mode self.step does
    cls = ManualSAM if not automatic else Trainer
    trainer = cls(model=ours, train_data=regression_batches(), optimizer=SAM, grad_clip=0.05, max_steps=4,
                  scheduler=partial(torch.optim.lr_scheduler.StepLR, step_size=1, gamma=0.5), device="cpu",
                  progress=False, loggers=())
    trainer.fit()
    assert_same_params(ref, ours, exact=True)
    assert trainer.optimizers["optimizer"].param_groups[0]["lr"] == pytest.approx(0.1 * 0.5 ** 4)


def test_a_failure_inside_the_closure_undoes_the_first_phase():
    torch.manual_seed(0)
    model = net()
    trainer = ManualSAM(model=model, train_data=regression_batches(), optimizer=SAM, max_steps=4, device="cpu",
                        progress=False, loggers=())
    trainer.fail_in_closure_at = 2
    trainer.max_steps = 1
    trainer.fit()
    before = copy.deepcopy(model.state_dict())
    trainer.max_steps = 4
    with pytest.raises(StepError, match=re.escape("step 2 failed and was abandoned (parameters and optimizer "
                                                  "state are unchanged): RuntimeError: boom in the closure")):
        trainer.fit()
    for name, value in model.state_dict().items():  # SAM's first step had moved them to w + e
        assert torch.equal(value, before[name]), name


def hand_lbfgs(model, data, evaluations):
    opt = torch.optim.LBFGS(model.parameters(), lr=0.5, max_iter=4)
    for x, y in data:
        def closure():
            evaluations.append(1)
            opt.zero_grad()
            loss = F.mse_loss(model(x), y)
            loss.backward()
            return loss

        opt.step(closure)


def test_lbfgs_in_automatic_mode_matches_the_hand_written_loop_evaluation_for_evaluation():
    class Counting(Trainer):
        def training_step(self, batch):
            self.evaluations += 1
            return super().training_step(batch)

    torch.manual_seed(0)
    ref, ours = net(), net()
    ours.load_state_dict(ref.state_dict())
    hand = []
    hand_lbfgs(ref, regression_batches(), hand)
    trainer = Counting(model=ours, train_data=regression_batches(), max_steps=4, device="cpu", progress=False,
                       optimizer=lambda p: torch.optim.LBFGS(p, lr=0.5, max_iter=4), loggers=())
    trainer.evaluations = 0
    trainer.fit()
    assert_same_params(ref, ours, exact=True)
    # the step's own forward and backward serve as L-BFGS's first evaluation: none is wasted
    assert trainer.evaluations == len(hand) > 4


def test_lbfgs_in_manual_mode_takes_the_closure_and_says_when_it_is_missing():
    class ManualLBFGS(Trainer):
        automatic = False
        closure = True

        def training_step(self, batch):
            x, y = batch
            losses = []

            def closure():
                loss = F.mse_loss(self.model(x), y)
                self.backward(loss)
                losses.append(loss.detach())
                return loss

            self.step(closure=closure if self.closure else None)
            return losses[0]

    torch.manual_seed(0)
    ref, ours = net(), net()
    ours.load_state_dict(ref.state_dict())
    hand_lbfgs(ref, regression_batches(), [])
    make = dict(train_data=regression_batches(), max_steps=4, device="cpu", progress=False, loggers=(),
                optimizer=lambda p: torch.optim.LBFGS(p, lr=0.5, max_iter=4))
    ManualLBFGS(model=ours, **make).fit()
    assert_same_params(ref, ours, exact=True)
    ManualLBFGS.closure = False
    with pytest.raises(StepError, match=re.escape("step 1: optimizer 'optimizer' (LBFGS) needs a closure: "
                                                  "self.step(name, closure=fn), where fn computes the loss, "
                                                  "calls self.backward(loss) and returns it")):
        ManualLBFGS(model=net(), **make).fit()


# -- routing without inputs= where it is not needed ----------------------------------------------------
class Towers(nn.Module):
    """Two towers, each checkpointed (reentrant), each trained by its own optimizer."""

    def __init__(self):
        super().__init__()
        self.a, self.b = net(), net()


class TowerTrainer(Trainer):
    def configure_optimizers(self):
        return {"a": torch.optim.SGD(self.model.a.parameters(), lr=0.1),
                "b": torch.optim.SGD(self.model.b.parameters(), lr=0.1)}

    def training_step(self, batch):
        x, y = batch
        out_a, out_b = (torch.utils.checkpoint.checkpoint(tower[1:], tower[0](x), use_reentrant=True)
                        for tower in (self.model.a, self.model.b))
        return {"a": F.mse_loss(out_a, y), "b": F.mse_loss(out_b + self.coupling * out_a if self.coupling else out_b, y)}


def test_reentrant_checkpointing_works_with_several_optimizers_when_no_loss_reaches_another():
    torch.manual_seed(0)
    ref, ours = Towers(), Towers()
    ours.load_state_dict(ref.state_dict())
    opts = [torch.optim.SGD(ref.a.parameters(), lr=0.1), torch.optim.SGD(ref.b.parameters(), lr=0.1)]
    for x, y in regression_batches():
        for opt, tower in zip(opts, (ref.a, ref.b)):
            opt.zero_grad()
            F.mse_loss(tower(x), y).backward()
            opt.step()
    trainer = TowerTrainer(model=ours, train_data=regression_batches(), max_steps=4, device="cpu", progress=False,
                           loggers=(), guard={"check": "off"})
    trainer.coupling = 0.0  # b's loss does not reach a's graph
    trainer.fit()
    assert_same_params(ref, ours)
    assert len(trainer._runner.routes.reentrant) == 2  # looked for once per loss: every step has the same shape


def test_a_loss_that_must_be_routed_through_reentrant_checkpointing_is_named_with_the_fix():
    trainer = TowerTrainer(model=Towers(), train_data=regression_batches(), max_steps=2, device="cpu",
                           progress=False, loggers=())
    trainer.coupling = 0.5  # b's loss now also reaches a's parameters
    with pytest.raises(StepError, match=re.escape(
            "step 1: loss 'b' goes through reentrant gradient checkpointing (torch.utils.checkpoint with "
            "use_reentrant=True), and its graph reaches tensors that are not optimizer 'b''s parameters, so its "
            "backward must be limited to them (backward(inputs=...)), which reentrant checkpointing rejects. Use "
            "torch.utils.checkpoint.checkpoint(..., use_reentrant=False)")):
        trainer.fit()


class Unfreezes(TowerTrainer):
    """From step 3 on, a frozen skip connection of tower a is trained too (``add_param_group``, as
    progressive unfreezing does); it is outside the checkpointed part, so a's graph reaches it."""

    def configure_optimizers(self):
        self.model.skip.requires_grad_(False)
        return super().configure_optimizers()

    def training_step(self, batch):
        if self.state.step == 2:
            self.model.skip.requires_grad_(True)
            self.optimizers["a"].add_param_group({"params": self.model.skip.parameters()})
        x, y = batch
        out_a = torch.utils.checkpoint.checkpoint(self.model.a[1:], self.model.a[0](x), use_reentrant=True)
        out_b = torch.utils.checkpoint.checkpoint(self.model.b[1:], self.model.b[0](x), use_reentrant=True)
        return {"a": F.mse_loss(out_a + self.model.skip(x), y), "b": F.mse_loss(out_b, y)}


@pytest.mark.parametrize("fits", [(6,), (2, 6)], ids=["one-fit", "two-fits"])  # a fit takes over the last's routes
@pytest.mark.parametrize("check", ["auto", "always"])
def test_a_param_group_added_mid_run_is_its_optimizers_own_for_routing(check, fits):
    torch.manual_seed(0)
    ref, ours = Towers(), Towers()
    ref.skip = nn.Linear(4, 1)
    ours.skip = copy.deepcopy(ref.skip)
    ours.load_state_dict(ref.state_dict())
    opts = [torch.optim.SGD(ref.a.parameters(), lr=0.1), torch.optim.SGD(ref.b.parameters(), lr=0.1)]
    for i, (x, y) in enumerate(regression_batches(6)):
        if i == 2:
            opts[0].add_param_group({"params": ref.skip.parameters()})
        for opt, loss in zip(opts, (F.mse_loss(ref.a(x) + (ref.skip(x) if i >= 2 else ref.skip(x).detach()), y),
                                    F.mse_loss(ref.b(x), y))):
            opt.zero_grad()
            loss.backward()
            opt.step()
    trainer = Unfreezes(model=ours, train_data=regression_batches(6), max_steps=fits[0], device="cpu",
                        progress=False, loggers=(), guard={"check": check})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for max_steps in fits:
            trainer.max_steps = max_steps
            trainer.fit()
    assert_same_params(ref, ours)


# -- zero_grad ------------------------------------------------------------------------------------
class GrowsAGroup(Trainer):
    """SGD over the first layer; from step 3 on, the second layer too (``add_param_group`` mid-run)."""
    def configure_optimizers(self):
        return torch.optim.SGD(self.model[0].parameters(), lr=0.1)

    def training_step(self, batch):
        self.seen.append([p.grad is None for p in self.model.parameters()])  # as the last step left them
        if self.state.step == 2:
            self.optimizers["optimizer"].add_param_group({"params": self.model[1].parameters()})
        x, y = batch
        return F.mse_loss(self.model(x), y)


@pytest.mark.parametrize("automatic", [True, False], ids=["automatic", "manual"])
def test_gradients_are_freed_when_the_next_step_begins_a_group_added_mid_run_included(automatic):
    torch.manual_seed(0)
    model, hand = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 1)), nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 1))
    hand.load_state_dict(model.state_dict())
    trainer = (GrowsAGroup if automatic else manual(GrowsAGroup))(
        model=model, train_data=regression_batches(), max_steps=4, device="cpu", progress=False, loggers=())
    trainer.seen = []
    trainer.fit()
    opt = torch.optim.SGD(hand[0].parameters(), lr=0.1)
    for i, (x, y) in enumerate(regression_batches()):
        opt.zero_grad(set_to_none=True)
        if i == 2:
            opt.add_param_group({"params": hand[1].parameters()})
        F.mse_loss(hand(x), y).backward()
        opt.step()
    assert_same_params(hand, model, exact=True)
    # the second layer's gradients pile up until it joins the optimizer, then are freed with the rest
    assert trainer.seen == [[True] * 4] + [[True, True, False, False]] * 2 + [[True] * 4]
    # the last update's gradients stay after it, as the loop's after its last step()
    assert all(torch.equal(p.grad, q.grad) for p, q in zip(model.parameters(), hand.parameters()))


class Finetune(Trainer):
    """Fine-tuning in stages, as Lightning ports write it: the optimizer over what requires grad at the start."""

    def configure_optimizers(self):
        return torch.optim.Adam((p for p in self.model.parameters() if p.requires_grad), lr=1e-2)


@pytest.mark.parametrize("cls", [Finetune, Trainer], ids=["trainable-only", "every-parameter"])
def test_a_layer_unfrozen_for_a_later_fit_that_no_optimizer_holds_is_named(cls):
    model = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 1))
    trainer = cls(model=model, train_data=regression_batches(), max_steps=2, device="cpu", progress=False,
                  loggers=(), optimizer=partial(torch.optim.Adam, lr=1e-2))
    model[0].requires_grad_(False)
    trainer.fit()
    model[0].requires_grad_(True)  # the next stage trains the first layer too
    trainer.max_steps = 4
    before = model[0].weight.detach().clone()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        trainer.fit()
    said = [str(w.message) for w in seen if issubclass(w.category, ConfigWarning)]
    if cls is Finetune:
        assert said == ["`model.0.weight`, `model.0.bias` require grad now but were frozen when the optimizers were "
                        "made, at this Trainer's first fit(), and no optimizer holds them: configure_optimizers runs "
                        "once per Trainer (Lightning's runs at every fit), so this fit would not train them. Add them "
                        "(trainer.optimizers['optimizer'].add_param_group({'params': [...]})), or make their "
                        "optimizers over every parameter (frozen ones get no gradient and stay as they are)"]
        assert torch.equal(model[0].weight, before)
    else:  # frozen parameters in the optimizer: trained once unfrozen, nothing to say
        assert said == [] and not torch.equal(model[0].weight, before)


class SeesGradients(Trainer):
    """Keeps the gradients ``on_step_end`` and ``on_epoch_end`` see, as a Lightning port reading them there does."""

    def on_step_end(self, losses):
        self.at_step_end.append([p.grad.clone() for p in self.model.parameters()])

    def on_epoch_end(self):
        self.at_epoch_end.append([p.grad.clone() for p in self.model.parameters()])


@pytest.mark.parametrize("automatic", [True, False], ids=["automatic", "manual"])
def test_hooks_after_an_update_see_its_gradients_as_a_loop_does_until_the_next_step_begins(automatic, tmp_path):
    torch.manual_seed(0)
    model, hand = nn.Linear(4, 1), nn.Linear(4, 1)
    hand.load_state_dict(model.state_dict())
    trainer = (SeesGradients if automatic else manual(SeesGradients))(
        model=model, train_data=regression_batches(), max_epochs=2, device="cpu", progress=False, loggers=(),
        checkpoint={"dir": str(tmp_path), "every": 1}, optimizer=partial(torch.optim.SGD, lr=0.1, momentum=0.9))
    trainer.at_step_end, trainer.at_epoch_end = [], []
    trainer.fit()
    opt, seen = torch.optim.SGD(hand.parameters(), lr=0.1, momentum=0.9), []
    for _ in range(2):
        for x, y in regression_batches():
            opt.zero_grad()
            F.mse_loss(hand(x), y).backward()
            opt.step()
            seen.append([p.grad.clone() for p in hand.parameters()])
    assert_same_params(hand, model, exact=True)
    for ours, theirs in zip(trainer.at_step_end, seen, strict=True):
        assert all(torch.equal(a, b) for a, b in zip(ours, theirs))
    for ours, theirs in zip(trainer.at_epoch_end, [seen[3], seen[7]], strict=True):
        assert all(torch.equal(a, b) for a, b in zip(ours, theirs))
    # an applied gradient is no gradient a later step needs: no checkpoint holds it
    assert all(torch.load(path)["gradients"] == {} for path in tmp_path.glob("step-*.pt"))


class CountingSGD(torch.optim.SGD):
    def zero_grad(self, set_to_none=True):
        self.cleared = getattr(self, "cleared", 0) + 1
        super().zero_grad(set_to_none)


@pytest.mark.parametrize("automatic", [True, False], ids=["automatic", "manual"])
@pytest.mark.parametrize("how", ["subclass", "instance"])
def test_an_optimizers_own_zero_grad_is_the_one_called(automatic, how):
    calls = []

    def make(params):
        if how == "subclass":
            return CountingSGD(params, lr=0.1)
        opt = torch.optim.SGD(params, lr=0.1)
        opt.zero_grad = lambda set_to_none=True: (calls.append(set_to_none), torch.optim.SGD.zero_grad(opt))
        return opt

    trainer = (Trainer if automatic else manual(Trainer))(
        model=nn.Linear(4, 1), train_data=regression_batches(), optimizer=make, max_steps=4, device="cpu",
        progress=False, loggers=())
    trainer.fit()
    opt = trainer.optimizers["optimizer"]
    # when steps 2 to 4 begin (the first starts from None; the last update's gradients stay after the run)
    assert (opt.cleared if how == "subclass" else len(calls)) == 3
    assert calls == ([] if how == "subclass" else [True] * 3)


def test_a_profiler_sees_zero_grad_as_in_the_hand_written_loop():
    trainer = Trainer(model=nn.Linear(4, 1), train_data=regression_batches(), optimizer=partial(torch.optim.SGD, lr=0.1),
                      max_steps=4, device="cpu", progress=False, loggers=())
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        trainer.fit()
    names = [event.name for event in prof.events()]
    assert names.count("Optimizer.zero_grad#SGD.zero_grad") == 3  # when steps 2 to 4 begin
    assert names.count("Optimizer.step#SGD.step") == 4


def test_a_failed_step_drops_the_gradients_of_parameters_no_optimizer_holds_too():
    class FailsBeforeTheUpdate(Trainer):
        def configure_optimizers(self):
            return torch.optim.SGD(self.model[1].parameters(), lr=0.1)

        def on_before_optimizer_step(self, name, optimizer):
            raise ValueError("no update today")

    model = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 1))
    before = copy.deepcopy(model.state_dict())
    with pytest.raises(StepError, match=re.escape(
            "step 1 failed and was abandoned (parameters and optimizer state are unchanged): ValueError: no update "
            "today")):
        FailsBeforeTheUpdate(model=model, train_data=regression_batches(), max_steps=2, device="cpu", progress=False,
                             loggers=()).fit()
    assert all(p.grad is None for p in model.parameters())
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


class AccumulatesWithANan(Trainer):
    """Manual mode, one update every 4 steps; step 2's loss is NaN."""

    automatic = False

    def training_step(self, batch):
        x, y = batch
        loss = F.mse_loss(self.model(x), y) / 4
        if self.state.step == 1:
            loss = loss * float("nan")
        self.backward(loss)
        if self.state.step % 4 == 3:
            self.step()
        return loss


def test_a_nan_in_an_accumulation_over_steps_skips_the_whole_update_as_a_hand_loop_would(caplog):
    data = regression_batches(8)
    torch.manual_seed(0)
    model, hand = net(), net()
    hand.load_state_dict(model.state_dict())
    opt = torch.optim.Adam(hand.parameters(), lr=0.1)
    for i, (x, y) in enumerate(data):
        loss = F.mse_loss(hand(x), y) / 4
        (loss * float("nan") if i == 1 else loss).backward()
        if i % 4 == 3:
            if all(torch.isfinite(p.grad).all() for p in hand.parameters()):
                opt.step()
            opt.zero_grad()  # a non-finite update is dropped with everything accumulated for it
    trainer = AccumulatesWithANan(model=model, train_data=data, optimizer=lambda p: torch.optim.Adam(p, lr=0.1),
                                  max_steps=8, device="cpu", progress=False, loggers=(), on_nonfinite="skip")
    with caplog.at_level(logging.WARNING, logger="safeloop"):
        trainer.fit()
    assert trainer.state.skipped == 1 and "step 4 skipped, nothing updated" in caplog.text
    assert_same_params(hand, model, exact=True)


def test_a_failed_step_in_an_accumulation_over_steps_drops_what_earlier_steps_accumulated():
    """The README's limit: the gradients carried from steps 5 and 6 are dropped with step 7's, not kept."""
    class FailsAtStep7(Trainer):
        automatic = False

        def training_step(self, batch):
            x, y = batch
            self.backward(F.mse_loss(self.model(x), y) / 4)
            if self.state.step == 6:
                raise ValueError("bad batch")
            if self.state.step % 4 == 3:
                self.step()

    trainer = FailsAtStep7(model=net(), train_data=regression_batches(8), max_steps=6, device="cpu",
                           optimizer=lambda p: torch.optim.SGD(p, lr=0.1), progress=False, loggers=())
    trainer.fit()
    assert all(p.grad is not None for p in trainer.model.parameters())  # steps 5 and 6, for the update at step 8
    after_6 = copy.deepcopy(trainer.model.state_dict())
    trainer.max_steps = 8
    with pytest.raises(StepError, match=re.escape("step 7 failed and was abandoned (parameters and optimizer state "
                                                  "are unchanged): ValueError: bad batch")):
        trainer.fit()
    assert all(p.grad is None for p in trainer.model.parameters())
    assert all(torch.equal(v, after_6[k]) for k, v in trainer.model.state_dict().items())


@pytest.mark.parametrize("undo", ["auto", "full"])
def test_a_hook_failing_before_the_last_update_of_a_manual_step_is_reported_unchanged(undo):
    """D stepped, then G's ``on_before_optimizer_step`` raises: D is restored, G never began."""
    class FailsBeforeG(ManualGAN):
        def on_before_optimizer_step(self, name, optimizer):
            if name == "g" and self.state.step == 2:
                raise ValueError("no update for g")

    torch.manual_seed(0)
    model = GAN()
    trainer = manual_gan(model, n=3, undo=undo)
    trainer.max_steps = 2
    trainer.fit()
    saved = state_of(model, trainer)
    trainer.__class__ = FailsBeforeG
    trainer.max_steps = 3
    with pytest.raises(StepError, match=re.escape(
            "step 3 failed and was abandoned (parameters and optimizer state are unchanged): ValueError: no update "
            "for g")):
        trainer.fit()
    assert_state(model, trainer, saved)


class Lookahead(torch.optim.Optimizer):
    """Lookahead as its authors published it (k fast steps of an inner optimizer, then the weights move
    alpha of the way back towards the slow ones): a wrapper whose ``zero_grad`` takes no argument."""

    def __init__(self, optimizer, k=3, alpha=0.5):
        self.optimizer, self.k, self.alpha, self.steps = optimizer, k, alpha, 0
        self.state = defaultdict(dict)
        for group in optimizer.param_groups:
            for p in group["params"]:
                self.state[p]["slow"] = p.detach().clone()

    @property
    def param_groups(self):
        return self.optimizer.param_groups

    def zero_grad(self):
        self.optimizer.zero_grad()

    def step(self, closure=None):
        loss = self.optimizer.step(closure)
        self.steps += 1
        if self.steps % self.k == 0:
            with torch.no_grad():
                for group in self.param_groups:
                    for p in group["params"]:
                        slow = self.state[p]["slow"]
                        slow.add_(p - slow, alpha=self.alpha)
                        p.copy_(slow)
        return loss

    def state_dict(self):
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict):
        self.optimizer.load_state_dict(state_dict)


class Fails(Trainer):
    def training_step(self, batch):
        if self.state.step + 1 == 3:
            raise ValueError("bad batch")
        return super().training_step(batch)


@pytest.mark.parametrize("mode", ["automatic", "manual"])
def test_an_optimizer_whose_zero_grad_takes_no_argument_trains_and_a_failure_is_reported(mode):
    torch.manual_seed(0)
    ref, ours = net(), net()
    ours.load_state_dict(ref.state_dict())
    opt = Lookahead(torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9))
    for x, y in regression_batches(6):
        opt.zero_grad()
        F.mse_loss(ref(x), y).backward()
        opt.step()
    cls = Trainer if mode == "automatic" else manual(Trainer)
    mine = Lookahead(torch.optim.SGD(ours.parameters(), lr=0.1, momentum=0.9))
    cls(model=ours, train_data=regression_batches(6), optimizer=mine, max_steps=6, device="cpu", progress=False,
        loggers=()).fit()
    assert_same_params(ref, ours, exact=True)
    cls = Fails if mode == "automatic" else manual(Fails)
    trainer = cls(model=net(), train_data=regression_batches(6), max_steps=6, device="cpu", progress=False,
                  loggers=(), optimizer=lambda p: Lookahead(torch.optim.SGD(p, lr=0.1)))
    with pytest.raises(StepError, match=re.escape("step 3 failed and was abandoned (parameters and optimizer "
                                                  "state are unchanged): ValueError: bad batch")):
        trainer.fit()
    assert all(p.grad is None for p in trainer.model.parameters())


class LookaheadGAN(RoutedGAN):
    """D's optimizer a wrapper that keeps its own state apart from its inner optimizer's (momentum) and counts its
    steps in a plain attribute; G's hook fails at ``fail_at``, after D stepped."""
    fail_at = None

    def configure_optimizers(self):
        return {"d": Lookahead(torch.optim.SGD(self.model.d.parameters(), lr=0.1, momentum=0.9), k=2),
                "g": torch.optim.SGD(self.model.g.parameters(), lr=0.1)}

    def on_before_optimizer_step(self, name, optimizer):
        if name == "g" and self.state.step + 1 == self.fail_at:
            raise ValueError("hook failed on g")


def test_an_undone_update_of_a_wrapping_optimizer_restores_its_inner_optimizer_and_its_counters():
    torch.manual_seed(0)
    model, clean = GAN(), GAN()
    clean.load_state_dict(model.state_dict())
    trainer = LookaheadGAN(model=model, train_data=gan_batches(4), max_steps=3, device="cpu", progress=False,
                           loggers=())
    trainer.fit()  # three good steps: momentum, slow weights, and the wrapper's count at 3 (odd: k=2)
    d = trainer.optimizers["d"]
    params, momentum = copy.deepcopy(model.state_dict()), copy.deepcopy(d.optimizer.state_dict())
    slow = {id(p): s["slow"].clone() for p, s in d.state.items()}
    trainer.fail_at, trainer.max_steps = 4, 4
    with pytest.raises(StepError, match="step 4 failed and was abandoned .*ValueError: hook failed on g"):
        trainer.fit()
    for key, value in model.state_dict().items():
        assert torch.equal(value, params[key]), key
    assert d.steps == 3
    assert all(torch.equal(s["slow"], slow[id(p)]) for p, s in d.state.items())
    for i, entry in momentum["state"].items():
        assert torch.equal(d.optimizer.state_dict()["state"][i]["momentum_buffer"], entry["momentum_buffer"]), i
    # the retried step trains as if the failed attempt had never happened
    trainer.fail_at = None
    trainer.state.batch_in_epoch -= 1
    trainer.fit()
    LookaheadGAN(model=clean, train_data=gan_batches(4), max_steps=4, device="cpu", progress=False, loggers=()).fit()
    assert_same_params(clean, model, exact=True)


class InfoGAN(Trainer):
    """InfoGAN's three optimizers: D, G, and an info loss trained through both networks."""

    def configure_optimizers(self):
        gan = self.model
        return {"d": torch.optim.Adam(gan.d.parameters(), lr=0.01), "g": torch.optim.Adam(gan.g.parameters(), lr=0.01),
                "info": torch.optim.Adam([*gan.g.parameters(), *gan.d.parameters()], lr=0.01)}

    def losses(self, batch):
        real, z = batch
        fake = self.model.g(z)
        yield "d", bce(self.model.d(real), 1.0) + bce(self.model.d(fake.detach()), 0.0)
        yield "g", bce(self.model.d(self.model.g(z)), 1.0)
        yield "info", (self.model.d(self.model.g(z)) - z[:, :1]).pow(2).mean()  # recover a code from fake

    def training_step(self, batch):
        return dict(self.losses(batch))


class ManualInfoGAN(InfoGAN):
    automatic = False

    def training_step(self, batch):
        out = {}
        for name, loss in self.losses(batch):  # each loss made after the update before it, as by hand
            self.backward(loss, optimizer=name)
            self.step(name)
            out[name] = loss
        return out


def test_optimizers_sharing_parameters_are_refused_in_automatic_mode_and_train_in_manual_mode():
    torch.manual_seed(0)
    model = GAN()
    before = copy.deepcopy(model.state_dict())
    trainer = InfoGAN(model=model, train_data=gan_batches(), max_steps=4, device="cpu", progress=False, loggers=())
    with pytest.raises(ConfigError, match=re.escape(
            "optimizers 'd' and 'info' both hold 4 parameter(s) (model.d.0.weight, model.d.0.bias, model.d.2.weight, "
            "...): in automatic mode every loss is back-propagated before any optimizer steps, so 'd' would also step "
            "with the gradient of the loss for 'info', and 'info' would find it cleared")) as info:
        trainer.fit()
    assert "set automatic = False" in str(info.value)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())

    ref, ours = GAN(), GAN()
    ours.load_state_dict(ref.state_dict())
    hand = InfoGAN(model=ref, train_data=[], max_steps=1, device="cpu")
    opts = hand.configure_optimizers()
    for batch in gan_batches():
        for name, loss in hand.losses(batch):
            opts[name].zero_grad()
            loss.backward()
            opts[name].step()
    ManualInfoGAN(model=ours, train_data=gan_batches(), max_steps=4, device="cpu", progress=False, loggers=(),
                  guard={"check": "always"}).fit()
    assert_same_params(ref, ours, exact=True)


class SharedEmbedding(nn.Module):
    """The chatbot tutorial's shape (pytorch/tutorials, beginner_source/chatbot_tutorial.py): one embedding in the
    encoder and in the decoder, so that both optimizers hold it."""

    def __init__(self):
        super().__init__()
        self.embedding = nn.Embedding(6, 4)
        self.encoder = nn.ModuleDict({"embedding": self.embedding, "rnn": nn.GRU(4, 4)})
        self.decoder = nn.ModuleDict({"embedding": self.embedding, "out": nn.Linear(8, 6)})

    def forward(self, words):
        encoded, _ = self.encoder["rnn"](self.encoder["embedding"](words))
        return self.decoder["out"](torch.cat([encoded, self.decoder["embedding"](words)], -1))


class SharedEmbeddingTrainer(Trainer):
    automatic = False

    def configure_optimizers(self):
        return {"encoder": torch.optim.Adam(self.model.encoder.parameters(), lr=0.01),
                "decoder": torch.optim.Adam(self.model.decoder.parameters(), lr=0.05)}

    def training_step(self, words):
        loss = F.cross_entropy(self.model(words).flatten(0, 1), words.flatten())
        self.backward(loss, optimizer="encoder", retain_graph=True)
        self.backward(loss, optimizer="decoder")
        self.step("encoder")
        self.step("decoder")
        return loss


@pytest.mark.parametrize("check", ["auto", "always", "off"])
def test_one_loss_routed_to_two_optimizers_sharing_a_parameter_gives_it_the_gradient_once(check):
    """The hand-written loop back-propagates once and steps both optimizers, each with the embedding's whole gradient;
    routed to each optimizer in turn, the loss's gradient would have been added to the embedding's twice."""
    torch.manual_seed(0)
    ref = SharedEmbedding()
    ours = copy.deepcopy(ref)
    gen = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, 6, (5, 2), generator=gen) for _ in range(3)]
    opts = SharedEmbeddingTrainer(model=ref, train_data=[], max_steps=1, device="cpu").configure_optimizers()
    for words in batches:
        for opt in opts.values():
            opt.zero_grad()
        F.cross_entropy(ref(words).flatten(0, 1), words.flatten()).backward()
        opts["encoder"].step()
        opts["decoder"].step()
    SharedEmbeddingTrainer(model=ours, train_data=batches, max_steps=3, device="cpu", progress=False, loggers=(),
                           guard={"check": check}).fit()
    assert_same_params(ref, ours, exact=True)


class SAMNeedsClosure(SAM):
    """SAM whose ``step`` takes ``closure=None`` and refuses to run without one, as published implementations do."""

    def step(self, closure=None):
        assert closure is not None, "Sharpness Aware Minimization requires closure, but it was not provided"
        return super().step(closure)


class FirstStepByHand(Trainer):
    """A port of the two-step SAM loop: the first step called by hand, then self.step() without the closure."""

    automatic = False

    def configure_optimizers(self):
        return SAMNeedsClosure(self.model.parameters())

    def training_step(self, batch):
        x, y = batch
        loss = F.mse_loss(self.model(x), y)
        self.backward(loss)
        self.optimizers["optimizer"].first_step()
        self.step()
        return loss


def test_a_failed_step_names_the_parameters_changed_outside_the_trainers_updates():
    """What the undo cannot restore is said: parameters first_step moved by hand before the update began."""
    torch.manual_seed(0)
    model = net()
    before = [p.detach().clone() for p in model.parameters()]
    trainer = FirstStepByHand(model=model, train_data=regression_batches(2), max_steps=2, device="cpu",
                              progress=False, loggers=())
    with pytest.raises(StepError, match=re.escape(
            "step 1: optimizer 'optimizer' (SAMNeedsClosure) needs a closure: self.step(name, closure=fn), where fn "
            "computes the loss, calls self.backward(loss) and returns it (the step was abandoned: parameters and "
            "optimizer state are unchanged; but `model.0.weight`, `model.0.bias`, `model.2.weight` and 1 more "
            "changed in this step other than by self.step or the Trainer's update (by hand, as SAM's first_step "
            "does), and stay changed)")):
        trainer.fit()
    assert all(not torch.equal(a, b) for a, b in zip(before, model.parameters()))  # as the report says


def pgd_batches(n=3):
    gen = torch.Generator().manual_seed(11)
    return [(torch.randn(16, 4, generator=gen), torch.randint(0, 3, (16,), generator=gen)) for _ in range(n)]


def pgd_delta(model, x, y, eps=0.1, alpha=0.05, clear=None):
    """One step of an L-inf PGD attack (fast adversarial training's): the input's gradient by loss.backward()."""
    delta = torch.zeros_like(x).uniform_(-eps, eps).requires_grad_(True)
    F.cross_entropy(model(x + delta), y).backward()  # also writes the parameters' .grad
    if clear is not None:
        clear()
    return (delta + alpha * delta.grad.sign()).clamp(-eps, eps).detach()


class PGDTraining(Trainer):
    automatic = False
    clears = False  # the fix: clear the attack's gradient before the training backward

    def configure_optimizers(self):
        return torch.optim.SGD(self.model.parameters(), lr=0.1)

    def training_step(self, batch):
        x, y = batch
        opt = self.optimizers["optimizer"]
        delta = pgd_delta(self.model, x, y, clear=opt.zero_grad if self.clears else None)
        loss = F.cross_entropy(self.model(x + delta), y)
        self.backward(loss)
        self.step()
        return loss


def classifier():
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))


def test_gradient_an_outside_backward_left_on_the_parameters_is_named_before_the_manual_backward_adds_to_it():
    torch.manual_seed(0)
    model = classifier()
    before = copy.deepcopy(model.state_dict())
    trainer = PGDTraining(model=model, train_data=pgd_batches(), max_steps=3, device="cpu", progress=False,
                          loggers=(), guard={"check": "always"})
    with pytest.raises(StepError, match=re.escape(
            "step 1: `model.0.weight`, `model.0.bias`, `model.2.weight` and more hold gradient from a backward run "
            "outside self.backward in this step (loss.backward() in training_step: an attack taking an input's "
            "gradient, say), which self.backward(loss, optimizer='optimizer') would add to")):
        trainer.fit()
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())

    # the fix named in the message: bit-identical to the hand-written loop, in every guard mode
    for check in ("always", "auto", "off"):
        torch.manual_seed(0)
        ref, ours = classifier(), classifier()
        ours.load_state_dict(ref.state_dict())
        opt = torch.optim.SGD(ref.parameters(), lr=0.1)
        torch.manual_seed(1)
        for x, y in pgd_batches():
            delta = pgd_delta(ref, x, y, clear=opt.zero_grad)
            F.cross_entropy(ref(x + delta), y).backward()
            opt.step()
            opt.zero_grad()
        fixed = type("Fixed", (PGDTraining,), {"clears": True})
        torch.manual_seed(1)
        fixed(model=ours, train_data=pgd_batches(), max_steps=3, device="cpu", progress=False, loggers=(),
              guard={"check": check}).fit()
        assert_same_params(ref, ours, exact=True)


class AssignsGradient(Trainer):
    """Gradient written by hand (implicit MAML's meta-gradient), then a regularizer's through self.backward."""

    automatic = False

    def training_step(self, batch):
        x, y = batch
        params = list(self.model.parameters())
        for p, g in zip(params, torch.autograd.grad(F.mse_loss(self.model(x), y), params)):
            p.grad = g
        self.backward(sum(p.pow(2).sum() for p in params) * 1e-3)
        self.step()


def test_gradient_assigned_by_hand_is_not_taken_for_an_outside_backward():
    torch.manual_seed(0)
    ref, ours = net(), net()
    ours.load_state_dict(ref.state_dict())
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for x, y in regression_batches():
        params = list(ref.parameters())
        for p, g in zip(params, torch.autograd.grad(F.mse_loss(ref(x), y), params)):
            p.grad = g
        (sum(p.pow(2).sum() for p in params) * 1e-3).backward()
        opt.step()
        opt.zero_grad()
    AssignsGradient(model=ours, train_data=regression_batches(), max_steps=4, device="cpu", progress=False,
                    loggers=(), optimizer=lambda p: torch.optim.SGD(p, lr=0.1), guard={"check": "always"}).fit()
    assert_same_params(ref, ours, exact=True)


def test_an_automatic_step_that_fails_after_moving_a_parameter_by_hand_says_so():
    class NudgesThenFails(Trainer):
        def training_step(self, batch):
            with torch.no_grad():
                self.model[2].bias.add_(1.0)  # by hand, outside any update
            raise ValueError("bad batch")

    torch.manual_seed(0)
    model = net()
    trainer = NudgesThenFails(model=model, train_data=regression_batches(2), max_steps=2, device="cpu",
                              progress=False, loggers=(), optimizer=lambda p: torch.optim.SGD(p, lr=0.1))
    with pytest.raises(StepError, match=re.escape(
            "step 1 failed and was abandoned (parameters and optimizer state are unchanged; but `model.2.bias` "
            "changed in this step other than by self.step or the Trainer's update")):
        trainer.fit()
