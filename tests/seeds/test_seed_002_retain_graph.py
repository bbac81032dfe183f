"""Seed 002: two backwards through one graph need retain_graph=True on all but the last.
The Trainer does that bookkeeping when training_step returns both losses."""
import pytest
import torch
import torch.nn.functional as F

from safeloop import DoubleBackwardError, Trainer

inputs = torch.randn(5)
target = torch.tensor([1.0, 2.0])


class TwoBackwardsByHand(Trainer):
    """The seed's failing code inside a training step."""

    def training_step(self, batch):
        computed = F.cross_entropy(self.model(inputs), target)
        computed.backward()
        return computed


class SameLossTwice(Trainer):
    """The seed's intent, the safeloop way: name both backwards, the Trainer retains as needed."""

    def training_step(self, batch):
        computed = F.cross_entropy(self.model(inputs), target)
        return {"first": computed, "second": computed}


def test_backward_twice_is_caught_before_the_second_backward(fit):
    with pytest.raises(DoubleBackwardError, match="already back-propagated without retain_graph"):
        fit(TwoBackwardsByHand, model=torch.nn.Linear(5, 2), data=[0] * 4)


def test_returning_both_losses_matches_the_retain_graph_fix(fit):
    torch.manual_seed(0)
    ours, ref = torch.nn.Linear(5, 2), torch.nn.Linear(5, 2)
    ref.load_state_dict(ours.state_dict())
    computed = F.cross_entropy(ref(inputs), target)
    computed.backward(retain_graph=True)  # the seed's fix
    computed.backward()
    expected = [p.grad.clone() for p in ref.parameters()]

    grads = []

    class Capture(SameLossTwice):
        def on_before_optimizer_step(self, name, optimizer):
            grads.extend(p.grad.clone() for p in self.model.parameters())

    for check in ("always", "off"):  # with and without the guard's walk deciding retain
        grads.clear()
        model = torch.nn.Linear(5, 2)
        model.load_state_dict(ours.state_dict())
        fit(Capture, model=model, steps=1, data=[0], guard={"check": check})
        for got, want in zip(grads, expected):
            torch.testing.assert_close(got, want)
