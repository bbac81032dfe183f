"""Failures as real training code meets them, and what each must leave behind.

Each case follows a public loop or a situation users meet: an out-of-memory error caught and the fit tried
again (fairseq's trainer, accelerate's ``find_executable_batch_size``), a callback raising at each hook, the
second optimizer of a GAN failing, a closure failing inside ``torch.optim.LBFGS``, Ctrl-C in a notebook, a
checkpoint the system refuses to write, a hook failing as a resumed run loads its checkpoint, an error fixed the
way its message says before ``fit()`` is called again. After the failure,
parameters, optimizer state, schedulers, the GradScaler and the counters are compared bit for bit with a deep
copy taken before it, and a fit tried again with a run that never failed, where the documentation promises it.

A case that fails today would be a strict xfail whose ``reason`` says what goes wrong and why: there is none.
"""
from __future__ import annotations

import copy
import csv
import os
import re
import resource
import signal
import threading

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from safeloop import Callback, CheckpointError, ConfigError, Interrupted, StepError, Trainer
from safeloop.checkpoint import Checkpointer
from safeloop.checkpoint.files import load

QUIET = dict(device="cpu", progress=False, loggers=())


def batches(n: int = 12, size: int = 4, seed: int = 0) -> list:
    gen = torch.Generator().manual_seed(seed)
    return [(torch.randn(size, 3, generator=gen), torch.randn(size, 1, generator=gen)) for _ in range(n)]


def mlp(seed: int = 0, hidden: int = 8) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(3, hidden), nn.Tanh(), nn.Linear(hidden, 1))


class WithDropout(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(3, 8), nn.Dropout(0.3), nn.Linear(8, 1))

    def forward(self, x):
        return self.net(x)


def everything(t: Trainer) -> dict:
    """A deep copy of what a failed step must leave as it was: parameters and buffers, optimizer and scheduler
    states, the GradScaler's, and the counters of ``trainer.state``."""
    s = t.state
    return copy.deepcopy({
        "model": t.model.state_dict(),
        "optimizers": {name: opt.state_dict() for name, opt in t.optimizers.items()},
        "schedulers": {name: sched.state_dict() for name, sched in t.schedulers.items()},
        "scaler": t.scaler.state_dict() if t.scaler is not None else None,
        "state": (s.step, s.epoch, s.skipped, s.skipped_in_row, len(s.val_history)),
    })


def differences(a, b, where: str = "") -> list[str]:
    """Where ``a`` and ``b`` differ, bit for bit (tensors by dtype, shape and value; NaN equal to NaN)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        same = (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype
                and a.shape == b.shape and torch.equal(a.nan_to_num(), b.nan_to_num()))
        return [] if same else [where or "tensor"]
    if isinstance(a, dict) and isinstance(b, dict):
        if a.keys() != b.keys():
            return [f"{where} keys {sorted(map(str, a))} != {sorted(map(str, b))}"]
        return [d for k in a for d in differences(a[k], b[k], f"{where}[{k!r}]")]
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        if len(a) != len(b):
            return [f"{where} length {len(a)} != {len(b)}"]
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in differences(x, y, f"{where}[{i}]")]
    return [] if a == b else [f"{where}: {a!r} != {b!r}"]


def no_gradients(t: Trainer) -> bool:
    return all(p.grad is None for p in t.model.parameters())


# -- out of memory: caught, and the fit tried again --------------------------------------------------------------
class OutOfMemoryAt(Trainer):
    """``oom = (step, micro)``: ``torch.OutOfMemoryError`` from the forward of micro-batch ``micro`` (from 1) of
    step ``step``."""

    oom: tuple[int, int] | None = None

    def training_step(self, batch):
        if self.oom is not None and self.oom[0] == self.state.step + 1:
            micro = (self.state.batch_in_epoch - 1) % self.grad_accum + 1
            if micro == self.oom[1]:
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (GPU 0; 79.10 GiB "
                                             "total capacity)")
        return super().training_step(batch)


def oom_trainer(**settings) -> OutOfMemoryAt:
    return OutOfMemoryAt(mlp(), batches(), lambda p: torch.optim.Adam(p, lr=0.05),
                         scheduler=lambda o: torch.optim.lr_scheduler.StepLR(o, 1, 0.9), **{**QUIET, **settings})


def accelerate_retries(err: BaseException) -> bool:
    """accelerate's ``should_reduce_batch_size`` (src/accelerate/utils/memory.py): what it takes for an OOM."""
    return isinstance(err, RuntimeError) and len(err.args) == 1 and "CUDA out of memory." in err.args[0]


@pytest.mark.parametrize("grad_accum, micro, precision", [(1, 1, "32"), (3, 2, "32"), (3, 3, "16"), (1, 1, "16")])
def test_an_oom_in_a_forward_changes_nothing_and_the_fit_tried_again_trains_as_the_run_that_never_failed(
        grad_accum, micro, precision):
    """fairseq's ``Trainer.train_step`` catches "out of memory", zeroes the gradients and goes on; accelerate's
    ``find_executable_batch_size`` catches it and calls the training function again. Here the OOM comes from the
    forward of micro-batch ``micro`` of step 3 (mid-accumulation with ``grad_accum=3``), under ``precision=16``
    with a GradScaler too. The error still reads as an OOM to accelerate."""
    t = oom_trainer(max_steps=2, grad_accum=grad_accum, precision=precision)
    t.fit()
    before = everything(t)
    t.oom, t.max_steps = (3, micro), 5
    with pytest.raises(StepError, match=re.escape("step 3 failed and was abandoned (parameters and optimizer state "
                                                  "are unchanged): OutOfMemoryError: CUDA out of memory.")) as info:
        t.fit()
    assert accelerate_retries(info.value)
    assert differences(before, everything(t)) == []
    assert no_gradients(t)
    assert t.state.batch_in_epoch == 3 * grad_accum  # the failed step's batches are consumed (documented)

    t.oom = None
    t.state.batch_in_epoch -= grad_accum  # the batches of the failed step, tried again
    t.fit()
    never_failed = oom_trainer(max_steps=5, grad_accum=grad_accum, precision=precision)
    never_failed.fit()
    assert differences(everything(never_failed), everything(t)) == []


