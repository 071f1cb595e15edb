"""Starting, joining and supervising worker processes.

Two ways in, one training loop:

- **Local** (``run_local``): ``--workers N`` spawns N processes on this machine. They form a
  process group over a free port on 127.0.0.1 (or ``--init-method``), train, and send their
  results back on a queue. Rank 0 also sends its metrics events, which this process (the one
  collector) writes to ``metrics.jsonl`` and the progress display. If a worker raises or dies,
  the others are stopped at once and the run fails with one line naming that worker. No worker
  outlives the run: they are reaped on success, failure and Ctrl-C.
- **torchrun** (``run_torchrun``): when torchrun set RANK, WORLD_SIZE, MASTER_ADDR and
  MASTER_PORT, this process *is* one worker. It joins the group torchrun formed (``env://``);
  rank 0 gathers the others' figures and writes the run directory.
"""

from __future__ import annotations

import io
import logging
import os
import queue
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from distsgd.comm.group import LOOPBACK, free_port, init_group, leave_group
from distsgd.config import RunConfig
from distsgd.data import Dataset
from distsgd.errors import WorkerError
from distsgd.metrics import NullSink, Sink
from distsgd.models import ModelSpec, build_model
from distsgd.train.loop import WorkerContext, WorkerResult, run_worker

log = logging.getLogger(__name__)

STOP_GRACE_S = 5.0


class QueueSink:
    """Forwards a worker's metrics events to the collector in the launching process."""

    def __init__(self, q: Any, rank: int = 0) -> None:
        self.q = q
        self.rank = rank

    def emit(self, event: dict[str, Any]) -> None:
        self.q.put(("event", self.rank, event))


def _error_text(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__


def _pack(result: WorkerResult) -> dict[str, Any]:
    """A WorkerResult as plain data; the model travels as torch.save bytes."""
    state = None
    if result.model is not None:
        buffer = io.BytesIO()
        torch.save(result.model.state_dict(), buffer)
        state = buffer.getvalue()
    fields = {k: v for k, v in vars(result).items() if k != "model"}
    return {**fields, "model_state": state}


def _unpack(payload: dict[str, Any], cfg: RunConfig, spec: ModelSpec, dataset: Dataset) -> WorkerResult:
    state = payload.pop("model_state")
    model = None
    if state is not None:
        model = build_model(spec, dataset.input_shape, dataset.num_classes, cfg.init)
        model.load_state_dict(torch.load(io.BytesIO(state), weights_only=True))
    return WorkerResult(model=model, **payload)


def _worker_entry(rank: int, world: int, cfg: RunConfig, algo_name: str, spec: ModelSpec, dataset: Dataset,
                  init_method: str, q: Any) -> None:
    """The body of a spawned worker process."""
    logging.basicConfig(level=logging.WARNING, format=f"worker {rank}: %(levelname)s: %(message)s")
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world))
    from distsgd.algorithms import registry

    try:
        init_group(cfg, rank, world, init_method)
        algo = registry.get(algo_name)(cfg)
        ctx = WorkerContext(cfg=cfg, dataset=dataset, model_spec=spec, rank=rank, world=world,
                            sink=QueueSink(q) if rank == 0 else NullSink(), reports=rank == 0)
        result = run_worker(ctx, algo)
        q.put(("result", rank, _pack(result)))
    except KeyboardInterrupt:
        q.put(("error", rank, "interrupted"))
        raise SystemExit(130) from None
    except BaseException as exc:  # report anything, in one line, then exit non-zero
        q.put(("error", rank, _error_text(exc)))
        raise SystemExit(1) from None
    finally:
        leave_group()


