"""Starting, joining and supervising worker processes.

Two ways in, one training loop:

- **Local** (``run_local``): ``--workers N`` starts N processes on this machine (forked from a
  fork server that has imported torch once, see ``mp_context``). They form a
  process group over a free port on 127.0.0.1 (or ``--init-method``), train, and send their
  results back, each on its own pipe. Rank 0 also sends its metrics events, which this process (the one
  collector) writes to ``metrics.jsonl`` and the progress display. If a worker raises or dies,
  the others are stopped at once and the run fails with one line naming that worker. No worker
  outlives the run: they are reaped on success, failure and Ctrl-C.
- **torchrun** (``run_torchrun``): when torchrun set RANK, WORLD_SIZE, MASTER_ADDR and
  MASTER_PORT, this process *is* one worker. It joins the group torchrun formed (``env://``);
  rank 0 gathers the others' figures and writes the run directory.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import queue
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from distsgd.comm.group import LOOPBACK, free_port, init_group, init_torchrun_group, leave_group
from distsgd.config import RunConfig
from distsgd.data import Dataset
from distsgd.errors import WorkerError
from distsgd.metrics import NullSink, Sink
from distsgd.models import ModelSpec, build_model
from distsgd.train.loop import WorkerContext, WorkerResult, run_worker

log = logging.getLogger(__name__)

STOP_GRACE_S = 5.0


@contextlib.contextmanager
def _child_env(**values: str) -> Iterator[None]:
    """Set environment variables for the processes spawned inside the block (unless already set)."""
    saved = {k: os.environ.get(k) for k in values}
    for k, v in values.items():
        os.environ.setdefault(k, v)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def mp_context() -> Any:
    """How worker processes start: forked from a fork server on Linux, spawned elsewhere.

    The fork server (one per launching process, started on first use and kept until it exits)
    has imported torch and distsgd once, so each worker starts in a fraction of a second instead
    of importing them again (3.5 s of CPU each). Like spawn, and unlike a plain fork, no worker
    inherits the launcher's threads or state; each gets the launcher's environment as it is when
    the worker starts (``_bootstrap``).
    """
    if not sys.platform.startswith("linux") or "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")  # macOS: forking after system frameworks load is unsafe
    from multiprocessing import forkserver

    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["distsgd._preload"])
    # The server starts ignoring Ctrl-C (the launcher handles it and stops the workers; otherwise
    # a Ctrl-C while the server imports torch prints its traceback). Workers restore the handler.
    with _child_env(TORCH_CPP_LOG_LEVEL="ERROR"), _sigint_ignored():  # TensorPipe logs closed pipes
        forkserver.ensure_running()
    global _WARM_SERVER
    server = getattr(forkserver._forkserver, "_forkserver_pid", None)
    if server != _WARM_SERVER:
        # Wait until the server has imported everything: a worker asked for before then would be
        # forked later, and a Ctrl-C meanwhile would leave it to start after the launcher is gone.
        p = ctx.Process(target=_nothing, name="distsgd-warmup")
        p.start()
        p.join()
        _WARM_SERVER = server
    return ctx


_WARM_SERVER: int | None = None


def _nothing() -> None:
    pass


@contextlib.contextmanager
def _sigint_ignored() -> Iterator[None]:
    import signal

    try:
        old = signal.signal(signal.SIGINT, signal.SIG_IGN)
    except ValueError:  # not the main thread: leave the handler alone
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, old)


def _bootstrap(env: dict[str, str], target: Any, args: tuple) -> None:
    """A worker's first step: take the launcher's environment as of now and Python's usual Ctrl-C
    handler (the fork server ignores Ctrl-C), then run ``target``."""
    import signal

    signal.signal(signal.SIGINT, signal.default_int_handler)
    os.environ.clear()
    os.environ.update(env)
    _exit_with_launcher()
    target(*args)


def _exit_with_launcher() -> None:
    """End this worker when its launcher dies (SIGKILL, OOM killer): no one would collect its
    result, and it would otherwise train on alone."""
    import threading

    launcher = mp.parent_process()
    if launcher is None:
        return

    def watch() -> None:
        launcher.join()
        os._exit(1)

    threading.Thread(target=watch, name="distsgd-launcher-watch", daemon=True).start()


def record_workers(cfg: RunConfig, procs: list[Any], roles: list[tuple[str, int]]) -> None:
    """While the run is live, ``<out>/workers.json`` lists every process: {role, rank, pid, host}."""
    if not cfg.out:
        return
    import json
    import socket

    from distsgd.checkpoint import atomic_write_bytes

    entries = [{"role": role, "rank": rank, "pid": p.pid, "host": socket.gethostname()}
               for (role, rank), p in zip(roles, procs)]
    entries.insert(0, {"role": "launcher", "rank": None, "pid": os.getpid(), "host": socket.gethostname()})
    atomic_write_bytes(Path(cfg.out) / "workers.json", (json.dumps(entries, indent=2) + "\n").encode())


def forget_workers(cfg: RunConfig) -> None:
    if cfg.out:
        (Path(cfg.out) / "workers.json").unlink(missing_ok=True)


class Outbox:
    """A worker's end of its own pipe to the launcher (one writer per pipe).

    With one multiprocessing.Queue shared by all workers, a worker killed while writing keeps the
    queue's write lock forever, and every other worker blocks on its next message: the run hangs.
    A pipe per worker breaks only the dead worker's own channel.
    """

    def __init__(self, conn: Any) -> None:
        import threading

        self.conn = conn
        self.lock = threading.Lock()  # threads of this process (the server's RPC threads) take turns

    def put(self, message: Any) -> None:
        with self.lock:
            self.conn.send(message)


class Inbox:
    """The launcher's ends of the workers' pipes, read as one queue: ``get(timeout)`` returns the
    next message from any worker or raises ``queue.Empty``. A pipe whose worker died is dropped."""

    def __init__(self) -> None:
        self.conns: list[Any] = []

    def add(self, conn: Any) -> None:
        self.conns.append(conn)

    def get(self, timeout: float) -> Any:
        from multiprocessing.connection import wait

        if not self.conns:
            time.sleep(timeout)
            raise queue.Empty
        for conn in wait(self.conns, timeout):
            try:
                return conn.recv()
            except Exception:  # EOF or a message cut short: its writer is gone
                self.conns.remove(conn)
                conn.close()
        raise queue.Empty

    def take(self, timeout: float, payloads: dict[int, Any], errors: dict[int, str],
             on_event: Any) -> tuple[str, int, Any] | None:
        """File the next message, if one comes within ``timeout``: a result into ``payloads``, a
        worker's first error into ``errors``, an event to ``on_event``. Returns the message."""
        try:
            kind, rank, body = self.get(timeout)
        except queue.Empty:
            return None
        if kind == "result":
            payloads[rank] = body
        elif kind == "error":
            errors.setdefault(rank, body)
        elif kind == "event":
            on_event(body)
        return kind, rank, body

    def close(self) -> None:
        for conn in self.conns:
            conn.close()
        self.conns = []


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


