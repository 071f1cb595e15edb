"""Shared fixtures: offline data lookups, small real datasets, and a reaper for child processes."""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import pytest

FASHION_DIR = Path("/usr/share/datasets/fashion-mnist")
needs_fashion = pytest.mark.skipif(not FASHION_DIR.is_dir(),
                                   reason="Fashion-MNIST not installed (apt-get install dataset-fashion-mnist)")


@pytest.fixture(autouse=True)
def _isolated_env(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    """No downloads and an empty user cache, so tests see only the files they set up."""
    monkeypatch.setenv("DISTSGD_OFFLINE", "1")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path_factory.mktemp("cache")))
    monkeypatch.delenv("DISTSGD_DATA", raising=False)


def _children(pid: int) -> list[int]:
    kids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        if ppid == pid:
            kids.append(int(entry.name))
    return kids


def descendants(pid: int) -> list[int]:
    found, todo = [], [pid]
    while todo:
        for kid in _children(todo.pop()):
            found.append(kid)
            todo.append(kid)
    return found


@pytest.fixture(autouse=True)
def reap_children():
    """Fail a test that leaves processes behind, and kill them so the next test starts clean."""
    yield
    if not sys.platform.startswith("linux"):
        return
    deadline = time.time() + 5
    left = descendants(os.getpid())
    while left and time.time() < deadline:
        time.sleep(0.1)
        left = [p for p in descendants(os.getpid()) if _alive(p)]
    for pid in left:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    assert not left, f"processes left behind: {left}"


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"
