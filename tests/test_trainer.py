"""The Trainer's step cycle: parity with plain PyTorch, hooks, accumulation, validation, state."""
import random
import re
import warnings
import weakref

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

from safeloop import (Callback, ConfigError, ConfigWarning, DoubleBackwardError, GraphReuseError, StepError,
                      Trainer)
from safeloop.models import MLP

from .conftest import manual

try:
    import numpy
except ImportError:  # optional: seed_everything seeds it when it is there
    numpy = None


def dataset(n=256, d=8, seed=1):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=gen)
    return TensorDataset(x, x.sum(1, keepdim=True).sin())


def loader(ds, batch=16, seed=2, shuffle=True):
    return DataLoader(ds, batch_size=batch, shuffle=shuffle, generator=torch.Generator().manual_seed(seed))


def test_200_steps_bit_identical_to_hand_written_loop():
    ds = dataset()
    torch.manual_seed(3)
    ref = MLP(8, 32, 1, depth=3)
    ours = MLP(8, 32, 1, depth=3)
    ours.load_state_dict(ref.state_dict())

    opt = torch.optim.Adam(ref.parameters(), lr=1e-3)
    steps, data = 0, loader(ds)
    while steps < 200:
        for x, y in data:
            opt.zero_grad(set_to_none=True)
            F.mse_loss(ref(x), y).backward()
            opt.step()
            steps += 1
            if steps == 200:
                break

    trainer = Trainer(model=ours, train_data=loader(ds), optimizer=lambda p: torch.optim.Adam(p, lr=1e-3),
                      max_steps=200, device="cpu", progress=False)
    trainer.fit()
    assert trainer.state.step == 200 and trainer.state.epoch == 12
    for a, b in zip(ref.parameters(), ours.parameters()):
        assert torch.equal(a, b)


def test_hooks_fire_in_documented_order():
    calls = []

    class Recorder(Callback):
        def on_step_end(self, trainer, losses):
            calls.append("callback.on_step_end")

    class Hooked(Trainer):
        """Every hook is set below, each recording its name."""

    for name in ["on_fit_start", "on_step_start", "on_before_backward", "on_after_backward",
                 "on_before_optimizer_step", "on_step_end", "on_validation_end", "on_fit_end"]:
        setattr(Hooked, name, lambda self, *a, _n=name: calls.append(_n))

    ds = dataset(32)
    Hooked(model=MLP(8, 8, 1), train_data=loader(ds), val_data=loader(ds, shuffle=False), val_every=2,
           optimizer=lambda p: torch.optim.SGD(p, lr=0.1), max_steps=2, device="cpu", progress=False,
           callbacks=[Recorder()]).fit()
    step = ["on_step_start", "on_before_backward", "on_after_backward", "on_before_optimizer_step",
            "on_step_end", "callback.on_step_end"]
    assert calls == ["on_fit_start", "on_validation_end", *step, *step, "on_validation_end", "on_fit_end"]


@pytest.mark.parametrize("mode", ["automatic", "manual"])
def test_a_hook_set_on_the_instance_is_called(mode):
    """``trainer.on_step_end = fn`` (and any hook) works as an override in the class does, and a later fit
    sees a hook set between fits."""
    calls = []
    cls = Trainer if mode == "automatic" else manual(Trainer)
    trainer = cls(model=MLP(8, 8, 1), train_data=loader(dataset(32)), optimizer=lambda p: torch.optim.SGD(p, lr=0.1),
                  max_steps=2, device="cpu", progress=False)
    trainer.on_step_end = lambda losses: calls.append(("step end", trainer.state.step, sorted(losses)))
    trainer.fit()
    trainer.on_before_optimizer_step = lambda name, opt: calls.append(("before step", name))
    trainer.max_steps = 3
    trainer.fit()
    assert calls == [("step end", 1, ["loss"]), ("step end", 2, ["loss"]), ("before step", "optimizer"),
                     ("step end", 3, ["loss"])]


