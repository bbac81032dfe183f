"""Sharded training (FSDP2) under real ``torchrun`` (2 CPU processes, gloo), against one process.

Deselect with ``pytest -m "not distributed"``.
"""
from __future__ import annotations

import re
import time

import pytest
import torch

from safeloop import fsdp
from tests import fsdp_cases
from tests.conftest import ROOT
from tests.test_distributed import torchrun

pytestmark = [pytest.mark.distributed,
              pytest.mark.skipif(not fsdp.available(), reason="FSDP2 needs torch 2.6 or later")]
RESUMED = ("fsdp", "manual_gan")


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    """Every case of tests/fsdp_cases.py on 2 ranks, in two launches: ``killed`` (its rank zero dies), then the
    others, ``after-killed`` (the killed job run again) among them."""
    out = tmp_path_factory.mktemp("fsdp")
    for case in RESUMED:
        fsdp_cases.build(case, 1, max_steps=fsdp_cases.STEPS // 2,
                         checkpoint={"dir": str(out / f"one-process-{case}")}).fit()
    script = str(ROOT / "tests" / "fsdp_cases.py")
    killed = torchrun(script, str(out), "killed", cwd=out, timeout=90)
    assert killed.returncode != 0
    (out / "killed.txt").write_text(" ".join(sorted(p.name for p in (out / "killed").glob("step-*.pt"))))
    resumed = [f"{how}-{case}" for case in RESUMED for how in ("resume", "from-one-process")]
    proc = torchrun(script, str(out), *fsdp_cases.CASES, *resumed, "sharded-checkpoint", "undo", "prebuilt",
                    "precision16", "unsharded", "hand", "hand_through_data", "reused", "after-killed", cwd=out, timeout=240)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (out / "after-killed.txt").write_text(proc.stdout + proc.stderr)
    return out


def load(ranks, name: str) -> tuple[dict, dict]:
    return tuple(torch.load(ranks / f"{name}_rank{r}.pt") for r in (0, 1))


@pytest.mark.parametrize("case", fsdp_cases.CASES)
def test_sharded_ranks_end_with_the_parameters_of_one_process_over_the_same_global_batches(ranks, case):
    rank0, rank1 = load(ranks, case)
    single = fsdp_cases.result(case)
    assert rank0["sharded"] and rank1["sharded"] and not single["sharded"]
    tolerance = dict(rtol=2e-2, atol=2e-2) if case == "bf16" else dict(rtol=1e-5, atol=1e-6)
    for p0, p1, p in zip(rank0["params"], rank1["params"], single["params"], strict=True):
        assert torch.equal(p0, p1), "the ranks' gathered parameters differ"
        torch.testing.assert_close(p0, p, **tolerance)
    # a NaN loss on rank 1 alone: every rank skips that step, as one process does
    assert rank0["skipped"] == rank1["skipped"] == single["skipped"] == (1 if case == "nan_skip" else 0)


@pytest.mark.parametrize("case", ["hand", "hand_through_data"])
def test_graphguard_in_a_hand_written_fsdp2_loop_is_quiet_and_changes_nothing(ranks, case):
    """The guard's warnings are errors in that job (an unused-gradient warning there was a false alarm once). Sharded
    gradients cleared through ``.data`` are read by the guard shard by shard (a DTensor has no ``tolist()``)."""
    single = fsdp_cases.hand(1, through_data=case == "hand_through_data")
    for done in load(ranks, case):
        assert done["sharded"]
        for p, expected in zip(done["params"], single["params"], strict=True):
            torch.testing.assert_close(p, expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("case", RESUMED)
def test_a_sharded_run_resumed_from_its_checkpoint_is_bit_identical_to_one_that_never_stopped(ranks, case):
    for resumed, straight in zip(load(ranks, f"resume-{case}"), load(ranks, case)):
        assert all(torch.equal(a, b) for a, b in zip(resumed["params"], straight["params"], strict=True))


@pytest.mark.parametrize("case", RESUMED)
def test_a_sharded_checkpoint_holds_full_tensors_and_resumes_in_one_process(ranks, case):
    saved = torch.load(ranks / f"resume-{case}" / "step-000000002.pt", weights_only=True)
    assert all(type(t) is torch.Tensor for t in saved["modules"]["model"].values())
    straight = fsdp_cases.result(case)["params"]
    from_ranks = fsdp_cases.result(case, resume=str(ranks / f"resume-{case}"), checkpoint=False)["params"]
    for p, expected in zip(from_ranks, straight, strict=True):
        torch.testing.assert_close(p, expected, rtol=1e-5, atol=1e-6)


def test_with_sharded_checkpoints_each_rank_writes_its_shards_and_the_run_resumes_bit_identically(ranks):
    for resumed, straight in zip(load(ranks, "sharded-checkpoint"), load(ranks, "fsdp")):
        assert all(torch.equal(a, b) for a, b in zip(resumed["params"], straight["params"], strict=True))
    directory = ranks / "sharded-checkpoint"
    assert sorted(p.name for p in directory.iterdir() if not p.name.startswith(".")) == [
        "step-000000002.pt", "step-000000002.shards"]
    assert sorted(p.name for p in (directory / "step-000000002.shards").iterdir()) == [
        ".metadata", "__0_0.distcp", "__1_0.distcp"]
    saved = torch.load(directory / "step-000000002.pt", weights_only=True)  # shapes only: the values are shards
    assert all(t.is_meta for t in saved["modules"]["model"].values())


def test_a_sharded_checkpoint_resumes_in_one_process_and_a_damaged_shard_is_refused(ranks, tmp_path):
    import shutil

    from safeloop.errors import CheckpointError
    straight = fsdp_cases.result("fsdp")["params"]
    resumed = fsdp_cases.result("fsdp", resume=str(ranks / "sharded-checkpoint"), checkpoint=False)["params"]
    for p, expected in zip(resumed, straight, strict=True):
        torch.testing.assert_close(p, expected, rtol=1e-5, atol=1e-6)
    copy = shutil.copytree(ranks / "sharded-checkpoint", tmp_path / "copy")
    shard = copy / "step-000000002.shards" / "__1_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 1
    shard.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=re.escape(
            f"checkpoint {copy / 'step-000000002.pt'} cannot be used: its shard file {shard} does not match the "
            "checksum saved with it")):
        fsdp_cases.result("fsdp", resume=str(copy / "step-000000002.pt"), checkpoint=False)


