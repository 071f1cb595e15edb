"""The process-group topology: symmetric workers in one ``torch.distributed`` group, stepping in
lockstep.

- **Local** (``--workers N``): N processes on this machine form a group over a free port on
  127.0.0.1 (or ``--init-method``), train, and send their results back, each on its own pipe;
  rank 0 also sends its metrics events, which the launching process writes. If a worker raises
  or dies, the others are stopped at once and the run fails with one line naming that worker;
  with ``--min-workers K`` (below ``--workers``) a worker that dies is left behind instead, and
  the others train on while K remain (:mod:`distsgd.train.membership`; under torchrun, :mod:`.keepers`).
- **torchrun, Ray Train**: this process *is* one worker. It joins the group its launcher formed
  (torchrun's ``env://``; Ray Train's, which exists already); rank 0 gathers the others' figures.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any, Protocol

import torch.distributed as dist

from distsgd.algorithms.base import Algorithm
from distsgd.checkpoint import resume_hint
from distsgd.config import RunConfig
from distsgd.errors import ConfigError, WorkerError
from distsgd.launch import environment, procs
from distsgd.launch.rendezvous import (
    LOOPBACK,
    check_backend,
    check_init_method,
    formed_group,
    init_group,
    init_on_store,
    launcher_group,
    leave_group,
    loopback_only,
    place,
    resolve_backend,
)
from distsgd.metrics import NullSink, Sink
from distsgd.train import device, membership
from distsgd.train.context import Attendance, Job, WorkerContext, WorkerResult
from distsgd.train.loop import run_worker

log = logging.getLogger(__name__)


def plan(cfg: RunConfig, algo_cls: type[Algorithm], torchrun: bool) -> RunConfig:
    """Under torchrun (or Ray Train) the group's size is the number of workers; the backend and
    rendezvous must work here."""
    if torchrun:
        cfg = cfg.replace(workers=place()[1])
    local = environment.current().local_world_size if torchrun else cfg.workers
    cfg = resolve_backend(cfg, local)
    check_backend(cfg, local)
    check_init_method(cfg.init_method)
    if cfg.trains_through:
        where = (
            "in a process group formed before the run (Ray Train's): use torchrun, or --workers"
            if torchrun and formed_group()
            else "with --init-method (the launcher holds the group's store on 127.0.0.1)"
            if cfg.init_method is not None
            else "on nccl (a failed NCCL collective cannot be left behind here): use --backend gloo"
            if cfg.backend == "nccl"
            else None
        )
        if where is not None:
            raise ConfigError(f"--min-workers trains on without a lost worker in gloo runs only, not {where}")
    return cfg


def run(job: Job, algo_cls: type[Algorithm], sink: Sink, torchrun: bool) -> list[WorkerResult]:
    """Every worker's result, rank 0 first (under torchrun, a rank > 0 gets only its own). A local
    group that loses a worker restarts from its last checkpoint, ``--restart-workers`` times; with
    ``--min-workers`` it trains through the loss (under torchrun: :mod:`.keepers`)."""
    if job.cfg.trains_through and job.main is not None:
        raise ConfigError("--min-workers trains on without a lost worker in distsgd's loop only, not in a user's loop")
    if torchrun:  # (with --min-workers: launch.keepers, which builds on this module)
        return _run_torchrun(job, algo_cls, sink)
    if job.cfg.trains_through:
        return _run_through(job, algo_cls, sink)
    return procs.with_restarts(job, sink, lambda j: _run_local(j, algo_cls, sink))


@dataclass(frozen=True)
class Seat:
    """Where a worker process sits: its rank and the group's size, and how the group forms.
    ``init_method``: the user's ``--init-method`` ("" without one); else ``store_port`` is the
    launcher's store, where the group forms; ``through``: a group that trains through losses forms
    each generation's there instead. ``slot``: the index it reports to its launcher under (its rank
    where None: a torchrun process's one child reports as 0); ``local_rank``: its device's index
    (its rank where None); ``loopback``: a local run's, whose gloo listens on 127.0.0.1 only."""

    rank: int
    world: int
    init_method: str = ""
    store_port: int = 0
    through: membership.StoreAt | None = None
    slot: int | None = None
    local_rank: int | None = None
    loopback: bool = True
    grace_s: float | None = None


