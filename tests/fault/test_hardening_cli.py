"""Hardening II (issue 38), the command's side: every setting checked before any process starts,
a resume under another algorithm refused, ``eval`` runs no file it was not asked to, ``--overwrite``
deletes only the files distsgd recorded writing, and repeated or full-disk failures say so once,
naming the file.

Each test failed on main 43f33af (before this work); the docstrings say how.
"""

from __future__ import annotations

import logging
import subprocess
import sys
from pathlib import Path

import pytest

from distsgd import cli

pytest.importorskip("sklearn")

SMALL = ["--dataset", "digits", "--model", "mlp", "--batch-size", "16", "--lr", "0.05"]


def one_error_line(err: str) -> str:
    """The only line on stderr, an ``error:`` line (no traceback, no warning)."""
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), err[-3000:]
    return lines[0]


def main(capsys: pytest.CaptureFixture, *args: str) -> subprocess.CompletedProcess:
    """``distsgd ARGS`` in this process, through the same main() the command runs."""
    capsys.readouterr()
    code = cli.main(list(args))
    out, err = capsys.readouterr()
    return subprocess.CompletedProcess(["distsgd", *args], code, out, err)


def train_here(capsys: pytest.CaptureFixture, *args: str) -> subprocess.CompletedProcess:
    return main(capsys, "train", *SMALL, "--quiet", *args)


class _Started(Exception):
    """launch.run was reached: the run would have started its processes."""


@pytest.fixture
def no_launch(monkeypatch: pytest.MonkeyPatch) -> None:
    from distsgd import launch

    def started(*_: object) -> None:
        raise _Started()

    monkeypatch.setattr(launch, "run", started)


# --- 8. every setting checked before any process starts -------------------------------------------


@pytest.mark.parametrize(
    "args, message",
    [
        (["--seed", str(2**64)], "--seed must be a whole number from 0 to 2**63 - 1"),
        (["--seed", "-1"], "--seed must be a whole number from 0"),
        (["--threads-per-worker", "100000"], "--threads-per-worker must be from 1 to the"),
        (["--timeout", "1e308"], "--timeout must be positive and at most 604800 seconds"),
        (["--timeout", "inf"], "--timeout must be a finite number"),
        (["--timeout", "nan"], "--timeout must be a finite number"),
        (
            ["--algo", "allreduce", "--workers", "2", "--init-method", "tcp://127.0.0.1:0"],
            "the port must be a number from 1 to 65535, got '0'",
        ),
        (
            ["--algo", "allreduce", "--workers", "2", "--init-method", "tcp://127.0.0.1:99999"],
            "the port must be a number from 1 to 65535, got '99999'",
        ),
        (["--algo", "asgd", "--workers", "2", "--init-method", "tcp://127.0.0.1:port"], "got 'port'"),
        (["--init-method", "tcp://127.0.0.1:0"], "the port must be a number"),  # checked for any algorithm
        (["--lr", "1e308"], "--lr must be a positive number (at most 3.403e+38)"),
        (["--weight-decay", "1e308"], "--weight-decay must be >= 0 (at most"),
        (["--target-loss", "inf"], "--target-loss must be a finite number"),
        (["--straggler", "0:1e308"], "FACTOR from 1 to 1000"),
    ],
)
def test_every_setting_is_range_checked_before_any_process_starts(
    tmp_path: Path, capsys: pytest.CaptureFixture, no_launch: None, args: list[str], message: str
) -> None:
    """On 43f33af: tracebacks (a seed of 2**64: ValueError; --lr 1e308: RuntimeError in the first
    step; a straggler factor of 1e308: OverflowError), a worker's error once the processes had
    started (--timeout 1e308: OverflowError; a port of 99999), a 15 s wait for port 0 (300 s by
    default), or "cannot write inf to TOML"."""
    r = train_here(capsys, "--max-samples", "64", "--out", str(tmp_path / "o"), *args)
    assert r.returncode == 2 and message in one_error_line(r.stderr)
    assert not (tmp_path / "o").exists()


# --- 6. a checkpoint resumes under the algorithm that wrote it --------------------------------