def run_local(cfg: RunConfig, algo_cls: type, spec: ModelSpec, dataset: Dataset, sink: Sink) -> list[WorkerResult]:
    """Spawn ``cfg.workers`` processes on this machine and supervise them to the end."""
    world = cfg.workers
    init_method = cfg.init_method or f"tcp://{LOOPBACK}:{free_port()}"
    dataset.share_memory_()  # every worker reads one copy
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = []
    try:
        for rank in range(world):
            p = ctx.Process(target=_worker_entry, name=f"distsgd-worker-{rank}",
                            args=(rank, world, cfg, algo_cls.name, spec, dataset, init_method, q))
            p.start()
            procs.append(p)
        payloads = _supervise(procs, q, sink)
    finally:
        stop_all(procs)
        q.close()
    return [_unpack(payloads[r], cfg, spec, dataset) for r in range(world)]


def _supervise(procs: list[Any], q: Any, sink: Sink) -> dict[int, dict[str, Any]]:
    """Relay events until every worker has reported; fail fast when one fails."""
    payloads: dict[int, dict[str, Any]] = {}
    while len(payloads) < len(procs):
        try:
            kind, rank, body = q.get(timeout=0.2)
        except queue.Empty:
            if any(p.exitcode is not None and r not in payloads for r, p in enumerate(procs)):
                raise _diagnose(procs, q, sink, payloads, {})
            continue
        if kind == "event":
            sink.emit(body)
        elif kind == "result":
            payloads[rank] = body
        elif kind == "error":
            raise _diagnose(procs, q, sink, payloads, {rank: body})
    return payloads


# What a worker says when a peer, not itself, went wrong.
_PEER_SYMPTOMS = ("Connection reset by peer", "Connection closed by peer", "Socket closed", "Broken pipe",
                  "Timed out", "timed out", "NCCL communicator was aborted")


def _diagnose(procs: list[Any], q: Any, sink: Sink, payloads: dict[int, dict[str, Any]],
              errors: dict[int, str], wait_s: float = 1.0) -> WorkerError:
    """Name the worker that caused a failure, not one that merely lost its connection to it.

    When one worker dies, its peers soon fail too, with "connection reset" errors that may
    arrive first. So: listen a moment longer, then blame, in order, a worker that died without
    saying why (killed), a worker whose error is not a peer symptom, and the first error heard.
    """
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        try:
            kind, rank, body = q.get(timeout=0.05)
        except queue.Empty:
            continue
        if kind == "error":
            errors.setdefault(rank, body)
        elif kind == "result":
            payloads[rank] = body
        elif kind == "event":
            sink.emit(body)
    silent = [r for r, p in enumerate(procs)
              if p.exitcode is not None and p.exitcode != 0 and r not in errors and r not in payloads]
    if silent:
        return WorkerError(f"worker {silent[0]} failed: {_describe_exit(procs[silent[0]].exitcode)}")
    causes = [r for r, text in errors.items() if not any(s in text for s in _PEER_SYMPTOMS)]
    rank = causes[0] if causes else next(iter(errors), None)
    if rank is None:
        rank = next(r for r, p in enumerate(procs) if p.exitcode is not None and r not in payloads)
        return WorkerError(f"worker {rank} failed: {_describe_exit(procs[rank].exitcode)}")
    return WorkerError(f"worker {rank} failed: {errors[rank]}")


def _describe_exit(code: int | None) -> str:
    if code is None:
        return "stopped"
    if code < 0:
        import signal

        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exited with status {code}"


def stop_all(procs: list[Any], grace_s: float = STOP_GRACE_S) -> None:
    """Terminate, then kill, every process still running; reap them all."""
    for p in procs:
        if p.is_alive():
            p.terminate()
    deadline = time.monotonic() + grace_s
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
        if p.is_alive():
            p.kill()
            p.join(1.0)


