"""Learning-rate schedules: per step, per epoch, on a validation metric; learning rates in the logs."""
import csv
import re
from functools import partial

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from safeloop import ConfigError, StepError, Trainer
from safeloop.config import build, compose
from safeloop.models import MLP


def data(n=64, batch=16):
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(n, 8, generator=gen)
    return DataLoader(TensorDataset(x, x.sum(1, keepdim=True).sin()), batch_size=batch)


def logged(run_dir, prefix="lr"):
    """``{metric: [values by step]}`` of the metrics starting with ``prefix`` in ``metrics.csv``."""
    out = {}
    with open(run_dir / "metrics.csv") as f:
        for row in csv.DictReader(f):
            if row["metric"].startswith(prefix):
                out.setdefault(row["metric"], []).append(float(row["value"]))
    return out


def halving(interval=None):
    step_lr = partial(torch.optim.lr_scheduler.StepLR, step_size=1, gamma=0.5)
    return step_lr if interval is None else {"scheduler": step_lr, "interval": interval}


@pytest.mark.parametrize("interval", [None, "step", "epoch"])
def test_a_scheduler_steps_after_every_update_or_once_an_epoch_and_its_rate_is_logged(tmp_path, interval):
    trainer = Trainer(model=MLP(8, 16, 1, 2), train_data=data(), optimizer=lambda p: torch.optim.SGD(p, lr=1.0),
                      scheduler=halving(interval), max_epochs=3, log_every=1, device="cpu", progress=False,
                      run_dir=tmp_path, checkpoint=False)
    trainer.fit()
    lrs = logged(tmp_path)["lr"]  # 4 batches an epoch; logged after each step, with its losses: the rate it used
    if interval == "epoch":
        assert lrs == [1.0] * 4 + [0.5] * 4 + [0.25] * 4
    else:
        assert lrs == pytest.approx([0.5 ** k for k in range(12)], rel=1e-5)  # written with 6 digits
    assert trainer.optimizers["optimizer"].param_groups[0]["lr"] == (0.125 if interval == "epoch" else 0.5 ** 12)


def test_reduce_on_plateau_steps_on_the_named_validation_metric_in_lightnings_dict_form(tmp_path):
    class Plateau(Trainer):
        def configure_optimizers(self):
            opt = torch.optim.SGD(self.model.parameters(), lr=1.0)
            plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, factor=0.5, patience=0)
            return {"optimizer": opt, "lr_scheduler": {"scheduler": plateau, "monitor": "val_loss"}}

        def validation_step(self, batch):
            return torch.tensor(1.0)  # never improves

    trainer = Plateau(model=MLP(8, 16, 1, 2), train_data=data(), val_data=data(), max_steps=6, val_every=2,
                      log_every=1, device="cpu", progress=False, run_dir=tmp_path, checkpoint=False)
    trainer.fit()
    # validations at steps 2, 4, 6 (the one before training is not a plateau step): best, worse, worse
    assert logged(tmp_path)["lr"] == [1.0] * 4 + [0.5] * 2
    assert trainer.optimizers["optimizer"].param_groups[0]["lr"] == 0.25


def plateau_over(model):
    opt = torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9)
    return opt, torch.optim.lr_scheduler.ReduceLROnPlateau(opt, factor=0.5, patience=0)


def growing(epoch):
    """Passes of 2, 3, 4... batches (a curriculum): no val_every is one pass's steps."""
    return data(n=32 + 16 * epoch)


