"""The README stays a front door, and no link in the documentation points nowhere.

Every relative link in README.md, docs/*.md and benchmarks/README.md must name a file (or folder)
of the repository, and every ``#anchor`` a heading of the file it points into, by GitHub's rules:
lowercase, spaces to ``-``, punctuation other than ``-`` and ``_`` dropped, ``-1``, ``-2``... for
repeated headings.
"""
from __future__ import annotations

import importlib.util
import itertools
import re
import shlex
import sys
from pathlib import Path

import hydra
import pytest
from hydra.core.override_parser.overrides_parser import OverridesParser

from safeloop import ConfigError, config
from tests.conftest import ROOT

README_MAX_LINES = 300
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "benchmarks" / "README.md"]

_FENCE = re.compile(r"^\s*(```|~~~)")
_CODE_SPAN = re.compile(r"(`+).*?\1")
_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")


def prose_lines(text: str) -> list[tuple[int, str]]:
    """``(line number, line)`` outside fenced code blocks, with inline code spans blanked."""
    out, fenced = [], False
    for number, line in enumerate(text.splitlines(), 1):
        if _FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            out.append((number, line))
    return out


def slug(heading: str) -> str:
    """GitHub's anchor for a heading's text."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link in a heading: its text
    text = text.replace("`", "").strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)  # \w keeps letters, digits and _
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    for _, line in prose_lines(path.read_text(encoding="utf-8")):
        match = _HEADING.match(line)
        if not match:
            continue
        base = slug(match.group(2))
        count = seen.get(base, 0)
        seen[base] = count + 1
        out.add(base if count == 0 else f"{base}-{count}")
    return out


def links(path: Path) -> list[tuple[int, str]]:
    out = []
    for number, line in prose_lines(path.read_text(encoding="utf-8")):
        line = _CODE_SPAN.sub(lambda m: " " * len(m.group(0)), line)  # a link inside code is no link
        out += [(number, m.group(1)) for m in _LINK.finditer(line)]
    return out


def broken_links(path: Path) -> list[str]:
    """Every relative link of ``path`` that names no file, or an anchor no heading makes."""
    problems = []
    for number, target in links(path):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I):  # https:, mailto: ...
            continue
        where = f"{path.relative_to(ROOT)}:{number}: {target}"
        file_part, _, anchor = target.partition("#")
        linked = (path.parent / file_part).resolve() if file_part else path
        if not linked.exists():
            problems.append(f"{where}: no such file {linked}")
            continue
        if ROOT.resolve() not in linked.parents and linked != ROOT.resolve():
            problems.append(f"{where}: points outside the repository")
            continue
        if anchor:
            if linked.suffix != ".md" or linked.is_dir():
                problems.append(f"{where}: an anchor into a file that is not markdown")
            elif anchor not in anchors(linked):
                problems.append(f"{where}: no heading of {linked.relative_to(ROOT.resolve())} has the anchor "
                                f"#{anchor} (it has: {', '.join(sorted(anchors(linked)))})")
    return problems


def test_the_pages_exist():
    for page in PAGES:
        assert page.is_file(), page
    assert len(PAGES) >= 7  # README, benchmarks/README and the pages of docs/


def test_the_readme_is_a_front_door_of_at_most_300_lines():
    lines = (ROOT / "README.md").read_text(encoding="utf-8").splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines; move detail into docs/"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_and_anchor_resolves(page):
    assert links(page) or page.name != "README.md", "the README links into docs/"
    assert broken_links(page) == []


def test_the_readme_links_every_page_of_docs():
    linked = {(ROOT / target.partition("#")[0]).resolve() for _, target in links(ROOT / "README.md")}
    for page in PAGES[1:]:
        assert page.resolve() in linked, f"README.md does not link {page.relative_to(ROOT)}"


# -- the checker itself --------------------------------------------------------------------------
def test_slugs_follow_githubs_rules():
    assert slug("A failed step, and `trainer.undo`") == "a-failed-step-and-trainerundo"
    assert slug("Closures and two-phase updates (L-BFGS, SAM)") == "closures-and-two-phase-updates-l-bfgs-sam"
    assert slug("Reliability: what is guaranteed and what is not") == "reliability-what-is-guaranteed-and-what-is-not"
    assert slug("Unmodified scripts: `safeloop.watch`") == "unmodified-scripts-safeloopwatch"
    assert slug("snake_case stays") == "snake_case-stays"


def test_a_broken_link_or_anchor_is_reported(tmp_path, monkeypatch):
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.md").write_text("# Title\n\n## Some heading\n\n## Some heading\n")
    page = tmp_path / "README.md"
    page.write_text(
        "[ok](docs/a.md) [ok](docs/a.md#some-heading) [ok](docs/a.md#some-heading-1) [ok](#top)\n"
        "# Top\n"
        "[gone](docs/b.md) [bad anchor](docs/a.md#nowhere) [bad here](#nothing)\n"
        "`[in code](docs/c.md)`\n"
        "```\n[in a block](docs/d.md)\n```\n"
        "[web](https://example.org/x.md#y)\n")
    problems = broken_links(page)
    assert [p.split(": ", 2)[1] for p in problems] == ["docs/b.md", "docs/a.md#nowhere", "#nothing"], problems


# -- every command of the docs runs as written ----------------------------------------------------
# The command lines of README.md's and docs/*.md's ```bash blocks (not inline code, not the ``` blocks
# that show a run's output, such as a bad override's error). Each ``python -m safeloop`` / ``safeloop`` /
# ``python recipes/...`` / ``torchrun ...`` / ``srun ...`` command is composed with its overrides as the command line
# does it (a sweep's every combination; a torchrun command's safeloop part, which is composed, not
# launched: tests/test_distributed.py launches torchrun). That is quick, and finds a key, a value or a
# path the config refuses. A block with a ``trainer.resume=`` command is also run, in order, so that a
# resume finds what the commands before it wrote: composed and trained in this process, as
# ``python -m safeloop`` does (``safeloop.config.train``), each shortened to a fiftieth of its steps.
# The commands below are left alone, each for its reason; any other command fails the test until it
# gets a rule here.
DOC_PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
NOT_RUN = {
    ("pip",): "installs packages",
    ("python3", "-m", "venv"): "makes a virtualenv",
    (".",): "activates a virtualenv",
    ("python", "-m", "pytest"): "the test command: this is one of its tests",
    ("python", "-m", "safeloop.watch"): "runs the user's own script (train.py [args]); tests/watch/ runs watch",
    ("safeloop", "watch"): "runs the user's own script (train.py [args]); tests/watch/ runs watch",
    ("sbatch",): "submits a job to SLURM; tests/test_slurm.py runs its srun command's parts",
}
# The user's own code that the docs' commands name (docs/configuration.md says what each takes).
USER_CODE = {
    "mypackage/__init__.py": "",
    "mypackage/train.py": "import safeloop\n\n\nclass Classifier(safeloop.Trainer):\n    pass\n",
    "mytrain.py": "import safeloop\n\n\nclass Classifier(safeloop.Trainer):\n    pass\n",
    "mypackage/nets.py": "import torch\nfrom safeloop.models import MLP as MyMLP  # in_dim, hidden, out_dim, depth\n\n"
                         "class Wide(torch.nn.Sequential):\n"
                         "    def __init__(self, in_dim: int, out_dim: int, width: int = 256):\n"
                         "        super().__init__(torch.nn.Linear(in_dim, width), torch.nn.Linear(width, out_dim))\n",
}
LAUNCHERS = {"submitit_slurm": "hydra_plugins.hydra_submitit_launcher",  # the plugins the docs install first
             "submitit_local": "hydra_plugins.hydra_submitit_launcher"}
SWEEPERS = {"optuna": "hydra_plugins.hydra_optuna_sweeper"}


def installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:  # its package is not there either
        return False


def shell_blocks(path: Path) -> list[tuple[str, list[tuple[int, str]]]]:
    """``(language, [(line number, line)])`` of each fenced block of ``path``; continued lines joined."""
    blocks, block = [], None
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        fence = re.match(r"^\s*```(\w*)", line)
        if fence and block is None:
            block = (fence.group(1), [])
        elif fence:
            blocks.append(block)
            block = None
        elif block is None:
            continue
        elif block[1] and block[1][-1][1].endswith("\\"):
            block[1][-1] = (block[1][-1][0], block[1][-1][1][:-1] + " " + line.strip())
        else:
            block[1].append((number, line))
    return blocks


def commands(path: Path) -> list[list[tuple[int, list[str]]]]:
    """The commands of each bash block of ``path``, as words, comments dropped, ``a && b`` split."""
    out = []
    for language, lines in shell_blocks(path):
        if language in ("bash", "sh", "shell"):
            out.append([(number, shlex.split(part, comments=True)) for number, line in lines
                        for part in line.split("&&") if shlex.split(part, comments=True)])
    return out


def safeloop_args(words: list[str]) -> tuple[list[str], list[str]] | None:
    """What a command gives safeloop's Hydra: ``(flags, overrides)``; None for a command in ``NOT_RUN``."""
    if any(tuple(words[:len(start)]) == start for start in NOT_RUN):
        return None
    if words[0] == "torchrun":  # its own options, then -m MODULE or a script
        at = next(i for i, w in enumerate(words) if w == "-m" or w.endswith(".py"))
        words = ["python", *words[at:]]
    if words[0] == "srun":  # its own options, then the command each task runs
        words = words[next(i for i, w in enumerate(words) if w in ("python", "safeloop")):]
    if words[:3] == ["python", "-m", "safeloop"] or words[0] == "safeloop":
        args = words[3:] if words[0] == "python" else words[1:]
    elif words[0] == "python" and words[1].startswith("recipes/"):  # recipes/gan.py is experiment=gan
        args = words[2:]
        if not any(a.split("=")[0].lstrip("+~") == "experiment" for a in args):
            args.insert(0, f"experiment={Path(words[1]).stem}")
    else:
        raise AssertionError(f"no rule for the command {shlex.join(words)!r}: compose or run it here, or add it to "
                             "NOT_RUN with its reason")
    args = [a for a in args if a != "..."]  # "and more overrides"
    for a in args:  # a launcher plugin the docs install first is only there where it was installed
        launcher = re.match(r"hydra/launcher=(\w+)", a)
        if launcher and not installed(LAUNCHERS[launcher.group(1)]):
            args = [b for b in args if not b.startswith(("hydra/launcher=", "hydra.launcher."))]
        sweeper = re.match(r"hydra/sweeper=(\w+)", a)
        if sweeper and not installed(SWEEPERS[sweeper.group(1)]):
            args = [b for b in args if not b.startswith(("hydra/sweeper=", "hydra.sweeper."))]
    return [a for a in args if a.startswith("-")], [a for a in args if not a.startswith("-")]


