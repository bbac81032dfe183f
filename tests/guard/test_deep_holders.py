"""A graph built before the loop and held deep inside an object a variable keeps: a torch.distributions object built
from the model's output (``dist = Normal(model(c), 1.0)`` once, ``-dist.log_prob(x)`` every step), its transforms, an
object of the script's own class nested a few levels down. Stopped at step 1, before any update, naming the tensor
inside it and advising to build the object inside the loop; a tensor made from trained parameters that nothing
names is advised to be made again, never to be kept detached (which would stop training what it is made from)."""
import re
import warnings

import pytest
import torch
from torch.distributions import AffineTransform, Normal, TransformedDistribution

from safeloop import DoubleBackwardError, GraphGuard, GraphLifecycleError, GraphReuseError
from safeloop.watch import Watch


def setup():
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    return model, torch.optim.SGD(model.parameters(), lr=0.1), torch.randn(4, 3), torch.randn(4, 2)


def state(model):
    return [p.detach().clone() for p in model.parameters()]


class Leaf:
    def __init__(self, value):
        self.value = value


class Part:
    def __init__(self, inner):
        self.inner = inner


class Flow:
    """An object of the script's own class keeping its tensor three levels down (``flow.parts[0].inner.value``)."""

    def __init__(self, value):
        self.parts = [Part(Leaf(value))]


def normal(model, c):
    return Normal(model(c), 1.0)


def transformed(model, c):
    return TransformedDistribution(Normal(torch.zeros(4, 2), 1.0), [AffineTransform(loc=model(c), scale=2.0)])


def stepped(guard):
    return guard.step() if guard is not None else warnings.catch_warnings()


def backward(guard, loss):
    guard.backward(loss) if guard is not None else loss.backward()


def built_once(guard, model, opt, c, x, build, steps=3):
    """``dist = build(model, c)`` once before the loop, ``loss = -dist.log_prob(x).mean()`` every step."""
    dist = build(model, c)
    for _ in range(steps):
        with stepped(guard):
            loss = -dist.log_prob(x).mean()
            backward(guard, loss)
            opt.step()
            opt.zero_grad()
    return state(model)


def built_in_the_loop(guard, model, opt, c, x, build, steps=3):
    for _ in range(steps):
        with stepped(guard):
            dist = build(model, c)
            loss = -dist.log_prob(x).mean()
            backward(guard, loss)
            opt.step()
            opt.zero_grad()
    return state(model)


@pytest.mark.parametrize("build, held", [(normal, "dist.loc"), (transformed, "dist.transforms[0].loc")])
@pytest.mark.parametrize("watched", [False, True])
def test_a_distribution_built_once_from_the_model_is_stopped_at_step_one_and_built_again_in_the_loop(
        build, held, watched):
    model, opt, c, x = setup()
    with pytest.raises(RuntimeError, match="backward through the graph a second time"):
        built_once(None, model, opt, c, x, build)
    model, opt, c, x = setup()
    before = state(model)
    with pytest.raises(GraphReuseError, match=re.escape("(step 1, loss 'loss')") + ".*" + re.escape(
            f"held by `{held}`") + ".*" + re.escape(f"To fix: build `dist` inside the loop (it holds the graph in "
                                                     f"`{held}`, made when it is built)")) as caught:
        if watched:
            with Watch(GraphGuard(check="always"), __file__):
                built_once(None, model, opt, c, x, build)
        else:
            built_once(GraphGuard(model, opt, check="always"), model, opt, c, x, build)
    assert caught.value.holder == held
    assert not any("detach" in fix for fix in caught.value.fixes)  # it is made from the parameters: they would stop
    assert all(torch.equal(a, b) for a, b in zip(state(model), before))
    model, opt, c, x = setup()
    bare = built_in_the_loop(None, model, opt, c, x, build)
    model, opt, c, x = setup()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        if watched:
            with Watch(GraphGuard(check="always"), __file__):
                fixed = built_in_the_loop(None, model, opt, c, x, build)
        else:
            fixed = built_in_the_loop(GraphGuard(model, opt, check="always"), model, opt, c, x, build)
    assert all(torch.equal(a, b) for a, b in zip(fixed, bare)) and not torch.equal(fixed[0], before[0])


def test_a_graph_three_levels_inside_an_object_of_the_scripts_class_is_named_at_step_one():
    model, opt, c, x = setup()
    guard = GraphGuard(model, opt, check="always")
    flow = Flow(model(c))
    with pytest.raises(GraphReuseError, match=re.escape("(step 1, loss 'loss')") + ".*" + re.escape(
            "held by `flow.parts[0].inner.value`") + ".*" + re.escape("To fix: build `flow` inside the loop")):
        for _ in range(3):
            with guard.step():
                loss = (flow.parts[0].inner.value * x).mean()
                guard.backward(loss)
                opt.step()
                opt.zero_grad()


class Fitter:
    """A trainer class whose method runs the steps (DeepXDE's callback opening them), the graph three levels inside
    ``self``: ``self.flow.parts[0].inner.value``."""

    def __init__(self):
        self.model, self.opt, c, self.x = setup()
        self.flow = Flow(self.model(c))
        self.guard = GraphGuard(self.model, self.opt, check="always")

    def fit(self):
        for _ in range(3):
            with self.guard.step():
                loss = (self.flow.parts[0].inner.value * self.x).mean()
                self.guard.backward(loss)
                self.opt.step()
                self.opt.zero_grad()