def _entry(seat: Seat, job: Job, algo_cls: type[Algorithm], replacement: bool, out: Connection) -> None:
    """The body of a worker process. ``replacement``: it takes the place of a worker of a run that
    trains through losses that died, joining the others."""
    rank, world = seat.rank, seat.world
    q = procs.Outbox(out)
    procs.begin_worker(f"worker {rank}", rank, world, job.cfg.quiet)
    cfg = job.cfg
    if cfg.init_method is None and seat.loopback:
        loopback_only()

    def body() -> WorkerResult:
        where = device.use(cfg.device, rank if seat.local_rank is None else seat.local_rank)
        if seat.init_method:
            init_group(cfg, rank, world, seat.init_method)
        elif seat.through is None:
            init_on_store(cfg, rank, world, seat.store_port)
        else:
            member = membership.Membership(seat.through, rank, world, cfg.timeout_s, seat.grace_s)
            membership.set_current(member)
            if replacement:  # at the others' next step (the loop then takes a live member's state)
                member.enter(cfg.backend)
            else:
                member.join(cfg.backend)
        ctx = WorkerContext(
            job,
            rank=rank,
            world=world,
            # with --min-workers any worker may come to report (the lowest rank left)
            sink=procs.QueueSink(q) if rank == 0 or seat.store_port or seat.through is not None else NullSink(),
            reports=rank == 0 and not replacement,
            device=where,
        )
        result = run_worker(ctx, algo_cls(cfg), replacement)
        joined = membership.current()
        result.generation = joined.gen if joined is not None else None
        return result

    try:
        procs.report(q, rank if seat.slot is None else seat.slot, body)
    finally:
        member = membership.current()
        if member is not None:
            member.stop()
            membership.set_current(None)
        leave_group()


def _run_local(job: Job, algo_cls: type[Algorithm], sink: Sink) -> list[WorkerResult]:
    cfg = job.cfg
    world = cfg.workers
    # the group forms on a store this launcher holds (listening before any worker starts), or at the user's --init-method
    store = None if cfg.init_method else dist.TCPStore(LOOPBACK, 0, world, is_master=True, wait_for_workers=False)
    port = store.port if store is not None else 0
    job.data.share_memory_()  # every worker reads one copy
    with procs.spawned(
        cfg,
        _entry,
        [("worker", r) for r in range(world)],
        lambda r, out, _: (Seat(r, world, cfg.init_method or "", port), job, algo_cls, False, out),
        signalled_grace_s=cfg.timeout_s if cfg.out else procs.STOP_GRACE_S,  # for a final checkpoint
    ) as team:
        sup = procs.Supervisor(team.procs, team.inbox, sink.emit, own=job.main is not None)
        while len(sup.results) < world:  # fail fast: a lockstep group cannot go on without a worker
            sup.poll(0.2)
            if sup.failed():
                raise sup.blame()
    return [procs.unpack(sup.results[r], job) for r in range(world)]


def _run_through(job: Job, algo_cls: type[Algorithm], sink: Sink) -> list[WorkerResult]:
    """A local group that trains through losses (``--min-workers``): see :class:`Generations`."""
    cfg = job.cfg
    job.data.share_memory_()  # every worker reads one copy
    gens = Generations(cfg, sink)
    with procs.spawned(
        cfg,
        _entry,
        [("worker", r) for r in range(cfg.workers)],
        lambda r, out, replacement: (Seat(r, cfg.workers, through=gens.at), job, algo_cls, replacement, out),
        signalled_grace_s=cfg.timeout_s if cfg.out else procs.STOP_GRACE_S,  # for a final checkpoint
        leave_s=2.0,  # the members end by themselves once they sent their results (a SIGTERM in their exit: a traceback)
    ) as team:
        sup = procs.Supervisor(team.procs, team.inbox, gens.on_event, own=False)
        here = _Local(team, sup, sink, gens.restarts)
        while not gens.finished(here):
            sup.poll(0.2)
            gens.admit_ready()
            gens.leave_behind(here)
        for r in gens.joining:  # replacements the run ended before: they hold nothing yet
            team.procs[r].kill()
    return gens.results([procs.unpack(sup.results[r], job) for r in gens.members])


