"""Bad input, one clear error each, and failed or non-finite steps that change nothing."""
import copy
import logging
import math
import re
import sys

import pytest
import torch

from safeloop import ConfigError, InplaceModificationError, NonFiniteError, SafeloopError, StepError, Trainer
from safeloop.config import build, compose

from . import forkserver
from .conftest import manual, subprocess_env, unchecked


def data(n: int = 8, seed: int = 0) -> list:
    gen = torch.Generator().manual_seed(seed)
    return [(torch.randn(4, 3, generator=gen), torch.randn(4, 1, generator=gen)) for _ in range(n)]


def trainer(cls=Trainer, **kwargs) -> Trainer:
    settings = dict(max_steps=6, device="cpu", progress=False, loggers=())
    settings.update(kwargs)
    model = torch.nn.Linear(3, 1)
    return cls(model, data(), lambda p: torch.optim.Adam(p, lr=0.1), **settings)


# -- configuration ---------------------------------------------------------------------------
def test_unknown_key_on_the_command_line_suggests_the_right_one(tmp_path):
    done = forkserver.run([sys.executable, "-m", "safeloop", "trainer.max_stepz=5"], cwd=tmp_path,
                          env=subprocess_env(), timeout=120)
    assert done.returncode == 2
    assert ("trainer.max_stepz=5: there is no config key 'trainer.max_stepz'; did you mean trainer.max_steps?"
            in done.stderr)
    assert not (tmp_path / "outputs").exists()  # refused before Hydra made a run directory


def test_unknown_key_through_compose_suggests_the_right_one():
    with pytest.raises(ConfigError, match=re.escape(
            "model.hiden=3: there is no config key 'model.hiden'; did you mean model.hidden? "
            "(to add a new key on purpose, write +model.hiden=3)")):
        compose(["model.hiden=3"])
    with pytest.raises(ConfigError, match=r"'trainer\.lr'; did you mean optimizer\.lr\?"):  # another section
        compose(["trainer.lr=0.1"])


def test_a_lightning_trainer_argument_is_refused_with_safeloops_way_in_python_and_on_the_command_line():
    """A port keeping ``pl.Trainer(accumulate_grad_batches=2, ...)``: each named with what does its work here."""
    with pytest.raises(ConfigError) as info:
        trainer(accumulate_grad_batches=2, check_val_every_n_epoch=1, detect_anomaly=True)
    assert info.value.problems == [
        "Trainer has no setting 'accumulate_grad_batches': that is Lightning's; here: grad_accum",
        "Trainer has no setting 'check_val_every_n_epoch': that is Lightning's; here: val_every=k * steps per pass "
        "(math.ceil(len(train_data) / grad_accum))",
        "Trainer has no setting 'detect_anomaly': that is Lightning's; here: guard={'trace': True}"]
    with pytest.raises(ConfigError, match=re.escape(  # a fraction of a pass, as a float val_check_interval gives it
            "'val_check_interval': that is Lightning's; here: val_every=N (optimizer steps, counted across passes; "
            "a fraction f of a pass is int(f * len(train_data)) batches, divided by grad_accum)")):
        trainer(val_check_interval=0.5)
    with pytest.raises(ConfigError, match=re.escape("trainer.gradient_clip_val=1: there is no config key "
                                                    "'trainer.gradient_clip_val': that is Lightning's; here: grad_clip")):
        compose(["trainer.gradient_clip_val=1"])


