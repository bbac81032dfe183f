"""What ``python -m safeloop`` says at the command line: each command a process of its own, forked from one that
imported torch once (``tests.forkserver``: what ``python -m safeloop ARGS`` would be, without a new interpreter's
start-up). The ``safeloop`` console script runs as a real subprocess, on purpose: its own entry point."""
import csv
import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from safeloop import ConfigError
from safeloop.config import compose

from . import forkserver
from .conftest import subprocess_env


def cli(*args, cwd, prefix=("-m", "safeloop")) -> subprocess.CompletedProcess:
    """``python -m safeloop ARGS`` (forked: ``tests.forkserver``); ``prefix=()``: the ``safeloop`` console script, a
    real subprocess."""
    if prefix:
        return forkserver.run([sys.executable, *prefix, *args], cwd=cwd, env=subprocess_env(), timeout=180)
    return subprocess.run([str(Path(sys.executable).with_name("safeloop")), *args], cwd=cwd, env=subprocess_env(),
                          capture_output=True, text=True, timeout=180)


@pytest.mark.parametrize("override, message", [
    pytest.param("device=cuda", "trainer.device='cuda' asks for CUDA, but torch.cuda.is_available() is False",
                 marks=pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")),
    ("trainer.precision=64", "trainer.precision='64' is not one of 32, 32-true, fp32, bf16, bf16-mixed, bf16-true, "
     "16, 16-mixed"),
    ("guard.check=sometimes", "guard.check='sometimes' is not one of auto, always, off"),
])
def test_a_trainer_configuration_error_is_one_message_and_exit_code_2(tmp_path, override, message):
    out = cli(override, "trainer.max_steps=2", cwd=tmp_path)
    assert out.returncode == 2, out.stderr
    assert out.stderr.startswith(f"safeloop: invalid configuration: {message}"), out.stderr
    assert len(out.stderr.strip().splitlines()) == 1, out.stderr  # no traceback, no Hydra report
    assert "Traceback" not in out.stderr + out.stdout
    assert not (tmp_path / "outputs").exists()  # refused by the Trainer, in the run directory: removed


def test_a_group_option_that_does_not_exist_lists_the_options(tmp_path):
    out = cli("optimizer=adamm", cwd=tmp_path)
    assert out.returncode == 2
    assert out.stderr.strip() == ("safeloop: invalid configuration: optimizer=adamm: optimizer has no option "
                                  "'adamm'; did you mean optimizer=adam? options: adam, adamw, sgd")
    assert not (tmp_path / "outputs").exists()


def test_an_optional_group_option_that_does_not_exist_is_refused_not_left_out(tmp_path):
    out = cli("experiment=gann", cwd=tmp_path)  # Hydra alone trains the default job without a word
    assert out.returncode == 2
    assert out.stderr.strip() == ("safeloop: invalid configuration: experiment=gann: experiment has no option "
                                  "'gann'; did you mean experiment=gan? options: gan, multi_loss, tbptt")
    assert not (tmp_path / "outputs").exists()
    with pytest.raises(ConfigError, match=r"debug=defualt: debug has no option 'defualt'; did you mean "
                                          r"debug=default\?"):
        compose(["debug=defualt"])
    assert compose(["experiment=gan", "~debug"]).recipe is not None


def test_help_is_titled_for_safeloop_and_lists_the_options_users_pick(tmp_path):
    out = cli("--help", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("safeloop: a PyTorch training run configured by Hydra.")
    assert "powered by Hydra" not in out.stdout and "__main__" not in out.stdout
    assert "  optimizer: adam, adamw, sgd\n" in out.stdout
    assert "  trainer: default\n" in out.stdout and "schema" not in out.stdout  # the schemas are no options
    assert "max_steps: 1000" in out.stdout
    out = cli("optimizer=sgd", "--help", cwd=tmp_path)
    assert "_target_: torch.optim.SGD" in out.stdout


def test_a_run_composes_its_config_four_times_and_logs_to_safeloop_log(tmp_path):
    """The config is composed four times: twice by safeloop's check of the overrides (a bad one gets
    safeloop's message and exit code 2; the second reads a sweep a config file declares, 0.2 s), twice by
    ``@hydra.main`` (the first to read ``hydra.mode``); counted on Hydra's real loader."""
    count = ("import atexit, sys, runpy\n"
             "from hydra._internal.config_loader_impl import ConfigLoaderImpl\n"
             "load, calls = ConfigLoaderImpl.load_configuration, []\n"
             "def counted(*a, **k):\n"
             "    calls.append(1)\n"
             "    return load(*a, **k)\n"
             "ConfigLoaderImpl.load_configuration = counted\n"
             "atexit.register(lambda: print('composed', len(calls)))\n"
             "sys.argv = ['safeloop', *sys.argv[1:]]\n"
             "runpy.run_module('safeloop', run_name='__main__')\n")
    out = cli("trainer.max_steps=2", "trainer.val_every=null", f"hydra.run.dir={tmp_path}/run", cwd=tmp_path,
              prefix=("-c", count))
    assert out.returncode == 0, out.stderr
    assert "composed 4" in out.stdout
    assert (tmp_path / "run" / "safeloop.log").exists() and not (tmp_path / "run" / "__main__.log").exists()


# -- your own model, data and Trainer from the command line ---------------------------------------
PROJECT = {  # a user's directory: modules of their own, and configs/ naming them
    "cnn.py": "import torch\n\n\nclass Net(torch.nn.Module):  # takes none of model=mlp's keys\n"
              "    def __init__(self):\n        super().__init__()\n        self.layer = torch.nn.Linear(16, 1)\n\n"
              "    def forward(self, x):\n        return self.layer(x)\n",
    "mydata.py": "import torch\nfrom torch.utils.data import DataLoader, TensorDataset\n\n\n"
                 "class Data:\n    def __init__(self):\n        x = torch.randn(256, 16)\n"
                 "        ds = TensorDataset(x, x.sum(1, keepdim=True))\n"
                 "        self.train, self.val = DataLoader(ds, batch_size=32, shuffle=True), DataLoader(ds, batch_size=64)\n",
    "mytrain.py": "import torch.nn.functional as F\n\nimport safeloop\n\n\nclass Twice(safeloop.Trainer):\n"
                  "    automatic = False\n\n    def training_step(self, batch):\n"
                  "        loss = super().training_step(batch)\n        self.backward(loss)\n"
                  "        self.backward(loss)  # the graph is freed\n        self.step()\n        return loss\n\n"
                  "    def validation_step(self, batch):\n        x, y = batch\n"
                  "        return F.mse_loss(self.model(x), y)\n",
    "configs/model/cnn.yaml": "_target_: cnn.Net\n",
    "configs/data/mine.yaml": "_target_: mydata.Data\n",
}


@pytest.fixture(scope="module")
def project(tmp_path_factory):
    root = tmp_path_factory.mktemp("project")
    for name, text in PROJECT.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return root


def test_the_safeloop_command_trains_your_model_and_data_from_your_configs_dir(project):
    script = Path(sys.executable).with_name("safeloop")
    if not script.exists():
        pytest.skip("the project is not installed in this environment (pip install -e .)")
    out = cli("model=cnn", "data=mine", "trainer.max_steps=4", "trainer.val_every=2", "trainer.progress=false",
              f"hydra.run.dir={project}/run", cwd=project, prefix=())  # the current directory is importable
    assert out.returncode == 0, out.stderr
    assert re.search(r"val_loss: [\d.]+ at step 0 -> [\d.]+ at step 4", out.stdout), out.stdout
    assert (project / "run" / "metrics.csv").exists()


def test_a_model_that_takes_none_of_the_groups_keys_is_one_problem_saying_what_to_do(project, monkeypatch):
    monkeypatch.chdir(project)
    monkeypatch.syspath_prepend(str(project))
    with pytest.raises(ConfigError) as info:
        compose(["model._target_=cnn.Net"])
    assert info.value.problems == [
        "model: cnn.Net takes none of in_dim, hidden, out_dim, depth (it takes no arguments). For your own model, "
        "write its config, configs/model/NAME.yaml in the current directory (_target_: cnn.Net and its arguments), "
        "and run with model=NAME (see docs/own-model.md); or drop each key: '~model.in_dim'..."]
    assert compose(["model=cnn"]).model == {"_target_": "cnn.Net"}


def test_a_safeloop_error_at_run_time_is_its_message_and_your_frames_only(project):
    out = cli("model=cnn", "trainer._target_=mytrain.Twice", "trainer.max_steps=3", "trainer.progress=false",
              f"hydra.run.dir={project}/twice", cwd=project)
    assert out.returncode == 1
    assert out.stderr.startswith("safeloop: DoubleBackwardError: backward through a graph that was already consumed "
                                 "(step 1, loss 'loss')"), out.stderr
    assert f"Graph picture: {project}/twice/graphs/step1_loss.dot" in out.stderr
    assert "held by an unnamed tensor" in out.stderr and "`an unnamed" not in out.stderr  # a description, not code
    assert out.stderr.endswith(f'File "{project}/mytrain.py", line 12, in training_step\n'
                               "    self.backward(loss)  # the graph is freed\n    ^^^^^^^^^^^^^^^^^^^\n")
    assert "HYDRA_FULL_ERROR" not in out.stderr
    assert not library_frames(out.stderr)


def library_frames(text: str) -> list[str]:
    """The traceback lines of ``text`` in safeloop's or Hydra's own files."""
    import hydra

    import safeloop
    packages = tuple(str(Path(m.__file__).parent) + os.sep for m in (safeloop, hydra))
    return [line for line in text.splitlines() if line.strip().startswith('File "')
            and line.split('"')[1].startswith(packages)]


# -- configuration errors leave nothing; disks that refuse writes ----------------------------------
def test_an_invalid_command_line_leaves_no_output_directory_and_names_the_full_key(tmp_path):
    out = cli("trainer.val_every=0", cwd=tmp_path)
    assert out.returncode == 2
    assert out.stderr == "safeloop: invalid configuration: trainer.val_every must be a positive integer, got 0\n"
    assert not (tmp_path / "outputs").exists()  # nor does one the Trainer refuses: see the test of trainer.device


def test_a_run_directory_that_cannot_be_made_is_one_line_before_anything_is_written(tmp_path):
    (tmp_path / "afile").write_text("")  # a directory cannot be made under a file, even by root
    out = cli(f"hydra.run.dir={tmp_path}/afile/run", cwd=tmp_path)
    assert out.returncode == 2
    assert out.stderr == (f"safeloop: invalid configuration: the run directory {tmp_path}/afile/run cannot be made: "
                          f"{tmp_path}/afile is not a directory; give a directory you can write to with "
                          "hydra.run.dir=PATH\n")


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full, a device every write to fails on")
def test_a_full_disk_at_run_time_is_one_line_and_no_checkpoint(tmp_path):
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "metrics.csv").symlink_to("/dev/full")  # writing metrics fails: no space left on device
    out = cli("trainer.max_steps=2", "trainer.val_every=null", "trainer.progress=false", f"hydra.run.dir={tmp_path}/run",
              f"checkpoint.dir={tmp_path}/ckpt", cwd=tmp_path)
    assert out.returncode == 1
    assert out.stderr == (f"safeloop: SafeloopError: metrics could not be written to {tmp_path}/run/metrics.csv (No "
                          "space left on device); the rows written before are intact. Free some space, or give the "
                          "run another directory (run_dir=..., on the command line hydra.run.dir=PATH)\n")
    assert not list(tmp_path.glob("ckpt/*.pt"))


def test_the_entry_point_returns_the_monitored_metric_as_a_float_for_a_sweeper():
    from safeloop.__main__ import task
    from safeloop.state import TrainState
    from safeloop.sweeps import Result

    small = ["trainer.max_steps=6", "trainer.val_every=3", "data.n_train=256", "data.n_val=64", "threads=null",
             "device=cpu"]
    value = task(compose(small))
    assert isinstance(value, float) and value.metrics.keys() == {"loss", "val_loss"}
    logged = [row for row in csv.DictReader(open("safeloop_runs/latest/metrics.csv")) if row["metric"] == "val_loss"]
    assert logged[-1]["step"] == "6" and value == pytest.approx(float(logged[-1]["value"]), rel=1e-5)
    with pytest.raises(ConfigError, match=re.escape("the run monitors 'val_acc', which validation does not report: it "
                                                    "reports val_loss; give monitor=<one of those>")):
        task(compose([*small, "monitor=val_acc", "+run_dir=acc"]))  # at the validation before training
    with pytest.raises(ConfigError, match=re.escape("the run monitors 'los', which validation does not report: it "
                                                    "reports loss, val_loss")):
        task(compose([*small, "monitor=los", "+run_dir=los"]))  # a training loss's name is known once there is one
    # a run that did not validate: its final training loss (their sum, for several losses)
    state = TrainState(losses={"g": torch.tensor(1.5), "d": torch.tensor(0.25)})
    assert Result.of(state, "val_loss") == 1.75 and Result.of(state, "d") == 0.25  # or the loss it names


def test_callbacks_early_stopping_watches_the_runs_monitor():
    from safeloop import EarlyStopping
    from safeloop.config import build

    trainer = build(compose(["callbacks=early_stopping", "monitor=val_mae", "callbacks.early_stopping.patience=5",
                             "device=cpu"]))
    [stopper] = [c for c in trainer.callbacks if isinstance(c, EarlyStopping)]
    assert isinstance(stopper, EarlyStopping) and (stopper.monitor, stopper.patience) == ("val_mae", 5)
    with pytest.raises(ConfigError, match=re.escape("callbacks.early_stopping.patience='many' is a str; give an "
                                                    "integer")):
        compose(["callbacks=early_stopping", "callbacks.early_stopping.patience=many"])


def installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:  # its package is not there either
        return False


@pytest.mark.skipif(not installed("hydra_plugins.hydra_optuna_sweeper"),
                    reason="needs Hydra's Optuna sweeper: pip install 'safeloop[optuna]'")
def test_an_optuna_sweep_of_4_trials_minimises_the_monitored_metric_each_run_returns(tmp_path):
    out = cli("-m", "hydra/sweeper=optuna", "hydra.sweeper.n_trials=4", "hydra.sweeper.sampler.seed=0",
              "optimizer.lr=interval(0.0001,0.3)", "trainer.max_steps=60", "hydra.sweep.dir=sweep", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    rows = [line.split("|") for line in (tmp_path / "sweep" / "summary.md").read_text().splitlines()[2:]]
    val_losses = {float(row[2].strip().removeprefix("optimizer.lr=")): float(row[-2]) for row in rows}
    assert len(val_losses) == 4
    best = re.search(r"best_value: (\S+)", (tmp_path / "sweep" / "optimization_results.yaml").read_text())
    # Optuna read each run's val_loss (the monitored metric the command returns) and kept the best trial
    assert float(best.group(1)) == pytest.approx(min(val_losses.values()), abs=5e-5)  # the table's 4 digits
    assert min(val_losses.values()) < max(val_losses.values())


def test_a_run_directory_another_run_holds_is_refused_before_hydra_writes_into_it(tmp_path):
    """Hydra writes each run's ``.hydra/`` (its config, overrides) before the task starts: a second run given the
    same ``hydra.run.dir`` would have replaced the first's record of what it ran before the Trainer refused it."""
    from safeloop.checkpoint import lock, release

    run_dir = tmp_path / "run"
    (run_dir / ".hydra").mkdir(parents=True)
    (run_dir / ".hydra" / "config.yaml").write_text("the first run's config\n")
    held = lock(run_dir, RuntimeError)  # this process is the run that holds it
    try:
        out = cli(f"hydra.run.dir={run_dir}", "trainer.max_steps=2", cwd=tmp_path)
    finally:
        release(held)
    assert out.returncode == 1, out.stderr
    assert re.fullmatch(rf"safeloop: SafeloopError: run directory {re.escape(str(run_dir))} is in use by another run "
                        rf"\(process {os.getpid()} on \S+, since [\d-]+ [\d:]+\): two runs writing there would "
                        r"interleave their metrics\.csv\. Give this run its own run directory \(run_dir=\.\.\., or "
                        r"hydra\.run\.dir=\.\.\. on the command line\), or wait until that run ends\n", out.stderr)
    assert (run_dir / ".hydra" / "config.yaml").read_text() == "the first run's config\n"
    assert sorted(p.name for p in run_dir.iterdir()) == [".hydra", ".lock"]
    assert sorted(p.name for p in (run_dir / ".hydra").iterdir()) == ["config.yaml"]
    out = cli(f"hydra.run.dir={run_dir}", "trainer.max_steps=2", cwd=tmp_path)  # free once that run let go
    assert out.returncode == 0, out.stderr


@pytest.mark.parametrize("sweep, message", [
    (("trainer.log_every=5,lots",), "trainer.log_every=lots: Value 'lots' of type 'str' could not be converted to "
                                    "Integer; give trainer.log_every a value of that type"),
    (("optimizer=adam,sgd", "optimizer.lr=range(0.1,0.3,0.1)", "guard.check=auto,sometimes"),
     "guard.check='sometimes' is not one of auto, always, off"),
    (("optimizer=sgd,adamm",), "optimizer=adamm: optimizer has no option 'adamm'; did you mean optimizer=adam? "
                               "options: adam, adamw, sgd"),
])
def test_a_sweep_with_a_bad_value_is_refused_before_its_first_run_trains(tmp_path, sweep, message):
    """Each value of each swept key is composed before the sweep starts: a bad one a later run would meet stops
    the sweep before the runs before it train, in safeloop's words."""
    out = cli("-m", *sweep, "trainer.max_steps=2", cwd=tmp_path)
    assert out.returncode == 2, out.stderr
    assert out.stderr.startswith(f"safeloop: invalid configuration: {message}"), out.stderr
    assert len(out.stderr.strip().splitlines()) == 1, out.stderr
    assert not (tmp_path / "multirun").exists() and not (tmp_path / "outputs").exists()
