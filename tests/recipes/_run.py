"""Running a recipe the way a user does: its script, or the main CLI, in a fresh process."""
import subprocess
import sys

from tests.conftest import ROOT, subprocess_env


def run(args, tmp_path, check=True):
    """``python ARGS hydra.run.dir=<tmp>/run`` from the repository root; returns the completed process."""
    proc = subprocess.run([sys.executable, *args, f"hydra.run.dir={tmp_path / 'run'}", "trainer.progress=false"],
                          cwd=ROOT, env=subprocess_env(), capture_output=True, text=True, timeout=120)
    if check:
        assert proc.returncode == 0, proc.stderr[-3000:]
    return proc
