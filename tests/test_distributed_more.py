"""Under real ``torchrun`` (2 CPU processes, gloo): the non-finite policy when only one rank sees a NaN, precision,
resume of a run whose ranks draw their own random numbers or shuffle, BatchNorm statistics and validation metrics.

One launch runs every case of tests/ddp_more_cases.py. The ``xfail(strict=True)`` tests record where a torchrun run
differs from the one-process run: limits docs/distributed.md and docs/checkpoints.md state.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from tests import ddp_more_cases
from tests.conftest import ROOT
from tests.ddp_cases import val_dataset
from tests.test_distributed import torchrun

RESUMED = [f"{name}-{how}" for name in ddp_more_cases.RESUMED for how in ("straight", "resumed")]
# the cases whose failure is recorded as an error run last, class_metrics last of all
CASES = ("handwritten", "test_before_fit", "masked_nan", "masked_manual_gan", "fp16_nan", *RESUMED, "val_drop_last",
         "bf16", "batchnorm", "batchnorm_accum", "best_k", "unfreeze", "unfreeze_epoch", "unfreeze_epoch_accum",
         "freeze_at_start", "sparse_accum", "create_graph", "class_metrics")

pytestmark = pytest.mark.distributed


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("ddp_more")
    proc = torchrun(str(ROOT / "tests" / "ddp_more_cases.py"), str(out), *CASES, cwd=out)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return out


def load(ranks: Path, case: str) -> tuple[dict, dict]:
    return torch.load(ranks / f"{case}_rank0.pt"), torch.load(ranks / f"{case}_rank1.pt")


def same(a: list, b: list) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def test_a_nan_loss_with_finite_gradients_on_one_rank_is_skipped_on_every_rank(ranks):
    """docs/distributed.md: "on_nonfinite: skip skips the same step everywhere". A loss averaged over the batch's
    positives is NaN on a batch without any, and its gradient is zeros: nothing carries the NaN to rank 0."""
    rank0, rank1 = load(ranks, "masked_nan")
    single = ddp_more_cases.result("masked_nan")
    assert single["skipped"] == 1
    assert rank0["skipped"] == rank1["skipped"] == 1
    assert same(rank0["params"], rank1["params"]), "the ranks hold different weights"


def test_manual_mode_a_nan_loss_with_finite_gradients_on_one_rank_is_skipped_on_every_rank(ranks):
    """The masked loss of the test above in a manual-mode GAN (two optimizers): rank 1 alone skipping at
    ``self.step("d")`` left ``training_step`` while rank 0 went on into optimizer g's all-reduce (gloo aborted; with
    buckets of one size their gradients would have been added together)."""
    rank0, rank1 = load(ranks, "masked_manual_gan")
    assert rank0["skipped"] == rank1["skipped"] == ddp_more_cases.result("masked_manual_gan")["skipped"] == 1
    assert same(rank0["params"], rank1["params"])


def test_precision_16_a_nan_loss_on_one_rank_keeps_the_scale_and_the_weights_alike_on_every_rank(ranks):
    rank0, rank1 = load(ranks, "fp16_nan")
    single = ddp_more_cases.result("fp16_nan")
    assert single["skipped"] == 1 and single["scales"] == [65536.0] * 4
    assert rank0["scales"] == rank1["scales"], "the ranks' GradScalers hold different scales"
    assert rank0["skipped"] == rank1["skipped"]
    assert same(rank0["params"], rank1["params"]), "the ranks hold different weights"


def test_the_trainer_equals_a_hand_written_ddp_loop_bit_for_bit(ranks):
    """Through DistributedDataParallel (the usual run) and safeloop's own reducer (grad_accum=2, where the loop
    accumulates under no_sync), with and without grad_clip, in float32 and under precision=16 (GradScaler), over a
    shuffled pass and a half: the weights of pytorch/examples' ddp-tutorial-series loop on every rank."""
    for rank in (0, 1):
        equal = torch.load(ranks / f"handwritten_rank{rank}.pt")["equal"]
        assert equal == dict.fromkeys(ddp_more_cases.HAND, True)


