"""Data-parallel runs under real ``torchrun`` (2 CPU processes, gloo), and Hydra sweeps.

Deselect the torchrun tests with ``pytest -m "not distributed"``.
"""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from tests import ddp_cases, forkserver
from tests.conftest import ROOT, subprocess_env

# sam: a two-phase update (SAM's closure) in manual mode; lbfgs: L-BFGS's closure in automatic mode
# manual_accum: manual mode accumulating over steps, so that its halfway checkpoint holds each rank's gradients
# accum_tail: grad_accum=2 over passes of 5 micro-batches: the last step of each pass takes the one left
# outside: a head kept on the Trainer, outside the model, made with other values on each rank
CASES = ("plain", "two_losses", "accum", "accum_tail", "gan", "manual_gan", "nan_skip", "unused", "sam", "lbfgs",
         "manual_accum", "outside")
RESUMED = ("plain", "manual_gan", "manual_accum", "outside")  # through DistributedDataParallel / safeloop's reducer


# --standalone: a free port of its own, so that runs on the same machine do not collide
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]


def cpu_env() -> dict:
    """These runs are 2 CPU processes (gloo): CUDA hidden, so that device=auto is the CPU on a GPU machine too."""
    return {**subprocess_env(), "CUDA_VISIBLE_DEVICES": ""}


