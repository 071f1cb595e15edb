"""The parameter-server topology: rank 0 serves, ranks 1..N train; each worker talks to the server
over a TCP connection of its own. What the server does is the algorithm's (its topology's
``serve``); this module starts, joins and supervises
the processes, and tells the workers where the server listens: a free port on 127.0.0.1
locally (or ``--init-method tcp://HOST:PORT``), or the address it publishes in the store of the
group torchrun (or Ray Train) formed, where rank 0 serves: N workers are N + 1 ranks.

Locally, a worker that dies is recorded in ``failed_workers`` and the server carries on without
it (unless the run checkpoints: then it stops, pointing at ``--resume``); if the server dies, the
run fails at once with one line.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import json
import os
import secrets
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

import torch

from distsgd.algorithms.base import Algorithm, Server, ServerSeat
from distsgd.checkpoint import resume_hint
from distsgd.config import RunConfig
from distsgd.errors import ConfigError, MainGuardError, Terminated
from distsgd.launch import environment, procs
from distsgd.launch.rendezvous import LOOPBACK, check_init_method, free_port, group_host, launcher_group, place
from distsgd.metrics import NullSink, Sink
from distsgd.train import device
from distsgd.train.context import Attendance, Job, LoopEnd, WorkerContext, WorkerResult
from distsgd.train.loop import run_worker

_RUNS = itertools.count()  # runs in one group (a Ray worker may call train twice): each its own keys


def _server(algo_cls: type[Algorithm]) -> Server:
    assert isinstance(algo_cls.topology, Server)  # the launcher picked this module by its kind
    return algo_cls.topology


def plan(cfg: RunConfig, algo_cls: type[Algorithm], torchrun: bool) -> RunConfig:
    """Under torchrun (or Ray Train) rank 0 serves, so the workers are the group's size less one.
    The server's address may be given as ``--init-method tcp://HOST:PORT``."""
    if cfg.init_method is not None and not cfg.init_method.startswith("tcp://"):
        raise ConfigError(f"{cfg.algo}'s server listens on a TCP address: give --init-method tcp://HOST:PORT")
    check_init_method(cfg.init_method)
    if not torchrun:
        return cfg
    cfg = cfg.replace(workers=place()[1] - 1)
    if cfg.workers < 1:
        raise ConfigError(
            f"{cfg.algo} needs a server and at least one worker: a group of 2 or more processes "
            f"(torchrun --nproc-per-node 2, Ray Train ScalingConfig(num_workers=2))"
        )
    if group_host() is None:
        raise ConfigError(
            f"{cfg.algo}'s server listens on rank 0's host, which this group does not name: set MASTER_ADDR"
        )
    return cfg


# A parameter server's processes say which they are in their environment ("server" or "worker"): a
# worker's RANK is its data rank, 0..N-1 (as run.rank), and the server, which runs no loop but builds
# the model (a factory may read the environment), keeps the launcher's numbering, rank 0 of N + 1.
ROLE = "DISTSGD_ROLE"


def run(job: Job, algo_cls: type[Algorithm], sink: Sink, torchrun: bool) -> list[WorkerResult]:
    topology = _server(algo_cls)
    if not torchrun:
        if topology.exact_checkpoints and job.cfg.checkpoint_period is not None:  # lockstep: restart the group
            return procs.with_restarts(job, sink, lambda j: _run_local(j, algo_cls, sink))
        return _run_local(job, algo_cls, sink)
    from torch.distributed import distributed_c10d

    key = f"distsgd/server/{environment.current().attempt}/{next(_RUNS)}"
    with launcher_group(job.cfg.replace(backend="gloo")) as (rank, world):  # its store: where the server listens
        store = distributed_c10d._get_default_store()
        if rank == 0:
            address = f"{group_host()}:0"
            secret = secrets.token_bytes(32)  # the workers read it from torchrun's store, as the address
            # torch's stub types the value str; Store.set takes bytes as they are (the secret is raw bytes)
            store.set(f"{key}/secret", secret)  # type: ignore[arg-type]
            with procs.child_env({ROLE: "server"}, override=True):
                chief = topology.serve(
                    job, algo_cls, world - 1, address, sink, publish=lambda a: store.set(key, a), secret=secret
                )
            chief.attendance = chief.attendance or Attendance(failed_workers=[])  # those the server dropped
            ended = [f"{key}/end/{r}" for r in range(1, world)]  # each told before its DONE: there now
            _add_loop_ends(chief, [LoopEnd(**json.loads(store.get(k))) for k in ended if store.check([k])])
            return [chief]
        store.wait([key])
        seat = ServerSeat(store.get(key).decode(), store.get(f"{key}/secret"))

        def tell_end(end: LoopEnd) -> None:  # a user's loop's data and steps, for rank 0's summary
            store.set(f"{key}/end/{rank}", json.dumps(dataclasses.asdict(end)))
            store.check(
                [f"{key}/end/{rank}"]
            )  # a round trip: the store has it before the DONE leaves (a set does not wait)

        return [_work(job, algo_cls, rank, world, seat, NullSink(), tell_end=tell_end)]


