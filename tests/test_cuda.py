"""What a CUDA run relies on (skipped without CUDA): the Trainer computes what the hand-written loop computes,
a step does not wait for the GPU except where the docs say, the guard names the same mistakes, a failed step
changes nothing, a checkpoint made on the GPU resumes on the GPU and on the CPU, and the commands run."""
import copy
import re
import subprocess
import sys
import textwrap
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

from safeloop import CarriedGraphError, ConfigError, GraphReuseError, NonFiniteError, Trainer
from safeloop.models import MLP

from .checkpoint_job import make
from .conftest import ROOT, manual, subprocess_env
from .test_errors import Poisoned, same, snapshot

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def loader(n: int = 256) -> DataLoader:
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(n, 8, generator=gen)
    return DataLoader(TensorDataset(x, x.sum(1, keepdim=True).sin()), batch_size=16)


def cuda_trainer(cls=Trainer, model=None, **settings) -> Trainer:
    torch.manual_seed(3)
    model = model if model is not None else MLP(8, 32, 1, depth=3).cuda()
    settings = {"max_steps": 16, "device": "cuda", "progress": False, "loggers": (), **settings}
    return cls(model=model, train_data=loader(), optimizer=lambda p: torch.optim.Adam(p, lr=1e-3), **settings)


@pytest.mark.parametrize("mode", ["automatic", "manual"])
def test_cuda_steps_are_bit_identical_to_the_hand_written_loop(mode):
    trainer = cuda_trainer(Trainer if mode == "automatic" else manual(Trainer))
    ref = copy.deepcopy(trainer.model)
    opt = torch.optim.Adam(ref.parameters(), lr=1e-3)
    for x, y in loader():  # 16 batches
        opt.zero_grad(set_to_none=True)
        F.mse_loss(ref(x.cuda()), y.cuda()).backward()
        opt.step()
    trainer.fit()
    assert all(torch.equal(a, b) for a, b in zip(ref.parameters(), trainer.model.parameters()))


class TwoLosses(Trainer):
    def training_step(self, batch):
        x, y = batch
        out = self.model(x)
        return {"fit": F.mse_loss(out, y), "small": out.pow(2).mean()}


def syncs_per_step(trainer: Trainer) -> dict[int, int]:
    """Host syncs (torch.cuda's sync debug mode) from each step's start to the next one's, by step number."""
    starts = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.on_step_start = lambda: starts.append(sum("synchroniz" in str(w.message) for w in caught))
        torch.cuda.set_sync_debug_mode("warn")
        try:
            trainer.fit()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return {step: b - a for step, (a, b) in enumerate(zip(starts, starts[1:]), start=1)}


@pytest.mark.parametrize("cls, settings", [
    (Trainer, {}),
    (manual(Trainer), {}),
    (Trainer, {"grad_accum": 2}),
    (TwoLosses, {}),
], ids=["automatic", "manual", "accumulation", "two-losses"])
def test_a_cuda_step_does_not_wait_for_the_gpu_between_logged_steps(cls, settings):
    per_step = syncs_per_step(cuda_trainer(cls, max_steps=12, log_every=5, **settings))
    unlogged = {step: n for step, n in per_step.items() if step % 5}
    assert unlogged and not any(unlogged.values()), f"host syncs by step: {per_step}"


def test_checking_every_step_waits_for_the_gpu_once_per_step_whatever_the_number_of_parameters():
    # check=always compares each parameter's fingerprint (prints.py) on the GPU and reads the answers at once
    per_step = syncs_per_step(cuda_trainer(max_steps=12, log_every=5, guard={"check": "always"},
                                           model=MLP(8, 32, 1, depth=6).cuda()))
    assert max(n for step, n in per_step.items() if step % 5) == 1, f"host syncs by step: {per_step}"


def test_the_nonfinite_check_waits_for_the_gpu_once_per_update():
    per_step = syncs_per_step(cuda_trainer(max_steps=12, log_every=5, on_nonfinite="skip"))
    assert {n for step, n in per_step.items() if step % 5} == {1}, f"host syncs by step: {per_step}"


