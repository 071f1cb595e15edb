"""The README and docs/*.md name only what exists: every path they quote under tests/, benchmarks/,
src/, docs/ and examples/ (and benchmarks' results/), every test file they name, every test
``file.py::name`` they quote, and every relative link. A file moved or a test renamed then fails
here, instead of leaving the docs pointing at nothing (RELIABILITY.md named tests/distributed/
test_sync.py and tests/test_low_communication.py long after both were gone)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

# a repository path: a top folder, then path characters, ending in a word character or "/";
# ``file.py::test_name`` (a parametrised one's id in brackets) names a test in it
PATH = re.compile(r"(?<![\w/.<-])((?:tests|benchmarks|src|docs|examples)/[\w./-]*[\w/])(?:::(\w+)(?:\[[^\]\s`]*\])?)?")
RESULTS = re.compile(r"(?<![\w/.<-])(results/[\w./-]*[\w/])")  # benchmarks' results, as BENCHMARKS.md says them
BARE_TEST = re.compile(r"(?<![\w/.<-])(test_\w+\.py)(?:::(\w+))?")  # a test file named without its folder
LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")


def quoted(text: str, folder: Path) -> list[tuple[str, str | None]]:
    """(path from the repository root, test name or None) for everything ``text`` (a doc in
    ``folder``, which its relative links start from) quotes."""
    found = [(m.group(1), m.group(2)) for m in PATH.finditer(text)]
    found += [("benchmarks/" + m.group(1), None) for m in RESULTS.finditer(text)]
    for m in BARE_TEST.finditer(text):
        where = sorted((ROOT / "tests").rglob(m.group(1)))
        found.append((str(where[0].relative_to(ROOT)) if len(where) == 1 else f"tests/**/{m.group(1)}", m.group(2)))
    for m in LINK.finditer(text):
        if not re.match(r"\w+:", m.group(1)):  # a relative link, not https: or mailto:
            found.append((str((folder / m.group(1)).resolve().relative_to(ROOT)), None))
    return found


def anchors(text: str, folder: Path, here: Path) -> list[tuple[str, str]]:
    """(file from the repository root, anchor) for every link of ``text`` (the doc ``here``, in
    ``folder``) to a heading of a markdown file: ``(#x)`` in itself, ``(OTHER.md#x)`` elsewhere."""
    found = []
    for m in re.finditer(r"\]\(([^)#\s]*)#([^)\s]+)\)", text):
        target = here if not m.group(1) else (folder / m.group(1)).resolve()
        if target.suffix == ".md" and not re.match(r"\w+:", m.group(1)):
            found.append((str(target.relative_to(ROOT)), m.group(2)))
    return found


def slugs(path: Path) -> set[str]:
    """The anchors a markdown file's headings make, as GitHub makes them (lower case, punctuation
    but hyphens dropped, spaces to hyphens), outside code blocks."""
    text = re.sub(r"(?ms)^```.*?^```", "", path.read_text())
    heads = re.findall(r"(?m)^#+ (.+?)\s*$", text)
    return {re.sub(r"[^\w\- ]", "", h.lower()).replace(" ", "-") for h in heads}


def defined(path: Path) -> set[str]:
    """The functions and classes a Python file defines, at any depth (tests inside classes too)."""
    tree = ast.parse(path.read_text())
    return {n.name for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))}


@pytest.mark.parametrize("doc", DOCS, ids=[str(d.relative_to(ROOT)) for d in DOCS])
def test_every_path_and_test_a_doc_quotes_exists(doc: Path) -> None:
    missing = []
    for path, name in quoted(doc.read_text(), doc.parent):
        if not (ROOT / path).exists():
            missing.append(path)
        elif name is not None and name not in defined(ROOT / path):
            missing.append(f"{path}::{name}")
    assert sorted(set(missing)) == [], f"{doc.name} quotes what does not exist"


@pytest.mark.parametrize("doc", DOCS, ids=[str(d.relative_to(ROOT)) for d in DOCS])
def test_every_anchor_a_doc_links_to_is_a_heading(doc: Path) -> None:
    """A section moved to another file, or renamed, leaves no link to a heading that is gone."""
    missing = [
        f"{path}#{anchor}"
        for path, anchor in anchors(doc.read_text(), doc.parent, doc)
        if anchor not in slugs(ROOT / path)
    ]
    assert missing == [], f"{doc.name} links to headings that do not exist"


def test_the_check_reads_what_docs_quote() -> None:
    """The patterns on a sample: paths with and without a test, a parametrised id, a bare test
    file, a results file, a relative link, and what is none of these (runs/, a dotted name, a URL)."""
    text = (
        "See `tests/test_cli.py::test_listing_commands`, tests/fault/test_hardening.py::"
        "test_a_script_that_spawns_its_loop_at_module_level_is_one_error_line[allreduce-spawn], "
        "(`test_resume.py`), results/limits.txt, [the guide](CHOOSING.md#slow-networks), "
        "[site](https://example.org/x), runs/<run>/model.pt, `launch.Outbox`, benchmarks/results/."
    )
    got = quoted(text, ROOT / "docs")
    assert got == [
        ("tests/test_cli.py", "test_listing_commands"),
        ("tests/fault/test_hardening.py", "test_a_script_that_spawns_its_loop_at_module_level_is_one_error_line"),
        ("benchmarks/results/", None),
        ("benchmarks/results/limits.txt", None),
        ("tests/fault/test_resume.py", None),
        ("docs/CHOOSING.md", None),
    ]
    assert "test_listing_commands" in defined(ROOT / "tests" / "test_cli.py")
    assert anchors(text, ROOT / "docs", ROOT / "docs" / "SAMPLE.md") == [("docs/CHOOSING.md", "slow-networks")]
    assert {"slow-networks", "the-short-version"} <= slugs(ROOT / "docs" / "CHOOSING.md")
    assert "benchmarking-which-algorithm" in slugs(ROOT / "README.md")