def _report(q: Any, rank: int, body: Any) -> None:
    """Run a worker's body; send its result, or its error in one line, to the launcher."""
    try:
        q.put(("result", rank, _pack(body())))
    except KeyboardInterrupt:
        q.put(("error", rank, "interrupted"))
        raise SystemExit(130) from None
    except BaseException as exc:  # report anything, in one line, then exit non-zero
        q.put(("error", rank, _error_text(exc)))
        raise SystemExit(1) from None


@contextlib.contextmanager
def _spawned(cfg: RunConfig, mpc: Any, q: Inbox, target: Any, roles: list[tuple[str, int]],
             args: Any) -> Iterator[list[Any]]:
    """Start one process per role (``args(i, out)`` gives the i-th one's arguments, ``out`` the
    writing end of its pipe into ``q``); reap them all on exit."""
    procs: list[Any] = []
    try:
        for i, (role, rank) in enumerate(roles):
            read, write = mpc.Pipe(duplex=False)
            q.add(read)
            p = mpc.Process(target=_bootstrap, name=f"distsgd-{role}-{rank}",
                            args=(dict(os.environ), target, args(i, write)))
            p.start()
            write.close()  # the worker holds it now
            procs.append(p)
        record_workers(cfg, procs, roles)
        yield procs
    finally:
        stop_all(procs)
        forget_workers(cfg)
        q.close()


def _worker_entry(rank: int, world: int, cfg: RunConfig, algo_name: str, spec: ModelSpec, dataset: Dataset,
                  init_method: str, q: Any) -> None:
    """The body of a spawned worker process."""
    q = Outbox(q)
    logging.basicConfig(level=logging.WARNING, format=f"worker {rank}: %(levelname)s: %(message)s")
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world))
    if cfg.init_method is None:
        _loopback_only()
    from distsgd.algorithms import registry

    def body() -> WorkerResult:
        init_group(cfg, rank, world, init_method)
        ctx = WorkerContext(cfg=cfg, dataset=dataset, model_spec=spec, rank=rank, world=world,
                            sink=QueueSink(q) if rank == 0 else NullSink(), reports=rank == 0)
        return run_worker(ctx, registry.resolve(algo_name, cfg)(cfg))

    try:
        _report(q, rank, body)
    finally:
        leave_group()


