"""Validation: the metrics are means over samples, and validating changes nothing the training draws.

Under torchrun (each rank its own share of val_data, the same metrics on every rank): test_distributed.
"""
import random
import re

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from safeloop import ConfigError, ConfigWarning, StepError, Trainer
from safeloop.models import MLP

from .conftest import manual


def dataset(n, d=8, seed=1):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=gen)
    return TensorDataset(x, x.sum(1, keepdim=True).sin())


def validating(cls=Trainer, **kwargs):
    """A Trainer of ``cls`` set up to validate ``kwargs["val_data"]``; ``trainer.validate()`` runs it."""
    return cls(model=MLP(8, 16, 1), train_data=DataLoader(dataset(16), batch_size=4), max_steps=1,
               optimizer=lambda p: torch.optim.SGD(p, lr=0.1), device="cpu", progress=False, **{"loggers": (), **kwargs})


def per_sample_mean(model, ds) -> float:
    """Every sample's squared error, averaged: the hand computation the metrics must match."""
    x, y = ds.tensors
    with torch.no_grad():
        return F.mse_loss(model(x), y, reduction="none").mean().item()


def test_the_validation_loss_is_the_mean_over_samples_when_the_last_batch_is_smaller():
    val = dataset(100, seed=5)  # batches of 32, 32, 32 and 4
    trainer = validating(val_data=DataLoader(val, batch_size=32))
    metrics = trainer.validate()
    expected = per_sample_mean(trainer.model, val)
    assert metrics["val_loss"] == pytest.approx(expected, rel=1e-6)
    # the mean of the four batch means weighs the last 4 samples as much as each 32
    x, y = val.tensors
    with torch.no_grad():
        batch_means = [F.mse_loss(trainer.model(x[i:i + 32]), y[i:i + 32]).item() for i in range(0, 100, 32)]
    assert abs(sum(batch_means) / 4 - expected) > 1e-3


def test_a_second_validation_loader_is_a_metric_of_its_own_through_test_in_on_validation_end(tmp_path):
    """What the refusal of a list of validation loaders advises (Lightning's ``dataloader_idx``): the first as
    ``val_data``, the other's ``self.test(...)`` put in ``metrics`` in ``on_validation_end``. Each is its own
    loader's mean over samples, and ``checkpoint.monitor`` ranks by it."""
    first, other = dataset(12, seed=5), dataset(8, seed=6)

    class TwoLoaders(Trainer):
        def on_validation_end(self, metrics):
            metrics["val_other"] = self.test(DataLoader(other, batch_size=3))["test_loss"]

    trainer = validating(TwoLoaders, val_data=DataLoader(first, batch_size=5), val_every=1,
                         checkpoint={"dir": str(tmp_path), "monitor": "val_other"})
    trainer.fit()
    step, metrics = trainer.state.val_history[-1]
    assert step == 1 and metrics["val_loss"] == pytest.approx(per_sample_mean(trainer.model, first), rel=1e-6)
    assert metrics["val_other"] == pytest.approx(per_sample_mean(trainer.model, other), rel=1e-6)
    assert (tmp_path / "best.txt").read_text().strip() == "step-000000001.pt"


def test_validation_step_returns_the_sample_count_where_the_first_tensor_does_not_hold_it():
    """Sequence-first batches, (time, batch, features): the first tensor's leading size is the time."""
    val = dataset(36, seed=5)
    x, y = val.tensors
    seq = x.unsqueeze(0).expand(5, -1, -1)  # 5 time steps of the same features
    batches = [(seq[:, :32], y[:32]), (seq[:, 32:], y[32:])]

    class SequenceFirst(Trainer):
        def validation_step(self, batch):
            x, y = batch
            out = self.model(x.mean(0))
            return {"loss": F.mse_loss(out, y), "abs": F.l1_loss(out, y)}, y.shape[0]

    trainer = validating(SequenceFirst, val_data=batches)
    metrics = trainer.validate()
    assert metrics["val_loss"] == pytest.approx(per_sample_mean(trainer.model, val), rel=1e-6)
    with torch.no_grad():
        assert metrics["val_abs"] == pytest.approx(F.l1_loss(trainer.model(x), y).item(), rel=1e-6)


