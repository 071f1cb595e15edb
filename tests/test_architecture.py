"""The import structure and size limits of docs/ARCHITECTURE.md, checked so a change that breaks
them fails CI: the import-linter contracts in pyproject.toml, and no function over 80 lines; and
the README's account of the code: its table of algorithms and its layout block."""

from __future__ import annotations

import ast
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src" / "distsgd"


def test_import_contracts_hold() -> None:
    exe = shutil.which("lint-imports", path=str(Path(sys.executable).parent)) or shutil.which("lint-imports")
    if exe is None:
        pytest.fail("import-linter is not installed: pip install -e '.[test]'")
    res = subprocess.run([exe, "--no-cache"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-2000:]
    assert "4 kept, 0 broken" in res.stdout


def test_no_function_is_longer_than_80_lines() -> None:
    long = []
    for path in SRC.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > 80:
                    long.append(f"{path.relative_to(ROOT)}:{node.name} ({lines} lines)")
    assert long == []


def _code_strings(path: Path) -> list[str]:
    """The string constants of a module that are not docstrings."""
    tree = ast.parse(path.read_text())
    docstrings = {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
        and node.body
        and isinstance(node.body[0], ast.Expr)
        and isinstance(node.body[0].value, ast.Constant)
    }
    return [
        n.value
        for n in ast.walk(tree)
        if isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in docstrings
    ]


def test_nothing_outside_an_algorithms_module_names_an_algorithm_or_its_options() -> None:
    """An algorithm is one module of distsgd/algorithms: the settings, the command line, the API,
    the launchers, the loop, the data and the bench never name one (a string that is its name,
    ``--algo NAME``, ``NAME[``), nor one of its options (``--option``, ``cfg.option``)."""

    from distsgd.algorithms import registry

    found = []
    for path in sorted(SRC.rglob("*.py")):
        if "algorithms" in path.relative_to(SRC).parts:
            continue
        for text in _code_strings(path):
            for name in registry.names():
                if text == name or re.search(rf"(--algo[ =]|`){re.escape(name)}\b|{re.escape(name)}\[", text):
                    found.append(f"{path.relative_to(ROOT)}: algorithm {name!r} in {text[:60]!r}")
            for option in registry.option_names():
                if re.search(rf"--{re.escape(option.replace('_', '-'))}\b", text):
                    found.append(f"{path.relative_to(ROOT)}: option {option!r} in {text[:60]!r}")
        for node in ast.walk(ast.parse(path.read_text())):
            if (
                isinstance(node, ast.Attribute)
                and node.attr in registry.option_names()
                and isinstance(node.value, ast.Name)
                and node.value.id == "cfg"
            ):
                found.append(f"{path.relative_to(ROOT)}:{node.lineno}: cfg.{node.attr}")
    assert found == []


def test_the_readme_lists_what_the_registry_has() -> None:
    """The README's table of algorithms is `distsgd algorithms --markdown`'s output, verbatim."""
    from distsgd.cli import algorithms_table

    assert algorithms_table() in (ROOT / "README.md").read_text()


_PATH_TOKEN = re.compile(r"[\w.-]+(?:/[\w.-]+)*(?:/|\.py)")


def layout_paths(block: str) -> set[str]:
    """The paths a layout block names, relative to the repository root; folders end in ``/``.

    Each line starts with the paths it names, then its description: the leading tokens that look
    like ``name.py`` or ``name/`` are paths, and the first other token ends them. A line whose
    first path is a folder names that folder, inside the nearest folder above it that is indented
    less; the other paths on the line are inside it. A line that starts with a file names files
    inside the nearest folder above it that is indented less (the block's top level when none is).
    A line that starts with neither is a description carried over and names nothing.
    """
    paths: set[str] = set()
    folders: list[tuple[int, str]] = []  # (indent, path) of the folders enclosing the current line
    for line in block.splitlines():
        tokens = line.split()
        names = []
        for token in tokens:
            if not _PATH_TOKEN.fullmatch(token):
                break
            names.append(token)
        if not names:
            continue
        indent = len(line) - len(line.lstrip())
        while folders and folders[-1][0] >= indent:
            folders.pop()
        here = folders[-1][1] if folders else ""
        if names[0].endswith("/"):
            here += names.pop(0)
            paths.add(here)
            folders.append((indent, here))
        paths.update(here + name for name in names)
    return paths


def _readme_layout() -> str:
    text = (ROOT / "README.md").read_text()
    section = text[text.index("\n## Layout\n") :]
    return section.split("```")[1]


def test_layout_paths_reads_folders_by_indentation() -> None:
    block = (
        "top/\n"
        "  a.py  b.py        two files\n"
        "  pkg/    c.py      a folder and a file in it\n"
        "          d.py      carried on: still pkg/\n"
        "          sub/ e.py a sub-folder of pkg/\n"
        "                    words carried on, then f.py: not a path\n"
        "  g.py              back in top/\n"
        "other/  x/ y/  and prose\n"
    )
    assert layout_paths(block) == {
        *"top/ top/a.py top/b.py top/pkg/ top/pkg/c.py top/pkg/d.py top/pkg/sub/ top/pkg/sub/e.py top/g.py".split(),
        *"other/ other/x/ other/y/".split(),
    }


def test_the_readme_layout_names_every_module_and_only_what_exists() -> None:
    """The README's layout block names every module under src/distsgd, and every path it names
    exists. A package's folder stands for its ``__init__.py``: naming one is allowed (where the
    package's main code lives there), not required."""
    named = layout_paths(_readme_layout())
    modules = {str(p.relative_to(ROOT)) for p in SRC.rglob("*.py") if p.name != "__init__.py"}
    assert sorted(modules - named) == [], "modules missing from the README's layout block"
    assert sorted(p for p in named if not (ROOT / p).exists()) == [], "paths in the layout that do not exist"


def test_what_an_algorithm_cannot_run_without_is_required_at_import() -> None:
    """A hook forgotten is an error where the class is made, not a run that trains otherwise: a
    process group's algorithm that exchanges nothing, one without its summary line, a server
    topology without its ``serve``."""
    from distsgd.algorithms.base import GroupAlgorithm, Server, register

    class Apart(GroupAlgorithm):  # every worker trains its own model: W models, none averaged
        name = "apart"
        kind = "data parallel"
        summary_line = "workers that never meet"

    with pytest.raises(ValueError, match="apart: a process group's algorithm exchanges something in one of setup"):
        register(Apart)

    class Unsaid(GroupAlgorithm):
        name = "unsaid"
        kind = "data parallel"

        def after_step(self, ctx, model, step) -> None: ...

    with pytest.raises(ValueError, match="unsaid: give it a summary_line"):
        register(Unsaid)

    class NoRule(Server):
        pass

    with pytest.raises(TypeError, match="abstract method.*serve"):
        NoRule()