def test_lightnings_minimums_are_not_taken_for_the_maximums_their_names_are_close_to():
    """The lightning-hydra-template's ``trainer: {min_epochs: 1, ...}``: the closest setting's name, max_epochs, would
    turn the least into the most. Each minimum says there is none here (a stop ends the run however early), in
    Python and on the command line, and suggests no maximum; so do the other Lightning arguments a port keeps."""
    minimum = ("no minimum: a stop asked for (EarlyStopping, request_stop) ends the run after that step, however "
               "early. Leave it out where no stop can come before it (min_epochs=1 with validation at each pass's "
               "end or less often); max_epochs and max_steps are the most, not the least")
    with pytest.raises(ConfigError) as info:
        trainer(min_epochs=1, min_steps=100, num_sanity_val_steps=0, fast_dev_run=True)
    assert info.value.problems == [
        f"Trainer has no setting 'min_epochs': that is Lightning's; here: {minimum}",
        f"Trainer has no setting 'min_steps': that is Lightning's; here: {minimum}",
        "Trainer has no setting 'num_sanity_val_steps': that is Lightning's; here: no setting: with val_data, a whole "
        "validation runs before the first step (logged at step 0; EarlyStopping, checkpoint.monitor and a plateau "
        "scheduler only check there that their metric is reported)",
        "Trainer has no setting 'fast_dev_run': that is Lightning's; here: max_steps=N, "
        "val_data=list(itertools.islice(loader, N)), checkpoint=False, loggers=[] (True: N=1)"]
    for override in ("trainer.min_epochs=1", "trainer.min_steps=5"):
        with pytest.raises(ConfigError) as info:
            compose([override])
        said = str(info.value)
        assert said.endswith(f"that is Lightning's; here: {minimum}") and "did you mean" not in said


def test_every_bad_override_is_reported_at_once():
    with pytest.raises(ConfigError) as info:
        compose(["trainer.max_steps=lots", "optimzer=sgd", "checkpoint.evry=5"])
    assert info.value.problems == [
        "trainer.max_steps=lots: Value 'lots' of type 'str' could not be converted to Integer; give "
        "trainer.max_steps a value of that type",
        "optimzer=sgd: there is no config key 'optimzer'; did you mean optimizer? (to add a new key on purpose, "
        "write +optimzer=sgd)",
        "checkpoint.evry=5: there is no config key 'checkpoint.evry'; did you mean checkpoint.every? (to add a "
        "new key on purpose, write +checkpoint.evry=5)",
    ]


def test_a_required_value_left_unset_is_named():
    with pytest.raises(ConfigError, match=re.escape(
            "model.in_dim is required and not set (it is ??? in the config): give it, e.g. "
            "python -m safeloop model.in_dim=VALUE")):
        compose(["model.in_dim=???"])
    cfg = compose()
    cfg.model.hidden = "???"
    with pytest.raises(ConfigError, match=r"model\.hidden is required and not set"):
        build(cfg)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on a machine without CUDA")
def test_cuda_without_cuda():
    with pytest.raises(ConfigError, match=r"device='cuda' asks for CUDA, but torch\.cuda\.is_available\(\) is "
                                          r"False.*Use device=cpu, or device=auto"):
        trainer(device="cuda")


@pytest.mark.parametrize("steps", [0, -3])
def test_max_steps_must_be_positive(steps):
    with pytest.raises(ConfigError, match=f"max_steps must be a positive integer, got {steps}"):
        trainer(max_steps=steps)


def test_a_resume_path_that_does_not_exist(tmp_path):
    with pytest.raises(ConfigError, match=re.escape(
            "resume='nope/step-000000001.pt': no such file or directory (give a checkpoint file, a checkpoint "
            "directory, or auto)")):
        trainer(resume="nope/step-000000001.pt")


def test_nonfinite_policy_and_checkpoint_settings_are_checked():
    with pytest.raises(ConfigError) as info:
        trainer(on_nonfinite="ignore", max_skipped=0, checkpoint={"every": 0, "kep": 2})
    assert info.value.problems == [
        "on_nonfinite='ignore' is not one of error, skip, off",
        "max_skipped must be a positive integer, got 0",
        "checkpoint has no setting 'kep': use every, keep, dir, monitor, mode, sharded",
        "checkpoint.every must be a positive integer, got 0",
    ]


def test_an_unknown_strategy_names_the_two_there_are():
    with pytest.raises(ConfigError, match=re.escape("strategy='fsdp2' is not one of ddp, fsdp")):
        trainer(strategy="fsdp2")


def test_empty_train_data():
    empty = Trainer(torch.nn.Linear(3, 1), [], lambda p: torch.optim.SGD(p, lr=0.1), max_steps=3, device="cpu",
                    progress=False, loggers=())
    with pytest.raises(ConfigError, match="train_data yielded no batches: check the dataset and batch size"):
        empty.fit()