@pytest.mark.parametrize("mode", ["automatic", "manual"])
def test_a_nan_on_the_gpu_stops_the_step_before_anything_changes(mode):
    cls = type("P", (Poisoned,), {"nan_at": (4,)})
    t = cuda_trainer(cls if mode == "automatic" else manual(cls), on_nonfinite="error")
    with pytest.raises(NonFiniteError, match=r"step 4: loss 'loss' is nan"):
        t.fit()
    assert t.state.step == 3 and same(snapshot(t), t.before)


class Seed001(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.t = torch.nn.Parameter(torch.eye(2, device="cuda"))
        self.a = torch.nn.Parameter(torch.ones(2, device="cuda"))


class ReusesY(Trainer):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.y = self.model.t @ self.model.a

    def training_step(self, batch):
        x = torch.tensor([1.0, 0.0], device="cuda")
        return F.mse_loss(self.model.t @ (x + self.y), x)


def test_a_graph_reused_across_steps_on_the_gpu_is_named_before_any_gradient_changes():
    model = Seed001()
    with pytest.raises(GraphReuseError, match=r"recompute `self\.y` inside training_step"):
        ReusesY(model=model, train_data=[0] * 4, optimizer=lambda p: torch.optim.SGD(p, lr=0.1), max_steps=3,
                device="cuda", progress=False, loggers=()).fit()
    assert all(p.grad is None for p in model.parameters())
    assert torch.equal(model.t, torch.eye(2, device="cuda"))


def test_a_checkpoint_made_on_the_gpu_resumes_as_the_run_that_never_stopped(tmp_path):
    """Dropout draws from the CUDA generator: its state is in the checkpoint too."""
    straight = make(tmp_path / "straight", 18, device="cuda")
    straight.fit()
    make(tmp_path / "stopped", 9, device="cuda").fit()
    resumed = make(tmp_path / "stopped", 18, resume="auto", device="cuda")
    resumed.fit()
    assert resumed.state.step == 18
    assert all(torch.equal(a, b) for a, b in zip(straight.model.parameters(), resumed.model.parameters()))


def test_a_checkpoint_made_on_the_gpu_resumes_on_the_cpu(tmp_path):
    stopped = make(tmp_path, 9, device="cuda")
    stopped.fit()
    at_stop = [p.detach().cpu() for p in stopped.model.parameters()]
    resumed = make(tmp_path, 9, resume="auto", device="cpu")
    resumed.fit()  # nothing left to train: the parameters are the checkpoint's, on the CPU
    assert resumed.state.step == 9 and next(resumed.model.parameters()).device.type == "cpu"
    assert all(torch.equal(a, b) for a, b in zip(at_stop, resumed.model.parameters()))
    resumed.max_steps = 12
    resumed.fit()
    assert resumed.state.step == 12


@pytest.mark.parametrize("args", [["trainer.max_steps=20", "trainer.val_every=10"],
                                  ["experiment=gan", "trainer.max_steps=20"]], ids=["default", "gan"])
def test_the_command_line_trains_on_cuda(tmp_path, args):
    done = subprocess.run([sys.executable, "-m", "safeloop", "trainer.device=cuda", *args], cwd=tmp_path,
                          env=subprocess_env(), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "step-000000020.pt" in done.stdout  # the last checkpoint


SCRIPT = """
import torch, torch.nn.functional as F
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1)).cuda()
opt = torch.optim.Adam(model.parameters(), lr=1e-2)
x, y = torch.randn(64, 8, device="cuda"), torch.randn(64, 1, device="cuda")
{before}
for step in range(30):
    opt.zero_grad()
    loss = F.mse_loss(model(x){extra}, y)
    loss.backward()
    opt.step()
print(b"".join(p.detach().cpu().numpy().tobytes() for p in model.parameters()).hex())
"""


def test_watch_leaves_a_cuda_script_bit_identical_and_catches_its_reused_graph(tmp_path):
    fine, broken = tmp_path / "fine.py", tmp_path / "broken.py"
    fine.write_text(textwrap.dedent(SCRIPT.format(before="", extra="")))
    broken.write_text(textwrap.dedent(SCRIPT.format(before="shift = model[0].weight.pow(2).sum()", extra=" + shift")))

    def run(*args):
        return subprocess.run([sys.executable, *args], cwd=tmp_path, env=subprocess_env(), capture_output=True,
                              text=True, timeout=300)

    plain, watched = run(str(fine)), run("-m", "safeloop.watch", str(fine))
    assert plain.returncode == 0 and watched.returncode == 0, watched.stderr[-3000:]
    assert watched.stdout == plain.stdout
    caught = run("-m", "safeloop.watch", str(broken))
    assert caught.returncode != 0 and "shift" in caught.stderr, caught.stderr[-3000:]


def test_a_carried_cudnn_gru_state_is_named_before_backward():
    """cuDNN's GRU node saves no cell state: the guard looks past that empty slot to the buffers backward freed."""
    from safeloop.recipes.tbptt import SequenceModel, TBPTTTrainer, signal

    trainer = TBPTTTrainer(model=SequenceModel(hidden=16), train_data=signal(length=4000, chunk=20).train,
                           optimizer=lambda p: torch.optim.Adam(p, lr=1e-3), max_steps=3, detach_hidden=False,
                           device="cuda", progress=False, loggers=())
    with pytest.raises(CarriedGraphError, match=r"\(step 2, loss 'loss'\): the loss reaches CudnnRnnBackward0, "
                                                r"created during an earlier step and held by `self\.hidden`"):
        trainer.fit()
    assert trainer.state.step == 1


def test_a_gpu_this_machine_does_not_have_is_named_with_the_ones_it_has():
    count = torch.cuda.device_count()
    with pytest.raises(ConfigError, match=re.escape(f"device='cuda:{count}': this machine has {count} CUDA device")
                       + r"s? \(cuda:0\.\.cuda:" + str(count - 1) + r"\); choose one of them, or use device=cuda"):
        cuda_trainer(device=f"cuda:{count}")


@pytest.mark.distributed
@pytest.mark.skipif(torch.cuda.device_count() > 1, reason="needs fewer GPUs than torchrun's processes")
def test_torchrun_with_more_processes_than_gpus_says_how_many_to_launch(tmp_path):
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                           "-m", "safeloop", "trainer.device=cuda", "trainer.max_steps=2"], cwd=tmp_path,
                          env=subprocess_env(), capture_output=True, text=True, timeout=300)
    assert done.returncode != 0
    assert ("torchrun started this process as LOCAL_RANK=1, but this machine has 1 CUDA device: each process trains "
            "on the GPU of its local rank. Launch at most 1 process per machine (--nproc-per-node=1), or use "
            "device=cpu (gloo)") in done.stderr, done.stderr[-3000:]