class StatefulBatches:
    """Batches numbered 0 .. n-1 each pass, keeping its own position as torchdata's ``StatefulDataLoader`` does
    (stateful_dataloader.py: ``__iter__`` makes a new iterator from ``next_iter_state``, which only
    ``load_state_dict`` sets: without it a new iterator starts the pass again)."""

    def __init__(self, n: int = 5):
        self.n, self.batch, self.next_state = n, 0, None

    def __iter__(self):
        self.batch, self.next_state = (self.next_state or {"batch": 0})["batch"], None
        while self.batch < self.n:
            self.batch += 1
            yield torch.full((4, 3), float(self.batch - 1)), torch.zeros(4, 1)

    def state_dict(self):
        return {"batch": self.batch}

    def load_state_dict(self, state):
        self.next_state = dict(state)


class RecordsBatches(OutOfMemoryAt):
    """Records the number of each batch it trains on."""

    def training_step(self, batch):
        loss = super().training_step(batch)
        self.seen = getattr(self, "seen", []) + [int(batch[0][0, 0])]
        return loss


def test_a_fit_tried_again_after_an_oom_goes_on_with_the_next_batch_of_a_stateful_data_loader():
    """fairseq skips the batch that ran out of memory and goes on with the next; docs/checkpoints.md says a failed
    step's batch is consumed ("the next step takes the next batch") and names torchdata's ``StatefulDataLoader`` as
    data keeping its own position. The fit tried again must read as the same run over a list of the batches does."""
    def run(data) -> RecordsBatches:
        t = RecordsBatches(nn.Linear(3, 1), data, lambda p: torch.optim.SGD(p, lr=0.1), max_steps=7, **QUIET)
        t.oom = (3, 1)
        with pytest.raises(StepError, match="OutOfMemoryError"):
            t.fit()
        t.oom = None
        t.fit()
        return t

    in_a_list = run([(torch.full((4, 3), float(i)), torch.zeros(4, 1)) for i in range(5)])
    assert in_a_list.seen == [0, 1, 3, 4, 0, 1, 2]
    stateful = run(StatefulBatches())
    assert stateful.seen == in_a_list.seen
    assert (stateful.state.epoch, stateful.state.batch_in_epoch) == (in_a_list.state.epoch,
                                                                     in_a_list.state.batch_in_epoch) == (1, 3)


class GrowsPastMemory(Trainer):
    """Runs out of memory on any batch larger than ``fits`` samples; counts the samples it trained on."""

    fits = 16
    trained = 0

    def training_step(self, batch):
        x, y = batch
        if len(x) > self.fits:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")
        self.trained += len(x)
        return super().training_step(batch)


def find_executable_batch_size(function, starting_batch_size: int):
    """accelerate's ``find_executable_batch_size`` (src/accelerate/utils/memory.py), as published: halve the batch
    size and call ``function`` again while it fails with an out-of-memory error."""
    def run():
        batch_size = starting_batch_size
        while True:
            try:
                return function(batch_size)
            except Exception as err:
                if not accelerate_retries(err):
                    raise
                batch_size //= 2
    return run


def test_find_executable_batch_size_on_one_trainer_trains_every_sample_at_the_batch_size_that_fits():
    """accelerate's docs (usage_guides/memory.md): the model and optimizer made once outside (``nonlocal model,
    optimizer``), the data loaders made inside the function the decorator retries with half the batch size. Two
    OOMs (64, 32), then 16 fits: as nothing was trained, the run must be the run that started at 16."""
    gen = torch.Generator().manual_seed(1)
    dataset = TensorDataset(torch.randn(64, 3, generator=gen), torch.randn(64, 1, generator=gen))
    settings = dict(optimizer=lambda p: torch.optim.Adam(p, lr=0.01), max_epochs=1, seed=0, **QUIET)
    trainer = GrowsPastMemory(mlp(), [], **settings)

    def train(batch_size):
        trainer.train_data = DataLoader(dataset, batch_size=batch_size, shuffle=True)
        trainer.fit()
        return batch_size

    assert find_executable_batch_size(train, 64)() == 16
    fresh = GrowsPastMemory(mlp(), DataLoader(dataset, batch_size=16, shuffle=True), **settings)
    fresh.fit()
    assert (trainer.trained, trainer.state.step) == (fresh.trained, fresh.state.step) == (64, 4)
    assert differences(fresh.model.state_dict(), trainer.model.state_dict()) == []


class SkipsOnNaN(Trainer):
    """Non-finite losses at the steps in ``nan``; an OOM in ``on_before_optimizer_step`` at step ``oom``."""

    nan: tuple[int, ...] = (2, 3)
    oom: int | None = None

    def training_step(self, batch):
        loss = super().training_step(batch)
        return loss * float("nan") if self.state.step + 1 in self.nan else loss

    def on_before_optimizer_step(self, name, optimizer):
        if self.state.step + 1 == self.oom:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1.00 GiB")


