"""``python -m safeloop.watch``: the seed scripts, two GAN mistakes (StyleGAN2's lazy R1 penalty, DCGAN's D step
on an undetached fake), an L-BFGS closure without its forward, gradients that go nowhere (layers in a plain
list or made in forward, a meta-loss through detached fast weights), graphs kept outside the loss (an epoch's
outputs list, a create_graph ``.grad``) and a tensor an autograd Function keeps on ctx changed in place, run
verbatim.

The broken ones stop at the first iteration with the Trainer's error, naming the tensor and
the fix; the fixed ones print what they print without it, exit 0 and warn nothing. Each script
runs under watch in a process of its own, forked from one that imported torch once (what
``python -m safeloop.watch`` does after its imports); the command line itself runs as a real
``python`` subprocess in the tests at the end.
"""
from __future__ import annotations

import json
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.conftest import subprocess_env

SCRIPTS = Path(__file__).parent / "scripts"

# script -> what its last line of stderr says under watch (the error, the tensor, the fix)
BROKEN = {
    "seed000_ex1_backward_twice": r"DoubleBackwardError: .*\(step 2, loss 'loss'\): this loss \(ViewBackward0, held by "
                                  r"`local loss`\) was already back-propagated in step 1 .*pass retain_graph=True",
    "seed000_ex2_reused_input": r"GraphReuseError: .*\(step 1, loss 'loss'\).*held by `local input_data`.*"
                                r"recompute `input_data` inside the loop",
    "seed000_ex3_edit_grads": r"DoubleBackwardError: .*\(step 2, loss 'loss'\).*held by `local loss`",
    "seed001_reused_graph": r"GraphReuseError: .*\(step 1, loss 'loss'\): the loss reaches MvBackward0, built before "
                            r"the step \(before the loop\) and held by `global y`.*To fix: recompute `y` inside the loop",
    "seed002_backward_twice": r"DoubleBackwardError: .*\(step 1, loss 'loss'\).*held by `global computed_loss`.*"
                              r"pass retain_graph=True to every backward but the last",
    # a step ends at each optimizer step: the penalty's is the second of the iteration, not a graph kept across steps
    "gan_lazy_r1": r"InplaceModificationError: .*\(step 2, loss 'loss'\): optimizer 'd_optim' stepped after this loss "
                   r"was built and before its backward.*a gradient penalty from a fresh D\(real\)",
    "gan_fake_not_detached": r"DoubleBackwardError: .*\(step 2, loss 'loss'\): the loss reaches TanhBackward0, made "
                             r"earlier in this loop iteration and held by `global fake`.*`fake.detach\(\)`",
    # the fix is where values are added to the list, not one element of it
    "baseline_list": r"CarriedGraphError: .*\(step 2, loss 'loss'\).*held by `global returns\[0\]`.*To fix: detach "
                     r"what is added to `returns` where it is added \(`returns.append\(x.detach\(\)\)`",
    "leaf_loss": r"NoGraphError: .*\(step 1, loss 'loss'\): it is a leaf tensor made with requires_grad=True",
    # caught at step 2, where PyTorch fails at step 3, with a reason retain_graph=True does not mislead
    "rnn_state_retained": r"CarriedGraphError: .*\(step 2, loss 'loss'\).*held by `global h`; the last step's "
                          r"backward already ran its graph \(retain_graph=True kept it\).*`h = h.detach\(\)`",
    # made once before the loop, used by the first generator step after two critic steps
    "wgan_fake_before_loop": r"GraphReuseError: .*\(step 3, loss 'loss'\): the loss reaches AddmmBackward0, built "
                             r"before the step \(before the loop\) and held by `global fake`.*recompute `fake` inside "
                             r"the loop",
    # the closure's evaluations run inside one optimizer step(): one step, not a graph carried from another
    "lbfgs_forward_outside_closure": r"DoubleBackwardError: .*\(step 1, loss 'loss'\): the loss reaches "
                                     r"AddmmBackward0, held by `global out`.*compute `out` again",
    # seed 001's graph held by a submodule of a model that a function's loop trains
    "scaled_weight_at_init": r"GraphReuseError: .*\(step 1, loss 'loss'\): the loss reaches MulBackward0, built before "
                             r"the step \(before the loop\) and held by `model.0.scaled`.*recompute `model.0.scaled` "
                             r"inside the loop",
    # a tensor a custom autograd Function keeps on ctx, changed in place by a residual `h += ...` (issue 35)
    "ctx_attribute_inplace": r"InplaceModificationError: .*\(step 1, loss 'loss'\): the loss reaches "
                             r"LinearFunctionBackward, the node of the autograd Function `LinearFunction`, which keeps "
                             r"`global h` as an attribute of its ctx \(`ctx.input`\).*change it out of place",
    # WGAN's weight clipping through .data moved after the critic's forward: seen with --check always only, from the
    # second step (the first checked step puts the fingerprints' hooks on the modules)
    "wgan_clip_after_forward": r"InplaceModificationError: .*\(step 2, loss 'loss'\): the loss reaches AddmmBackward0, "
                               r"whose graph saved `netD.2.weight`.*through `.data`.*To fix: write them before the "
                               r"forward that uses them",
}
# scripts that run to their end, warning once (the line of the script that warns, the parameter, the fix)
WARNED = {
    "plain_list_layers": r"plain_list_layers.py:27: UnusedGradientWarning: .*\(step 2, loss 'loss'\): the loss reaches "
                         r"`model.layers\[1\].weight`, `model.layers\[0\].weight`.*keep layers in an nn.ModuleList",
    "layer_in_forward": r"layer_in_forward.py:25: UnusedGradientWarning: .*\(step 3, loss 'loss'\): the loss reaches "
                        r"`model.layer2.weight`, `model.layer2.bias`.*create layers and Parameters once, in __init__",
    "maml_detached_fast_weights": r"maml_detached_fast_weights.py:29: UnusedGradientWarning: .*\(step 2, "
                                  r"loss 'loss'\): the loss reaches none of the parameters the optimizers update, only an unnamed "
                                  r"tensor shaped as `model.2.weight`.*create_graph=True",
}
# scripts that run to their end, warning once that graphs pile up (the holder, the fix) (issue 35)
LEAKED = {
    "epoch_outputs_list": r"epoch_outputs_list.py:17: GraphLeakWarning: .*\(step 2\).*held by "
                          r"`global all_outputs\[0\]`.*To fix: detach what is added to `all_outputs` where it is added "
                          r"\(`all_outputs.append\(x.detach\(\)\)`",
    "create_graph_grads": r"create_graph_grads.py:13: GraphLeakWarning: .*\(step 2\).*held by `model.0.weight.grad`.*"
                          r"To fix: set the gradients to None before each backward "
                          r"\(`optimizer.zero_grad\(set_to_none=True\)`",
}
# scripts that catch the RuntimeError themselves and print it: they print the guard's explanation instead
NO_GRAPH = ("seed003_detach", "seed003_no_grad", "seed004_detach", "seed004_requires_grad")
FIXED = sorted(p.stem for p in SCRIPTS.glob("*.py") if p.stem not in {*BROKEN, *WARNED, *LEAKED, *NO_GRAPH})