def test_a_checkpoint_resumes_only_under_its_own_algorithm(
    tmp_path: Path, capsys: pytest.CaptureFixture, no_launch: None
) -> None:
    """An asgd checkpoint resumed with another --algo: on 43f33af hogwild raised a KeyError
    traceback, allreduce stalled in gloo for --timeout (300 s), and dcasgd, sync-ps and async easgd
    resumed it as their own."""
    from helpers import run_cli

    run = tmp_path / "asgd"
    r = run_cli(
        "train",
        *SMALL,
        *"--quiet --algo asgd --workers 2 --max-samples 256 --checkpoint-every 128 --out".split(),
        str(run),
        timeout=180,
    )
    assert r.returncode == 0, r.stderr
    for other in (["hogwild"], ["allreduce"], ["dcasgd"], ["sync-ps"], ["easgd", "--easgd-mode", "async"]):
        r = main(capsys, "train", "--resume", str(run), "--max-samples", "512", "--quiet", "--algo", *other)
        assert r.returncode == 2
        assert (
            one_error_line(r.stderr) == f"error: the checkpoint in {run} was written by asgd, not {other[0]}; "
            f"resume it with --algo asgd"
        )
    with pytest.raises(_Started):  # its own algorithm, named or not, goes on
        cli.main(["train", "--resume", str(run), "--max-samples", "512", "--quiet", "--algo", "asgd"])


# --- 4. eval runs no file it was not asked to ----------------------------------------------------

EVIL = """
import pathlib

def make(*args, **kwargs):
    pathlib.Path(__file__).with_suffix(".ran").write_text("ran")
    raise ValueError("this file ran")
"""


@pytest.fixture
def saved(tmp_path: Path, capsys: pytest.CaptureFixture) -> dict:
    """A model.pt of a short run, as a dict to edit and save again."""
    import torch

    assert train_here(capsys, "--max-samples", "64", "--out", str(tmp_path / "run")).returncode == 0
    return torch.load(tmp_path / "run" / "model.pt", weights_only=True)


@pytest.mark.parametrize("what", ["model", "dataset"])
def test_eval_imports_no_file_the_command_does_not_name(
    tmp_path: Path, capsys: pytest.CaptureFixture, saved: dict, what: str
) -> None:
    """A checkpoint whose dataset (or model) is ``evil.py:make``: on 43f33af ``distsgd eval``
    imported and ran it. Now one line says how to allow it; naming the file runs it."""
    import torch

    evil = tmp_path / "evil.py"
    evil.write_text(EVIL)
    ran = evil.with_suffix(".ran")
    ckpt = tmp_path / "model.pt"
    torch.save({**saved, what: f"{evil}:make"}, ckpt)
    r = main(capsys, "eval", "--checkpoint", str(ckpt))
    assert r.returncode == 2 and not ran.exists()
    assert one_error_line(r.stderr) == (
        f"error: {ckpt} was trained with the {what} in {evil}:make, and eval runs "
        f"no file you did not name: if you trust that file, give --{what} {evil}:make"
    )
    r = main(capsys, "eval", "--checkpoint", str(ckpt), f"--{what}", f"{evil}:make")
    assert r.returncode == 2 and "this file ran" in one_error_line(r.stderr) and ran.exists()
    other = {"model": "mlp", "dataset": "digits"}[what]  # or a model or dataset that is no file
    r = main(capsys, "eval", "--checkpoint", str(ckpt), f"--{what}", other)
    assert r.returncode == 0 and r.stdout.startswith("mlp on digits"), r.stderr


