"""The README stays a front door, and no link in the documentation points nowhere.

Every relative link in README.md, docs/*.md and benchmarks/README.md must name a file (or folder)
of the repository, and every ``#anchor`` a heading of the file it points into, by GitHub's rules:
lowercase, spaces to ``-``, punctuation other than ``-`` and ``_`` dropped, ``-1``, ``-2``... for
repeated headings.
"""
from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

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
