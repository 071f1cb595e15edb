"""The shared-memory topology: workers on one machine train models held in shared memory, and this
process watches and evaluates them.

The workers do not pause for evaluations: this process copies the shared weights every
``eval_every`` samples and evaluates the copies after training. With ``stop_at_target`` each copy
is evaluated at once, and the workers wait between two steps while it is taken and measured (the
training clock stops meanwhile), so the run stops at most one step per worker past the copy that
reached the target; under torchrun nothing holds the other machines' clusters, so every cluster
trains on, and the clock runs on, while rank 0 measures a copy. A worker that dies is
recorded in ``failed_workers``; the others carry on. Under torchrun (a topology with
``local_workers``) each process is one machine's cluster of local workers, and what links the
clusters (a token ring, say) comes from the topology's ``link``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import logging
import time
from collections.abc import Iterator
from multiprocessing.connection import Connection
from multiprocessing.synchronize import Event
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist

from distsgd.algorithms.base import Algorithm, Link, SharedMemory, SharedSeat
from distsgd.checkpoint import (
    CHECKPOINT_DIR,
    COORDINATOR,
    commit_checkpoint,
    commit_coordinator_only,
    load_worker_state,
    restore_shared,
    save_worker_state,
    scatter,
)
from distsgd.config import RunConfig, checkpoint_record
from distsgd.data.partition import samples_per_epoch
from distsgd.errors import ConfigError, MainGuardError, Terminated, WorkerError
from distsgd.launch import procs
from distsgd.launch.environment import formed_group
from distsgd.launch.group import gather_results
from distsgd.launch.rendezvous import formed_backend, launcher_group, place
from distsgd.metrics import NullSink, Sink
from distsgd.models import build_model
from distsgd.train import device
from distsgd.train.context import Attendance, Figures, Job, WorkerContext, WorkerResult
from distsgd.train.evaluate import Watcher
from distsgd.train.graphs import graphs_refusal
from distsgd.train.loop import run_worker

log = logging.getLogger(__name__)


def _shared(algo_cls: type[Algorithm]) -> SharedMemory:
    assert isinstance(algo_cls.topology, SharedMemory)  # the launcher picked this module by its kind
    return algo_cls.topology


def plan(cfg: RunConfig, algo_cls: type[Algorithm], torchrun: bool) -> RunConfig:
    """Under torchrun, only an algorithm whose clusters can be linked across machines runs (one
    cluster of ``local_workers`` per process), with gloo."""
    if not torchrun:
        return cfg
    per_process = _shared(algo_cls).local_workers(cfg)
    if per_process is None:
        raise ConfigError(
            f"{cfg.algo} shares memory between the processes of one machine; run it in one process with "
            f"--workers N, not under torchrun or Ray Train"
        )
    if formed_group():
        cfg = formed_backend(cfg)
    if cfg.backend not in ("auto", "gloo"):
        raise ConfigError(f"{cfg.algo} passes its token between machines with gloo: use --backend gloo (or auto)")
    cfg = cfg.replace(backend="gloo")
    if cfg.checkpoint_period is not None or cfg.resume:
        raise ConfigError(
            f"checkpoints of {cfg.algo} across machines are not supported yet: checkpoint it on one "
            f"machine (--workers N), or let torchrun restart it from scratch"
        )
    return cfg.replace(workers=place()[1] * per_process)


def run(job: Job, algo_cls: type[Algorithm], sink: Sink, torchrun: bool) -> list[WorkerResult]:
    if torchrun:
        return _run_torchrun(job, algo_cls, sink)
    return Machine(job, algo_cls, sink).run()


def _entry(
    slot: int,
    world: int,
    job: Job,
    algo_cls: type[Algorithm],
    seat: SharedSeat,
    go: Event,
    out: Connection,
    first_rank: int,
    data_world: int,
    replacement: bool = False,
    threaded: bool = False,
) -> None:
    """The body of a worker that trains a model held in shared memory. ``slot`` is its place on
    this machine; it reads data shard ``first_rank + slot`` of ``data_world``. ``threaded``: a
    thread of the launcher, on a CUDA stream of its own (the process's settings are the launcher's)."""
    q = procs.Outbox(out)
    if not threaded:
        procs.begin_worker(f"worker {first_rank + slot}", slot, world, job.cfg.quiet)

    def start_together() -> None:
        q.put(("ready", slot, None))
        if not go.wait(job.cfg.timeout_s):
            raise TimeoutError(f"no start signal from the launcher within {job.cfg.timeout_s:.0f} s")

    def checkpointed(seq: int, samples: int) -> None:
        q.put(("checkpointed", slot, (seq, samples)))

    mine = dataclasses.replace(seat, slot=slot, start_together=start_together, checkpointed=checkpointed)
    ctx = WorkerContext(
        job,
        rank=first_rank + slot,
        world=data_world,
        sink=procs.QueueSink(q, slot),
        reports=True,
        evaluates=False,
        device=device.use(seat.device),
    )
    stream = torch.cuda.stream(torch.cuda.Stream(ctx.device)) if threaded and ctx.device.type == "cuda" else None
    with stream if stream is not None else contextlib.nullcontext():
        procs.report(q, slot, lambda: run_worker(ctx, algo_cls(job.cfg, mine), replacement=replacement))
    if seat.device.startswith("cuda") and not threaded:
        # what the launcher lent through CUDA IPC (the models, the data) is given back before this
        # process ends: it ends with os._exit, which frees nothing, and the launcher then warns
        # "Producer process has been terminated before all shared CUDA tensors released"
        del ctx, mine
        seat.states.clear()
        job.data = None  # type: ignore[assignment]  # this process's last use of it is over
        gc.collect()
        torch.cuda.synchronize()


class Machine:
    """This machine's shared models, its workers, and the watch over them. With ``link`` (under
    torchrun) it is one cluster among several: its workers read shards ``first_rank ..`` of
    ``data_world``, and the link joins its model to the other machines'."""

    def __init__(
        self,
        job: Job,
        algo_cls: type[Algorithm],
        sink: Sink,
        *,
        first_rank: int = 0,
        data_world: int | None = None,
        link: Callable[[torch.nn.Module, SharedSeat], Link] | None = None,
        evaluates: bool = True,
        machines: int = 1,
    ) -> None:
        cfg, dataset = job.cfg, job.data
        self.job, self.cfg, self.algo_cls, self.dataset, self.sink = job, cfg, algo_cls, dataset, sink
        self.topology = topology = _shared(algo_cls)
        self.first_rank, self.data_world = first_rank, data_world or cfg.workers
        self.own = job.main is not None  # the user's loop evaluates what it wants (its rank 0 logs it)
        self.evaluates = evaluates and not self.own
        # On a GPU this process owns the shared models and the data in GPU memory (its workers map them
        # through CUDA IPC, and it keeps them alive); the fork server, started fresh, has no CUDA.
        self.device = device.resolve(cfg.device, 0)
        dataset = dataset.to(self.device).share_memory_()
        self.job = job = job.replace(data=dataset)
        self.dataset = dataset
        self.models = [
            build_model(job.model, dataset.input_shape, dataset.num_classes, cfg.init, seed=cfg.seed).to(self.device)
            for _ in range(topology.models(cfg))
        ]
        self.counts = torch.zeros(cfg.workers, dtype=torch.int64)
        saved = load_worker_state(Path(cfg.resume), COORDINATOR, job.resume_from) if cfg.resume else None
        if saved is not None:  # the shared models and counters of the checkpoint, checked
            restore_shared(saved, self.models, self.counts)
        for m in self.models:
            m.share_memory()
        self.states = [m.state_dict() for m in self.models]
        mpc = procs.mp_context()
        self.go = mpc.Event()
        self.handles = SharedSeat(
            states=self.states,
            counts=self.counts.share_memory_(),
            stop=torch.zeros(1, dtype=torch.int8).share_memory_(),
            hold=torch.full((1 + cfg.workers,), -1, dtype=torch.int64).share_memory_()
            if job.may_stop and link is None and self.evaluates
            else None,
            lock=topology.lock(cfg, mpc),
            machines=machines,
            device=str(self.device),
            extras=topology.extras(cfg, mpc, self.models),
        )
        self.link = link(self.models[0], self.handles) if link is not None else None
        # Hogwild! workers sharing one GPU: threads of this process, each step a CUDA graph (when the
        # settings allow one) replayed on the thread's own stream; processes' kernels would take turns
        self.threaded = link is None and topology.threads(cfg, own_loop=self.own)
        self.handles.threads = self.threaded
        graphs = (
            self.threaded and self.device.type == "cuda" and not cfg.cuda_graphs and graphs_refusal(cfg, "cuda") is None
        )
        self.worker_job = job.replace(cfg=cfg.replace(cuda_graphs=True)) if graphs else job
        per_epoch = samples_per_epoch(dataset.n_train, self.data_world, cfg.partition)
        self.watcher = Watcher(job, per_epoch, sink, self.current_state, device=self.device)
        self.supervisor: procs.Supervisor | None = None
        if self.handles.hold is not None:  # the copy that may stop the run: no worker steps past it
            self.watcher.hold, self.watcher.count = self._held, self.samples
            self._hold_at_next()
        if saved is not None:
            scatter({"watcher": self.watcher}, saved)
        self.saved: dict[int, dict[int, int]] = {}  # checkpoint seq -> {slot: its samples when it saved}
        self.restarts: list[dict[str, Any]] = []
        self.gone: set[int] = set()  # failed slots the run carries on without

    def current_state(self) -> dict[str, torch.Tensor]:
        """A copy of the model the algorithm returns (hogwild++: the clusters' average), in host
        memory: the watcher keeps one per evaluation point, which would otherwise fill the GPU."""
        return {k: v.detach().to("cpu", copy=True) for k, v in self.topology.combine(self.states).items()}

    def samples(self) -> int:
        return self.link.global_samples() if self.link is not None else int(self.handles.counts.sum())

    def relay(self, event: dict[str, Any]) -> None:
        """A worker's progress line, with all workers' samples and the launcher's clock."""
        if event.get("event") == "progress":
            done, elapsed = self.samples(), self.watcher.clock.elapsed()
            self.sink.emit(
                {
                    **event,
                    "samples": done,
                    "train_wall_s": elapsed,
                    "samples_per_s": done / elapsed if elapsed > 0 else 0.0,
                }
            )
        else:  # what a user's loop logged
            self.sink.emit(event)

    def run(self) -> list[WorkerResult]:
        try:
            return self._run()
        except Terminated:  # SIGTERM or SIGUSR1: the workers have been stopped
            self._final_checkpoint()
            raise

    def _run(self) -> list[WorkerResult]:
        cfg, world = self.cfg, self.cfg.workers
        with procs.spawned(
            cfg,
            _entry,
            [("worker", r) for r in range(world)],
            lambda r, out, again: (
                r,
                world,
                self.worker_job,
                self.algo_cls,
                self.handles,
                self.go,
                out,
                self.first_rank,
                self.data_world,
                again,
                self.threaded,
            ),
            # workers given the models through CUDA IPC free them as they exit: a SIGTERM would skip that
            leave_s=procs.STOP_GRACE_S if self.device.type == "cuda" and not self.threaded else 0.0,
            threads=self._stop_threads if self.threaded else None,
        ) as team:
            sup = self.supervisor = procs.Supervisor(team.procs, team.inbox, self.relay, own=self.own)
            self._start_together(sup)
            self._watch(sup, team)
            failed = sup.failed()
            if len(failed) == world:
                first = min(failed)
                if sup.reason(first) == procs.MAIN_GUARD:  # the script to mend, not the workers
                    raise MainGuardError(procs.MAIN_GUARD)
                raise WorkerError(f"all {world} workers failed; worker {self.first_rank + first}: {sup.reason(first)}")
            total = self.link.finish() if self.link is not None else int(self.handles.counts.sum())
            train_wall_s, evals, final, total = (
                self.watcher.finish(total)
                if self.evaluates
                else (self.watcher.clock.elapsed(), [], self.current_state(), total)
            )
        return self._results(sup, total, train_wall_s, evals, final)

    def _stop_threads(self) -> None:
        """Stop worker threads (a thread cannot be killed): the stop flag, read before every step."""
        self.handles.stop.fill_(1)

    def _start_together(self, sup: procs.Supervisor) -> None:
        """Wait until every worker has built its model and optimiser (or failed), and under torchrun
        every other machine's too, then say go."""
        ready: set[int] = set()
        deadline = time.monotonic() + self.cfg.timeout_s
        while len(ready | sup.failed()) < self.cfg.workers:
            if time.monotonic() > deadline:
                missing = sorted(set(range(self.cfg.workers)) - ready)
                raise WorkerError(f"workers {missing} did not start within {self.cfg.timeout_s:.0f} s")
            message = sup.poll(0.1)
            if message is not None and message[0] == "ready":
                ready.add(message[1])
        if self.link is not None:  # every machine's clusters start together, on the chief's clock
            dist.barrier()
        self.go.set()
        self.watcher.start()
        if self.link is not None:
            self.link.start()

    def _watch(self, sup: procs.Supervisor, team: procs.Team) -> None:
        """Until every worker is done or dead: relay progress, copy the model at evaluation points,
        commit checkpoints, and start replacements for dead workers (``--restart-workers``). A
        user's loop that failed in a worker (not a process that died) ends the run."""
        threads = torch.get_num_threads()
        torch.set_num_threads(1)  # evaluations during training share the cores with the workers
        try:
            while len(sup.results) + len(sup.failed()) < self.cfg.workers:
                self._handle(sup, sup.poll(0.01))
                fatal = sup.fatal_error(lambda slot: f"worker {self.first_rank + slot}")
                if fatal is not None:
                    raise fatal
                for slot in sorted(sup.failed() - self.gone):
                    if self.handles.stop[0] or not procs.replace(
                        team, sup, slot, f"worker {self.first_rank + slot}", self.sink, self.restarts
                    ):
                        self.gone.add(slot)
                        self._commit_whole(sup)
                if self.evaluates and self.watcher.observe(self.samples()):
                    if self.link is not None:
                        self.link.request_stop()
                    self.handles.stop.fill_(1)
        finally:
            torch.set_num_threads(threads)

    def _handle(self, sup: procs.Supervisor, message: tuple[str, int, Any] | None) -> None:
        if message is not None and message[0] == "checkpointed":
            seq, samples = message[2]
            self.saved.setdefault(seq, {})[message[1]] = samples
            self._commit_whole(sup)

    def _hold_at_next(self) -> None:
        """The workers wait at the watcher's next evaluation point (--stop-at-target)."""
        assert self.handles.hold is not None
        nxt = self.watcher.at.next
        self.handles.hold[0] = nxt if nxt is not None else -1

    @contextlib.contextmanager
    def _held(self) -> Iterator[None]:
        """Every live worker waits between two steps (or is done) while the body runs: the copy
        evaluated is the model at the samples counted, and none trains on while it is measured.
        Waits at most --timeout for the workers to get there (each stops after the step that
        reaches the evaluation point, or the one it was taking then); then they go on to the next."""
        hold, sup = self.handles.hold, self.supervisor
        assert hold is not None and sup is not None
        flags = hold.numpy()
        try:
            deadline = time.monotonic() + self.cfg.timeout_s
            while time.monotonic() < deadline:
                live = set(range(self.cfg.workers)) - sup.failed() - set(sup.results)
                if all(flags[1 + s] for s in live):
                    break
                self._handle(sup, sup.poll(0.0005))
            yield
            if self.watcher.reached is not None:  # the copy reached the target: the workers stop before
                # they are let go, or a loaded machine's launcher let them train on until it said stop
                # (18 steps past the copy in one test under 4 test processes on 2 cores)
                self.handles.stop.fill_(1)
        finally:
            self._hold_at_next()

    def _commit_whole(self, sup: procs.Supervisor) -> None:
        """Commit the newest checkpoint every live worker has saved its part of, with the shared
        models, counters and evaluations."""
        live = set(range(self.cfg.workers)) - sup.failed()
        whole = [seq for seq, slots in self.saved.items() if set(slots) >= live]
        if not whole or not self.cfg.out:
            return
        seq, ckpt_dir = max(whole), Path(self.cfg.out) / CHECKPOINT_DIR
        counts = self.handles.counts.clone()
        for slot, samples in self.saved[seq].items():  # what each worker had when it saved its part
            counts[slot] = samples
        state = {
            "models": [{k: v.detach().clone() for k, v in st.items()} for st in self.states],
            "counts": counts,
            "watcher": self.watcher.state_dict(),
        }
        save_worker_state(ckpt_dir, seq, COORDINATOR, state)
        # the samples its resume goes on from: each worker's when it saved its part (until 2026-12-01 the
        # count at this commit, past theirs, which a short run's checkpoints all gave as its final count)
        samples = self.samples() if self.link is not None else int(counts.sum())
        commit_checkpoint(
            ckpt_dir,
            seq,
            self.cfg.workers,
            {"samples": samples, **checkpoint_record(self.cfg, self.dataset)},
            ranks=sorted(self.first_rank + s for s in self.saved[seq]),
            coordinator=True,
        )
        self.saved = {s: slots for s, slots in self.saved.items() if s > seq}
        self.sink.emit(
            {"event": "checkpoint", "seq": seq, "samples": samples, "train_wall_s": self.watcher.clock.elapsed()}
        )

    def _final_checkpoint(self) -> None:
        """A signal stopped the run, and its workers: the shared models, each worker's samples and
        the evaluations saved as a checkpoint of this launcher's own, numbered past every one
        before, with no worker's part. ``--resume`` then starts every worker as one that replaces
        a dead worker, from its samples (its optimiser's momentum starts again): nothing trained
        is lost. A worker stopped in the middle of an update leaves it half applied, as Hogwild!
        allows any update to be read half applied. Not for a user's loop (its
        ``run.checkpoint(**state)`` state is in the workers' parts, which a resume would drop),
        nor before the workers were told to go (nothing trained yet)."""
        if not self.cfg.out or self.link is not None or self.own or not self.go.is_set():
            return
        out = Path(self.cfg.out)
        counts = self.handles.counts.clone()
        state = {
            "models": [{k: v.detach().clone() for k, v in st.items()} for st in self.states],
            "counts": counts,
            "watcher": self.watcher.state_dict(),
        }
        samples = int(counts.sum())
        seq = commit_coordinator_only(
            out, state, self.cfg.workers, {"samples": samples, **checkpoint_record(self.cfg, self.dataset)}, self.saved
        )
        if seq is None:
            return
        self.sink.emit(
            {"event": "checkpoint", "seq": seq, "samples": samples, "train_wall_s": self.watcher.clock.elapsed()}
        )

    def _results(
        self,
        sup: procs.Supervisor,
        total: int,
        train_wall_s: float,
        evals: list[dict[str, Any]],
        final: dict[str, torch.Tensor],
    ) -> list[WorkerResult]:
        counts, first, failed = self.handles.counts, self.first_rank, sorted(sup.failed())
        model = build_model(self.job.model, self.dataset.input_shape, self.dataset.num_classes, self.cfg.init)
        model.load_state_dict(final)  # what was evaluated last: the models now, or the copy that reached the target
        figures = self.topology.figures([sup.results[r]["figures"] for r in sorted(sup.results)], self.handles.extras)
        if self.link is not None:
            figures = self.link.figures(figures)
        attendance = Attendance(
            samples_per_worker=[int(c) for c in counts],
            failed_workers=[first + r for r in failed],
            restarts=self.restarts,
            worker_errors={str(first + r): sup.reason(r) for r in failed} if failed else None,
        )
        if self.own and sup.results:  # the user's loop: what its lowest worker logged
            evals = sup.results[min(sup.results)]["evals"]
        last = evals[-1] if evals else {}
        # where each worker trained (its device, its GPU): this process only holds the shared models
        where = {r: sup.results[r].get("where") for r in sup.results}
        chief = WorkerResult(
            rank=first,
            samples=int(counts[0]),
            global_samples=total,
            train_wall_s=train_wall_s,
            evals=evals,
            final_test_accuracy=last.get("test_accuracy"),
            final_test_loss=last.get("test_loss"),
            model=model,
            figures=figures,
            attendance=attendance,
            where=where.get(0) or next(iter(where.values()), None),
            data_len=next((d["data_len"] for d in sup.results.values() if d.get("data_len")), None),
            steps=sup.results.get(0, {}).get("steps"),
            checkpoints=sup.results.get(0, {}).get("checkpoints"),
        )
        others = [
            WorkerResult(
                rank=first + r,
                samples=int(counts[r]),
                global_samples=total,
                train_wall_s=train_wall_s,
                evals=[],
                final_test_accuracy=None,
                final_test_loss=None,
                model=None,
                figures=sup.results.get(r, {}).get("figures", Figures()),
                where=where.get(r),
                steps=sup.results.get(r, {}).get("steps"),
                checkpoints=sup.results.get(r, {}).get("checkpoints"),
            )
            for r in range(1, self.cfg.workers)
        ]
        return [chief] + others


