"""The guard on its own cases: carried state, leaks, clean abandonment, policies, pictures, schedule."""
import copy
import importlib.util
import re
import subprocess
import sys
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch.nn.utils import prune
from torch.utils.checkpoint import checkpoint

import safeloop
from safeloop import (CarriedGraphError, GraphLeakWarning, GraphReuseError, InplaceModificationError, NoGraphError,
                      Trainer)
from safeloop.guard import walk
from safeloop.guard.guard import Guard

from ..conftest import manual, subprocess_env


def fit(cls, model=None, steps=4, optimizer=None, **kwargs):
    model = model if model is not None else torch.nn.Linear(4, 4)
    trainer = cls(model=model, train_data=[torch.randn(3, 4) for _ in range(8)], max_steps=steps,
                  optimizer=optimizer or (lambda p: torch.optim.Adam(p, lr=0.01)), device="cpu", progress=False,
                  loggers=(), **kwargs)
    trainer.fit()
    return trainer


class CarriesHidden(Trainer):
    detach = False

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.h = torch.zeros(3, 4)

    def training_step(self, batch):
        self.h = torch.tanh(self.model(batch) + self.h)
        loss = self.h.pow(2).mean()
        if self.detach:
            self.h = self.h.detach()
        return loss


def test_hidden_state_carried_across_steps_is_caught_at_step_two():
    with pytest.raises(CarriedGraphError, match=re.escape("(step 2, loss 'loss'): the loss reaches TanhBackward0, "
                                                          "created during an earlier step and held by `self.h`")
                       + r".*To fix: detach the carried state at the end of each step \(`self.h = "
                       r"self.h.detach\(\)`\)") as info:
        fit(CarriesHidden)
    assert (info.value.step, info.value.holder, info.value.node_name) == (2, "self.h", "TanhBackward0")


class CarriesNormalized(Trainer):
    """The carried graph's top node saves an optional tensor that was not given (layer_norm without bias, as
    cuDNN's GRU without a cell state): it unpacks as None after backward freed the node, the others raise."""

    h = None

    def training_step(self, batch):
        self.h = F.layer_norm(self.model.bias + (0 if self.h is None else self.h), (4,))  # nothing else saved
        return (self.model(batch) * self.h).pow(2).mean()


@pytest.mark.parametrize("make", [lambda cls: cls, manual], ids=["automatic", "manual"])
def test_a_carried_graph_whose_first_saved_tensor_was_not_given_is_named_before_backward(make):
    with pytest.raises(CarriedGraphError, match=re.escape(
            "(step 2, loss 'loss'): the loss reaches NativeLayerNormBackward0, created during an earlier step and "
            "held by `self.h`; an earlier backward already freed the saved tensors")):
        fit(make(CarriesNormalized))