def test_test_before_the_first_fit_evaluates_rank_zeros_weights_on_every_rank(ranks):
    """karpathy/nanoGPT train.py seeds each rank apart before making the model and relies on DDP's broadcast at
    construction, so its first estimate_loss() already runs rank zero's weights. docs/trainer.md: test() works
    before any fit(); docs/distributed.md: every rank gets rank zero's weights. The metric here is the mean of two
    different models' losses, neither the one that will be trained."""
    rank0, rank1 = load(ranks, "test_before_fit")
    single = ddp_more_cases.result("test_before_fit")  # rank zero's weights (seed 1337), every sample
    assert rank0["tested"] == rank1["tested"]
    assert rank0["tested"]["test_loss"] == pytest.approx(single["tested"]["test_loss"], rel=1e-5)


def test_predict_over_fewer_samples_than_ranks_returns_each_sample_once(ranks):
    """docs/trainer.md: under torchrun each rank returns the predictions of its own share (every world-th sample from
    its rank on); nothing is gathered. Rank 1's share of one sample is none; gathered, the ranks' predictions hold
    the sample twice."""
    rank0, rank1 = load(ranks, "test_before_fit")
    assert sum(rank0["predicted_one"]) + sum(rank1["predicted_one"]) == 1


def test_resumed_with_one_seed_for_every_rank_is_bit_identical_to_the_run_that_never_stopped(ranks):
    for rank in (0, 1):
        straight, resumed = (torch.load(ranks / f"rng_same-{how}_rank{rank}.pt") for how in ("straight", "resumed"))
        assert same(straight["params"], resumed["params"])


def test_resumed_with_a_grad_scaler_a_schedule_and_early_stopping_is_bit_identical(ranks):
    """precision=16 (the GradScaler's scale halves at step 2), a learning rate stepped every update, EarlyStopping
    (it stops both runs at step 4 of 6), checkpoint.monitor and dropout: stopped at step 3 and resumed on 2 ranks."""
    for rank in (0, 1):
        straight, resumed = (torch.load(ranks / f"stateful-{how}_rank{rank}.pt") for how in ("straight", "resumed"))
        assert straight["step"] == resumed["step"] == 4
        assert straight["scales"][-1] == resumed["scales"][-1] == 32768.0
        assert straight["val_history"] == resumed["val_history"]
        assert same(straight["params"], resumed["params"])


def test_resumed_with_one_seed_per_rank_is_bit_identical_to_the_run_that_never_stopped(ranks):
    """karpathy/nanoGPT train.py seeds each rank apart (``torch.manual_seed(1337 + seed_offset)``, the offset the
    rank) so that the ranks' dropout masks differ. docs/checkpoints.md: "A torchrun run resumed on as many ranks is
    bit-identical"."""
    for rank in (0, 1):
        straight, resumed = (torch.load(ranks / f"rng_resume-{how}_rank{rank}.pt") for how in ("straight", "resumed"))
        assert same(straight["params"], resumed["params"])


def test_a_shuffled_run_resumed_in_a_process_seeded_as_the_first_reads_the_same_batches(ranks):
    for rank in (0, 1):
        straight, resumed = (torch.load(ranks / f"shuffled_same_seed-{how}_rank{rank}.pt")
                             for how in ("straight", "resumed"))
        assert same(straight["params"], resumed["params"])


def test_a_shuffled_run_resumed_in_a_process_seeded_otherwise_reads_the_same_batches(ranks):
    """In one process the checkpoint's random state gives the resumed pass its order back whatever the process was
    seeded with (docs/trainer.md, Seeding: "A resumed run takes the random state its checkpoint saved instead");
    under torchrun the pass's order comes from the seed of the process that resumes."""
    straight, resumed = ddp_more_cases.result("shuffled-straight"), ddp_more_cases.result("shuffled-resumed")
    assert same(straight["params"], resumed["params"])  # one process: bit-identical
    for rank in (0, 1):
        straight, resumed = (torch.load(ranks / f"shuffled-{how}_rank{rank}.pt") for how in ("straight", "resumed"))
        assert same(straight["params"], resumed["params"])