def test_a_failed_step_leaves_the_count_of_steps_skipped_in_a_row_as_it_was():
    """fairseq's ``Trainer.train_step`` skips a batch that ran out of memory and goes on; safeloop counts non-finite
    steps skipped in a row (``on_nonfinite=skip``) across fits so that a diverging run stops at ``max_skipped``.
    Two NaN steps skipped, then step 4 runs out of memory: its abandonment must leave the count at 2."""
    t = SkipsOnNaN(mlp(), batches(), lambda p: torch.optim.Adam(p, lr=0.01), max_steps=3, on_nonfinite="skip",
                   **QUIET)
    t.fit()
    assert (t.state.skipped, t.state.skipped_in_row) == (2, 2)
    before = everything(t)
    t.oom, t.max_steps = 4, 8
    with pytest.raises(StepError, match=r"step 4 failed and was abandoned \(parameters and optimizer state are "
                                        r"unchanged\): OutOfMemoryError"):
        t.fit()
    assert differences(before, everything(t)) == []


# -- a start-up error, fixed as it says, and fit() called again ----------------------------------------------------
def test_a_fit_called_again_after_fixing_a_scheduler_config_error_as_it_says_trains_with_the_scheduler():
    """docs/trainer.md: a plateau scheduler's monitor without ``val_every`` is an error at start-up, whose message
    says "set val_every=N"; settings are attributes "which a later fit() reads". In a notebook the user sets
    ``trainer.val_every = 2`` and calls ``fit()`` again."""
    t = Trainer(mlp(), batches(), lambda p: torch.optim.SGD(p, lr=0.1), val_data=batches(2), max_steps=6,
                scheduler={"scheduler": lambda o: torch.optim.lr_scheduler.ReduceLROnPlateau(o, patience=0),
                           "monitor": "val_loss"}, **QUIET)
    with pytest.raises(ConfigError, match=r"no validation runs during training .* set val_every=N"):
        t.fit()
    t.val_every = 2
    t.fit()
    plateau = t.schedulers["optimizer"]
    assert isinstance(plateau, torch.optim.lr_scheduler.ReduceLROnPlateau)
    assert t.state.step == 6 and plateau.last_epoch == 3  # after the validations of steps 2, 4 and 6


def test_a_fit_called_again_with_the_precision_the_closure_error_asks_for_trains_without_a_grad_scaler():
    """docs/trainer.md: L-BFGS under ``precision="16"`` is refused, "use precision=bf16 or 32"; a setting is an
    attribute a later ``fit()`` reads. The user of a PINN loop sets ``trainer.precision = "32"`` and fits again:
    it must train as a Trainer made with ``precision="32"``."""
    t = lbfgs_trainer(max_steps=3, precision="16")
    with pytest.raises(ConfigError, match=re.escape("steps with a closure, which precision=16's GradScaler does not "
                                                    "support: use precision=bf16 or 32")):
        t.fit()
    t.precision = "32"
    t.fit()
    assert t.scaler is None
    made_so = lbfgs_trainer(max_steps=3, precision="32")
    made_so.fit()
    assert differences(everything(made_so), everything(t)) == []


class OneCycleTooShort(Trainer):
    """OneCycleLR stepped every update, its ``total_steps`` (4) fewer than the run's steps: its fifth ``step()``
    raises "Tried to step 5 times. The specified number of total steps is 4" after the optimizer's update."""

    def configure_optimizers(self):
        opt = torch.optim.Adam(self.model.parameters(), lr=0.1)
        cycle = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.1, total_steps=4)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": cycle, "interval": "step"}}


def test_undo_full_set_as_the_error_advises_undoes_the_next_failure_of_the_last_update():
    """vLAR-group/GrowSP#11: OneCycleLR's "Tried to step 60002 times. The specified number of total steps is 60000",
    raised by the scheduler after the last update of a step. safeloop's error says the update "is not undone; set
    trainer.undo=full to make such failures undoable"; the user does (``trainer.undo = "full"``) and calls
    ``fit()`` again, where the same step fails again: it must now be undone."""
    t = OneCycleTooShort(mlp(), batches(), max_steps=6, **QUIET)
    with pytest.raises(StepError, match=re.escape("step 5 failed and was abandoned (optimizer 'optimizer' had "
                                                  "already updated its parameters or begun to, and is not undone; "
                                                  "set trainer.undo=full to make such failures undoable): "
                                                  "ValueError: Tried to step 5 times")):
        t.fit()
    t.undo = "full"
    before = everything(t)
    with pytest.raises(StepError, match=re.escape("step 5 failed and was abandoned (parameters and optimizer state "
                                                  "are unchanged): ValueError: Tried to step")):
        t.fit()
    assert differences(before, everything(t)) == []


# -- a callback raising at each hook -------------------------------------------------------------------------------
def raising(hook: str, at: int) -> Callback:
    """A callback that overrides ``hook`` alone (safeloop calls only the hooks a callback overrides) and raises
    ``ValueError`` there at step ``at``."""
    def fire(self, trainer, *args):
        under_way = trainer.state.step if hook == "on_step_end" else trainer.state.step + 1  # (after the count)
        if under_way == at:
            raise ValueError(f"callback failed in {hook}")

    return type(f"RaisesIn_{hook}", (Callback,), {hook: fire})()


def scaled_trainer(*callbacks, **settings) -> Trainer:
    return Trainer(mlp(), batches(), lambda p: torch.optim.Adam(p, lr=0.05), precision="16",
                   scheduler=lambda o: torch.optim.lr_scheduler.StepLR(o, 1, 0.9), callbacks=list(callbacks),
                   **{**QUIET, **settings})