def compose_problems(flags: list[str], overrides: list[str]) -> list[str]:
    """The problems the command line would find composing ``overrides``: a sweep (``-m``) in each of its
    combinations; ``--config-dir`` as Hydra adds it (a search path), then the values checked as a run does."""
    assert set(f.split("=")[0] for f in flags) <= {"-m", "--config-dir"}, f"no rule for the flags {flags}"
    parsed = OverridesParser.create().parse_overrides(overrides)
    choices = [[f"{o.get_key_element()}={v}" for v in o.sweep_string_iterator()] if o.is_sweep_override()
               else [o.input_line] for o in parsed]
    problems = []
    for combination in itertools.product(*choices):
        dirs = [f.split("=", 1)[1] for f in flags if f.startswith("--config-dir=")]
        try:
            if dirs:
                config.register()
                search = f"hydra.searchpath=[{','.join(f'file://{Path(d).resolve()}' for d in dirs)}]"
                with hydra.initialize_config_dir(config_dir=str(config.CONFIG_DIR), version_base=None):
                    problems += config.check(hydra.compose("train", overrides=[search, *combination]))
            else:
                config.compose(list(combination))
        except (ConfigError, hydra.errors.HydraException) as err:
            problems.append(str(err))
    return problems


def shortened(overrides: list[str]) -> list[str]:
    """The same run with a fiftieth of its steps (the default job's 1000 when it sets none)."""
    steps = next((int(o.split("=")[1]) for o in overrides if o.startswith("trainer.max_steps=")), 1000)
    return [o for o in overrides if not o.startswith("trainer.max_steps=")] + [f"trainer.max_steps={steps // 50}"]