def _add_loop_ends(chief: WorkerResult, ends: list[LoopEnd]) -> None:
    """The server's result under torchrun, with what its workers' loops measured (locally each
    worker's result comes whole, and the summary reads them all): the training set's length their
    run.loader saw (the run's epochs), and their steps and those steps' samples, summed (its
    samples a step)."""
    chief.data_len = next((e.data_len for e in ends if e.data_len), None)
    if ends and all(e.steps is not None and e.step_samples is not None for e in ends):
        chief.steps = sum(e.steps or 0 for e in ends)
        chief.step_samples = sum(e.step_samples or 0 for e in ends)


def _work(
    job: Job,
    algo_cls: type[Algorithm],
    rank: int,
    world: int,
    seat: ServerSeat,
    sink: Sink,
    replacement: bool = False,
    tell_end: Callable[[LoopEnd], None] | None = None,
) -> WorkerResult:
    """Be worker ``rank`` (1..N): its data rank is rank - 1 of N; its device, by its index on its
    machine (the server computes on the CPU: what it sends and receives are host bytes). A loop's
    ``os.environ`` says the same as ``run.rank`` and ``run.world`` (torchrun's contract, which a
    converted script reads: ``DistributedSampler(ds, num_replicas=WORLD_SIZE, rank=RANK)``,
    ``if RANK == 0: save``, ``torch.cuda.set_device(LOCAL_RANK)``): it said the server's numbering,
    RANK 1..N of N + 1, so such a sampler never trained shard 0 and no worker saved (an audit's),
    and a local run put worker k on GPU k + 1."""
    where = environment.current()
    here = isinstance(where, (environment.Local, environment.Spawned))  # every worker on this machine
    local = rank - 1 if here else where.local_rank
    numbered = {"RANK": str(rank - 1), "WORLD_SIZE": str(world - 1), "LOCAL_RANK": str(local), ROLE: "worker"}
    ctx = WorkerContext(
        job,
        rank=rank - 1,
        world=world - 1,
        sink=sink,
        reports=True,
        evaluates=False,
        device=device.use(job.cfg.device, local),
        tell_end=tell_end,
    )
    # the worker's numbering while it works, torchrun's after: under torchrun (Kubeflow, SLURM) a
    # rank's process may run another run, whose environment is read from its variables
    with procs.child_env({**numbered, **({"LOCAL_WORLD_SIZE": str(world - 1)} if here else {})}, override=True):
        return run_worker(ctx, algo_cls(job.cfg, seat), replacement=replacement)


def _entry(
    rank: int,
    world: int,
    job: Job,
    algo_cls: type[Algorithm],
    seat: ServerSeat,
    given_up: torch.Tensor,
    out: Connection,
    replacement: bool = False,
) -> None:
    """A process of a local parameter-server run: rank 0 serves, the others train."""
    q = procs.Outbox(out)
    procs.begin_worker("server" if rank == 0 else f"worker {rank - 1}", rank, world, job.cfg.quiet)
    if rank == 0:
        os.environ[ROLE] = "server"  # (this process serves, then ends)

    def body() -> WorkerResult:
        if rank == 0:
            return _server(algo_cls).serve(
                job, algo_cls, world - 1, seat.address, procs.QueueSink(q, 0), given_up=given_up, secret=seat.secret
            )
        return _work(job, algo_cls, rank, world, seat, procs.QueueSink(q, rank), replacement)

    procs.report(q, rank, body)


def _name(rank: int) -> str:
    """Process ``rank`` of a local run as the user knows it: the server, or its worker (data rank)."""
    return "the parameter server" if rank == 0 else f"worker {rank - 1}"


def _stop_if_fatal(sup: procs.Supervisor) -> None:
    """A user's loop that failed in a worker (not a process that died: the server carries on
    without that) ends the run."""
    fatal = sup.fatal_error(_name)
    if fatal is not None:
        raise fatal


