"""An autocast region around the whole training loop. pytorch/pytorch's torch/amp/autocast_mode.py (``autocast``'s
docstring: wrap only the forward pass(es) and the loss computation; backward passes under autocast are not
recommended) and docs/source/notes/amp_examples.rst (commit af616bb641d3825cc8216e583f2918912cc77103) enter
``autocast`` once per iteration. Entered once around the loop instead (``with torch.autocast(...): for x, y in
loader: ...``, or a Trainer's ``fit()`` called inside such a region), autocast keeps its cache of low-precision
weight copies until the outermost region exits: the forwards after the first update run with the weights of step 1,
and each step's loss reaches the ``ToCopyBackward0`` node made at step 1.

Changes: a single ``nn.Linear(4, 2)``, ``mse_loss``, SGD, 6 random batches of 8, bf16 autocast on the CPU.

The guard stops such a loop under watch, at step 4 (steps 2 and 3 trained with stale weights: a one-step lag is
allowed), with a ``CarriedGraphError`` that names autocast's weight copies and says to enter ``autocast`` per
iteration. ``fit()`` inside such a region is refused before training. Entered per iteration, the same loop trains
with the updated weights, and the port (``precision="bf16-mixed"``) matches it.
"""
import pytest
import torch
import torch.nn.functional as F

from safeloop import CarriedGraphError, ConfigError, GraphGuard, Trainer
from safeloop.watch import Watch

from .harness import batches, checks, compare, fixed

STEPS = 6


def make_model():
    return torch.nn.Linear(4, 2)


def data():
    return fixed(batches(STEPS, (8, 4), (8, 2), seed=5))


def per_iteration_hand(net, loader):
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    for x, y in loader:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = F.mse_loss(net(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()


def one_region_hand(net, loader):
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        for x, y in loader:
            loss = F.mse_loss(net(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()


class Port(Trainer):
    def configure_optimizers(self):
        return torch.optim.SGD(self.model.parameters(), lr=0.1)

    def training_step(self, batch):
        x, y = batch
        return F.mse_loss(self.model(x), y)


@pytest.mark.parametrize("check", checks())
def test_autocast_entered_per_iteration(check):
    compare(make_model, per_iteration_hand, Port, data(), check, steps=STEPS, precision="bf16-mixed")


def test_one_region_trains_with_stale_weights():
    torch.manual_seed(0)
    a = make_model()
    b = make_model()
    b.load_state_dict(a.state_dict())
    per_iteration_hand(a, data()(a))
    one_region_hand(b, data()(b))
    assert not torch.equal(a.weight, b.weight)


@pytest.mark.parametrize("check", ["auto", "always"])
def test_one_region_under_watch_is_stopped_naming_autocast(check):
    torch.manual_seed(0)
    net = make_model()
    with pytest.raises(CarriedGraphError) as caught, Watch(GraphGuard(check=check), __file__):
        one_region_hand(net, data()(net))
    assert "a low-precision copy of a weight that torch.autocast made during an earlier step" in str(caught.value)
    assert "enter torch.autocast around each forward and its loss only" in str(caught.value)


@pytest.mark.parametrize("precision", ["bf16-mixed", "32"])
def test_fit_inside_an_autocast_region_is_refused_before_training(precision):
    torch.manual_seed(0)
    net = make_model()
    before = {k: v.clone() for k, v in net.state_dict().items()}
    trainer = Port(model=net, train_data=data()(net), max_steps=STEPS, device="cpu", progress=False, loggers=(),
                   precision=precision)
    with pytest.raises(ConfigError, match=r"fit\(\) is called inside torch.autocast\('cpu'\): autocast keeps its "
                                          r"low-precision copy of each weight.*call fit\(\) outside it"):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            trainer.fit()
    assert trainer.state.step == 0 and all(torch.equal(v, before[k]) for k, v in net.state_dict().items())
