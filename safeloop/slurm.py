"""SLURM: a task ``srun`` started trains as a torchrun rank would, and the pre-emption signal saves and requeues.

As Lightning's ``SLURMEnvironment`` (its variables, its first host, its port, its requeue):

- **Rank and world.** In a task ``srun`` started (``SLURM_NTASKS`` and ``SLURM_PROCID`` set), with no
  torchrun variables (``RANK`` / ``WORLD_SIZE``) and not in an interactive job (``SLURM_JOB_NAME`` ``bash`` or
  ``interactive``, as Lightning), ``adopt`` sets torchrun's variables from SLURM's when safeloop is imported:
  ``RANK`` = ``SLURM_PROCID``, ``WORLD_SIZE`` = ``SLURM_NTASKS``, ``LOCAL_RANK`` = ``SLURM_LOCALID``,
  ``MASTER_ADDR`` = the first host of the step's node list, ``MASTER_PORT`` = 15000 + the last four digits of
  ``SLURM_JOB_ID`` (12910 without one); a ``MASTER_ADDR`` or ``MASTER_PORT`` already set wins. The rest of
  safeloop then runs as under torchrun. One task (``SLURM_NTASKS=1``) is one process, as without SLURM.
- **Pre-emption.** In a SLURM job (``SLURM_JOB_ID``, not interactive), ``SIGUSR1`` (``#SBATCH
  --signal=SIGUSR1@90``) stops a fit as SIGTERM does: the current step finishes, a checkpoint is written,
  and ``fit`` returns with ``stop_signal`` ``SIGUSR1`` (``python -m safeloop`` exits 128 + 10 = 138).
  With ``requeue`` (the default, Lightning's ``auto_requeue``) and ``resume=auto``, rank zero then runs
  ``scontrol requeue <job id>``: SLURM puts the job back in its queue, and it runs the same command again,
  which resumes from that checkpoint. Without ``resume=auto`` it would start over, so it is not requeued
  (a warning says why). SLURM ends a requeued job with SIGTERM: from then on this process ignores it
  (Lightning "bypasses" it too), so that loggers and the process group close, and it exits by itself.
"""
from __future__ import annotations

import logging
import os
import re
import signal
import subprocess
from collections.abc import Iterator, Mapping, MutableMapping
from contextlib import contextmanager

from lightning_utilities.core.rank_zero import rank_zero_only

from . import checkpoint as ckpt

log = logging.getLogger("safeloop")

REQUEUE_SIGNAL = signal.SIGUSR1
INTERACTIVE = ("bash", "interactive")  # SLURM_JOB_NAME of `srun --pty bash` and the like: not a SLURM run
DEFAULT_PORT = 12910  # Lightning's, without a job id


def in_job(env: Mapping[str, str]) -> bool:
    """Whether this process runs in a SLURM job (not an interactive one)."""
    return "SLURM_JOB_ID" in env and env.get("SLURM_JOB_NAME") not in INTERACTIVE


def launched_by_srun(env: Mapping[str, str]) -> bool:
    """Whether ``srun`` started this process as one of its tasks, with no torchrun around it."""
    return ("SLURM_NTASKS" in env and "SLURM_PROCID" in env and "RANK" not in env and "WORLD_SIZE" not in env
            and env.get("SLURM_JOB_NAME") not in INTERACTIVE)


def first_host(nodelist: str) -> str:
    """The first host of a SLURM host list, as ``scontrol show hostnames`` would list it first:
    ``node[01-03,7]`` -> ``node01``, ``a1,b2`` -> ``a1``, ``rack[1-2]-gpu[3-4]`` -> ``rack1-gpu3``."""
    first = re.split(r"[,\s]+(?![^\[]*\])", nodelist.strip())[0]  # a comma or space outside brackets
    return re.sub(r"\[([^\]\-,]*)[^\]]*\]", r"\1", first)  # each bracket: its first number, as written


def port(job_id: str | None) -> int:
    """Lightning's rendezvous port: 15000 + the last four digits of the job id, the same in every task."""
    return 15000 + int(job_id[-4:]) if job_id and job_id.isdigit() else DEFAULT_PORT


