"""Runs that are never lost: checkpoints of the asynchronous algorithms (the whole process tree
SIGKILLed mid-run, then --resume), replacement workers (--restart-workers), a group restarted
from its last checkpoint, and a dead server pointing at --resume."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from helpers import cli_here, kill_at_step_model, run_cli

pytest.importorskip("sklearn")

# One run per distinct checkpoint path: hogwild's shared model; hogwild++'s clusters; the parameter
# server's (asgd, ssp and dcasgd save and restore exactly the same state, the server's core and each
# worker's part, and every worker pulls the weights before its first push; ssp stands for the three,
# being the one whose rule reads restored state, the workers' clocks); async easgd's elastic exchange.
ASYNC = [
    ("hogwild", []),
    ("hogwild++", ["--update-delay", "4"]),
    ("ssp", ["--staleness", "2"]),
    ("easgd", ["--easgd-mode", "async", "--tau", "4"]),
]
BUDGET, EVERY = 57_440, 4_000  # 40 epochs of digits, 2 workers; a checkpoint every 4,000 samples
# The lr decays to 0 (cosine) so that the final model is not one noisy iterate: at a constant lr two
# uninterrupted ssp runs here ended 1.7 points apart (5 runs: 0.967-0.983); with cosine, 0.3 (one
# of the 360 test digits).
COMMON = [
    *"--workers 2 --dataset digits --model mlp --batch-size 16 --lr 0.05 --schedule cosine --max-samples".split(),
    str(BUDGET),
    "--eval-every",
    "14360",
    "--quiet",
]


def _manifest(run: Path) -> dict | None:
    try:
        return json.loads((run / "checkpoint" / "manifest.json").read_text())
    except (OSError, ValueError):
        return None


@pytest.mark.slow
@pytest.mark.parametrize("algo, extra", ASYNC, ids=[a for a, _ in ASYNC])
def test_killed_mid_run_resumes_and_ends_like_an_uninterrupted_run(tmp_path: Path, algo: str, extra: list[str]) -> None:
    args = ["train", "--algo", algo, *COMMON, *extra]
    whole = cli_here(*args, "--out", str(tmp_path / "whole"))
    assert whole.returncode == 0, whole.stderr
    run = tmp_path / "killed"
    proc = subprocess.Popen(
        [sys.executable, "-m", "distsgd", *args, "--checkpoint-every", str(EVERY), "--out", str(run)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )  # its own process group: the launcher, fork server, workers
    try:
        deadline = time.monotonic() + 120
        while (_manifest(run) or {}).get("seq", 0) < 3 and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.02)
        manifest = _manifest(run)
        assert manifest is not None and proc.poll() is None, "the run ended before its third checkpoint"
        progress = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
        done = max(e["samples"] for e in progress if "samples" in e)
        os.killpg(proc.pid, signal.SIGKILL)  # everything at once, as a machine crash would
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    kept = _manifest(run)
    assert kept["samples"] >= done - EVERY - 2 * 16 * 50  # lost at most an interval (and the progress lag)
    resumed = cli_here("train", "--resume", str(run), "--max-samples", str(BUDGET), "--quiet")
    assert resumed.returncode == 0, resumed.stderr
    a = json.loads((tmp_path / "whole" / "summary.json").read_text())
    b = json.loads((run / "summary.json").read_text())
    assert b["samples"] >= BUDGET and a["samples"] >= BUDGET
    assert abs(a["final_test_accuracy"] - b["final_test_accuracy"]) <= 0.01, (
        a["final_test_accuracy"],
        b["final_test_accuracy"],
    )


@pytest.fixture
def kill_once(tmp_path: Path, monkeypatch) -> str:
    """The process whose RANK is KILL_RANK SIGKILLs itself at its 20th training step, once."""
    monkeypatch.setenv("KILL_MARKER", str(tmp_path / "killed"))
    monkeypatch.setenv("KILL_STEP", "20")
    return kill_at_step_model(tmp_path)


@pytest.mark.parametrize("algo, rank", [("hogwild", "1"), ("asgd", "1"), ("hogwild++", "1"), ("ssp", "1")])
def test_a_killed_worker_is_replaced(tmp_path: Path, kill_once: str, algo: str, rank: str, monkeypatch) -> None:
    """(Worker 1 has RANK 1 under every algorithm; a parameter server's has DISTSGD_ROLE=server.)
    Under ssp the replacement starts at the slowest live worker's clock, and does not wait at the
    start barrier the others passed: it used to, while they waited for it at the staleness bound."""
    import distsgd

    monkeypatch.setenv("KILL_RANK", rank)
    s = distsgd.train(
        model=kill_once,
        data="digits",
        algo=algo,
        workers=2,
        epochs=4,
        batch_size=16,
        lr=0.05,
        restart_workers=1,
        out=str(tmp_path / "run"),
        quiet=True,
        **({"staleness": 2} if algo == "ssp" else {}),
    ).summary
    assert (tmp_path / f"killed.{rank}").exists()  # the worker was killed
    assert len(s["restarts"]) == 1 and s["restarts"][0]["reason"] == "killed by SIGKILL"
    assert s["failed_workers"] == []
    shard = 1436 // 2  # its replacement carried on from the dead worker's samples to the end of its share
    assert s["samples_per_worker"][1] >= 4 * shard - 16
    events = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [e["worker"] for e in events if e["event"] == "restart"] == ["worker 1"]


def test_the_only_worker_is_replaced(tmp_path: Path, kill_once: str, monkeypatch) -> None:
    """--workers 1 (RANK 0, beside the server): its death used to end the run as "all 1 workers
    failed" before the launcher could start a replacement."""
    import distsgd

    monkeypatch.setenv("KILL_RANK", "0")
    s = distsgd.train(
        model=kill_once,
        data="digits",
        algo="asgd",
        workers=1,
        epochs=2,
        batch_size=16,
        lr=0.05,
        restart_workers=1,
        out=str(tmp_path / "run"),
        quiet=True,
    ).summary
    assert (tmp_path / "killed.0").exists() and len(s["restarts"]) == 1 and s["failed_workers"] == []
    assert s["samples_per_worker"][0] >= 2 * 1436 - 16


DIE_AT_START = '''
import os, signal
import torch.nn as nn


class Net(nn.Module):
    """The process whose RANK is KILL_RANK dies while it builds the model, before it reaches the
    server: SIGKILLed (every time, or once: a marker file spares its replacement), or on a mistake
    of the user's (a ValueError: a ModelError, which no restart can mend)."""

    def __init__(self, num_classes, input_shape):
        super().__init__()
        if os.environ.get("RANK") == os.environ["KILL_RANK"] and os.environ.get("DISTSGD_ROLE") != "server":
            how, marker = os.environ["DIE_HOW"], os.environ["KILL_MARKER"]
            if how == "bad-input":
                raise ValueError("this worker's input is bad")
            if how == "always" or not os.path.exists(marker):
                open(marker, "w").close()
                os.kill(os.getpid(), signal.SIGKILL)
        self.net = nn.Sequential(nn.Flatten(), nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, num_classes))

    def forward(self, x):
        return self.net(x)
'''


@pytest.mark.parametrize(
    "algo, rank, how",
    [
        ("asgd", "1", "once"),
        ("asgd", "1", "always"),
        ("ssp", "1", "always"),
        ("asgd", "1", "bad-input"),
        ("hogwild", "1", "bad-input"),
    ],
)
def test_a_worker_that_dies_before_it_starts(tmp_path: Path, monkeypatch, algo: str, rank: str, how: str) -> None:
    """Worker 1 dies before it connects. Replaced once (``once``): its replacement takes part from the
    start. Dying again (``always``): the launcher gives up after one restart and tells the server,
    which used to wait for it forever at the start barrier. On bad input: never restarted."""
    import distsgd

    path = tmp_path / "dieatstart.py"
    path.write_text(DIE_AT_START)
    for k, v in {"KILL_RANK": rank, "DIE_HOW": how, "KILL_MARKER": str(tmp_path / "killed")}.items():
        monkeypatch.setenv(k, v)
    s = distsgd.train(
        model=f"{path}:Net",
        data="digits",
        algo=algo,
        workers=2,
        epochs=2,
        batch_size=16,
        lr=0.05,
        restart_workers=1,
        out=str(tmp_path / "run"),
        quiet=True,
        **({"staleness": 2} if algo == "ssp" else {}),
    ).summary
    shard = 1436 // 2
    if how == "once":
        assert s["failed_workers"] == [] and len(s["restarts"]) == 1
        assert s["samples_per_worker"][1] >= 2 * shard - 16
    else:
        assert s["failed_workers"] == [1] and len(s.get("restarts", [])) == (1 if how == "always" else 0)
        assert s["samples_per_worker"][0] >= 2 * shard - 16 and s["samples_per_worker"][1] == 0
    if how == "bad-input":
        assert "this worker's input is bad" in s["worker_errors"]["1"]
    assert s["final_test_accuracy"] > 0.5


def test_a_lockstep_group_restarts_from_its_last_checkpoint(tmp_path: Path, kill_once: str, monkeypatch) -> None:
    import distsgd

    monkeypatch.setenv("KILL_RANK", "1")
    common = dict(
        model=kill_once,
        data="digits",
        algo="allreduce",
        workers=2,
        epochs=2,
        batch_size=16,
        lr=0.05,
        quiet=True,
        seed=1,
    )
    s = distsgd.train(restart_workers=1, checkpoint_every="160", out=str(tmp_path / "run"), **common).summary
    assert len(s["restarts"]) == 1 and s["restarts"][0]["from_checkpoint"]
    clean = distsgd.train(out=str(tmp_path / "clean"), **{**common, "model": "mlp"}).summary
    assert s["samples"] == clean["samples"]


@pytest.mark.slow
def test_a_dead_server_points_at_resume(tmp_path: Path, monkeypatch) -> None:
    """The server (RANK 0) SIGKILLs itself at its 5th model copy; the run stops with one line naming
    --resume, and the resumed run finishes."""
    path = tmp_path / "killserver.py"
    path.write_text("""
import os, signal
import torch.nn as nn


class Net(nn.Module):
    def __init__(self, num_classes, input_shape):
        super().__init__()
        self.fc = nn.Linear(64, num_classes)
        self.copies = 0

    def state_dict(self, *args, **kwargs):
        marker = os.environ["KILL_MARKER"]
        if os.environ.get("DISTSGD_ROLE") == "server" and not os.path.exists(marker):
            self.copies += 1
            if self.copies == 5:
                open(marker, "w").close()
                os.kill(os.getpid(), signal.SIGKILL)
        return super().state_dict(*args, **kwargs)

    def forward(self, x):
        return self.fc(x.flatten(1))
""")
    monkeypatch.setenv("KILL_MARKER", str(tmp_path / "killed"))
    run = tmp_path / "run"
    res = run_cli(
        *"train --algo asgd --workers 2 --dataset digits --model".split(),
        f"{path}:Net",
        "--epochs",
        "30",
        "--checkpoint-every",
        "epoch",
        "--out",
        str(run),
        "--quiet",
        timeout=120,
    )
    assert res.returncode == 2
    assert res.stderr.strip().splitlines()[-1] == (
        f"error: the parameter server failed: killed by SIGKILL; continue from the last checkpoint with --resume {run}"
    )
    resumed = cli_here("train", "--resume", str(run), "--quiet")
    assert resumed.returncode == 0, resumed.stderr
    assert json.loads((run / "summary.json").read_text())["samples"] >= 30 * 1436
