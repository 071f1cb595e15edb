"""Hardening III (issue 46): a resume that never crashes or misleads, a stop that keeps the work.

Each test failed on main 31e7de9 (before this work); its docstring says how. The standard for
bad input: one ``error:`` line on stderr and exit 2, never a traceback, a lost checkpoint or a
rewritten file.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

import distsgd
from distsgd import checkpoint, cli
from distsgd.data import formats
from distsgd.errors import DataError
from helpers import cli_here, progress_seen, run_cli, signal_when

pytest.importorskip("sklearn")

SMALL = ["--model", "mlp", "--dataset", "digits", "--batch-size", "32"]


def one_error_line(r: subprocess.CompletedProcess) -> str:
    """The one line a user mistake prints (exit 2, no traceback)."""
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert r.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: "), (r.returncode, r.stderr[-3000:])
    return lines[0]


def here(capsys: pytest.CaptureFixture, *args: str) -> subprocess.CompletedProcess:
    """``distsgd ARGS`` in this process, through the same main() the command runs."""
    capsys.readouterr()
    code = cli.main(list(args))
    out, err = capsys.readouterr()
    return subprocess.CompletedProcess(["distsgd", *args], code, out, err)


@pytest.fixture(scope="module")
def saved_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A small run with two checkpoints (256 samples, one every 128), trained once for the module."""
    run = tmp_path_factory.mktemp("saved") / "run"
    distsgd.train(
        model="mlp", data="digits", batch_size=32, max_samples=256, checkpoint_every="128", out=str(run), quiet=True
    )
    return run


@pytest.fixture
def run_copy(saved_run: Path, tmp_path: Path) -> Path:
    """A copy of ``saved_run`` of the test's own, to change."""
    return Path(shutil.copytree(saved_run, tmp_path / "run"))


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
    r = cli_here("train", "--resume", str(run_copy), flag, value, "--max-samples", "384", "--quiet")
    line = one_error_line(r)
    assert f"written with {flag} {recorded}, not {value}" in line, line
    assert "older distsgd" not in line