def test_a_plateau_steps_after_a_validation_a_hook_runs_as_the_hand_written_loop_steps_it():
    """Passes of changing length validated in ``on_epoch_end`` (Lightning's validation at each epoch's end, its
    ``reload_dataloaders_every_n_epochs``), ``val_every`` out of reach: a ``ReduceLROnPlateau`` monitoring ``val_loss``
    steps after each of those validations, as EarlyStopping counts them, and the run is the hand-written loop's that
    validates after each pass and steps its plateau on the result: each pass's rate, the parameters, bit for bit."""
    val = data(n=24, batch=8)

    def by_hand():
        torch.manual_seed(0)
        model = MLP(8, 16, 1, 2)
        opt, plateau = plateau_over(model)
        rates = []
        for epoch in range(5):
            rates.append(opt.param_groups[0]["lr"])
            for x, y in growing(epoch):
                opt.zero_grad()
                torch.nn.functional.mse_loss(model(x), y).backward()
                opt.step()
            with torch.no_grad():
                losses = [(torch.nn.functional.mse_loss(model(x), y).item(), len(x)) for x, y in val]
            plateau.step(sum(v * n for v, n in losses) / sum(n for _, n in losses))
        return model, rates

    class Curriculum(Trainer):
        def configure_optimizers(self):
            opt, plateau = plateau_over(self.model)
            return {"optimizer": opt, "lr_scheduler": {"scheduler": plateau, "monitor": "val_loss"}}

        def on_epoch_start(self):
            self.train_data = growing(self.state.epoch)
            self.rates.append(self.optimizers["optimizer"].param_groups[0]["lr"])

        def on_epoch_end(self):
            self.validate()

    model, rates = by_hand()
    torch.manual_seed(0)
    trainer = Curriculum(model=MLP(8, 16, 1, 2), train_data=growing(0), val_data=val, max_epochs=5, val_every=1000,
                         device="cpu", progress=False, loggers=())
    trainer.rates = []
    trainer.fit()
    assert trainer.rates == rates and len(set(rates)) > 2
    assert all(torch.equal(a, b) for a, b in zip(trainer.model.state_dict().values(), model.state_dict().values()))


def test_lightnings_frequency_1_is_taken_and_another_frequency_refused_saying_what_to_do():
    """``"frequency": 1`` is Lightning's default, which lightning-hydra-template's configure_optimizers writes out."""
    def run(frequency):
        class Dict(Trainer):
            def configure_optimizers(self):
                opt = torch.optim.SGD(self.model.parameters(), lr=1.0)
                return {"optimizer": opt, "lr_scheduler": {"scheduler": torch.optim.lr_scheduler.StepLR(opt, 1, 0.5),
                                                           "interval": "step", "frequency": frequency}}

        trainer = Dict(model=MLP(8, 16, 1, 2), train_data=data(), max_steps=3, device="cpu", progress=False,
                       loggers=())
        trainer.fit()
        return trainer.optimizers["optimizer"].param_groups[0]["lr"]

    assert run(1) == 0.125
    with pytest.raises(ConfigError, match=re.escape("Lightning's 'frequency' other than 1 is not supported: step it "
                                                    "yourself in a hook")):
        run(2)


def test_each_optimizers_rate_is_logged_by_name(tmp_path):
    class TwoOptimizers(Trainer):
        def configure_optimizers(self):
            layers = list(self.model.children())
            return {"first": {"optimizer": torch.optim.SGD(layers[0].parameters(), lr=0.1)},
                    "rest": torch.optim.SGD([{"params": layers[1].parameters()}, {"params": layers[2:][-1].parameters(),
                                                                                   "lr": 0.01}], lr=0.1)}

        def training_step(self, batch):
            x, y = batch
            return {"first": torch.nn.functional.mse_loss(self.model(x), y),
                    "rest": torch.nn.functional.mse_loss(self.model(x), y)}

    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    TwoOptimizers(model=model, train_data=data(), max_steps=2, log_every=2, device="cpu", progress=False,
                  run_dir=tmp_path, checkpoint=False).fit()
    assert logged(tmp_path) == {"lr_first": [0.1], "lr_rest_0": [0.1], "lr_rest_1": [0.01]}


def test_a_scheduler_dict_from_the_command_line_steps_once_an_epoch(tmp_path):
    cfg = compose(["trainer.max_steps=9", "trainer.val_every=null", "data.n_train=256", "data.batch_size=64",
                   "scheduler={scheduler:{_target_:torch.optim.lr_scheduler.StepLR,_partial_:true,step_size:1,"
                   "gamma:0.5},interval:epoch}", "optimizer.lr=1.0", "trainer.progress=false", "device=cpu",
                   f"+run_dir={tmp_path}"])
    trainer = build(cfg)
    trainer.fit()  # 4 batches an epoch: two ended, two scheduler steps
    assert trainer.optimizers["optimizer"].param_groups[0]["lr"] == 0.25


class Cycle:
    """A schedule written by hand with only step(), as some repositories have (no state_dict to save)."""

    def __init__(self):
        self.steps = 0

    def step(self):
        self.steps += 1