class KeepsReturns(Trainer):
    """A moving-average baseline over past values kept in a list with their graphs."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.returns = []

    def training_step(self, batch):
        value = self.model(batch).mean()
        baseline = torch.stack(self.returns[-3:]).mean() if self.returns else torch.zeros(())
        self.returns.append(value)
        return (value - baseline).pow(2)


@pytest.mark.parametrize("make", [lambda cls: cls, manual], ids=["automatic", "manual"])
def test_a_list_keeping_graphs_is_fixed_where_values_are_added_not_at_one_element(make):
    with pytest.raises(CarriedGraphError, match=re.escape(
            "held by `self.returns[0]`") + ".*" + re.escape(
            "To fix: detach what is added to `self.returns` where it is added (`self.returns.append(x.detach())`")):
        fit(make(KeepsReturns))


class LeafLoss(Trainer):
    def training_step(self, batch):
        return torch.tensor(self.model(batch).pow(2).mean().item(), requires_grad=True)


class ArgmaxLoss(Trainer):
    def training_step(self, batch):
        return (self.model(batch).argmax(1).float() - 1).pow(2).mean()


@pytest.mark.parametrize("make", [lambda cls: cls, manual], ids=["automatic", "manual"])
@pytest.mark.parametrize("cls, why, fix", [
    (LeafLoss, "it is a leaf tensor made with requires_grad=True (torch.tensor(loss.item(), requires_grad=True), "
               "say), whose graph begins and ends at itself, so backward has no parameter to differentiate (loss is "
               "a torch.float32 tensor with requires_grad=True and no grad_fn)",
     "To fix: compute the loss from the model's output and keep it a tensor"),
    (ArgmaxLoss, "it was computed through argmax, whose result has no gradient (an index, a comparison, an integer), "
                 "which cuts the graph", "the logits with cross_entropy rather than argmax"),
], ids=["leaf", "argmax"])
def test_a_loss_that_reaches_no_parameter_says_how_it_lost_its_graph(make, cls, why, fix):
    model = torch.nn.Linear(4, 4)
    before = copy.deepcopy(model.state_dict())
    with pytest.raises(NoGraphError, match=re.escape(why) + ".*" + re.escape(fix)):
        fit(make(cls), model=model)
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())


class NothingToLearnAtStep2(Trainer):
    """A batch with nothing to learn from gives a zero that requires grad (a masked loss over an empty mask)."""
    made = staticmethod(lambda: torch.tensor(0., requires_grad=True))

    def training_step(self, batch):
        return self.made() if self.state.step == 1 else self.model(batch).pow(2).mean()


@pytest.mark.parametrize("made", [lambda: torch.tensor(0., requires_grad=True),
                                  lambda: torch.tensor(0., requires_grad=True).to(torch.float64)],
                         ids=["leaf", "moved"])
@pytest.mark.parametrize("check", ["auto", "always", "off"])
@pytest.mark.parametrize("make", [lambda cls: cls, manual], ids=["automatic", "manual"])
def test_a_zero_that_requires_grad_is_a_step_with_nothing_to_learn_as_in_a_plain_loop(make, check, made):
    torch.manual_seed(0)
    model, ref = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)
    ref.load_state_dict(model.state_dict())
    rng = torch.get_rng_state()  # fit's batches are drawn from here
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        trainer = fit(make(type("Made", (NothingToLearnAtStep2,), {"made": staticmethod(made)})), model=model,
                      guard={"check": check})
    torch.set_rng_state(rng)
    batches = [torch.randn(3, 4) for _ in range(8)]
    opt = torch.optim.Adam(ref.parameters(), lr=0.01)
    for i, batch in enumerate(batches[:4]):
        opt.zero_grad()
        (made() if i == 1 else ref(batch).pow(2).mean()).backward()
        opt.step()
    assert trainer.state.step == 4
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), ref.parameters()))


class RetainsCarriedState(Trainer):
    """Manual mode, a recurrent state carried with its graph and retain_graph=True on every backward."""

    automatic = False
    h = None

    def training_step(self, batch):
        self.h = torch.tanh(self.model(batch) + (0 if self.h is None else self.h))
        loss = self.h.pow(2).mean()
        self.backward(loss, retain_graph=True)
        self.step()
        return loss


def test_a_carried_state_whose_graph_was_retained_is_caught_at_step_two_with_the_reason():
    with pytest.raises(CarriedGraphError, match=re.escape(
            "(step 2, loss 'loss'): the loss reaches TanhBackward0, created during an earlier step and held by "
            "`self.h`; the last step's backward already ran its graph (retain_graph=True kept it)") + ".*"
            + re.escape("(`self.h = self.h.detach()`)")):
        fit(RetainsCarriedState)


class CarriesLSTMState(Trainer):
    """An LSTM's state ``(h, c)`` kept from step to step with its graph (word_language_model without its
    ``repackage_hidden``)."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.hidden = (torch.zeros(1, 3, 4), torch.zeros(1, 3, 4))

    def training_step(self, batch):
        out, self.hidden = self.model(batch[None], self.hidden)
        return out.pow(2).mean()


@pytest.mark.parametrize("make", [lambda cls: cls, manual], ids=["automatic", "manual"])
def test_a_carried_lstm_state_is_detached_as_a_whole_tuple_in_the_fix(make):
    with pytest.raises(CarriedGraphError, match=re.escape(
            "held by `self.hidden[0]`") + ".*" + re.escape(
            "To fix: detach the carried state at the end of each step "
            "(`self.hidden = tuple(t.detach() for t in self.hidden)`)")):
        fit(make(CarriesLSTMState), model=torch.nn.LSTM(4, 4))


def test_detached_hidden_state_runs_clean():
    class Detaches(CarriesHidden):
        detach = True

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert fit(Detaches, steps=6, guard={"check": "always"}).state.step == 6


