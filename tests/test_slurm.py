"""SLURM (``safeloop.slurm``): rank and world from srun's variables, SIGUSR1 saves after the step and requeues.

No SLURM here: its variables are set as srun sets them, and ``scontrol`` is a small script on PATH that
records its arguments (and, as SLURM does once it has requeued a running job, sends SIGTERM to its caller).
"""
from __future__ import annotations

import csv
import logging
import os
import signal
import socket
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from safeloop import Callback, slurm
from safeloop.checkpoint import Checkpointer, load
from safeloop.config import compose, train

from .checkpoint_job import make
from .conftest import subprocess_env

TASK = {"SLURM_JOB_ID": "4242", "SLURM_JOB_NAME": "train", "SLURM_NTASKS": "1", "SLURM_PROCID": "0",
        "SLURM_LOCALID": "0", "SLURM_NODELIST": "localhost"}


# -- rank, world, rendezvous -----------------------------------------------------------------------
@pytest.mark.parametrize("nodelist, first", [
    ("node7", "node7"), ("node[01-03,7]", "node01"), ("node[1,3-4]", "node1"), ("n[5]", "n5"), ("a1,b2", "a1"),
    ("gpu2-[10-12]", "gpu2-10"), ("rack[1-2]-gpu[3-4],x9", "rack1-gpu3"), ("node[001-003],other[1-2]", "node001"),
    ("host0 host1", "host0")])
def test_the_first_host_of_a_slurm_host_list(nodelist, first):
    assert slurm.first_host(nodelist) == first


def test_a_task_srun_started_gets_torchruns_variables_from_slurms():
    env = {"SLURM_NTASKS": "8", "SLURM_PROCID": "5", "SLURM_LOCALID": "1", "SLURM_NODEID": "2",
           "SLURM_NODELIST": "gpu[017-020]", "SLURM_JOB_ID": "7123456", "SLURM_JOB_NAME": "train"}
    assert slurm.torchrun_env(env) == {"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "MASTER_ADDR": "gpu017",
                                       "MASTER_PORT": "18456"}  # Lightning's port: 15000 + the id's last 4 digits
    given = {**env, "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500"}  # set by the user: they win
    assert (slurm.torchrun_env(given)["MASTER_ADDR"], slurm.torchrun_env(given)["MASTER_PORT"]) == ("10.0.0.1", "29500")
    without_id = {k: v for k, v in env.items() if k != "SLURM_JOB_ID"}
    assert slurm.torchrun_env(without_id)["MASTER_PORT"] == "12910"
    environ = dict(env)
    assert slurm.adopt(environ) == slurm.torchrun_env(env) and environ["RANK"] == "5"


@pytest.mark.parametrize("why, change", [
    ("torchrun started it", {"RANK": "0", "WORLD_SIZE": "2"}),
    ("an interactive job (srun --pty bash)", {"SLURM_JOB_NAME": "bash"}),
    ("an interactive job by name", {"SLURM_JOB_NAME": "interactive"}),
    ("one task", {"SLURM_NTASKS": "1"}),
    ("no task of srun's (salloc's shell)", {"SLURM_PROCID": None}),
    ("no SLURM", {"SLURM_NTASKS": None, "SLURM_PROCID": None})])
def test_torchrun_interactive_jobs_and_one_task_are_left_as_they_are(why, change):
    env = {"SLURM_NTASKS": "2", "SLURM_PROCID": "1", "SLURM_LOCALID": "1", "SLURM_NODELIST": "a1", "SLURM_JOB_ID": "9"}
    env = {k: v for k, v in {**env, **change}.items() if v is not None}
    environ = dict(env)
    assert slurm.torchrun_env(env) == {} and slurm.adopt(environ) == {} and environ == env, why


def test_scontrol_is_given_the_job_id_or_for_an_array_task_array_job_and_task():
    assert slurm.job_id({"SLURM_JOB_ID": "4242"}) == "4242"
    assert slurm.job_id({"SLURM_JOB_ID": "4243", "SLURM_ARRAY_JOB_ID": "4240", "SLURM_ARRAY_TASK_ID": "3"}) == "4240_3"


