"""Running a recipe the way a user does: its script, or the main CLI, in a process of its own, forked from one that
imported torch once (``tests.forkserver``: what ``python ARGS`` would be, without a new interpreter's start-up)."""
import sys

import torch

from safeloop.checkpoint import Checkpointer, load
from safeloop.config import compose, train
from tests import forkserver
from tests.conftest import ROOT, subprocess_env


def run(args, tmp_path, check=True):
    """``python ARGS hydra.run.dir=<tmp>/run`` from the repository root; returns the completed process."""
    proc = forkserver.run([sys.executable, *args, f"hydra.run.dir={tmp_path / 'run'}", "trainer.progress=false"],
                          cwd=ROOT, env=subprocess_env(), timeout=120)
    if check:
        assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def straight_and_resumed(tmp_path, experiment: str, steps: int, *overrides: str) -> tuple[dict, dict]:
    """The last checkpoints of ``experiment`` trained for ``steps`` steps here, and of the same run
    stopped halfway here, then resumed by its script in a new process (use the ``one_thread``
    fixture: bit-identical comparisons need the same thread count on both sides)."""
    common = [f"experiment={experiment}", "trainer.progress=false", *overrides]
    for name, n in (("straight", steps), ("stopped", steps // 2)):
        trainer = train(compose([*common, f"trainer.max_steps={n}", f"checkpoint.dir={tmp_path / name}",
                                 f"+run_dir={tmp_path / name}"]))
    run([f"recipes/{experiment}.py", f"trainer.max_steps={steps}", "trainer.resume=auto",
         f"checkpoint.dir={tmp_path / 'stopped'}", *overrides], tmp_path)
    saved = tuple(load(Checkpointer(tmp_path / name).saved()[-1]) for name in ("straight", "stopped"))
    if trainer.device.type == "cpu":  # CUDA's RNG states are saved where the process has a CUDA context: here if
        for ckpt in saved:  # an earlier test in this worker made one, never in the resumed run's fresh process;
            ckpt["data"].get("epoch_start", {}).pop("cuda", None)  # a CPU run draws nothing from them
    return saved


def assert_same(a, b, where: str = "checkpoint") -> None:
    """``a`` and ``b`` hold the same values: tensors bit for bit, containers item by item."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and torch.equal(a, b), f"{where} differs"
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), f"{where} keys differ: {sorted(a)} vs {sorted(b)}"
        for key in a:
            assert_same(a[key], b[key], f"{where}[{key!r}]")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), f"{where} lengths differ"
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{where}[{i}]")
    else:
        assert a == b, f"{where}: {a!r} vs {b!r}"