def test_trace_names_the_line_that_made_the_carried_tensor():
    with pytest.raises(CarriedGraphError, match=r"it was created at .*test_guard.py.*in training_step") as info:
        fit(CarriesHidden, guard={"trace": True})
    assert not any("guard.trace" in f for f in info.value.fixes)


def test_trace_names_the_users_line_in_a_directory_named_safeloop(tmp_path):
    """``git clone`` makes a directory named safeloop: the user's files there are still the user's."""
    (tmp_path / "safeloop").mkdir()
    user = tmp_path / "safeloop" / "carries.py"
    user.write_text("import torch\nfrom safeloop import Trainer\n\n\nclass Carries(Trainer):\n"
                    "    def training_step(self, batch):\n"
                    "        self.h = torch.tanh(self.model(batch) + getattr(self, 'h', 0))\n"
                    "        return self.h.pow(2).mean()\n")
    spec = importlib.util.spec_from_file_location("carries", user)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    with pytest.raises(CarriedGraphError, match=re.escape(f'it was created at File "{user}", line 7, in '
                                                          'training_step')):
        fit(module.Carries, guard={"trace": True})


@pytest.mark.parametrize("mode", [lambda cls: cls, manual], ids=["automatic", "manual"])
@pytest.mark.parametrize("keep, holder, fix", [
    ("self.running = self.running + loss", "self.running", "loss.item()"),
    ("self.history.append(loss)", "self.history[0]", "`self.history.append(x.detach())`"),  # at the append
])
def test_graph_kept_after_its_step_warns_naming_the_holder(keep, holder, fix, mode):
    class Keeps(Trainer):
        running, history = 0.0, []

        def training_step(self, batch):
            loss = self.model(batch).pow(2).mean()
            exec(keep, {"self": self, "loss": loss})
            return loss

    Keeps.history = []
    with pytest.warns(GraphLeakWarning, match=re.escape(f"steps 1 and 2: the autograd graphs of both steps are "
                                                        f"still alive, held by `{holder}`") + ".*" + re.escape(fix)):
        fit(mode(Keeps))


def test_the_leak_warning_carries_its_step_and_holder_as_the_errors_do():
    class Keeps(Trainer):
        running = 0.0

        def training_step(self, batch):
            loss = self.model(batch).pow(2).mean()
            self.running = self.running + loss
            return loss

    with pytest.warns(GraphLeakWarning, match=re.escape("autograd graph kept alive after its step (step 2): steps 1 "
                                                        "and 2: the autograd graphs")) as caught:
        fit(Keeps)
    leak, = [w.message for w in caught if w.category is GraphLeakWarning]
    assert (leak.step, leak.holder) == (2, "self.running")


@pytest.mark.parametrize("mode", [lambda cls: cls, manual], ids=["automatic", "manual"])
@pytest.mark.parametrize("returns", ["loss * 1.0", "loss / 2"])
def test_graphs_kept_of_the_loss_while_the_step_back_propagates_another_tensor_warn_naming_the_holder(returns, mode):
    """What Lightning's and Accelerate's gradient accumulation do: the loss kept (``self.total = self.total +
    loss``) is not the tensor back-propagated (``loss / 2``), whose graph dies with the step. Keeping the last
    step's output, replaced every step, is still no leak."""
    class KeepsTheLoss(Trainer):
        total = 0.0

        def training_step(self, batch):
            loss = self.model(batch).pow(2).mean()
            self.total = self.total + loss  # meant: loss.item()
            return eval(returns)

    with pytest.warns(GraphLeakWarning, match=re.escape("steps 1 and 2: the autograd graphs of both steps are "
                                                        "still alive, held by `self.total`")):
        fit(mode(KeepsTheLoss))

    class KeepsTheLastOutput(Trainer):
        def training_step(self, batch):
            out = self.model(batch)
            self.last_out = out  # one step's graph at a time
            return eval(returns, {"loss": out.pow(2).mean()})

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        trainer = fit(mode(KeepsTheLastOutput), steps=8, guard={"check": "always"})
    assert trainer.last_out.grad_fn is not None  # the last step's graph outlived it: looked at, no leak


@pytest.mark.parametrize("mode", [lambda cls: cls, manual], ids=["automatic", "manual"])
@pytest.mark.parametrize("keep", ["self.last_loss = loss", "self.last = {'loss': loss, 'step': self.state.step}",
                                  "if self.state.step % 3 == 0: self.last_loss = loss"])  # kept for a few steps