@pytest.mark.parametrize("hook", ["on_before_backward", "on_after_backward", "on_before_optimizer_step"])
def test_a_callback_raising_in_a_step_hook_after_scaler_scale_leaves_everything_as_it_was(hook):
    """Lightning's documented ``on_before_optimizer_step`` (``self.log_dict(grad_norm(self.layer, norm_type=2))``)
    and loss hooks ported to a callback, raising mid-step under ``precision=16``: the loss is already
    ``scaler.scale``d (and the gradients unscaled, in ``on_before_optimizer_step``). Parameters, Adam's state, the
    schedule, the GradScaler and the counters must be as before the step."""
    cb = raising(hook, at=3)
    t = scaled_trainer(cb, max_steps=2)
    t.fit()
    before = everything(t)
    t.max_steps = 5
    with pytest.raises(StepError, match=re.escape(f"step 3 failed and was abandoned (parameters and optimizer state "
                                                  f"are unchanged): ValueError: callback failed in {hook}")):
        t.fit()
    assert differences(before, everything(t)) == []
    assert no_gradients(t)
    assert not t.scaler._per_optimizer_states  # nothing is left unscaled or stepped for the next update

    t.callbacks.remove(cb)
    t.state.batch_in_epoch -= 1
    t.fit()
    never_failed = scaled_trainer(max_steps=5)
    never_failed.fit()
    assert differences(everything(never_failed), everything(t)) == []


def test_a_callback_raising_in_on_step_end_says_the_update_was_applied_and_leaves_it():
    """An EMA or logging callback's ``on_train_batch_end`` ported to ``on_step_end`` raising after the update: the
    update was right and stays (docs/trainer.md, Hooks), the error says so, and the step counts."""
    cb = raising("on_step_end", at=3)
    t = scaled_trainer(cb, max_steps=5)
    with pytest.raises(StepError, match=re.escape("step 3's update was applied; the error came after it, in "
                                                  "on_step_end: ValueError: callback failed in on_step_end")):
        t.fit()
    three = scaled_trainer(max_steps=3)
    three.fit()
    assert differences(everything(three), everything(t)) == []


def test_a_callback_raising_in_on_step_start_is_named_as_a_failure_of_that_step():
    """A ported ``on_train_batch_start`` (a schedule set by hand, a timer) raising: docs/trainer.md lists
    ``on_step_start`` as the first hook of a step, and the README says an error inside a step names the step and
    says what was undone."""
    t = scaled_trainer(raising("on_step_start", at=3), max_steps=5)
    with pytest.raises(StepError, match=re.escape("step 3 failed and was abandoned (parameters and optimizer state "
                                                  "are unchanged): ValueError: callback failed in on_step_start")):
        t.fit()


class EpochScheduled(Trainer):
    """An epoch-interval StepLR (Lightning's default interval); ``on_epoch_end`` raises once at the end of pass
    ``fail_at_end_of``."""

    fail_at_end_of: int | None = None

    def configure_optimizers(self):
        opt = torch.optim.SGD(self.model.parameters(), lr=0.5)
        return {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)}

    def on_epoch_end(self):
        if self.state.epoch == self.fail_at_end_of:
            self.fail_at_end_of = None
            raise ValueError("epoch metric failed: compute() called before update()")


def test_a_fit_tried_again_after_on_epoch_end_failed_steps_the_epoch_scheduler_once_for_that_pass():
    """Lightning's ``on_train_epoch_end`` computing an epoch metric (torchmetrics' ``compute()`` raising on a state
    it never updated), caught in a notebook, the fit called again: the run must go on as the one that never
    failed, with one scheduler step per pass."""
    t = EpochScheduled(mlp(), batches(2), max_epochs=3, **QUIET)
    t.fail_at_end_of = 0
    with pytest.raises(ValueError, match="epoch metric failed"):
        t.fit()
    t.fit()
    never_failed = EpochScheduled(mlp(), batches(2), max_epochs=3, **QUIET)
    never_failed.fit()
    assert t.optimizers["optimizer"].param_groups[0]["lr"] == never_failed.optimizers["optimizer"].param_groups[0]["lr"]
    assert differences(everything(never_failed), everything(t)) == []


class FailsOnEpochStart(Trainer):
    fail_at: int | None = None

    def on_epoch_start(self):
        if self.state.epoch == self.fail_at:
            self.fail_at = None
            raise ValueError("could not rebuild the data for this pass")


def test_a_fit_tried_again_after_on_epoch_start_failed_trains_as_the_run_that_never_failed():
    """Lightning's ``reload_dataloaders_every_n_epochs`` ported as ``self.train_data = ...`` in
    ``on_epoch_start`` (docs/trainer.md), failing at the second pass; a shuffled DataLoader, dropout and an epoch
    scheduler: the fit called again must draw and train as the run that never failed."""
    gen = torch.Generator().manual_seed(1)
    dataset = TensorDataset(torch.randn(12, 3, generator=gen), torch.randn(12, 1, generator=gen))

    def make():
        torch.manual_seed(0)
        return FailsOnEpochStart(WithDropout(), DataLoader(dataset, batch_size=4, shuffle=True),
                                 lambda p: torch.optim.Adam(p, lr=0.01), max_epochs=3,
                                 scheduler={"scheduler": lambda o: torch.optim.lr_scheduler.StepLR(o, 1, 0.5),
                                            "interval": "epoch"}, **QUIET)

    t = make()
    t.fail_at = 1
    with pytest.raises(ValueError, match="could not rebuild"):
        t.fit()
    assert (t.state.step, t.state.epoch, t.state.batch_in_epoch) == (3, 1, 0)
    t.fit()
    never_failed = make()
    never_failed.fit()
    assert differences(everything(never_failed), everything(t)) == []