def torchrun_env(env: Mapping[str, str]) -> dict[str, str]:
    """torchrun's variables for a task ``srun`` started (see the module docstring); none otherwise, or for
    one task."""
    if not launched_by_srun(env) or int(env["SLURM_NTASKS"]) <= 1:
        return {}
    nodes = next((env[k] for k in ("SLURM_STEP_NODELIST", "SLURM_NODELIST", "SLURM_JOB_NODELIST") if env.get(k)),
                 "127.0.0.1")
    return {"RANK": env["SLURM_PROCID"], "WORLD_SIZE": env["SLURM_NTASKS"], "LOCAL_RANK": env.get("SLURM_LOCALID", "0"),
            "MASTER_ADDR": env.get("MASTER_ADDR") or first_host(nodes),
            "MASTER_PORT": env.get("MASTER_PORT") or str(port(env.get("SLURM_JOB_ID")))}


def adopt(environ: MutableMapping[str, str]) -> dict[str, str]:
    """Set torchrun's variables in ``environ`` from SLURM's (``torchrun_env``); returns those set."""
    found = torchrun_env(environ)
    environ.update(found)
    return found


def job_id(env: Mapping[str, str]) -> str:
    """The id ``scontrol requeue`` takes: ``ARRAYJOB_TASK`` for a task of a job array, as Lightning."""
    if env.get("SLURM_ARRAY_JOB_ID") and env.get("SLURM_ARRAY_TASK_ID"):
        return f"{env['SLURM_ARRAY_JOB_ID']}_{env['SLURM_ARRAY_TASK_ID']}"
    return env["SLURM_JOB_ID"]


@contextmanager
def stop_signals(request: ckpt.StopRequest, state, settings) -> Iterator[None]:
    """``checkpoint.stop_signals`` around a fit; in a SLURM job ``SIGUSR1`` too, and once the fit it stopped
    has ended (its checkpoint written), rank zero requeues the job (``after_preemption``)."""
    slurm = in_job(os.environ)
    with ckpt.stop_signals(request, state, (REQUEUE_SIGNAL,) if slurm else ()):
        yield
    if slurm and request.signum == REQUEUE_SIGNAL:
        after_preemption(settings.requeue, str(settings.resume) == "auto", state.step, os.environ)


def after_preemption(requeue: bool, resumes: bool, step: int, env: Mapping[str, str]) -> bool:
    """Requeue the job from rank zero when asked and sensible; returns whether it was requeued. Every rank
    then ignores SIGTERM, with which SLURM ends the job it requeues: each is on its way out already."""
    zero = rank_zero_only.rank == 0
    command = f"scontrol requeue {job_id(env)}"
    if requeue and not resumes and zero:
        log.warning("SLURM: %s not run: the requeued job would run this command again, and without "
                    "trainer.resume=auto it would start over. Add trainer.resume=auto (and a checkpoint.dir that "
                    "stays the same) to continue from the checkpoint of step %d, or set trainer.requeue=false",
                    command, step)
    if not (requeue and resumes):
        return False
    try:
        previous = signal.signal(signal.SIGTERM, _bypass)
    except ValueError:  # not the main thread
        previous = None
    if not zero:
        return False
    failure = run(command)
    if failure is None:
        log.info("SLURM: requeued the job (%s): it runs this command again and resumes from the checkpoint of "
                 "step %d", command, step)
        return True
    if previous is not None:  # not requeued: SIGTERM stops this process as usual
        signal.signal(signal.SIGTERM, previous)
    log.warning("SLURM: `%s` failed (%s), so the job is not requeued. The checkpoint of step %d is written: "
                "submit the job again (sbatch) to continue from it, with trainer.resume=auto", command, failure, step)
    return False


def run(command: str) -> str | None:
    """Run ``command``; None when it succeeded, otherwise what went wrong."""
    try:
        done = subprocess.run(command.split(), capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError) as err:
        return str(err)
    return None if done.returncode == 0 else f"exit code {done.returncode}: {done.stderr.strip()}"


def _bypass(signum, frame) -> None:
    log.info("SIGTERM after the requeue: ignored while this process finishes (SLURM kills it after KillWait)")