@pytest.mark.parametrize("given, problem", [
    ({"scheduler": halving(), "interval": "batch"}, "the scheduler of optimizer 'optimizer': interval='batch' is not "
                                                    "one of step, epoch"),
    (partial(torch.optim.lr_scheduler.ReduceLROnPlateau), "the scheduler of optimizer 'optimizer' is "
                                                          "ReduceLROnPlateau, which steps on a metric: give "
                                                          "{'scheduler': ..., 'monitor': 'val_loss'}"),
    ({"scheduler": halving(), "monitor": "val_loss"}, "the scheduler of optimizer 'optimizer' monitors 'val_loss', "
                                                      "a validation metric, and there is no val_data"),
    ({"scheduler": halving(), "every": 2}, "the scheduler of optimizer 'optimizer' is a dict with keys ['every', "
                                           "'scheduler']: give 'scheduler' and optionally 'interval'"),
    (lambda opt: Cycle(), "the scheduler of optimizer 'optimizer' is a Cycle without state_dict() or "
                          "load_state_dict(): the Trainer steps a scheduler with step() and saves and restores it"),
    (lambda opt: 0.5, "the scheduler of optimizer 'optimizer' is a float without step() or state_dict() or "
                      "load_state_dict()"),
], ids=["interval", "plateau-without-monitor", "monitor-without-val_data", "unknown-key", "no-state_dict", "number"])
def test_a_scheduler_that_cannot_run_as_given_is_named_at_start(given, problem):
    trainer = Trainer(model=MLP(8, 16, 1, 2), train_data=data(), optimizer=lambda p: torch.optim.SGD(p, lr=1.0),
                      scheduler=given, max_steps=2, device="cpu", progress=False, loggers=())
    with pytest.raises(ConfigError, match=re.escape(problem)):
        trainer.fit()


def test_a_monitor_that_validation_does_not_report_is_named():
    class Plateau(Trainer):
        def configure_optimizers(self):
            opt = torch.optim.SGD(self.model.parameters(), lr=1.0)
            return {"optimizer": opt, "lr_scheduler": {
                "scheduler": torch.optim.lr_scheduler.ReduceLROnPlateau(opt), "monitor": "val_acc"}}

    trainer = Plateau(model=MLP(8, 16, 1, 2), train_data=data(), val_data=data(), max_steps=4, val_every=2,
                      device="cpu", progress=False, loggers=())
    with pytest.raises(ConfigError, match=re.escape("the scheduler of optimizer 'optimizer' monitors 'val_acc', "
                                                    "which validation does not report: it reports val_loss")):
        trainer.fit()
    assert trainer.state.step == 0  # found at the validation before training


class Lightning(Trainer):
    """``configure_optimizers`` in Lightning's form, with a halving StepLR given as ``lr_scheduler``."""

    def configure_optimizers(self):
        opt = torch.optim.SGD(self.model.parameters(), lr=1.0)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
        return {"optimizer": opt, "lr_scheduler": sched if self.form == "alone" else {"scheduler": sched}}


@pytest.mark.parametrize("form", ["alone", "dict"])
def test_lightnings_form_without_an_interval_steps_once_an_epoch_as_in_lightning(tmp_path, form):
    trainer = Lightning(model=MLP(8, 16, 1, 2), train_data=data(), max_epochs=2, log_every=1, device="cpu",
                        progress=False, run_dir=tmp_path, checkpoint=False)
    trainer.form = form
    trainer.fit()
    assert logged(tmp_path)["lr"] == [1.0] * 4 + [0.5] * 4  # Lightning's LRSchedulerConfig.interval is "epoch"


def test_a_monitor_on_a_scheduler_that_steps_without_a_metric_is_a_config_error():
    """StepLR.step(val_loss) would read the loss as an epoch number (the rate stuck, one deprecation warning)."""
    trainer = Trainer(model=MLP(8, 16, 1, 2), train_data=data(), val_data=data(), val_every=2,
                      optimizer=lambda p: torch.optim.SGD(p, lr=1.0), max_steps=4, device="cpu", progress=False,
                      loggers=(), scheduler={"scheduler": halving(), "monitor": "val_loss", "interval": "step"})
    with pytest.raises(ConfigError, match=re.escape(
            "the scheduler of optimizer 'optimizer' (StepLR) monitors 'val_loss', and its step() takes no metric (it "
            "would read the value as an epoch number): 'monitor' is for a scheduler that steps on a metric, such as "
            "ReduceLROnPlateau. Drop it, and give 'interval'")):
        trainer.fit()
    assert trainer.state.step == 0