# Runs every fixed script without watch in one process, each from the RNG state a fresh process has.
PLAIN = """
import contextlib, io, json, runpy, sys, torch
fresh, out = torch.get_rng_state(), {}
for path in sys.argv[1:]:
    torch.set_rng_state(fresh)
    buffer = io.StringIO()
    with contextlib.redirect_stdout(buffer):
        runpy.run_path(path, run_name="__main__")
    out[path] = buffer.getvalue()
print(json.dumps(out))
"""


# Runs each script under watch in a child process of its own: exit code, stdout and stderr by script. A script whose
# first line is "# watch: OPTIONS" runs with them.
WATCHED = """
import json, os, sys, tempfile
import torch  # once, before the forks: what every child would import first
import safeloop.watch
out, running = {}, {}
def reap():
    pid, status = os.wait()
    path, files = running.pop(pid)
    out[path] = [os.waitstatus_to_exitcode(status)] + [open(f).read() for f in files]
for path in sys.argv[1:]:
    first = open(path).readline()  # "# watch: --check always": the options the script runs with
    options = first.split(":", 1)[1].split() if first.startswith("# watch:") else []
    if len(running) == 4:
        reap()
    files = [tempfile.mkstemp()[1] for _ in range(2)]
    sys.stdout.flush(), sys.stderr.flush()
    pid = os.fork()
    if pid == 0:  # the child: python -m safeloop.watch path, its output to the files; exits with its code
        for fd, name in zip((1, 2), files):
            os.dup2(os.open(name, os.O_WRONLY), fd)
        sys.exit(safeloop.watch.main([*options, path]))
    running[pid] = path, files
while running:
    reap()
print(json.dumps(out))
"""


