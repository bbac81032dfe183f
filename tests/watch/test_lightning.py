"""The guard for scripts that stay on Lightning, driven by the stand-in of ``lightning_like.py`` (Lightning's
automatic optimization, its DDP launcher and start-up broadcast): under ``python -m safeloop.watch``, and with
``GraphGuard.check`` in the module's ``on_before_backward``."""
from __future__ import annotations

import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

import safeloop
from safeloop import GraphReuseError
from tests.conftest import subprocess_env
from tests.watch.forked import run_all
from tests.watch.lightning_like import LightningModule, Trainer

SCRIPTS = Path(__file__).parent / "lightning_scripts"
REUSED = (r"GraphReuseError: graph built before the step is reused \(step 1, loss 'loss'\): the loss reaches "
          r"ExpBackward0, built before the step \(before the loop\) and held by `(self|model).scale`.*To fix: "
          r"recompute `(self|model).scale` inside the loop")


def run(*args: str, cwd: Path, watch: tuple[str, ...] | None = ()) -> subprocess.CompletedProcess:
    """``python [-m safeloop.watch *watch] *args`` (watch=None: without watch)."""
    command = [sys.executable, *(("-m", "safeloop.watch", *watch) if watch is not None else ()), *args]
    return subprocess.run(command, cwd=cwd, env=subprocess_env(), capture_output=True, text=True, timeout=120)


LAUNCH = ("import subprocess, sys\nimport torch\n\n"
          "if sys.argv[1:] == ['child']:\n"
          "    t = torch.eye(2, requires_grad=True)\n    a = torch.ones(2, requires_grad=True)\n    y = t @ a\n"
          "    for i in range(2):\n        loss = (t @ (torch.ones(2) + y)).sum()\n        loss.backward()\n"
          "else:\n"
          "    child = subprocess.run([sys.executable, '-u', __file__, 'child'], capture_output=True, text=True)\n"
          "    print('child exit code', child.returncode)\n    print(child.stderr)\n")


@pytest.fixture(scope="module")
def forked(tmp_path_factory) -> tuple[Path, dict[str, list[subprocess.CompletedProcess]]]:
    """The runs of the tests below, by test, in processes forked from one that imported torch (``forked.run_all``),
    and their directory (``launch.py`` there: a script that starts another)."""
    cwd = tmp_path_factory.mktemp("lightning")
    (cwd / "launch.py").write_text(LAUNCH)
    jobs = {  # each script: under watch with the graph of __init__, under watch and without it as it is
        "init": [job for script in ("plain.py", "train.py") for job in (
            ([str(SCRIPTS / script), "--scale-in-init", "exp"], True), ([str(SCRIPTS / script)], True),
            ([str(SCRIPTS / script)], False))],
        "launch": [([str(cwd / "launch.py")], False), (["--trace", str(cwd / "launch.py")], True)],
        **{f"broadcast-{check}": [(["--check", check, str(SCRIPTS / "train.py"), "--scale-in-init", "pow",
                                     "--strategy", "ddp", *more], True) for more in ((), ("--accumulate", "2"))]
           for check in ("auto", "off")}}
    results = iter(run_all([job for runs in jobs.values() for job in runs], cwd))
    return cwd, {name: [next(results) for _ in runs] for name, runs in jobs.items()}


def test_a_graph_built_in_init_is_reused_at_step_one_as_in_a_plain_loop_and_a_correct_module_stays_quiet(forked):
    """Lightning runs training_step inside optimizer.step(closure): the first step starts with the optimizer's
    step, not with the script, so a graph of __init__ is built before it (it was taken for a carried state, at
    step 2)."""
    scripts = ("plain.py", "train.py")
    for script, (proc, watched, plain) in zip(scripts, zip(*[iter(forked[1]["init"])] * 3)):
        assert proc.returncode == 1
        assert re.search(REUSED, proc.stderr.strip().splitlines()[-1]), proc.stderr[-2000:]
        assert f"lightning_scripts/{script}" in proc.stderr
        assert watched.returncode == plain.returncode == 0
        assert watched.stdout == plain.stdout and watched.stderr == plain.stderr == ""


