"""``python -m safeloop ARGS`` (``python -m MODULE ARGS``, ``python script.py ARGS``, ``python -c CODE ARGS``) run
in a process forked from a server that imported torch, Hydra, OmegaConf and ``safeloop.__main__`` once.

A fresh interpreter spends ~4 s of CPU importing torch, Hydra and safeloop (and 1-5 s more on ``torch._dynamo``,
which an optimizer's constructor imports), more than most runs the tests make take. Each pytest(-xdist) worker
starts one server, lazily, at its first ``run``, and ends it at exit. The server imports and does nothing else: no
thread, no torch op, no user code, before it forks; ``import torch._dynamo`` is the optimizer's warm-up without
an optimizer. A child is what Python would be for the same command line:

- in ``cwd``, with ``os.environ`` replaced by ``env``, stdin ``/dev/null``, stdout and stderr to files (pipes'
  buffering: not a terminal);
- ``sys.argv`` as Python sets it; ``sys.path[0]`` the current directory (``-m``; ``''`` for ``-c``) or the script's
  directory, the entries a test adds to ``PYTHONPATH`` after it; import caches invalidated;
- run by ``runpy`` as ``__main__`` (``run_module(..., alter_sys=True)``, ``run_path``);
- its exit code as Python's: ``SystemExit``'s code (not an int: printed, 1); an uncaught exception printed by
  ``sys.excepthook`` and 1 (``KeyboardInterrupt``: killed by SIGINT); then the ``atexit`` functions, the streams
  flushed and ``os._exit``. Python's teardown of every module is skipped (~1 s with torch loaded, and silent), as
  ``tests/watch/forked.py`` does;
- ``timeout``: the child is killed and ``subprocess.TimeoutExpired`` raised, as ``subprocess.run`` does.

A child forked from the server sees none of another test's modules (the server never imports one): a test's
``cnn.py`` is found afresh in its own directory. What torch, Hydra and safeloop read from the environment when
imported (``OMP_NUM_THREADS``, ``TORCH_*``, ``CUDA_*``, ``HYDRA_*``, ...) is the server's, so a fork only runs
a command whose environment is the server's (``tests.conftest.subprocess_env()`` when it started) but for
``PYTEST_CURRENT_TEST``, entries put before the server's ``PYTHONPATH`` and the variables the server's imports set
to the value they read as unset (``import torch._dynamo`` sets ``TORCHINDUCTOR_CACHE_DIR`` to its default, in the
server and in a test's process once it built an optimizer: after that every command would otherwise differ); any
other difference, however harmless it looks, runs a real subprocess (conservative: no list of keys read at import
to keep up to date).
So do command lines that are not ``python`` with one of the forms above (a console script, ``-X``/``-W`` flags).
``SAFELOOP_TESTS_NO_FORK=1`` runs every command as a real subprocess, to check the suite both ways.

What a fork cannot be is left to a real interpreter by the tests themselves: signals and Ctrl-C (``Popen``), the
console script, Python's own start-up (warnings torch gives when imported appear once, in the server's stderr, not
in each child's: no test may expect one), and the README's default job, run as a user runs it.
"""
from __future__ import annotations

import atexit
import json
import os
import signal
import select
import subprocess
import sys
import tempfile
import time

from tests.conftest import subprocess_env

SERVER = r"""
import atexit, contextlib, importlib, json, os, runpy, signal, sys, types
import hydra, omegaconf, torch
import safeloop.__main__
import torch._dynamo  # what an optimizer's constructor imports (1-5 s): here, once for every child, with no torch op
threads = len(os.listdir("/proc/self/task"))
if threads != 1:
    sys.exit(f"the fork server has {threads} threads after its imports: forking it is not safe")
sys.modules.pop("safeloop.__main__")  # run afresh as __main__ by each child, as `python -m safeloop` runs it


def child(request):
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    for fd, name in zip((1, 2), (request["stdout"], request["stderr"])):
        os.dup2(os.open(name, os.O_WRONLY | os.O_TRUNC), fd)
    os.close(reply.fileno())  # the server's replies; its requests were fd 0
    sys.stdin = open(0, closefd=False)
    os.environ.clear()
    os.environ.update(request["env"])
    os.chdir(request["cwd"])
    kind, target, args = request["kind"], request["target"], request["args"]
    first = {"module": os.getcwd(), "code": "", "script": os.path.dirname(os.path.abspath(target))}[kind]
    sys.path[0:1] = [first, *request["pythonpath"]]
    importlib.invalidate_caches()
    try:
        try:
            if kind == "module":  # python -m target args
                sys.argv = ["-m", *args]  # runpy sets argv[0] to the module's file, as Python does
                runpy.run_module(target, run_name="__main__", alter_sys=True)
            elif kind == "script":  # python target args
                sys.argv = [target, *args]
                runpy.run_path(target, run_name="__main__")
            else:  # python -c target args
                sys.argv = ["-c", *args]
                main = types.ModuleType("__main__")
                main.__builtins__ = __builtins__
                sys.modules["__main__"] = main
                exec(compile(target, "<string>", "exec"), vars(main))
            code = 0
        except SystemExit:
            raise
        except BaseException as error:  # Python's report of an uncaught exception, less this file's frame
            error = error.with_traceback(error.__traceback__.tb_next)
            sys.excepthook(type(error), error, error.__traceback__)
            code = "SIGINT" if isinstance(error, KeyboardInterrupt) else 1
    except SystemExit as stop:  # as Python ends on it
        code = stop.code
        if code is not None and not isinstance(code, int):
            print(code, file=sys.stderr)
            code = 1
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):  # a stream the command closed or replaced
            stream.flush()
    if code == "SIGINT":  # Python ends on an uncaught KeyboardInterrupt killed by SIGINT: exit code -2
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    os._exit((code or 0) & 0xFF)


reply = os.fdopen(os.dup(1), "w")
print(json.dumps({"ready": dict(os.environ)}), file=reply, flush=True)  # with what the imports set
for line in sys.stdin:
    request = json.loads(line)
    sys.stdout.flush(), sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        try:
            child(request)
        finally:
            os._exit(70)
    print(json.dumps({"pid": pid}), file=reply, flush=True)
    _, status = os.waitpid(pid, 0)
    print(json.dumps({"code": os.waitstatus_to_exitcode(status)}), file=reply, flush=True)
reply.flush()
os._exit(0)
"""