# -- what training_step returns --------------------------------------------------------------
class Returns(Trainer):
    """A plain loss until step ``at``, then ``output(loss)``."""

    def __init__(self, output, at: int = 1, **kwargs):
        super().__init__(torch.nn.Linear(3, 1), data(), lambda p: torch.optim.SGD(p, lr=0.1), max_steps=at,
                         device="cpu", progress=False, loggers=(), **kwargs)
        self.output, self.at = output, at

    def training_step(self, batch):
        loss = super().training_step(batch)
        return self.output(loss) if self.state.step + 1 == self.at else loss


@pytest.mark.parametrize("output, message", [
    (lambda loss: None, "step {}: training_step returned None; training_step must return the loss tensor, or a dict "
                        "{{name: loss tensor}} (did you forget `return loss`?)"),
    (lambda loss: loss.item(), "step {}: training_step returned a float; training_step must return the loss tensor"),
    (lambda loss: loss.expand(4), "step {}: loss 'loss' has shape (4,); a loss must be a scalar (reduce it with "
                                  ".mean() or .sum())"),
    (lambda loss: {"mse": loss, "acc": 0.5}, "step {}: training_step returned 'acc' = float, not a tensor"),
    (lambda loss: loss.detach(), "loss has no autograd graph (step {}, loss 'loss'): it was built from detached "
                                 "tensors (.detach()), which cuts the graph"),
])
@pytest.mark.parametrize("at", [1, 3], ids=["first step", "a later step"])  # the guard off: no step is walked
def test_training_step_output_errors(output, message, at):
    t = Returns(output, at, guard={"check": "off"})
    with pytest.raises(SafeloopError, match=re.escape(message.format(at))):
        t.fit()
    assert t.state.step == at - 1


def test_a_loss_key_naming_no_optimizer():
    class TwoOptimizers(Returns):
        def configure_optimizers(self):
            return {"g": torch.optim.SGD([self.model.weight], lr=0.1), "d": torch.optim.SGD([self.model.bias], lr=0.1)}

    with pytest.raises(StepError, match=re.escape("step 1: loss 'gen' names no optimizer; with several optimizers "
                                                  "each loss key must be one of ['d', 'g']")):
        TwoOptimizers(lambda loss: {"gen": loss, "d": loss * 2}).fit()


# -- a failed step changes nothing (automatic and manual mode: one step cycle) ------------------
@pytest.fixture(params=["automatic", "unchecked", "manual"])
def mode(request):
    """Makes a Trainer class run in the parametrized mode: automatic (the guard checks its first steps),
    automatic and unchecked (the guard walks no step) or manual."""
    return {"automatic": lambda cls: cls, "unchecked": unchecked, "manual": manual}[request.param]


def snapshot(t: Trainer):
    opt = t.optimizers["optimizer"]
    return copy.deepcopy([p.detach() for p in t.model.parameters()]), copy.deepcopy(opt.state_dict())


def same(a, b) -> bool:
    (pa, sa), (pb, sb) = a, b
    states = [(x, y) for k in sa["state"] for x, y in zip(sa["state"][k].values(), sb["state"][k].values())]
    return all(torch.equal(x, y) for x, y in zip(pa, pb)) and all(torch.equal(x, y) for x, y in states)


class FailsAfterBackward(Trainer):
    def on_step_end(self, losses):
        self.before = snapshot(self)

    def on_after_backward(self, name):
        if self.state.step + 1 == 3:
            raise KeyError("boom")


def test_an_exception_after_backward_leaves_parameters_and_optimizer_state_as_before(mode):
    t = trainer(mode(FailsAfterBackward))
    with pytest.raises(StepError, match=r"step 3 failed and was abandoned \(parameters and optimizer state are "
                                        r"unchanged\): KeyError: 'boom'") as info:
        t.fit()
    assert info.value.step == 3 and t.state.step == 2
    assert same(snapshot(t), t.before)
    assert all(p.grad is None for p in t.model.parameters())