def test_gradient_accumulation_equals_one_big_batch():
    ds = dataset(32)
    torch.manual_seed(4)
    big, small = MLP(8, 16, 1), MLP(8, 16, 1)
    small.load_state_dict(big.state_dict())
    opt = torch.optim.SGD(big.parameters(), lr=0.1)
    x, y = ds.tensors
    F.mse_loss(big(x), y).backward()
    opt.step()

    Trainer(model=small, train_data=loader(ds, batch=8, shuffle=False), grad_accum=4, max_steps=1,
            optimizer=lambda p: torch.optim.SGD(p, lr=0.1), device="cpu", progress=False).fit()
    for a, b in zip(big.parameters(), small.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("check", ["auto", "always"])
@pytest.mark.parametrize("inside, error, match", [
    ("attack", DoubleBackwardError, r"\(step 1, loss 'loss'\): gradients were changed inside training_step since the "
                                    r"last micro-batch's backward \(under gradient accumulation"),
    ("zero_in_place", DoubleBackwardError, r"a zero_grad\(set_to_none=False\) changes them too"),
    ("zero_grad", StepError, r"step 1: under gradient accumulation, the gradients this update's earlier micro-batches "
                             r"left \(`self.model.0.weight`, `self.model.0.bias`, `self.model.2.weight` and more\) "
                             r"were cleared in training_step"),
])
def test_gradients_changed_in_training_step_between_micro_batches_of_one_update_stop_it(check, inside, error, match):
    """Under grad_accum, what a later micro-batch's training_step does to the gradients the earlier ones left (a
    backward of its own adds to them, a zero_grad() drops them) would change the update without a word: it is an
    error before that micro-batch's backward, the parameters unchanged, as in a step's first micro-batch."""
    class Port(Trainer):
        def training_step(self, batch):
            x, y = batch
            self.calls = getattr(self, "calls", 0) + 1
            if self.calls % 2 == 0:  # the second micro-batch of each update
                if inside == "attack":  # an input's gradient taken by a plain backward
                    x = x.clone().requires_grad_()
                    F.mse_loss(self.model(x), y).backward()
                    x = (x + 0.1 * x.grad.sign()).detach()
                else:
                    self.model.zero_grad(set_to_none=inside == "zero_grad")
            return F.mse_loss(self.model(x), y)

    torch.manual_seed(0)
    model = MLP(8, 16, 1)
    before = [p.detach().clone() for p in model.parameters()]
    trainer = Port(model=model, train_data=loader(dataset(32), batch=8, shuffle=False), grad_accum=2, max_steps=2,
                   optimizer=lambda p: torch.optim.SGD(p, lr=0.1), device="cpu", progress=False, loggers=(),
                   guard={"check": check})
    with pytest.raises(error, match=match):
        trainer.fit()
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))


def test_grad_accum_set_in_on_epoch_start_groups_that_pass_and_a_change_mid_pass_is_refused():
    """``grad_accum`` changed in ``on_epoch_start`` (Lightning's ``GradientAccumulationScheduler``) groups that pass's
    batches and divides their losses by the new value, as a fit begun with it; changed in the middle of a pass, it
    would group the pass by one value and divide by the other: refused."""
    class Scheduled(Trainer):
        def on_epoch_start(self):
            self.grad_accum = 2 if self.state.epoch >= 1 else 1

    def run(trainer_class, **kwargs):
        torch.manual_seed(0)
        trainer = trainer_class(model=MLP(8, 16, 1), train_data=loader(dataset(32), batch=8, shuffle=False),
                                optimizer=lambda p: torch.optim.SGD(p, lr=0.1), device="cpu", progress=False,
                                loggers=(), **kwargs)
        trainer.fit()
        return trainer

    scheduled = run(Scheduled, max_epochs=2)
    assert scheduled.state.step == 4 + 2
    first = run(Trainer, max_epochs=1)
    first.grad_accum, first.max_epochs = 2, 2  # a second fit goes on with the new value
    first.fit()
    assert all(torch.equal(a, b) for a, b in zip(scheduled.model.parameters(), first.model.parameters()))

    class MidPass(Trainer):
        def on_step_end(self, losses):
            self.grad_accum = 2

    with pytest.raises(ConfigError, match=r"grad_accum changed from 1 to 2 in the middle of pass 0, whose batches are "
                                          r"grouped by 1: change it in on_epoch_start"):
        run(MidPass, max_epochs=1)


def test_training_step_sees_batch_in_epoch_count_its_own_micro_batch_and_a_hook_returning_a_value_is_refused():
    """Under grad_accum=3, each micro-batch's training_step sees the pass's batches counted up to itself (Lightning's
    batch_idx + 1: 1..7 over windows of 3, 3 and 1); on_step_start returning a value (Lightning's -1 from
    on_train_batch_start, which ends the epoch) is refused rather than ignored."""
    class Seeing(Trainer):
        def training_step(self, batch):
            self.seen.append(self.state.batch_in_epoch)
            return super().training_step(batch)

        def on_step_end(self, losses):
            self.ends.append(self.state.batch_in_epoch)

    trainer = Seeing(model=MLP(8, 16, 1), train_data=loader(dataset(28), batch=4, shuffle=False), grad_accum=3,
                     max_epochs=1, optimizer=lambda p: torch.optim.SGD(p, lr=0.1), device="cpu", progress=False,
                     loggers=())
    trainer.seen, trainer.ends = [], []
    trainer.fit()
    assert trainer.seen == [1, 2, 3, 4, 5, 6, 7] and trainer.ends == [3, 6, 7]

    trainer.on_step_start = lambda: -1
    trainer.max_epochs = 2
    with pytest.raises(ConfigError, match="on_step_start returned a value: Lightning's on_train_batch_start returns -1"):
        trainer.fit()


def test_gradients_never_leak_into_the_next_step():
    """The gradient each backward leaves is exactly that step's gradient, not a sum with earlier ones."""
    seen = []

    class Check(Trainer):
        def on_after_backward(self, name):
            x, y = self.current
            params = list(self.model.parameters())
            expected = torch.autograd.grad(F.mse_loss(self.model(x), y), params)
            seen.append(all(torch.allclose(p.grad, g) for p, g in zip(params, expected)))

        def training_step(self, batch):
            self.current = batch
            return super().training_step(batch)

    Check(model=MLP(8, 16, 1), train_data=loader(dataset(64)), max_steps=6,
          optimizer=lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9), device="cpu", progress=False).fit()
    assert seen == [True] * 6