def test_keeping_the_last_loss_until_the_next_step_replaces_it_does_not_warn(keep, mode):
    """The hand-written loop's ``loss`` variable lives until the next step too: one step's graph, no leak."""
    class KeepsTheLast(Trainer):
        def training_step(self, batch):
            loss = self.model(batch).pow(2).mean()
            exec(keep, {"self": self, "loss": loss})
            return loss

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        trainer = fit(mode(KeepsTheLast), steps=8, guard={"check": "always"})
    held = trainer.last_loss if hasattr(trainer, "last_loss") else trainer.last["loss"]
    assert held.grad_fn is not None  # the last step's graph outlived it: the guard looked, and saw no leak


def test_keeping_floats_does_not_warn():
    class KeepsFloats(Trainer):
        running = 0.0

        def training_step(self, batch):
            loss = self.model(batch).pow(2).mean()
            self.running += loss.item()
            return loss

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fit(KeepsFloats, guard={"check": "always"})


def snapshot(trainer):
    return ([p.detach().clone() for p in trainer.model.parameters()],
            [None if p.grad is None else p.grad.clone() for p in trainer.model.parameters()],
            copy.deepcopy(trainer.optimizers["optimizer"].state_dict()))


def assert_same(a, b):
    for x, y in zip(a[0] + [g for g in a[1] if g is not None], b[0] + [g for g in b[1] if g is not None]):
        assert torch.equal(x, y)
    assert [g is None for g in a[1]] == [g is None for g in b[1]]
    sa, sb = a[2]["state"], b[2]["state"]
    assert sa.keys() == sb.keys()
    for k in sa:
        for name in sa[k]:
            assert torch.equal(sa[k][name], sb[k][name])


@pytest.mark.parametrize("failure, error", [
    ("reuse", GraphReuseError),          # caught before backward
    ("inplace", InplaceModificationError),  # raised by backward itself, half-way through
])
def test_a_guard_error_leaves_parameters_grads_and_optimizer_state_untouched(failure, error):
    snaps = []

    class FailsAtStep4(Trainer):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.y = self.model.weight @ torch.ones(4)

        def training_step(self, batch):  # as the step found them (the last update's gradients cleared)
            snaps.append(snapshot(self))
            h = self.model(batch)
            if self.state.step < 3:
                return h.pow(2).mean()
            if failure == "reuse":
                return (h + self.y).pow(2).mean()
            # the second layer's input is saved by sigmoid, then changed: backward fails after the
            # first nodes already ran, so some .grad would be written mid-step by plain PyTorch
            s = self.model(h).sigmoid()
            s.mul_(2)
            return s.pow(2).mean() + h.pow(2).mean()

    trainer = FailsAtStep4(model=torch.nn.Linear(4, 4), train_data=[torch.randn(3, 4) for _ in range(8)],
                           max_steps=6, optimizer=lambda p: torch.optim.Adam(p, lr=0.01), device="cpu",
                           progress=False, loggers=())
    with pytest.raises(error, match="step 4"):
        trainer.fit()
    assert trainer.state.step == 3
    assert_same(snaps[-1], snapshot(trainer))


class ReusesExp(Trainer):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.y = self.model.weight.sum(0).exp()

    def training_step(self, batch):
        return (self.model(batch) * self.y).pow(2).mean()


def test_check_off_still_explains_the_failure_after_the_fact():
    with pytest.raises(GraphReuseError, match=r"step 2.*reaches ExpBackward0.*held by `self.y`.*an earlier "
                       "backward already freed its saved tensors"):
        fit(ReusesExp, guard={"check": "off"})


def test_without_a_run_dir_the_trainer_writes_no_picture_and_a_plain_loops_guard_does(tmp_path):
    """The Trainer says "no graph pictures are written" without a run_dir: nothing lands in the working
    directory (the test's own), also from a GraphGuard handed to it; a plain loop's writes to safeloop_graphs, and
    a Trainer with a run_dir under it."""
    for guard in ({"check": "always"}, safeloop.GraphGuard()):
        with pytest.raises(GraphReuseError) as info:
            fit(ReusesExp, guard=guard)
        assert info.value.picture is None and "Graph picture" not in str(info.value)
    assert list(tmp_path.iterdir()) == []
    model = torch.nn.Linear(4, 4)
    y = model.weight.sum(0).exp()
    with pytest.raises(GraphReuseError, match=re.escape("Graph picture: safeloop_graphs/step1_loss.dot")):
        safeloop.GraphGuard(model).backward((model(torch.randn(3, 4)) + y).pow(2).mean())
    assert (tmp_path / "safeloop_graphs" / "step1_loss.dot").exists()
    with pytest.raises(GraphReuseError) as info:  # handed to a Trainer with a run_dir: under it, as the Trainer's
        fit(ReusesExp, guard=safeloop.GraphGuard(), run_dir=tmp_path / "run")
    assert info.value.picture.startswith(str(tmp_path / "run" / "graphs"))