class SparseRecommender(Trainer):
    """An embedding bag with sparse gradients under SparseAdam and a dense head under Adam, as DLRM-style models
    train; the dense optimizer updates first. ``automatic = False``: the same updates by self.backward / self.step."""

    def configure_optimizers(self):
        return {"dense": torch.optim.Adam(self.model[1].parameters(), lr=0.1),
                "sparse": torch.optim.SparseAdam(list(self.model[0].parameters()), lr=0.1)}

    def training_step(self, batch):
        idx, y = batch
        loss = torch.nn.functional.mse_loss(self.model(idx), y)
        if self.automatic:
            return {"dense": loss, "sparse": loss}
        self.backward(loss, optimizer="dense", retain_graph=True)
        self.backward(loss, optimizer="sparse")
        self.step("dense")
        self.step("sparse")
        return loss


@pytest.mark.parametrize("automatic", [True, False], ids=["automatic", "manual"])
def test_grad_clip_over_a_sparse_gradient_is_named_with_what_to_do_and_changes_nothing(automatic):
    """torch's clip_grad_norm_ cannot take a sparse gradient's norm: instead of its NotImplementedError from
    aten's sparse backend, the parameter and the way out; the dense optimizer's update of the step is undone."""
    gen = torch.Generator().manual_seed(0)
    batches = [(torch.randint(0, 10, (4, 2), generator=gen), torch.randn(4, 1, generator=gen)) for _ in range(3)]
    model = torch.nn.Sequential(torch.nn.EmbeddingBag(10, 3, sparse=True), torch.nn.Linear(3, 1))
    before = copy.deepcopy(model.state_dict())
    t = type("Sparse", (SparseRecommender,), {"automatic": automatic})(
        model, batches, max_steps=2, grad_clip=1.0, device="cpu", progress=False, loggers=())
    with pytest.raises(StepError, match=re.escape(
            "step 1: grad_clip=1.0 clips optimizer 'sparse''s gradients, and `model.0.weight` holds a sparse "
            "gradient (nn.Embedding(sparse=True), nn.EmbeddingBag(sparse=True)), whose norm torch's clip_grad_norm_ "
            "cannot take. Leave grad_clip out and clip the dense parameters in on_before_optimizer_step")):
        t.fit()
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())
    assert t.optimizers["dense"].state == {} and t.state.step == 0


class FailsInTrainingStep(Trainer):
    def training_step(self, batch):
        self.before = snapshot(self)
        if self.state.step + 1 == 4:
            raise ValueError("no batch like this one")
        return super().training_step(batch)


def test_an_exception_in_training_step_leaves_parameters_and_optimizer_state_as_before(mode):
    t = trainer(mode(FailsInTrainingStep))
    with pytest.raises(StepError, match=r"step 4 failed and was abandoned \(parameters and optimizer state are "
                                        r"unchanged\): ValueError: no batch like this one"):
        t.fit()
    assert t.state.step == 3 and same(snapshot(t), t.before)
    assert all(p.grad is None for p in t.model.parameters())


class StaleGeneratorLoss(Trainer):
    """A GAN step's mistake: the generator's loss built before the discriminator's update, back-propagated
    after it (the guard raises before that backward, once optimizer 'd' has stepped)."""

    automatic = False

    def configure_optimizers(self):
        return {"d": torch.optim.SGD(self.model[1].parameters(), lr=0.1),
                "g": torch.optim.SGD(self.model[0].parameters(), lr=0.1)}

    def training_step(self, batch):
        x, _ = batch
        self.before = copy.deepcopy(self.model.state_dict())
        d_out = self.model[1](torch.tanh(self.model[0](x)))
        d_loss = d_out.pow(2).mean()
        self.backward(d_loss, optimizer="d", retain_graph=True)
        self.step("d")
        g_loss = (d_out - 1).pow(2).mean()
        self.backward(g_loss, optimizer="g")
        self.step("g")
        return {"d": d_loss, "g": g_loss}


@pytest.mark.parametrize("undo, left", [
    ("auto", "parameters and optimizer state are unchanged"),
    ("off", "optimizer 'd' had already updated its parameters, which trainer.undo=off leaves"),
])
def test_a_guard_error_in_a_manual_step_says_what_abandoning_the_step_left(undo, left):
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 1))
    t = StaleGeneratorLoss(model, data(), max_steps=2, device="cpu", progress=False, loggers=(), undo=undo)
    with pytest.raises(InplaceModificationError, match=re.escape(
            "(step 1, loss 'g'): optimizer 'd' stepped after this loss was built and before its backward, changing "
            f"parameters its graph saved ([torch.FloatTensor [4, 1]]). The step was abandoned ({left}). To fix: ")):
        t.fit()
    changed = [k for k, v in model.state_dict().items() if not torch.equal(v, t.before[k])]
    assert changed == ([] if undo == "auto" else ["1.weight", "1.bias"])