# -- SIGUSR1: save after the step, requeue ------------------------------------------------------------
def fake_scontrol(directory: Path, body: str = "", on_path: bool = True) -> Path:
    """An ``scontrol`` that appends its arguments to ``directory/calls``, then runs ``body``."""
    (directory / "bin").mkdir(exist_ok=True)
    script = directory / "bin" / "scontrol"
    script.write_text(f'#!/bin/sh\necho "$@" >> "{directory}/calls"\n{body}\n')
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    return directory / "calls"


class SendAt(Callback):
    def __init__(self, step: int, signum: int = slurm.REQUEUE_SIGNAL):
        self.step, self.signum, self.handler = step, signum, None

    def on_step_end(self, trainer, losses):
        self.handler = signal.getsignal(signal.SIGUSR1)
        if trainer.state.step == self.step:
            os.kill(os.getpid(), self.signum)


@pytest.fixture
def in_a_job(monkeypatch, tmp_path):
    """This process as a one-task SLURM job, with the fake scontrol on PATH; SIGTERM's handler put back."""
    for key, value in TASK.items():
        monkeypatch.setenv(key, value)
    calls = fake_scontrol(tmp_path)
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}{os.pathsep}{os.environ['PATH']}")
    before = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGUSR1)
    yield calls
    signal.signal(signal.SIGTERM, before[0])
    assert signal.getsignal(signal.SIGUSR1) == before[1]


def test_sigusr1_in_a_job_saves_after_the_step_and_rank_zero_requeues_it(in_a_job, tmp_path, caplog):
    trainer = make(tmp_path / "ckpt", 50, resume="auto", callbacks=[SendAt(3)])
    with caplog.at_level(logging.INFO, logger="safeloop"):
        state = trainer.fit()
    assert (state.step, trainer.stop_signal) == (3, signal.SIGUSR1)
    assert [p.name for p in Checkpointer(tmp_path / "ckpt").saved()] == ["step-000000003.pt"]
    assert in_a_job.read_text() == "requeue 4242\n"
    assert "requeued the job (scontrol requeue 4242)" in caplog.text and "step 3" in caplog.text
    assert signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL  # the SIGTERM of the requeue is bypassed


def test_an_array_task_is_requeued_as_array_job_and_task(in_a_job, tmp_path, monkeypatch):
    monkeypatch.setenv("SLURM_ARRAY_JOB_ID", "4240")
    monkeypatch.setenv("SLURM_ARRAY_TASK_ID", "2")
    make(tmp_path / "ckpt", 50, resume="auto", callbacks=[SendAt(2)]).fit()
    assert in_a_job.read_text() == "requeue 4240_2\n"


@pytest.mark.parametrize("settings, said", [
    ({"requeue": False}, None),
    ({}, "without trainer.resume=auto it would start over")])  # the requeued job would start over: not requeued
def test_without_requeue_or_resume_auto_it_saves_and_stops_and_requeues_nothing(in_a_job, tmp_path, caplog,
                                                                                 settings, said):
    with caplog.at_level(logging.INFO, logger="safeloop"):
        trainer = make(tmp_path / "ckpt", 50, callbacks=[SendAt(4)], **settings)
        trainer.fit()
    assert (trainer.state.step, trainer.stop_signal) == (4, signal.SIGUSR1)
    assert [p.name for p in Checkpointer(tmp_path / "ckpt").saved()] == ["step-000000004.pt"]
    assert not in_a_job.exists()
    assert (said in caplog.text and "scontrol requeue 4242" in caplog.text) if said else "scontrol" not in caplog.text


def test_only_rank_zero_requeues_and_every_rank_then_ignores_the_sigterm_that_ends_the_job(in_a_job):
    from lightning_utilities.core.rank_zero import rank_zero_only  # put back by conftest's fixture

    rank_zero_only.rank = 1
    assert slurm.after_preemption(True, True, 8, os.environ) is False and not in_a_job.exists()
    assert signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL
    rank_zero_only.rank = 0
    assert slurm.after_preemption(True, True, 8, os.environ) is True and in_a_job.read_text() == "requeue 4242\n"