class Workers(Protocol):
    """The workers of a group that trains through losses, as :class:`Generations` sees them, by
    first rank: their results (plain data, as :func:`procs.pack` makes them), who failed and why."""

    @property
    def results(self) -> Mapping[int, dict[str, Any]]: ...

    def failed(self) -> set[int]:
        """Workers that died or raised, and were not yet replaced."""

    def raised(self) -> set[int]:
        """Those of the failed that raised (they would raise again: the run ends)."""

    def blame(self) -> WorkerError: ...

    def reason(self, rank: int) -> str: ...

    def replace(self, rank: int) -> bool:
        """Start a replacement for ``rank``, which failed, where ``--restart-workers`` has one
        left (its failure is then history); whether one starts."""

    def kill(self, rank: int) -> None: ...


class _Local:
    """A local group's workers: the processes this launcher started."""

    def __init__(self, team: procs.Team, sup: procs.Supervisor, sink: Sink, restarts: list[dict[str, Any]]) -> None:
        self.team, self.sup, self.sink, self.restarts = team, sup, sink, restarts

    @property
    def results(self) -> Mapping[int, dict[str, Any]]:
        return self.sup.results

    def failed(self) -> set[int]:
        return self.sup.failed()

    def raised(self) -> set[int]:
        return set(self.sup.said)

    def blame(self) -> WorkerError:
        return self.sup.blame()

    def reason(self, rank: int) -> str:
        return self.sup.reason(rank)

    def replace(self, rank: int) -> bool:
        return procs.replace(self.team, self.sup, rank, f"worker {rank}", self.sink, self.restarts)

    def kill(self, rank: int) -> None:
        self.team.procs[rank].kill()