class ChangesASavedTensorAtStep(Trainer):
    """No hooks, one loss, one optimizer: the plain step. At step ``bad`` a tensor that backward needs is
    changed in place, so backward fails half way, after some gradients were written."""

    bad = 15

    def training_step(self, batch):
        x, y = batch
        self.before = snapshot(self)
        out = self.model(x)
        h = torch.sigmoid(out)  # saves its output for backward
        loss = ((h - y) ** 2).mean() + out.pow(2).mean()
        if self.state.step + 1 == self.bad:
            h.mul_(2)
        return loss


@pytest.mark.parametrize("check", ["auto", "off"])
def test_a_failing_unchecked_plain_step_changes_nothing(check, tmp_path, mode):
    t = trainer(mode(ChangesASavedTensorAtStep), max_steps=30, guard={"check": check, "budget": 1e-9}, run_dir=tmp_path)
    with pytest.raises(InplaceModificationError, match=r"a tensor the graph saved for backward \(.*the output of "
                                                       r"Sigmoid\) was changed in place"):
        t.fit()
    assert t.state.step == 14 and not t.guard.checking  # a step the guard left alone (after its warm-up)
    assert same(snapshot(t), t.before)
    assert all(p.grad is None for p in t.model.parameters())


# -- non-finite losses and gradients ---------------------------------------------------------
class Poisoned(Trainer):
    """A NaN loss at the steps in ``nan_at``; an Inf gradient (finite loss) at the steps in ``inf_grad_at``."""

    nan_at: tuple = ()
    inf_grad_at: tuple = ()

    def training_step(self, batch):
        self.before = snapshot(self)
        loss = super().training_step(batch)
        step = self.state.step + 1
        if step in self.nan_at:
            loss = loss * float("nan")
        if step in self.inf_grad_at:  # sqrt at 0: value 0, gradient Inf
            loss = loss + torch.sqrt((self.model.bias - self.model.bias.detach()).sum())
        return loss


def test_nan_loss_stops_the_run_naming_loss_and_step(mode):
    t = trainer(mode(type("P", (Poisoned,), {"nan_at": (4,)})), on_nonfinite="error")
    with pytest.raises(NonFiniteError, match=r"step 4: loss 'loss' is nan \(a non-finite loss makes every gradient "
                                             r"non-finite\)\. The step was abandoned before the optimizer step"):
        t.fit()
    assert t.state.step == 3 and same(snapshot(t), t.before)


def test_inf_gradient_with_a_finite_loss_names_the_parameter(mode):
    t = trainer(mode(type("P", (Poisoned,), {"inf_grad_at": (2,)})), on_nonfinite="error")
    with pytest.raises(NonFiniteError, match=r"step 2: the losses are finite \('loss' = [\d.]+\) but the gradients "
                                             r"of model\.bias hold NaN or Inf"):
        t.fit()
    assert same(snapshot(t), t.before)


def test_gradients_written_by_hand_are_checked_and_the_message_says_no_loss_was():
    class WritesGradients(Trainer):  # manual mode without self.backward (per-sample gradients, DP-SGD)
        automatic = False

        def training_step(self, batch):
            self.before = snapshot(self)
            for p in self.model.parameters():
                p.grad = torch.full_like(p, float("inf") if self.state.step == 1 else 0.5)
            self.step()

    t = trainer(WritesGradients, on_nonfinite="error")
    with pytest.raises(NonFiniteError, match=re.escape(
            "step 2: the gradients of model.weight, model.bias hold NaN or Inf (no loss was back-propagated in this "
            "step, so no loss was checked). The step was abandoned before the optimizer step")):
        t.fit()
    assert same(snapshot(t), t.before)