@pytest.mark.parametrize("second", ["another loss", "a count of right answers"])
def test_a_loss_and_a_tensor_returned_as_a_tuple_are_not_taken_for_a_loss_and_its_count(second):
    class Two(Trainer):
        def validation_step(self, batch):
            x, y = batch
            out = self.model(x)
            if second == "another loss":
                return F.mse_loss(out, y), F.l1_loss(out, y)
            return F.mse_loss(out, y), ((out - y).abs() < 0.5).sum()  # `return loss, correct`: an int tensor

    trainer = validating(Two, val_data=DataLoader(dataset(8), batch_size=4))
    with pytest.raises(StepError, match=re.escape(
            "failed on batch 1 of val_data (training is unchanged): TypeError: validation_step returned a tuple of "
            "Tensor, Tensor: a tuple is (losses, number of samples), the number an int (len(x), int(mask.sum())); "
            "several losses or metrics go in a dict")):
        trainer.validate()


def test_a_batch_without_a_tensor_to_count_its_samples_by_says_how_to_give_the_count():
    class Text(Trainer):
        def validation_step(self, batch):
            lengths = torch.tensor([[float(len(s))] for s in batch])
            return F.mse_loss(self.model(lengths.expand(-1, 8)), lengths)

    trainer = validating(Text, val_data=[["a b", "c"], ["d e f"]])
    with pytest.raises(StepError, match=re.escape(
            "validation at step 0 failed on batch 1 of val_data (training is unchanged): ValueError: the batch "
            "holds no tensor to count its samples by (each batch's losses count as many times as it has samples: "
            "the leading size of its first tensor); return (losses, number of samples) from validation_step")):
        trainer.validate()


def test_a_batch_whose_tensors_differ_in_leading_size_is_counted_by_the_first_with_a_warning():
    val = dataset(40, seed=5)
    x, y = val.tensors
    weights = torch.ones(3)  # not per sample
    batches = [(x[:32], y[:32], weights), (x[32:], y[32:], weights)]

    class Weighted(Trainer):
        def validation_step(self, batch):
            x, y, _ = batch
            return F.mse_loss(self.model(x), y)

    trainer = validating(Weighted, val_data=batches)
    with pytest.warns(ConfigWarning, match=re.escape(
            "a val_data batch holds tensors of different leading sizes: its losses count as many times as the "
            "first tensor's leading size; if that is not its number of samples, return (losses, number of "
            "samples) from validation_step")) as said:
        metrics = trainer.validate()
    assert said[0].filename == __file__  # the user's call, trainer.validate()
    assert metrics["val_loss"] == pytest.approx(per_sample_mean(trainer.model, val), rel=1e-6)


# -- validating draws nothing the training draws ----------------------------------------------------------
class Noisy(Trainer):
    """A step and a validation that both draw from torch's, Python's and numpy's global generators."""

    def training_step(self, batch):
        x, y = batch
        x = x + 0.01 * (random.random() + float(np.random.rand()))
        return F.mse_loss(self.model(x), y)

    def validation_step(self, batch):
        x, y = batch
        x = x + 0.01 * (random.random() + float(np.random.rand()))
        return F.mse_loss(F.dropout(self.model(x), 0.5, training=True), y)  # Monte Carlo dropout


def trained(cls, val_data) -> list[torch.Tensor]:
    torch.manual_seed(0)
    random.seed(0)
    np.random.seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Dropout(0.3), nn.Linear(32, 1))
    # shuffled from the global torch generator, reshuffled every pass (4 batches a pass)
    train = DataLoader(dataset(64), batch_size=16, shuffle=True)
    cls(model=model, train_data=train, val_data=val_data, val_every=3, max_steps=10, device="cpu", progress=False,
        optimizer=lambda p: torch.optim.SGD(p, lr=0.1)).fit()
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("mode", ["automatic", "manual"])
def test_training_with_validation_is_bit_identical_to_training_without(mode):
    """Validations before, during (every 3 steps) and after training: the data order, the dropout masks and
    the step's own random draws are those of the same training without val_data."""
    cls = Noisy if mode == "automatic" else manual(Noisy)
    # a DataLoader draws a seed from the global torch generator each time it is iterated
    val = DataLoader(dataset(24, seed=5), batch_size=8)
    with_val, without = trained(cls, val), trained(cls, None)
    assert all(torch.equal(a, b) for a, b in zip(with_val, without, strict=True))


