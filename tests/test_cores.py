"""The threads a run takes when the user gives no count: the cores other processes leave
(launch.cores). On 8b8418d a worker took cores / workers threads whatever else ran: beside one busy
process on 2 cores, `distsgd train --model mlp` ran at 413 samples/s against 59,671 with one thread."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from distsgd.config import cores
from distsgd.launch import cores as cores_mod
from helpers import run_cli

pytest.importorskip("sklearn")
# they read the machine's load: run while no other test does (conftest's _the_machine); the wait for
# the tests running then is part of their time
pytestmark = [pytest.mark.alone, pytest.mark.slow, pytest.mark.timeout(600)]  # alone: a wait for an idle machine each


@contextmanager
def spinning(n: int) -> Iterator[None]:
    """``n`` other processes, each keeping one core busy."""
    procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]
    try:
        time.sleep(0.5)  # started and spinning
        yield
    finally:
        for p in procs:
            p.kill()
            p.wait()


def _looked(window_s: float, busy_meanwhile: bool = False) -> float:
    """The load of other processes over ``window_s``, read as a run reads it (this process spinning
    meanwhile where ``busy_meanwhile``)."""
    first = cores_mod.look()
    assert first is not None
    stop = time.monotonic() + window_s
    while time.monotonic() < stop:
        if busy_meanwhile:  # this process's own work (the data it loads) is not another's load
            sum(range(1000))
        else:
            time.sleep(0.01)
    busy = first.busy()
    assert busy is not None
    return busy


def test_the_cores_other_processes_keep_busy_are_seen_and_its_own_are_not(monkeypatch: pytest.MonkeyPatch) -> None:
    """Read over a few windows, each claim needing one: a process this test did not start (a
    finished test's teardown) once kept a core busy through the only window, 0.976 (CI, f5eedb9).
    A look that counted this process's own work would read about 1 in every window."""
    monkeypatch.setenv(cores_mod.FROM_LOAD, "1")
    others = max(1, cores() - 1)
    with spinning(others):
        seen = [_looked(0.3) for _ in range(3)]
    assert any(others - 0.5 < busy < others + 0.5 for busy in seen), seen
    own = [_looked(0.4, busy_meanwhile=True) for _ in range(4)]
    assert min(own) < 0.5, own


def _threads(out: Path, *extra: str) -> int:
    r = run_cli(
        "train", "--model", "mlp", "--dataset", "digits", "--max-samples", "640", "--quiet", "--out", str(out), *extra,
        env={cores_mod.FROM_LOAD: "1"},
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads((out / "summary.json").read_text())["threads_per_worker"]


def test_a_run_beside_busy_processes_takes_the_cores_they_leave(tmp_path: Path) -> None:
    """Every core but one busy: one thread (cores / workers on 8b8418d, here 2 on 2 cores), and
    --threads-per-worker still the user's."""
    if cores() < 2:  # asked here, not at import: an ``alone`` test has every core (tests/conftest.py)
        pytest.skip("one core: one thread whatever the load")
    with spinning(cores() - 1):
        assert _threads(tmp_path / "chosen") == 1
        assert _threads(tmp_path / "asked", "--threads-per-worker", "2") == 2


def test_the_fork_server_the_command_forked_is_not_load(tmp_path: Path) -> None:
    """The command forks its workers' fork server before it reads the data, and the server imports
    the rest (torch._dynamo: a core for a second) while the cores are looked at: that is the run's
    own CPU. On an idle machine one Hogwild! worker still gets every core (before it was counted
    out, it got cores - 1)."""
    if cores() < 2:
        pytest.skip("one core: one thread whatever the load")
    assert _threads(tmp_path / "one", "--algo", "hogwild", "--workers", "1") == cores()


def test_a_thread_of_its_own_is_not_load() -> None:
    """The launcher's own threads (a user's loader thread, say) are its own CPU time, taken out."""
    first = cores_mod.Look()
    done = threading.Event()

    def burn() -> None:
        while not done.is_set():
            sum(range(1000))

    t = threading.Thread(target=burn)
    t.start()
    time.sleep(0.3)
    done.set()
    t.join()
    busy = first.busy()
    assert busy is not None and busy < 0.5, busy