@pytest.mark.parametrize(
    "recorded, message",
    [
        ({"context": "abc"}, "setting 'context' must be a whole number, got 'abc'"),
        ({"loss": 5}, "setting 'loss' must be a string, got 5"),
        ({"loss": "hinge"}, "unknown loss 'hinge'"),
        ({"init": [1]}, "setting 'init' must be a string, got [1]"),
        ({"init": "orthogonal"}, "unknown init 'orthogonal'"),
        ({"context": 0}, "--context must be at least 1"),
    ],
)
def test_eval_of_settings_of_the_wrong_type_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture, saved: dict, recorded: dict, message: str
) -> None:
    """On 43f33af ``loss = 5`` was an AttributeError traceback, ``loss = "hinge"`` a KeyError, and
    ``context = "abc"`` went unnoticed (a traceback for a token dataset)."""
    import torch

    ckpt = tmp_path / "model.pt"
    torch.save({**saved, "config": {**saved["config"], **recorded}}, ckpt)
    r = main(capsys, "eval", "--checkpoint", str(ckpt))
    assert r.returncode == 2
    line = one_error_line(r.stderr)
    assert line.startswith(f"error: {ckpt} is damaged: the settings it records are not a run's (") and message in line


# --- 5. --overwrite deletes only the files distsgd recorded writing --------------------------------


