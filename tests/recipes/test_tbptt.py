"""recipes/tbptt.py: an RNN over a long sequence in chunks, hidden state carried with .detach()."""
import re

import pytest
import torch

from safeloop import CarriedGraphError
from tests.recipes._run import assert_same, run, straight_and_resumed
from tests.test_cli import library_frames


def test_tbptt_script_trains_with_the_detached_hidden_state(tmp_path):
    proc = run(["recipes/tbptt.py", "trainer.max_steps=30", "trainer.log_every=10"], tmp_path)
    found = re.search(r"next-value MSE: ([\d.e-]+) at step 1 -> ([\d.e-]+) at step 30", proc.stdout)
    assert found, proc.stdout[-2000:]
    assert float(found[2]) < float(found[1])


def test_carrying_the_hidden_state_with_its_graph_is_a_carried_graph_error_from_the_cli(tmp_path):
    proc = run(["-m", "safeloop", "experiment=tbptt", "recipe.detach_hidden=false", "trainer.max_steps=5"],
               tmp_path, check=False)
    assert proc.returncode == 1
    # the node that made the hidden state: the GRU's own on cuDNN, the stack of its layers' states elsewhere
    assert re.match(r"safeloop: CarriedGraphError: graph carried over from an earlier step \(step 2, loss 'loss'\): "
                    r"the loss reaches (StackBackward0|CudnnRnnBackward0), created during an earlier step and held by "
                    r"`self.hidden`", proc.stderr), proc.stderr[-3000:]
    assert f"Graph picture: {tmp_path / 'run' / 'graphs'}" in proc.stderr
    # its message, not a traceback through safeloop and Hydra: the error is raised outside the user's code
    assert "HYDRA_FULL_ERROR" not in proc.stderr and "Traceback" not in proc.stderr
    assert not library_frames(proc.stderr)


def test_carried_graph_error_names_the_hidden_state_and_the_fix():
    from safeloop.recipes.tbptt import SequenceModel, TBPTTTrainer, signal

    torch.manual_seed(0)
    trainer = TBPTTTrainer(model=SequenceModel(hidden=16), train_data=signal(length=4000, chunk=20).train,
                           optimizer=lambda p: torch.optim.Adam(p, lr=1e-3), max_steps=3, detach_hidden=False,
                           device="cpu", progress=False, loggers=())
    with pytest.raises(CarriedGraphError, match=re.escape(
            "(step 2, loss 'loss'): the loss reaches StackBackward0, created during an earlier step and held by "
            "`self.hidden`")) as err:
        trainer.fit()
    assert "`self.hidden = self.hidden.detach()`" in str(err.value)
    assert trainer.state.step == 1


def test_tbptt_resumed_in_a_new_process_is_bit_identical_to_a_run_that_never_stopped(tmp_path, one_thread):
    # 9 chunks a pass: stopped 3 chunks into the second pass, with a hidden state carried into the next chunk
    straight, resumed = straight_and_resumed(tmp_path, "tbptt", 24, "data.length=2000", "data.streams=4")
    assert resumed["state"]["step"] == 24 and resumed["data"]["iterable"] == {"batch": 6}
    assert resumed["tbptt"]["hidden"].shape == (1, 4, 64)
    for key in ("modules", "optimizers", "state", "data", "tbptt"):  # weights, Adam's moments, position, hidden
        assert_same(resumed[key], straight[key], key)


def test_tbptt_trains_under_bf16(tmp_path):
    proc = run(["recipes/tbptt.py", "trainer.max_steps=30", "trainer.log_every=10", "trainer.precision=bf16"],
               tmp_path)
    found = re.search(r"next-value MSE: ([\d.e-]+) at step 1 -> ([\d.e-]+) at step 30", proc.stdout)
    assert found and float(found[2]) < float(found[1]), proc.stdout[-2000:]