# -- several optimizers: the second one fails -------------------------------------------------------------------
class GAN(nn.Module):
    def __init__(self):
        super().__init__()
        self.g = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
        self.d = nn.Sequential(nn.Linear(2, 8), nn.ReLU(), nn.Linear(8, 1))


def gan_batches(n: int = 6) -> list:
    gen = torch.Generator().manual_seed(5)
    return [(torch.randn(8, 2, generator=gen), torch.randn(8, 4, generator=gen)) for _ in range(n)]


def bce(logits, target: float):
    return F.binary_cross_entropy_with_logits(logits, torch.full_like(logits, target))


class RoutedGAN(Trainer):
    """Both losses returned, each routed to its optimizer (automatic mode); ``on_before_optimizer_step`` of 'g'
    raises at step ``fail``, after 'd' stepped."""

    fail: int | None = None

    def configure_optimizers(self):
        return {"d": torch.optim.Adam(self.model.d.parameters(), lr=0.01, betas=(0.5, 0.999)),
                "g": torch.optim.Adam(self.model.g.parameters(), lr=0.01, betas=(0.5, 0.999))}

    def training_step(self, batch):
        real, z = batch
        fake = self.model.g(z)
        return {"d": bce(self.model.d(real), 1.0) + bce(self.model.d(fake.detach()), 0.0),
                "g": bce(self.model.d(fake), 1.0)}

    def on_before_optimizer_step(self, name, optimizer):
        if name == "g" and self.state.step + 1 == self.fail:
            raise ValueError("hook failed on g")


class ManualGAN(RoutedGAN):
    """The README's GAN step: D's update, then G's; raises between the two ``self.step`` calls at step ``fail``."""

    automatic = False

    def training_step(self, batch):
        real, z = batch
        fake = self.model.g(z)
        d_loss = bce(self.model.d(real), 1.0) + bce(self.model.d(fake.detach()), 0.0)
        self.backward(d_loss, optimizer="d")
        self.step("d")
        if self.state.step + 1 == self.fail:
            raise RuntimeError("failed between the two updates")
        g_loss = bce(self.model.d(fake), 1.0)
        self.backward(g_loss, optimizer="g")
        self.step("g")
        return {"d": d_loss, "g": g_loss}

    def on_before_optimizer_step(self, name, optimizer):
        """This step fails in training_step, between the updates: not in RoutedGAN's hook."""


@pytest.mark.parametrize("cls, error", [(RoutedGAN, "ValueError: hook failed on g"),
                                        (ManualGAN, "RuntimeError: failed between the two updates")])
def test_a_gan_step_failing_after_d_stepped_restores_d_and_the_fit_tried_again_is_the_run_that_never_failed(cls, error):
    """pytorch/examples' DCGAN (``optimizerD.step()`` then G's loss and ``optimizerG.step()``): in automatic mode
    the hook of G's optimizer fails after D's update; in manual mode the step fails between ``self.step("d")`` and
    ``self.step("g")``. Under ``precision=16``: D's update went through ``scaler.step`` (float32 is in
    tests/test_step.py)."""
    def make():
        torch.manual_seed(0)
        return cls(GAN(), gan_batches(), max_steps=2, precision="16", **QUIET)

    t = make()
    t.fit()
    before = everything(t)
    t.fail, t.max_steps = 3, 5
    with pytest.raises(StepError, match=re.escape(f"step 3 failed and was abandoned (parameters and optimizer state "
                                                  f"are unchanged): {error}")):
        t.fit()
    assert differences(before, everything(t)) == []
    assert no_gradients(t)
    t.fail = None
    t.state.batch_in_epoch -= 1
    t.fit()
    never_failed = make()
    never_failed.max_steps = 5
    never_failed.fit()
    assert differences(everything(never_failed), everything(t)) == []


# -- a closure failing inside L-BFGS -----------------------------------------------------------------------------
class LBFGSFit(Trainer):
    """Automatic mode with ``torch.optim.LBFGS(max_iter=4)``: the Trainer's closure re-runs training_step;
    evaluation ``fail[1]`` of step ``fail[0]`` raises."""

    fail: tuple[int, int] | None = None
    evaluations = 0

    def on_step_start(self):
        self.evaluations = 0

    def training_step(self, batch):
        self.evaluations += 1
        if self.fail == (self.state.step + 1, self.evaluations):
            raise RuntimeError("evaluation failed inside the line search")
        return super().training_step(batch)


def lbfgs_trainer(**settings) -> LBFGSFit:
    return LBFGSFit(mlp(), batches(8), lambda p: torch.optim.LBFGS(p, lr=0.5, max_iter=4, history_size=3),
                    **{**QUIET, **settings})


def test_a_closure_failing_inside_lbfgs_leaves_its_history_as_it_was():
    """docs/trainer.md (Closures): "The update is snapshotted whatever undo=auto learned, so a failure inside the
    closure is undone". L-BFGS as in PINN and style-transfer loops (``optimizer.step(closure)``), its third
    evaluation of step 3 failing."""
    t = lbfgs_trainer(max_steps=2)
    t.fit()
    before = everything(t)
    t.fail, t.max_steps = (3, 3), 4
    with pytest.raises(StepError, match=re.escape("step 3 failed and was abandoned (parameters and optimizer state "
                                                  "are unchanged): RuntimeError: evaluation failed")):
        t.fit()
    assert differences(before, everything(t)) == []
    t.fail = None
    t.state.batch_in_epoch -= 1
    t.fit()
    never_failed = lbfgs_trainer(max_steps=4)
    never_failed.fit()
    assert differences(everything(never_failed), everything(t)) == []