def run_local(cfg: RunConfig, algo_cls: type, spec: ModelSpec, dataset: Dataset, sink: Sink) -> list[WorkerResult]:
    """Spawn ``cfg.workers`` processes on this machine and supervise them to the end."""
    world = cfg.workers
    init_method = cfg.init_method or f"tcp://{LOOPBACK}:{free_port()}"
    dataset.share_memory_()  # every worker reads one copy
    mpc = mp_context()
    q = Inbox()
    with _spawned(cfg, mpc, q, _worker_entry, [("worker", r) for r in range(world)],
                  lambda r, out: (r, world, cfg, algo_cls.name, spec, dataset, init_method, out)) as procs:
        payloads = _supervise(procs, q, sink)
    return [_unpack(payloads[r], cfg, spec, dataset) for r in range(world)]


def _supervise(procs: list[Any], q: Any, sink: Sink) -> dict[int, dict[str, Any]]:
    """Relay events until every worker has reported; fail fast when one fails."""
    payloads: dict[int, dict[str, Any]] = {}
    errors: dict[int, str] = {}
    while len(payloads) < len(procs):
        if q.take(0.2, payloads, errors, sink.emit) is None and \
                any(p.exitcode is not None and r not in payloads for r, p in enumerate(procs)):
            raise _diagnose(procs, q, sink, payloads, errors)
        if errors:
            raise _diagnose(procs, q, sink, payloads, errors)
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
        q.take(0.05, payloads, errors, sink.emit)
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
    init_torchrun_group(cfg, rank, world)
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
                  shared: dict[str, Any], q: Any, first_rank: int, data_world: int) -> None:
    """The body of a worker that trains a model held in shared memory (Hogwild!). ``rank`` is its
    slot on this machine; it reads data shard ``first_rank + rank`` of ``data_world``."""
    q = Outbox(q)
    logging.basicConfig(level=logging.WARNING, format=f"worker {first_rank + rank}: %(levelname)s: %(message)s")
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world))
    from distsgd.algorithms import registry

    def body() -> WorkerResult:
        ctx = WorkerContext(cfg=cfg, dataset=dataset, model_spec=spec, rank=first_rank + rank, world=data_world,
                            sink=QueueSink(q, rank), reports=True, evaluates=False,
                            state={**shared, "queue": q, "slot": rank})
        return run_worker(ctx, registry.resolve(algo_name, cfg)(cfg))

    _report(q, rank, body)


