"""Seed 002: two backwards through one graph need retain_graph=True on all but the last.
The Trainer does that bookkeeping when training_step returns both losses."""
import pytest
import torch
import torch.nn.functional as F

from safeloop import DoubleBackwardError, StepError, Trainer

inputs = torch.randn(5)
target = torch.tensor([1.0, 2.0])


class TwoBackwardsByHand(Trainer):
    """The seed's failing code inside a training step."""

    def training_step(self, batch):
        computed = F.cross_entropy(self.model(inputs), target)
        computed.backward()
        return computed


class SameLossTwice(Trainer):
    """The seed's fixed code, the same loss back-propagated twice, in manual mode: ``retain_graph=True`` on the first."""

    automatic = False

    def training_step(self, batch):
        computed = F.cross_entropy(self.model(inputs), target)
        self.backward(computed, retain_graph=True)
        self.backward(computed)
        self.step()


class SameLossReturnedTwice(Trainer):
    """Returned under two names in automatic mode: its gradient would count twice, which a dict is not for."""

    def training_step(self, batch):
        computed = F.cross_entropy(self.model(inputs), target)
        return {"first": computed, "second": computed}


def test_backward_twice_is_caught_before_the_second_backward(fit):
    with pytest.raises(DoubleBackwardError, match="already back-propagated without retain_graph"):
        fit(TwoBackwardsByHand, model=torch.nn.Linear(5, 2), data=[0] * 4)


def test_the_seeds_fix_in_manual_mode_matches_it_and_a_dict_of_the_loss_twice_is_refused(fit):
    """``self.backward(computed, retain_graph=True); self.backward(computed)`` writes the seed's fixed gradients, with
    and without the guard; returning ``{"first": computed, "second": computed}`` is a StepError before any backward."""
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

    for check in ("always", "off"):
        grads.clear()
        model = torch.nn.Linear(5, 2)
        model.load_state_dict(ours.state_dict())
        fit(Capture, model=model, steps=1, data=[0], guard={"check": check})
        assert len(grads) == len(expected)
        for got, want in zip(grads, expected):
            torch.testing.assert_close(got, want)
    with pytest.raises(StepError, match=r"step 1: training_step returned 'first' and 'second', and 'first' and "
                                        r"'second' are the same tensor"):
        fit(SameLossReturnedTwice, model=torch.nn.Linear(5, 2), steps=1, data=[0])