def test_validation_builds_no_graph_and_restores_train_mode():
    seen = []

    class Val(Trainer):
        def validation_step(self, batch):
            out = super().validation_step(batch)
            seen.append((torch.is_grad_enabled(), self.model.training, out.grad_fn))
            return out

    model = torch.nn.Sequential(MLP(8, 16, 1), torch.nn.Dropout(0.5))
    trainer = Val(model=model, train_data=loader(dataset(64)), val_data=loader(dataset(32, seed=5)),
                  val_every=2, max_steps=4, optimizer=lambda p: torch.optim.SGD(p, lr=0.1), device="cpu",
                  progress=False)
    trainer.fit()
    assert seen and all(s == (False, False, None) for s in seen)
    assert model.training
    assert [s for s, _ in trainer.state.val_history] == [0, 2, 4]


def test_no_step_graph_outlives_its_step_and_state_is_detached():
    alive = []

    class Watch(Trainer):
        refs = []

        def on_step_start(self):
            alive.append(sum(r() is not None for r in self.refs))

        def training_step(self, batch):
            loss = super().training_step(batch)
            token = type("Token", (), {})()
            loss.grad_fn.metadata["token"] = token  # dies with the graph's root node
            self.refs.append(weakref.ref(token))
            return loss

    trainer = Watch(model=MLP(8, 16, 1), train_data=loader(dataset(64)), max_steps=5,
                    optimizer=lambda p: torch.optim.SGD(p, lr=0.1), device="cpu", progress=False)
    trainer.fit()
    assert alive == [0] * 5
    assert all(r() is None for r in Watch.refs)
    assert all(v.grad_fn is None and not v.requires_grad for v in trainer.state.losses.values())


def test_bf16_autocast_on_cpu_trains():
    trainer = Trainer(model=MLP(8, 16, 1), train_data=loader(dataset(64)), precision="bf16", max_steps=3,
                      optimizer=lambda p: torch.optim.SGD(p, lr=0.1), device="cpu", progress=False)
    trainer.fit()
    assert trainer.state.step == 3 and torch.isfinite(trainer.state.losses["loss"])


@pytest.mark.parametrize("kwargs, message", [
    ({"max_steps": 0}, "max_steps must be a positive integer, got 0"),
    ({"precision": "fp16", "device": "cpu"}, "precision='fp16' is not one of 32, 32-true, fp32, bf16, "),
    ({"multi_loss": "avg"}, "multi_loss='avg' is not one of sequential, sum"),
    ({"guard": {"check": "sometimes"}}, "guard.check='sometimes' is not one of auto, always, off"),
    ({"train_data": None, "max_steps": None}, "train_data is required.*\n.*set max_steps or max_epochs"),
])
def test_bad_arguments_are_reported_together_at_construction(kwargs, message):
    args = dict(model=MLP(), train_data=[], max_steps=1, device="cpu")
    args.update(kwargs)
    with pytest.raises(ConfigError, match=message):
        Trainer(**args)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on a machine without CUDA")
def test_cuda_requested_without_cuda_is_a_start_up_error():
    with pytest.raises(ConfigError, match=re.escape("device='cuda' asks for CUDA, but torch.cuda.is_available() "
                                                    "is False") + ".*Use device=cpu, or device=auto"):
        Trainer(model=MLP(), train_data=[0], max_steps=1, device="cuda")


def test_device_auto_takes_cuda_only_when_present():
    trainer = Trainer(model=MLP(), train_data=[0], max_steps=1, device="auto")
    assert trainer.device.type == ("cuda" if torch.cuda.is_available() else "cpu")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("precision", ["32", "bf16", "16"])
@pytest.mark.parametrize("mode", ["automatic", "manual"])
def test_cuda_training_moves_batches_and_trains(precision, mode):
    model = MLP(8, 16, 1)
    cls = Trainer if mode == "automatic" else manual(Trainer)  # one step cycle: the GradScaler in both modes
    trainer = cls(model=model, train_data=loader(dataset(64)), precision=precision, max_steps=5,
                      optimizer=lambda p: torch.optim.SGD(p, lr=0.1), device="cuda", progress=False)
    trainer.fit()
    assert next(model.parameters()).device.type == "cuda"
    assert torch.isfinite(trainer.state.losses["loss"]).item()
    if precision == "16":  # the losses went through the GradScaler (it makes its scale at the first scale())
        assert trainer.scaler._scale is not None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_buffer_added_between_fits_is_moved_to_the_device_by_the_next_fit():
    model = MLP(8, 16, 1)
    trainer = Trainer(model=model, train_data=loader(dataset(64)), max_steps=2, device="cuda", progress=False,
                      loggers=(), optimizer=lambda p: torch.optim.SGD(p, lr=0.1))
    trainer.fit()
    model.register_buffer("offset", torch.zeros(1))  # on the CPU, while the parameters are on the GPU
    trainer.max_steps = 4
    trainer.fit()
    assert model.offset.device.type == "cuda"


