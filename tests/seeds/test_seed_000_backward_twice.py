"""Seed 000: backward called twice on one loss, a forward pass reusing an input built once,
and gradients edited by hand between two backwards."""
import pytest
import torch

from safeloop import DoubleBackwardError, GraphReuseError, Trainer


class BackwardInStep(Trainer):
    """Example 1: the training step back-propagates itself, then hands the loss over."""

    def training_step(self, batch):
        loss = self.model(batch).pow(2).mean()
        loss.backward()
        return loss


class EditsGradsThenReturns(Trainer):
    """Example 3: backward, scale the gradients by hand, return the loss."""

    def training_step(self, batch):
        loss = self.model(batch).pow(2).mean()
        loss.backward()
        for p in self.model.parameters():
            p.grad *= 2.0
        return loss


class EditsGradsInHook(Trainer):
    """Example 3, fixed: the gradient edit goes where gradients exist, after the Trainer's backward."""

    def training_step(self, batch):
        return self.model(batch).pow(2).mean()

    def on_after_backward(self, name):
        for p in self.model.parameters():
            p.grad *= 2.0


class ReusesInput(Trainer):
    """Example 2: the input of every forward pass was itself computed, with a graph, once."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.embed = torch.nn.Linear(4, 4)
        self.inputs = self.embed(torch.randn(3, 4)).tanh()

    def training_step(self, batch):
        return self.model(self.inputs).pow(2).mean()


def test_backward_inside_training_step_is_a_double_backward(fit):
    model = torch.nn.Linear(4, 2)
    with pytest.raises(DoubleBackwardError, match=r"step 1, loss 'loss'.*already back-propagated without "
                       r"retain_graph.*do not call loss.backward\(\) in training_step") as info:
        fit(BackwardInStep, model=model)
    assert info.value.step == 1
    assert all(p.grad is None for p in model.parameters())  # the step's gradients were dropped


def test_gradients_present_when_the_step_returns_are_reported_even_if_the_graph_survived(fit):
    class RetainsThenReturns(Trainer):
        def training_step(self, batch):
            loss = self.model(batch).sum()  # a graph with nothing to free
            loss.backward(retain_graph=True)
            return loss

    with pytest.raises(DoubleBackwardError, match="gradients were already present when training_step returned"):
        fit(RetainsThenReturns)


def test_hand_edited_gradients_then_return_is_caught(fit):
    with pytest.raises(DoubleBackwardError, match="training_step, a hook or an earlier loss called backward"):
        fit(EditsGradsThenReturns)


def test_gradient_edit_in_on_after_backward_works_and_doubles_the_update(fit):
    torch.manual_seed(0)
    plain, edited = torch.nn.Linear(4, 2), torch.nn.Linear(4, 2)
    edited.load_state_dict(plain.state_dict())
    start = plain.weight.detach().clone()

    class Plain(Trainer):
        def training_step(self, batch):
            return self.model(batch).pow(2).mean()

    data = [torch.randn(3, 4)]
    fit(Plain, model=plain, steps=1, data=data)
    fit(EditsGradsInHook, model=edited, steps=1, data=data)
    torch.testing.assert_close(edited.weight - start, 2 * (plain.weight - start))


def test_input_computed_once_with_a_graph_is_caught(fit):
    with pytest.raises(GraphReuseError, match=r"reaches TanhBackward0.*held by `self.inputs`"):
        fit(ReusesInput)
