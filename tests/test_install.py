"""``pip install .`` (a wheel, not an editable install) gives a working command from any directory."""
import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

from tests.conftest import ROOT

# .ci/run builds, installs and runs the wheel itself right after the suite: it sets this, to do it once
CHECKED_BY_CI = os.environ.get("SAFELOOP_CI_CHECKS_THE_WHEEL") == "1"


def run(*cmd, cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # nothing of the checkout importable
    env.setdefault("OMP_NUM_THREADS", "1")
    proc = subprocess.run([str(c) for c in cmd], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc


@pytest.mark.skipif(CHECKED_BY_CI, reason=".ci/run installs the wheel in a fresh virtualenv after the suite")
def test_the_wheel_installed_in_a_fresh_virtualenv_runs_the_cli_from_any_directory(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    for name in ("safeloop", "configs", "recipes"):  # safeloop/configs and safeloop/recipes are links
        shutil.copytree(ROOT / name, src / name, symlinks=True, ignore=shutil.ignore_patterns("__pycache__"))
    # the dependencies (torch first of all) come from this interpreter: only the wheel is installed
    run(sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", tmp_path / "dist", src,
        cwd=tmp_path)
    wheel, = (tmp_path / "dist").glob("safeloop-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert "safeloop/configs/train.yaml" in names and "safeloop/configs/experiment/gan.yaml" in names
    assert "safeloop/recipes/gan.py" in names
    assert not [n for n in names if n.split("/")[0] != "safeloop" and ".dist-info" not in n]

    venv = tmp_path / "venv"
    # no pip of its own: the one ensurepip brings comes with an old setuptools that would hide this one
    run(sys.executable, "-m", "venv", "--without-pip", venv, cwd=tmp_path)
    python, command = venv / "bin" / "python", venv / "bin" / "safeloop"
    run(sys.executable, "-m", "pip", "--python", python, "install", "--no-index", "--no-deps", "-q", wheel, cwd=tmp_path)
    # the dependencies (torch first of all) are this interpreter's: its site directories, added after the venv's
    # own; their .pth files are not read, so an editable safeloop installed there stays out of sight
    venv_site = Path(run(python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])", cwd=tmp_path)
                     .stdout.strip())
    here = {sysconfig.get_paths()[k] for k in ("purelib", "platlib")}
    (venv_site / "dependencies.pth").write_text("".join(f"{p}\n" for p in sorted(here)))
    site = Path(run(python, "-c", "import safeloop; print(safeloop.__file__)", cwd=tmp_path).stdout.strip()).parent
    assert site.is_relative_to(venv), site  # the installed copy, not the checkout
    assert not (site.parent / "recipes").exists()  # no top-level package named `recipes`

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    out = run(command, "trainer.max_steps=2", "trainer.val_every=null", "trainer.progress=false", cwd=elsewhere)
    assert "outputs: " in out.stdout
    out = run(python, "-m", "safeloop", "experiment=gan", "trainer.max_steps=2", "trainer.log_every=1",
              "trainer.progress=false", cwd=elsewhere)
    assert "outputs: " in out.stdout
    logs = list((elsewhere / "outputs").glob("*/*/safeloop.log"))
    assert len(logs) == 2