def test_the_ranks_the_ddp_launcher_starts_as_python_script_are_watched_too(tmp_path):
    proc = run(str(SCRIPTS / "train.py"), "--scale-in-init", "exp", "--strategy", "ddp", "--devices", "2",
               cwd=tmp_path)
    assert proc.returncode == 1
    errors = [line for line in proc.stderr.splitlines() if "Error:" in line]
    assert len(errors) == 2 and all(re.search(REUSED, line) for line in errors), proc.stderr[-3000:]


def test_a_python_script_the_watched_script_starts_is_watched_with_the_same_settings(forked):
    """The child makes seed 001's mistake; started by the watched script, it stops at its first iteration."""
    script = forked[0] / "launch.py"
    plain, watched = forked[1]["launch"]
    assert plain.stdout.startswith("child exit code 1\n") and \
        "RuntimeError: Trying to backward through the graph a second time" in plain.stdout
    assert watched.returncode == 0, watched.stderr
    assert watched.stdout.startswith("child exit code 1\n")
    assert re.search(r"safeloop.errors.GraphReuseError: .*\(step 1, loss 'loss'\): the loss reaches MvBackward0, "
                     r"built before the step \(before the loop\) and held by `global y`; .*it was created at File "
                     rf"\"{re.escape(str(script))}\", line 7", watched.stdout), watched.stdout  # --trace reached it


@pytest.mark.parametrize("check", ["auto", "off"])
def test_weights_broadcast_in_place_after_a_graph_saved_them_are_named_as_such_not_cloned(forked, check):
    """DDP's constructor writes every parameter in place under no_grad before training: a graph built in
    __init__ that saved a weight fails in backward with PyTorch's in-place error, whose usual fix (.clone())
    does not apply."""
    broadcast = ("changed in place (optimizer steps update parameters in place, and so do writes under "
                 "torch.no_grad() or through .data, such as DDP's broadcast of the weights at start-up)")
    proc, accumulating = forked[1][f"broadcast-{check}"]  # the second: with gradient accumulation (below)
    error = proc.stderr.strip().splitlines()[-1]
    kind = "GraphReuseError" if check == "auto" else "InplaceModificationError"
    assert error.startswith(f"safeloop.errors.{kind}") and broadcast in error and ".clone()" not in error, error
    assert "recompute `self.scale` inside the loop" in error
    # with gradient accumulation the first backward runs before any optimizer step: the first step begins at the
    # script's call into Lightning (trainer.fit), as without, and the error is the same
    error = accumulating.stderr.strip().splitlines()[-1]
    assert error.startswith(f"safeloop.errors.{kind}") and broadcast in error and ".clone()" not in error, error
    assert "(step 1, loss 'loss')" in error and "recompute `self.scale` inside the loop" in error, error


class Checked(LightningModule):
    """As docs/guard.md shows it: the guard made when training starts, checking each loss before backward."""

    def __init__(self, scale_in_init: bool):
        super().__init__()
        self.layer = nn.Linear(4, 4)
        self.scale = self.layer.weight.sum(0).exp() if scale_in_init else None

    def on_train_start(self):
        self.graph_guard = safeloop.GraphGuard(self, self.trainer.optimizers)

    def on_before_backward(self, loss):
        self.graph_guard.check(loss)

    def training_step(self, batch, batch_idx):
        scale = self.scale if self.scale is not None else self.layer.weight.sum(0).exp()
        return (self.layer(batch) * scale).pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


def test_graph_guard_check_in_on_before_backward_catches_a_graph_of_init_and_leaves_a_correct_module_alone():
    data = [torch.randn(3, 4) for _ in range(4)]
    torch.manual_seed(0)
    with pytest.raises(GraphReuseError, match=re.escape("(step 1, loss 'loss'): the loss reaches ExpBackward0, built "
                                                        "before the step (before the loop) and held by `self.scale`")):
        Trainer(max_epochs=2).fit(Checked(scale_in_init=True), data)
    trained = []
    for check in (False, True):
        torch.manual_seed(0)
        model = Checked(scale_in_init=False)
        if not check:
            model.on_train_start = model.on_before_backward = lambda *_: None
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            Trainer(max_epochs=2).fit(model, data)
        trained.append(model.layer.weight.detach().clone())
    assert torch.equal(*trained)