def test_a_closure_failing_in_the_first_lbfgs_step_leaves_no_state():
    """The same L-BFGS loop failing in its very first step: no state may be left for its parameters."""
    t = lbfgs_trainer(max_steps=2)
    t.setup()  # the optimizer, made as fit() makes it
    before = everything(t)
    t.fail = (1, 2)
    with pytest.raises(StepError, match=r"step 1 failed and was abandoned \(parameters and optimizer state are "
                                        r"unchanged\)"):
        t.fit()
    assert differences(before, everything(t)) == []
    assert len(t.optimizers["optimizer"].state) == 0


# -- Ctrl-C --------------------------------------------------------------------------------------------------------
class InterruptedIn(Trainer):
    """``KeyboardInterrupt`` from ``training_step`` at step ``at``."""

    at: int | None = None

    def training_step(self, batch):
        if self.state.step + 1 == self.at:
            self.at = None
            raise KeyboardInterrupt
        return super().training_step(batch)


def test_a_keyboard_interrupt_in_a_step_propagates_as_itself_and_changes_nothing():
    """A ``KeyboardInterrupt`` raised in the step (Jupyter's interrupt where safeloop's handler is not in place, or a
    loop that raises it to stop): it comes out as a ``KeyboardInterrupt``, not wrapped, and the step is undone."""
    t = InterruptedIn(mlp(), batches(), lambda p: torch.optim.Adam(p, lr=0.05), max_steps=2, **QUIET)
    t.fit()
    before = everything(t)
    t.at, t.max_steps = 3, 5
    with pytest.raises(KeyboardInterrupt) as info:
        t.fit()
    assert type(info.value) is KeyboardInterrupt
    assert differences(before, everything(t)) == []
    assert no_gradients(t)


class InterruptedMidUpdate(torch.optim.SGD):
    """SGD whose update a user's Ctrl-C, pressed twice, lands in: after its first parameter moved."""

    interrupt_at: int | None = None

    def step(self, closure=None):
        self.updates = getattr(self, "updates", 0) + 1
        group = self.param_groups[0]
        with torch.no_grad():
            for i, p in enumerate(group["params"]):
                p.add_(p.grad, alpha=-group["lr"])
                if i == 0 and self.updates == self.interrupt_at:
                    os.kill(os.getpid(), signal.SIGINT)
                    os.kill(os.getpid(), signal.SIGINT)


def needs_the_main_thread():
    if threading.current_thread() is not threading.main_thread():
        pytest.skip("signal handlers are installed from the main thread only")


def test_a_second_ctrl_c_inside_the_last_update_restores_it_or_says_it_was_not_undone():
    """docs/checkpoints.md: SIGINT finishes the step, a second one "stops at once without saving"
    (``safeloop.Interrupted``); "The error says exactly which optimizer was restored and which was not". A notebook
    user presses interrupt twice; the second lands in the optimizer's update."""
    needs_the_main_thread()
    t = Trainer(mlp(), batches(), lambda p: InterruptedMidUpdate(p, lr=0.1), max_steps=2, **QUIET)
    t.fit()
    before = everything(t)
    t.optimizers["optimizer"].interrupt_at, t.max_steps = 3, 5
    with pytest.raises(Interrupted) as info:
        t.fit()
    said = " ".join([str(info.value), *getattr(info.value, "__notes__", [])])
    assert differences(before, everything(t)) != [] and "step 3 was abandoned: optimizer 'optimizer' had already " \
        "updated its parameters or begun to, and is not undone; set trainer.undo=full" in said, said


class CtrlCAt(Trainer):
    """A Jupyter interrupt (SIGINT) arriving once, while step ``at`` runs."""

    at: int | None = None

    def training_step(self, batch):
        if self.state.step + 1 == self.at:
            self.at = None
            os.kill(os.getpid(), signal.SIGINT)
        return super().training_step(batch)


def test_a_fit_called_again_after_ctrl_c_stopped_the_last_one_trains_to_max_steps():
    """docs/checkpoints.md: on SIGINT "the run stops cleanly". In a notebook, interrupting the kernel sends SIGINT:
    the fit finishes its step and returns; the user looks at the model, then calls ``fit()`` to go on."""
    needs_the_main_thread()
    t = CtrlCAt(mlp(), batches(), lambda p: torch.optim.Adam(p, lr=0.05), max_steps=8, **QUIET)
    t.at = 3
    t.fit()
    assert (t.state.step, t.stop_signal) == (3, signal.SIGINT)
    t.fit()
    assert (t.state.step, t.stop_signal) == (8, None)


# -- validation failing during fit -------------------------------------------------------------------------------
class FlakyValidation(Trainer):
    """``validation_step`` raises on the second batch of the validation after step ``fail_at``."""

    fail_at: int | None = None
    seen = 0

    def validation_step(self, batch):
        self.seen += 1
        if self.state.step == self.fail_at and self.seen == 2:
            raise RuntimeError("metric server unreachable")
        return super().validation_step(batch)

    def on_validation_end(self, metrics):
        self.seen = 0


