"""EarlyStopping against the hand-written patience loop Lightning's EarlyStopping is: real Trainers, real checkpoint
files, a validation metric scripted by step."""
import logging
import math
import os
import re
import signal

import pytest
import torch

from safeloop import Callback, ConfigError, EarlyStopping, StepError, Trainer

from .conftest import manual

VAL_EVERY = 2


class Scripted(Trainer):
    """Validation reports ``val_loss`` = ``values[i]`` at its i-th validation during training (step
    ``VAL_EVERY * (i + 1)``); the one before training reports 100."""

    def __init__(self, values, **kwargs):
        data = [(torch.randn(4, 2), torch.randn(4, 1)) for _ in range(3)]
        super().__init__(model=torch.nn.Linear(2, 1), train_data=data, val_data=data[:1], val_every=VAL_EVERY,
                         optimizer=lambda p: torch.optim.SGD(p, lr=0.01), progress=False, loggers=[], **kwargs)
        self.values, self.trained, self.ended = values, 0, False

    def validation_step(self, batch):
        step = self.state.step
        return torch.tensor(self.values[step // VAL_EVERY - 1] if step else 100.0)

    def on_step_end(self, losses):
        self.trained += 1

    def on_fit_end(self):
        self.ended = True


def hand_written(values, mode, patience, min_delta):
    """The usual patience loop: the validation (its index) after which it stops, the best value and its index."""
    best, at, wait = (math.inf if mode == "min" else -math.inf), None, 0
    for i, value in enumerate(values):
        if (value < best - min_delta) if mode == "min" else (value > best + min_delta):
            best, at, wait = value, i, 0
        else:
            wait += 1
        if wait >= patience:
            return i, best, at
    return None, best, at


SEQUENCES = [
    ([5, 4, 3, 3.5, 3.2, 3.1, 2, 1], "min", 3, 0.0),  # stops at the 6th validation: 3 without a new low
    ([5, 4, 3, 2.95, 2.91, 2.9, 1], "min", 3, 0.1),  # improvements smaller than min_delta do not count
    ([5, 4, 3, 2.95, 2.91, 2.9, 2.9, 2.95, 3], "min", 3, 0.0),  # ... and without min_delta they do
    ([1, 2, 2, 1.5, 3, 2, 2, 2, 2], "max", 2, 0.0),  # max: a tie is no improvement
    ([3, 3, 2, 1], "min", 1, 0.0),  # patience 1: the first validation that is not better
]


@pytest.mark.parametrize("values, mode, patience, min_delta", SEQUENCES)
def test_it_stops_at_the_validation_the_hand_written_patience_loop_stops_at(tmp_path, caplog, values, mode, patience,
                                                                            min_delta):
    stop, best, at = hand_written(values, mode, patience, min_delta)
    trainer = Scripted(values, max_steps=VAL_EVERY * (len(values) + 3), run_dir=tmp_path,
                       callbacks=[EarlyStopping("val_loss", mode, patience, min_delta)])
    with caplog.at_level(logging.INFO, logger="safeloop"):
        trainer.fit()
    assert stop is not None and trainer.state.step == VAL_EVERY * (stop + 1) == trainer.trained
    assert trainer.ended  # a clean end: on_fit_end, and no validation after the one that decided it
    assert [s for s, _ in trainer.state.val_history] == [VAL_EVERY * i for i in range(stop + 2)]
    assert trainer.checkpointer.last.name == f"step-{trainer.state.step:09d}.pt" and trainer.checkpointer.last.exists()
    assert (f"early stopping: val_loss did not improve by more than {min_delta:g} over the last {patience} "
            f"validations (best {best:.4g} at step {VAL_EVERY * (at + 1)}): stopping after step {trainer.state.step}"
            in caplog.text)


def test_the_first_sequence_stops_at_step_12():
    assert hand_written(*SEQUENCES[0]) == (5, 3, 2)  # the 6th validation, step 12; the best 3 at step 6


def test_a_resumed_run_counts_on_exactly_and_one_resumed_after_the_stop_trains_nothing(tmp_path):
    values = [5, 4, 3, 3.5, 3.2, 3.1, 2, 1] + [1] * 10  # stops after step 12
    ckpt = {"dir": str(tmp_path / "ckpt"), "every": 2}
    first = Scripted(values, max_steps=8, checkpoint=ckpt, callbacks=[EarlyStopping(patience=3)])
    first.fit()  # stopped by max_steps one validation after the best (step 6)
    assert first.state.step == 8 and first.callbacks[0].wait == 1
    resumed = Scripted(values, max_steps=40, checkpoint=ckpt, resume="auto", callbacks=[EarlyStopping(patience=3)])
    resumed.fit()
    assert resumed.state.step == 12 and resumed.trained == 4  # as the run that never stopped
    stopper = resumed.callbacks[0]
    assert (stopper.best, stopper.best_step, stopper.wait) == (3, 6, 3)
    again = Scripted(values, max_steps=40, checkpoint=ckpt, resume="auto", callbacks=[EarlyStopping(patience=3)])
    again.fit()
    assert again.state.step == 12 and again.trained == 0 and again.ended
    assert sorted(p.name for p in (tmp_path / "ckpt").glob("*.pt"))[-1] == "step-000000012.pt"
    patient = Scripted(values, max_steps=40, checkpoint=ckpt, resume="auto", callbacks=[EarlyStopping(patience=5)])
    patient.fit()  # a larger patience trains on, counting from the saved state: 2 then 1 are new bests
    assert patient.state.step == 26


def test_a_later_fit_after_an_early_stop_trains_nothing_unless_the_patience_is_raised():
    """docs/trainer.md, Early stopping: the patience is spent, so a later ``fit()`` of the same Trainer, with more
    steps, trains nothing, as a run resumed after the stop (Lightning's trains to its next validation); once the
    callback's patience is raised it trains on, counting from where it stood."""
    values = [5, 4, 3, 3.5, 3.2, 3.1, 2, 1] + [1] * 10
    trainer = Scripted(values, max_steps=40, callbacks=[EarlyStopping(patience=3)])
    trainer.fit()
    assert trainer.state.step == 12 and trainer.trained == 12
    trainer.ended = False
    trainer.fit()
    assert trainer.state.step == 12 and trainer.trained == 12 and trainer.ended  # a clean end, no step
    trainer.callbacks[0].patience = 5
    trainer.fit()  # 2 then 1 are new bests (steps 14, 16), then five validations without improvement
    assert trainer.state.step == 26 and trainer.trained == 26


class Stops(Callback):
    def on_step_end(self, trainer, losses):
        if trainer.state.step == 3:
            trainer.request_stop("enough")


def test_a_stop_asked_for_lasts_one_fit(tmp_path):
    trainer = Scripted([1] * 20, max_steps=10, callbacks=[Stops()])
    trainer.fit()
    assert trainer.state.step == 3
    trainer.fit()  # asked for again at no step of this fit: it trains on
    assert trainer.state.step == 10


@pytest.mark.parametrize("mode", ["automatic", "manual"])
@pytest.mark.parametrize("hook", ["on_epoch_end", "on_epoch_start"])
@pytest.mark.parametrize("last", [False, True], ids=["mid-run", "at-max_steps"])
def test_a_stop_asked_at_a_passs_edge_trains_no_step_of_the_next_pass_and_the_next_fit_begins_it(tmp_path, hook,
                                                                                                   last, mode):
    """Passes of 4 batches; the hook asks to stop at the end of pass 0 (or as pass 1 begins), as Lightning's Timer
    callback does: the run ends after step 4, with its checkpoint, as Lightning's. The next fit trains pass 1 from its
    first batch. ``last``: the fit's max_steps ends it at that very step too."""
    seen = []

    class EdgeStop(Trainer):
        def training_step(self, batch):
            seen.append(float(batch[0][0, 0]))
            return super().training_step(batch)

    def ask(trainer):
        if trainer.state.epoch == (0 if hook == "on_epoch_end" else 1) and trainer.max_steps != 8:
            trainer.request_stop("the time is up")

    data = [(torch.full((2, 2), float(i)), torch.ones(2, 1)) for i in range(4)]
    cls = manual(EdgeStop) if mode == "manual" else EdgeStop
    trainer = cls(model=torch.nn.Linear(2, 1), train_data=data, max_steps=4 if last else 10, device="cpu",
                  optimizer=lambda p: torch.optim.SGD(p, lr=0.1), progress=False, loggers=(),
                  checkpoint={"dir": str(tmp_path), "every": 100})
    setattr(trainer, hook, lambda: ask(trainer))
    trainer.fit()
    assert (trainer.state.step, seen) == (4, [0, 1, 2, 3])
    assert [p.name for p in tmp_path.glob("step-*.pt")] == ["step-000000004.pt"]
    trainer.max_steps = 8
    trainer.fit()
    assert (trainer.state.step, trainer.state.epoch, seen[4:]) == (8, 2, [0, 1, 2, 3])  # pass 1 ended with the fit


def test_early_stopping_on_a_validation_run_by_on_epoch_end_stops_before_the_next_pass():
    """``validate()`` called in ``on_epoch_end`` counts for EarlyStopping (docs): its stop is taken there, so the run
    trains no batch of the next pass (nor validates after one). Passes of 3 batches; val_loss 5 before training,
    then 4, 6, 7: patience 2 is spent at the end of pass 2."""
    class EpochValidation(Trainer):
        def validation_step(self, batch):
            return torch.tensor([5.0, 4.0, 6.0, 7.0, 1.0, 1.0][len(self.state.val_history)])

        def on_epoch_end(self):
            self.validate()

    data = [(torch.randn(4, 2), torch.randn(4, 1)) for _ in range(3)]
    trainer = EpochValidation(model=torch.nn.Linear(2, 1), train_data=data, val_data=data[:1], val_every=100,
                              max_steps=20, callbacks=[EarlyStopping(patience=2)], progress=False, loggers=(),
                              optimizer=lambda p: torch.optim.SGD(p, lr=0.01), device="cpu")
    trainer.fit()
    assert [step for step, _ in trainer.state.val_history] == [0, 3, 6, 9]
    assert trainer.state.step == 9


def test_a_monitored_name_no_validation_reports_is_an_error_at_the_first_validation():
    trainer = Scripted([1, 2], max_steps=10, callbacks=[EarlyStopping(monitor="val_acc")])
    with pytest.raises(ConfigError, match=re.escape("EarlyStopping monitors 'val_acc', which validation does not "
                                                    "report: it reports val_loss; give monitor=<one of those>")):
        trainer.fit()
    assert trainer.trained == 0


class AddsScore(Callback):
    """A metric of the whole pass added in ``on_validation_end``, as docs/trainer.md says (an F1, here 1 - loss)."""

    def on_validation_end(self, trainer, metrics):
        metrics["val_score"] = 1.0 - metrics["val_loss"]


def test_a_metric_a_callback_adds_reaches_the_early_stopping_listed_after_it_and_the_message_says_so():
    before = Scripted([5, 4, 4, 4], max_steps=10, callbacks=[EarlyStopping("val_score", "max", 2), AddsScore()])
    with pytest.raises(ConfigError, match=re.escape("(a metric a callback adds in on_validation_end reaches the "
                                                    "callbacks listed after it: list that one first)")):
        before.fit()
    after = Scripted([5, 4, 4, 4], max_steps=10, callbacks=[AddsScore(), EarlyStopping("val_score", "min", 2)])
    after.fit()
    assert after.state.step == 6  # val_score -4 (step 2), -3, -3: no new low twice: stopped after step 6


@pytest.mark.parametrize("settings, why", [(dict(val_data=None), "no val_data"),
                                           (dict(val_every=None), "val_every is not set: only at its end")])
def test_early_stopping_without_validations_during_training_is_refused_before_the_first_step(settings, why):
    trainer = Scripted([1, 2], max_steps=10, callbacks=[EarlyStopping()])
    for key, value in settings.items():
        setattr(trainer, key, value)
    with pytest.raises(ConfigError, match=re.escape(
            f"EarlyStopping monitors 'val_loss', but no validation runs during training ({why}), so it would never "
            "stop the run: pass val_data=... and val_every=N")):
        trainer.fit()
    assert trainer.trained == 0


def test_validations_outside_fit_do_not_count():
    """Lightning's count: trainer.validate() of your own, before or between fits, changes nothing."""
    stopper = EarlyStopping(patience=2)
    trainer = Scripted([5, 4, 6, 7, 1], max_steps=4, callbacks=[stopper])
    trainer.fit()  # validations at steps 2 (5) and 4 (4): the best is 4, nothing waits
    for _ in range(3):  # at step 4, values[1] = 4: no improvement, three times over
        trainer.validate()
    assert (stopper.best, stopper.wait) == (4, 0)
    trainer.max_steps = 10
    trainer.fit()  # 6 and 7 at steps 6 and 8: patience 2 reached, the run stops at step 8
    assert trainer.state.step == 8 and stopper.wait == 2


@pytest.mark.parametrize("how", ["SIGTERM", "an error"])
def test_validations_after_a_fit_stopped_by_a_signal_or_an_error_do_not_count(how):
    """docs/trainer.md: a ``trainer.validate()`` outside ``fit()`` does not count. A fit stopped by SIGTERM/SIGINT
    (Ctrl-C in a notebook) or by an error calls no ``on_fit_end``: a look at the metrics after it, then ``fit()``
    again, counts as the run that never stopped (it counted them, and trained nothing more, before)."""
    stopper = EarlyStopping(patience=2)
    trainer = Scripted([5, 4, 6, 7, 1], max_steps=10, callbacks=[stopper])
    stop = Callback()
    if how == "SIGTERM":
        stop.on_step_end = lambda trainer, losses: trainer.state.step == 3 and os.kill(os.getpid(), signal.SIGTERM)
    else:
        def fail(trainer):
            if trainer.state.step == 2 and not stop.failed:
                stop.failed = True
                raise RuntimeError("out of memory")
        stop.failed, stop.on_step_start = False, fail
    trainer.callbacks.append(stop)
    if how == "SIGTERM":
        trainer.fit()
    else:
        with pytest.raises(StepError):
            trainer.fit()
    assert trainer.state.step in (2, 3) and (stopper.best, stopper.wait) == (5, 0)
    for _ in range(3):  # values[0] = 5 again at steps 2 and 3: no improvement, three times over
        trainer.validate()
    assert (stopper.best, stopper.wait) == (5, 0)
    trainer.fit()  # 4 at step 4, then 6 and 7 at steps 6 and 8: patience 2 reached, the run stops at step 8
    assert trainer.state.step == 8 and (stopper.best, stopper.best_step, stopper.wait) == (4, 4, 2)


def test_two_early_stoppings_on_one_metric_are_refused_before_the_first_step():
    """Checkpoints keep EarlyStopping's state by its metric: the second's would overwrite the first's, and a resumed
    run count both from it (Lightning refuses two of the same monitor and mode)."""
    trainer = Scripted([5, 4, 3], max_steps=6, callbacks=[EarlyStopping(patience=3), EarlyStopping(patience=10,
                                                                                                    min_delta=0.1)])
    with pytest.raises(ConfigError, match=re.escape("two EarlyStopping callbacks monitor 'val_loss': checkpoints keep "
                                                    "one state per monitored metric")):
        trainer.fit()
    assert trainer.trained == 0


def test_should_stop_kept_from_a_lightning_port_stops_after_that_step():
    class Stopper(Callback):
        def on_step_end(self, trainer, losses):
            if trainer.state.step == 3:
                trainer.should_stop = True  # Lightning's way

    trainer = Scripted([5, 4, 3, 2, 1], max_steps=10, callbacks=[Stopper()])
    trainer.fit()
    assert trainer.state.step == 3 and trainer.ended


def test_bad_arguments_are_one_config_error():
    with pytest.raises(ConfigError, match=r"(?s)EarlyStopping\(mode='mini'\): give min or max.*"
                                          r"EarlyStopping\(patience=0\): give a positive integer.*"
                                          r"EarlyStopping\(min_delta=-1\): give a number >= 0"):
        EarlyStopping(mode="mini", patience=0, min_delta=-1)
    # Lightning's positional EarlyStopping("val_loss", 0.01, 5): its min_delta would be taken for the mode
    with pytest.raises(ConfigError, match=re.escape(
            "EarlyStopping(mode=0.01): give min or max (Lightning's EarlyStopping takes min_delta second, then "
            "patience; safeloop's order is monitor, mode, patience, min_delta: give them by name)")):
        EarlyStopping("val_loss", 0.01, 5)


def test_lightnings_hook_names_on_a_trainer_or_a_callback_are_a_config_error_naming_safeloops():
    """A port keeping Lightning's names would define hooks that are never called, without a word."""
    class Port(Trainer):
        def on_train_epoch_end(self):
            self.ended = True

        def optimizer_step(self, *args, **kwargs):  # a warm-up, as Lightning's docs write one
            pass

        def training_step(self, batch, batch_idx):
            return super().training_step(batch)

        def on_after_batch_transfer(self, batch, dataloader_idx):  # a transform on the device
            return batch

        def train_dataloader(self):  # new data each pass (reload_dataloaders_every_n_epochs)
            return []

    class Counting(Callback):
        def on_train_batch_end(self, trainer, *args):
            pass

        def state_dict(self):
            return {}

    trainer = Port(model=torch.nn.Linear(2, 1), train_data=[(torch.ones(2, 2), torch.ones(2, 1))], max_steps=1,
                   optimizer=lambda p: torch.optim.SGD(p, lr=0.1), callbacks=[Counting()], device="cpu",
                   progress=False, loggers=())
    trainer.automatic_optimization = False  # set in __init__, as Lightning's GAN example does
    with pytest.raises(ConfigError) as caught:
        trainer.fit()
    assert str(caught.value).splitlines()[1:] == [
        "  - Port.on_train_epoch_end is Lightning's name, which safeloop never calls: use on_epoch_end",
        "  - Port.optimizer_step is Lightning's name, which safeloop never calls: the Trainer makes each update; a "
        "warm-up is a scheduler (LambdaLR, interval: step), and gradients are changed in on_before_optimizer_step",
        "  - Port.on_after_batch_transfer is Lightning's name, which safeloop never calls: change the batch in "
        "training_step (or override to_device(batch))",
        "  - Port.train_dataloader is Lightning's name, which safeloop never calls: pass train_data=... (new data each "
        "pass: set self.train_data in on_epoch_start)",
        "  - Port.automatic_optimization is Lightning's name, which safeloop never calls: manual mode is automatic = "
        "False, a class attribute (automatic mode is the default)",
        "  - Port.training_step takes (batch, batch_idx), and safeloop calls training_step(batch): drop batch_idx "
        "(Lightning's batch_idx: self.state.batch_in_epoch counts the batches of the pass)",
        "  - Counting.on_train_batch_end is Lightning's name, which safeloop never calls: use on_step_end(losses)",
        "  - Counting.state_dict is Lightning's name, which safeloop never calls: keep a callback's state with "
        "on_save_checkpoint(checkpoint) and on_load_checkpoint(checkpoint)"]
    assert trainer.state.step == 0


def test_a_hook_that_cannot_take_safeloops_arguments_is_a_config_error_at_start_up_naming_its_signature(tmp_path):
    """Lightning's signatures kept on a port (``on_after_backward(self)``, ``on_before_optimizer_step(self,
    optimizer)``, a callback's ``on_fit_start(self, trainer, pl_module)``), or a function set on the instance that
    takes nothing: refused before the validation that precedes training, each with the signature to write."""
    class Port(Trainer):
        def on_after_backward(self):
            """Lightning's signature: safeloop calls on_after_backward(name)."""

        def on_before_optimizer_step(self, optimizer):
            """Lightning's signature: safeloop calls on_before_optimizer_step(name, optimizer)."""

        def on_validation_end(self, metrics, *more):
            """Takes what safeloop gives: fine."""

    class Lightningish(Callback):
        def on_fit_start(self, trainer, pl_module):
            """Lightning's callback signature: safeloop calls on_fit_start(trainer)."""

    data = [(torch.ones(2, 2), torch.ones(2, 1))]
    trainer = Port(model=torch.nn.Linear(2, 1), train_data=data, val_data=data, max_steps=1, callbacks=[Lightningish()],
                   optimizer=lambda p: torch.optim.SGD(p, lr=0.1), device="cpu", progress=False, loggers=(),
                   checkpoint={"dir": str(tmp_path)})
    trainer.on_step_end = lambda: None
    with pytest.raises(ConfigError) as caught:
        trainer.fit()
    assert str(caught.value).splitlines()[1:] == [
        "  - Port.on_after_backward takes (), and safeloop calls on_after_backward(name): write it as "
        "def on_after_backward(self, name)",
        "  - Port.on_before_optimizer_step takes (optimizer), and safeloop calls on_before_optimizer_step(name, "
        "optimizer): write it as def on_before_optimizer_step(self, name, optimizer)",
        "  - Port.on_step_end takes (), and safeloop calls on_step_end(losses): write it as a function of (losses)",
        "  - Lightningish.on_fit_start takes (trainer, pl_module), and safeloop calls on_fit_start(trainer): write it "
        "as def on_fit_start(self, trainer)"]
    assert trainer.state.step == 0 and trainer.state.val_history == [] and not list(tmp_path.iterdir())


@pytest.mark.parametrize("reads, message", [
    (lambda self: self.current_epoch, "'Reads' object has no attribute 'current_epoch': that is Lightning's; here: "
                                      "self.state.epoch"),
    (lambda self: self.trainer.global_step, "'Reads' object has no attribute 'trainer': that is Lightning's; here: the "
                                            "Trainer is self: self.state.epoch, self.state.step"),
    (lambda self: self.toggle_optimizer(None), "'toggle_optimizer': that is Lightning's; here: drop it: "
                                               "self.backward(loss, optimizer=name) reaches only"),
    (lambda self: self.optimizers(), "TypeError: 'dict' object is not callable. If it is self.optimizers() or "
                                     "self.lr_schedulers() (Lightning's): self.optimizers and self.schedulers are "
                                     "dicts by optimizer name here, self.optimizers['name']"),
    (lambda self: self.no_such_thing, "AttributeError: 'Reads' object has no attribute 'no_such_thing'$"),
])
def test_a_lightning_attribute_a_port_reads_in_its_step_names_safeloops_way(reads, message):
    class Reads(Trainer):
        def training_step(self, batch):
            reads(self)

    trainer = Reads(model=torch.nn.Linear(2, 1), train_data=[(torch.ones(2, 2), torch.ones(2, 1))], max_steps=1,
                    optimizer=lambda p: torch.optim.SGD(p, lr=0.1), device="cpu", progress=False, loggers=())
    with pytest.raises(StepError, match=re.escape(message.rstrip("$")) + "$" * message.endswith("$")):
        trainer.fit()
    assert trainer.state.step == 0
    with pytest.raises(AttributeError, match=re.escape("'Reads' object has no attribute 'hparams': that is "
                                                       "Lightning's; here: keep settings as attributes")):
        trainer.hparams.lr
    assert not hasattr(trainer, "global_step") and getattr(trainer, "hparams", None) is None


def test_lightnings_setup_and_backward_hooks_are_refused_where_they_would_replace_the_trainers_own():
    """Lightning's ``setup(stage)`` and an automatic-mode ``backward(loss)`` hook share a name with the Trainer's
    own methods: kept from a port, the first would replace the Trainer's set-up, the second never be called. Both
    are refused when the Trainer is made; a ``setup()`` that extends the Trainer's, and manual mode's ``backward``
    overridden, are not."""
    kwargs = dict(model=torch.nn.Linear(2, 1), train_data=[(torch.ones(2, 2), torch.ones(2, 1))], max_steps=1,
                  optimizer=lambda p: torch.optim.SGD(p, lr=0.1), device="cpu", progress=False, loggers=())

    class Port(Trainer):
        def setup(self, stage):
            pass

        def backward(self, loss, *args, **kwargs):
            loss.backward()

    with pytest.raises(ConfigError) as caught:
        Port(**kwargs)
    assert [line.split(":")[0] for line in str(caught.value).splitlines()[1:]] == [
        "  - Port.setup overrides the Trainer's own setup", "  - Port.backward overrides the Trainer's own backward"]

    class Extending(Trainer):
        automatic = False

        def setup(self):
            super().setup()
            self.made = True

        def backward(self, loss, optimizer=None, retain_graph=False, create_graph=False):
            super().backward(loss * 2, optimizer, retain_graph, create_graph)

        def training_step(self, batch):
            self.backward(super().training_step(batch))
            self.step()

    trainer = Extending(**kwargs)
    trainer.fit()
    assert trainer.made and trainer.state.step == 1


def test_a_callbacks_on_exception_is_a_config_error_saying_that_fit_raises():
    """Lightning calls a callback's ``on_exception`` when fit fails; safeloop never would: said before any step."""
    class Alerting(Callback):
        def on_exception(self, trainer, pl_module, exception):
            """Lightning's signature; a port would send an alert here."""

    trainer = Trainer(model=torch.nn.Linear(2, 1), train_data=[(torch.ones(2, 2), torch.ones(2, 1))], max_steps=1,
                      optimizer=lambda p: torch.optim.SGD(p, lr=0.1), callbacks=[Alerting()], device="cpu",
                      progress=False, loggers=())
    with pytest.raises(ConfigError, match=re.escape(
            "Alerting.on_exception is Lightning's name, which safeloop never calls: a failed fit() raises its error, "
            "after the step is undone and the run's files closed: catch it around trainer.fit()")):
        trainer.fit()
    assert trainer.state.step == 0
