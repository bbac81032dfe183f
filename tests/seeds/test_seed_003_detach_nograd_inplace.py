"""Seed 003: a loss cut from its graph by .detach() or torch.no_grad(), and in-place edits."""
import warnings

import pytest
import torch

from safeloop import InplaceModificationError, NoGraphError, Trainer


def step_of(body):
    return type("Step", (Trainer,), {"training_step": lambda self, batch: body(self, batch)})


def manual_step_of(body):
    """Manual mode: the same loss given to self.backward, then self.step."""
    def training_step(self, batch):
        loss = body(self, batch)
        self.backward(loss)
        self.step()
        return loss
    return type("ManualStep", (Trainer,), {"automatic": False, "training_step": training_step})


def detached(self, batch):
    y = self.model(batch) * 3
    z = y.detach()
    return (z ** 2).mean()


def under_no_grad(self, batch):
    y = self.model(batch) * 3
    with torch.no_grad():
        z = y * 2
    return (z ** 2).mean()


def inplace_on_saved(self, batch):
    y = self.model(batch).sigmoid()  # sigmoid saves its output for backward
    y.add_(1)
    return (y ** 2).mean()


def inplace_on_unsaved(self, batch):
    y = self.model(batch) * 3  # multiplying by a number saves nothing that add_ changes
    y.add_(1)
    return (y ** 2).mean()


@pytest.mark.parametrize("make", [step_of, manual_step_of], ids=["automatic", "manual"])
@pytest.mark.parametrize("body, why, fix", [
    (detached, r"built from detached tensors \(.detach\(\)\)", r"remove .detach\(\) on the path"),
    (under_no_grad, r"computed under torch.no_grad\(\)", r"compute the loss outside torch.no_grad\(\)"),
])
def test_loss_without_graph_says_which_cut_it(fit, make, body, why, fix):
    model = torch.nn.Linear(4, 2)
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(NoGraphError, match=f"step 1, loss 'loss'.*{why}.*To fix: {fix}"):
        fit(make(body), model=model)
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))


def test_inplace_change_of_a_saved_tensor_is_explained(fit):
    with pytest.raises(InplaceModificationError, match=r"step 1, loss 'loss'.*\[torch.FloatTensor \[3, 2\]\], the output of Sigmoid\).*"
                       r"was changed in place.*out-of-place form.*guard.trace=true") as info:
        fit(step_of(inplace_on_saved))
    assert info.value.node_name == "Sigmoid"


def test_inplace_change_of_an_unsaved_tensor_runs_clean(fit):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fit(step_of(inplace_on_unsaved), guard={"check": "always"})


def test_gan_discriminator_loss_detached_in_the_wrong_place(fit):
    """The seed's GAN story: D's loss built only from detached outputs has no graph to D."""
    def d_step(self, batch):
        fake = self.model(batch)
        score = self.model(fake).detach()  # meant fake.detach(): D itself is cut off
        return score.mean()

    model = torch.nn.Linear(4, 4)
    with pytest.raises(NoGraphError, match="built from detached tensors"):
        fit(step_of(d_step), model=model)