def test_validation_failing_mid_fit_names_it_gives_back_train_mode_and_leaves_training_as_the_run_that_never_failed():
    """A validation that fails (a remote metric, an OOM in a larger eval batch) after step 4: the error names the
    validation, the step and the batch; the model is back in train mode, the update's gradients and the random
    streams are as before it, so a fit tried again trains as the run that never failed (dropout included)."""
    def make():
        torch.manual_seed(0)
        return FlakyValidation(WithDropout(), batches(), lambda p: torch.optim.Adam(p, lr=0.01), val_data=batches(3),
                               val_every=2, max_steps=8, **QUIET)

    t = make()
    t.fail_at = 4
    with pytest.raises(StepError, match=re.escape("validation at step 4 failed on batch 2 of val_data (training is "
                                                  "unchanged): RuntimeError: metric server unreachable")):
        t.fit()
    assert t.model.training and all(m.training for m in t.model.modules())
    assert t.state.step == 4 and not no_gradients(t)  # the update of step 4 stays, its gradients until step 5 begins
    t.fail_at = None
    t.fit()
    never_failed = make()
    never_failed.fit()
    assert differences(never_failed.model.state_dict(), t.model.state_dict()) == []
    assert differences(never_failed.optimizers["optimizer"].state_dict(),
                       t.optimizers["optimizer"].state_dict()) == []


class SaveFailsOnce(FlakyValidation):
    """``on_save_checkpoint`` fails at step ``save_fails_at`` (a full disk), after that step's validation ran."""

    save_fails_at: int | None = None

    def on_save_checkpoint(self, checkpoint):
        if self.state.step == self.save_fails_at:
            self.save_fails_at = None
            raise OSError(28, "No space left on device")


@pytest.mark.parametrize("failing", ["validation", "save"])
def test_a_fit_tried_again_first_does_what_the_failed_validation_or_save_left(tmp_path, failing):
    """The validation after step 4 fails (an OOM in a larger eval batch), or the save after it (a full disk). The
    fit tried again first does what was left of step 4: its validation, once, then the ReduceLROnPlateau monitoring
    it, then its checkpoint. Validations, the plateau's state and the checkpoints kept are the run's that never
    failed (imagenet/main.py validates and saves after each epoch, nanoGPT after each evaluation)."""
    def make(directory):
        torch.manual_seed(0)
        plateau = {"scheduler": lambda o: torch.optim.lr_scheduler.ReduceLROnPlateau(o, patience=0, factor=0.5),
                   "monitor": "val_loss"}
        return SaveFailsOnce(WithDropout(), batches(), lambda p: torch.optim.Adam(p, lr=0.01), val_data=batches(3),
                             val_every=2, max_steps=8, scheduler=plateau,
                             checkpoint={"dir": str(directory), "every": 2, "keep": 10}, **QUIET)

    t = make(tmp_path / "tried")
    t.fail_at, t.save_fails_at = (4, None) if failing == "validation" else (None, 4)
    with pytest.raises(StepError if failing == "validation" else OSError):
        t.fit()
    assert [step for step, _ in t.state.val_history] == ([0, 2] if failing == "validation" else [0, 2, 4])
    t.fit()
    never_failed = make(tmp_path / "never")
    never_failed.fit()
    assert [step for step, _ in t.state.val_history] == [step for step, _ in never_failed.state.val_history] == \
        [0, 2, 4, 6, 8]
    assert t.schedulers["optimizer"].state_dict() == never_failed.schedulers["optimizer"].state_dict()
    assert [p.name for p in Checkpointer(tmp_path / "tried").saved()] == \
        [p.name for p in Checkpointer(tmp_path / "never").saved()]
    assert differences(never_failed.model.state_dict(), t.model.state_dict()) == []


class ValidationEndFails(Trainer):
    """``on_validation_end`` raises once, at the validation after step ``fail_at``."""

    fail_at: int | None = None

    def on_validation_end(self, metrics):
        if self.state.step == self.fail_at:
            self.fail_at = None
            raise KeyError("val_acc")


def test_on_validation_end_failing_mid_fit_leaves_train_mode_and_the_random_streams_for_the_fit_tried_again():
    """Lightning's ``on_validation_epoch_end`` ported as ``on_validation_end(metrics)`` (docs/trainer.md), reading
    a metric the pass did not log: the user's own error comes out; the model is back in train mode and training's
    random streams are as the validation found them, so the fit tried again (dropout) trains as the run that never
    failed."""
    def make():
        torch.manual_seed(0)
        return ValidationEndFails(WithDropout(), batches(), lambda p: torch.optim.Adam(p, lr=0.01),
                                  val_data=batches(2), val_every=3, max_steps=8, **QUIET)

    t = make()
    t.fail_at = 3
    with pytest.raises(KeyError, match="val_acc"):
        t.fit()
    assert t.model.training and t.state.step == 3
    assert [step for step, _ in t.state.val_history] == [0, 3]
    t.fit()
    never_failed = make()
    never_failed.fit()
    assert differences(never_failed.model.state_dict(), t.model.state_dict()) == []
    assert [step for step, _ in t.state.val_history] == [step for step, _ in never_failed.state.val_history]


# -- checkpoints ---------------------------------------------------------------------------------------------------
def wider() -> nn.Module:
    return mlp(hidden=64)  # a checkpoint of about 75 KB: larger than the file-size limit below


class SaveHookFails(Trainer):
    fail_at: int | None = None

    def on_save_checkpoint(self, checkpoint):
        checkpoint["mine"] = {"step": torch.tensor(self.state.step)}
        if self.state.step == self.fail_at:
            raise OSError(28, "No space left on device", "/scratch/embeddings.npy")


def checkpointed(directory, cls=Trainer, **settings) -> Trainer:
    return cls(wider(), batches(), lambda p: torch.optim.Adam(p, lr=0.01), max_steps=8,
               checkpoint={"dir": str(directory), "every": 2, "keep": 2}, **{**QUIET, **settings})