@pytest.mark.parametrize("page", DOC_PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_command_of_the_docs_runs_as_written(page, tmp_path, monkeypatch, caplog):
    for name, text in USER_CODE.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    for language, lines in shell_blocks(page):  # a config file or module the page shows, under the path it names
        named = re.match(r"#\s*(\S+\.(?:ya?ml|py))$", lines[0][1].strip()) if language in ("yaml", "yml", "python") \
            and lines else None
        if named:
            (tmp_path / named.group(1)).parent.mkdir(parents=True, exist_ok=True)
            (tmp_path / named.group(1)).write_text("\n".join(line for _, line in lines) + "\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    problems = []
    for block in commands(page):
        run = any(o.startswith("trainer.resume=") for _, words in block for o in words)
        for number, words in block:
            args = safeloop_args(words)
            if args is None:
                continue
            where = f"{page.relative_to(ROOT)}:{number}: {shlex.join(words)}"
            problems += [f"{where}: {p}" for p in compose_problems(*args)]
            if run and not problems:  # what python -m safeloop runs, here (tests/test_cli.py runs the command)
                assert not args[0], f"{where}: no rule to run the flags {args[0]}"
                caplog.clear()
                with caplog.at_level("INFO", logger="safeloop"):
                    config.train(config.compose(shortened(args[1])))
                resume = next((o.split("=", 1)[1] for o in args[1] if o.startswith("trainer.resume=")), None)
                if resume not in (None, "auto"):
                    assert f"resumed from {Path(resume)}" in caplog.text, where
    assert problems == []
