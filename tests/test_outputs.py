"""What a run shows: a plain script (no Hydra, output piped) prints its progress and where its
outputs go, or that none are written (the command line's lines: tests/test_config.py)."""
import copy
import subprocess
import sys
import re
import textwrap
import time

import pytest
import torch

from safeloop import ConfigError, Trainer, curves

from .conftest import subprocess_env

SCRIPT = textwrap.dedent("""
    import sys
    import torch
    from torch.utils.data import DataLoader, TensorDataset
    import safeloop

    torch.manual_seed(0)
    x = torch.randn(64, 4)
    data = DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=16)
    trainer = safeloop.Trainer(model=torch.nn.Linear(4, 1), train_data=data, val_data=data, max_steps=6,
                               log_every=3, val_every=6, optimizer=lambda p: torch.optim.SGD(p, lr=0.1),
                               device="cpu", run_dir=sys.argv[1] if len(sys.argv) > 1 else None)
    trainer.fit()
    print("done")
""")


def run(*args, cwd):
    return subprocess.run([sys.executable, *args], cwd=cwd, env=subprocess_env(), capture_output=True, text=True,
                          timeout=120)


def test_a_plain_script_shows_its_progress_says_where_its_outputs_go_and_draws_its_curves(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    quiet = run(str(script), cwd=tmp_path)
    assert quiet.returncode == 0 and quiet.stdout == "done\n", quiet.stderr
    lines = quiet.stderr.splitlines()
    assert lines[0] == ("no run_dir: no metrics file, no checkpoints and no graph pictures are written (pass "
                        "run_dir=... to keep them)")
    assert any(line.startswith("step 3/6 loss ") for line in lines) and any(l.startswith("step 6/6 loss ") for l in lines)
    assert sum(line.startswith("validation at step 6: val_loss ") for line in lines) == 1
    kept = run(str(script), str(tmp_path / "run"), cwd=tmp_path)
    assert kept.returncode == 0, kept.stderr
    assert kept.stderr.splitlines()[0] == (f"writing metrics to {tmp_path / 'run'}; checkpoints to "
                                           f"{tmp_path / 'run' / 'checkpoints'}")
    assert (tmp_path / "run" / "metrics.csv").exists()
    # the loss curves, or how to have them
    picture = tmp_path / "run" / "curves.png"
    if curves.HAVE_MATPLOTLIB:
        assert f"loss curves: {picture}" in kept.stderr
        assert picture.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and picture.stat().st_size > 10_000
    else:
        assert f"no loss curves: pip install matplotlib to have them drawn to {picture}" in kept.stderr
        assert not picture.exists()
    assert "loss curves" not in quiet.stderr  # no run_dir: no metrics, no picture


def test_a_run_trained_in_several_fit_calls_says_where_its_outputs_go_once(caplog):
    data = [(torch.randn(8, 4), torch.randn(8, 1)) for _ in range(4)]
    trainer = Trainer(model=torch.nn.Linear(4, 1), train_data=data, max_steps=2, progress=False,
                      optimizer=lambda p: torch.optim.SGD(p, lr=0.1), device="cpu", loggers=())
    with caplog.at_level("INFO", logger="safeloop"):
        trainer.fit()
        trainer.max_steps = 4
        trainer.fit()
    assert trainer.state.step == 4
    assert sum(r.getMessage().startswith("no run_dir: ") for r in caplog.records) == 1


def test_progress_false_turns_off_the_bar_only_not_the_log_lines(caplog):
    trainer = Trainer(model=torch.nn.Linear(4, 1), train_data=data(), val_data=data(), max_steps=4, log_every=2,
                      progress=False, optimizer=lambda p: torch.optim.SGD(p, lr=0.1), device="cpu", loggers=())
    with caplog.at_level("INFO", logger="safeloop"):
        trainer.fit()
    lines = [r.getMessage() for r in caplog.records]
    assert trainer.progress.bar is None
    assert [line.split(" loss ")[0] for line in lines if line.startswith("step ")] == ["step 2/4", "step 4/4"]
    assert any(line.startswith("validation at step 4: val_loss ") for line in lines)


class LogsMae(Trainer):
    def training_step(self, batch):
        x, y = batch
        out = self.model(x)
        self.log("mae", (out - y).abs().mean())
        self.log("step_seen", self.state.step + 1)
        return torch.nn.functional.mse_loss(out, y)


def test_a_parameter_logged_in_training_step_is_logged_as_the_step_saw_it(tmp_path):
    """``self.log("logit_scale", self.model.logit_scale)`` (CLIP's learnable scale): the value written is the one
    the step used, not the parameter after the step's update changed it in place."""
    class LogsWeight(Trainer):
        seen: list = []

        def training_step(self, batch):
            self.log("w", self.model.weight[0, 0])
            self.seen.append(self.model.weight[0, 0].item())
            return super().training_step(batch)

    trainer = LogsWeight(model=torch.nn.Linear(4, 1), train_data=data(), max_steps=3, log_every=1, device="cpu",
                         progress=False, run_dir=tmp_path, checkpoint=False, optimizer=lambda p: torch.optim.SGD(p, lr=1))
    trainer.fit()
    rows = [r.split(",") for r in (tmp_path / "metrics.csv").read_text().splitlines()]
    assert [float(value) for step, name, value in rows if name == "w"] == pytest.approx(LogsWeight.seen, rel=1e-5)
    assert len(set(LogsWeight.seen)) == 3  # the updates changed it


def test_steps_per_second_counts_the_steps_of_this_fit_only(caplog):
    """A later fit (or a resumed run) starts at step 2: its first rate counts its own steps, 2 of 20 ms each,
    so at most 50 steps/s (counted from step 0 it read about 4 steps in that time)."""
    class Slow(Trainer):
        def training_step(self, batch):
            time.sleep(0.02)
            return super().training_step(batch)

    trainer = Slow(model=torch.nn.Linear(4, 1), train_data=data(), max_steps=2, log_every=2, device="cpu",
                   progress=False, loggers=(), optimizer=lambda p: torch.optim.SGD(p, lr=0.1))
    trainer.fit()
    trainer.max_steps = 4
    with caplog.at_level("INFO", logger="safeloop"):
        trainer.fit()
    line, = [r.getMessage() for r in caplog.records if r.getMessage().startswith("step 4/4")]
    assert float(line.split()[-2]) <= 50, line


class ReturnsLossAndMae(Trainer):
    def training_step(self, batch):
        x, y = batch
        out = self.model(x)
        return {"loss": torch.nn.functional.mse_loss(out, y), "mae": (out - y).abs().mean()}


class ReturnsTotalAndTerm(Trainer):
    """``{"total": mse + mae, "mse": mse}`` (or ``out``'s order): mse is trained twice over."""

    out = staticmethod(lambda mse, mae: {"total": mse + mae, "mse": mse})

    def training_step(self, batch):
        x, y = batch
        pred = self.model(x)
        return self.out(torch.nn.functional.mse_loss(pred, y), (pred - y).abs().mean())


def data(n=4):
    torch.manual_seed(0)
    return [(x, x.sum(1, keepdim=True)) for x in torch.randn(n, 8, 4)]


def test_self_log_writes_metrics_with_the_losses_at_each_log_point(tmp_path, caplog):
    """Lightning's ``self.log(name, value)``: the value of the log step goes to metrics.csv and the progress
    line next to the losses, in automatic and manual mode; only the loss is trained."""
    from .conftest import manual

    for cls in (LogsMae, manual(LogsMae)):
        run_dir = tmp_path / cls.__name__
        with caplog.at_level("INFO", logger="safeloop"):
            trainer = cls(model=torch.nn.Linear(4, 1), train_data=data(), max_steps=4, log_every=2, device="cpu",
                          run_dir=run_dir, checkpoint=False,
                          optimizer=lambda p: torch.optim.SGD(p, lr=0.1))
            trainer.fit()
            trainer.max_steps = 6  # a later fit writes to the same file: trainer.loggers are the logger objects
            trainer.fit()
        rows = (run_dir / "metrics.csv").read_text().splitlines()
        assert "2,step_seen,2" in rows and "6,step_seen,6" in rows and "3,step_seen,3" not in rows
        assert any(r.startswith("2,mae,") for r in rows) and any(r.startswith("2,loss,") for r in rows)
        assert any("step 4/4 loss" in r.getMessage() and "mae" in r.getMessage() for r in caplog.records)
        assert [type(logger).__name__ for logger in trainer.loggers] == ["CSVLogger"]
        assert trainer.logged == {} and set(trainer.state.losses) == {"loss"}


class LogsDict(Trainer):
    def training_step(self, batch):
        x, y = batch
        out = self.model(x)
        self.log_dict({"mae": (out - y).abs().mean(), "step_seen": self.state.step + 1}, prog_bar=True)
        return torch.nn.functional.mse_loss(out, y)

    def validation_step(self, batch):
        x, y = batch
        self.log_dict({"val_mae": (self.model(x) - y).abs().mean()})
        return torch.nn.functional.mse_loss(self.model(x), y)


@pytest.mark.parametrize("settings", [{}, {"multi_loss": "sum"}, {"grad_accum": 2}], ids=["sequential", "sum", "accum"])
@pytest.mark.parametrize("out, said", [
    (lambda mse, mae: {"total": mse + mae, "mse": mse},
     "returned 'mse' and 'total', and 'total' was computed from 'mse'"),
    (lambda mse, mae: {"mse": mse, "total": 0.5 * (mse + mae)},
     "returned 'mse' and 'total', and 'total' was computed from 'mse'"),
    (lambda mse, mae: {"a": mse, "b": mse}, "returned 'a' and 'b', and 'a' and 'b' are the same tensor"),
], ids=["total-first", "term-first", "same-tensor"])
def test_a_returned_loss_computed_from_another_returned_loss_is_refused_before_any_backward(settings, out, said):
    """With one optimizer every entry is back-propagated into the same parameters: a term returned beside its sum
    would have its gradient applied twice, silently. Refused at step 1 with what to return instead, nothing trained."""
    from safeloop import StepError

    model = torch.nn.Linear(4, 1)
    before = [p.detach().clone() for p in model.parameters()]
    trainer = type("T", (ReturnsTotalAndTerm,), {"out": staticmethod(out)})(
        model=model, train_data=data(), max_steps=2, device="cpu", progress=False, loggers=(), checkpoint=False,
        optimizer=lambda p: torch.optim.SGD(p, lr=0.1), **settings)
    term = re.search(r"'(\w+)'", said).group(1)
    with pytest.raises(StepError, match=re.escape(
            f"step 1: training_step {said}: every entry of a returned dict is back-propagated into the same "
            f"parameters, so the gradient of '{term}' would be applied twice. Return only the losses to train (the "
            f"terms, not their sum too: the Trainer adds their gradients) and log the others with "
            f"self.log('{term}', value)")):
        trainer.fit()
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


class RoutedTotalAndTerm(Trainer):
    """Two optimizers: ``d``'s loss is computed from ``g``'s, and each trains only its own parameters."""

    def configure_optimizers(self):
        return {"g": torch.optim.SGD(self.model[0].parameters(), lr=0.1),
                "d": torch.optim.SGD(self.model[1].parameters(), lr=0.1)}

    def training_step(self, batch):
        x, y = batch
        g = self.model[0](x).pow(2).mean()
        return {"g": g, "d": (self.model[1](x) - y).pow(2).mean() + g}


def test_with_several_optimizers_a_loss_computed_from_another_trains_each_optimizers_own_parameters_once():
    """Routed losses reach only their optimizer's parameters, so ``g`` inside ``d`` is no double count: allowed, and
    ``g``'s parameters move by the gradient of ``g`` alone, as a hand loop's ``g.backward(inputs=G's parameters)``."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 1), torch.nn.Linear(4, 1))
    hand = copy.deepcopy(model)
    RoutedTotalAndTerm(model=model, train_data=data(1), max_steps=1, device="cpu", progress=False, loggers=(),
                       checkpoint=False).fit()
    (x, y), = data(1)
    opt = torch.optim.SGD(hand[0].parameters(), lr=0.1)
    hand[0](x).pow(2).mean().backward()
    opt.step()
    assert all(torch.equal(a, b) for a, b in zip(hand[0].parameters(), model[0].parameters()))


def test_self_log_dict_logs_each_entry_as_self_log_does_in_training_and_validation(tmp_path):
    """Lightning's ``self.log_dict({...})`` is ``self.log`` of each entry: the same rows in metrics.csv, the
    validation value a mean over the pass; its options are ``self.log``'s (``on_epoch`` refused with its text)."""
    def rows(cls, **kwargs) -> list[str]:
        torch.manual_seed(0)
        trainer = cls(model=torch.nn.Linear(4, 1), train_data=data(), max_steps=4, log_every=2, device="cpu",
                      run_dir=tmp_path / cls.__name__, checkpoint=False, optimizer=lambda p: torch.optim.SGD(p, lr=0.1),
                      progress=False, **kwargs)
        trainer.fit()
        return (tmp_path / cls.__name__ / "metrics.csv").read_text().splitlines()

    got = rows(LogsDict, val_data=data(2), val_every=2)
    assert [r for r in got if ",val_" not in r] == rows(LogsMae)
    assert sum(",val_mae," in r for r in got) == 3  # before training, at step 2 and at step 4
    bad = type("Bad", (LogsDict,), {"validation_step": Trainer.validation_step,
                                    "training_step": lambda self, b: self.log_dict({"m": 1.0}, on_epoch=True)})
    with pytest.raises(ConfigError, match=re.escape("self.log(..., on_epoch=True): safeloop's self.log(name, value) "
                                                    "takes no on_epoch")):
        rows(bad)


def test_a_returned_dict_with_loss_and_other_keys_is_an_error_pointing_to_self_log():
    """In Lightning, ``{"loss": loss, "mae": mae}`` trains ``loss`` and logs the rest; here every entry
    would be trained, so the step stops before any backward and says what to do."""
    from safeloop import StepError

    model = torch.nn.Linear(4, 1)
    before = [p.detach().clone() for p in model.parameters()]
    trainer = ReturnsLossAndMae(model=model, train_data=data(), max_steps=2, device="cpu", progress=False,
                                loggers=(), optimizer=lambda p: torch.optim.SGD(p, lr=0.1))
    with pytest.raises(StepError, match=re.escape(
            "step 1: training_step returned a dict with 'loss' and ['loss', 'mae']: every entry of a returned dict "
            "is a loss the Trainer back-propagates, so 'mae' would be trained too (Lightning trains 'loss' and only "
            "logs the rest). Return the loss alone and log the others with self.log('mae', value)")):
        trainer.fit()
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