def test_a_non_finite_complex_gradient_is_found_and_finite_ones_train():
    """Complex parameters (a Fourier layer's spectral weights): a NaN in the imaginary part alone is found."""
    class Spectral(Trainer):
        def configure_optimizers(self):
            self.w = torch.nn.Parameter(torch.ones(3, dtype=torch.cfloat))
            return torch.optim.Adam([*self.model.parameters(), self.w], lr=0.1)

        def training_step(self, batch):
            x, y = batch
            loss = torch.nn.functional.mse_loss(self.model(x), y) + (self.w * self.w.conj()).real.sum()
            if self.state.step == 1:  # sqrt at 0: value 0, gradient Inf, in the imaginary part only
                loss = loss + (self.w.imag - self.w.imag.detach()).sum().sqrt()
            return loss

    t = trainer(Spectral, on_nonfinite="skip", max_steps=3)
    t.fit()
    assert t.state.step == 3 and t.state.skipped == 1
    assert torch.isfinite(torch.view_as_real(t.w)).all() and not torch.equal(t.w, torch.ones(3, dtype=torch.cfloat))


def test_skip_leaves_parameters_and_optimizer_state_untouched_and_counts(caplog, mode):
    t = trainer(mode(type("P", (Poisoned,), {"nan_at": (3,), "inf_grad_at": (4,)})), on_nonfinite="skip",
                scheduler=lambda opt: torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5), max_steps=4)
    with caplog.at_level(logging.WARNING, logger="safeloop"):
        t.fit()
    assert t.state.step == 4 and t.state.skipped == 2
    assert same(snapshot(t), t.before)  # steps 3 and 4 changed nothing
    assert t.optimizers["optimizer"].state_dict()["state"][0]["step"] == 2
    assert t.schedulers["optimizer"].last_epoch == 2  # the schedule does not advance on a skipped step
    assert "step 3 skipped, nothing updated: loss 'loss' is nan" in caplog.text
    assert "(2 skipped so far, 2 in a row; trainer.max_skipped=10)" in caplog.text
    assert math.isnan(t.state.floats()["loss"]) is False  # step 4's loss was finite, its gradient was not


def test_skip_stops_after_max_skipped_in_a_row(mode):
    t = trainer(mode(type("P", (Poisoned,), {"nan_at": (2, 4, 5, 6)})), on_nonfinite="skip", max_skipped=2)
    with pytest.raises(NonFiniteError, match=r"step 6: loss 'loss' is nan .*, and the 2 steps before it were skipped "
                                             r"for the same reason \(trainer.max_skipped=2\): training diverged"):
        t.fit()
    assert t.state.skipped == 3  # steps 2, 4, 5; step 3 was fine and reset the count


def test_skips_in_a_row_are_counted_across_a_resume_and_a_second_fit(mode, tmp_path):
    """The run that never stopped stops at step 6 (steps 4 and 5 skipped, max_skipped=2); so does one
    resumed from a checkpoint written after step 5, and one trained by a second fit()."""
    poisoned = mode(type("P", (Poisoned,), {"nan_at": (4, 5, 6)}))
    diverged = r"step 6: loss 'loss' is nan .*, and the 2 steps before it were skipped"
    with pytest.raises(NonFiniteError, match=diverged):
        trainer(poisoned, on_nonfinite="skip", max_skipped=2).fit()
    first = trainer(poisoned, on_nonfinite="skip", max_skipped=2, max_steps=5)
    first.fit()
    assert first.state.skipped_in_row == 2
    torch.save(first.state_dict(), tmp_path / "step-5.pt")
    with pytest.raises(NonFiniteError, match=diverged):  # the same Trainer, fit() again
        first.max_steps = 6
        first.fit()
    resumed = trainer(poisoned, on_nonfinite="skip", max_skipped=2, resume=str(tmp_path / "step-5.pt"))
    with pytest.raises(NonFiniteError, match=diverged):
        resumed.fit()
    assert resumed.state.step == 5 and resumed.state.skipped == 2


def test_off_removes_the_check(mode):
    t = trainer(mode(type("P", (Poisoned,), {"nan_at": (2,)})), on_nonfinite="off", max_steps=2)
    t.fit()
    assert torch.isnan(t.model.weight).all()
