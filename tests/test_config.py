"""The Hydra-configured run: real compose, and ``python -m safeloop`` in processes forked from one that imported torch
once (``tests.forkserver``). The README's default job runs in a real fresh interpreter, on purpose: as a user runs
it, start-up included."""
import csv
import re
import subprocess
import sys

import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.errors import ConfigCompositionException
from omegaconf import OmegaConf
from omegaconf.errors import ValidationError

from safeloop import ConfigError, Trainer
from safeloop.config import build, register
from safeloop.config import compose as safeloop_compose

from . import forkserver
from .conftest import ROOT, subprocess_env


def composed(*overrides):
    register()
    with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base=None):
        return compose("train", overrides=list(overrides))


def test_default_config_builds_the_embedded_job():
    cfg = composed()
    trainer = build(cfg)
    assert type(trainer) is Trainer
    assert trainer.max_steps == 1000 and trainer.device.type in ("cpu", "cuda")
    assert isinstance(trainer.configure_optimizers(), torch.optim.Adam)
    assert trainer.on_nonfinite == "off" and trainer.guard.check == "auto"  # YAML's bare off is a boolean


def test_unknown_trainer_key_fails_at_compose_with_its_path():
    with pytest.raises(ConfigCompositionException, match="trainer.max_stepz"):
        composed("trainer.max_stepz=5")


def test_wrong_type_fails_at_compose_with_its_path():
    with pytest.raises(ConfigCompositionException, match="trainer.max_steps=lots") as info:
        composed("trainer.max_steps=lots")
    assert isinstance(info.value.__cause__, ValidationError)
    assert "could not be converted to Integer" in str(info.value.__cause__)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on a machine without CUDA")
def test_device_cuda_without_cuda_names_the_key_and_the_fix():
    with pytest.raises(ConfigError, match="device='cuda' asks for CUDA.*Use device=cpu, or device=auto"):
        build(composed("device=cuda"))


def test_trainer_target_must_be_a_trainer_subclass():
    with pytest.raises(ConfigError, match=r"trainer._target_='collections.OrderedDict' is not a safeloop.Trainer"):
        build(composed("trainer._target_=collections.OrderedDict"))


def run_cli(*args, cwd, env=None, timeout=120, fresh=False):
    """``python -m safeloop ARGS``: forked (``tests.forkserver``); ``fresh``: a real subprocess."""
    command = [sys.executable, "-m", "safeloop", *args]
    if fresh:
        return subprocess.run(command, cwd=cwd, capture_output=True, text=True, env=env or subprocess_env(),
                              timeout=timeout)
    return forkserver.run(command, cwd=cwd, env=env or subprocess_env(), timeout=timeout)


def test_cli_default_job_learns_and_writes_metrics(tmp_path):
    out = run_cli(f"hydra.run.dir={tmp_path}/run", cwd=tmp_path, fresh=True)  # a fresh interpreter, as a user runs it
    assert out.returncode == 0, out.stderr
    first, final = (float(v) for v in out.stdout.split("val_loss: ")[1].split(" at step 1000")[0]
                    .split(" at step 0 -> "))
    assert final < first / 2
    assert f"outputs: {tmp_path}/run" in out.stdout
    assert "steps/s" in out.stdout + out.stderr  # plain progress lines when not a terminal
    shown = (out.stdout + out.stderr).splitlines()  # each line once: Hydra's logging, none of safeloop's own
    assert sum("writing metrics to" in line for line in shown) == 1 and sum("outputs: " in l for l in shown) == 1
    assert sum("step 1000/1000 loss" in line for line in shown) == 1
    rows = list(csv.DictReader(open(tmp_path / "run" / "metrics.csv")))
    assert {r["metric"] for r in rows} == {"loss", "lr", "val_loss"}  # the learning rate logged with the loss
    assert max(int(r["step"]) for r in rows) == 1000


def test_cli_overrides_and_user_subclass_from_config(tmp_path):
    (tmp_path / "mytrain.py").write_text(
        "import safeloop\n"
        "class MyTrainer(safeloop.Trainer):\n"
        "    def on_fit_end(self):\n"
        "        print(f'MyTrainer ran {self.state.step} steps with lr', self.optimizers['optimizer']"
        ".param_groups[0]['lr'])\n")
    env = subprocess_env()
    env["PYTHONPATH"] = f"{tmp_path}:{env['PYTHONPATH']}"
    out = run_cli("trainer._target_=mytrain.MyTrainer", "trainer.max_steps=7", "optimizer=sgd",
                  "optimizer.lr=0.003", "device=cpu", f"hydra.run.dir={tmp_path}/run", cwd=tmp_path, env=env)
    assert out.returncode == 0, out.stderr
    assert "MyTrainer ran 7 steps with lr 0.003" in out.stdout


def test_cli_rejects_unknown_key_before_training(tmp_path):
    out = run_cli("trainer.max_stepz=5", f"hydra.run.dir={tmp_path}/run", cwd=tmp_path)
    assert out.returncode != 0
    assert "trainer.max_stepz" in out.stderr
    assert not (tmp_path / "run" / "metrics.csv").exists()


