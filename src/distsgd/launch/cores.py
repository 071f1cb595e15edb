"""How many threads a worker gets when the user did not say: from the cores other processes leave.

PyTorch's OpenMP threads spin at each barrier; beside another busy process on the same cores the
spinning threads fight it for every core, and a worker ran 45-80x slower (2 threads beside one busy
process: 411 samples/s, 1 thread: 18,514; docs/BENCHMARKS.md). Sleeping instead of spinning
(``OMP_WAIT_POLICY=PASSIVE``) mends the loaded case but halves an idle machine's speed on small
models, so the launcher measures instead: how busy its cores were, from ``/proc/stat``, over the
time it spent loading the run's data (its own CPU time taken out), and gives the workers the cores
left. An idle machine keeps today's count (cores / workers); ``--threads-per-worker`` always wins.

The choice travels to the workers in ``config.CHOSEN_THREADS`` (their environment is the launcher's), so every
worker and the summary see one number. Under torchrun (or Ray, SLURM) each rank starts with its
siblings, whose start-up would look like load: there the count stays cores / local workers.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Collection, Iterator

from distsgd.config import RunConfig, cores
from distsgd.train.device import CHOSEN_THREADS

log = logging.getLogger(__name__)

# "0": keep cores / workers whatever the load (runs that must repeat bit for bit: the thread count can
# change a float sum's order; the test suite sets it; --threads-per-worker does the same per run)
FROM_LOAD = "DISTSGD_THREADS_FROM_LOAD"
MIN_WINDOW_S = 0.15  # at least this long between the two looks (USER_HZ ticks are 10 ms)


def _cpu_ticks(cpus: set[int]) -> tuple[int, int] | None:
    """(busy, total) clock ticks since boot over ``cpus``, from /proc/stat; None where unreadable."""
    busy = total = 0
    try:
        with open("/proc/stat") as f:
            for line in f:
                name, *values = line.split()
                if not name.startswith("cpu") or name == "cpu" or int(name[3:]) not in cpus:
                    continue
                ticks = [int(v) for v in values[:8]]  # user nice system idle iowait irq softirq steal
                total += sum(ticks)
                busy += sum(ticks) - ticks[3] - ticks[4]
    except (OSError, ValueError, IndexError):
        return None
    return (busy, total) if total else None


def _own_cpu_s(helpers: Collection[int] = ()) -> float:
    """CPU seconds of this process, its ended children, and its ``helpers`` (processes of its own
    still running: the fork server forked from it while the data loads, ``procs.prefork_server``)."""
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system + sum(_cpu_s(pid) for pid in helpers)


def _cpu_s(pid: int) -> float:
    """CPU seconds a live process has used, from /proc (0 where unreadable: it has ended)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rpartition(")")[2].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime: the 14th, 15th
    except (OSError, ValueError, IndexError):
        return 0.0


class Look:
    """A first look at the cores (:func:`look`); :meth:`busy` takes the second and says how many
    cores' worth other processes used between the two."""

    def __init__(self, helpers: Collection[int] = ()) -> None:
        try:
            self.cpus = os.sched_getaffinity(0)
        except AttributeError:  # pragma: no cover - not Linux
            self.cpus = set()
        self.helpers = tuple(helpers)
        self.at = time.monotonic()
        self.own = _own_cpu_s(self.helpers)
        self.ticks = _cpu_ticks(self.cpus)

    def busy(self) -> float | None:
        """Cores' worth of CPU that other processes used since the first look (None where unknown)."""
        if self.ticks is None:
            return None
        time.sleep(max(0.0, MIN_WINDOW_S - (time.monotonic() - self.at)))
        now, own = _cpu_ticks(self.cpus), _own_cpu_s(self.helpers)
        elapsed = time.monotonic() - self.at
        if now is None or now[1] <= self.ticks[1] or elapsed <= 0:
            return None
        share = (now[0] - self.ticks[0]) / (now[1] - self.ticks[1])  # of every core in the set
        return max(0.0, share * len(self.cpus) - (own - self.own) / elapsed)


def look(helpers: Collection[int] = ()) -> Look | None:
    """The first look, unless :data:`FROM_LOAD` is ``0``; ``helpers``: see :func:`_own_cpu_s`."""
    return None if os.environ.get(FROM_LOAD, "1").strip() == "0" else Look(helpers)


@contextlib.contextmanager
def chosen(cfg: RunConfig, first: Look | None, local_workers: int) -> Iterator[None]:
    """While the run lasts: its workers' thread count in ``config.CHOSEN_THREADS``, unless the user
    chose one: the cores other processes left since ``first`` (None: not measured, the cores
    as they are) shared by ``local_workers``, this machine's (under torchrun, its ranks)."""
    if cfg.threads_per_worker is not None:
        yield
        return
    busy = first.busy() if first is not None else None
    workers = max(1, local_workers)
    even = max(1, cores() // workers)
    threads = even if busy is None else max(1, round(cores() - busy)) // workers or 1
    if threads < even:
        log.info(
            "other processes kept %.1f of %d cores busy: %d thread(s) per worker, not %d (--threads-per-worker to choose)",
            busy,
            cores(),
            threads,
            even,
        )
    was = os.environ.get(CHOSEN_THREADS)
    os.environ[CHOSEN_THREADS] = str(threads)
    try:
        yield
    finally:
        if was is None:
            os.environ.pop(CHOSEN_THREADS, None)
        else:
            os.environ[CHOSEN_THREADS] = was
