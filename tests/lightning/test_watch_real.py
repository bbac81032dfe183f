"""``python -m safeloop.watch`` on a script that trains with pytorch_lightning's own Trainer (``scripts/``): correct
modules train as without watch (one process, Lightning's DDP launcher, its ``ddp_spawn``), a graph built in
``__init__`` is stopped at step 1 in every rank, named as the script's variables reach it, and a running sum of the
losses kept on the module is warned as a leak."""
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("pytorch_lightning")

from tests.conftest import subprocess_env  # noqa: E402
from tests.watch.forked import ABORTED  # noqa: E402

SCRIPT = str(Path(__file__).parent / "scripts" / "lit_regression.py")
REUSED = ("GraphReuseError: graph built before the step is reused (step 1, loss 'loss'): the loss reaches "
          "SumBackward0, built before the step (before the loop) and held by `model.prior` (its graph saves tensors in "
          "PowBackward0)")


def run(*args: str, watch: bool, cwd: Path) -> subprocess.CompletedProcess:
    """The script's run; run again once where it aborted at exit as Lightning's DDP launch sometimes does under load,
    with or without watch, after the training printed its result ("terminate called without an active
    exception", SIGABRT, in a thread torn down at interpreter exit)."""
    command = [sys.executable, *(["-m", "safeloop.watch"] if watch else []), SCRIPT, *args]
    for _ in range(2):
        proc = subprocess.run(command, cwd=cwd, env=subprocess_env(), capture_output=True, text=True, timeout=300)
        aborted = proc.returncode == -6 and ABORTED in proc.stderr
        if not (aborted and proc.stdout):
            break
    return proc


@pytest.mark.parametrize("args", [("auto",), ("manual",), ("auto", "2", "ddp"), ("auto", "2", "ddp_spawn")],
                         ids=["automatic", "manual", "ddp", "ddp_spawn"])
def test_a_correct_lightning_module_trains_under_watch_as_without_it(tmp_path, args):
    bare, watched = run(*args, watch=False, cwd=tmp_path), run(*args, watch=True, cwd=tmp_path)
    assert bare.returncode == 0, bare.stderr[-2000:]
    assert (watched.returncode, watched.stdout) == (0, bare.stdout), watched.stderr[-2000:]
    # the guard's messages (Lightning prints warnings without their category)
    said = ("safeloop", "autograd graph kept alive", "gradient that no optimizer uses", "graph built before the step")
    assert not any(words in watched.stderr for words in said), watched.stderr[-2000:]


@pytest.mark.parametrize("args", [("prior",), ("prior", "2", "ddp")], ids=["one process", "ddp"])
def test_a_graph_built_in_init_is_stopped_at_step_one_in_every_rank(tmp_path, args):
    bare = run(*args, watch=False, cwd=tmp_path)
    # PyTorch's error at step 2: "backward through the graph a second time"; under DDP, whose broadcast at start-up
    # writes the weights in place, "modified by an inplace operation" at step 1
    assert bare.returncode == 1 and re.search("a second time|modified by an inplace operation", bare.stderr)
    watched = run(*args, watch=True, cwd=tmp_path)
    assert watched.returncode == 1
    assert watched.stderr.count(REUSED) == (2 if "ddp" in args else 1), watched.stderr[-3000:]


def test_losses_summed_on_the_module_with_their_graphs_are_warned(tmp_path):
    """Lightning prints warnings its own way (no category name), at the script's ``trainer.fit`` line."""
    watched = run("total", watch=True, cwd=tmp_path)
    assert watched.returncode == 0, watched.stderr[-2000:]
    assert watched.stderr.count("autograd graph kept alive after its step (step 2): steps 1 and 2: the autograd graphs "
                                "of both steps are still alive, held by `model.total`") == 1, watched.stderr[-2000:]