# -- what real code relies on: module modes, manual validation, loud misconfigurations ------------------
class FrozenBackbone(torch.nn.Module):
    """A BatchNorm backbone the user froze (eval mode) under a trained head."""

    def __init__(self):
        super().__init__()
        self.backbone = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16))
        self.head = torch.nn.Linear(16, 1)

    def forward(self, x):
        return self.head(self.backbone(x))


def test_validation_gives_each_module_back_its_own_mode():
    class Recording(Trainer):
        def training_step(self, batch):
            if torch.is_grad_enabled():  # not validation, which runs it too
                self.modes.append((self.model.backbone.training, self.model.head.training))
            return super().training_step(batch)

    model = FrozenBackbone()
    model.backbone.eval()
    stats = model.backbone[1].running_mean.clone()
    trainer = Recording(model=model, train_data=loader(dataset()), val_data=loader(dataset(64), shuffle=False),
                        optimizer=lambda p: torch.optim.SGD(p, lr=0.1), max_steps=4, val_every=2, device="cpu",
                        progress=False, loggers=())
    trainer.modes = []
    trainer.fit()
    assert len(trainer.state.val_history) == 3  # before training, at step 2 and at step 4
    assert trainer.modes == [(False, True)] * 4
    assert torch.equal(model.backbone[1].running_mean, stats)  # the frozen statistics never moved


def test_manual_mode_with_val_data_needs_a_validation_step_and_uses_it():
    common = dict(model=MLP(8, 16, 1, 2), train_data=loader(dataset()), val_data=loader(dataset(64)),
                  optimizer=lambda p: torch.optim.SGD(p, lr=0.1), max_steps=2, device="cpu", progress=False,
                  loggers=())
    with pytest.raises(ConfigError, match=re.escape(
            "val_data is given, and in manual mode (automatic = False) the default validation_step cannot re-run "
            "training_step (it calls self.backward and self.step): override validation_step(batch)")):
        manual(Trainer)(**common)

    class Validated(manual(Trainer)):
        def validation_step(self, batch):
            x, y = batch
            return F.mse_loss(self.model(x), y)

    trainer = Validated(**common)
    trainer.fit()
    assert [step for step, _ in trainer.state.val_history] == [0, 2]


def test_an_optimizer_over_another_models_parameters_is_named_at_start():
    model, other = MLP(8, 16, 1, 2), MLP(8, 16, 1, 2)
    trainer = Trainer(model=model, train_data=loader(dataset()), optimizer=torch.optim.SGD(other.parameters(), lr=0.1),
                      max_steps=2, device="cpu", progress=False, loggers=())
    with pytest.raises(ConfigError, match=re.escape(
            "no optimizer holds any of the model's 4 trainable parameters, so training would not change the "
            "model: optimizer 'optimizer' holds 4 other tensor(s)")):
        trainer.fit()
    assert trainer.state.step == 0
    with warnings.catch_warnings():  # a model meant to stay fixed (an input is optimized) says so
        warnings.simplefilter("error")
        model.requires_grad_(False)
        Trainer(model=model, train_data=loader(dataset()), optimizer=torch.optim.SGD(other.parameters(), lr=0.1),
                max_steps=2, device="cpu", progress=False, loggers=()).setup()


@pytest.mark.parametrize("mode", ["automatic", "manual"])
def test_an_optimizer_no_loss_reaches_is_named_once(mode):
    class Unreached(Trainer):
        automatic = mode == "automatic"

        def configure_optimizers(self):
            return {"net": torch.optim.SGD(self.model.net.parameters(), lr=0.1),
                    "spare": torch.optim.SGD(self.model.spare.parameters(), lr=0.1)}

        def training_step(self, batch):
            x, y = batch
            loss = F.mse_loss(self.model.net(x), y)  # nothing for "spare"
            if self.automatic:
                return {"net": loss}
            self.backward(loss, optimizer="net")
            self.step("net")
            self.step("spare")  # stepped every step, with no gradient: said once too (not by the guard as well)
            return {"net": loss}

    model = torch.nn.ModuleDict({"net": MLP(8, 16, 1, 2), "spare": torch.nn.Linear(8, 1)})
    trainer = Unreached(model=model, train_data=loader(dataset()), max_steps=40, log_every=5, device="cpu",
                        progress=False, loggers=())
    with pytest.warns(ConfigWarning) as seen:
        trainer.fit()
    assert [str(w.message) for w in seen] == [
        "optimizer 'spare' has not updated anything in the 20 steps so far: no loss's gradient reached its "
        "parameters (is a loss returned, or self.backward(loss, optimizer='spare') called, for it? are its "
        "parameters the ones the forward uses, with requires_grad?)"]