def test_validation_with_drop_last_gives_the_metric_one_process_gets(ranks):
    """docs/distributed.md: "every rank gets the same metrics: the mean over all samples, as one process gets"."""
    rank0, rank1 = load(ranks, "val_drop_last")
    single = ddp_more_cases.result("val_drop_last")
    assert rank0["val_history"] == rank1["val_history"]
    for (_, ours), (_, theirs) in zip(rank0["val_history"], single["val_history"], strict=True):
        assert ours["val_loss"] == pytest.approx(theirs["val_loss"], rel=1e-5)


def test_bf16_mixed_under_ddp_agrees_with_one_process(ranks):
    rank0, rank1 = load(ranks, "bf16")
    single = ddp_more_cases.result("bf16")
    assert same(rank0["params"], rank1["params"])
    for ours, theirs in zip(rank0["params"], single["params"], strict=True):
        torch.testing.assert_close(ours, theirs, rtol=2e-2, atol=2e-3)


def validated_alone(record: dict) -> float:
    """val_loss of the model ``record`` holds (its parameters and buffers), over every validation sample in one
    process: what a checkpoint of it gives."""
    model = ddp_more_cases.batchnorm_model()
    with torch.no_grad():
        for mine, saved in zip([*model.parameters(), *model.buffers()], [*record["params"], *record["buffers"]],
                               strict=True):
            mine.copy_(saved)
    x, y = val_dataset().tensors
    with torch.no_grad():
        return F.mse_loss(model.eval()(x), y).item()


def test_batch_norm_statistics_through_safeloops_reducer_are_rank_zeros_and_validated_as_such(ranks):
    rank0, rank1 = load(ranks, "batchnorm_accum")
    assert same(rank0["buffers"], rank1["buffers"])
    assert rank0["val_history"][-1][1]["val_loss"] == pytest.approx(validated_alone(rank0), rel=1e-6)


def test_batch_norm_statistics_through_ddp_are_rank_zeros_and_validated_as_such(ranks):
    """safeloop's own reducer gives every rank rank zero's running statistics after each step (the test above); the
    usual run through DistributedDataParallel does not. The last validation's val_loss, which the final checkpoint
    and its best-k ranking hold, is then the metric of no checkpointed model."""
    rank0, rank1 = load(ranks, "batchnorm")
    assert same(rank0["params"], rank1["params"])
    assert same(rank0["buffers"], rank1["buffers"]), "rank 1 kept other running statistics than rank 0"
    assert rank0["val_history"][-1][1]["val_loss"] == pytest.approx(validated_alone(rank0), rel=1e-6)


def test_every_rank_names_the_same_best_checkpoint_after_fit(ranks):
    """docs/checkpoints.md: "trainer.checkpointer.best is its path". A script that tests the best model after
    fit() on every rank (trainer.test after loading it) needs every rank to name the same, existing file."""
    rank0, rank1 = load(ranks, "best_k")
    assert [s for s, _ in rank0["val_history"]] == [0, 2, 4]
    assert rank0["best"].endswith("step-000000004.pt") and rank0["best_exists"] and rank0["best_txt"] == \
        "step-000000004.pt"
    assert rank1["best"] == rank0["best"] and rank1["best_exists"]


def test_a_layer_unfrozen_for_a_second_fit_is_averaged_over_the_ranks(ranks):
    """docs/distributed.md: gradients are averaged over ranks, accumulation included, and a Trainer joins a process
    group the script made; docs/trainer.md names "a layer unfrozen for a later fit" as a use of a later fit(). Each
    rank here steps the unfrozen backbone with its own gradient, and the ranks' weights part."""
    rank0, rank1 = load(ranks, "unfreeze")
    single = ddp_more_cases.result("unfreeze")
    assert rank0["step"] == rank1["step"] == single["step"] == ddp_more_cases.STEPS
    assert same(rank0["params"], rank1["params"]), "the ranks hold different weights"
    for ours, theirs in zip(rank0["params"], single["params"], strict=True):
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)