@pytest.mark.parametrize("case", RESUMED)
def test_a_one_process_checkpoint_resumes_sharded(ranks, case):
    rank0, rank1 = load(ranks, f"from-one-process-{case}")
    straight = fsdp_cases.result(case)["params"]
    for p0, p1, p in zip(rank0["params"], rank1["params"], straight, strict=True):
        assert torch.equal(p0, p1)
        torch.testing.assert_close(p0, p, rtol=1e-5, atol=1e-6)


def test_a_sharded_job_killed_mid_run_and_run_again_with_resume_auto_ends_bit_identical(ranks):
    # rank zero died at step 3, before its checkpoint: the newest is step 2's
    assert (ranks / "killed.txt").read_text() == "step-000000001.pt step-000000002.pt"
    assert "resumed from" in (ranks / "after-killed.txt").read_text()
    for resumed, straight in zip(load(ranks, "after-killed"), load(ranks, "fsdp")):
        assert resumed["step"] == straight["step"] == fsdp_cases.STEPS
        assert all(torch.equal(a, b) for a, b in zip(resumed["params"], straight["params"], strict=True))


def test_a_failed_step_leaves_every_ranks_shards_and_optimizer_state_as_they_were(ranks):
    for done in load(ranks, "undo"):
        assert done["error"].startswith("step 3 failed and was abandoned (parameters and optimizer state are "
                                        "unchanged): RuntimeError: fails after d stepped"), done["error"]
        before, after = done["before"], done["after"]
        assert all(torch.equal(a, b) for a, b in zip(before["params"], after["params"], strict=True))
        assert before["d"]["state"].keys() == after["d"]["state"].keys()
        for i, entry in before["d"]["state"].items():
            assert all(torch.equal(entry[k], after["d"]["state"][i][k]) for k in entry)


def test_an_optimizer_built_before_the_trainer_shards_the_model_is_a_config_error_saying_what_to_pass(ranks):
    for error in load(ranks, "prebuilt"):
        assert error.startswith("invalid configuration: strategy=fsdp replaced the model's parameters with "
                                "sharded ones after the optimizer was built over the old ones: pass optimizer as a "
                                "callable"), error


def test_what_a_sharded_run_cannot_do_is_a_config_error_saying_what_to_do_instead(ranks):
    for error in load(ranks, "precision16"):
        assert error == ("invalid configuration: precision=16 (a GradScaler) does not work with a model sharded by "
                         "FSDP2: use precision=bf16-mixed (FSDP2 computes in bf16 and reduces gradients in float32) "
                         "or 32"), error
    for error in load(ranks, "unsharded"):
        assert error == ("invalid configuration: trainer.strategy=fsdp: configure_sharding(model) left no parameter "
                         "sharded; call torch.distributed.fsdp.fully_shard on the model's blocks and on the model "
                         "itself"), error


def test_a_loss_built_before_training_is_a_graph_reuse_error_at_step_1_on_both_ranks(ranks):
    for error in load(ranks, "reused"):
        assert error.startswith("graph built before the step is reused (step 1"), error


def test_an_error_on_one_rank_stops_both_promptly_and_is_shown(tmp_path):
    started = time.perf_counter()
    proc = torchrun(str(ROOT / "tests" / "fsdp_cases.py"), str(tmp_path), "fails_on_rank1", cwd=tmp_path, timeout=60)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert time.perf_counter() - started < 45
    assert "[rank1]: safeloop.errors.GraphReuseError: graph built before the step is reused (step 3" in out, out
    assert not list(tmp_path.glob("*.pt"))


def test_shards_of_a_save_cut_short_are_removed_when_a_run_takes_the_directory(tmp_path):
    left = tmp_path / ".step-000000007.shards.tmp"
    left.mkdir()
    (left / "__0_0.distcp").write_bytes(b"partial")
    fsdp_cases.build("fsdp", 1, max_steps=1, checkpoint={"dir": str(tmp_path), "sharded": True}).fit()
    assert sorted(p.name for p in tmp_path.iterdir() if p.name != ".lock") == ["step-000000001.pt"]
