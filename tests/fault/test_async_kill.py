"""Asynchronous algorithms finish the run when a worker is SIGKILLed at a random moment.

The victim is found the way an operator would: in the live run's workers.json.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("sklearn")

ALGOS = [
    ("hogwild", []),
    ("asgd", []),
    ("ssp", ["--staleness", "2"]),
    ("dcasgd", []),
    ("easgd", ["--easgd-mode", "async", "--tau", "4"]),
    ("hogwild++", ["--update-delay", "8"]),
]
# Epochs: enough that the kill (within 0.3 s of the first progress line) lands mid-run. Async
# EASGD's workers talk to the server only every tau steps, so its run is nearly as short as
# Hogwild!'s (at 8 epochs its worker 1 once finished before the kill); hogwild++'s clusters
# exchange only a token, and at 20 epochs its worker 1 once finished first (failed_workers []).
EPOCHS = {"hogwild": 20, "hogwild++": 60, "easgd": 20}


@pytest.mark.slow
@pytest.mark.parametrize("algo, extra", ALGOS, ids=[a for a, _ in ALGOS])
def test_run_finishes_after_a_worker_is_killed(tmp_path: Path, algo: str, extra: list[str]) -> None:
    out = tmp_path / "run"
    epochs = EPOCHS.get(algo, 8)
    cmd = [
        sys.executable,
        "-m",
        "distsgd",
        "train",
        "--algo",
        algo,
        *"--workers 2 --dataset digits --model mlp --epochs".split(),
        str(epochs),
        *"--batch-size 8 --lr 0.02 --log-every 20 --out".split(),
        str(out),
        *extra,
    ]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 90
        victim = None
        while time.monotonic() < deadline and proc.poll() is None:
            metrics = out / "metrics.jsonl"
            if (out / "workers.json").exists() and metrics.exists() and '"progress"' in metrics.read_text():
                entries = json.loads((out / "workers.json").read_text())
                victim = next(e for e in entries if e["role"] == "worker" and e["rank"] == 1)
                break
            time.sleep(0.05)
        assert victim is not None, "the run never got going"
        assert {e["role"] for e in entries} >= {"launcher", "worker"}
        time.sleep(random.uniform(0.0, 0.3))  # a random moment of training
        os.kill(victim["pid"], signal.SIGKILL)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, err[-2000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["failed_workers"] == [1]
    assert summary["samples_per_worker"][0] == epochs * 718  # the survivor finished its epochs
    assert 0 < summary["samples_per_worker"][1] < epochs * 718
    assert summary["samples"] == sum(summary["samples_per_worker"])
    assert not (out / "workers.json").exists()  # the run is over