def run(*args: str, cwd: Path, timeout: int = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], cwd=cwd, env=subprocess_env(), capture_output=True, text=True,
                          timeout=timeout)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Every script under watch (exit code, stdout, stderr), and the fixed ones without it (stdout), by script."""
    cwd = tmp_path_factory.mktemp("watch")
    names = sorted(p.stem for p in SCRIPTS.glob("*.py"))
    with ThreadPoolExecutor(2) as pool:
        # every script in two processes: minutes, not seconds, on cores other test runs share
        plain = pool.submit(run, "-c", PLAIN, *(str(SCRIPTS / f"{n}.py") for n in FIXED), cwd=cwd, timeout=300)
        watched = pool.submit(run, "-c", WATCHED, *(str(SCRIPTS / f"{n}.py") for n in names), cwd=cwd, timeout=300)
    for proc in plain.result(), watched.result():
        assert proc.returncode == 0, proc.stderr
    results = {Path(k).stem: subprocess.CompletedProcess(k, *v) for k, v in json.loads(watched.result().stdout).items()}
    assert sorted(results) == names
    return results, {Path(k).stem: v for k, v in json.loads(plain.result().stdout).items()}


@pytest.mark.parametrize("name", sorted(BROKEN))
def test_a_broken_seed_script_stops_at_the_first_iteration_naming_the_tensor_and_the_fix(runs, name):
    proc = runs[0][name]
    assert proc.returncode == 1
    assert re.search(BROKEN[name], proc.stderr.strip().splitlines()[-1]), proc.stderr[-3000:]
    assert f"{name}.py" in proc.stderr  # the script's own frames in the traceback


def test_seed_001_stops_before_its_first_iteration_ends(runs):
    assert runs[0]["seed001_reused_graph"].stdout == ""  # without watch: "iteration 0: ..." then the crash


@pytest.mark.parametrize("name", sorted(WARNED))
def test_a_script_whose_gradients_go_nowhere_runs_as_without_watch_and_says_so_once(runs, name):
    proc = runs[0][name]
    assert proc.returncode == 0, proc.stderr
    assert len(re.findall("UnusedGradientWarning", proc.stderr)) == 1, proc.stderr
    assert re.search(WARNED[name], proc.stderr), proc.stderr


@pytest.mark.parametrize("name", sorted(LEAKED))
def test_a_script_keeping_graphs_outside_the_loss_runs_as_without_watch_and_names_the_holder_once(runs, name):
    proc = runs[0][name]
    assert proc.returncode == 0, proc.stderr
    assert len(re.findall("GraphLeakWarning", proc.stderr)) == 1, proc.stderr
    assert re.search(LEAKED[name], proc.stderr), proc.stderr


@pytest.mark.parametrize("name", NO_GRAPH)
def test_a_script_catching_the_error_prints_the_explanation_instead(runs, name):
    proc = runs[0][name]
    assert proc.returncode == 0, proc.stderr
    assert "loss has no autograd graph (step 1, loss 'loss')" in proc.stdout
    assert "does not depend on any tensor that requires grad" in proc.stdout


@pytest.mark.parametrize("name", FIXED)
def test_a_fixed_seed_script_prints_what_it_prints_without_watch_and_warns_nothing(runs, name):
    proc = runs[0][name]
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == runs[1][name]
    assert "Warning" not in proc.stderr and "safeloop" not in proc.stderr, proc.stderr


def test_a_scripts_own_error_keeps_its_exit_code_and_traceback(tmp_path):
    script = tmp_path / "train.py"
    script.write_text("import sys\nprint(sys.argv[1:])\n\ndef load():\n    raise ValueError('no data in ./data')\n\n"
                      "load()\n")
    plain, watched = run(str(script), "--epochs", "3", cwd=tmp_path), \
        run("-m", "safeloop.watch", str(script), "--epochs", "3", cwd=tmp_path)
    assert watched.returncode == plain.returncode == 1
    assert watched.stdout == plain.stdout == "['--epochs', '3']\n"
    assert watched.stderr == plain.stderr  # the same traceback, no frame of safeloop's


def test_a_scripts_own_warnings_are_shown_as_often_as_without_watch(tmp_path):
    """Python shows a warning once per place; watch must not reset that (changing the warning filters does),
    nor add any: the script imports torch.distributed, whose deprecated `reduce_op` warns when looked at."""
    script = tmp_path / "train.py"
    script.write_text("import warnings\nimport torch\nimport torch.distributed as dist\n"
                      "model = torch.nn.Linear(2, 1)\nopt = torch.optim.SGD(model.parameters(), lr=0.1)\n"
                      "for step in range(3):\n    warnings.warn('a warning of the script')\n"
                      "    model(torch.ones(4, 2)).sum().backward()\n    opt.step()\n    opt.zero_grad()\n")
    watched = run("-m", "safeloop.watch", str(script), cwd=tmp_path)
    assert watched.returncode == 0
    # what Python prints without watch: the warning, once, and the line that warns
    assert watched.stderr == f"{script}:7: UserWarning: a warning of the script\n  warnings.warn('a warning of the script')\n"


def test_the_script_runs_as_the_same_main_module_as_without_watch(tmp_path):
    """``__name__``, ``__spec__`` and ``__loader__`` as ``python train.py`` sets them (Python 3.12's warnings read
    the loader of the module a warning points at: without one, a warning about the script failed)."""
    script = tmp_path / "train.py"
    script.write_text("import warnings\nprint(__name__, __spec__, type(__loader__).__name__, __loader__.name)\n"
                      "warnings.warn_explicit('said', UserWarning, __file__, 2, module_globals=globals())\n")
    plain, watched = run(str(script), cwd=tmp_path), run("-m", "safeloop.watch", str(script), cwd=tmp_path)
    assert watched.returncode == plain.returncode == 0, watched.stderr
    assert watched.stdout == plain.stdout == "__main__ None SourceFileLoader __main__\n"
    assert watched.stderr == plain.stderr


def test_watch_refuses_a_script_that_is_not_there(tmp_path):
    proc = run("-m", "safeloop.watch", "nothere.py", cwd=tmp_path)
    assert proc.returncode == 2 and "nothere.py: no such file (give the path of a Python script)" in proc.stderr


def test_the_safeloop_command_runs_a_script_under_watch(tmp_path):
    proc = run("-m", "safeloop", "watch", str(SCRIPTS / "seed001_reused_graph.py"), cwd=tmp_path)
    assert proc.returncode == 1 and "held by `global y`" in proc.stderr.splitlines()[-1]
    proc = run("-m", "safeloop", "watch", "--help", cwd=tmp_path)
    assert proc.returncode == 0 and proc.stdout.startswith("usage: safeloop watch")


def test_a_running_sum_of_the_losses_is_warned_about_when_each_backward_is_of_the_loss_divided(tmp_path):
    """Gradient accumulation written by hand: each micro-batch back-propagates ``loss / accumulate`` while
    ``running`` sums the losses themselves, with their graphs (meant: ``loss.item()``)."""
    script = tmp_path / "train.py"
    script.write_text("import torch\ntorch.manual_seed(0)\nmodel = torch.nn.Linear(4, 1)\n"
                      "opt = torch.optim.SGD(model.parameters(), lr=0.1)\naccumulate, running = 2, 0.0\n"
                      "for i in range(8):\n    loss = model(torch.randn(3, 4)).pow(2).mean()\n"
                      "    running = running + loss\n    (loss / accumulate).backward()\n"
                      "    if i % accumulate == 1:\n        opt.step()\n        opt.zero_grad()\n"
                      "print(f'mean loss {running.item() / 8:.6f}')\n")
    plain, watched = run(str(script), cwd=tmp_path), run("-m", "safeloop.watch", str(script), cwd=tmp_path)
    assert watched.returncode == plain.returncode == 0
    assert watched.stdout == plain.stdout
    assert f"{script}:9: GraphLeakWarning: autograd graph kept alive after its step (step 2): steps 1 and 2: the autograd " \
           "graphs of both steps are still alive, held by `global running`" in watched.stderr



# scripts whose run under watch must match `python script.py` in exit code, stdout and stderr
AS_WITHOUT_WATCH = {
    # multiprocessing's spawn start method runs the script's module-level code again in each worker, as
    # __mp_main__ (it finds the script from sys.modules['__main__'])
    "spawn": "import multiprocessing\nimport random\n\nrandom.seed(0)\nscale = random.random()  # made again in each "
             "worker\n\n\ndef work(rank):\n    return f'worker {rank} loss {scale * (rank + 1):.6f} as {__name__}'\n\n"
             "\nif __name__ == '__main__':\n    with multiprocessing.get_context('spawn').Pool(2) as pool:\n"
             "        print('\\n'.join(pool.map(work, range(2))))\n",
    "syntax_error": "print('start')\nx = (1,\n",  # its line and caret, no traceback, exit code 1
    "keyboard_interrupt": "print('start')\n\n\ndef load():\n    raise KeyboardInterrupt\n\n\nload()\n",  # ends by SIGINT
}


def test_a_script_that_spawns_workers_or_stops_by_syntax_error_or_ctrl_c_shows_as_without_watch(tmp_path):
    scripts = []
    for name, source in AS_WITHOUT_WATCH.items():
        scripts.append(tmp_path / f"{name}.py")
        scripts[-1].write_text(source)
    with ThreadPoolExecutor(2) as pool:
        plain = list(pool.map(lambda s: run(str(s), cwd=tmp_path), scripts))
        watched = list(pool.map(lambda s: run("-m", "safeloop.watch", str(s), cwd=tmp_path), scripts))
    assert [p.returncode for p in plain] == [0, 1, -2]
    assert plain[0].stdout == "worker 0 loss 0.844422 as __mp_main__\nworker 1 loss 1.688844 as __mp_main__\n"
    for script, p, w in zip(scripts, plain, watched):
        assert (w.returncode, w.stdout, w.stderr) == (p.returncode, p.stdout, p.stderr), script.name