@pytest.mark.parametrize("retain", [False, True], ids=["", "retain_graph=True"])
def test_manual_backward_of_a_graph_built_before_fit_says_what_this_backward_does_with_it(retain):
    """Manual mode's self.backward(loss, retain_graph=True) on a graph built before fit frees nothing: the error
    says it keeps the stale graph. Nothing is updated."""
    class Prebuilt(Trainer):
        automatic = False

        def training_step(self, batch):
            x, y = batch
            self.backward(F.mse_loss(self.model(x) * self.scale, y), retain_graph=retain)
            self.step()
            return {"loss": 0.0}

    model = MLP(8, 16, 1, 2)
    trainer = Prebuilt(model=model, train_data=loader(dataset()), optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                       max_steps=3, device="cpu", progress=False, loggers=())
    trainer.scale = model(torch.ones(1, 8)).sum()
    before = [p.detach().clone() for p in model.parameters()]
    state_now = ("keeps it (retain_graph=True), so every step would back-propagate the same graph" if retain
                 else "will free its saved tensors")
    with pytest.raises(GraphReuseError, match=r"\(step 1, loss 'loss'\).*held by `self\.scale`.*this step's backward "
                       + re.escape(state_now)):
        trainer.fit()
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


@pytest.mark.parametrize("mode", ["automatic", "manual"])
def test_the_only_optimizer_no_gradient_reaches_is_named_too(mode):
    class DifferentiatesACopy(Trainer):  # the loss's gradient goes into a detached copy of the weights
        def training_step(self, batch):
            x, y = batch
            w = self.model.weight.detach().requires_grad_()
            return F.mse_loss(x @ w.t(), y)

    model = torch.nn.Linear(8, 1, bias=False)
    before = model.weight.detach().clone()
    cls = DifferentiatesACopy if mode == "automatic" else manual(DifferentiatesACopy)
    trainer = cls(model=model, train_data=loader(dataset()), optimizer=lambda p: torch.optim.SGD(p, lr=0.1),
                  max_steps=25, device="cpu", progress=False, loggers=())
    with pytest.warns(ConfigWarning, match=re.escape("optimizer 'optimizer' has not updated anything in the 20 "
                                                     "steps so far: no loss's gradient reached its parameters")) as said:
        trainer.fit()
    assert torch.equal(model.weight, before)
    assert {w.filename for w in said if w.category is ConfigWarning} == {__file__}  # trainer.fit(), not safeloop


def test_gradients_waiting_for_a_later_update_are_not_taken_for_an_unreached_optimizer():
    class EveryThirdStep(Trainer):  # manual mode accumulating over steps; the run stops before the first update
        automatic = False

        def training_step(self, batch):
            x, y = batch
            self.backward(F.mse_loss(self.model(x), y) / 3)
            if self.state.step % 3 == 2:
                self.step()

    trainer = EveryThirdStep(model=MLP(8, 16, 1, 2), train_data=loader(dataset()), max_steps=2, device="cpu",
                             optimizer=lambda p: torch.optim.SGD(p, lr=0.1), progress=False, loggers=())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        trainer.fit()
    assert all(p.grad is not None for p in trainer.model.parameters())


def test_a_loss_weight_that_names_no_loss_is_named_once():
    class TwoLosses(Trainer):
        def training_step(self, batch):
            x, y = batch
            out = self.model(x)
            return {"fit": F.mse_loss(out, y), "small": out.pow(2).mean()}

    trainer = TwoLosses(model=MLP(8, 16, 1, 2), train_data=loader(dataset()), max_steps=3, device="cpu",
                        optimizer=lambda p: torch.optim.SGD(p, lr=0.1), loss_weights={"smal": 0.1}, progress=False,
                        loggers=())
    with pytest.warns(ConfigWarning, match=re.escape(
            "loss_weights names ['smal'], but no loss of the 3 steps so far had that name (the losses: ['fit', "
            "'small']): the weight is not applied; fix the key")):
        trainer.fit()


@pytest.mark.parametrize("check", ["auto", "off"])  # off: every step after the first is a simple one
def test_max_epochs_trains_on_every_batch_of_every_epoch_as_the_hand_written_loop(check):
    torch.manual_seed(0)
    model, hand = MLP(8, 16, 1, 2), MLP(8, 16, 1, 2)
    hand.load_state_dict(model.state_dict())
    batches = list(loader(dataset(64)))
    trainer = Trainer(model=model, train_data=batches, max_epochs=3, device="cpu", progress=False, loggers=(),
                      optimizer=lambda p: torch.optim.SGD(p, lr=0.1), guard={"check": check})
    state = trainer.fit()
    opt = torch.optim.SGD(hand.parameters(), lr=0.1)
    for _ in range(3):
        for x, y in batches:
            F.mse_loss(hand(x), y).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
    assert (state.step, state.epoch, state.batch_in_epoch) == (12, 3, 0)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), hand.parameters()))