@pytest.mark.distributed
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs: one per torchrun process")
def test_sharded_training_on_two_gpus_matches_one_process_and_resumes_bit_identically(tmp_path):
    from tests import fsdp_cases
    cases = ("fsdp", "user", "manual_gan", "bf16", "resume-fsdp")
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                           str(ROOT / "tests" / "fsdp_cases.py"), str(tmp_path), *cases], cwd=tmp_path,
                          env={**subprocess_env(), "FSDP_CASES_DEVICE": "cuda"}, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    for case in cases[:-1]:
        single = fsdp_cases.result(case)  # one process, on the CPU
        tolerance = dict(rtol=2e-2, atol=2e-2) if case == "bf16" else dict(rtol=1e-4, atol=1e-5)
        for rank in (0, 1):
            ranked = torch.load(tmp_path / f"{case}_rank{rank}.pt")
            assert ranked["sharded"]
            for p, expected in zip(ranked["params"], single["params"], strict=True):
                torch.testing.assert_close(p, expected, **tolerance)
    for rank in (0, 1):
        resumed, straight = (torch.load(tmp_path / f"{name}_rank{rank}.pt") for name in ("resume-fsdp", "fsdp"))
        assert all(torch.equal(a, b) for a, b in zip(resumed["params"], straight["params"], strict=True))