def _run_torchrun(job: Job, algo_cls: type[Algorithm], sink: Sink) -> list[WorkerResult]:
    """Across machines: this torchrun process is one cluster of ``local_workers`` workers; the
    topology's link (a token ring over the process group) joins the clusters. Rank 0 evaluates
    (its own cluster's model during training, the average of all at the end) and gets every
    worker's figures."""
    cfg, topology = job.cfg, _shared(algo_cls)
    rank, n = place()
    size = topology.local_workers(cfg)
    assert size is not None  # plan refused a topology without one
    node = topology.node_algorithm(algo_cls)
    # --max-samples stays the run's: workers count every cluster's samples
    local = cfg.replace(workers=size, options={k: v for k, v in cfg.options.items() if k in node.Options.names()})
    if rank != 0:  # only rank 0 evaluates and writes the run directory
        local = local.replace(out=None, stop_at_target=False)

    def link(model: torch.nn.Module, seat: SharedSeat) -> Link:
        return topology.link(cfg, rank, n, model, seat)

    with launcher_group(cfg):
        mine = Machine(
            job.replace(cfg=local, callbacks=job.callbacks if rank == 0 else ()),
            node,
            sink if rank == 0 else NullSink(),
            first_rank=rank * size,
            data_world=n * size,
            link=link,
            evaluates=rank == 0,
            machines=n,
        ).run()
        gathered = gather_results(mine, rank, n)
    if rank != 0:
        return mine
    results = mine + [r for node in gathered[1:] for r in node]
    chiefs = [node[0] for node in gathered]
    results[0].figures = topology.merge_nodes([c.figures for c in chiefs])
    # the shared-memory topologies' figures (HogwildFigures) have this field; the launcher knows no algorithm
    results[0].figures.dataset_shared = all(  # type: ignore[attr-defined]
        getattr(c.figures, "dataset_shared", False) for c in chiefs
    )
    attendances = [c.attendance or Attendance() for c in chiefs]
    errors = {k: v for a in attendances for k, v in (a.worker_errors or {}).items()}
    results[0].attendance = Attendance(
        samples_per_worker=[c for a in attendances for c in (a.samples_per_worker or [])],
        failed_workers=sorted(r for a in attendances for r in (a.failed_workers or [])),
        restarts=[r for a in attendances for r in (a.restarts or [])],
        worker_errors=errors or None,
    )
    return results