def test_a_one_shot_generator_as_train_data_is_named_at_the_second_epoch():
    batches = list(loader(dataset(64)))
    trainer = Trainer(model=MLP(8, 16, 1, 2), train_data=(b for b in batches), max_epochs=2, device="cpu",
                      optimizer=lambda p: torch.optim.SGD(p, lr=0.1), progress=False, loggers=())
    with pytest.raises(ConfigError, match=re.escape(
            "train_data is a generator, an iterator that one pass uses up: epoch 2 got no batches. Pass something "
            "that can be iterated again (a DataLoader, a list, or an object whose __iter__ returns a new generator "
            "each time), or set max_steps to at most the batches of one pass")):
        trainer.fit()
    assert trainer.state.step == 4  # the first pass trained


def test_a_dataset_of_samples_as_train_or_val_data_says_to_batch_it():
    samples = dataset(64)
    with pytest.raises(ConfigError, match=re.escape(
            f"train_data is a {type(samples).__name__}, a Dataset of single samples: each step would train on one "
            "unbatched sample. Pass DataLoader(dataset, batch_size=..., shuffle=True)")) as info:
        Trainer(model=MLP(8, 16, 1, 2), train_data=samples, val_data=samples, max_steps=2, device="cpu")
    assert "val_data is a" in str(info.value)
    Trainer(model=MLP(8, 16, 1, 2), train_data=loader(samples), val_data=loader(samples), max_steps=2, device="cpu")


class EpochEvents(Trainer):
    """Records each step's end, each pass's start (epoch, batches taken in it) and end (epoch, batches in
    it, the learning rate then: the epoch schedulers have stepped, as Lightning steps them before its
    on_train_epoch_end)."""

    def on_step_end(self, losses):
        self.events.append(("step", self.state.step))

    def on_epoch_start(self):
        self.events.append(("epoch start", self.state.epoch, self.state.batch_in_epoch))

    def on_epoch_end(self):
        self.events.append(("epoch end", self.state.epoch, self.state.batch_in_epoch,
                            self.optimizers["optimizer"].param_groups[0]["lr"]))


class CountsEpochs(Callback):
    def __init__(self):
        self.starts, self.ends = [], []

    def on_epoch_start(self, trainer):
        self.starts.append(trainer.state.epoch)

    def on_epoch_end(self, trainer):
        self.ends.append(trainer.state.epoch)


def epoch_run(tmp_path, cls=EpochEvents, **settings) -> EpochEvents:
    data = [(torch.randn(4, 8), torch.randn(4, 1)) for _ in range(3)]
    trainer = cls(model=MLP(8, 16, 1, 2), train_data=data, optimizer=lambda p: torch.optim.SGD(p, lr=0.1),
                          scheduler={"scheduler": lambda opt: torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5),
                                     "interval": "epoch"},
                          device="cpu", progress=False, loggers=(), **settings)
    trainer.events = []
    return trainer


@pytest.mark.parametrize("mode", [EpochEvents, manual(EpochEvents)], ids=["automatic", "manual"])
def test_on_epoch_start_and_end_frame_each_pass_and_the_epoch_schedulers_step_before_the_end_hook(tmp_path, mode):
    counts = CountsEpochs()
    trainer = epoch_run(tmp_path, mode, max_epochs=2, callbacks=[counts])
    trainer.fit()
    assert trainer.events == [("epoch start", 0, 0), ("step", 1), ("step", 2), ("step", 3), ("epoch end", 0, 3, 0.05),
                              ("epoch start", 1, 0), ("step", 4), ("step", 5), ("step", 6),
                              ("epoch end", 1, 3, 0.025)]
    assert counts.starts == counts.ends == [0, 1]


@pytest.mark.parametrize("stop", [3, 2], ids=["after-the-pass-s-last-batch", "within-the-pass"])
def test_a_run_that_stops_and_goes_on_has_the_epoch_events_of_the_run_that_never_stopped(tmp_path, stop):
    """Stopped right after the first pass's last batch (step 3), that pass ends with the run (its on_epoch_end and
    epoch scheduler, as Lightning ends it), once; stopped within it (step 2), neither the resumed run nor the next
    fit() starts the pass again (no second on_epoch_start), and its end comes with the pass's last batch."""
    straight = epoch_run(tmp_path, max_steps=6)
    straight.fit()
    first = epoch_run(tmp_path, max_steps=stop, checkpoint={"dir": str(tmp_path)})
    first.fit()
    ended = [("epoch end", 0, 3, 0.05)] if stop == 3 else []
    assert first.events == [("epoch start", 0, 0)] + [("step", k) for k in range(1, stop + 1)] + ended
    assert first.state.epoch == (1 if stop == 3 else 0)
    resumed = epoch_run(tmp_path / "resumed", max_steps=6, resume=str(tmp_path / f"step-{stop:09d}.pt"))
    with warnings.catch_warnings():  # the epoch scheduler steps before this process's first optimizer step
        warnings.simplefilter("error")
        resumed.fit()
    assert first.events + resumed.events == straight.events
    first.max_steps = 6
    first.fit()  # the same Trainer trained on
    assert first.events == straight.events


