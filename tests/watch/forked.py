"""Runs many scripts, each as ``python script.py args`` or ``python -m safeloop.watch script.py args`` would, in
processes forked from one that imported torch once and built an optimizer once.

An optimizer's constructor imports ``torch._dynamo`` (1-2 s, and 5 s on a loaded machine): paid once here, before
the forks, it is paid by no script; most scripts then take 30-70 ms. A script runs as its own program (``__main__``,
``sys.argv``, ``sys.path[0]`` its directory); the real command line runs as a ``python`` subprocess in the tests that
need its own behaviour (exit by SIGINT, spawned workers, Python's own traceback of a syntax error). A child ends as
Python does (``atexit`` functions, streams flushed) but without tearing every module down, which takes ~1 s with
torch loaded and prints nothing.
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.conftest import subprocess_env

RUNNER = """
import atexit, json, os, runpy, sys, tempfile, traceback
import torch
import safeloop.watch
torch.optim.SGD([torch.zeros(1, requires_grad=True)])  # imports torch._dynamo here, once for every child
jobs, out, running = json.loads(sys.argv[1]), {}, {}
def reap():
    pid, status = os.wait()
    i, files = running.pop(pid)
    out[i] = [os.waitstatus_to_exitcode(status)] + [open(f).read() for f in files]
    for f in files:
        os.unlink(f)
for i, (argv, watch) in enumerate(jobs):
    if len(running) == 2:
        reap()
    files = [tempfile.mkstemp()[1] for _ in range(2)]
    sys.stdout.flush(), sys.stderr.flush()
    pid = os.fork()
    if pid == 0:  # the child: the script, its output to the files; exits with its code
        for fd, name in zip((1, 2), files):
            os.dup2(os.open(name, os.O_WRONLY), fd)
        try:
            if watch:  # python -m safeloop.watch script.py args
                code = safeloop.watch.main(argv)
            else:  # python script.py args
                sys.argv, sys.path[0] = argv, os.path.dirname(os.path.abspath(argv[0]))
                try:
                    runpy.run_path(argv[0], run_name="__main__")
                    code = 0
                except SystemExit:
                    raise
                except BaseException:
                    traceback.print_exc()
                    code = 1
        except SystemExit as stop:  # as Python ends on it
            code = stop.code
            if code is not None and not isinstance(code, int):
                print(code, file=sys.stderr)
                code = 1
        # Python's exit, less the teardown of every module (~1 s with torch, and silent): atexit functions, streams
        atexit._run_exitfuncs()
        sys.stdout.flush(), sys.stderr.flush()
        os._exit(code or 0)
    running[pid] = i, files
while running:
    reap()
print(json.dumps([out[i] for i in range(len(jobs))]))
"""


ABORTED = "terminate called without an active exception"


def run_all(jobs: list[tuple[list[str], bool]], cwd: Path, again: bool = True) -> list[subprocess.CompletedProcess]:
    """For each ``(argv, watch)``: ``python [-m safeloop.watch] *argv`` run in ``cwd``, as a CompletedProcess. A run
    whose spawned ranks aborted as gloo's threads were torn down at their exit (``ABORTED``, with or without watch,
    now and then on a loaded machine) is run once more."""
    proc = subprocess.run([sys.executable, "-c", RUNNER, json.dumps(jobs)], cwd=cwd, env=subprocess_env(),
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr
    done = [subprocess.CompletedProcess(argv, *result) for (argv, _), result in zip(jobs, json.loads(proc.stdout))]
    aborted = [i for i, run in enumerate(done) if run.returncode != 0 and ABORTED in run.stderr]
    if again and aborted:
        for i, run in zip(aborted, run_all([jobs[i] for i in aborted], cwd, again=False)):
            done[i] = run
    return done