@pytest.mark.parametrize("how", ["fails", "missing"])
def test_a_failed_or_missing_scontrol_is_a_warning_naming_the_command_and_the_checkpoint_is_written(
        in_a_job, tmp_path, monkeypatch, caplog, how):
    if how == "fails":
        fake_scontrol(tmp_path, 'echo "slurm_requeue error: Access/permission denied" >&2; exit 1')
    else:
        monkeypatch.setenv("PATH", str(tmp_path / "nowhere"))
    before = signal.getsignal(signal.SIGTERM)
    with caplog.at_level(logging.WARNING, logger="safeloop"):
        trainer = make(tmp_path / "ckpt", 50, resume="auto", callbacks=[SendAt(3)])
        trainer.fit()
    assert [p.name for p in Checkpointer(tmp_path / "ckpt").saved()] == ["step-000000003.pt"]
    assert "`scontrol requeue 4242` failed" in caplog.text and "the job is not requeued" in caplog.text
    assert ("exit code 1: slurm_requeue error: Access/permission denied" if how == "fails" else "No such file") \
        in caplog.text
    assert signal.getsignal(signal.SIGTERM) == before  # no requeue: SIGTERM stops the next fit as always


@pytest.mark.parametrize("name", [None, "bash"])
def test_outside_a_job_or_in_an_interactive_one_sigusr1_is_not_taken(monkeypatch, tmp_path, name):
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    if name is not None:
        for key, value in {**TASK, "SLURM_JOB_NAME": name}.items():
            monkeypatch.setenv(key, value)
    before = signal.getsignal(signal.SIGUSR1)
    seen = SendAt(0)
    make(tmp_path / "ckpt", 2, callbacks=[seen]).fit()
    assert seen.handler == before


# -- real processes ---------------------------------------------------------------------------------
def job_env(tmp_path: Path, **slurm_vars: str) -> dict:
    return {**subprocess_env(), **TASK, **slurm_vars, "CUDA_VISIBLE_DEVICES": "",
            "PATH": f"{tmp_path / 'bin'}{os.pathsep}{os.environ['PATH']}"}


def last_logged_step(metrics: Path) -> int:
    if not metrics.exists():
        return 0
    with open(metrics) as f:
        return max((int(row["step"]) for row in csv.DictReader(f) if (row.get("step") or "").isdigit()), default=0)


def test_the_command_line_preempted_by_sigusr1_saves_requeues_exits_138_and_resumes_bit_identically(
        tmp_path, one_thread):
    steps = 200
    calls = fake_scontrol(tmp_path, 'kill -TERM "$PPID"')  # SLURM ends the job it requeued
    common = ["checkpoint.every=null", "trainer.resume=auto", "trainer.device=cpu", "trainer.val_every=null",
              "trainer.log_every=1", "trainer.progress=false", f"trainer.max_steps={steps}"]
    run_dir = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-m", "safeloop", f"hydra.run.dir={run_dir}",
                             f"checkpoint.dir={tmp_path / 'ckpt'}", *common], cwd=tmp_path,
                            env=job_env(tmp_path), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 60
        while last_logged_step(run_dir / "metrics.csv") < 3:
            assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read()
            time.sleep(0.005)
        proc.send_signal(signal.SIGUSR1)
        output = proc.communicate(timeout=60)[0]
    finally:
        proc.kill()
    assert proc.returncode == 128 + signal.SIGUSR1, output
    assert "SIGUSR1 received" in output and "requeued the job (scontrol requeue 4242)" in output, output
    assert "SIGTERM after the requeue: ignored" in output and "stopped by signal 10" in output, output
    assert calls.read_text() == "requeue 4242\n"
    saved = Checkpointer(tmp_path / "ckpt").saved()
    stopped = last_logged_step(run_dir / "metrics.csv")
    assert [p.name for p in saved] == [f"step-{stopped:09d}.pt"] and 3 <= stopped < steps  # after the step it was in

    # the requeued job runs the same command (here in this process, as python -m safeloop does)
    resumed = train(compose([f"checkpoint.dir={tmp_path / 'ckpt'}", *common]))
    assert resumed.state.step == steps
    straight = train(compose([f"checkpoint.dir={tmp_path / 'straight'}", *common]))
    for a, b in zip(resumed.model.parameters(), straight.model.parameters(), strict=True):
        assert torch.equal(a, b)
    assert load(tmp_path / "ckpt" / f"step-{steps:09d}.pt")["optimizers"]["optimizer"]["state"][0]["step"] == steps