class SteppedByHand(Trainer):
    """A port of Lightning's manual optimization, which steps its scheduler itself (``sch.step()``)."""

    automatic = False

    def configure_optimizers(self):
        opt = torch.optim.SGD(self.model.parameters(), lr=1.0)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": torch.optim.lr_scheduler.StepLR(opt, 1, 0.5),
                                                   "interval": self.interval}}

    def training_step(self, batch):
        x, y = batch
        self.backward(torch.nn.functional.mse_loss(self.model(x), y))
        self.step()
        if self.state.step + 1 == 2:  # the second step, after its update, as `if self.trainer.is_last_batch:`
            self.schedulers["optimizer"].step()


@pytest.mark.parametrize("interval", ["step", "epoch"])
def test_a_scheduler_the_trainer_steps_and_the_users_code_steps_too_stops_the_run_before_it_moves_twice(interval):
    trainer = SteppedByHand(model=MLP(8, 16, 1, 2), train_data=data(), max_epochs=2, device="cpu", progress=False,
                            loggers=())
    trainer.interval = interval
    trainer.on_step_end = lambda losses: setattr(trainer, "kept", [p.clone() for p in trainer.model.parameters()])
    with pytest.raises(StepError) as caught:
        trainer.fit()
    assert trainer.state.step == 2 and all(map(torch.equal, trainer.kept, trainer.model.parameters()))
    after = {"step": ("step 3", "from 2 to 3", "after every update of it"),  # found at step 3's update, before it
             "epoch": ("step 3", "from 0 to 1", "at the end of every pass over train_data")}[interval]
    assert str(caught.value).startswith(
        f"{after[0]}: the scheduler of optimizer 'optimizer' (StepLR) was stepped outside the Trainer (its last_epoch "
        f"went {after[1]} since the Trainer last stepped it), and the Trainer steps it itself, {after[2]}: it would "
        "move twice. Remove your scheduler.step()")


def test_a_resumed_run_and_a_skipped_step_are_not_taken_for_a_scheduler_stepped_elsewhere(tmp_path):
    class NaNOnce(Trainer):
        def training_step(self, batch):
            loss = super().training_step(batch)
            return loss * float("nan") if self.state.step + 1 == 3 else loss

    def run(**kwargs):
        return NaNOnce(model=MLP(8, 16, 1, 2), train_data=data(), optimizer=lambda p: torch.optim.SGD(p, lr=1.0),
                       scheduler=halving("step"), on_nonfinite="skip", undo="full", device="cpu", progress=False,
                       loggers=(), checkpoint={"dir": str(tmp_path), "every": 2}, **kwargs)

    run(max_steps=4).fit()
    resumed = run(max_steps=8, resume="auto")
    resumed.fit()
    assert resumed.state.step == 8 and resumed.schedulers["optimizer"].last_epoch == 7  # step 3 skipped


def test_lightnings_form_with_the_monitor_beside_a_plateau_given_alone():
    class Plateau(Trainer):
        def configure_optimizers(self):
            opt = torch.optim.SGD(self.model.parameters(), lr=1.0)
            plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, factor=0.5, patience=0)
            return {"optimizer": opt, "lr_scheduler": plateau, "monitor": "val_loss"}  # Lightning's documented form

        def validation_step(self, batch):
            return torch.tensor(1.0)  # never improves

    trainer = Plateau(model=MLP(8, 16, 1, 2), train_data=data(), val_data=data(), max_steps=6, val_every=2,
                      device="cpu", progress=False, loggers=())
    trainer.fit()
    assert trainer.optimizers["optimizer"].param_groups[0]["lr"] == 0.25  # stepped at 2, 4, 6: the first sets its best


def test_lightnings_lists_from_configure_optimizers_are_refused_with_the_dict_to_return():
    class Lists(Trainer):
        def configure_optimizers(self):
            opt = torch.optim.SGD(self.model.parameters(), lr=1.0)
            return [opt], [torch.optim.lr_scheduler.StepLR(opt, 1)]

    with pytest.raises(ConfigError, match=re.escape(
            "configure_optimizers returned a tuple: Lightning's lists ([opt], ([opt], [scheduler]), [opt_g, opt_d]) "
            "are not read here, since optimizers go by name: return {'g': opt_g, 'd': opt_d}")):
        Lists(model=MLP(8, 16, 1, 2), train_data=data(), max_steps=1, device="cpu", progress=False, loggers=()).fit()