def run_shared(cfg: RunConfig, algo_cls: type, spec: ModelSpec, dataset: Dataset, sink: Sink, *,
               first_rank: int = 0, data_world: int | None = None, ring: Any = None) -> list[WorkerResult]:
    """Start ``cfg.workers`` processes that all train one model in shared memory; watch and evaluate it.

    The workers never pause: this process copies the shared weights every ``eval_every``
    samples and evaluates the copies after training (at once with ``stop_at_target``). A worker
    that dies is recorded in ``failed_workers``; the others carry on. With ``ring`` (a factory
    for a hogwild++ :class:`TokenRing`), this machine is one cluster among several: its workers
    read shards ``first_rank ..`` of ``data_world`` and the ring links its model to the others'.
    """
    from distsgd.data.partition import shard_size
    from distsgd.metrics import TrainClock
    from distsgd.train.evaluate import Snapshots

    world = cfg.workers
    data_world = data_world or world
    dataset.share_memory_()
    models = [build_model(spec, dataset.input_shape, dataset.num_classes, cfg.init, seed=cfg.seed)
              for _ in range(algo_cls.models(cfg))]
    for m in models:
        m.share_memory()
    states = [m.state_dict() for m in models]
    mpc = mp_context()
    shared = {"shared_states": states, "shared_state": states[0],
              "counts": torch.zeros(world, dtype=torch.int64).share_memory_(),
              "stop": torch.zeros(1, dtype=torch.int8).share_memory_(), "go": mpc.Event(), "lock": mpc.Lock() if cfg.hogwild_lock else None,
              **algo_cls.shared_extras(cfg, mpc, models)}

    def current_state() -> dict[str, torch.Tensor]:
        return {k: v.detach().clone() for k, v in algo_cls.combine(states).items()}

    counts = shared["counts"]
    if ring is not None:
        ring = ring(states[0], counts, shared["stop"])

    def samples_now() -> int:
        return ring.global_samples() if ring is not None else int(counts.sum())

    q = Inbox()
    payloads: dict[int, dict[str, Any]] = {}
    failed: dict[int, str] = {}
    global_per_epoch = shard_size(len(dataset.y_train), data_world, cfg.partition) * data_world
    snapshots = Snapshots(cfg, spec, dataset, global_per_epoch, sink)
    threads = torch.get_num_threads()

    def relay_progress(event: dict[str, Any]) -> None:
        """A worker's progress line, with all workers' samples and the launcher's clock."""
        if event.get("event") == "progress":
            done = samples_now()
            elapsed = clock.elapsed()
            sink.emit({**event, "samples": done, "train_wall_s": elapsed,
                       "samples_per_s": done / elapsed if elapsed > 0 else 0.0})

    def reap_exits() -> None:
        for r, p in enumerate(procs):
            if p.exitcode is not None and p.exitcode != 0 and r not in failed and r not in payloads:
                failed[r] = _describe_exit(p.exitcode)

    with _spawned(cfg, mpc, q, _shared_entry, [("worker", r) for r in range(world)],
                  lambda r, out: (r, world, cfg, algo_cls.name, spec, dataset, shared, out, first_rank,
                                  data_world)) as procs:
        ready: set[int] = set()
        deadline = time.monotonic() + cfg.timeout_s
        while len(ready) + len(failed) < world:  # everyone has built its model and optimiser
            if time.monotonic() > deadline:
                raise WorkerError(f"workers {sorted(set(range(world)) - ready)} did not start "
                                  f"within {cfg.timeout_s:.0f} s")
            message = q.take(0.1, payloads, failed, lambda event: None)
            if message is None:
                reap_exits()
            elif message[0] == "ready":
                ready.add(message[1])
        clock = TrainClock()
        shared["go"].set()
        if ring is not None:
            ring.start()
        torch.set_num_threads(1)  # evaluations during training share the cores with the workers
        while len(payloads) + len(failed) < world:
            if q.take(0.01, payloads, failed, relay_progress) is None:
                reap_exits()
            done = samples_now()
            if snapshots.due(done) and snapshots.take(done, clock.elapsed(), current_state()):
                if ring is not None:
                    ring.request_stop()
                shared["stop"].fill_(1)
        if len(failed) == world:
            first = min(failed)
            raise WorkerError(f"all {world} workers failed; worker {first_rank + first}: {failed[first]}")
        total = ring.finish() if ring is not None else int(counts.sum())  # the ring: every cluster is done
        train_wall_s = clock.elapsed()
    torch.set_num_threads(threads)
    final_state = current_state()
    evals = snapshots.finish(total, train_wall_s, final_state)
    model = models[0] if len(models) == 1 else build_model(spec, dataset.input_shape, dataset.num_classes, cfg.init)
    if len(models) > 1:
        model.load_state_dict(final_state)
    extra: dict[str, Any] = {}
    for r in sorted(payloads):
        extra = {**payloads[r]["extra"], **extra}
    if "token_passes" in extra:  # shared counters: read the final value, not a worker's last view
        extra["token_passes"] = int(shared["passes"][0])
    if ring is not None:
        extra.update(ring.summary())
    extra["dataset_shared"] = all(p["extra"].get("dataset_shared", False) for p in payloads.values())
    extra["samples_per_worker"] = [int(c) for c in counts]
    extra["failed_workers"] = sorted(first_rank + r for r in failed)
    if failed:
        extra["worker_errors"] = {str(first_rank + r): failed[r] for r in sorted(failed)}
    final = evals[-1]
    chief = WorkerResult(rank=first_rank, samples=int(counts[0]), global_samples=total, train_wall_s=train_wall_s,
                         evals=evals, final_test_accuracy=final["test_accuracy"], final_test_loss=final["test_loss"],
                         model=model, extra=extra)
    others = [WorkerResult(rank=first_rank + r, samples=int(counts[r]), global_samples=total,
                           train_wall_s=train_wall_s, evals=[],
                           final_test_accuracy=None, final_test_loss=None, model=None,
                           extra=payloads.get(r, {}).get("extra", {})) for r in range(1, world)]
    return [chief] + others