def _run_local(job: Job, algo_cls: type[Algorithm], sink: Sink) -> list[WorkerResult]:
    """One server process and ``cfg.workers`` worker processes on this machine. A worker that
    dies is dropped by the server (its connection closes) and, with ``--restart-workers``,
    started again; the run stops only when the server dies, or every worker has.

    The launcher alone decides whether a dead worker is replaced (the restart budget, and never a
    worker that failed on the user's input: it would fail again), and tells the server when it
    will start none (``given_up``, shared memory), so the server neither waits for a replacement
    that is not coming nor for a worker that died before it connected."""
    cfg = job.cfg
    workers, world = cfg.workers, cfg.workers + 1
    address = cfg.init_method[len("tcp://") :] if cfg.init_method else f"{LOOPBACK}:{free_port()}"
    seat = ServerSeat(address, secrets.token_bytes(32))  # the run's secret: the server admits no one else
    job.data.share_memory_()
    roles = [("server", 0)] + [("worker", r) for r in range(workers)]
    resume = functools.partial(resume_hint, cfg.out)  # read when the run fails: is there a checkpoint yet?
    lockstep = _server(algo_cls).exact_checkpoints and cfg.checkpoint_period is not None  # every worker, every round
    restarts: list[dict[str, Any]] = []
    # by worker rank (1..N); given_up[0] (the server's own rank): the launcher was stopped by a signal,
    # so the server writes its final checkpoint as it stops (not as it is stopped after a failure)
    given_up = torch.zeros(world, dtype=torch.uint8).share_memory_()
    with procs.spawned(
        cfg,
        _entry,
        roles,
        lambda i, out, again: (i, world, job, algo_cls, seat, given_up, out, again),
        signalled_grace_s=cfg.timeout_s if cfg.out else procs.STOP_GRACE_S,  # the server's final checkpoint
    ) as team:
        sup = procs.Supervisor(team.procs, team.inbox, sink.emit, own=job.main is not None)
        gone: set[int] = set()  # failed workers the run carries on without
        try:
            while 0 not in sup.results:
                sup.poll(0.05)
                _stop_if_fatal(sup)
                failed = sup.failed()
                if 0 not in failed:
                    for rank in sorted(failed - gone):
                        if lockstep:  # the group restarts from the last checkpoint (see run), or the run stops
                            cause = sup.blame(_name)  # the dead one, not one its death upset
                            raise type(cause)(f"{cause}{resume()}")
                        if not procs.replace(team, sup, rank, f"worker {rank - 1}", sink, restarts):
                            gone.add(rank)
                            given_up[rank] = 1
                if 0 in failed or len(gone) == workers:  # the server's death may reach the workers first
                    cause = sup.blame(_name)
                    if isinstance(cause, MainGuardError):  # the script to mend, not the workers
                        raise cause
                    if not str(cause).startswith("the parameter server"):
                        cause = type(cause)(f"all {workers} workers failed; {cause}")
                    raise type(cause)(f"{cause}{resume()}")
        except Terminated:
            given_up[0] = 1  # before the server's SIGTERM (procs.spawned sends it): a final checkpoint
            raise
        # late results; none will come from a worker the server dropped (one frozen says nothing)
        seen = sup.results[0]["attendance"] or Attendance()  # the server's: one frozen is alive, not failed
        dropped = {r + 1 for r in seen.failed_workers or []}
        sup.drain_until(lambda: len(set(sup.results) | sup.failed() | dropped) == world, procs.STOP_GRACE_S)
        _stop_if_fatal(sup)
    dead = sorted(sup.failed())
    chief = procs.unpack(sup.results[0], job)
    errors = {**(seen.worker_errors or {}), **{str(r - 1): sup.reason(r) for r in dead}}
    chief.attendance = Attendance(
        samples_per_worker=seen.samples_per_worker,
        restarts=restarts,
        failed_workers=sorted({r - 1 for r in dead} | set(seen.failed_workers or [])),
        worker_errors=errors or None,
    )
    others = [procs.unpack(sup.results[r], job) for r in range(1, world) if r in sup.results]
    if job.main is not None and others:  # the user's loop: what its first worker logged
        chief.evals = others[0].evals
        chief.final_test_accuracy, chief.final_test_loss = others[0].final_test_accuracy, others[0].final_test_loss
    return [chief] + others