def test_error_writes_a_picture_with_the_node_highlighted(tmp_path):
    with pytest.raises(GraphReuseError) as info:
        fit(ReusesExp, run_dir=tmp_path)
    picture = info.value.picture
    assert picture and picture in str(info.value) and picture.startswith(str(tmp_path / "graphs"))
    dot = open(picture.replace(".svg", ".dot")).read()
    assert re.search(r'label="ExpBackward0", style=filled, fillcolor="#ff9999"', dot)
    assert "AccumulateGrad" in dot


def test_auto_schedule_keeps_check_cost_under_budget():
    guard = Guard(check="auto", warmup=3, budget=0.01)
    checked, timed = [], []
    for step in range(1, 200):
        timed.append(guard.begin_step(step))  # True: time this step
        checked.append(guard.checking)
        if guard.checking:
            guard.spent = 20e-6  # the timed check: 20 µs, but its step takes 50 µs longer ...
        if guard.timed:
            guard.record_step_time(step, 1e-3 + 50e-6 * guard.checking)  # ... than a bare 1 ms step
    assert checked[:3] == [True] * 3
    assert guard.interval == 5  # 50 µs every 5 steps = 1% of 5 ms
    after = [i for i, c in enumerate(checked) if c and i >= 3]
    assert all(b - a == 5 for a, b in zip(after[-20:], after[-19:]))  # evenly spaced once the cost is known
    assert all(timed[i - 1] and not checked[i - 1] for i in after)  # the bare step is the one before a check
    assert sum(timed) == pytest.approx(2 * sum(checked[3:]) + 3, abs=2)  # no other step pays for a timer
    always, off = Guard(check="always"), Guard(check="off")
    assert all(always.begin_step(s) and always.checking for s in range(1, 50))
    assert not any(off.begin_step(s) or off.checking for s in range(1, 50))


def test_auto_finds_a_mistake_that_starts_after_warm_up():
    class LateCarry(Trainer):
        """From step 30 on, adds a tensor made in step 30: its AddBackward0 saves nothing, so
        backward never fails and only a scheduled check can see the carried graph."""

        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.scale = torch.nn.Parameter(torch.ones(4))
            self.shift = None

        def training_step(self, batch):
            if self.state.step + 1 == 30:
                self.shift = self.scale + 1.0
            out = self.model(batch)
            return (out if self.shift is None else out + self.shift).pow(2).mean()

    trainer = LateCarry(model=torch.nn.Linear(4, 4), train_data=[torch.randn(3, 4) for _ in range(8)],
                        max_steps=400, optimizer=lambda p: torch.optim.SGD(p, lr=0.01), device="cpu",
                        progress=False, loggers=(), guard={"check": "auto", "warmup": 5, "budget": 1.0})
    with pytest.raises(CarriedGraphError, match=r"the loss reaches AddBackward0, created during an earlier step "
                                                r"and held by `self.shift`") as info:
        trainer.fit()
    assert 30 < info.value.step < 400 and trainer.state.step == info.value.step - 1


# -- no false positives ------------------------------------------------------------------------

def clean(cls, model, steps=4, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("error", category=UserWarning)
        return fit(cls, model=model, steps=steps, guard={"check": "always"}, **kwargs)


def test_parameters_buffers_and_constants_made_before_the_step_are_fine():
    class Step(Trainer):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.scale = torch.linspace(0, 1, 4)  # made before the step, no grad
            self.mask = (torch.rand(4) > 0.5).float()

        def training_step(self, batch):
            return (self.model(batch) * self.scale * self.mask).pow(2).mean()

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4), torch.nn.Linear(4, 4))
    assert clean(Step, model).state.step == 4