@pytest.mark.parametrize("accum", [2, 3])
def test_the_last_step_of_a_pass_takes_the_batches_left_as_lightning_and_a_hand_loop_do(accum):
    """5 batches a pass, grad_accum=2: updates after batches 2, 4 and 5 of every pass (the last with one
    micro-batch, its loss still halved), then the epoch scheduler and on_epoch_end; no update spans two
    passes (3: after batches 3 and 5). The hand loop is the usual `if (i + 1) % accum == 0 or i ==
    len(loader) - 1`, dividing each loss by accum."""
    torch.manual_seed(0)
    data = [(torch.randn(4, 8), torch.randn(4, 1)) for _ in range(5)]
    ref = MLP(8, 16, 1, 2)
    model = MLP(8, 16, 1, 2)
    model.load_state_dict(ref.state_dict())
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5)
    for _ in range(2):
        for i, (x, y) in enumerate(data):
            (F.mse_loss(ref(x), y) / accum).backward()
            if (i + 1) % accum == 0 or i == len(data) - 1:
                opt.step()
                opt.zero_grad()
        sched.step()
    trainer = EpochEvents(model=model, train_data=data, optimizer=lambda p: torch.optim.SGD(p, lr=0.1),
                          scheduler={"scheduler": lambda o: torch.optim.lr_scheduler.StepLR(o, 1, gamma=0.5),
                                     "interval": "epoch"},
                          grad_accum=accum, max_epochs=2, device="cpu", progress=False, loggers=())
    trainer.events = []
    trainer.fit()
    per_pass = -(-len(data) // accum)  # the last step of a pass takes the batches left
    assert trainer.events == [("epoch start", 0, 0)] + [("step", k) for k in range(1, per_pass + 1)] + [
        ("epoch end", 0, 5, 0.05), ("epoch start", 1, 0)] + [
        ("step", per_pass + k) for k in range(1, per_pass + 1)] + [("epoch end", 1, 5, 0.025)]
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), ref.parameters()))


def test_with_two_optimizers_the_last_step_of_a_pass_takes_the_batches_left_too():
    """Two losses, each into its own optimizer, grad_accum=2 over 5 batches a pass: both optimizers
    update after batches 2, 4 and 5, as the hand loop with the same condition."""
    class TwoHeads(Trainer):
        def configure_optimizers(self):
            return {name: torch.optim.SGD(self.model[name].parameters(), lr=0.1) for name in ("a", "b")}

        def training_step(self, batch):
            x, y = batch
            return {name: F.mse_loss(self.model[name](x), y) for name in ("a", "b")}

    torch.manual_seed(0)
    data = [(torch.randn(4, 8), torch.randn(4, 1)) for _ in range(5)]
    ref = torch.nn.ModuleDict({"a": MLP(8, 16, 1, 2), "b": MLP(8, 16, 1, 2)})
    model = torch.nn.ModuleDict({"a": MLP(8, 16, 1, 2), "b": MLP(8, 16, 1, 2)})
    model.load_state_dict(ref.state_dict())
    opts = {name: torch.optim.SGD(ref[name].parameters(), lr=0.1) for name in ("a", "b")}
    for _ in range(2):
        for i, (x, y) in enumerate(data):
            for name in ("a", "b"):
                (F.mse_loss(ref[name](x), y) / 2).backward()
            if (i + 1) % 2 == 0 or i == len(data) - 1:
                for opt in opts.values():
                    opt.step()
                    opt.zero_grad()
    trainer = TwoHeads(model=model, train_data=data, grad_accum=2, max_epochs=2, device="cpu", progress=False,
                       loggers=())
    trainer.fit()
    assert trainer.state.step == 6
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), ref.parameters()))


# -- seed ------------------------------------------------------------------------------------------
class Noisy(Trainer):
    """Draws from every generator a training step may use: torch's, Python's random and NumPy's."""

    def training_step(self, batch):
        x, y = batch
        noise = random.random() + (float(numpy.random.rand()) if numpy is not None else 0.0)
        return torch.nn.functional.mse_loss(self.model(x + torch.randn_like(x)), y) * (1 + noise)


def test_seed_seeds_every_generator_when_a_run_starts_and_none_seeds_nothing():
    data = [(torch.ones(4, 3), torch.zeros(4, 1))] * 3

    def weights_after(run_seed, drawn_before: int) -> torch.Tensor:
        torch.manual_seed(0)
        model = torch.nn.Linear(3, 1)  # the same initial weights
        torch.manual_seed(drawn_before)
        random.seed(drawn_before)
        if numpy is not None:
            numpy.random.seed(drawn_before)
        Noisy(model=model, train_data=data, optimizer=lambda p: torch.optim.SGD(p, lr=0.1), max_steps=3, seed=run_seed,
              device="cpu", progress=False, loggers=()).fit()
        return model.weight.detach().clone()

    assert torch.equal(weights_after(7, drawn_before=1), weights_after(7, drawn_before=2))
    assert not torch.equal(weights_after(None, drawn_before=1), weights_after(None, drawn_before=2))
    with pytest.raises(ConfigError, match=re.escape("seed='7' is a str; give an integer")):
        Trainer(model=torch.nn.Linear(3, 1), train_data=data, max_steps=1, seed="7")