def _tree(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_overwrite_keeps_a_users_file_inside_distsgds_folders(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """On 43f33af ``--overwrite`` checked the top-level names only and removed whole folders:
    ``checkpoint/my_notes.txt``, ``tb/plot.py`` and a ``runs/thesis/`` tree went with them."""
    run = tmp_path / "run"
    args = ["--max-samples", "128", "--checkpoint-every", "64", "--out", str(run)]
    assert train_here(capsys, *args, "--tensorboard").returncode == 0
    for mine in ("checkpoint/my_notes.txt", "tb/plot.py", "runs/thesis/chapter1.tex"):
        (run / mine).parent.mkdir(parents=True, exist_ok=True)
        (run / mine).write_text("mine")
        before = _tree(run)
        r = train_here(capsys, *args, "--overwrite")
        assert r.returncode == 2 and f"also holds {mine}, which distsgd did not write" in one_error_line(r.stderr)
        assert _tree(run) == before  # nothing deleted, nothing written
        (run / mine).unlink()
    (run / "runs" / "thesis" / "figures").mkdir()  # an empty folder of the user's: no file to lose, kept
    r = train_here(capsys, *args, "--overwrite")
    assert r.returncode == 0, r.stderr
    assert (run / "runs" / "thesis" / "figures").is_dir() and (run / "model.pt").is_file()
    assert not (run / "tb").exists()  # what the first run wrote, and this one did not, is gone


def test_overwrite_of_a_bench_keeps_run_folders_it_did_not_make(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """A bench directory's runs/ holds run directories; a user's folder there, even a copy of a
    run directory with its own ledger, is not the bench's (43f33af deleted runs/ whole)."""
    import shutil

    bench = tmp_path / "bench"
    args = [
        "bench",
        "--algos",
        "single",
        "--workers",
        "1",
        *SMALL,
        "--max-samples",
        "64",
        "--quiet",
        "--out",
        str(bench),
    ]
    assert main(capsys, *args).returncode == 0
    shutil.copytree(bench / "runs" / "single-w1-r0", bench / "runs" / "mine")
    before = _tree(bench)
    r = main(capsys, *args, "--overwrite")
    assert r.returncode == 2 and "also holds runs/mine/.distsgd, runs/mine/config.toml" in one_error_line(r.stderr)
    assert _tree(bench) == before
    shutil.rmtree(bench / "runs" / "mine")
    old = (bench / "runs" / "single-w1-r0" / "summary.json").read_bytes()
    assert main(capsys, *args, "--overwrite").returncode == 0
    assert (bench / "runs" / "single-w1-r0" / "summary.json").read_bytes() != old


def test_overwrite_refuses_a_directory_whose_files_are_not_recorded(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """A run directory of an older distsgd (a marker, or a config.toml, but no record of what it
    wrote) is not guessed at by its names: refused (43f33af replaced it by its names)."""
    run = tmp_path / "run"
    assert train_here(capsys, "--max-samples", "64", "--out", str(run)).returncode == 0
    (run / ".distsgd").write_text("run directory written by distsgd\n")
    before = _tree(run)
    r = train_here(capsys, "--max-samples", "64", "--out", str(run), "--overwrite")
    assert r.returncode == 2 and "was written by an older distsgd" in one_error_line(r.stderr)
    assert _tree(run) == before


# --- 9. a repeated warning is said once, with a count; a full disk names its file ------------------


def test_a_diverged_run_says_its_loss_is_nan_once_with_a_count(
    tmp_path: Path, capsys: pytest.CaptureFixture, caplog: pytest.LogCaptureFixture
) -> None:
    """--lr 1e30 makes the loss nan within a step or two: on 43f33af "training loss is nan" came at
    every progress report (39 lines here; 94 in the issue's run)."""
    caplog.set_level(logging.WARNING)  # (not --quiet, which says nothing but errors)
    r = main(
        capsys,
        "train",
        *SMALL,
        *"--lr 1e30 --max-samples 640 --log-every 1 --out".split(),
        str(tmp_path / "o"),
    )
    assert r.returncode == 0, r.stderr
    said = [rec.getMessage() for rec in caplog.records if "training loss" in rec.getMessage()]
    assert len(said) == 2, said
    assert said[0].startswith("training loss is nan at ") and said[0].endswith(
        " samples: lower --lr? (or NaN/inf in the data)"
    )
    count = sum(
        1
        for line in (tmp_path / "o" / "metrics.jsonl").read_text().splitlines()
        if '"event":"progress"' in line and '"loss":NaN' in line
    )
    assert count > 30 and said[1].startswith(f"training loss was nan or inf in {count} progress reports, from ")


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full (a device whose writes fail: ENOSPC)")
def test_a_full_disk_under_metrics_jsonl_names_the_file(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """metrics.jsonl on a full disk (here /dev/full, where every write fails with ENOSPC): on
    43f33af the one line said "No space left on device" without naming the file."""
    run = tmp_path / "run"
    assert train_here(capsys, "--max-samples", "128", "--checkpoint-every", "64", "--out", str(run)).returncode == 0
    (run / "metrics.jsonl").unlink()
    (run / "metrics.jsonl").symlink_to("/dev/full")
    r = train_here(capsys, "--resume", str(run), "--max-samples", "256")
    assert r.returncode == 2
    assert one_error_line(r.stderr) == f"error: cannot write or read {run / 'metrics.jsonl'}: No space left on device"


TENSORBOARD_ON_A_FULL_DISK = """
import errno, sys
from tensorboard.summary.writer import record_writer

calls, real = [0], record_writer.RecordWriter.write

def write(self, data):
    calls[0] += 1
    if calls[0] > int(sys.argv[1]):
        raise OSError(errno.ENOSPC, "No space left on device")
    return real(self, data)

record_writer.RecordWriter.write = write
from distsgd import cli
sys.exit(cli.main(sys.argv[2:]))
"""


@pytest.mark.parametrize("writes", [0, 3], ids=["first write", "a later write"])
def test_a_full_disk_under_tensorboard_is_one_line_naming_the_folder(tmp_path: Path, writes: int) -> None:
    """TensorBoard writes in a thread of its own: before 2026-11-29 a full disk printed that
    thread's traceback before the error line, which named no file."""
    script = tmp_path / "full.py"
    script.write_text(TENSORBOARD_ON_A_FULL_DISK)
    run = tmp_path / "run"
    args = ["train", *SMALL, "--quiet", "--max-samples", "512", "--tensorboard", "--out", str(run)]
    r = subprocess.run([sys.executable, str(script), str(writes), *args], capture_output=True, text=True, timeout=300)
    assert r.returncode == 2
    assert one_error_line(r.stderr) == f"error: cannot write or read {run / 'tb'}: No space left on device"


# --- an audit of bad input, 2026-11-29 ---------------------------------------------------------------

MODELS = """
import sys
import torch
from torch import nn


class FailsLater(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(64, 10)
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        if self.calls == 5:
            raise ValueError("bad forward")
        return self.fc(x.flatten(1))


class NoParameters(nn.Module):
    def forward(self, x):
        return x.flatten(1)[:, :10]


class Exits(nn.Module):
    def __init__(self):
        sys.exit(3)
"""


@pytest.mark.parametrize(
    "model, message",
    [
        ("FailsLater", "worker 0 failed: ValueError: bad forward"),
        ("NoParameters", "worker 0 failed: ValueError: optimizer got an empty parameter list"),
        ("Exits", "failed: SystemExit: 3"),
    ],
)
def test_a_users_model_failing_in_a_run_of_one_process_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture, model: str, message: str
) -> None:
    """Before: under --algo single (trained in the command's own process) a traceback and exit 1
    (with --workers 2, one line); a constructor's sys.exit(3) ended distsgd with status 3, silently."""
    path = tmp_path / f"audit_models_{model.lower()}.py"
    path.write_text(MODELS)
    r = main(
        capsys, "train", "--dataset", "digits", "--model", f"{path}:{model}", "--quiet", "--out", str(tmp_path / "o")
    )
    assert r.returncode == 2 and message in one_error_line(r.stderr)


def test_a_model_file_that_calls_sys_exit_as_it_is_imported_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """Before: exit 0, nothing trained, nothing said (SystemExit is no Exception)."""
    path = tmp_path / "audit_exits_on_import.py"
    path.write_text("import sys\nsys.exit(0)\n")
    r = main(capsys, "train", "--dataset", "digits", "--model", f"{path}:X", "--quiet")
    assert r.returncode == 2 and "failed: SystemExit: 0" in one_error_line(r.stderr)


@pytest.mark.parametrize("args", [["--out", ""], ["--resume", ""], ["--out", "", "--checkpoint-every", "100"]])
def test_an_empty_path_is_refused(capsys: pytest.CaptureFixture, no_launch: None, args: list[str]) -> None:
    """Before: --out '' trained, saved nothing and said nothing (exit 0); with --checkpoint-every,
    an AssertionError traceback once training had started."""
    r = train_here(capsys, "--max-samples", "64", *args)
    assert r.returncode == 2 and "names no directory" in one_error_line(r.stderr)


def test_npz_without_test_rows_or_features_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """Before: an empty test set trained, then reported test accuracy and loss 0.0000 (measured on
    nothing), exit 0; inputs of no values trained with two torch warnings."""
    import numpy as np

    rng = np.random.default_rng(0)
    x, y = rng.random((100, 8), dtype=np.float32), rng.integers(0, 3, 100)
    np.savez(tmp_path / "e.npz", x=x, y=y, x_test=np.zeros((0, 8), np.float32), y_test=np.zeros(0, np.int64))
    np.savez(tmp_path / "z.npz", x=np.zeros((100, 0), np.float32), y=y)
    for name, message in (("e", "the test set is empty"), ("z", "each sample has no values")):
        r = main(capsys, "train", "--dataset", f"npz:{tmp_path / name}.npz", "--model", "logreg", "--quiet")
        assert r.returncode == 2 and message in one_error_line(r.stderr)


def test_eval_of_a_pickle_of_another_protocol_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """Before: torch's two-line UserWarning on the pickle protocol came before the error line."""
    import pickle
    import warnings

    path = tmp_path / "p.pt"
    path.write_bytes(pickle.dumps({"a": object.__name__}, protocol=4))
    with warnings.catch_warnings(record=True) as seen:  # (pytest keeps warnings off stderr: caught here)
        warnings.simplefilter("always")
        r = main(capsys, "eval", "--checkpoint", str(path))
    assert r.returncode == 2 and one_error_line(r.stderr)
    assert not [w for w in seen if "pickle" in str(w.message)]


def test_a_tensorboard_path_through_a_file_is_refused_before_the_run_directory_is_made(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """Before: the run directory was made first, so the corrected rerun met 'already exists'."""
    (tmp_path / "model.pt").write_text("a user's file")
    for tb in (tmp_path / "model.pt", tmp_path / "model.pt" / "tb"):
        r = train_here(capsys, "--max-samples", "64", "--tensorboard", str(tb), "--out", str(tmp_path / "o"))
        assert r.returncode == 2 and "is a file, not a directory" in one_error_line(r.stderr)
        assert not (tmp_path / "o").exists()
    assert (tmp_path / "model.pt").read_text() == "a user's file"
