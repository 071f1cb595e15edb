"""Shared fixtures: offline data lookups, small real datasets, and a reaper for child processes."""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import time
from collections.abc import Collection, Iterator
from pathlib import Path

import pytest


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The ``alone`` tests first, then the ``slow`` ones (otherwise in their files' order), so that
    the test processes (pytest-xdist) end together rather than one finishing a long test alone, and
    an ``alone`` test waits for little: pytest-xdist's worksteal hands each process a contiguous
    half of this order, so the first process starts with the ``alone`` tests while the other starts
    the second half's short ones. (Last, they came in the middle of the other process's slow
    tests: the first waited 27 s for one to end, 2026-11-27.) Tests marked ``gpu`` need CUDA:
    skipped, saying so, on a machine without it (CI)."""
    import torch

    items.sort(key=lambda item: ("alone" not in item.keywords, "slow" not in item.keywords))
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (torch.cuda.is_available() is False)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


ALL_CORES = frozenset(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else frozenset()


def _own_cores() -> frozenset[int]:
    """Under pytest-xdist, this test process's share of the cores: with N processes and C cores,
    every min(N, C)-th core from its own (gw0 the first, gw1 the second, ...; with more processes
    than cores, two share one). What a test starts (a run's launcher and workers) inherits it, so
    that a run's threads per worker are its share / workers and no two runs' OpenMP threads,
    spinning at every barrier, fight over the same cores (two such runs on the same 2 cores ran up
    to 80x slower). Else (one process) every core."""
    worker, count = os.environ.get("PYTEST_XDIST_WORKER", ""), os.environ.get("PYTEST_XDIST_WORKER_COUNT", "")
    if not (worker.startswith("gw") and worker[2:].isdigit() and count.isdigit()) or not ALL_CORES:
        return ALL_CORES
    ordered = sorted(ALL_CORES)
    k = min(int(count), len(ordered))
    return ALL_CORES if k < 2 else frozenset(ordered[int(worker[2:]) % k :: k])


def pytest_configure(config: pytest.Config) -> None:
    if ALL_CORES and _own_cores() != ALL_CORES:
        os.sched_setaffinity(0, _own_cores())


def _session_folder(config: pytest.Config) -> Path:
    """The folder the session's test processes share (above each one's own basetemp)."""
    return config._tmp_path_factory.getbasetemp().parent  # type: ignore[attr-defined]


def pytest_collection_finish(session: pytest.Session) -> None:
    """Say that this test process has collected: an ``alone`` test waits for every process to have
    (collecting imports torch and every test module: a core's work for seconds, which no lock
    covers, and which an ``alone`` test at the session's start read as load, 2026-11-27)."""
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    if worker:
        (_session_folder(session.config) / f"collected-{worker}").touch()


def _collected(folder: Path, limit_s: float) -> None:
    """Wait (at most ``limit_s``) until every test process of the session has collected."""
    count = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    end = time.monotonic() + limit_s
    while len(list(folder.glob("collected-gw*"))) < count and time.monotonic() < end:
        time.sleep(0.1)


def _quiet(limit_s: float) -> None:
    """Wait (at most ``limit_s``) until the machine is idle: the processes of the tests that just
    ended (a run's workers, torchrun's agents) may still be on their way out when the lock frees."""
    from distsgd.launch import cores

    end = time.monotonic() + limit_s
    while time.monotonic() < end:
        busy = cores.Look().busy()
        if busy is None or busy < 0.3:
            return


@pytest.hookimpl(hookwrapper=True, tryfirst=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    """Each test's whole protocol (setup, call, teardown) holds :func:`_the_machine`'s locks: the
    fixtures of a module or session a test is the first to need are set up in its setup, so they
    start under the locks too (a module's fixture in one test process, a run or a Ray cluster
    started outside them, was load to an ``alone`` test in the other: it read 2 cores busy where 1
    was, at the start of the suite of 2026-11-28)."""
    with _the_machine(item):
        yield


@contextlib.contextmanager
def _the_machine(item: pytest.Item) -> Iterator[None]:
    """Tests run in parallel (pytest-xdist's processes, ``-n`` in pyproject.toml), except those
    marked ``alone`` (they read the machine's load): one of them waits until the tests running
    now have ended, and none starts while it runs. A lock file shared by the session's processes,
    held shared by every other test, exclusively by an ``alone`` one; a gate in front of it so
    that the tests that keep coming cannot keep an ``alone`` one waiting. Tests marked
    ``one_at_a_time(NAME)`` (a real SLURM's steps and Ray's clusters, whose ports collide) run
    beside others, but never beside another of NAME; tests marked ``every_core`` run beside others
    on every core, not on their process's share. (pytest-xdist's ``xdist_group`` would do
    that, but its loadgroup scheduling groups nothing under pytest 9.2: it renames ``_nodeid``,
    which pytest no longer reads.)"""
    if "PYTEST_XDIST_WORKER" not in os.environ:
        yield
        return
    import fcntl

    folder = _session_folder(item.config)
    alone = item.get_closest_marker("alone") is not None
    group = item.get_closest_marker("one_at_a_time")
    with contextlib.ExitStack() as held:
        gate, machine = (held.enter_context(open(folder / name, "a")) for name in ("gate.lock", "machine.lock"))
        fcntl.flock(gate, fcntl.LOCK_EX if alone else fcntl.LOCK_SH)
        fcntl.flock(machine, fcntl.LOCK_EX if alone else fcntl.LOCK_SH)
        if not alone:
            fcntl.flock(gate, fcntl.LOCK_UN)
        if group is not None:
            fcntl.flock(held.enter_context(open(folder / f"{group.args[0]}.lock", "a")), fcntl.LOCK_EX)
        # the machine is an ``alone`` test's: all of it. An ``every_core`` test spreads what it starts
        # over every core (a bench's hosts pinned to cores of their own), beside the other tests.
        if (alone or item.get_closest_marker("every_core") is not None) and ALL_CORES:
            os.sched_setaffinity(0, ALL_CORES)
            held.callback(os.sched_setaffinity, 0, _own_cores())
        if alone:
            _collected(folder, 120.0)
            _quiet(10.0)
        yield  # every lock is let go as its file closes


@pytest.fixture(autouse=True)
def _isolated_env(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    """No downloads and an empty user cache, so tests see only the files they set up."""
    monkeypatch.setenv("DISTSGD_OFFLINE", "1")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path_factory.mktemp("cache")))
    monkeypatch.delenv("DISTSGD_DATA", raising=False)
    # cores / workers threads whatever else runs (launch.cores): runs compared bit for bit use one count
    monkeypatch.setenv("DISTSGD_THREADS_FROM_LOAD", "0")
    # a run from Python adopts its launcher's variables into os.environ (torchrun's, which torch's
    # env:// reads): recorded absent here, so that none outlives its test
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)