def test_a_resume_with_another_algorithm_option_names_it(tmp_path: Path) -> None:
    """Item 1, an algorithm's option (local-sgd's --sync-every): on main it resumed with the new
    period read from the old one's saved state."""
    run = tmp_path / "run"
    r = cli_here(
        "train", *SMALL, "--algo", "local-sgd", "--workers", "2", "--sync-every", "4", "--max-samples", "256",
        "--checkpoint-every", "128", "--out", str(run), "--quiet",
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    r = cli_here("train", "--resume", str(run), "--sync-every", "8", "--max-samples", "512", "--quiet")
    assert "written with --sync-every 4, not 8" in one_error_line(r)


def test_a_resume_giving_an_option_its_first_part_left_to_its_default_names_it(tmp_path: Path) -> None:
    """An option whose default is worked out (easgd's --alpha: 0.9 / workers) is held against the
    checkpoint too when the first part left it to that default: on 3ae785c only a value given both
    times was compared, so --alpha 0.45 then 0.3 was refused and the default then 0.3 trained on."""
    run = tmp_path / "run"
    r = cli_here(
        "train", *SMALL, "--algo", "easgd", "--workers", "2", "--max-samples", "256",
        "--checkpoint-every", "128", "--out", str(run), "--quiet",
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    r = cli_here("train", "--resume", str(run), "--alpha", "0.3", "--max-samples", "512", "--quiet")
    line = one_error_line(r)
    assert "written with --alpha at its default, not 0.3" in line and "resume without --alpha" in line, line
    r = cli_here("train", "--resume", str(run), "--max-samples", "512", "--quiet")
    assert r.returncode == 0, r.stderr[-3000:]


def test_a_failed_resume_leaves_config_toml_and_the_plain_resume_works(run_copy: Path) -> None:
    """Item 2: on main a resume with --model logreg failed after rewriting the run's config.toml
    with model = "logreg", so the plain ``--resume DIR`` failed too."""
    before = (run_copy / "config.toml").read_bytes()
    one_error_line(cli_here("train", "--resume", str(run_copy), "--model", "logreg", "--quiet"))
    assert (run_copy / "config.toml").read_bytes() == before
    r = cli_here("train", "--resume", str(run_copy), "--max-samples", "384", "--quiet")
    assert r.returncode == 0, r.stderr[-3000:]
    assert 'model = "mlp"' in (run_copy / "config.toml").read_text()


def test_a_config_toml_edited_by_hand_is_held_against_the_checkpoint_not_believed(run_copy: Path) -> None:
    """On 8f65d93 a config.toml edited to ``optimizer = "adam"`` after the run passed the settings
    check (it compared the flags with that file), rewrote config.toml, then failed in the worker
    with "the file is damaged, or distsgd did not write it". The manifest now records what the
    checkpoint was written with (config.checkpoint_record): one line naming the edit, nothing written."""
    toml = run_copy / "config.toml"
    toml.write_text(toml.read_text().replace('optimizer = "sgd"', 'optimizer = "adam"'))
    before = toml.read_bytes()
    line = one_error_line(cli_here("train", "--resume", str(run_copy), "--max-samples", "384", "--quiet"))
    assert "written with --optimizer sgd, not adam (its config.toml says adam: edited since)" in line, line
    assert "damaged" not in line and "leave --optimizer out" not in line
    assert toml.read_bytes() == before
    r = cli_here("train", "--resume", str(run_copy), "--optimizer", "sgd", "--max-samples", "384", "--quiet")
    assert r.returncode == 0, r.stderr[-3000:]


# --- 2. the "older distsgd" line only where the file's format says so --------------------------------


def _edit_newest(run: Path, edit) -> Path:
    """Apply ``edit`` to the newest checkpoint's file of worker 0 (both checkpoints' files: no fallback)."""
    for path in (run / checkpoint.CHECKPOINT_DIR).glob("ckpt-*-rank0.pt"):
        state = torch.load(path, weights_only=True)
        edit(state)
        torch.save(state, path)
    return sorted((run / checkpoint.CHECKPOINT_DIR).glob("ckpt-*-rank0.pt"))[-1]


def test_older_distsgd_is_said_only_of_a_file_that_predates_this_format(run_copy: Path, capsys) -> None:
    """Item 2: on main a file of this version that lacked a piece (damaged, or a hand edit) was
    said to be "written by an older distsgd ... (train afresh ...)": untrue, and advice that
    throws the run away. The format each file now carries decides."""
    newest = _edit_newest(run_copy, lambda s: s.pop("algo"))
    line = one_error_line(here(capsys, "train", "--resume", str(run_copy), "--max-samples", "384", "--quiet"))
    assert f"cannot resume from {newest}: the checkpoint has no 'algo' part: the file is damaged" in line, line
    assert "older distsgd" not in line and "afresh" not in line
    _edit_newest(run_copy, lambda s: s.pop("format"))  # as distsgd wrote its files before the marker
    line = one_error_line(here(capsys, "train", "--resume", str(run_copy), "--max-samples", "384", "--quiet"))
    assert "the checkpoint has no 'algo' part: it was written by an older distsgd" in line, line


# --- 3. every field of a worker's file checked as it loads -------------------------------------------


def _first_param(state: dict) -> str:
    return next(iter(state["model"]))


EDITS = {
    "steps": (lambda s: s["loop"].update(steps="abc"), "its 'loop' part's 'steps' is 'abc', not a whole number"),
    "evals": (lambda s: s["loop"].update(evals="x"), "its 'loop' part's 'evals' is 'x', not a list of evaluations"),
    "rng": (
        lambda s: s["rng"].update(torch=torch.zeros(3, dtype=torch.uint8)),
        "its 'rng' part's 'torch' is a uint8 tensor of shape [3], not a uint8 tensor of shape",
    ),
    "param_groups": (
        lambda s: s["optimizer"].update(param_groups=[]),
        "its 'optimizer' part's 'param_groups' is [], not a list of one or more parameter groups",
    ),
    "model key": (lambda s: s["model"].pop(_first_param(s)), "its 'model' part does not fit the model: missing '"),
    "epoch": (lambda s: s["loop"].update(epoch=-5), "its 'loop' part's 'epoch' is -5, not a whole number >= 0"),
    "train_wall_s": (
        lambda s: s["loop"].update(train_wall_s=float("nan")),
        "its 'loop' part's 'train_wall_s' is nan, not a number of seconds >= 0",
    ),
    "bytes_sent": (lambda s: s["algo"].update(bytes_sent=-3), "its 'algo' part's 'bytes_sent' is -3, not a whole"),
    "momentum": (
        lambda s: [v.update(momentum_buffer=torch.zeros(3)) for v in s["optimizer"]["state"].values()],
        "its 'optimizer' part's 'state's momentum_buffer' is a float32 tensor of shape [3], not a tensor of its",
    ),
}


@pytest.mark.parametrize("field", list(EDITS))
def test_a_wrong_value_in_a_workers_file_is_one_line_naming_the_file_and_the_field(
    run_copy: Path, capsys, field: str
) -> None:
    """Item 3: on main loop.steps = "abc" was a TypeError, loop.evals = "x" an AttributeError, a
    3-byte rng.torch a RuntimeError, param_groups = [] a ValueError, a missing model key a
    RuntimeError (tracebacks); loop.epoch = -5 trained 13 epochs when 6 were asked, and
    train_wall_s = nan put train_s=nan in the summary."""
    edit, said = EDITS[field]
    newest = _edit_newest(run_copy, edit)
    r = here(capsys, "train", "--resume", str(run_copy), "--epochs", "6", "--quiet")
    line = one_error_line(r)
    assert line.startswith(f"error: cannot resume from {newest}: {said}"), line
    assert not (run_copy / "summary.json").read_text().count("NaN")


# --- 4. a --resume command only where a checkpoint exists; no partial checkpoint left -----------------


@pytest.fixture
def small_disk(tmp_path: Path):
    """A 4 MB tmpfs (a disk that fills), unmounted after the test; skipped without root."""
    disk = tmp_path / "disk"
    disk.mkdir()
    if (
        os.geteuid() != 0
        or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(disk)], capture_output=True).returncode
    ):
        pytest.skip("needs root to mount a small tmpfs (a full disk)")
    try:
        yield disk
    finally:
        subprocess.run(["umount", "-l", str(disk)], capture_output=True)


