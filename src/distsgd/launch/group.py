"""The process-group topology: symmetric workers in one ``torch.distributed`` group, stepping in
lockstep.

- **Local** (``--workers N``): N processes on this machine form a group over a free port on
  127.0.0.1 (or ``--init-method``), train, and send their results back, each on its own pipe;
  rank 0 also sends its metrics events, which the launching process writes. If a worker raises
  or dies, the others are stopped at once and the run fails with one line naming that worker.
- **torchrun, Ray Train**: this process *is* one worker. It joins the group its launcher formed
  (torchrun's ``env://``; Ray Train's, which exists already); rank 0 gathers the others' figures.
"""

from __future__ import annotations

import os
from multiprocessing.connection import Connection
from typing import Any

import torch.distributed as dist

from distsgd.algorithms.base import Algorithm
from distsgd.config import RunConfig
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
from distsgd.train import device
from distsgd.train.context import Job, WorkerContext, WorkerResult
from distsgd.train.loop import run_worker


def plan(cfg: RunConfig, algo_cls: type[Algorithm], torchrun: bool) -> RunConfig:
    """Under torchrun (or Ray Train) the group's size is the number of workers; the backend and
    rendezvous must work here."""
    if torchrun:
        cfg = cfg.replace(workers=place()[1])
    local = int(os.environ.get("LOCAL_WORLD_SIZE", cfg.workers)) if torchrun else cfg.workers
    cfg = resolve_backend(cfg, local)
    check_backend(cfg, local)
    check_init_method(cfg.init_method)
    return cfg


def run(job: Job, algo_cls: type[Algorithm], sink: Sink, torchrun: bool) -> list[WorkerResult]:
    """Every worker's result, rank 0 first (under torchrun, a rank > 0 gets only its own). A local
    group that loses a worker restarts from its last checkpoint, ``--restart-workers`` times."""
    if torchrun:
        return _run_torchrun(job, algo_cls, sink)
    return procs.with_restarts(job, sink, lambda j: _run_local(j, algo_cls, sink))


def _entry(rank: int, world: int, job: Job, algo_cls: type[Algorithm], init_method: str, out: Connection) -> None:
    """The body of a worker process."""
    q = procs.Outbox(out)
    procs.begin_worker(f"worker {rank}", rank, world, job.cfg.quiet)
    cfg = job.cfg
    if cfg.init_method is None:
        loopback_only()

    def body() -> WorkerResult:
        where = device.use(cfg.device, rank)
        init_group(cfg, rank, world, init_method)
        ctx = WorkerContext(
            job,
            rank=rank,
            world=world,
            sink=procs.QueueSink(q) if rank == 0 else NullSink(),
            reports=rank == 0,
            device=where,
        )
        return run_worker(ctx, algo_cls(cfg))

    try:
        procs.report(q, rank, body)
    finally:
        leave_group()


def _run_local(job: Job, algo_cls: type[Algorithm], sink: Sink) -> list[WorkerResult]:
    cfg = job.cfg
    world = cfg.workers
    init_method = cfg.init_method or f"tcp://{LOOPBACK}:{free_port()}"
    job.data.share_memory_()  # every worker reads one copy
    with procs.spawned(
        cfg,
        _entry,
        [("worker", r) for r in range(world)],
        lambda r, out, _: (r, world, job, algo_cls, init_method, out),
        signalled_grace_s=cfg.timeout_s if cfg.out else procs.STOP_GRACE_S,  # for a final checkpoint
    ) as team:
        sup = procs.Supervisor(team.procs, team.inbox, sink.emit, own=job.main is not None)
        while len(sup.results) < world:  # fail fast: a lockstep group cannot go on without a worker
            sup.poll(0.2)
            if sup.failed():
                raise sup.blame()
    return [procs.unpack(sup.results[r], job) for r in range(world)]


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
