"""The process-group topology: symmetric workers in one ``torch.distributed`` group, stepping in
lockstep.

- **Local** (``--workers N``): N processes on this machine form a group over a free port on
  127.0.0.1 (or ``--init-method``), train, and send their results back, each on its own pipe;
  rank 0 also sends its metrics events, which the launching process writes. If a worker raises
  or dies, the others are stopped at once and the run fails with one line naming that worker;
  with ``--min-workers K`` (below ``--workers``) a worker that dies is left behind instead, and
  the others train on while K remain (:mod:`distsgd.train.membership`).
- **torchrun, Ray Train**: this process *is* one worker. It joins the group its launcher formed
  (torchrun's ``env://``; Ray Train's, which exists already); rank 0 gathers the others' figures.
"""

from __future__ import annotations

import logging
import os
import time
from multiprocessing.connection import Connection
from typing import Any

import torch.distributed as dist

from distsgd.algorithms.base import Algorithm
from distsgd.config import RunConfig
from distsgd.errors import ConfigError
from distsgd.launch import procs
from distsgd.launch.rendezvous import (
    LOOPBACK,
    check_backend,
    check_init_method,
    free_port,
    init_group,
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
    local = int(os.environ.get("LOCAL_WORLD_SIZE", cfg.workers)) if torchrun else cfg.workers
    cfg = resolve_backend(cfg, local)
    check_backend(cfg, local)
    check_init_method(cfg.init_method)
    if cfg.min_workers is not None and cfg.min_workers < cfg.workers:
        where = (
            "under torchrun (use its --max-restarts, with --checkpoint-every)"
            if torchrun
            else "with --init-method (the launcher holds the group's store on 127.0.0.1)"
            if cfg.init_method is not None
            else "on nccl (a failed NCCL collective cannot be left behind here): use --backend gloo"
            if cfg.backend == "nccl"
            else None
        )
        if where is not None:
            raise ConfigError(f"--min-workers trains on without a lost worker in local gloo runs only, not {where}")
    return cfg


def run(job: Job, algo_cls: type[Algorithm], sink: Sink, torchrun: bool) -> list[WorkerResult]:
    """Every worker's result, rank 0 first (under torchrun, a rank > 0 gets only its own). A local
    group that loses a worker restarts from its last checkpoint, ``--restart-workers`` times."""
    if torchrun:
        return _run_torchrun(job, algo_cls, sink)
    if job.main is not None and job.cfg.min_workers is not None and job.cfg.min_workers < job.cfg.workers:
        raise ConfigError("--min-workers trains on without a lost worker in distsgd's loop only, not in a user's loop")
    return procs.with_restarts(job, sink, lambda j: _run_local(j, algo_cls, sink))


def _entry(
    rank: int, world: int, job: Job, algo_cls: type[Algorithm], init_method: str, store_port: int, out: Connection
) -> None:
    """The body of a worker process. ``store_port``: the launcher's store, where a run that trains
    through losses (0: one that does not) forms its groups."""
    q = procs.Outbox(out)
    procs.begin_worker(f"worker {rank}", rank, world, job.cfg.quiet)
    cfg = job.cfg
    if cfg.init_method is None:
        loopback_only()

    def body() -> WorkerResult:
        where = device.use(cfg.device, rank)
        if store_port:
            member = membership.Membership(LOOPBACK, store_port, rank, world, cfg.timeout_s)
            member.join(cfg.backend)
            membership.set_current(member)
        else:
            init_group(cfg, rank, world, init_method)
        ctx = WorkerContext(
            job,
            rank=rank,
            world=world,
            # with --min-workers any worker may come to report (the lowest rank left)
            sink=procs.QueueSink(q) if rank == 0 or store_port else NullSink(),
            reports=rank == 0,
            device=where,
        )
        return run_worker(ctx, algo_cls(cfg))

    try:
        procs.report(q, rank, body)
    finally:
        member = membership.current()
        if member is not None:
            member.stop()
            membership.set_current(None)
        leave_group()


def _run_local(job: Job, algo_cls: type[Algorithm], sink: Sink) -> list[WorkerResult]:
    cfg = job.cfg
    world = cfg.workers
    init_method = cfg.init_method or f"tcp://{LOOPBACK}:{free_port()}"
    job.data.share_memory_()  # every worker reads one copy
    through = cfg.min_workers is not None and cfg.min_workers < world  # --min-workers: train through losses
    store = dist.TCPStore(LOOPBACK, 0, world, is_master=True, wait_for_workers=False) if through else None
    recoveries: list[dict[str, Any]] = []
    gen = 0  # the group's generation: one more each time the launcher announces a loss

    def on_event(event: dict[str, Any]) -> None:
        if event.get("event") == "recovery":  # the reporting worker's word on a loss it trained through
            for rec in recoveries:
                if rec["generation"] == event["generation"]:
                    rec.update({k: v for k, v in event.items() if k not in ("event", "lost", "generation")})
        sink.emit(event)

    started = time.monotonic()
    with procs.spawned(
        cfg,
        _entry,
        [("worker", r) for r in range(world)],
        lambda r, out, _: (r, world, job, algo_cls, init_method, store.port if store is not None else 0, out),
        signalled_grace_s=cfg.timeout_s if cfg.out else procs.STOP_GRACE_S,  # for a final checkpoint
    ) as team:
        sup = procs.Supervisor(team.procs, team.inbox, on_event, own=job.main is not None)
        members = list(range(world))
        while not all(r in sup.results for r in members):
            sup.poll(0.2)
            failed = sup.failed() & set(members)
            if not failed:
                continue
            # fail fast: a lockstep group cannot go on without a worker, unless --min-workers lets it
            # leave behind one that died without a word (one that raised would raise again)
            if store is None or failed & set(sup.said) or len(members) - len(failed) < (cfg.min_workers or world):
                raise sup.blame()
            members = [r for r in members if r not in failed]
            gen += 1
            for r in sorted(failed):
                reason = sup.reason(r)
                log.warning(
                    "worker %d died (%s): the other %d train on without it (--min-workers %d)",
                    r,
                    reason,
                    len(members),
                    cfg.min_workers,
                )
                recoveries.append(
                    {"worker": r, "reason": reason, "generation": gen, "at_s": round(time.monotonic() - started, 3)}
                )
                sink.emit({"event": "worker_lost", "worker": r, "reason": reason, "workers": len(members)})
            membership.announce(store, gen, members)
    results = [procs.unpack(sup.results[r], job) for r in members]
    if recoveries:
        attendance = results[0].attendance = results[0].attendance or Attendance()
        attendance.recoveries = recoveries
        attendance.failed_workers = [rec["worker"] for rec in recoveries]
    return results


def _run_torchrun(job: Job, algo_cls: type[Algorithm], sink: Sink) -> list[WorkerResult]:
    where = device.use(job.cfg.device, int(os.environ.get("LOCAL_RANK", 0)))
    with launcher_group(job.cfg) as (rank, world):
        ctx = WorkerContext(
            job, rank=rank, world=world, sink=sink if rank == 0 else NullSink(), reports=rank == 0, device=where
        )
        mine = run_worker(ctx, algo_cls(job.cfg))
        gathered = gather_results([mine], rank, world)
    return [mine] + [r for node in gathered[1:] for r in node] if rank == 0 else [mine]


def gather_results(mine: list[WorkerResult], rank: int, world: int) -> list[list[WorkerResult]]:
    """Every process's results (without models) on rank 0, by rank; others get []."""
    light = [{k: v for k, v in vars(r).items() if k != "model"} for r in mine]
    gathered: list[Any] = [None] * world if rank == 0 else []
    dist.gather_object(light, gathered if rank == 0 else None, dst=0)
    return [[WorkerResult(model=None, **g) for g in node] for node in gathered]
