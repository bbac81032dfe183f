"""Hydra workflows at the command line (``--config-dir``, ``--config-name``, ``hydra.job.chdir``, interpolations,
your own YAML files, a stopped run's advice): ``python -m safeloop`` in processes forked from one that imported torch
once (``tests.forkserver``); the stopped run is a real subprocess, stopped by a real SIGTERM."""
import signal
import subprocess
import sys

import pytest

from . import forkserver
from .conftest import subprocess_env

SMALL = ("trainer.max_steps=2", "trainer.val_every=null", "data.n_train=64", "data.n_val=32")


def cli(*args, cwd) -> subprocess.CompletedProcess:
    return forkserver.run([sys.executable, "-m", "safeloop", *args], cwd=cwd, env=subprocess_env(), timeout=180)


def one_message(out: subprocess.CompletedProcess) -> None:
    assert out.returncode == 2, out.stderr
    assert out.stderr.startswith("safeloop: invalid configuration: "), out.stderr
    assert "Traceback" not in out.stderr, out.stderr


@pytest.mark.xfail(strict=True, reason="train.yaml sets hydra.searchpath, which Hydra takes only from the primary "
                                       "config: a primary config of your own with defaults: [train] is refused "
                                       "(docs/configuration.md says so)")
def test_your_own_primary_config_extends_train_yaml(tmp_path):
    (tmp_path / "mycfg").mkdir()
    (tmp_path / "mycfg" / "mytrain.yaml").write_text("defaults:\n  - train\n  - _self_\n"
                                                     "trainer:\n  max_steps: 2\n  val_every: null\n")
    out = cli("--config-dir", "mycfg", "--config-name", "mytrain", "hydra.run.dir=run", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert (tmp_path / "run" / "checkpoints" / "step-000000002.pt").exists()


def test_a_mistyped_option_is_refused_with_config_dir_too_and_its_own_options_are_taken(tmp_path):
    (tmp_path / "mycfg" / "model").mkdir(parents=True)
    (tmp_path / "mycfg" / "model" / "narrow.yaml").write_text("_target_: safeloop.models.MLP\nhidden: 4\n")
    out = cli("--config-dir", "mycfg", "experiment=gann", "model=narrow", *SMALL, cwd=tmp_path)
    one_message(out)
    assert "experiment has no option 'gann'" in out.stderr and "narrow" not in out.stderr
    assert not (tmp_path / "outputs").exists()
    assert cli("-cd", "mycfg", "model=narrow", "hydra.run.dir=run", *SMALL, cwd=tmp_path).returncode == 0


def test_an_unset_environment_variable_is_one_message_naming_the_key(tmp_path):
    out = cli(*SMALL, "data.seed=${oc.env:SAFELOOP_TEST_UNSET_VARIABLE}", cwd=tmp_path)
    one_message(out)
    assert "data.seed" in out.stderr and "SAFELOOP_TEST_UNSET_VARIABLE" in out.stderr
    assert not (tmp_path / "outputs").exists()


def test_a_yaml_syntax_error_in_your_config_is_one_message_naming_the_file(tmp_path):
    (tmp_path / "configs" / "model").mkdir(parents=True)
    (tmp_path / "configs" / "model" / "broken.yaml").write_text("_target_: safeloop.models.MLP\nhidden: [8\n")
    out = cli("model=broken", *SMALL, cwd=tmp_path)
    one_message(out)
    assert "broken.yaml" in out.stderr
    assert not (tmp_path / "outputs").exists()


def test_the_same_command_resumes_under_hydra_job_chdir(tmp_path):
    args = (*SMALL, "hydra.job.chdir=True", "checkpoint.dir=ckpt/exp1", "trainer.resume=auto")
    assert cli(*args, cwd=tmp_path).returncode == 0
    out = cli(*args[1:], "trainer.max_steps=4", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert "resumed from" in out.stdout, out.stdout
    assert (tmp_path / "ckpt" / "exp1" / "step-000000004.pt").exists()


def test_a_stopped_runs_advice_names_what_resumes_it(tmp_path):
    env = {**subprocess_env(), "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "safeloop", "trainer.max_steps=1000000", "trainer.val_every=null",
                             "data.n_train=64", "data.n_val=32", "checkpoint.every=1000000"], cwd=tmp_path, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        for line in proc.stdout:
            if "validation at step 0" in line:
                break
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 143, err
    checkpoint = next((tmp_path / "outputs").glob("*/*/checkpoints/*.pt"))
    assert f"To continue, run the same command with trainer.resume=auto checkpoint.dir={checkpoint.parent}" in err, err