def test_debug_group_runs_few_steps_on_cpu_with_anomaly_mode(tmp_path):
    cfg = composed("debug=default")
    assert cfg.trainer.device == "cpu" and cfg.guard.trace is True and cfg.trainer.max_steps == 20
    out = run_cli("debug=default", f"hydra.run.dir={tmp_path}/run", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert "at step 20" in out.stdout


# -- every value the command line can set, checked at start-up ----------------------------------
def problems_of(*overrides) -> list[str]:
    with pytest.raises(ConfigError) as info:
        build(safeloop_compose(list(overrides) + ["device=cpu"]))
    return info.value.problems


def test_values_of_groups_without_a_schema_are_named_by_their_key_path():
    assert problems_of("optimizer.lr=abc", "seed=abc", "model.hidden=abc", "+model.width=3",
                       "+optimizer.betas=[0.9]", "data.batch_size=1.5", "threads=0") == [
        "seed='abc' is not an integer: give one (seed=0), or null not to seed",
        "threads=0 is not a positive integer: give torch's CPU thread count (threads=4), or null for torch's default",
        "data.batch_size=1.5 is a float; give an integer",
        "data.seed='abc' is a str; give an integer or None",  # data.seed is ${seed}
        "model.width: safeloop.models.MLP takes no argument 'width' (it takes in_dim, hidden, out_dim, depth); fix the "
        "key or drop it",
        "model.hidden='abc' is a str; give an integer",
        "optimizer.lr='abc' is a str; give a number or a Tensor",
        "optimizer.betas=[0.9] is a list; give a tuple[float | Tensor, float | Tensor]",
    ]


def test_an_interpolation_that_cannot_be_resolved_or_a_config_file_that_is_not_yaml_is_named(tmp_path, monkeypatch):
    """An environment variable not set or a key that does not exist, and a YAML error in a config file of the
    user's own: one ConfigError each (the command line's exit code 2), not OmegaConf's or PyYAML's traceback."""
    monkeypatch.delenv("SAFELOOP_UNSET", raising=False)
    assert problems_of("data.seed=${oc.env:SAFELOOP_UNSET}") == [
        "data.seed: its interpolation cannot be resolved (KeyError raised while resolving interpolation: \"Environment "
        "variable 'SAFELOOP_UNSET' not found\"): set what it reads, or give the value itself"]
    assert problems_of("data.seed=${model.nope}") == [
        "data.seed: its interpolation cannot be resolved (Interpolation key 'model.nope' not found): set what it "
        "reads, or give the value itself"]
    (tmp_path / "configs" / "model").mkdir(parents=True)
    (tmp_path / "configs" / "model" / "broken.yaml").write_text("_target_: safeloop.models.MLP\nhidden: [8\n")
    monkeypatch.chdir(tmp_path)  # configs/ of the current directory: the user's own options
    with pytest.raises(ConfigError, match=re.escape(f"{tmp_path}/configs/model/broken.yaml, line 2, column 9 is not "
                                                    "valid YAML: expected ',' or ']', but got '<stream end>' (while "
                                                    "parsing a flow sequence)")):
        safeloop_compose(["model=broken"])


def test_a_target_that_cannot_be_imported_or_a_group_without_one_is_named():
    assert problems_of("optimizer._target_=torch.optim.Adamm", "scheduler=abc") == [
        "optimizer._target_='torch.optim.Adamm' cannot be imported (no such module or attribute); give the dotted "
        "path of a class or function",
        "scheduler='abc' is not a config with a _target_: choose one of configs/scheduler/ (scheduler=NAME), or give "
        "scheduler._target_=dotted.path.of.a.Class and its arguments",
    ]


def test_a_value_its_target_refuses_is_named_with_the_group_at_start_up():
    assert problems_of("optimizer.lr=-1") == [
        "optimizer: torch.optim.Adam(lr=-1) failed: ValueError: Invalid learning rate: -1; fix the value at fault "
        "(optimizer.KEY=VALUE)"]
    assert problems_of("model.hidden=-3") == [
        "model: safeloop.models.MLP(in_dim=16, hidden=-3, out_dim=1, depth=3) failed: ValueError: hidden=-3: in_dim, "
        "hidden, out_dim and depth must be positive integers; fix the value at fault (model.KEY=VALUE)"]


def test_loss_weights_take_any_loss_name_as_written():
    assert build(safeloop_compose(["trainer.loss_weights={loss:2.0}", "device=cpu"])).loss_weights == {"loss": 2.0}
    both = safeloop_compose(["experiment=multi_loss", "trainer.loss_weights={cls:2.0}"])
    assert OmegaConf.to_container(both.trainer.loss_weights) == {"recon": 0.5, "cls": 2.0}
    with pytest.raises(ConfigError, match=re.escape(
            "trainer.loss_weights={loss:abc}: Value 'abc' of type 'str' could not be converted to Float; give "
            "trainer.loss_weights.loss a value of that type")):
        safeloop_compose(["trainer.loss_weights={loss:abc}"])


def test_cli_reports_every_bad_value_at_once_before_anything_runs(tmp_path):
    out = run_cli("optimizer.lr=abc", "seed=abc", "model.hidden=abc", "guard.budget=0", f"hydra.run.dir={tmp_path}/run",
                  cwd=tmp_path)
    assert out.returncode == 2, out.stderr
    assert out.stderr.splitlines() == [
        "safeloop: invalid configuration:",
        "  - seed='abc' is not an integer: give one (seed=0), or null not to seed",
        "  - data.seed='abc' is a str; give an integer or None",
        "  - model.hidden='abc' is a str; give an integer",
        "  - optimizer.lr='abc' is a str; give a number or a Tensor",
        "  - guard.budget must be a number in (0, 1] (the share of step time checks may take; 0.0025 is 0.25%), got 0.0",
    ]
    assert "Traceback" not in out.stderr
    assert not (tmp_path / "run").exists()  # found before Hydra makes the run directory


def test_the_seed_decides_the_initial_weights_whatever_ran_before():
    from safeloop.config import build
    weights = []
    for before in (1, 2):
        torch.manual_seed(before)
        weights.append(build(composed("seed=3")).model.state_dict())
    assert all(torch.equal(weights[0][k], weights[1][k]) for k in weights[0])