def test_on_save_checkpoint_failing_leaves_the_older_checkpoints_intact_and_a_fit_tried_again_goes_on(tmp_path):
    """An ``on_save_checkpoint`` that writes a side file of its own (an embedding table, as a retrieval model's
    ``ModelCheckpoint`` hook does) and fails: nothing of that save is written, the older checkpoints are as they
    were and load, and the fit tried again goes on to the same weights as the run that never failed."""
    t = checkpointed(tmp_path / "ckpt", SaveHookFails)
    t.fail_at = 4
    with pytest.raises(OSError, match="No space left on device"):
        t.fit()
    directory = Checkpointer(tmp_path / "ckpt")
    assert [p.name for p in directory.saved()] == ["step-000000002.pt"]
    assert not list(directory.dir.glob(".step-*"))
    assert load(directory.saved()[0])["mine"]["step"] == 2
    t.fail_at = None
    t.fit()
    assert [p.name for p in directory.saved()] == ["step-000000006.pt", "step-000000008.pt"]
    never_failed = checkpointed(tmp_path / "other")
    never_failed.fit()
    assert differences(never_failed.model.state_dict(), t.model.state_dict()) == []
    assert differences(load(directory.saved()[-1])["modules"]["model"], t.model.state_dict()) == []


class FileSizeLimit(Callback):
    """``ulimit -f`` lowered by the job's environment while the run goes on (a quota, a scratch file system's
    largest file), after step ``at``: the next checkpoint is refused by the system (EFBIG)."""

    def __init__(self, at: int):
        self.at, self.limits = at, None

    def on_step_end(self, trainer, losses):
        if trainer.state.step == self.at:
            self.limits = resource.getrlimit(resource.RLIMIT_FSIZE)
            resource.setrlimit(resource.RLIMIT_FSIZE, (16 * 1024, self.limits[1]))

    def lift(self):
        if self.limits is not None:
            resource.setrlimit(resource.RLIMIT_FSIZE, self.limits)
            self.limits = None


def test_a_checkpoint_the_system_refuses_mid_run_is_named_and_the_fit_tried_again_saves_on(tmp_path):
    """A real write refused by the system mid-run (``RLIMIT_FSIZE``, as ``ulimit -f``): the ``CheckpointError``
    names the file, the cause and the fix; the older checkpoint is intact and loads; no temporary file is left.
    Once the limit is lifted, the fit tried again saves on and ends on the weights of the run that never failed."""
    limit = FileSizeLimit(at=4)
    t = checkpointed(tmp_path / "ckpt", callbacks=[limit])
    first = None
    xfsz = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # the write fails with EFBIG instead of killing the process
    try:
        with pytest.raises(CheckpointError, match=re.escape(f"checkpoint {tmp_path / 'ckpt' / 'step-000000004.pt'} "
                                                            "could not be saved: the file is larger than this process "
                                                            "may write")) as info:
            t.fit()
        first = (tmp_path / "ckpt" / "step-000000002.pt").read_bytes()
    finally:
        limit.lift()
        signal.signal(signal.SIGXFSZ, xfsz)
    assert "The checkpoints saved before it are intact" in str(info.value)
    directory = Checkpointer(tmp_path / "ckpt")
    assert [p.name for p in directory.saved()] == ["step-000000002.pt"]
    assert not list(directory.dir.glob(".step-*"))
    load(directory.saved()[0])
    assert t.state.step == 4
    t.callbacks.remove(limit)
    t.fit()
    assert [p.name for p in directory.saved()] == ["step-000000006.pt", "step-000000008.pt"]
    assert first is not None
    never_failed = checkpointed(tmp_path / "other")
    never_failed.fit()
    assert differences(everything(never_failed), everything(t)) == []


class LoadHookFails(Trainer):
    """The TBPTT recipe's ``on_load_checkpoint`` (``checkpoint["tbptt"]["hidden"]``) reading a checkpoint saved
    before that key existed; ``crash_at``: a node lost after that step (its ``on_step_end`` raises)."""

    fail_load = False
    crash_at: int | None = None

    def on_step_end(self, losses):
        if self.state.step == self.crash_at:
            raise RuntimeError("node lost")

    def on_load_checkpoint(self, checkpoint):
        if self.fail_load:
            self.fail_load = False
            raise KeyError("tbptt")


def logged_steps(run_dir) -> list[int]:
    with open(run_dir / "metrics.csv") as f:
        return [int(row["step"]) for row in csv.DictReader(f) if row["metric"] == "loss"]


def test_a_fit_tried_again_after_on_load_checkpoint_failed_logs_each_step_once(tmp_path):
    """docs/checkpoints.md: "An error [on_load_checkpoint] raises leaves the checkpoint loaded", and a resumed run
    leaves "every step's metric ... in there once, in order". The TBPTT recipe's hook fails on an older checkpoint;
    the user sets the hidden state by hand and calls ``fit()`` again."""
    def make(**settings):
        return LoadHookFails(mlp(), batches(), lambda p: torch.optim.Adam(p, lr=0.01), max_steps=8,
                             run_dir=str(tmp_path), checkpoint={"every": 4}, log_every=1, device="cpu",
                             progress=False, **settings)

    crashed = make()
    crashed.crash_at = 6
    with pytest.raises(StepError, match="node lost"):
        crashed.fit()
    assert logged_steps(tmp_path) == [1, 2, 3, 4, 5]  # step 5 logged, its checkpoint never written
    resumed = make(resume="auto")
    resumed.fail_load = True
    with pytest.raises(KeyError, match="tbptt"):
        resumed.fit()
    assert resumed.state.step == 4  # left loaded, as documented
    resumed.fit()
    assert logged_steps(tmp_path) == [1, 2, 3, 4, 5, 6, 7, 8]
