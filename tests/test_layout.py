"""The shape of the code a newcomer reads: one step loop, a Trainer read in one sitting, and no module
reaching into another's private names."""
import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SOURCES = sorted((ROOT / "safeloop").rglob("*.py")) + sorted((ROOT / "recipes").rglob("*.py"))


def private(name: str) -> bool:
    """``_name``; not ``__dunder__``, nor Hydra's ``_target_`` / ``_partial_`` keys."""
    return name.startswith("_") and not name.endswith("_")


def defined_privates(tree: ast.Module) -> set[str]:
    """The private names a module defines: functions, classes, methods, attributes it assigns, globals."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and private(node.name):
            names.add(node.name)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) and private(node.attr):
            names.add(node.attr)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store) and private(node.id):
            names.add(node.id)
    return names


def cross_module_reads(trees: dict[Path, ast.Module]) -> list[str]:
    """``x._name`` outside ``self``/``cls``, or ``from .mod import _name``, where ``_name`` is defined by
    another of these modules and not by the one reading it."""
    owners: dict[str, set[Path]] = {}
    for path, tree in trees.items():
        for name in defined_privates(tree):
            owners.setdefault(name, set()).add(path)
    found = []
    for path, tree in trees.items():
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and private(node.attr) and not (
                    isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")):
                name = node.attr
            elif isinstance(node, ast.ImportFrom):
                name = next((a.name for a in node.names if private(a.name)), None)
            else:
                continue
            if name in owners and path not in owners[name]:
                found.append(f"{path.name}:{node.lineno}: {ast.unparse(node)}")
    return found


def test_no_module_reads_another_modules_private_names():
    """What a module offers the others is its public names. (Private names of torch, Hydra or the
    standard library, such as ``node._sequence_nr()``, are not safeloop's and not checked here.)"""
    found = cross_module_reads({path: ast.parse(path.read_text()) for path in SOURCES})
    assert not found, "private names of another module:\n" + "\n".join(found)


def test_the_rule_finds_private_names_read_across_modules():
    trees = {Path("a.py"): ast.parse("class A:\n    def _hidden(self): ...\n    def own(self): self._hidden()\n"),
             Path("b.py"): ast.parse("from a import _helper\ndef f(a):\n    return a._hidden()\n"),
             Path("c.py"): ast.parse("def _helper(): ...\n")}
    assert cross_module_reads(trees) == ["b.py:1: from a import _helper", "b.py:3: a._hidden"]


def test_the_trainer_reads_in_one_sitting():
    lines = len((ROOT / "safeloop" / "trainer.py").read_text().splitlines())
    assert lines <= 450, f"safeloop/trainer.py has {lines} lines"


@pytest.mark.parametrize("name", ["simple_steps", "plain_update", "_plan_events", "_next_event", "accumulators"])
def test_one_step_loop_and_one_update_path(name):
    """Every step runs ``Runner.run``; every update ``Runner._update``: no second loop or path beside them."""
    users = [str(p.relative_to(ROOT)) for p in SOURCES if name in p.read_text()]
    assert not users, f"{name} in {users}"


def test_no_line_of_the_code_is_longer_than_120_characters():
    benchmarks = sorted((ROOT / "benchmarks").glob("*.py"))
    long = [f"{path.relative_to(ROOT)}:{number}" for path in SOURCES + benchmarks
            for number, line in enumerate(path.read_text().splitlines(), 1) if len(line) > 120]
    assert not long, f"lines over 120 characters: {long}"