def test_activation_checkpointing_is_fine():
    for reentrant in (False, True):
        class Step(Trainer):
            def training_step(self, batch):
                x = batch.requires_grad_(reentrant)
                return checkpoint(self.model, x, use_reentrant=reentrant).pow(2).mean()

        model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 4))
        assert clean(Step, model).state.step == 4


def test_compiled_model_is_fine():
    class Step(Trainer):
        def training_step(self, batch):
            return self.compiled(batch).pow(2).mean()

    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 4))
    Step.compiled = torch.compile(model, backend="aot_eager")
    assert clean(Step, model, steps=3).state.step == 3


def test_gan_step_on_detached_fakes_is_fine():
    class GAN(Trainer):
        def configure_optimizers(self):
            return {"d": torch.optim.Adam(self.model.d.parameters(), 1e-3),
                    "g": torch.optim.Adam(self.model.g.parameters(), 1e-3)}

        def training_step(self, batch):
            fake = self.model.g(torch.randn(3, 2))
            d_loss = F.softplus(self.model.d(fake.detach())).mean() + F.softplus(-self.model.d(batch)).mean()
            g_loss = F.softplus(-self.model.d(fake)).mean()
            return {"d": d_loss, "g": g_loss}

    model = torch.nn.Module()
    model.g, model.d = torch.nn.Linear(2, 4), torch.nn.Linear(4, 1)
    assert clean(GAN, model).state.step == 4


@pytest.mark.parametrize("mode", ["automatic", "manual"])
@pytest.mark.parametrize("check", ["always", "auto", "off"])
def test_a_graph_made_while_fetching_the_batch_is_the_steps_own(check, mode):
    """An RL-style data iterator runs the policy to make each batch (log-probabilities with a graph);
    that graph belongs to the step it feeds, not to an earlier one."""
    def rollouts(policy, n):
        gen = torch.Generator().manual_seed(3)
        for _ in range(n):
            obs = torch.randn(16, 4, generator=gen)
            logp = torch.log_softmax(policy(obs), dim=1)[:, 0]  # made while the batch is fetched
            yield logp, torch.randn(16, generator=gen)

    class PolicyGradient(Trainer):
        def training_step(self, batch):
            logp, advantage = batch
            return -(logp * advantage).mean()

    torch.manual_seed(0)
    ref, ours = torch.nn.Linear(4, 2), torch.nn.Linear(4, 2)
    ours.load_state_dict(ref.state_dict())
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for logp, advantage in rollouts(ref, 5):
        (-(logp * advantage).mean()).backward()
        opt.step()
        opt.zero_grad()
    cls = PolicyGradient if mode == "automatic" else manual(PolicyGradient)
    cls(ours, type("Rollouts", (), {"__iter__": lambda self: rollouts(ours, 5)})(),
                   lambda p: torch.optim.SGD(p, lr=0.1), max_steps=5, device="cpu", progress=False, loggers=(),
                   guard={"check": check}).fit()  # CarriedGraphError at step 1 before the fix
    for p, q in zip(ref.parameters(), ours.parameters()):
        assert torch.equal(p, q)


@pytest.mark.parametrize("check", ["always", "auto", "off"])
def test_a_value_recomputed_after_the_update_and_used_once_is_not_a_carried_graph(check):
    """Soft actor-critic's temperature: ``alpha = log_alpha.exp()`` recomputed after each update and
    used (with its graph) in the next step only. Reused a second time, it is a carried graph."""
    class Temperature(Trainer):
        def __init__(self, stale=False, **kwargs):
            super().__init__(**kwargs)
            self.log_alpha = torch.nn.Parameter(torch.zeros(()))
            self.alpha = self.log_alpha.exp().detach()
            self.stale = stale

        def configure_optimizers(self):
            return torch.optim.SGD([*self.model.parameters(), self.log_alpha], lr=0.1)

        def training_step(self, batch):
            return (self.model(batch).pow(2).mean() - self.alpha * 0.1) ** 2

        def on_step_end(self, losses):
            if not self.stale or self.state.step == 1:
                self.alpha = self.log_alpha.exp()  # after the update: the next step's value, with its graph

    def hand(model, log_alpha, data):
        opt = torch.optim.SGD([*model.parameters(), log_alpha], lr=0.1)
        alpha = log_alpha.exp().detach()
        for x in data:
            ((model(x).pow(2).mean() - alpha * 0.1) ** 2).backward()
            opt.step()
            opt.zero_grad()
            alpha = log_alpha.exp()

    data = [torch.randn(3, 4) for _ in range(6)]
    torch.manual_seed(0)
    ref, ours = torch.nn.Linear(4, 2), torch.nn.Linear(4, 2)
    ours.load_state_dict(ref.state_dict())
    log_alpha = torch.nn.Parameter(torch.zeros(()))
    hand(ref, log_alpha, data)
    trainer = Temperature(model=ours, train_data=data, max_steps=6, device="cpu", progress=False, loggers=(),
                          guard={"check": check})
    trainer.fit()  # CarriedGraphError at step 2 before
    assert all(torch.equal(p, q) for p, q in zip(ref.parameters(), ours.parameters()))
    assert torch.equal(trainer.log_alpha, log_alpha)

    if check == "always":  # the same graph used in a second step: its buffers were freed by the first
        stale = Temperature(stale=True, model=torch.nn.Linear(4, 2), train_data=data, max_steps=6, device="cpu",
                            progress=False, loggers=(), guard={"check": check})
        with pytest.raises(CarriedGraphError, match=r"\(step 3, loss 'loss'\): the loss reaches ExpBackward0, created "
                                                    r"during an earlier step and held by `self.alpha`; an earlier "
                                                    r"backward already freed"):
            stale.fit()