def run_torchrun(cfg: RunConfig, algo_cls: type, spec: ModelSpec, dataset: Dataset, sink: Sink) -> list[WorkerResult]:
    """Be one worker of the group torchrun formed. Rank 0 gets every worker's result."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    init_group(cfg, rank, world, "env://")
    try:
        ctx = WorkerContext(cfg=cfg, dataset=dataset, model_spec=spec, rank=rank, world=world,
                            sink=sink if rank == 0 else NullSink(), reports=rank == 0)
        mine = run_worker(ctx, algo_cls(cfg))
        light = {k: v for k, v in vars(mine).items() if k != "model"}
        gathered: list[Any] = [None] * world if rank == 0 else []
        dist.gather_object(light, gathered if rank == 0 else None, dst=0)
    finally:
        leave_group()
    if rank != 0:
        return [mine]
    return [mine] + [WorkerResult(model=None, **g) for g in gathered[1:]]


def _shared_entry(rank: int, world: int, cfg: RunConfig, algo_name: str, spec: ModelSpec, dataset: Dataset,
                  shared: dict[str, Any], q: Any) -> None:
    """The body of a worker that trains a model held in shared memory (Hogwild!)."""
    logging.basicConfig(level=logging.WARNING, format=f"worker {rank}: %(levelname)s: %(message)s")
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world))
    from distsgd.algorithms import registry

    try:
        ctx = WorkerContext(cfg=cfg, dataset=dataset, model_spec=spec, rank=rank, world=world,
                            sink=QueueSink(q, rank), reports=True, evaluates=False, state={**shared, "queue": q})
        result = run_worker(ctx, registry.get(algo_name)(cfg))
        q.put(("result", rank, _pack(result)))
    except KeyboardInterrupt:
        raise SystemExit(130) from None
    except BaseException as exc:
        q.put(("error", rank, _error_text(exc)))
        raise SystemExit(1) from None


def run_shared(cfg: RunConfig, algo_cls: type, spec: ModelSpec, dataset: Dataset, sink: Sink) -> list[WorkerResult]:
    """Start ``cfg.workers`` processes that all train one model in shared memory; watch and evaluate it.

    The workers never pause: this process copies the shared weights every ``eval_every``
    samples and evaluates the copies after training (at once with ``stop_at_target``). A worker
    that dies is recorded in ``failed_workers``; the others carry on.
    """
    from distsgd.data.partition import shard_size
    from distsgd.train.evaluate import evaluate

    world = cfg.workers
    dataset.share_memory_()
    model = build_model(spec, dataset.input_shape, dataset.num_classes, cfg.init, seed=cfg.seed)
    model.share_memory()
    mpc = mp.get_context("spawn")
    shared = {"shared_state": model.state_dict(keep_vars=False), "counts": torch.zeros(world, dtype=torch.int64).share_memory_(),
              "stop": mpc.Event(), "go": mpc.Event(), "lock": mpc.Lock() if cfg.hogwild_lock else None}
    counts = shared["counts"]
    q = mpc.Queue()
    procs: list[Any] = []
    payloads: dict[int, dict[str, Any]] = {}
    failed: dict[int, str] = {}
    global_per_epoch = shard_size(len(dataset.y_train), world, cfg.partition) * world
    eval_every = cfg.eval_every or global_per_epoch
    snapshots: list[tuple[int, float, dict[str, torch.Tensor]]] = []
    evals: list[dict[str, Any]] = []
    threads = torch.get_num_threads()

    def evaluate_now(samples: int, train_s: float, state: dict[str, torch.Tensor]) -> dict[str, Any]:
        probe = build_model(spec, dataset.input_shape, dataset.num_classes, cfg.init)
        probe.load_state_dict(state)
        acc, loss = evaluate(probe, dataset.x_test, dataset.y_test, cfg.eval_batch_size)
        event = {"event": "eval", "samples": samples, "epoch": round(samples / global_per_epoch, 4),
                 "train_wall_s": train_s, "test_accuracy": acc, "test_loss": loss}
        sink.emit(event)
        return event

    def handle(kind: str, rank: int, body: Any, clock: Any | None) -> None:
        if kind == "result":
            payloads[rank] = body
        elif kind == "error":
            failed.setdefault(rank, body)
        elif kind == "event" and clock is not None and body.get("event") == "progress":
            done = int(counts.sum())
            elapsed = clock.elapsed()
            sink.emit({**body, "samples": done, "train_wall_s": elapsed,
                       "samples_per_s": done / elapsed if elapsed > 0 else 0.0})

    def reap_exits() -> None:
        for r, p in enumerate(procs):
            if p.exitcode is not None and p.exitcode != 0 and r not in failed and r not in payloads:
                failed[r] = _describe_exit(p.exitcode)

    try:
        for rank in range(world):
            p = mpc.Process(target=_shared_entry, name=f"distsgd-worker-{rank}",
                            args=(rank, world, cfg, algo_cls.name, spec, dataset, shared, q))
            p.start()
            procs.append(p)
        ready: set[int] = set()
        deadline = time.monotonic() + cfg.timeout_s
        while len(ready) + len(failed) < world:  # everyone has built its model and optimiser
            if time.monotonic() > deadline:
                raise WorkerError(f"workers {sorted(set(range(world)) - ready)} did not start "
                                  f"within {cfg.timeout_s:.0f} s")
            try:
                kind, rank, body = q.get(timeout=0.1)
                if kind == "ready":
                    ready.add(rank)
                else:
                    handle(kind, rank, body, None)
            except queue.Empty:
                reap_exits()
        from distsgd.metrics import TrainClock

        clock = TrainClock()
        shared["go"].set()
        next_eval = eval_every
        while len(payloads) + len(failed) < world:
            try:
                kind, rank, body = q.get(timeout=0.01)
                handle(kind, rank, body, clock)
            except queue.Empty:
                reap_exits()
            done = int(counts.sum())
            if done >= next_eval:
                while next_eval <= done:
                    next_eval += eval_every
                state = {k: v.detach().clone() for k, v in model.state_dict().items()}
                if cfg.stop_at_target:
                    torch.set_num_threads(1)
                    event = evaluate_now(done, clock.elapsed(), state)
                    evals.append(event)
                    if cfg.target_accuracy is not None and event["test_accuracy"] >= cfg.target_accuracy:
                        shared["stop"].set()
                else:
                    snapshots.append((done, clock.elapsed(), state))
        train_wall_s = clock.elapsed()
    finally:
        stop_all(procs)
        q.close()
    if len(failed) == world:
        first = min(failed)
        raise WorkerError(f"all {world} workers failed; worker {first}: {failed[first]}")
    torch.set_num_threads(threads)
    for samples, train_s, state in snapshots:
        evals.append(evaluate_now(samples, train_s, state))
    total = int(counts.sum())
    if not evals or evals[-1]["samples"] != total:
        evals.append(evaluate_now(total, train_wall_s,
                                  {k: v.detach().clone() for k, v in model.state_dict().items()}))
    extra: dict[str, Any] = {}
    for r in sorted(payloads):
        extra = {**payloads[r]["extra"], **extra}
    extra["dataset_shared"] = all(p["extra"].get("dataset_shared", False) for p in payloads.values())
    extra["samples_per_worker"] = [int(c) for c in counts]
    extra["failed_workers"] = sorted(failed)
    if failed:
        extra["worker_errors"] = {str(r): failed[r] for r in sorted(failed)}
    final = evals[-1]
    chief = WorkerResult(rank=0, samples=int(counts[0]), global_samples=total, train_wall_s=train_wall_s, evals=evals,
                         final_test_accuracy=final["test_accuracy"], final_test_loss=final["test_loss"],
                         model=model, extra=extra)
    others = [WorkerResult(rank=r, samples=int(counts[r]), global_samples=total, train_wall_s=train_wall_s, evals=[],
                           final_test_accuracy=None, final_test_loss=None, model=None,
                           extra=payloads.get(r, {}).get("extra", {})) for r in range(1, world)]
    return [chief] + others


__all__ = ["run_local", "run_torchrun", "run_shared", "stop_all"]