class Generations:
    """The launcher's side of a group that trains through losses: it holds the group's store (or,
    under torchrun, a connection to the agent's: ``store``, at ``at``); a worker that dies without a
    word is left behind while ``--min-workers`` remain (the next generation of the group is
    announced without it) and, with ``--restart-workers``, its replacement joins once it says it is
    ready (a generation with it). A worker that raised fails the run: it would raise again."""

    def __init__(
        self,
        cfg: RunConfig,
        sink: Sink,
        store: dist.Store | None = None,
        at: membership.StoreAt | None = None,
        restarts_heard: bool = False,
    ) -> None:
        self.cfg, self.sink = cfg, sink
        self.least = cfg.min_workers or cfg.workers
        if store is None:
            store = dist.TCPStore(LOOPBACK, 0, cfg.workers, is_master=True, wait_for_workers=False)
            at = membership.StoreAt(LOOPBACK, store.port)
        assert at is not None
        self.store, self.at = store, at
        self.gen = 0
        self.members = list(range(cfg.workers))  # the current generation's, by first rank
        self.joining: set[int] = set()  # replacements started, not yet in the group
        self.admitted: dict[int, int] = {}  # a replacement taken into the group -> that generation
        self.recoveries: list[dict[str, Any]] = []  # one per worker lost or joined, with its generation
        self.restarts: list[dict[str, Any]] = []  # the replacements started
        self.restarts_heard = restarts_heard  # (under torchrun each keeper starts its own, and says so)
        self.evals: list[dict[str, Any]] = []  # every evaluation the reporting workers made
        self.started = time.monotonic()

    def on_event(self, event: dict[str, Any]) -> None:
        if event.get("event") == "eval":
            self.evals.append(event)
        elif event.get("event") == "recovery":  # the reporting worker's word on a regrouping
            for rec in self.recoveries:  # (one that came during another's regrouping: the group formed after both)
                if rec["generation"] == event["generation"] or (
                    rec["generation"] < event["generation"] and "recovery_s" not in rec
                ):
                    rec.update({k: v for k, v in event.items() if k not in ("event", "lost", "joined", "generation")})
        elif event.get("event") == "restart" and self.restarts_heard:
            self.restarts.append({k: v for k, v in event.items() if k != "event"})
        self.sink.emit(event)

    def results(self, results: list[WorkerResult]) -> list[WorkerResult]:
        """The members' ``results`` (the first member's first) with what the launcher saw."""
        # the reporting worker's own record starts where it took over: the run's is every one made
        # (one made again after a regrouping, at the same samples, replaces the first)
        results[0].evals = list({e["samples"]: e for e in self.evals}.values())
        attendance = results[0].attendance = results[0].attendance or Attendance()
        attendance.recoveries = self.recoveries
        attendance.restarts = self.restarts
        attendance.failed_workers = [r for r in range(self.cfg.workers) if r not in self.members]
        return results

    def announce(self, records: list[dict[str, Any]], finished: Collection[int]) -> None:
        """The next generation is ``self.members`` but those ``finished`` (they sent their results:
        a last collective can complete on one worker and fail on another); ``records`` say why
        (one per worker lost or joined)."""
        self.gen += 1
        membership.announce(self.store, self.gen, [r for r in self.members if r not in finished])
        at = round(time.monotonic() - self.started, 3)
        self.recoveries.extend({**record, "generation": self.gen, "at_s": at} for record in records)

    def finished(self, workers: Workers) -> bool:
        """Whether every member has sent its result. A replacement admitted after the others
        finished (they take one in only where all agree to, at the last at their loop's end) will
        never meet them: it is stopped, and the run ends without it."""
        results = workers.results
        ended = [results[r].get("generation") for r in self.members if r in results]
        oldest = min((g for g in ended if g is not None), default=None)
        for r in [r for r in self.members if r not in results]:
            if oldest is not None and self.admitted.get(r, -1) > oldest:
                log.warning("the others finished before the replacement for worker %d could join them", r)
                workers.kill(r)
                self.members.remove(r)
                for rec in self.recoveries:
                    if rec["worker"] == r and rec.get("joined") and rec["generation"] == self.admitted[r]:
                        rec["joined"], rec["too_late"] = False, True
        return all(r in results for r in self.members)

    def admit_ready(self) -> None:
        """A generation with each replacement that is ready to join."""
        for r in sorted(self.joining):
            token = membership.ready_to_join(self.store, r)
            if token is None:
                continue
            self.joining.discard(r)
            self.members = sorted(self.members + [r])
            self.announce([{"worker": r, "joined": True}], set())
            membership.admit(self.store, token, self.gen)
            self.admitted[r] = self.gen
            log.warning("a replacement for worker %d joins the other %d", r, len(self.members) - 1)
            self.sink.emit({"event": "worker_joined", "worker": r, "workers": len(self.members)})

    def leave_behind(self, workers: Workers) -> None:
        """A generation without the workers that died (and a replacement for each, where
        ``--restart-workers`` has one left); the run's end (one error line) where one raised or
        fewer than ``--min-workers`` remain."""
        failed = workers.failed() & (set(self.members) | self.joining)
        if not failed:
            return
        if failed & workers.raised():
            raise workers.blame()
        if len(set(self.members) - failed) < self.least:  # where the run has a checkpoint, how to go on from it
            error = workers.blame()
            raise type(error)(f"{error}; fewer than --min-workers {self.least} remain{resume_hint(self.cfg.out)}")
        lost = sorted(failed & set(self.members))
        if lost:
            self.members = [r for r in self.members if r not in failed]
            for r in lost:
                log.warning(
                    "worker %d died (%s): the other %d train on without it (--min-workers %d)",
                    r,
                    workers.reason(r),
                    len(self.members),
                    self.least,
                )
                self.sink.emit(
                    {"event": "worker_lost", "worker": r, "reason": workers.reason(r), "workers": len(self.members)}
                )
            self.announce([{"worker": r, "reason": workers.reason(r)} for r in lost], set(workers.results))
        for r in sorted(failed):
            if workers.replace(r):
                self.joining.add(r)
            else:
                self.joining.discard(r)


def _run_torchrun(job: Job, algo_cls: type[Algorithm], sink: Sink) -> list[WorkerResult]:
    where = device.use(job.cfg.device, environment.current().local_rank)
    with launcher_group(job.cfg) as (rank, world):
        ctx = WorkerContext(
            job, rank=rank, world=world, sink=sink if rank == 0 else NullSink(), reports=rank == 0, device=where
        )
        mine = run_worker(ctx, algo_cls(job.cfg))
        gathered = gather_results([mine], rank, world)
    return [mine] + [r for node in gathered[1:] for r in node] if rank == 0 else [mine]


def gather_results(mine: list[WorkerResult], rank: int, world: int) -> list[list[WorkerResult]]:
    """Every process's results (without models) on rank 0, by rank; others get []."""
    light = [{k: v for k, v in vars(r).items() if k not in ("model", "callbacks")} for r in mine]  # (rank 0's own)
    gathered: list[Any] = [None] * world if rank == 0 else []
    dist.gather_object(light, gathered if rank == 0 else None, dst=0)
    return [[WorkerResult(model=None, **g) for g in node] for node in gathered]
