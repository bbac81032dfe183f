"""What a run shows: a plain script (no Hydra, output piped) prints its progress and where its
outputs go, or that none are written (the command line's lines: tests/test_config.py)."""
import subprocess
import sys
import textwrap

import torch

from safeloop import Trainer, curves

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
