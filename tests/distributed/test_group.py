"""The process-group launcher: stop decisions agreed by all, a failing worker, Ctrl-C, torchrun, a
group formed before distsgd runs."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import pytest

import distsgd
from distsgd import checkpoint
from helpers import in_group, run_cli, signal_when, torchrun

pytest.importorskip("sklearn")

B = 16
STEPS = 20


def test_stop_at_target_is_agreed_by_all_workers(digits) -> None:
    s = distsgd.train(
        model="mlp",
        data=digits,
        algo="allreduce",
        workers=2,
        epochs=30,
        lr=0.05,
        eval_every=512,
        target_accuracy=0.7,
        stop_at_target=True,
        quiet=True,
    ).summary
    assert s["samples_to_target"] is not None and s["samples"] == s["samples_to_target"] < 30 * 1436
    assert s["final_test_accuracy"] >= 0.7


FAILING_MODEL = '''
import os, signal
import torch.nn as nn

class Failing(nn.Module):
    """mlp-sized model whose worker 1 fails at its 5th training step."""
    def __init__(self, num_classes, input_shape):
        super().__init__()
        self.net = nn.Sequential(nn.Flatten(), nn.Linear(64, num_classes))
        self.calls = 0

    def forward(self, x):
        if self.training:
            self.calls += 1
            if os.environ.get("RANK") == "1" and self.calls == 5:
                if os.environ.get("HOW") == "kill":
                    os.kill(os.getpid(), signal.SIGKILL)
                raise RuntimeError("injected failure at step 5")
        return self.net(x)
'''


RAISES_AT = 1 + FAILING_MODEL.splitlines().index('                raise RuntimeError("injected failure at step 5")')


@pytest.mark.slow
@pytest.mark.parametrize(
    "how, message",
    [
        # the line of the model's code it raised at (before 2026-11-29 not said: no traceback either)
        ("raise", "worker 1 failed: RuntimeError: injected failure at step 5 ({model}:%d)" % RAISES_AT),
        ("kill", "worker 1 failed: killed by SIGKILL"),
    ],
)
def test_a_failing_worker_stops_the_run(tmp_path: Path, how: str, message: str) -> None:
    model = tmp_path / "failing.py"
    model.write_text(FAILING_MODEL)
    start = time.monotonic()
    res = run_cli(
        *"train --algo allreduce --workers 2 --dataset digits --model".split(),
        f"{model}:Failing",
        "--epochs",
        "50",
        "--out",
        str(tmp_path / "run"),
        "--quiet",
        timeout=60,
        env={"HOW": how},
    )
    assert time.monotonic() - start < 30
    assert res.returncode != 0
    lines = res.stderr.strip().splitlines()
    assert lines[-1] == f"error: {message.format(model=model)}", res.stderr
    assert "Traceback" not in res.stderr
    assert not (tmp_path / "run" / "summary.json").exists()
    # The reaper fixture (conftest) fails this test if any worker process is still alive.


@pytest.mark.slow
def test_a_failing_rank_under_torchrun_is_one_line_and_torchruns_root_cause(tmp_path: Path) -> None:
    """Rank 1's model raises at its 5th step: it says one line, naming the line of the model's code,
    and exits 2; torchrun's report names rank 1 the root cause; rank 0, whose peer's connection
    closed, waits for torchrun's agent to end it and says nothing. On 0a3bbc7 rank 1 printed a
    traceback of 40 lines and exited 1, and rank 0 its line `process 0 stopped: another process
    of the group failed`, which often came first: torchrun then named rank 0 the root cause."""
    (tmp_path / "failing.py").write_text(FAILING_MODEL)
    res = torchrun(
        *"--algo allreduce --dataset digits --model failing.py:Failing --epochs 2 --quiet --out run".split(),
        env={"HOW": "raise"},
        cwd=tmp_path,
        timeout=120,
    )
    said = [line for line in res.stderr.splitlines() if line.startswith("error: ")]
    assert said == [f"error: process 1 failed: RuntimeError: injected failure at step 5 (failing.py:{RAISES_AT})"], (
        res.stderr[-3000:]
    )
    assert "[rank1]" not in res.stderr and "[rank0]" not in res.stderr, res.stderr[-3000:]  # no rank's traceback
    root = res.stderr[res.stderr.index("Root Cause") :]
    assert re.search(r"rank\s*: 1 \(local_rank: 1\)\s*exitcode\s*: 2 ", root), res.stderr[-3000:]


@pytest.mark.slow
def test_torchrun_standalone_two_processes(tmp_path: Path) -> None:
    """Neither --algo nor --out: torchrun's processes are the workers, so the default is allreduce
    (until 2026-11-27 it was --workers' 1: single, a run of its own in each process, into the same
    files), said once; the run's directory is named by torchrun's rendezvous id, every rank's (each
    rank's own clock named it: where their starts straddled a second, their checkpoint parts went
    into two directories, and the run stopped, "checkpoint 1 is missing the files of workers [1]")."""
    res = torchrun(
        *"--dataset digits --model mlp --epochs 2 --lr 0.05 --checkpoint-every epoch".split(), timeout=180, cwd=tmp_path
    )
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stderr.count("2 processes of torchrun without --algo: training with allreduce") == 1, res.stderr
    (out,) = (tmp_path / "runs").iterdir()
    assert re.fullmatch(r"torchrun-[0-9a-f]{8}-allreduce", out.name), out.name
    manifest = checkpoint.read_manifest(out)  # the last checkpoint: both ranks' parts, in the run's directory
    assert manifest is not None and manifest["samples"] == 2 * 1436
    assert all(checkpoint.worker_file(out / checkpoint.CHECKPOINT_DIR, manifest["seq"], r).is_file() for r in (0, 1))
    summary = json.loads((out / "summary.json").read_text())
    assert summary["workers"] == 2 and summary["algo"] == "allreduce" and summary["global_batch_size"] == 128
    assert summary["samples"] == 2 * 1436
    assert summary["final_test_accuracy"] > 0.6
    assert len(summary["bytes_sent_per_worker"]) == 2 and summary["bytes_sent_per_worker"][1] > 0
    assert res.stdout.count("run saved in") == 1  # only rank 0 reports


@pytest.mark.slow
def test_ctrl_c_stops_every_worker(tmp_path: Path) -> None:
    import signal
    import subprocess
    import sys

    proc = subprocess.Popen(
        [
            sys.executable,
            *"-m distsgd train --algo allreduce --workers 2 --dataset digits --model mlp --epochs 100000".split(),
            *"--out".split(),
            str(tmp_path / "run"),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        # as from a terminal: a shell without job control starts background jobs (a CI
        # script run with &, say) with Ctrl-C ignored, and children inherit that
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    metrics = tmp_path / "run" / "metrics.jsonl"  # the signal once the workers are training
    err = signal_when(proc, lambda: metrics.exists() and metrics.stat().st_size > 0, signal.SIGINT, 60, 30)
    assert proc.returncode == 130, err
    # the workers, stopped by the launcher's SIGTERM, may first write a checkpoint of their step: then
    # the line names the --resume that goes on from it
    last = err.strip().splitlines()[-1]
    assert last == "error: interrupted" or last.startswith("error: interrupted; its last whole checkpoint"), err
    # The reaper fixture checks that no worker outlived the launcher.


@pytest.mark.slow
def test_workers_end_when_their_launcher_is_killed(tmp_path: Path) -> None:
    """A SIGKILLed launcher cannot stop its workers; they notice it is gone and exit by themselves."""
    import subprocess
    import sys

    out = tmp_path / "run"
    proc = subprocess.Popen(
        [
            sys.executable,
            *"-m distsgd train --algo asgd --workers 2 --dataset digits --model mlp --epochs 100000 --out".split(),
            str(out),
            "--quiet",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 60
        metrics = out / "metrics.jsonl"
        while time.monotonic() < deadline and not (metrics.exists() and metrics.stat().st_size > 0):
            time.sleep(0.1)  # wait until the workers are training
        assert metrics.exists(), "the run never started"
        pids = [e["pid"] for e in json.loads((out / "workers.json").read_text()) if e["role"] != "launcher"]
        assert len(pids) == 3  # the server and two workers
    finally:
        proc.kill()
        proc.wait()

    def running(pid: int) -> bool:
        try:
            return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
        except OSError:
            return False

    deadline = time.monotonic() + 10
    while any(running(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [p for p in pids if running(p)], "workers outlived their launcher"


def _asgd_twice(rank: int, world: int) -> dict:
    """Two parameter-server runs, one after the other, in a group formed before distsgd ran (as Ray
    Train forms one), with no MASTER_ADDR: the server listens on the host of the group's store."""
    import os

    import torch
    import torch.distributed as dist

    os.environ.pop("MASTER_ADDR", None)
    runs = [
        distsgd.train(model="mlp", data="digits", algo="asgd", max_samples=960, batch_size=32, quiet=True)
        for _ in range(2)
    ]
    after = torch.ones(1)
    dist.all_reduce(after)  # the group is left as distsgd found it
    return {
        "workers": [r.summary["workers"] for r in runs],
        "models": [r.model is not None for r in runs],
        "after": after,
    }


@pytest.mark.slow
def test_a_group_formed_before_the_run_is_joined_and_left_as_it_was(tmp_path: Path) -> None:
    """Rank 0 serves each run from the address it publishes under that run's own key (a second run
    must not find the first one's server), and both ranks go on in their group. Each rank is a
    fresh interpreter: forked from this test process, both hung in a run of the whole suite."""
    from distsgd.launch.rendezvous import free_port

    got = in_group(_asgd_twice, 2, tmp_path, init=f"tcp://127.0.0.1:{free_port()}", start="spawn", timeout=60)
    assert [g["workers"] for g in got] == [[1, 1], [1, 1]]
    assert [g["models"] for g in got] == [[True, True], [False, False]]
    assert [g["after"].item() for g in got] == [2.0, 2.0]