def run_shared_torchrun(cfg: RunConfig, algo_cls: type, spec: ModelSpec, dataset: Dataset,
                        sink: Sink) -> list[WorkerResult]:
    """hogwild++ across machines: this torchrun process is one cluster of ``--cluster-size`` local
    Hogwild! workers; a token ring over the process group links the clusters. Rank 0 evaluates
    (its own cluster's model during training, the average of all at the end) and gets every
    worker's figures."""
    from distsgd.algorithms.hogwild import Hogwild
    from distsgd.algorithms.hogwildpp import TokenRing

    rank, n = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    size = cfg.cluster_size
    local = cfg.replace(workers=size)
    if cfg.max_samples is not None:  # each cluster trains its share
        local = local.replace(max_samples=-(-cfg.max_samples // n))
    if rank != 0:  # only rank 0 evaluates during training and writes the run directory
        local = local.replace(eval_every=2 ** 62, out=None, stop_at_target=False)
    from distsgd.algorithms.hogwild import bind_to_shared

    def ring(state: dict[str, torch.Tensor], counts: torch.Tensor, stop: torch.Tensor) -> TokenRing:
        model = bind_to_shared(build_model(spec, dataset.input_shape, dataset.num_classes, cfg.init), state)
        return TokenRing(cfg, rank, n, model, counts, stop)

    init_torchrun_group(cfg, rank, n)
    try:
        mine = run_shared(local, Hogwild, spec, dataset, sink if rank == 0 else NullSink(), first_rank=rank * size,
                          data_world=n * size, ring=ring)
        light = [{k: v for k, v in vars(r).items() if k != "model"} for r in mine]
        gathered: list[Any] = [None] * n if rank == 0 else []
        dist.gather_object(light, gathered if rank == 0 else None, dst=0)
    finally:
        leave_group()
    if rank != 0:
        return mine
    results = mine + [WorkerResult(model=None, **g) for node in gathered[1:] for g in node]
    chiefs = [node[0]["extra"] for node in gathered]
    extra = results[0].extra
    extra["samples_per_worker"] = [c for e in chiefs for c in e["samples_per_worker"]]
    extra["failed_workers"] = sorted(r for e in chiefs for r in e["failed_workers"])
    errors = {k: v for e in chiefs for k, v in e.get("worker_errors", {}).items()}
    if errors:
        extra["worker_errors"] = errors
    extra["token_passes"] = sum(e["token_passes"] for e in chiefs)
    extra["dataset_shared"] = all(e["dataset_shared"] for e in chiefs)
    return results


def _loopback_only() -> None:
    """Keep gloo's and TensorPipe's listeners of a local run on the loopback interface."""
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    os.environ.setdefault("TP_SOCKET_IFNAME", "lo")


def _rpc_init(cfg: RunConfig, name: str, rank: int, world: int, init_method: str) -> Any:
    import warnings

    from torch.distributed import rpc

    warnings.filterwarnings("ignore", message="You are using a Backend")  # torch's own rpc init

    options = rpc.TensorPipeRpcBackendOptions(init_method=init_method, rpc_timeout=cfg.timeout_s,
                                              num_worker_threads=max(16, 2 * world + 4))
    rpc.init_rpc(name, rank=rank, world_size=world, rpc_backend_options=options)
    return rpc


def _server_role(cfg: RunConfig, algo_name: str, spec: ModelSpec, dataset: Dataset, world: int, init_method: str,
                 sink: Sink, dead: Any) -> WorkerResult:
    from distsgd.algorithms import param_server, registry

    role = param_server.ServerRole(cfg, registry.resolve(algo_name, cfg).mode, spec, dataset, world - 1, sink)
    rpc = _rpc_init(cfg, "ps", 0, world, init_method)
    try:
        return role.run(dead)
    finally:
        rpc.shutdown(graceful=False)


def _ps_worker_role(cfg: RunConfig, algo_name: str, spec: ModelSpec, dataset: Dataset, rank: int, world: int,
                    init_method: str, sink: Sink) -> WorkerResult:
    from distsgd.algorithms import registry

    rpc = _rpc_init(cfg, f"worker{rank}", rank, world, init_method)
    try:
        ctx = WorkerContext(cfg=cfg, dataset=dataset, model_spec=spec, rank=rank - 1, world=world - 1,
                            sink=sink, reports=True, evaluates=False)
        return run_worker(ctx, registry.resolve(algo_name, cfg)(cfg))
    finally:
        rpc.shutdown(graceful=False)


def _ps_entry(rank: int, world: int, cfg: RunConfig, algo_name: str, spec: ModelSpec, dataset: Dataset,
              init_method: str, q: Any, dead_flags: torch.Tensor) -> None:
    """A spawned process of a parameter-server run: rank 0 serves, the others train."""
    q = Outbox(q)
    logging.basicConfig(level=logging.WARNING,
                        format=("server" if rank == 0 else f"worker {rank - 1}") + ": %(levelname)s: %(message)s")
    _loopback_only()
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world))
    def body() -> WorkerResult:
        if rank == 0:
            def dead() -> set[int]:
                return {int(r) for r in torch.nonzero(dead_flags).flatten()}

            return _server_role(cfg, algo_name, spec, dataset, world, init_method, QueueSink(q, 0), dead)
        return _ps_worker_role(cfg, algo_name, spec, dataset, rank, world, init_method, QueueSink(q, rank))

    _report(q, rank, body)


