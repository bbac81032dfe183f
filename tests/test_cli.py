"""What ``python -m safeloop`` says at the command line: real subprocesses."""
import subprocess
import sys

import pytest
import torch

from safeloop import ConfigError
from safeloop.config import compose

from .conftest import subprocess_env


def cli(*args, cwd, prefix=("-m", "safeloop")) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *prefix, *args], cwd=cwd, env=subprocess_env(), capture_output=True,
                          text=True, timeout=180)


@pytest.mark.parametrize("override, message", [
    pytest.param("device=cuda", "trainer.device='cuda' asks for CUDA, but torch.cuda.is_available() is False",
                 marks=pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")),
    pytest.param("trainer.precision=16", "trainer.precision=16 needs CUDA (it uses a GradScaler); on CPU use precision=bf16 "
                 "or 32", marks=pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")),
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


def test_a_run_composes_its_config_three_times_and_logs_to_safeloop_log(tmp_path):
    """The config is composed three times: once by safeloop's check of the overrides (a bad one gets
    safeloop's message and exit code 2), twice by ``@hydra.main`` (the first to read ``hydra.mode``);
    counted on Hydra's real loader."""
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
    assert "composed 3" in out.stdout
    assert (tmp_path / "run" / "safeloop.log").exists() and not (tmp_path / "run" / "__main__.log").exists()