def free_port_from_job_id() -> str:
    """A job id whose Lightning port (15000 + its last 4 digits) is free now."""
    for offset in range(1000, 10000, 37):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", 15000 + offset))
            except OSError:
                continue
        return f"77{offset:04d}"
    pytest.skip("no free port in 16000-24999")


JOB = """
import os
import sys
import torch
import torch.distributed as dist
from safeloop import Callback
from tests.checkpoint_job import make

class Ready(Callback):
    def on_step_end(self, trainer, losses):
        if trainer.state.step == 3:
            open(f"ready{dist.get_rank()}", "w").write(str(os.getpid()))

trainer = make(sys.argv[1], 100000, resume="auto", val_every=None, checkpoint={"dir": sys.argv[1]}, callbacks=[Ready()])
trainer.fit()
torch.save({"world": dist.get_world_size(), "batches": len(trainer.train_data), "signal": trainer.stop_signal,
            "step": trainer.state.step, "params": [p.detach() for p in trainer.model.parameters()]},
           f"rank{dist.get_rank()}.pt")
"""


def test_two_tasks_as_srun_starts_them_train_as_two_ranks_and_sigusr1_stops_both_and_rank_zero_requeues(tmp_path):
    """Two processes started as srun starts them (SLURM_PROCID 0 and 1): one gloo group of 2, each rank on its
    half of the data, the same weights. SIGUSR1 to both (as --signal sends it to every task) stops both after
    the same step, with one checkpoint (rank zero's) and one requeue (rank zero's)."""
    (tmp_path / "job.py").write_text(JOB)
    calls = fake_scontrol(tmp_path, 'kill -TERM "$PPID"')
    job = free_port_from_job_id()
    procs = [subprocess.Popen([sys.executable, "job.py", str(tmp_path / "ckpt")], cwd=tmp_path,
                              env=job_env(tmp_path, SLURM_JOB_ID=job, SLURM_NTASKS="2", SLURM_PROCID=str(rank),
                                          SLURM_LOCALID=str(rank), SLURM_NTASKS_PER_NODE="2"),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for rank in (0, 1)]
    try:
        deadline = time.monotonic() + 60
        while not all((tmp_path / f"ready{rank}").exists() for rank in (0, 1)):
            assert all(p.poll() is None for p in procs) and time.monotonic() < deadline, [p.poll() for p in procs]
            time.sleep(0.01)
        for p in procs:
            p.send_signal(signal.SIGUSR1)
        outputs = [p.communicate(timeout=60)[0] for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert [p.returncode for p in procs] == [0, 0], outputs
    rank0, rank1 = (torch.load(tmp_path / f"rank{r}.pt") for r in (0, 1))
    assert rank0["world"] == rank1["world"] == 2
    assert rank0["batches"] == rank1["batches"] == 7  # 200 samples: 100 a rank, in batches of 16
    assert all(torch.equal(a, b) for a, b in zip(rank0["params"], rank1["params"], strict=True))
    assert rank0["signal"] == rank1["signal"] == signal.SIGUSR1
    step = rank0["step"]
    assert rank1["step"] == step and step % 8 == 0  # the ranks agree on a stop every 8 steps
    assert [p.name for p in Checkpointer(tmp_path / "ckpt").saved()] == [f"step-{step:09d}.pt"]
    assert calls.read_text() == f"requeue {job}\n"
    assert "requeued the job" in outputs[0] and "SIGTERM after the requeue: ignored" in outputs[0], outputs[0]


@pytest.mark.parametrize("by_srun, message", [
    (True, "srun started this task as SLURM_LOCALID=2, but this node has 2 CUDA devices: each task trains on the "
           "GPU of its local rank. Start at most 2 tasks per node (#SBATCH --ntasks-per-node=2, and as many GPUs: "
           "--gpus-per-node=2), or use device=cpu (gloo)"),
    (False, "torchrun started this process as LOCAL_RANK=2, but this machine has 2 CUDA devices: each process "
            "trains on the GPU of its local rank. Launch at most 2 processes per machine (--nproc-per-node=2), or "
            "use device=cpu (gloo)"),
])
def test_more_tasks_than_gpus_on_a_node_is_said_in_the_words_of_what_started_them(by_srun, message):
    """The check itself runs with CUDA only (tests/test_cuda.py, under torchrun); its words are the launcher's."""
    from safeloop.distributed import too_many_processes

    assert too_many_processes(2, 2, by_srun) == message
