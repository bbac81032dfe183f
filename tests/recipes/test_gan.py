"""recipes/gan.py: alternating manual-mode GAN on a ring of 8 Gaussians."""
import re

import torch

from tests.recipes._run import assert_same, run, straight_and_resumed


def test_shortened_gan_run_covers_most_modes_with_good_samples(tmp_path):
    # Half the default run; the default (2000 steps) covers at least 7 of the 8 modes.
    proc = run(["recipes/gan.py", "trainer.max_steps=1000"], tmp_path)
    found = re.search(r"modes covered: (\d)/8; high-quality samples \(within 3 std of a mode\): (\d+)%", proc.stdout)
    assert found, proc.stdout[-2000:]
    covered, good = int(found[1]), int(found[2])
    assert covered >= 6 and good >= 34, proc.stdout[-2000:]


def test_gan_runs_from_the_main_cli_and_logs_each_loss(tmp_path):
    proc = run(["-m", "safeloop", "experiment=gan", "trainer.max_steps=6", "trainer.log_every=3"], tmp_path)
    assert "modes covered: " in proc.stdout
    rows = (tmp_path / "run" / "metrics.csv").read_text().splitlines()
    # each loss by name, with each optimizer's learning rate
    assert [row.rsplit(",", 1)[0] for row in rows[1:]] == ["3,d", "3,g", "3,lr_d", "3,lr_g"] + \
        ["6,d", "6,g", "6,lr_d", "6,lr_g"]
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert not (tmp_path / "run" / "gan.png").exists()
        assert f"pip install matplotlib to have it drawn to {tmp_path / 'run' / 'gan.png'}" in proc.stdout
    else:
        assert (tmp_path / "run" / "gan.png").stat().st_size > 0
        assert f"scatter plot: {tmp_path / 'run' / 'gan.png'}" in proc.stdout


def test_gan_coverage_counts_modes_and_samples_near_them():
    from safeloop.recipes.gan import coverage, ring_modes

    centers = ring_modes(8, 2.0)
    near_two = torch.cat([centers[0] + 0.01 * torch.randn(50, 2), centers[3] + 0.01 * torch.randn(50, 2)])
    assert coverage(near_two, centers, std=0.05) == (2, 1.0)
    assert coverage(torch.zeros(10, 2), centers, std=0.05) == (0, 0.0)  # the ring's centre is no mode


def test_gan_resumed_in_a_new_process_is_bit_identical_to_a_run_that_never_stopped(tmp_path, one_thread):
    # 4 batches an epoch: stopped 2 batches into the second epoch, whose order depends on the epoch
    straight, resumed = straight_and_resumed(tmp_path, "gan", 12, "data.n=2048", "data.batch_size=512",
                                             "recipe.samples=100")
    assert resumed["state"]["step"] == 12 and resumed["data"]["iterable"] == {"epoch": 2, "batch": 4}
    for key in ("modules", "optimizers", "state", "data"):  # weights, both Adams' moments, position
        assert_same(resumed[key], straight[key], key)


def test_gan_runs_under_bf16(tmp_path):
    # the G step's fresh D(fake) sees D's updated weights (the autocast cache is cleared after D's step)
    proc = run(["recipes/gan.py", "trainer.max_steps=20", "trainer.log_every=10", "trainer.precision=bf16",
                "recipe.samples=100"], tmp_path)
    assert "modes covered: " in proc.stdout
    rows = (tmp_path / "run" / "metrics.csv").read_text().splitlines()
    assert len([row for row in rows if row.startswith(("20,d,", "20,g,"))]) == 2, rows
