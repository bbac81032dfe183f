"""benchmarks.run's verdict: a quick run reports a missed target, a full run fails on one; a benchmark that raises
fails the run, after the others have reported."""
from benchmarks import run
from benchmarks.common import row
from benchmarks.run import report


def test_a_quick_run_reports_a_missed_target_and_exits_0_a_full_run_exits_1(capsys):
    rows = [row("tiny MLP", 1.10, 1.0, 1.05), row("mid MLP", 1.0, 1.0, 1.02), row("non-finite", 1.2, 1.0, None)]
    assert report(rows, quick=True) == 0
    out, err = capsys.readouterr()
    assert "| tiny MLP | " in out and "≤ 1.05× ✗" in out
    assert err == "--quick: 1 row(s) over target (tiny MLP); a quick run's ratios are noisy, a full run decides\n"
    assert report(rows, quick=False) == 1
    assert report(rows[1:], quick=False) == 0


def test_a_benchmark_that_raises_costs_its_own_rows_only_and_the_run_exits_1(monkeypatch, capsys):
    """On a machine a benchmark was not tried on (a GPU machine's default FSDP2 mesh), the others still report."""
    class Breaks:
        def run(quick):
            raise RuntimeError("invalid device ordinal")

    class Works:
        def run(quick):
            return [row("mid MLP", 1.0, 1.0, 1.02)]

    modules = {"benchmarks.bench_fsdp": Breaks, "benchmarks.bench_gan": Works}
    monkeypatch.setattr(run.importlib, "import_module", modules.__getitem__)
    monkeypatch.setattr(run, "keep_freed_memory", lambda: True)  # (main's settings for a whole process: not here)
    monkeypatch.setattr(run.torch, "set_num_threads", lambda n: None)
    assert run.main(["--quick", "--only", "fsdp", "--only", "gan"]) == 1
    out, err = capsys.readouterr()
    assert "| mid MLP | " in out
    assert "RuntimeError: invalid device ordinal" in err and "failed, no rows: bench_fsdp (tracebacks above)" in err


def test_a_row_that_times_nothing_shows_a_dash_not_nan(capsys):
    """A memory ratio (FSDP2's state per rank, undo's snapshots) has no µs/step of either system."""
    memory = {"benchmark": "memory held", "safeloop_us": float("nan"), "reference_us": float("nan"), "ratio": 0.5,
              "target": 0.55, "ok": True}
    assert report([memory], quick=False) == 0
    assert "| memory held | — | — | 0.500× | ≤ 0.55× ✓ |" in capsys.readouterr().out