def test_a_carried_graph_that_grows_every_step_is_named_as_such():
    """A running total kept with its graph: each step adds a node over the last step's (AddBackward0
    saves nothing, so backward never fails, but the graph and backward's work grow every step)."""
    class RunningTotal(Trainer):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.total = None

        def training_step(self, batch):
            step_value = self.model.bias + 1.0
            self.total = step_value if self.total is None else self.total + step_value
            return self.model(batch).pow(2).mean() + self.total.sum()

    trainer = RunningTotal(model=torch.nn.Linear(4, 4), train_data=[torch.randn(3, 4) for _ in range(4)],
                           max_steps=4, optimizer=lambda p: torch.optim.SGD(p, lr=0.01), device="cpu",
                           progress=False, loggers=(), guard={"check": "always"})
    with pytest.raises(CarriedGraphError, match=r"\(step 3, loss 'loss'\): the loss reaches AddBackward0, created "
                                                r"during an earlier step and held by `self.total`; its graph extends "
                                                r"the graphs of the steps before it, so it grows every step"):
        trainer.fit()


@pytest.mark.parametrize("mode", [lambda cls: cls, manual], ids=["automatic", "manual"])
def test_a_loss_built_before_fit_and_returned_as_it_is_is_named_by_its_attribute(mode):
    """The loss tensor itself is the stale graph: the attribute holding it is named (a plain loop's
    local `loss` variable, made in the step, would not count as a holder; an attribute does)."""
    class ReturnsTheOldLoss(Trainer):
        def training_step(self, batch):
            return self.stale if self.state.step == 1 else self.model(batch).pow(2).mean()

    model = torch.nn.Linear(4, 4)
    trainer_cls = mode(ReturnsTheOldLoss)
    trainer_cls.stale = model(torch.randn(3, 4)).pow(2).mean()
    with pytest.raises(GraphReuseError, match=r"step 2, loss 'loss'.*built before the step .* held by `self\.stale`"):
        fit(trainer_cls, model=model, guard={"check": "always"})


