"""The parameter-server topology (asgd, sync-ps, ssp, dcasgd, async easgd): rank 0 serves, ranks
1..N train. How they talk and what the server does are the algorithm's (its ``serve`` and
``connect`` class methods); this module starts, joins and supervises the processes.

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
from distsgd.launch.rendezvous import LOOPBACK, free_port, loopback_only
from distsgd.metrics import NullSink, Sink
from distsgd.train.context import Job, WorkerContext, WorkerResult
from distsgd.train.loop import run_worker


def plan(cfg: RunConfig, algo_cls: Any, torchrun: bool) -> RunConfig:
    """Under torchrun rank 0 serves, so the workers are the group's size less one."""
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
    if rank == 0:
        chief = algo_cls.serve(job, world, "env://", sink)
        chief.extra["failed_workers"] = []
        return [chief]
    return [_work(job, algo_cls, rank, world, "env://", NullSink())]


def _work(job: Job, algo_cls: Any, rank: int, world: int, init_method: str, sink: Sink) -> WorkerResult:
    """Be worker ``rank`` (1..N): its data rank is rank - 1 of N."""
    with algo_cls.connect(job.cfg, rank, world, init_method):
        ctx = WorkerContext(job, rank=rank - 1, world=world - 1, sink=sink, reports=True, evaluates=False)
        return run_worker(ctx, algo_cls(job.cfg))


def _entry(rank: int, world: int, job: Job, algo_cls: Any, init_method: str, out: Any,
           dead_flags: torch.Tensor) -> None:
    """A process of a local parameter-server run: rank 0 serves, the others train."""
    q = procs.Outbox(out)
    procs.begin_worker("server" if rank == 0 else f"worker {rank - 1}", rank, world)
    loopback_only()

    def dead() -> set[int]:
        return {int(r) for r in torch.nonzero(dead_flags).flatten()}

    def body() -> WorkerResult:
        if rank == 0:
            return algo_cls.serve(job, world, init_method, procs.QueueSink(q, 0), dead)
        return _work(job, algo_cls, rank, world, init_method, procs.QueueSink(q, rank))

    procs.report(q, rank, body)


def _run_local(job: Job, algo_cls: Any, sink: Sink) -> list[WorkerResult]:
    """One server process and ``cfg.workers`` worker processes on this machine."""
    cfg = job.cfg
    workers, world = cfg.workers, cfg.workers + 1
    init_method = cfg.init_method or f"tcp://{LOOPBACK}:{free_port()}"
    job.data.share_memory_()
    dead_flags = torch.zeros(world, dtype=torch.int8).share_memory_()  # the server drops these workers
    roles = [("server", 0)] + [("worker", r) for r in range(workers)]
    # TensorPipe logs every closed pipe at shutdown as a warning; keep C++ logs to errors.
    with procs.child_env(TORCH_CPP_LOG_LEVEL="ERROR"), \
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
                if cfg.checkpoint_period is not None:  # a checkpointed run cannot go on without a worker's state
                    raise WorkerError(f"worker {rank - 1} failed: {sup.reason(rank)}; continue from the last "
                                      f"checkpoint with --resume {cfg.out}")
            if len(failed) == workers:
                raise WorkerError(f"all {workers} workers failed; worker 0: {sup.reason(1)}")
        sup.drain_until(lambda: len(sup.results) + len(sup.failed()) == world, procs.STOP_GRACE_S)
    failed = sorted(sup.failed())
    chief = procs.unpack(sup.results[0], job)
    chief.extra["failed_workers"] = [r - 1 for r in failed]
    if failed:
        chief.extra["worker_errors"] = {str(r - 1): sup.reason(r) for r in failed}
    others = [procs.unpack(sup.results[r], job) for r in range(1, world) if r in sup.results]
    return [chief] + others