IGNORED = {"PYTEST_CURRENT_TEST"}  # pytest's, changed for every test: read by nothing at import
_server: Server | None = None


class Server:
    """The server: a ``python -c SERVER`` subprocess, one request at a time on its stdin, replies on its stdout."""

    def __init__(self):
        self.env = subprocess_env()
        self.log = tempfile.NamedTemporaryFile("w+", prefix="forkserver-", suffix=".log")
        self.proc = subprocess.Popen([sys.executable, "-c", SERVER], cwd=tempfile.gettempdir(), env=self.env,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log, text=True)
        self.buffer = b""
        self.set_by_imports = {k: v for k, v in self.reply(None, "ready").items() if self.env.get(k) != v}

    def reply(self, deadline: float | None, key: str) -> int | dict | None:
        """The server's next reply, ``key``'s value; None at the deadline."""
        fd = self.proc.stdout.fileno()
        while b"\n" not in self.buffer:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not select.select([fd], [], [], left)[0]:
                return None
            chunk = os.read(fd, 4096)
            if not chunk:
                self.log.seek(0)
                raise RuntimeError(f"the fork server ended (exit code {self.proc.wait()}):\n{self.log.read()}")
            self.buffer += chunk
        line, self.buffer = self.buffer.split(b"\n", 1)
        return json.loads(line)[key]

    def close(self):
        self.proc.stdin.close()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


def _request(args, cwd, env: dict) -> dict | None:
    """What the server needs to run ``args`` as Python would; None when a fork cannot be that process."""
    if os.environ.get("SAFELOOP_TESTS_NO_FORK") == "1" or not args or args[0] != sys.executable or len(args) < 2:
        return None
    if args[1] in ("-m", "-c"):
        if len(args) < 3:
            return None
        kind, target, rest = {"-m": "module", "-c": "code"}[args[1]], args[2], args[3:]
    elif args[1].startswith("-"):
        return None
    else:
        kind, target, rest = "script", args[1], args[2:]
    base, set_by_imports = (_server.env, _server.set_by_imports) if _server else (subprocess_env(), {})
    if {k: v for k, v in env.items() if k not in IGNORED and k != "PYTHONPATH" and set_by_imports.get(k) != v} != \
            {k: v for k, v in base.items() if k not in IGNORED and k != "PYTHONPATH"}:
        return None
    path, own = env.get("PYTHONPATH", ""), base.get("PYTHONPATH", "")
    if not path.endswith(own) or (path != own and not path[:len(path) - len(own)].endswith(os.pathsep)):
        return None
    added = [p for p in path[:len(path) - len(own)].split(os.pathsep) if p]
    return {"kind": kind, "target": str(target), "args": [str(a) for a in rest], "cwd": os.path.abspath(cwd),
            "env": env, "pythonpath": [os.path.abspath(p) for p in added]}


def run(args, cwd, env: dict | None = None, timeout: float | None = 180) -> subprocess.CompletedProcess:
    """``subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)``, forked from the
    server where it can be (``args[0]`` is ``sys.executable``); ``env=None``: ``subprocess_env()``."""
    global _server
    args = [str(a) for a in args]
    env = subprocess_env() if env is None else dict(env)
    request = _request(args, cwd, env)
    if request is None:
        return subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    if _server is None:
        _server = Server()
        atexit.register(_server.close)
    outputs = [tempfile.NamedTemporaryFile(prefix="forkserver-") for _ in range(2)]
    try:
        request.update(stdout=outputs[0].name, stderr=outputs[1].name)
        _server.proc.stdin.write(json.dumps(request) + "\n")
        _server.proc.stdin.flush()
        pid = _server.reply(None, "pid")
        code = _server.reply(None if timeout is None else time.monotonic() + timeout, "code")
        if code is None:  # subprocess.run's timeout: the child killed, what it wrote so far
            os.kill(pid, signal.SIGKILL)
            _server.reply(None, "code")
        out, err = (open(f.name).read() for f in outputs)
    finally:
        for f in outputs:
            f.close()
    if code is None:
        raise subprocess.TimeoutExpired(args, timeout, output=out, stderr=err)
    return subprocess.CompletedProcess(args, code, out, err)