def _become_subreaper() -> None:
    """Orphaned grandchildren (workers of a CLI run in a subprocess) are re-parented to pytest, so
    the reaper below sees them instead of losing them to init."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    PR_SET_CHILD_SUBREAPER = 36
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    except (OSError, AttributeError):
        pass


_become_subreaper()


def _reap_zombies() -> None:
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


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


def reap(grace_s: float = 5, spare: Collection[int] = ()) -> list[int]:
    """This process's live descendants after ``grace_s`` seconds to end, killed so the next test
    starts clean (none off Linux); ``spare``: processes that outlive a test by design, with theirs."""
    if not sys.platform.startswith("linux"):
        return []

    def live() -> list[int]:
        spared = set(spare).union(*(descendants(p) for p in spare))
        return [p for p in descendants(os.getpid()) if p not in spared and _alive(p)]

    _reap_zombies()
    deadline = time.time() + grace_s
    left = live()
    while left and time.time() < deadline:
        time.sleep(0.1)
        _reap_zombies()
        left = live()
    for pid in left:
        _LAST_SEEN[pid] = _what(pid)  # read before it is killed: the failure message names it
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    _reap_zombies()
    return left


_LAST_SEEN: dict[int, str] = {}


def _what(pid: int) -> str:
    """A process as the failure message names it: its parent and command line."""
    try:
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
        ppid = next(x.split()[1] for x in Path(f"/proc/{pid}/status").read_text().splitlines() if x.startswith("PPid:"))
    except (OSError, StopIteration):
        return f"{pid} (gone)"
    return f"{pid} (parent {ppid}): {cmd[:300]}"


@pytest.fixture(autouse=True)
def reap_children():
    """Fail a test that leaves processes behind, and kill them so the next test starts clean."""
    yield
    left = reap()
    assert not left, "processes left behind: " + "; ".join(_LAST_SEEN.get(p, str(p)) for p in left)


# Helpers that live as long as the test process by design, not workers of a run. (The fork server
# that starts workers is one; the workers it forks share its command line, so they are told apart
# by their parent.)
_LIFETIME_HELPERS = (b"multiprocessing.resource_tracker", b"multiprocessing.forkserver", b"torch_shm_manager")


def _alive(pid: int) -> bool:
    """A live process that is not one of Python's or torch's lifetime helpers."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        parent = Path(f"/proc/{fields[1]}/cmdline").read_bytes()
    except OSError:
        return False
    helper = any(h in cmdline for h in _LIFETIME_HELPERS) and b"multiprocessing.forkserver" not in parent
    return fields[0] != "Z" and not helper


@pytest.fixture(scope="module")
def digits():
    """scikit-learn's digits (1,437 training images of 8 x 8), loaded once per test module."""
    pytest.importorskip("sklearn")
    from distsgd.data import load_dataset

    return load_dataset("digits")


@pytest.fixture
def group_of_one(tmp_path: Path):
    """A real process group of one process (gloo): every collective is the identity."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()
