"""Hardening III (issue 46): a resume that never crashes or misleads, a stop that keeps the work.

Each test failed on main 31e7de9 (before this work); its docstring says how. The standard for
bad input: one ``error:`` line on stderr and exit 2, never a traceback, a lost checkpoint or a
rewritten file.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from helpers import run_cli

pytest.importorskip("sklearn")

SMALL = ["--model", "mlp", "--dataset", "digits", "--batch-size", "32"]


def one_error_line(r: subprocess.CompletedProcess) -> str:
    """The one line a user mistake prints (exit 2, no traceback)."""
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert r.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: "), (r.returncode, r.stderr[-3000:])
    return lines[0]


@pytest.fixture(scope="module")
def saved_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A small run with two checkpoints (256 samples, one every 128), trained once for the module."""
    run = tmp_path_factory.mktemp("saved") / "run"
    r = run_cli(
        "train", *SMALL, "--max-samples", "256", "--checkpoint-every", "128", "--out", str(run), "--quiet", timeout=120
    )
    assert r.returncode == 0, r.stderr[-3000:]
    return run


@pytest.fixture
def run_copy(saved_run: Path, tmp_path: Path) -> Path:
    """A copy of ``saved_run`` of the test's own, to change."""
    return Path(shutil.copytree(saved_run, tmp_path / "run"))


@pytest.mark.slow
@pytest.mark.parametrize(
    "flag, value, recorded",
    [
        ("--model", "logreg", "mlp"),
        ("--dataset", "fashion-mnist", "digits"),
        ("--optimizer", "adam", "sgd"),
        ("--weight-decay-on", "weights", "all"),
    ],
)
def test_a_resume_with_another_model_or_dataset_names_the_setting(
    run_copy: Path, flag: str, value: str, recorded: str
) -> None:
    """Item 1: on main, --model logreg was a traceback from load_state_dict (exit 1); --optimizer
    adam said the checkpoint "was written by an older distsgd". Now: one line naming the setting
    and its two values, before anything is written or loaded."""
    r = run_cli("train", "--resume", str(run_copy), flag, value, "--max-samples", "384", "--quiet", timeout=120)
    line = one_error_line(r)
    assert f"written with {flag} {recorded}, not {value}" in line, line
    assert "older distsgd" not in line


@pytest.mark.slow
def test_a_resume_with_another_algorithm_option_names_it(tmp_path: Path) -> None:
    """Item 1, an algorithm's option (local-sgd's --sync-every): on main it resumed with the new
    period read from the old one's saved state."""
    run = tmp_path / "run"
    r = run_cli(
        "train", *SMALL, "--algo", "local-sgd", "--workers", "2", "--sync-every", "4", "--max-samples", "256",
        "--checkpoint-every", "128", "--out", str(run), "--quiet", timeout=120,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    r = run_cli("train", "--resume", str(run), "--sync-every", "8", "--max-samples", "512", "--quiet", timeout=120)
    assert "written with --sync-every 4, not 8" in one_error_line(r)


@pytest.mark.slow
def test_a_failed_resume_leaves_config_toml_and_the_plain_resume_works(run_copy: Path) -> None:
    """Item 2: on main a resume with --model logreg failed after rewriting the run's config.toml
    with model = "logreg", so the plain ``--resume DIR`` failed too."""
    before = (run_copy / "config.toml").read_bytes()
    one_error_line(run_cli("train", "--resume", str(run_copy), "--model", "logreg", "--quiet", timeout=120))
    assert (run_copy / "config.toml").read_bytes() == before
    r = run_cli("train", "--resume", str(run_copy), "--max-samples", "384", "--quiet", timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    assert 'model = "mlp"' in (run_copy / "config.toml").read_text()