# -- test() and predict(): validation's loop with another step ----------------------------------------------
def by_hand(model, loader) -> dict[str, float]:
    """The hand-written test loop: eval mode, no gradients, each batch's mean counted by its size."""
    model.eval()
    total = absolute = n = 0.0
    with torch.no_grad():
        for x, y in loader:
            out = model(x)
            total += F.mse_loss(out, y).item() * len(x)
            absolute += F.l1_loss(out, y).item() * len(x)
            n += len(x)
    model.train()
    return {"test_loss": total / n, "test_abs": absolute / n}


def test_test_returns_the_means_over_samples_a_hand_written_loop_gets():
    class Tested(Trainer):
        def test_step(self, batch):
            x, y = batch
            out = self.model(x)
            return {"loss": F.mse_loss(out, y), "abs": F.l1_loss(out, y)}

    model = nn.Sequential(nn.Linear(8, 16), nn.Dropout(0.5), nn.Linear(16, 1))  # dropout: eval mode matters
    trainer = validating(Tested)
    trainer.model = model
    loader = DataLoader(dataset(50, seed=7), batch_size=16)  # 16, 16, 16 and 2
    metrics = trainer.test(loader)
    assert metrics == pytest.approx(by_hand(model, loader), rel=1e-6)
    assert model.training  # its own mode again
    # the default test_step is validation_step's loss
    assert validating().test(loader).keys() == {"test_loss"}


def test_test_metrics_reach_the_loggers_only_when_written_there_in_on_fit_end():
    """docs/trainer.md, Test and predict: ``test()`` writes nothing to the metric loggers (Lightning's ``trainer.test``
    logs to its logger); ``self.log_metrics(self.test(data))`` in ``on_fit_end`` writes them at the run's last step,
    with the loggers still open."""
    rows = []

    class Rows:
        def log_metrics(self, metrics, step):
            rows.append((step, dict(metrics)))

    loader = DataLoader(dataset(10, seed=7), batch_size=4)

    class TestedAtTheEnd(Trainer):
        def on_fit_end(self):
            self.log_metrics(self.test(loader))

    plain = validating(loggers=[Rows()])
    plain.fit()
    plain.test(loader)
    assert rows and not [m for _, m in rows if "test_loss" in m]
    rows.clear()
    trainer = validating(TestedAtTheEnd, loggers=[Rows()])
    trainer.fit()
    assert [(step, m) for step, m in rows if "test_loss" in m] == [(1, {"test_loss": trainer.test(loader)["test_loss"]})]


def test_predict_returns_each_batchs_output_as_model_x_under_no_grad():
    trainer = validating()
    x, y = dataset(10, seed=3).tensors
    with torch.no_grad():
        expected = [trainer.model(x[i:i + 4]) for i in range(0, 10, 4)]
    out = trainer.predict(DataLoader(TensorDataset(x, y), batch_size=4))  # (x, y) batches: model(x)
    assert len(out) == 3 and all(torch.equal(o, e) and not o.requires_grad for o, e in zip(out, expected))
    out = trainer.predict([x[i:i + 4] for i in range(0, 10, 4)])  # tensor batches: model(batch)
    assert all(torch.equal(o, e) for o, e in zip(out, expected, strict=True))


def test_a_failing_test_step_names_the_batch_of_the_test_data():
    class Broken(Trainer):
        def test_step(self, batch):
            x, y = batch
            return F.mse_loss(self.model(x), y), F.l1_loss(self.model(x), y)

    with pytest.raises(StepError, match=re.escape(
            "test at step 0 failed on batch 1 of test data (training is unchanged): TypeError: test_step returned "
            "a tuple of Tensor, Tensor")):
        validating(Broken).test(DataLoader(dataset(8), batch_size=4))


class LogsInValidation(Trainer):
    """A Lightning-style validation step: ``self.log("val_mae", ...)``, the loss returned (``returns``) or not."""

    def validation_step(self, batch):
        x, y = batch
        out = self.model(x)
        self.log("val_mae", (out - y).abs().mean())
        return F.mse_loss(out, y) if self.returns else None

    test_step = validation_step