def test_a_layer_unfrozen_during_fit_stops_the_step_on_every_rank_saying_to_unfreeze_between_fits(ranks):
    """In one process a layer unfrozen in on_epoch_start trains from then on (Lightning's BaseFinetuning). Under
    torchrun DistributedDataParallel averages the parameters that required grad when fit() began (a hand-written DDP
    loop has the same limit: DDP registers them when it is made), so each rank would step the unfrozen layer with its
    own gradient and the ranks' weights would part without a word. The first step that trains it stops instead, on
    every rank, before its update."""
    single = ddp_more_cases.result("unfreeze_epoch")
    assert single["error"] is None and single["step"] == 8
    rank0, rank1 = load(ranks, "unfreeze_epoch")
    for found in (rank0, rank1):
        assert found["step"] == 4, found["error"]
        assert "step 5: 4 model parameter(s) were unfrozen after fit() began (the first: 0.0.weight;" in \
            found["error"] and "call fit() again, which averages every parameter that requires grad then" in \
            found["error"], found["error"]
    assert same(rank0["params"], rank1["params"]), "the ranks hold different weights"


def test_a_layer_unfrozen_during_fit_with_accumulation_stops_the_step_too(ranks):
    """The same through safeloop's own reducer (``grad_accum=2``), whose buckets are made for the parameters that
    require grad when fit() starts."""
    single = ddp_more_cases.result("unfreeze_epoch_accum")
    assert single["error"] is None and single["step"] == 8
    for found in load(ranks, "unfreeze_epoch_accum"):
        assert found["step"] == 4, found["error"]
        assert "step 5: 4 model parameter(s) were unfrozen after fit() began" in found["error"], found["error"]


def test_layers_frozen_in_on_fit_start_are_refused_under_torchrun_saying_to_freeze_them_before_fit(ranks):
    """docs/trainer.md: a freeze "done in on_fit_start, the optimizer already holds the frozen layers" (one process:
    trains the head alone). Under torchrun DistributedDataParallel is built as fit() starts, before on_fit_start: the
    run stops at step 1, saying to freeze before fit() (the advice was to freeze, which had been done)."""
    single = ddp_more_cases.result("freeze_at_start")
    assert single["error"] is None and single["step"] == 8
    for found in load(ranks, "freeze_at_start"):
        assert "model parameter(s) were frozen after fit() began" in found["error"] and \
            "Under torchrun freeze them before calling fit()" in found["error"], found["error"]


def test_sparse_gradients_through_safeloops_all_reduce_are_refused_saying_which_run_takes_them(ranks):
    """nn.Embedding(sparse=True) trains in one process with grad_accum=2, and under torchrun without accumulation
    (DistributedDataParallel all-reduces sparse gradients). Through safeloop's own all-reduce (accumulation) every
    rank stops at step 1 saying so, not with torch's 'reshape is not implemented for sparse tensors'."""
    single = ddp_more_cases.result("sparse_accum")
    assert single["error"] is None
    for found in load(ranks, "sparse_accum"):
        assert "step 1: a sparse gradient (nn.Embedding(sparse=True)) cannot go through safeloop's all-reduce" in \
            found["error"] and "the usual run (automatic mode, one optimizer, no accumulation)" in found["error"], \
            found["error"]


@pytest.mark.filterwarnings("ignore:Using backward\\(\\) with create_graph=True:UserWarning")
def test_manual_backward_with_create_graph_is_refused_under_torchrun_saying_so(ranks):
    """docs/trainer.md: "for create_graph=True (AdaHessian, a gradient penalty), use manual mode and
    self.backward(loss, create_graph=True)". In one process it trains; under torchrun averaging the gradients would
    drop the graph an optimizer such as AdaHessian differentiates, so every rank stops at step 1 saying so (not with
    torch's 'cat(): functions with out=... arguments don't support automatic differentiation')."""
    single = ddp_more_cases.result("create_graph")
    assert single["error"] is None
    for found in load(ranks, "create_graph"):
        assert "step 1: a gradient with a graph (backward(create_graph=True)" in found["error"] and \
            "not supported under torchrun. It trains in one process" in found["error"], found["error"]


def test_ranks_that_log_different_metric_names_in_validation_are_told(ranks):
    """A per-class metric logged for the classes a batch holds: rank 0's share holds class a only, rank 1's class b
    only. docs/trainer.md: "Under torchrun every rank must log the same names"; a mistake should not pass silently."""
    rank0, rank1 = load(ranks, "class_metrics")
    for found in (rank0, rank1):
        assert ("validation_step reported other metrics on other ranks (rank 0: val_err_a, val_loss; rank 1: "
                "val_err_b, val_loss)") in found["error"], found["error"]