def run_server_local(cfg: RunConfig, algo_cls: type, spec: ModelSpec, dataset: Dataset,
                     sink: Sink) -> list[WorkerResult]:
    """One server process and ``cfg.workers`` worker processes on this machine, over RPC.

    A worker that dies is recorded in ``failed_workers`` and the server carries on without it;
    if the server dies, the run fails at once with one line.
    """
    workers = cfg.workers
    world = workers + 1
    init_method = cfg.init_method or f"tcp://{LOOPBACK}:{free_port()}"
    dataset.share_memory_()
    dead_flags = torch.zeros(world, dtype=torch.int8).share_memory_()
    mpc = mp_context()
    q = Inbox()
    payloads: dict[int, dict[str, Any]] = {}
    failed: dict[int, str] = {}
    # TensorPipe logs every closed pipe at shutdown as a warning; keep C++ logs to errors.
    with _child_env(TORCH_CPP_LOG_LEVEL="ERROR"), \
            _spawned(cfg, mpc, q, _ps_entry, [("server", 0)] + [("worker", r) for r in range(workers)],
                     lambda i, out: (i, world, cfg, algo_cls.name, spec, dataset, init_method, out,
                                     dead_flags)) as procs:
        def take() -> None:
            q.take(0.05, payloads, failed, sink.emit)

        while 0 not in payloads:
            take()
            if 0 in failed or procs[0].exitcode not in (None, 0):
                reason = failed.get(0) or _describe_exit(procs[0].exitcode)
                raise WorkerError(f"the parameter server failed: {reason}")
            for rank in range(1, world):
                code = procs[rank].exitcode
                if rank not in payloads and (rank in failed or code not in (None, 0)):
                    failed.setdefault(rank, _describe_exit(code))
                    dead_flags[rank] = 1
                    if cfg.checkpoint_every:  # a checkpointed run cannot go on without a worker's state
                        raise WorkerError(f"worker {rank - 1} failed: {failed[rank]}; continue from the last "
                                          f"checkpoint with --resume {cfg.out}")
            if len(failed) == workers:
                raise WorkerError(f"all {workers} workers failed; worker 0: {failed.get(1)}")
        deadline = time.monotonic() + STOP_GRACE_S  # the workers are done: collect their figures
        while len(payloads) + len(failed) < world and time.monotonic() < deadline:
            take()
    chief = _unpack(payloads[0], cfg, spec, dataset)
    chief.extra["failed_workers"] = sorted(r - 1 for r in failed)
    if failed:
        chief.extra["worker_errors"] = {str(r - 1): failed[r] for r in sorted(failed)}
    others = [_unpack(payloads[r], cfg, spec, dataset) for r in range(1, world) if r in payloads]
    return [chief] + others


def run_server_torchrun(cfg: RunConfig, algo_cls: type, spec: ModelSpec, dataset: Dataset,
                        sink: Sink) -> list[WorkerResult]:
    """Under torchrun: rank 0 serves, the other ranks are workers; rank 0 returns the results."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    init_method = "env://"
    if rank == 0:
        chief = _server_role(cfg, algo_cls.name, spec, dataset, world, init_method, sink, set)
        chief.extra["failed_workers"] = []
        return [chief]
    return [_ps_worker_role(cfg, algo_cls.name, spec, dataset, rank, world, init_method, NullSink())]


__all__ = ["run_local", "run_torchrun", "run_shared", "run_shared_torchrun", "run_server_local", "run_server_torchrun",
           "stop_all"]