def test_a_graph_inside_the_object_running_the_steps_is_computed_in_the_loop_not_self_built_again():
    with pytest.raises(GraphReuseError, match=re.escape("held by `self.flow.parts[0].inner.value`")) as caught:
        Fitter().fit()
    assert caught.value.fixes[0].startswith("compute `self.flow.parts[0].inner.value` inside the loop, with the "
                                            "object that keeps it")


def holding(value):
    return lambda: value  # a closure: no variable the guard searches holds `value`


def test_an_unnamed_graph_made_from_the_parameters_is_advised_to_be_made_again_never_kept_detached():
    model, opt, c, x = setup()
    guard = GraphGuard(model, opt, check="always")
    kept = holding(model(c))
    with pytest.raises((GraphReuseError, DoubleBackwardError), match="held by an unnamed tensor") as caught:
        for _ in range(3):
            with guard.step():
                loss = (kept() * x).mean()
                guard.backward(loss)
                opt.step()
                opt.zero_grad()
    assert caught.value.fixes[0].startswith("compute the tensor inside the loop, with the object that keeps it")
    assert not any("detach" in fix or "`tensor`" in fix for fix in caught.value.fixes)


def test_an_unnamed_graph_made_from_no_trained_parameter_may_still_be_kept_as_a_constant():
    """(What the fix above keeps: made from no trained parameter, a constant is a fix.)"""
    model, opt, c, x = setup()
    guard = GraphGuard(model, opt, check="always")
    scale = torch.ones(4, 2, requires_grad=True)  # an input differentiated against, trained by no optimizer
    kept = holding(scale * 2)
    with pytest.raises((GraphReuseError, DoubleBackwardError), match="held by an unnamed tensor") as caught:
        for _ in range(3):
            with guard.step():
                loss = (model(c) * kept() * x).mean()
                guard.backward(loss)
                opt.step()
                opt.zero_grad()
    assert any(fix.startswith("if it is meant as a constant") for fix in caught.value.fixes)


def test_a_distribution_built_in_the_first_step_and_kept_is_advised_to_be_built_every_step():
    """Built by the first step (``if dist is None``) and kept: a cache of a value made from the parameters, made again
    every step; the tensor inside it, not the object, is what a carried state would detach."""
    model, opt, c, x = setup()
    guard = GraphGuard(model, opt, check="always")
    dist = None
    with pytest.raises(GraphLifecycleError, match=re.escape("(step 2, loss 'loss')") + ".*" + re.escape(
            "held by `dist.loc`") + ".*" + re.escape("To fix: make `dist` again every step instead of keeping it: it "
                                                     "is made from `model.weight`, `model.bias`")) as caught:
        for _ in range(3):
            with guard.step():
                if dist is None:
                    dist = Normal(model(c), 1.0)
                loss = -dist.log_prob(x).mean()
                guard.backward(loss)
                opt.step()
                opt.zero_grad()
    assert "(`dist = None`, where forward rebuilds it when it is None)" in caught.value.fixes[0]
    assert "(`dist.loc = dist.loc.detach()`)" in caught.value.fixes[1]


class Columns:
    def __init__(self):
        self.data = {}


class Buffer:
    """A replay buffer of the script's own class: the rollout's tensors, by key, in a private storage object
    (TorchRL's ``buffer._storage._storage``)."""

    def __init__(self):
        self._storage = Columns()

    def extend(self, **columns):
        self._storage.data.update(columns)

    def __getitem__(self, key):
        return self._storage.data[key]


def critic_loop(guard, no_grad: bool):
    """PPO's value targets computed once per rollout with the critic (``target = reward + gamma * critic(next)``)
    and stored in a buffer; the critic regresses on them over several epochs. Without ``torch.no_grad()`` the
    stored target keeps the critic's graph, which the first epoch's backward frees."""
    torch.manual_seed(0)
    critic = torch.nn.Linear(3, 1)
    opt = torch.optim.SGD(critic.parameters(), lr=0.1)
    states, reward = torch.randn(8, 3), torch.randn(8, 1)
    buffer = Buffer()
    with torch.no_grad() if no_grad else warnings.catch_warnings():
        buffer.extend(state=states, target=reward + 0.9 * critic(states.roll(1, 0)))
    for _ in range(3):
        with stepped(guard):
            loss = (critic(buffer["state"]) - buffer["target"]).pow(2).mean()
            backward(guard, loss)
            opt.step()
            opt.zero_grad()
    return state(critic)


def test_a_target_stored_with_the_critics_graph_is_advised_no_grad_as_a_target():
    with pytest.raises(RuntimeError, match="backward through the graph a second time"):
        critic_loop(None, no_grad=False)
    with pytest.raises(GraphReuseError, match=re.escape("held by `buffer._storage.data['target']`")) as caught:
        critic_loop(GraphGuard(check="always"), no_grad=False)
    assert caught.value.step == 1
    assert caught.value.fixes[1].startswith("if it is a target the loss compares with, not a value to train through")
    assert "compute it under `torch.no_grad()`" in caught.value.fixes[1]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fixed = critic_loop(GraphGuard(check="always"), no_grad=True)
    assert all(torch.equal(a, b) for a, b in zip(fixed, critic_loop(None, no_grad=True), strict=True))