@pytest.mark.slow
def test_a_disk_that_fills_before_the_first_commit_leaves_no_partial_checkpoint(
    saved_run: Path, small_disk: Path
) -> None:
    """Item 4: two lockstep workers, room for one worker's file of the first checkpoint and not
    the other's: on main the one written (ckpt-000001-rank0.pt or rank1) stayed, though no
    manifest named it. Now the run stops with one line naming the file it could not write, offers
    no --resume (there is nothing to resume), and leaves no checkpoint file."""
    part = next((saved_run / checkpoint.CHECKPOINT_DIR).glob("ckpt-*-rank0.pt")).stat().st_size
    with open(small_disk / "filler", "wb") as fh:  # room for one part and a half, and the run's small files
        fh.write(bytes(4 * 2**20 - int(1.5 * part) - 64 * 2**10))
    out = small_disk / "run"
    r = run_cli(
        "train", *SMALL, "--algo", "allreduce", "--workers", "2", "--max-samples", "512",
        "--checkpoint-every", "128", "--out", str(out), "--quiet", timeout=120,
    )  # fmt: skip
    line = one_error_line(r)
    assert "No space left on device" in line and f"{out}/checkpoint/ckpt-000001-rank" in line, line
    assert "--resume" not in line
    assert checkpoint.read_manifest(out) is None
    assert not list((out / checkpoint.CHECKPOINT_DIR).iterdir())


