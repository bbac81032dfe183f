"""benchmarks.run's verdict: a quick run reports a missed target, a full run fails on one."""
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