def test_a_holder_only_the_garbage_collector_finds_is_named_so_and_looking_warns_nothing():
    """The last resort of naming: every object the garbage collector tracks, looked at by type only
    (torch.distributed's deprecated ``reduce_op`` warns when ``isinstance`` looks at it, and silencing that reset
    Python's once-per-place registry: the program's own warning showed again). In a process of its own, as Python
    runs a script."""
    code = ("import warnings, torch\nfrom safeloop.guard import explain\n"
            "kept = [[[[torch.ones(2, requires_grad=True) * 2]]]]  # deeper than names are searched\n"
            "for _ in range(2):\n    warnings.warn('a warning of the program')\n"
            "    print(explain.find_holder(kept[0][0][0][0].grad_fn))\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=subprocess_env(),
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == "an unnamed tensor (found by the garbage collector)\n" * 2
    assert proc.stderr.count("UserWarning") == 1, proc.stderr


def test_one_walk_meets_each_node_once_and_not_below_where_it_is_told_to_stop():
    w = torch.ones(3, requires_grad=True)
    shared = w.exp()  # reached through both branches
    loss = (shared.sin() + shared.cos()).sum()
    names = [type(n).__name__ for n in walk.iter_nodes(loss.grad_fn)]
    assert sorted(names) == sorted(["SumBackward0", "AddBackward0", "SinBackward0", "CosBackward0", "ExpBackward0",
                                    walk.ACCUMULATE.__name__])
    assert names[0] == "SumBackward0"
    stopped = walk.iter_nodes(loss.grad_fn, stop=lambda n: type(n).__name__ == "ExpBackward0")
    assert sorted(type(n).__name__ for n in stopped) == ["AddBackward0", "CosBackward0", "SinBackward0", "SumBackward0"]
    seen = set()
    assert len(list(walk.iter_nodes(shared.grad_fn, seen=seen))) == 2
    again = [type(n).__name__ for n in walk.iter_nodes(loss.grad_fn, seen=seen)]
    assert sorted(again) == ["AddBackward0", "CosBackward0", "SinBackward0", "SumBackward0"]  # exp's met already
    assert walk.reachable(loss.grad_fn, shared.grad_fn) and not walk.reachable(shared.grad_fn, loss.grad_fn)
    add = loss.grad_fn.next_functions[0][0]
    on_path = {loss.grad_fn, add, *(n for n, _ in add.next_functions), shared.grad_fn}
    assert walk.runs(loss.grad_fn, [shared]) == on_path  # backward(inputs=[shared]) runs all but w's leaf


def test_safeloop_Guard_is_a_deprecated_name_of_the_engine():
    assert "Guard" not in safeloop.__all__ and "GraphGuard" in safeloop.__all__
    with pytest.warns(DeprecationWarning, match=r"safeloop\.GraphGuard.*Trainer\(guard=\{\.\.\.\}\)"):
        engine = safeloop.Guard
    assert engine is Guard


class PrunedPenalty(Trainer):
    """An L1 penalty on a pruned layer's ``weight``, which pruning's forward pre-hook makes again at each forward
    (``weight_orig * weight_mask``); ``before``: read before the forward, it is the value made at pruning (step 1)
    or by the last step's forward, whose graph that step's backward frees (PyTorch fails at step 2); ``start``: the
    step from which the penalty is added."""

    before, start = True, 0

    def training_step(self, batch):
        penalty = self.model[0].weight.abs().sum() if self.before else None
        out = self.model(batch)
        if not self.before:
            penalty = self.model[0].weight.abs().sum()
        return out.pow(2).mean() + (1e-3 * penalty if self.state.step >= self.start else 0)


def pruned():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    prune.l1_unstructured(model[0], "weight", amount=0.3)
    return model


@pytest.mark.parametrize("check", ["auto", "always"])
@pytest.mark.parametrize("mode", [lambda cls: cls, manual], ids=["automatic", "manual"])
@pytest.mark.parametrize("start, error, made", [
    (0, GraphReuseError, "made before the step (in __init__, at module level or before fit)"),
    (1, CarriedGraphError, "made by an earlier step's forward")], ids=["at-pruning", "last-step"])
def test_a_pruned_weight_read_before_the_forward_is_named_as_an_earlier_value(mode, check, start, error, made):
    """Only this step's tensor ``penalty`` reaches the stale node: the error names the attribute the forward makes
    again and says to read it after the forward (detaching ``penalty`` would drop its gradient)."""
    with pytest.raises(error) as caught:
        fit(type("P", (mode(PrunedPenalty),), {"start": start}), pruned(), guard={"check": check})
    err = caught.value
    assert err.step == start + 1 and err.holder == "self.model.0.weight" and "The step was abandoned" in str(err)
    assert (f"the loss reaches MulBackward0, {made} as `self.model.0.weight`, which each forward makes again (a "
            "forward pre-hook sets it: torch.nn.utils.prune, weight_norm): it was read before this step's forward, "
            "which replaced it; ") in str(err)
    assert err.fixes[0] == "read `self.model.0.weight` after this step's forward, so that it holds this step's value"
    assert not any("detach" in fix for fix in err.fixes)
    after = type("After", (mode(PrunedPenalty),), {"before": False})
    trained = [fit(after, pruned(), guard={"check": c}).model for c in (check, "off")]
    assert all(torch.equal(a, b) for a, b in zip(trained[0].state_dict().values(), trained[1].state_dict().values()))
