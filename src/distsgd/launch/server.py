"""The parameter-server topology (asgd, sync-ps, ssp, dcasgd, async easgd): rank 0 serves, ranks
1..N train, in one gloo process group (the server's messages are point-to-point). What the
server does is the algorithm's (its ``serve`` class method); this module starts, joins and
supervises the processes.

Locally, a worker that dies is recorded in ``failed_workers`` and the server carries on without
it (unless the run checkpoints: then it stops, pointing at ``--resume``); if the server dies, the
run fails at once with one line.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from distsgd.config import RunConfig
from distsgd.errors import ConfigError, WorkerError
from distsgd.launch import procs
from distsgd.launch.rendezvous import (LOOPBACK, check_init_method, free_port, init_group, init_torchrun_group,
                                       leave_group, loopback_only)
from distsgd.metrics import NullSink, Sink
from distsgd.train.context import Job, WorkerContext, WorkerResult
from distsgd.train.loop import run_worker


def plan(cfg: RunConfig, algo_cls: Any, torchrun: bool) -> RunConfig:
    """Under torchrun rank 0 serves, so the workers are the group's size less one; the messages are
    CPU tensors over gloo."""
    if cfg.backend != "gloo":
        raise ConfigError(f"{cfg.algo} sends CPU tensors between the server and its workers over gloo: "
                          f"use --backend gloo")
    check_init_method(cfg.init_method)
    if not torchrun:
        return cfg
    cfg = cfg.replace(workers=int(os.environ["WORLD_SIZE"]) - 1)
    if cfg.workers < 1:
        raise ConfigError(f"{cfg.algo} needs a server and at least one worker: torchrun --nproc-per-node 2 or more")
    return cfg


def run(job: Job, algo_cls: Any, sink: Sink, torchrun: bool) -> list[WorkerResult]:
    if not torchrun:
        return _run_local(job, algo_cls, sink)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    init_torchrun_group(job.cfg, rank, world)
    try:
        if rank == 0:
            chief = algo_cls.serve(job, world, sink)
            chief.extra["failed_workers"] = []
            return [chief]
        return [_work(job, algo_cls, rank, world, NullSink())]
    finally:
        leave_group()


def _work(job: Job, algo_cls: Any, rank: int, world: int, sink: Sink) -> WorkerResult:
    """Be worker ``rank`` (1..N): its data rank is rank - 1 of N."""
    ctx = WorkerContext(job, rank=rank - 1, world=world - 1, sink=sink, reports=True, evaluates=False)
    return run_worker(ctx, algo_cls(job.cfg))


def _entry(rank: int, world: int, job: Job, algo_cls: Any, init_method: str, out: Any,
           dead_flags: torch.Tensor) -> None:
    """A process of a local parameter-server run: rank 0 serves, the others train."""
    q = procs.Outbox(out)
    procs.begin_worker("server" if rank == 0 else f"worker {rank - 1}", rank, world)
    if job.cfg.init_method is None:
        loopback_only()

    def dead() -> set[int]:
        return {int(r) for r in torch.nonzero(dead_flags).flatten()}

    def body() -> WorkerResult:
        init_group(job.cfg.replace(backend="gloo"), rank, world, init_method)
        if rank == 0:
            return algo_cls.serve(job, world, procs.QueueSink(q, 0), dead)
        return _work(job, algo_cls, rank, world, procs.QueueSink(q, rank))

    try:
        procs.report(q, rank, body)
    finally:
        leave_group()


def _run_local(job: Job, algo_cls: Any, sink: Sink) -> list[WorkerResult]:
    """One server process and ``cfg.workers`` worker processes on this machine."""
    cfg = job.cfg
    workers, world = cfg.workers, cfg.workers + 1
    init_method = cfg.init_method or f"tcp://{LOOPBACK}:{free_port()}"
    job.data.share_memory_()
    dead_flags = torch.zeros(world, dtype=torch.int8).share_memory_()  # the server drops these workers
    roles = [("server", 0)] + [("worker", r) for r in range(workers)]
    # gloo logs a dead worker's closed connection as an error at C++ level: the run reports it once.
    with procs.child_env(TORCH_CPP_LOG_LEVEL="FATAL"), \
            procs.spawned(cfg, _entry, roles, lambda i, out: (i, world, job, algo_cls, init_method, out,
                                                              dead_flags)) as (ps, inbox):
        sup = procs.Supervisor(ps, inbox, sink.emit)
        while 0 not in sup.results:
            sup.poll(0.05)
            failed = sup.failed()
            if 0 in failed:
                raise WorkerError(f"the parameter server failed: {sup.reason(0)}")
            for rank in failed:
                dead_flags[rank] = 1
            if failed and cfg.checkpoint_period is not None:  # it cannot go on without a worker's state
                cause = sup.blame(lambda r: f"worker {r - 1}")  # the dead one, not one its death upset
                raise type(cause)(f"{cause}; continue from the last checkpoint with --resume {cfg.out}")
            if len(failed - {0}) == workers:  # the server's death can reach the workers before us: blame
                cause = sup.blame(lambda r: "the parameter server" if r == 0 else f"worker {r - 1}")
                raise cause if str(cause).startswith("the parameter server") else \
                    type(cause)(f"all {workers} workers failed; {cause}")
        sup.drain_until(lambda: len(sup.results) + len(sup.failed()) == world, procs.STOP_GRACE_S)
    failed = sorted(sup.failed())
    chief = procs.unpack(sup.results[0], job)
    chief.extra["failed_workers"] = [r - 1 for r in failed]
    if failed:
        chief.extra["worker_errors"] = {str(r - 1): sup.reason(r) for r in failed}
    others = [procs.unpack(sup.results[r], job) for r in range(1, world) if r in sup.results]
    return [chief] + others