@pytest.mark.parametrize("returns", [True, False], ids=["loss returned", "only logged"])
def test_self_log_in_validation_step_is_a_mean_over_samples_among_the_validation_metrics(tmp_path, returns):
    """Lightning's default for a validation step's self.log (on_epoch): the mean over the pass, not the last batch's
    value logged with a later training step."""
    val = dataset(10, seed=2)  # batches of 4, 4 and 2
    trainer = LogsInValidation(model=MLP(8, 16, 1), train_data=DataLoader(dataset(16), batch_size=4),
                               val_data=DataLoader(val, batch_size=4), max_steps=2, val_every=1, log_every=1,
                               optimizer=lambda p: torch.optim.SGD(p, lr=0.1), device="cpu", progress=False,
                               run_dir=tmp_path, checkpoint=False)
    trainer.returns = returns
    trainer.log("kept", 7.0)  # logged in training before a validation: written at the next log point, as it was
    trainer.fit()
    x, y = val.tensors
    with torch.no_grad():
        mae = (trainer.model(x) - y).abs().mean().item()
    step, metrics = trainer.state.val_history[-1]
    assert step == 2 and metrics["val_mae"] == pytest.approx(mae, rel=1e-6)
    assert ("val_loss" in metrics) == returns
    rows = (tmp_path / "metrics.csv").read_text().splitlines()
    assert [r.split(",")[0] for r in rows if ",val_mae," in r] == ["0", "1", "2"]  # at each validation only
    assert [r.split(",")[0] for r in rows if ",kept," in r] == ["1"]
    assert trainer.test(DataLoader(val, batch_size=4))["val_mae"] == pytest.approx(mae, rel=1e-6)  # named as logged


def test_a_validation_step_that_returns_nothing_and_logs_nothing_is_named():
    class Silent(Trainer):
        def validation_step(self, batch):
            self.model(batch[0])

    trainer = validating(Silent, val_data=DataLoader(dataset(8), batch_size=4))
    trainer.setup()
    with pytest.raises(StepError, match=re.escape("validation at step 0 failed on batch 1 of val_data (training is "
                                                  "unchanged): TypeError: validation_step returned NoneType and "
                                                  "logged nothing: return the loss (or a dict of losses), or log the "
                                                  "metrics with self.log(name, value)")):
        trainer.validate()



class InputGradient(Trainer):
    """FGSM's validation (pytorch/tutorials, fgsm_tutorial.py): the input's gradient by ``model.zero_grad()`` and
    ``loss.backward()`` (``zeroed``), or by ``loss.backward()`` alone."""
    zeroed = True

    def validation_step(self, batch):
        x, y = batch
        x = x.clone().requires_grad_(True)
        with torch.enable_grad():
            if self.zeroed:
                self.model.zero_grad()
            F.mse_loss(self.model(x), y).backward()
        return F.mse_loss(self.model(x + 0.1 * x.grad.sign()), y)


def test_a_backward_in_validation_leaves_the_gradients_as_it_found_them():
    trainer = validating(InputGradient, val_data=DataLoader(dataset(8), batch_size=4))
    trainer.validate()
    assert all(p.grad is None for p in trainer.model.parameters())
    kept = [torch.ones_like(p) for p in trainer.model.parameters()]  # gradients accumulating over steps
    for p, g in zip(trainer.model.parameters(), kept):
        p.grad = g
    trainer.validate()
    assert all(p.grad is g and torch.equal(g, torch.ones_like(g)) for p, g in zip(trainer.model.parameters(), kept))
    trainer.zeroed = False  # its backward adds to them in place: no way back
    with pytest.raises(StepError, match=r"validation_step added to gradients that training had accumulated \(a "
                                        r"backward\(\) in it\), which cannot be taken back: take its gradient with "
                                        r"torch.autograd.grad"):
        trainer.validate()


def test_a_number_returned_from_validation_step_is_refused_saying_what_to_return():
    class Item(Trainer):
        def validation_step(self, batch):
            x, y = batch
            return F.mse_loss(self.model(x), y).item()

    trainer = validating(Item, val_data=DataLoader(dataset(8), batch_size=4))
    with pytest.raises(StepError, match=re.escape(
            "TypeError: validation_step returned a float: return the loss as a tensor (or a dict of them, or "
            "(losses, n)), or log metrics with self.log(name, value)")):
        trainer.validate()


def test_validate_without_val_data_says_to_pass_it():
    trainer = validating()
    with pytest.raises(ConfigError, match=r"validation has no data: pass val_data=\.\.\. to the Trainer"):
        trainer.validate()
    with pytest.raises(ConfigError, match=r"predict has no data: pass the batches, trainer.predict\(loader\)"):
        trainer.predict(None)