def modal_net() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.Dropout(0.5),
                               torch.nn.Linear(8, 1))


def fit_modal(net: torch.nn.Module, cls: type[Trainer] = Trainer) -> None:
    cls(model=net, train_data=[(torch.randn(8, 4), torch.randn(8, 1))] * 2, max_steps=2, device="cpu",
        progress=False, loggers=(), optimizer=lambda p: torch.optim.SGD(p, lr=0.1)).fit()


def test_a_model_left_in_eval_mode_is_reported_after_the_first_step():
    """The Trainer leaves modes as it finds them (Lightning's since 2.2): a model built or left in eval mode would
    train without dropout, its batch norm frozen on running statistics, without a word."""
    net = modal_net().eval()
    with pytest.warns(ConfigWarning, match=re.escape(
            "every dropout and batch-norm layer of the model (`model.1` (BatchNorm1d), `model.2` (Dropout)) was in "
            "eval mode through step 1: training runs without dropout, and batch norm normalizes with running "
            "statistics it does not update. The Trainer leaves modes as it finds them (as Lightning's does); call "
            "model.train() before fit(), or in training_step if your loop did. If eval mode is meant (a linear probe "
            "keeping batch-norm statistics), call model.eval() in on_fit_start rather than before fit()")) as caught:
        fit_modal(net)
    assert len([w for w in caught if w.category is ConfigWarning]) == 1
    assert not bool(net[1].running_mean.any())  # what it warns of: the statistics never moved


class TrainsItself(Trainer):
    def training_step(self, batch):
        self.model.train()  # as braindecode's train_batch does
        return super().training_step(batch)


class LinearProbe(Trainer):
    def on_epoch_start(self):
        self.model.eval()  # as MoCo's main_lincls.py does at each epoch's start: the features' statistics stay


@pytest.mark.parametrize("case", ["train", "frozen batch norm", "train in training_step", "no layer eval changes",
                                  "eval set by the run", "frozen part holding every such layer"])
def test_a_model_in_train_mode_or_with_some_layers_frozen_on_purpose_is_not_reported(case):
    net = modal_net()
    if case == "frozen batch norm":
        net[1].eval()  # a fine-tuning's frozen statistics: meant
    elif case == "train in training_step":
        net.eval()
    elif case == "frozen part holding every such layer":  # a frozen backbone under a head of Linear layers
        net[1].eval()
        net[2].eval()
    elif case == "no layer eval changes":  # dropout of p=0, batch norm on batch statistics alone: the same either way
        net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8, track_running_stats=False),
                                  torch.nn.Dropout(0.0), torch.nn.Linear(8, 1)).eval()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fit_modal(net, {"train in training_step": TrainsItself, "eval set by the run": LinearProbe}.get(case, Trainer))
    if case == "eval set by the run":
        assert not net.training and not bool(net[1].running_mean.any())  # kept as the run's code set it


def test_on_before_backward_gets_the_loss_back_propagated_divided_under_accumulation_as_lightnings():
    class Seen(Trainer):
        def training_step(self, batch):
            loss = super().training_step(batch)
            self.returned.append(loss.item())
            return loss

        def on_before_backward(self, name, loss):
            self.given.append(loss.item())

    data = [(torch.randn(4, 8), torch.randn(4, 1)) for _ in range(3)]
    trainer = Seen(model=MLP(8, 16, 1, 2), train_data=data, optimizer=lambda p: torch.optim.SGD(p, lr=0.1),
                   grad_accum=3, max_steps=1, device="cpu", progress=False, loggers=())
    trainer.returned, trainer.given = [], []
    trainer.fit()
    assert trainer.given == pytest.approx([loss / 3 for loss in trainer.returned], rel=1e-6)


def test_a_sampler_inside_a_batch_sampler_gets_each_pass_number_as_lightning_gives_it():
    """A DistributedSampler (or a bucketing sampler) inside ``batch_sampler=``: without ``set_epoch`` every pass would
    repeat the first pass's order."""
    dataset = TensorDataset(torch.arange(12.0)[:, None], torch.zeros(12, 1))
    sampler = torch.utils.data.DistributedSampler(dataset, num_replicas=1, rank=0, shuffle=True, seed=3)
    loader = DataLoader(dataset, batch_sampler=torch.utils.data.BatchSampler(sampler, batch_size=4, drop_last=False))

    class Orders(Trainer):
        def training_step(self, batch):
            self.seen.append(batch[0].flatten().tolist())
            return super().training_step(batch)

    trainer = Orders(model=torch.nn.Linear(1, 1), train_data=loader, optimizer=lambda p: torch.optim.SGD(p, lr=0.1),
                     max_epochs=3, device="cpu", progress=False, loggers=())
    trainer.seen = []
    trainer.fit()
    expected = []
    for epoch in range(3):
        sampler.set_epoch(epoch)
        expected += [[float(i) for i in batch] for batch in torch.utils.data.BatchSampler(sampler, 4, False)]
    assert trainer.seen == expected and expected[:3] != expected[3:6]