def torchrun(*args: str, cwd: Path, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([*TORCHRUN, *args], cwd=cwd, env=cpu_env(), capture_output=True, text=True,
                          timeout=timeout)


@pytest.fixture(scope="module")
def ranks(jobs) -> Path:
    """Every case of tests/ddp_cases.py run once on 2 ranks (by the launch that runs JOBS after them); one file per
    case and rank. The RESUMED cases also stop halfway and resume, from their own checkpoint and from a one-process
    one."""
    return jobs


@pytest.mark.distributed
@pytest.mark.parametrize("case", CASES)
def test_ranks_agree_with_one_process_over_the_same_global_batches(ranks, case):
    rank0, rank1 = (torch.load(ranks / f"{case}_rank{r}.pt") for r in (0, 1))
    single = ddp_cases.result(case)
    # the usual run goes through DistributedDataParallel (several losses summed); the rest through safeloop's reducer
    assert rank0["ddp"] == rank1["ddp"] == (case in ("plain", "two_losses", "nan_skip", "unused", "lbfgs"))
    for p0, p1, p in zip(rank0["params"], rank1["params"], single["params"], strict=True):
        assert torch.equal(p0, p1), "ranks hold different parameters"
        torch.testing.assert_close(p0, p, rtol=1e-5, atol=1e-6)
    # the gradients every optimizer stepped with in step 1: the all-reduced mean equals one big batch's
    assert rank0["grads"].keys() == single["grads"].keys()
    for name, grad in single["grads"].items():
        torch.testing.assert_close(rank0["grads"][name], grad, rtol=1e-5, atol=1e-7)
        torch.testing.assert_close(rank1["grads"][name], grad, rtol=1e-5, atol=1e-7)
    # a NaN on one rank reaches every rank through the all-reduce: all skip the same step
    assert rank0["skipped"] == rank1["skipped"] == single["skipped"] == (1 if case == "nan_skip" else 0)


@pytest.mark.distributed
def test_a_rank_left_alone_in_a_collective_says_which_and_why(ranks):
    # rank 1 alone saves (state_dict() gathers every rank's random state and gradients); rank 0 has ended
    error = torch.load(ranks / "lone_save_rank1.pt")
    assert re.match(r"step 4: rank 1 of 2 could not gather every rank's random state and gradients for a checkpoint "
                    r"\(every rank calls Trainer\.state_dict\(\) together, as the Trainer's saves do: not under `if "
                    r"rank == 0`\) \(.*\)\. Every rank makes this call at the same point, and another did not", error), error


@pytest.mark.distributed
def test_ranks_check_the_same_steps_though_their_timings_differ(ranks):
    # rank 1's checks take 1 ms longer, so its own schedule would space them further apart
    checked0, checked1 = (torch.load(ranks / f"schedule_rank{r}.pt")["checked"] for r in (0, 1))
    assert checked0 == checked1
    assert checked0[:2] == [1, 2] and 4 <= len(checked0) < 60  # warm-up, then spaced, several times


@pytest.mark.distributed
def test_each_rank_validates_its_own_share_and_every_rank_gets_the_mean_over_all_samples(ranks):
    rank0, rank1 = (torch.load(ranks / f"validation_rank{r}.pt") for r in (0, 1))
    samples = sorted(ddp_cases.val_dataset().tensors[0][:, 0].tolist())
    # before training, at steps 2 and 4, and none after (step 4 is the last): each of the 37 samples on one rank
    assert [s for s, _ in rank0["validated"]] == [s for s, _ in rank1["validated"]] == [0, 2, 4]
    for (_, seen0), (_, seen1) in zip(rank0["validated"], rank1["validated"]):
        assert (len(seen0), len(seen1)) == (19, 18) and sorted(seen0 + seen1) == samples
    # the same metrics on both ranks: the mean over all samples, by hand before training, as one process gets after
    assert rank0["val_history"] == rank1["val_history"]
    x, y = ddp_cases.val_dataset().tensors
    with torch.no_grad():
        by_hand = torch.nn.functional.mse_loss(ddp_cases.build("validation", world=1).model(x), y).item()
    assert rank0["val_history"][0] == (0, {"val_loss": pytest.approx(by_hand, rel=1e-6)})
    single = ddp_cases.result("validation")["val_history"]
    assert [s for s, _ in single] == [0, 2, 4]
    for (_, ours), (_, theirs) in zip(rank0["val_history"], single, strict=True):
        assert ours["val_loss"] == pytest.approx(theirs["val_loss"], rel=1e-5)


@pytest.mark.distributed
def test_test_reduces_over_every_sample_and_predict_gives_each_rank_its_own_share(ranks):
    rank0, rank1 = (torch.load(ranks / f"validation_rank{r}.pt") for r in (0, 1))
    single = ddp_cases.result("validation")
    assert rank0["tested"] == rank1["tested"]  # the mean over all 37 samples, on every rank
    assert rank0["tested"]["test_loss"] == pytest.approx(single["tested"]["test_loss"], rel=1e-5)
    # every second sample from the rank's own on, in order (19 and 18 of 37); nothing gathered
    assert (len(rank0["predicted"]), len(rank1["predicted"])) == (19, 18)
    torch.testing.assert_close(rank0["predicted"], single["predicted"][0::2], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(rank1["predicted"], single["predicted"][1::2], rtol=1e-5, atol=1e-6)


@pytest.mark.distributed
def test_early_stopping_stops_every_rank_after_the_same_validation(ranks):
    rank0, rank1 = (torch.load(ranks / f"early_stop_rank{r}.pt") for r in (0, 1))
    assert rank0["step"] == rank1["step"] == ddp_cases.result("early_stop")["step"] == 4  # of max_steps=8
    assert [s for s, _ in rank0["val_history"]] == [0, 2, 4]


@pytest.mark.distributed
def test_a_run_of_whole_passes_ends_its_pass_and_logged_validation_metrics_are_means_over_all_samples(ranks):
    """max_steps a whole pass: the epoch scheduler steps and on_epoch_end runs once, after the last step, on every
    rank as in one process; a metric ``self.log``-ged in validation_step is its mean over all 37 samples;
    on_step_end sees the update's gradients, all-reduced: the same on every rank and as in one process."""
    rank0, rank1 = (torch.load(ranks / f"pass_end_rank{r}.pt") for r in (0, 1))
    single = ddp_cases.result("pass_end")
    assert rank0["ends"] == rank1["ends"] == single["ends"] == [(8, 5e-3)]
    assert [s for s, _ in rank0["step_end_grads"]] == [s for s, _ in single["step_end_grads"]] == list(range(1, 9))
    for (_, ours), (_, other), (_, theirs) in zip(rank0["step_end_grads"], rank1["step_end_grads"],
                                                  single["step_end_grads"], strict=True):
        assert all(g is not None for g in ours)
        assert all(torch.equal(a, b) for a, b in zip(ours, other, strict=True))
        torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-6)
    assert rank0["val_history"] == rank1["val_history"]
    x, y = ddp_cases.val_dataset().tensors
    with torch.no_grad():
        by_hand = (ddp_cases.build("pass_end", world=1).model(x) - y).abs().mean().item()
    assert rank0["val_history"][0][1]["val_abs"] == pytest.approx(by_hand, rel=1e-6)
    assert [s for s, _ in rank0["val_history"]] == [s for s, _ in single["val_history"]] == [0, 4, 8]
    for (_, ours), (_, theirs) in zip(rank0["val_history"], single["val_history"], strict=True):
        assert ours.keys() == theirs.keys() == {"val_loss", "val_abs"}
        assert all(ours[k] == pytest.approx(theirs[k], rel=1e-5) for k in ours)


@pytest.mark.distributed
def test_a_scheduler_stepped_by_the_users_code_too_stops_every_rank_at_the_same_step(ranks):
    rank0, rank1 = (torch.load(ranks / f"scheduler_twice_rank{r}.pt") for r in (0, 1))
    single = ddp_cases.result("scheduler_twice")
    assert rank0["error"] == rank1["error"] == single["error"]
    assert rank0["error"].startswith("step 3: the scheduler of optimizer 'optimizer' (StepLR) was stepped "
                                     "outside the Trainer"), rank0["error"]
    assert rank0["step"] == rank1["step"] == single["step"] == 2  # step 3 abandoned
    torch.testing.assert_close(rank0["params"], single["params"], rtol=1e-5, atol=1e-6)
    assert all(torch.equal(a, b) for a, b in zip(rank0["params"], rank1["params"]))


def params(path: Path) -> list[torch.Tensor]:
    return torch.load(path)["params"]


@pytest.mark.distributed
@pytest.mark.parametrize("case", RESUMED)
def test_resumed_under_torchrun_is_bit_identical_to_a_torchrun_run_that_never_stopped(ranks, case):
    for rank in (0, 1):
        resumed, straight = params(ranks / f"resume-{case}_rank{rank}.pt"), params(ranks / f"{case}_rank{rank}.pt")
        assert all(torch.equal(a, b) for a, b in zip(resumed, straight, strict=True))


@pytest.mark.distributed
@pytest.mark.parametrize("case", RESUMED)
def test_a_torchrun_checkpoint_resumes_in_one_process(ranks, case):
    saved = torch.load(ranks / f"resume-{case}" / "step-000000002.pt", weights_only=True)  # rank zero's
    # the user's module, not the DistributedDataParallel wrapper (and the head the optimizer trains outside it)
    assert list(saved["modules"]) == ["model"] + (["outside_modules"] if case == "outside" else [])
    straight = ddp_cases.result(case)["params"]
    # from a one-process checkpoint: bit-identical; from torchrun's: the same up to the all-reduce's summation order
    from_one = ddp_cases.result(case, resume=str(ranks / f"one-process-{case}"), checkpoint=False)["params"]
    assert all(torch.equal(a, b) for a, b in zip(from_one, straight, strict=True))
    from_ranks = ddp_cases.result(case, resume=str(ranks / f"resume-{case}"), checkpoint=False)["params"]
    for p, expected in zip(from_ranks, straight, strict=True):
        torch.testing.assert_close(p, expected, rtol=1e-5, atol=1e-6)


@pytest.mark.distributed
@pytest.mark.parametrize("case", RESUMED)
def test_a_one_process_checkpoint_resumes_under_torchrun(ranks, case):
    rank0, rank1 = (params(ranks / f"from-one-process-{case}_rank{r}.pt") for r in (0, 1))
    straight = ddp_cases.result(case)["params"]
    for p0, p1, p in zip(rank0, rank1, straight, strict=True):
        assert torch.equal(p0, p1), "ranks hold different parameters"
        torch.testing.assert_close(p0, p, rtol=1e-5, atol=1e-6)


def cli_with_trainer(tmp_path: Path, target: str, source: str, *overrides: str) -> tuple[list[str], dict]:
    """The command and environment that run ``python -m safeloop`` on 2 ranks with the Trainer
    ``target`` (``module.Class``) whose module's ``source`` is written into ``tmp_path``."""
    module = target.split(".")[0]
    (tmp_path / f"{module}.py").write_text(textwrap.dedent(source))
    env = cpu_env()
    env["PYTHONPATH"] = f"{tmp_path}:{env['PYTHONPATH']}"
    return [*TORCHRUN, "-m", "safeloop", f"trainer._target_={target}", *overrides], env


def torchrun_script(tmp_path: Path, body: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """Run ``body`` on 2 ranks, with ``tests.ddp_cases`` importable; the Trainer makes the process group."""
    (tmp_path / "job.py").write_text(f"import os, sys, faulthandler\nimport torch\nimport safeloop\n"
                                     # a rank that hangs prints every thread's stack, not only torchrun's timeout
                                     f"faulthandler.dump_traceback_later({timeout - 20}, exit=True)\n"
                                     f"sys.path.insert(0, {str(ROOT)!r})\nfrom tests import ddp_cases\n"
                                     + textwrap.dedent(body))
    proc = torchrun("job.py", cwd=tmp_path, timeout=timeout)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc


# Jobs whose every rank returns from the script, run in turn by the module's one 2-rank launch after the cases of
# tests/ddp_cases.py (a launch costs ~5 s of CPU), in the order written. Each is a function of its own, whose
# report(text) lines each rank writes to NAME_rankR.txt (its files go to the launch's directory). A group a job's
# Trainer made is ended after it, as at exit, so that the next job's Trainer makes one of its own.
JOBS: dict[str, str] = {}


def job(name: str, *parts: str) -> None:
    """Job ``name``: its source, in parts, each indented as it likes."""
    JOBS[name] = "".join(textwrap.dedent(part) for part in parts)


@pytest.fixture(scope="module")
def jobs(tmp_path_factory) -> Path:
    """The directory of the module's one launch: every case of tests/ddp_cases.py (``ranks``), then every job of
    JOBS."""
    out = tmp_path_factory.mktemp("ddp")
    for case in RESUMED:
        ddp_cases.halfway(case, 1, out / f"one-process-{case}")
    resumed = [f"{how}-{case}" for case in RESUMED for how in ("resume", "from-one-process")]
    cases = [*CASES, "schedule", "validation", "early_stop", "pass_end", "scheduler_twice", *resumed, "lone_save"]
    functions = "".join(f"\n\ndef {name}(report):\n{textwrap.indent(body, '    ')}" for name, body in JOBS.items())
    torchrun_script(out, functions + textwrap.dedent(f"""

        print(f"rank {{os.environ['RANK']}}: tests/ddp_cases.py", flush=True)
        ddp_cases.run({str(out)!r}, {cases!r})
        for index, name in enumerate({list(JOBS)!r}, start=1):
            print(f"rank {{os.environ['RANK']}}: job {{name}}", flush=True)  # the job a failure or a hang came in
            # torch names a group by a count that starts again at 0 once the groups end, and the launch's store
            # keeps each rank's gloo address under that name: a name of its own for each job's groups, or gloo
            # would connect to the addresses of an earlier group of the launch
            torch.distributed.distributed_c10d._world.group_count = 100 * index
            with open(f"{{name}}_rank{{os.environ['RANK']}}.txt", "w") as file:
                globals()[name](lambda text: file.write(f"{{text}}\\n"))
            safeloop.distributed._end_group()  # what runs at exit
        """), timeout=300)
    return out


def reported(jobs: Path, name: str) -> list[str]:
    """What each rank's run of job ``name`` reported: rank 0's, then rank 1's."""
    return [(jobs / f"{name}_rank{rank}.txt").read_text() for rank in (0, 1)]


def gloo_threads() -> str:
    """Job source: the report of the gloo threads this process still runs."""
    return """
        names = [open(f"/proc/self/task/{t}/comm").read().strip() for t in os.listdir("/proc/self/task")]
        report(f"gloo threads: {sorted(n for n in names if 'gloo' in n)}")
        """


# through DistributedDataParallel / the reducer: a Trainer fits 2 steps, then fits on to the end (without a process
# group of the caller's it makes one), saves each rank's parameters, then ends the group as its atexit handler does
# and reports the gloo threads still running
for _case in ("plain", "manual_gan"):
    job(f"two_fits_{_case}", f"""
        trainer = ddp_cases.build({_case!r}, world=2)
        trainer.max_steps = 2
        trainer.fit()
        trainer.max_steps = ddp_cases.STEPS
        trainer.fit()
        params = [p.detach() for p in trainer.model.parameters()]
        torch.save(params, f"two_fits_{_case}_params{{os.environ['RANK']}}.pt")
        safeloop.distributed._end_group()  # what runs at exit
        """, gloo_threads())


@pytest.fixture(params=["plain", "manual_gan"])
def two_fits(request, jobs):
    """The case, and the launch's directory."""
    return request.param, jobs


@pytest.mark.distributed
def test_a_second_fit_goes_on_where_the_first_stopped(two_fits):
    """A second fit() of the same Trainer (more steps) goes on where the first stopped, in the same group."""
    case, jobs = two_fits
    single = ddp_cases.result(case)["params"]
    for rank in (0, 1):
        for p, expected in zip(torch.load(jobs / f"two_fits_{case}_params{rank}.pt"), single, strict=True):
            torch.testing.assert_close(p, expected, rtol=1e-5, atol=1e-6)


@pytest.mark.distributed
def test_the_group_the_trainer_made_ends_with_its_threads_before_interpreter_shutdown(two_fits):
    """Gloo's worker threads left running into interpreter shutdown can abort the process at exit
    ("terminate called without an active exception", SIGABRT) when one releases a finished
    all-reduce's tensors; ending the group at exit (what the Trainer's atexit handler does) must stop them."""
    case, jobs = two_fits
    assert reported(jobs, f"two_fits_{case}") == ["gloo threads: []\n"] * 2, case


# The same for a group the user's script makes and destroys: safeloop, imported first, sees to it, while the
# Trainers stay alive past the group's end, as a script's globals do. Cases through DistributedDataParallel (whose
# wrapper, kept, would hold the group's threads as long as it lives), safeloop's reducer, and both with a second fit()
job("script_group", """
    import torch.distributed as dist
    dist.init_process_group("gloo")
    trainers = [ddp_cases.build(case, world=2) for case in ("plain", "gan", "accum")]
    for trainer in trainers:
        trainer.max_steps = 2
        trainer.fit()
        trainer.max_steps = ddp_cases.STEPS
        trainer.fit()
    dist.destroy_process_group()
    """, gloo_threads(), """
    try:
        trainers[0].fit()
    except safeloop.SafeloopError as err:
        report(f"{type(err).__name__}: {err}")
    """)


@pytest.mark.distributed
def test_a_group_the_script_made_after_importing_safeloop_ends_with_its_threads(jobs):
    for text in reported(jobs, "script_group"):
        assert text.startswith("gloo threads: []\nDistributedError: the process group this Trainer joined has ended "
                               "(destroy_process_group): fit() needs it"), text


# Each rank trains on its own half of every train_data it is given: the first; one assigned in on_step_end halfway
# through the first pass, read from the second pass on; the one on_epoch_start puts in its place at the third pass;
# and the one assigned before a second fit()
job("replaced_data", """
    from torch.utils.data import DataLoader, TensorDataset

    def loader(first):
        return DataLoader(TensorDataset(torch.arange(first, first + 16.0).unsqueeze(1)), batch_size=2)

    class Seen(safeloop.Trainer):
        seen = []

        def training_step(self, batch):
            (x,) = batch
            self.seen += x[:, 0].tolist()
            return self.model(x).pow(2).mean()

        def on_step_end(self, losses):
            if self.state.step == 2:
                self.train_data = loader(100.0)

        def on_epoch_start(self):
            if self.state.epoch == 2:
                self.train_data = loader(300.0)

    trainer = Seen(model=torch.nn.Linear(1, 1), train_data=loader(0.0), max_steps=12, device="cpu",
                   optimizer=torch.optim.SGD, progress=False, loggers=())
    trainer.fit()  # 3 passes of 16 samples / 2 ranks / 2 a batch = 4 steps
    trainer.train_data = loader(200.0)
    trainer.max_steps = 16
    trainer.fit()
    torch.save(trainer.seen, f"seen{os.environ['RANK']}.pt")
    """)


@pytest.mark.distributed
def test_train_data_replaced_in_on_epoch_start_or_between_fits_is_sharded_again(jobs):
    seen = [torch.load(jobs / f"seen{rank}.pt") for rank in (0, 1)]
    assert len(seen[0]) == len(seen[1]) == 32, seen
    assert sorted(seen[0] + seen[1]) == [float(v) for first in (0, 100, 200, 300) for v in range(first, first + 16)]


job("failed_fit", """
    class Fails(ddp_cases.Recording):
        def training_step(self, batch):
            if self.state.step == 1:
                raise ValueError("bad batch")
            return super().training_step(batch)

    trainer = ddp_cases.build("plain", world=2)
    trainer.__class__ = Fails
    for attempt in (1, 2):
        try:
            trainer.fit()
        except safeloop.SafeloopError as err:
            report(f"fit {attempt}: {type(err).__name__}: {err}")
    """)


@pytest.mark.distributed
def test_fit_after_a_failed_fit_says_the_group_ended(jobs):
    for text in reported(jobs, "failed_fit"):
        assert "fit 1: StepError: step 2 failed and was abandoned" in text, text
        assert "fit 2: DistributedError: the process group ended with an earlier fit() that failed (the other ranks " \
               "stopped with it): start the job again; trainer.resume=auto continues from the last checkpoint" \
               in text, text


# a parameter the step leaves without gradient, with find_unused_parameters off: both ranks stop before the update,
# with a checkpoint due after every step
job("unused_strict", """
    from pathlib import Path

    trainer = ddp_cases.build("unused_strict", world=2, checkpoint={"dir": "unused_strict", "every": 1})
    try:
        trainer.fit()
    except safeloop.SafeloopError as err:
        report(f"{type(err).__name__}: {err}")
    report(f"checkpoints: {sorted(p.name for p in Path('unused_strict').glob('*.pt'))}")
    """)


@pytest.mark.distributed
def test_a_parameter_left_without_gradient_under_ddp_stops_before_the_optimizer_step(jobs):
    for text in reported(jobs, "unused_strict"):
        assert re.search(r"step 1: 2 model parameter\(s\) got no gradient on rank \d \(the first: spare.weight\), "
                         r"so DistributedDataParallel cannot average this step's gradients; the step was abandoned "
                         r"before the optimizer step. If steps may leave parameters unused, set "
                         r"trainer.find_unused_parameters=true", text), text
        assert text.endswith("checkpoints: []\n"), text


# Last: it leaves rank 0 alone. Rank 1 fails after its step 3 updated (on_step_end); rank 0 goes on into step 4,
# where DistributedDataParallel's all-reduce finds rank 1 gone
job("alone_in_ddp", """
    class Fails(ddp_cases.Recording):
        def on_step_end(self, losses):
            if self.dist.rank == 1 and self.state.step == 3:
                raise ValueError("bad hook")

    trainer = ddp_cases.build("plain", world=2)
    trainer.__class__ = Fails
    try:
        trainer.fit()
    except safeloop.SafeloopError as err:
        report(f"rank {trainer.dist.rank}: {type(err).__name__}: {err}")
    """)


@pytest.mark.distributed
def test_a_rank_left_alone_in_ddps_all_reduce_says_another_rank_failed_not_only_what_gloo_says(jobs):
    """Torch raises a plain RuntimeError in gloo's words, which the Trainer says as a rank left alone, with the step
    abandoned and left as it was."""
    rank0, rank1 = reported(jobs, "alone_in_ddp")
    assert rank1.startswith("rank 1: StepError: step 3's update was applied; the error came after it, in "
                            "on_step_end: ValueError: bad hook\n"), rank1
    assert re.match(r"rank 0: DistributedError: step 4: rank 0 of 2 could not take part in this step's collective "
                    r"calls \(under DistributedDataParallel: its all-reduce of the gradients\) \(.*gloo.*\)\. The "
                    r"step was abandoned \(parameters and optimizer state are unchanged\)\. Every rank makes this "
                    r"call at the same point, and another did not: it most likely failed", rank0, re.S), rank0


@pytest.fixture(scope="module")
def default_job(tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess, list[str], subprocess.CompletedProcess]:
    """The default job on 2 ranks for 20 steps, run in first/ with its checkpoints in ckpt/, then resumed there for
    10 more in second/: the directory, the first run, the checkpoints it left, the second run."""
    tmp_path = tmp_path_factory.mktemp("default_job")
    ckpt = tmp_path / "ckpt"
    common = ("-m", "safeloop", f"checkpoint.dir={ckpt}", "trainer.log_every=10")
    (tmp_path / "first").mkdir()
    (tmp_path / "second").mkdir()
    first = torchrun(*common, "trainer.max_steps=20", cwd=tmp_path / "first")
    saved = sorted(p.name for p in ckpt.glob("*.pt"))
    second = torchrun(*common, "trainer.max_steps=30", "trainer.resume=auto", cwd=tmp_path / "second")
    return tmp_path, first, saved, second


@pytest.mark.distributed
def test_default_job_runs_under_torchrun_with_outputs_from_rank_zero_only(default_job):
    tmp_path, proc, _, _ = default_job
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.count("outputs: ") == 1, proc.stdout
    assert "not a DataLoader" not in proc.stderr  # the recipe's own batches split across ranks
    runs = [p for p in (tmp_path / "first" / "outputs").glob("*/*") if p.is_dir()]
    assert len(runs) == 1, runs  # rank 1 makes no Hydra directory of its own
    rows = (runs[0] / "metrics.csv").read_text().splitlines()
    assert any(row.startswith("20,loss,") for row in rows), rows
    assert len([r for r in rows if r.startswith("20,loss,")]) == 1, "a rank other than zero logged"


@pytest.mark.distributed
def test_an_error_on_one_rank_stops_both_promptly_and_is_shown(tmp_path):
    started = time.perf_counter()
    proc = torchrun(str(ROOT / "tests" / "ddp_cases.py"), str(tmp_path), "fails_on_rank1", cwd=tmp_path, timeout=60)
    elapsed = time.perf_counter() - started
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert elapsed < 45, f"took {elapsed:.0f}s to stop"
    assert "[rank1]: safeloop.errors.GraphReuseError: graph built before the step is reused (step 3" in out, out
    # rank 0, waiting in the gradient all-reduce, says why it stopped (or torchrun stopped it first)
    assert "step 3: rank 0 of 2 could not all-reduce gradients" in out or "SIGTERM" in out, out
    assert not list(tmp_path.glob("*.pt"))


@pytest.mark.distributed
def test_a_cli_run_that_fails_puts_the_error_in_torchruns_summary(tmp_path):
    cmd, env = cli_with_trainer(tmp_path, "carries.Carries", """
        import torch
        import safeloop

        class Carries(safeloop.Trainer):
            y = None

            def training_step(self, batch):
                if torch.is_grad_enabled() and self.y is None:
                    self.y = self.model(batch[0]).sum() * 0  # made in step 1, used by every later step
                loss = super().training_step(batch)
                return loss if self.y is None or not torch.is_grad_enabled() else loss + self.y.exp()
        """, "trainer.max_steps=5", "trainer.progress=false")
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    summary = proc.stderr[proc.stderr.index("Root Cause (first observed failure)"):]
    assert "error_file: <N/A>" not in summary
    assert re.search(r"safeloop.errors.CarriedGraphError: graph carried over from an earlier step \(step 2", summary)


def test_multirun_sweeps_with_one_output_directory_per_run(tmp_path):
    cmd = [sys.executable, "-m", "safeloop", "-m", "optimizer.lr=1e-2,1e-3", "trainer.max_steps=20",
           "trainer.val_every=null"]
    proc = forkserver.run(cmd, cwd=tmp_path, timeout=120)  # one process, not torchrun: forked
    assert proc.returncode == 0, proc.stdout + proc.stderr
    runs = sorted(p.parent for p in (tmp_path / "multirun").glob("*/*/*/metrics.csv"))
    assert [r.name for r in runs] == ["0", "1"], runs
    overrides = [(r / ".hydra" / "overrides.yaml").read_text() for r in runs]
    assert "optimizer.lr=0.01" in overrides[0] and "optimizer.lr=0.001" in overrides[1], overrides
    assert proc.stdout.count("outputs: ") == 2
    # one table across the runs: what differs between them, and their final losses
    summary = (runs[0].parent / "summary.md").read_text().splitlines()
    assert summary[0] == "| run | overrides | loss | val_loss |" and len(summary) == 4, summary
    assert re.fullmatch(r"\| 0 \| optimizer.lr=0.01 \| [\d.]+ \| [\d.]+ \|", summary[2]), summary
    assert re.fullmatch(r"\| 1 \| optimizer.lr=0.001 \| [\d.]+ \| [\d.]+ \|", summary[3]), summary
    assert "\n".join(summary) in proc.stdout and f"sweep summary: {runs[0].parent / 'summary.md'}" in proc.stdout


@pytest.mark.distributed
def test_resume_under_torchrun_rank_zero_writes_every_rank_loads(default_job):
    tmp_path, first, saved, second = default_job
    assert first.returncode == 0, first.stdout + first.stderr
    assert saved == ["step-000000020.pt"]  # one writer, no rank copies
    assert second.returncode == 0, second.stdout + second.stderr
    assert "resumed from" in second.stdout + second.stderr
    assert sorted(p.name for p in (tmp_path / "ckpt").glob("*.pt")) == ["step-000000020.pt", "step-000000030.pt"]


@pytest.mark.distributed
def test_gan_recipe_runs_under_torchrun_with_max_steps_a_multiple_of_checkpoint_every(tmp_path):
    # as the README's command (2000 steps, a save every 1000): the last step's save is the final one on
    # every rank, so no rank starts another alone (in manual mode a save gathers every rank's gradients)
    proc = torchrun(str(ROOT / "recipes" / "gan.py"), "trainer.max_steps=4", "checkpoint.every=2",
                    "trainer.log_every=2", f"checkpoint.dir={tmp_path / 'ckpt'}", cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.count("outputs: ") == 1, proc.stdout
    assert sorted(p.name for p in (tmp_path / "ckpt").glob("*.pt")) == ["step-000000002.pt", "step-000000004.pt"]


@pytest.mark.distributed
def test_sigterm_to_one_rank_stops_every_rank_after_the_same_step(tmp_path):
    """A signal that reaches one rank only (as preemption can) stops both ranks at the same step,
    with one checkpoint and no rank left waiting in an all-reduce."""
    cmd, env = cli_with_trainer(tmp_path, "pidtrainer.PidTrainer", """
        import os
        import safeloop

        class PidTrainer(safeloop.Trainer):
            def on_step_end(self, losses):
                if self.state.step == 3:
                    open(f"pid{os.environ['RANK']}", "w").write(str(os.getpid()))
        """, "trainer.max_steps=100000", "trainer.val_every=null", "checkpoint.every=null",
        f"checkpoint.dir={tmp_path}/ckpt", "trainer.progress=false")
    proc = subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while not (tmp_path / "pid1").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        os.kill(int((tmp_path / "pid1").read_text()), signal.SIGTERM)
        out, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    stops = re.findall(r"stopped by signal 15 at step (\d+)", err)
    assert len(stops) == 2 and stops[0] == stops[1], out + err
    step = int(stops[0])
    assert step % 8 == 0
    assert [p.name for p in (tmp_path / "ckpt").glob("*.pt")] == [f"step-{step:09d}.pt"]


class PositionedLoader(torch.utils.data.DataLoader):
    """A loader that keeps its own position, as torchdata's StatefulDataLoader does."""

    position = 0  # batches handed out (kept only as far as this test needs)

    def state_dict(self) -> dict:
        return {"position": self.position}

    def load_state_dict(self, state: dict) -> None:
        self.position = state["position"]


def stateful_loaders():
    yield PositionedLoader
    try:
        from torchdata.stateful_dataloader import StatefulDataLoader
    except ImportError:
        return
    yield StatefulDataLoader


@pytest.mark.parametrize("loader", list(stateful_loaders()), ids=lambda c: c.__name__)
def test_a_loader_that_keeps_its_position_stays_one_when_sharded_for_the_ranks(loader):
    from safeloop.distributed import shard

    data = torch.utils.data.TensorDataset(torch.arange(12.0))
    ranks = [shard(loader(data, batch_size=2), rank, 2, seed=0) for rank in (0, 1)]
    assert all(type(r) is loader and callable(r.state_dict) for r in ranks)  # checkpoints save its position
    seen = [torch.cat([b[0] for b in r]).tolist() for r in ranks]
    assert sorted(seen[0] + seen[1]) == [float(i) for i in range(12)] and not set(seen[0]) & set(seen[1])


def test_val_data_is_split_across_ranks_in_order_with_no_sample_repeated():
    """DistributedSampler pads the shares to equal sizes by repeating samples, which a validation would
    count twice: val_data's shares are not padded, a val loader's own DistributedSampler included."""
    from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

    from safeloop.distributed import shard_in_order

    data = TensorDataset(torch.arange(5.0))
    padded = DataLoader(data, batch_size=2, sampler=DistributedSampler(data, num_replicas=2, rank=0, shuffle=False))
    for loader in (DataLoader(data, batch_size=2, shuffle=True), padded):
        seen = [torch.cat([b[0] for b in shard_in_order(loader, rank, 2)]).tolist() for rank in (0, 1)]
        assert seen == [[0.0, 2.0, 4.0], [1.0, 3.0]]
    # fewer samples than ranks: every rank validates them all (the ranks' sums and counts keep the mean)
    small = DataLoader(TensorDataset(torch.arange(3.0)), batch_size=2)
    assert shard_in_order(small, 2, 4) is small
