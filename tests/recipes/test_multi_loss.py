"""recipes/multi_loss.py: three losses on a shared trunk, sequential with auto retain, and sum."""
from tests.recipes._run import assert_same, run, straight_and_resumed


def test_sequential_retains_only_for_the_loss_that_shares_the_trunk(tmp_path):
    proc = run(["recipes/multi_loss.py", "trainer.max_steps=15", "trainer.val_every=15", "trainer.log_every=5"],
               tmp_path)
    out = proc.stdout
    assert "multi_loss=sequential, loss weights {'recon': 0.5}" in out
    assert "steps walked by the guard (first: step 1): retained the graph for reg\n" in out
    assert "validation: val_recon" in out and "val_reg" in out and "val_cls" in out


def test_sum_from_the_main_cli_needs_no_retain(tmp_path):
    proc = run(["-m", "safeloop", "experiment=multi_loss", "trainer.multi_loss=sum", "trainer.max_steps=10",
                "trainer.val_every=10"], tmp_path)
    assert "multi_loss=sum" in proc.stdout
    assert "one backward per step (of the weighted sum): no graph had to be retained" in proc.stdout


def test_multi_loss_trains_under_bf16(tmp_path):
    proc = run(["recipes/multi_loss.py", "trainer.max_steps=15", "trainer.val_every=15", "trainer.log_every=5",
                "trainer.precision=bf16"], tmp_path)
    assert "validation: val_recon" in proc.stdout


def test_multi_loss_resumed_in_a_new_process_is_bit_identical_to_a_run_that_never_stopped(tmp_path, one_thread):
    # 4 batches an epoch: stopped 2 batches into the second epoch, whose order depends on the epoch
    straight, resumed = straight_and_resumed(tmp_path, "multi_loss", 12, "data.n_train=512", "data.n_val=128",
                                             "trainer.val_every=null", "model.hidden=16")
    for key in ("modules", "optimizers", "data"):  # weights, Adam's moments, position
        assert_same(resumed[key], straight[key], key)
    assert resumed["state"]["step"] == 12 and resumed["data"]["iterable"] == {"epoch": 2, "batch": 4}
    assert [v[0] for v in resumed["state"]["val_history"]] == [0, 6, 12]  # the stopped run validated at its end
    del resumed["state"]["val_history"][1]
    assert_same(resumed["state"], straight["state"], "state")


def test_under_torchrun_each_rank_trains_its_own_equal_share_of_the_samples():
    from safeloop.recipes.multi_loss import tasks

    data = tasks(n_train=1000, n_val=64, batch_size=100)
    shards = [data.train.shard(rank, 2) for rank in (0, 1)]
    assert [len(shard) for shard in shards] == [5, 5]  # as many steps on every rank: each step all-reduces
    seen = [{tuple(x.tolist()) for batch in shard for x in batch[0]} for shard in shards]
    assert len(seen[0]) == len(seen[1]) == 500 and not seen[0] & seen[1]
    assert seen[0] | seen[1] == {tuple(x.tolist()) for x in data.train.tensors[0]}