@pytest.mark.slow
@pytest.mark.parametrize("algo", ["asgd", "sync-ps"])
def test_a_parameter_server_on_a_full_disk_says_one_line(saved_run: Path, small_disk: Path, algo: str) -> None:
    """The server's checkpoint on a disk with room for none: on 7ae212f asgd's server said its own
    ``server: ERROR: cannot write ...; stopping the run`` before the run's error line (two lines);
    now the run's one line names the file (sync-ps's said one line already)."""
    part = next((saved_run / checkpoint.CHECKPOINT_DIR).glob("ckpt-*-rank0.pt")).stat().st_size
    with open(small_disk / "filler", "wb") as fh:  # room for half a model and the run's small files
        fh.write(bytes(4 * 2**20 - part // 2 - 64 * 2**10))
    out = small_disk / "run"
    r = run_cli(
        "train", *SMALL, "--algo", algo, "--workers", "2", "--max-samples", "512",
        "--checkpoint-every", "128", "--out", str(out), "--quiet", timeout=120,
    )  # fmt: skip
    line = one_error_line(r)
    assert "No space left on device" in line and f"{out}/checkpoint/ckpt-000001-rank" in line, line


KILLS_THE_SERVER = """
import os, signal
import torch.nn as nn


class Net(nn.Module):
    '''The server (DISTSGD_ROLE=server) SIGKILLs itself at its second copy of the model: before its first checkpoint.'''

    def __init__(self, num_classes, input_shape):
        super().__init__()
        self.fc = nn.Linear(64, num_classes)
        self.copies = 0

    def state_dict(self, *args, **kwargs):
        if os.environ.get("DISTSGD_ROLE") == "server":
            self.copies += 1
            if self.copies == 2:
                os.kill(os.getpid(), signal.SIGKILL)
        return super().state_dict(*args, **kwargs)

    def forward(self, x):
        return self.fc(x.flatten(1))
"""


@pytest.mark.slow
def test_a_server_killed_before_the_first_checkpoint_offers_no_resume(tmp_path: Path) -> None:
    """Item 4: on main the line said "continue from the last checkpoint with --resume DIR", and
    that command then said there was no checkpoint."""
    model = tmp_path / "killserver.py"
    model.write_text(KILLS_THE_SERVER)
    out = tmp_path / "run"
    r = run_cli(
        "train", "--algo", "asgd", "--workers", "2", "--dataset", "digits", "--model", f"{model}:Net",
        "--epochs", "3", "--checkpoint-every", "epoch", "--out", str(out), "--quiet", timeout=120,
    )  # fmt: skip
    assert r.returncode == 2, r.stderr[-3000:]
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("error: the parameter server failed: killed by SIGKILL"), r.stderr[-3000:]
    assert checkpoint.read_manifest(out) is None and "--resume" not in last


# --- 5. signals from the first instruction of distsgd ------------------------------------------------


def _loading_torch(pid: int) -> bool:
    try:
        return "libtorch" in Path(f"/proc/{pid}/maps").read_text()
    except OSError:
        return False


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="reads /proc/PID/maps (Linux)")
def test_a_sigterm_while_the_command_imports_torch_is_one_line_and_143(tmp_path: Path) -> None:
    """Item 5: on main a SIGTERM in the first second or two of ``python -m distsgd`` (while it
    imports torch, before main() set its handler) ended it with status -15 and no word. The
    signal is sent once torch's libraries are mapped: during the imports (or, on a fast machine,
    later, when main's own handler says the same)."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "distsgd", "train", *SMALL, "--max-samples", "256", "--out", str(tmp_path / "r")],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 60
        while not _loading_torch(proc.pid) and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.005)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
        proc.wait()
    assert proc.returncode == 143 and err == "error: terminated by SIGTERM\n", (proc.returncode, err[-3000:])


# --- 6. data and model errors that say what is wrong -------------------------------------------------


def test_labels_too_large_for_a_model_are_named(tmp_path: Path, capsys) -> None:
    """Item 6: on main npz labels of 2**40 were "building model mlp failed: ... tried to allocate
    562949953421824 bytes", and labels near 2**25 would have allocated ~17 GB for the last layer
    (on main that run is killed for memory: this test checks the bound itself, not such a run)."""
    rng = np.random.default_rng(0)
    path = tmp_path / "big.npz"
    np.savez(path, x=rng.random((40, 8), dtype=np.float32), y=np.array([0, 1] * 19 + [2**40, 3]))
    line = one_error_line(here(capsys, "train", "--dataset", f"npz:{path}", "--model", "mlp", "--quiet"))
    assert f"'y': the largest label is {2**40}, so a model would need {2**40 + 1} outputs" in line, line
    assert formats.classes_from_labels(formats.MAX_CLASSES - 1, "y") == formats.MAX_CLASSES
    with pytest.raises(DataError, match=f"y: the largest label is {2**25}"):
        formats.classes_from_labels(2**25, "y")


def test_eval_of_a_model_of_other_shapes_says_which(saved_run: Path, capsys) -> None:
    """Item 6: on main ``distsgd eval`` of a model.pt with wrong shapes said only "Error(s) in
    loading state_dict for Sequential:", torch's first line, without the mismatch."""
    line = one_error_line(here(capsys, "eval", "--checkpoint", str(saved_run), "--model", "logreg"))
    assert "does not match model logreg: unexpected '3.weight'" in line, line
    assert "1.weight is [256, 64] there and [10, 64] in the model" in line


@pytest.mark.parametrize("path, said", [("/dev/zero", "is not a regular file"), (".", "is a directory")])
def test_an_npz_that_is_not_a_file_says_what_it_is(capsys, path: str, said: str) -> None:
    """Item 6: on main ``npz:/dev/zero`` (and a directory) said "npz file not found"."""
    line = one_error_line(here(capsys, "train", "--dataset", f"npz:{path}", "--model", "mlp", "--quiet"))
    assert f"npz:{path} {said}" in line, line


@pytest.mark.parametrize("spec", ["text:", "npz:", "folder: ", "hf:"])
def test_a_dataset_format_without_a_path_is_refused_not_read_from_the_working_directory(capsys, spec: str) -> None:
    """Before 2026-11-29 ``text:`` was ``Path("")``, the working directory: it read every file
    under it as the training text."""
    line = one_error_line(here(capsys, "train", "--dataset", spec, "--model", "mlp", "--quiet"))
    assert line == f"error: dataset '{spec}' names no path (give {spec.strip()}PATH)", line


@pytest.mark.parametrize(
    "call, said",
    [
        (
            lambda: distsgd.train(model="mlp", data="digits", resume=5),
            "setting 'resume' must be a run directory's path, got 5",
        ),
        (
            lambda: distsgd.spawn(print, model="mlp", train_size="x"),
            "distsgd.spawn(train_size=...) is your training set's length",
        ),
        (lambda: distsgd.spawn(print, model="mlp", train_size=0), "a whole number >= 1; got 0"),
    ],
    ids=["resume", "train_size", "train_size0"],
)
def test_a_python_api_setting_of_the_wrong_type_is_a_config_error(call, said: str) -> None:
    """Before 2026-11-29 ``resume=5`` was a TypeError from pathlib, and ``train_size="x"`` went
    through to the schedule (``train_size=0`` meant "not given")."""
    with pytest.raises(distsgd.ConfigError) as info:
        call()
    assert said in str(info.value) and "\n" not in str(info.value)


@pytest.mark.parametrize("algo", ["asgd", "hogwild"])
def test_a_run_resumed_in_place_logs_each_evaluation_once(tmp_path: Path, algo: str) -> None:
    """The watcher of Hogwild! and the parameter server measures its copies once training ends, and
    a checkpoint files the copies not yet measured: before 2026-11-29 a run resumed in place measured
    them again and metrics.jsonl held the first part's evaluations twice (summary.json's once)."""
    out = tmp_path / "run"
    args = ["train", *SMALL, "--algo", algo, "--workers", "2", "--checkpoint-every", "epoch", "--quiet"]
    assert cli_here(*args, "--epochs", "2", "--out", str(out)).returncode == 0
    first = [e["samples"] for e in _events(out, "eval")]
    r = cli_here("train", "--resume", str(out), "--epochs", "3", "--quiet")
    assert r.returncode == 0, r.stderr[-3000:]
    logged = [e["samples"] for e in _events(out, "eval")]
    assert logged[: len(first)] == first and len(set(logged)) == len(logged) > len(first), logged
    summary = json.loads((out / "summary.json").read_text())
    assert {e["samples"] for e in summary["evals"]} <= set(logged)


def _events(out: Path, kind: str) -> list[dict]:
    lines = (out / "metrics.jsonl").read_text().splitlines()
    return [e for e in map(json.loads, lines) if e["event"] == kind]


# --- 7. which model the final figures describe -------------------------------------------------------


def test_the_final_figures_say_which_model_they_describe(tmp_path: Path) -> None:
    """Item 7: an asynchronous EASGD worker's local steps after its last exchange (or a killed
    worker's) never reach the centre, the model returned: on main its last evaluation was at
    193,910 samples while summary.json said 194,372, with nothing saying which model the figures
    are of. Here one worker exchanges every 4 steps of 32 samples: the centre last changes at 256
    samples, and the run trains 320."""
    out = tmp_path / "run"
    r = cli_here(
        "train", *SMALL, "--algo", "easgd", "--easgd-mode", "async", "--tau", "4", "--workers", "1",
        "--max-samples", "320", "--eval-every", "64", "--out", str(out),
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    s = json.loads((out / "summary.json").read_text())
    assert s["samples"] == 320 and s["final_eval_samples"] == s["evals"][-1]["samples"] == 256
    assert "(of the model returned, as it was at 256 samples: the 64 trained after never reached it)" in r.stdout


# --- a signal's stop keeps the work: a final checkpoint at the next step -----------------------------

BUDGET = 30 * 1437  # digits' training samples, thirty epochs: the signal lands mid-run (ten took 0.16 s
# of training under local-sgd on 2 cores, and a signal after the loop's end keeps its last step, not a
# mid-run one). Fifty until 2026-11-28: each test trains the budget twice, 20 s of the suite's wall.


def _signalled_mid_run(common: list[str], out: Path, how: str) -> tuple[subprocess.Popen, str]:
    """``distsgd train *common --out out``, sent SIGTERM or SIGUSR1 (``how``; "... to the process
    group": to every process) once its first progress line is in metrics.jsonl; the process
    (ended) and its stderr."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "distsgd", "train", *common, "--out", str(out)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 120
        while not progress_seen(out) and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.02)
        assert proc.poll() is None, "the run ended before the signal"
        sig = signal.SIGUSR1 if how == "SIGUSR1" else signal.SIGTERM
        if how.endswith("process group"):
            os.killpg(proc.pid, sig)
        else:
            proc.send_signal(sig)
        _, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    return proc, err


@pytest.mark.slow
@pytest.mark.parametrize(
    "algo, workers, how",
    [
        ("single", 1, "SIGTERM"),
        ("allreduce", 2, "SIGTERM"),
        ("local-sgd", 2, "SIGTERM to the process group"),
        ("ddp", 2, "SIGUSR1"),
    ],
)
def test_a_signal_writes_a_final_checkpoint_and_the_resume_loses_nothing(
    tmp_path: Path, algo: str, workers: int, how: str
) -> None:
    """A preemption notice (SIGTERM, or SLURM's --signal USR1) mid-run, with no --checkpoint-every:
    the workers stop together at their next step and write a checkpoint there, and the command
    says so in one line, with the --resume that goes on. That resume ends exactly as a run that
    was never stopped (the same samples, loss and weights): no step lost, none taken twice. On
    main the run stopped with no checkpoint at all (SIGTERM kept only the last periodic one)."""
    common = [
        *SMALL, "--algo", algo, "--workers", str(workers), "--max-samples", str(BUDGET), "--lr", "0.05",
        "--eval-every", "4000", "--log-every", "5", "--quiet",
    ]  # fmt: skip
    r = cli_here("train", *common, "--out", str(tmp_path / "whole"))
    assert r.returncode == 0, r.stderr[-3000:]
    out = tmp_path / "stopped"
    proc, err = _signalled_mid_run(common, out, how)
    manifest = checkpoint.read_manifest(out)
    assert manifest is not None, err[-3000:]
    name = "SIGUSR1" if how == "SIGUSR1" else "SIGTERM"
    assert proc.returncode == 128 + getattr(signal, name)
    assert err.strip() == (
        f"error: terminated by {name}; its last whole checkpoint ({manifest['samples']} samples) goes on "
        f"with distsgd train --resume {out}"
    ), err[-3000:]
    progress = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert 0 < max(e["samples"] for e in progress if e["event"] == "progress") <= manifest["samples"] < BUDGET
    assert sorted(p.name for p in (out / checkpoint.CHECKPOINT_DIR).glob("ckpt-*.pt")) == [
        checkpoint.worker_file(Path(), manifest["seq"], r).name for r in range(workers)
    ]  # that checkpoint's, every worker's part, and no other
    r = cli_here("train", "--resume", str(out), "--quiet")
    assert r.returncode == 0, r.stderr[-3000:]
    whole, resumed = (json.loads((tmp_path / d / "summary.json").read_text()) for d in ("whole", "stopped"))
    assert resumed["samples"] == whole["samples"] >= BUDGET
    assert resumed["final_test_loss"] == whole["final_test_loss"]
    a, b = (torch.load(tmp_path / d / "model.pt", weights_only=True)["state_dict"] for d in ("whole", "stopped"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


SLOW_EVALUATION = """
import os
import time

import torch.nn as nn


class Net(nn.Module):
    \"\"\"mlp-sized; each evaluated batch takes 0.3 s and is noted in EVAL_LOG (a long evaluation).\"\"\"

    def __init__(self, num_classes, input_shape):
        super().__init__()
        self.net = nn.Sequential(nn.Flatten(), nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, num_classes))

    def forward(self, x):
        if not self.training:
            with open(os.environ["EVAL_LOG"], "a") as f:
                f.write("batch\\n")
            time.sleep(0.3)
        return self.net(x)
"""


@pytest.mark.slow
@pytest.mark.parametrize("algo, workers", [("single", 1), ("allreduce", 2)])
def test_a_signal_during_an_evaluation_stops_the_run_before_it_ends(tmp_path: Path, algo: str, workers: int) -> None:
    """SIGTERM while an evaluation in the middle of training runs (45 batches of 0.3 s, 13.5 s): it
    is given up at its next batch, and the run stops with its checkpoint at the next step, as a
    signal during training does. On 0a3bbc7 the evaluation ran to its end first (a scheduler's
    grace period, 30 s on Kubernetes, is shorter than many a test set's evaluation: its SIGKILL
    then lost every step since the last checkpoint), and the audit's second SIGTERM did not help."""
    (tmp_path / "slow.py").write_text(SLOW_EVALUATION)
    notes = tmp_path / "evaluated"
    common = [
        *"--dataset digits --batch-size 32 --eval-batch-size 8 --eval-every 2000 --lr 0.05 --quiet".split(),
        *["--model", f"{tmp_path / 'slow.py'}:Net", "--algo", algo, "--workers", str(workers)],
        *["--max-samples", str(BUDGET)],
    ]
    out = tmp_path / "stopped"
    proc = subprocess.Popen(
        [sys.executable, "-m", "distsgd", "train", *common, "--out", str(out)],
        stderr=subprocess.PIPE, text=True, start_new_session=True, env={**os.environ, "EVAL_LOG": str(notes)},
    )  # fmt: skip
    err = signal_when(proc, lambda: notes.exists() and notes.read_text().count("batch") >= 3, signal.SIGTERM)
    manifest = checkpoint.read_manifest(out)
    assert proc.returncode == 143 and manifest is not None, err[-3000:]
    assert err.strip().startswith("error: terminated by SIGTERM; its last whole checkpoint"), err[-3000:]
    # the evaluation under way when the signal came was given up within a batch or two of it: it
    # never reached its 45th (nor did any other start: the stop came first), and none was logged
    assert notes.read_text().count("batch") < 10, notes.read_text().count("batch")
    events = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert not [e for e in events if e["event"] == "eval"]
    assert 2000 <= manifest["samples"] < BUDGET


@pytest.mark.slow
@pytest.mark.parametrize(
    "algo, extra, how",
    [
        ("asgd", [], "SIGTERM"),
        ("ssp", [], "SIGTERM to the process group"),
        ("dcasgd", [], "SIGTERM"),
        ("easgd", ["--easgd-mode", "async"], "SIGUSR1"),
        ("hogwild", [], "SIGTERM"),
        ("hogwild++", ["--cluster-size", "1"], "SIGTERM to the process group"),
    ],
)
def test_a_signal_to_an_asynchronous_run_writes_its_coordinators_checkpoint(
    tmp_path: Path, algo: str, extra: list[str], how: str
) -> None:
    """SIGTERM (SIGUSR1) mid-run under the parameter server or Hogwild!: the process that holds
    the model (the server; Hogwild!'s launcher, with the shared model) writes its part as a new
    checkpoint once the workers have stopped, and the command names the --resume that goes on.
    It has no worker's part: the resume starts every worker as one that replaces a dead worker,
    from the samples its rank had trained (an optimiser's momentum of a Hogwild! worker starts
    again), so the samples trained before the signal are kept (async EASGD: those of each
    worker's last exchange with the centre), and the resumed run ends at the budget. On main
    (1bde0ba) such a run stopped with no checkpoint at all: every sample lost; and a replacement
    async EASGD worker claimed 0 samples at its first exchange, and the server dropped it.
    (sync-ps keeps its last checkpoint, every worker's part of one round, so that its resume is
    exact: test_resume's test_sync_ps_stops_when_a_worker_dies_and_resumes_exactly.)"""
    common = [
        *SMALL, "--algo", algo, *extra, "--workers", "2", "--max-samples", str(BUDGET), "--lr", "0.05",
        "--eval-every", "20000", "--log-every", "5", "--quiet",
    ]  # fmt: skip
    out = tmp_path / "stopped"
    proc, err = _signalled_mid_run(common, out, how)
    manifest = checkpoint.read_manifest(out)
    assert manifest is not None, err[-3000:]
    name = "SIGUSR1" if how == "SIGUSR1" else "SIGTERM"
    assert proc.returncode == 128 + getattr(signal, name), err[-3000:]
    assert err.strip() == (
        f"error: terminated by {name}; its last whole checkpoint ({manifest['samples']} samples) goes on "
        f"with distsgd train --resume {out}"
    ), err[-3000:]
    progress = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    seen = max(e["samples"] for e in progress if e["event"] in ("progress", "server"))
    if algo == "easgd":  # the server holds the centre and counts a worker's samples at its exchanges, every
        assert 0 <= manifest["samples"] < BUDGET  # --tau steps: what came after its last one is lost
    else:
        assert 0 < seen <= manifest["samples"] < BUDGET
    assert manifest["coordinator"] and manifest["ranks"] == []
    assert sorted(p.name for p in (out / checkpoint.CHECKPOINT_DIR).glob("ckpt-*.pt")) == [
        checkpoint.worker_file(Path(), manifest["seq"], "coordinator").name
    ]
    r = cli_here("train", "--resume", str(out), "--quiet")
    assert r.returncode == 0, r.stderr[-3000:]
    resumed = json.loads((out / "summary.json").read_text())
    assert BUDGET <= resumed["samples"] < BUDGET + 2 * 32 * 2, resumed["samples"]  # a step a worker at most past it
    assert resumed["final_test_accuracy"] > 0.8, resumed


API_SCRIPT = """
import sys
import distsgd
from distsgd.errors import Terminated
if __name__ == "__main__":
    try:
        distsgd.train(model="mlp", data="digits", algo="allreduce", workers=2, batch_size=32, max_samples={budget},
                      lr=0.05, eval_every=4000, log_every=5, out={out!r}, quiet=True)
    except Terminated as exc:
        print("terminated by", exc.signal_name, flush=True)
        sys.exit(3)
"""


@pytest.mark.slow
def test_a_signal_to_a_python_api_run_stops_it_as_the_command_does(tmp_path: Path) -> None:
    """SIGTERM to a script that called distsgd.train (a scheduler's, ``kill``): the run stops as
    the command's does, its workers at their next step with a final checkpoint, and the script
    gets :class:`~distsgd.errors.Terminated` (a KeyboardInterrupt, as Ctrl-C gives) with every
    clean-up done (no workers.json, no uncommitted file). On main (1bde0ba) the script died of
    the signal at once, with no checkpoint and workers.json left behind."""
    out = tmp_path / "stopped"
    script = tmp_path / "script.py"
    script.write_text(API_SCRIPT.format(budget=BUDGET, out=str(out)))
    proc = subprocess.Popen(
        [sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        deadline = time.monotonic() + 120
        while not progress_seen(out) and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.02)
        assert proc.poll() is None, "the run ended before the signal"
        proc.send_signal(signal.SIGTERM)
        stdout, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 3 and stdout.strip() == "terminated by SIGTERM", (proc.returncode, stdout, err[-3000:])
    manifest = checkpoint.read_manifest(out)
    assert manifest is not None and 0 < manifest["samples"] < BUDGET, err[-3000:]
    assert not (out / "workers.json").exists()
    assert sorted(p.name for p in (out / checkpoint.CHECKPOINT_DIR).glob("ckpt-*.pt")) == [
        checkpoint.worker_file(Path(), manifest["seq"], r).name for r in range(2)
    ]
    r = cli_here("train", "--resume", str(out), "--quiet")
    assert r.returncode == 0, r.stderr[-3000:]
    assert BUDGET <= json.loads((out / "summary.json").read_text())["samples"] < BUDGET + 2 * 32  # its last step's


def _sends_a_big_result_through_sigterm(conn, ready) -> None:  # a worker whose loop heard the signal too late
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a listening worker's SIGTERM only asks it to stop
    ready.set()
    conn.send(("result", 0, b"x" * (4 << 20)))  # its model: more than a pipe holds


def test_a_stopping_launcher_reads_what_its_workers_still_send() -> None:
    """A signal to the whole process group as a lockstep run ended: each worker sent its result
    (the model, megabytes) while the launcher, stopped by the same signal, waited for the workers
    to end without reading their pipes. The worker blocked on its full pipe, the launcher on the
    worker, for the whole --timeout (the CI run of 2026-11-26 hung 300 s in
    test_a_signal_writes_a_final_checkpoint...[local-sgd]); now it files what comes as it waits."""
    import multiprocessing

    from distsgd.launch import procs

    mp = multiprocessing.get_context("fork")
    read, write = mp.Pipe(duplex=False)
    inbox = procs.Inbox()
    inbox.add(read)
    heard: list[tuple[str, int, object]] = []
    inbox.filer = lambda *message: heard.append(message)
    ready = mp.Event()
    p = mp.Process(target=_sends_a_big_result_through_sigterm, args=(write, ready))
    p.start()
    write.close()
    assert ready.wait(60)
    procs.stop_all([p], grace_s=60.0, inbox=inbox)  # on main: SIGKILLed after the whole grace, nothing heard
    assert p.exitcode == 0 and [(kind, len(body)) for kind, _, body in heard] == [("result", 4 << 20)]
    inbox.close()


@pytest.mark.parametrize(
    "edit, said",
    [
        (lambda s: s.update(counts=torch.zeros(5, dtype=torch.int64)), "its 'counts' is a int64 tensor of shape [5]"),
        (
            lambda s: s["watcher"].update(train_wall_s=float("nan")),
            "its 'watcher' part's 'train_wall_s' is nan, not a number of seconds >= 0",
        ),
    ],
    ids=["counts", "watcher"],
)
def test_a_wrong_value_in_a_coordinators_file_is_one_line(tmp_path: Path, edit, said: str) -> None:
    """Item 3, the coordinator's file (Hogwild!'s launcher: the shared model, each worker's samples,
    the evaluations): on main a counts tensor of another shape was a RuntimeError traceback from
    copy_, and a nan training time went into the summary."""
    out = tmp_path / "run"
    r = cli_here(
        "train", *SMALL, "--algo", "hogwild", "--workers", "2", "--max-samples", "512", "--checkpoint-every", "256",
        "--out", str(out), "--quiet",
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    for path in (out / checkpoint.CHECKPOINT_DIR).glob("ckpt-*-rankcoordinator.pt"):
        state = torch.load(path, weights_only=True)
        edit(state)
        torch.save(state, path)
    newest = checkpoint.worker_file(
        out / checkpoint.CHECKPOINT_DIR, checkpoint.read_manifest(out)["seq"], "coordinator"
    )
    line = one_error_line(cli_here("train", "--resume", str(out), "--max-samples", "1024", "--quiet"))
    assert line.startswith(f"error: cannot resume from {newest}: {said}"), line
