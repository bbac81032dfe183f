"""Watches the Python processes that a watched script starts (``python -m safeloop.watch``), such as the ranks
Lightning's DDP launcher or torchrun start as ``python script.py``: this directory is put on their
``PYTHONPATH``, and ``SAFELOOP_WATCH`` holds the watch's options (a JSON list of arguments).

A process running a script file is started again, in place, as ``python -m safeloop.watch <options>
script.py args`` with the same interpreter options. A worker multiprocessing starts by spawn or forkserver (a
``python -c`` process that runs the watched script's functions: ``torch.multiprocessing.spawn``'s ranks) is
watched in place, ``SAFELOOP_WATCH_SCRIPT`` naming the script. Other ``python -c`` and ``python -m`` processes
(torchrun itself) run as they are; forked workers inherit the watch. The ``sitecustomize`` this one hides, if
any, runs as well.
"""
import importlib.machinery
import importlib.util
import json
import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))
# the commands multiprocessing's spawn and forkserver start methods run their workers with (``python -c``)
_WORKERS = ("from multiprocessing.spawn import spawn_main", "from multiprocessing.forkserver import main")


def _watch() -> None:
    options = os.environ.get("SAFELOOP_WATCH")
    if options is None or not sys.executable or os.name != "posix":  # os.execv replaces the process on POSIX only
        return
    # ``python [options] script.py args``: sys.argv is ``[script.py, args]``; ``python -m module args``: ``[-m, args]``
    first = len(sys.orig_argv) - len(sys.argv)
    watched = sys.argv[:1] == ["-m"] and sys.orig_argv[first] == "safeloop.watch"
    worker = sys.argv[:1] == ["-c"] and sys.orig_argv[first].startswith(_WORKERS)  # (-c's command)
    if (watched or worker) and importlib.util.find_spec("safeloop") is None:
        sys.path.append(os.path.dirname(os.path.dirname(os.path.dirname(_HERE))))  # last: it hides nothing
    if worker and os.environ.get("SAFELOOP_WATCH_SCRIPT"):
        from safeloop.watch import watch_process
        watch_process(json.loads(options), os.environ["SAFELOOP_WATCH_SCRIPT"])
    if sys.argv[:1] in (["-m"], ["-c"]):
        return
    script = sys.argv[0] if sys.argv else ""
    if script in ("", "-c", "-") or not os.path.isfile(script):
        return
    given = sys.orig_argv[1:first]  # the interpreter's own options (-u, -W ...)
    os.execv(sys.executable, [sys.executable, *given, "-m", "safeloop.watch", *json.loads(options), *sys.argv])


def _hidden() -> None:
    """The ``sitecustomize`` further down the path, which this one hides."""
    path = [entry for entry in sys.path if os.path.abspath(entry or os.curdir) != _HERE]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", path)
    if spec is not None and spec.loader is not None:
        spec.loader.exec_module(importlib.util.module_from_spec(spec))


_watch()
_hidden()
