"""A parameter server over ``torch.distributed.rpc``: asgd, sync-ps, ssp and dcasgd.

Roles: rank 0 is the server, ranks 1..N are the workers (world size N+1). The server holds the
model and the optimiser. A worker pulls the weights once, as one flat tensor with their version;
then, every step, it computes a gradient on its shard and pushes it with the version it read, and
gets the new weights (and their version) back in the same call.

Update rules (g_r: worker r's gradient, computed on weights of version v_r; v: server version):

- ``asgd`` (asynchronous SGD): apply every gradient on arrival, w <- w - lr * g_r. Its staleness
  is tau = v - v_r. ``--staleness-lr`` (any asynchronous mode) divides the stale gradient by
  max(1, tau) before the optimiser sees it (Zhang, Gupta, Lian, Liu, "Staleness-aware
  Async-SGD", IJCAI 2016: the gradient is scaled, so momentum history and weight decay are not).
- ``sync-ps`` (the seeds' scheme): wait for the gradients of all N workers, step once with their
  mean (summed in rank order, so a run is deterministic); equal to one process taking the global
  batch. It is the one server mode with checkpoints (``--checkpoint-every``, ``--resume``): every
  worker saves its own loop state at the same round, and worker 0's file carries the server's
  state (weights, optimiser, counters, evaluations) fetched over RPC at that round.
- ``ssp`` (stale synchronous parallel, Ho et al., NIPS 2013): apply on arrival as asgd, but a
  worker that is more than ``--staleness S`` pushes ahead of the slowest live worker waits for it.
- ``dcasgd`` (delay-compensated ASGD, Zheng et al., ICML 2017): apply
  g_r + lambda * g_r * g_r * (w - w_r), where w_r are the weights worker r read: a first-order
  Taylor correction of the stale gradient towards the current weights. ``--dc-lambda`` is the
  constant lambda (default 0.04, DC-ASGD-c); ``--dc-adaptive`` uses lambda0 / sqrt(m + eps), as
  the paper's DC-ASGD-a: m is a running mean square of gradients, m <- 0.95 m + 0.05 g * g,
  starting from 0, eps = 1e-7, and lambda0 defaults to the paper's 2.

Buffers (BatchNorm statistics): the server's model would otherwise keep its initial running
statistics, since only gradients reach it. Each push also carries the worker's buffers; the
server's floating-point buffers are the mean of every worker's most recent ones, and its integer
buffers (``num_batches_tracked``) those of the latest push. They are set whenever the server's
model is taken (evaluated, checkpointed, returned), so the model evaluated is the model saved.

Concurrency: every change to the server's state (gradients, optimiser step, version, counters)
happens under one lock, so updates are atomic with respect to each other; nothing is accumulated
into shared state outside it. Workers keep computing while the server applies other gradients.
Waiting (sync-ps, ssp) uses futures, so no RPC thread is held while a worker waits; futures are
completed after the lock is released, so replies are serialised outside the critical section.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import Counter
from typing import Any, Callable

import torch
from torch import nn
from torch.futures import Future

from distsgd.algorithms.averaging import (averaged, elastic_alpha, flatten, float_buffers, int_buffers, params,
                                          unflatten_into)
from distsgd.algorithms.base import SERVER, Algorithm, register
from distsgd.config import RunConfig
from distsgd.errors import ConfigError
from distsgd.train.loop import WorkerContext
from distsgd.train.optim import build_optimizer, lr_at, set_lr

log = logging.getLogger(__name__)

MODES = ("asgd", "sync-ps", "ssp", "dcasgd", "easgd")


def flat_params(model: nn.Module) -> torch.Tensor:
    return flatten(params(model))


def dc_lambda(cfg: RunConfig) -> float:
    """lambda (DC-ASGD-c) or lambda0 (DC-ASGD-a): ``--dc-lambda``, else the paper's 0.04 or 2."""
    if cfg.dc_lambda is not None:
        return cfg.dc_lambda
    return 2.0 if cfg.dc_adaptive else 0.04


class ParameterServer:
    """The server's state and update rules, independent of RPC (so tests can drive it directly).

    ``pull(rank)`` returns (weights, version). ``push(rank, grad, version_read, local_samples)``
    returns a Future of (weights, version, total_samples, stop).
    """

    def __init__(self, cfg: RunConfig, model: nn.Module, workers: int, mode: str,
                 samples_per_epoch: int, on_update: Callable[[int], None] | None = None,
                 on_start: Callable[[], None] | None = None) -> None:
        if mode not in MODES:
            raise ValueError(f"unknown parameter-server mode {mode!r}")
        self.cfg, self.model, self.mode, self.workers = cfg, model, mode, workers
        self.params = [p for p in model.parameters()]
        self.optimizer = build_optimizer(cfg, self.params)
        self.samples_per_epoch = samples_per_epoch
        self.total_epochs = cfg.epochs if cfg.max_samples is None else cfg.max_samples / samples_per_epoch
        self.on_update = on_update
        self.on_start = on_start
        self.lock = threading.Lock()
        self.version = 0
        self.counts = [0] * (workers + 1)  # local samples reported by each worker rank (1..N)
        self.clocks = [0] * (workers + 1)  # pushes by each worker
        self.active = set(range(1, workers + 1))  # neither finished nor failed
        self.staleness: Counter[int] = Counter()
        self.stop = False
        self.bytes_sent = 0
        self._waiting: list[Future] = []  # workers at a barrier
        self._started = False
        # sync-ps: the round being gathered, gradients by worker rank
        self._gathered: dict[int, tuple[torch.Tensor, Future]] = {}
        # ssp: workers held back until the slowest catches up
        self._held: list[tuple[int, Future]] = []
        # dcasgd: the weights each worker read, and the running mean square of gradients
        self._read: dict[int, torch.Tensor] = {}
        self._meansq: torch.Tensor | None = None
        # every worker's most recent buffers (floating-point, integer), and the latest integer ones
        self._buffers: dict[int, torch.Tensor] = {}
        self._ints: torch.Tensor | None = None
        self._done: list[tuple[Future, Any]] = []  # futures to complete once the lock is released

    # -- what the workers call ------------------------------------------------------------
    def barrier(self) -> Future:
        """Resolves once every live worker has called it. The first one marks the start of training
        (every worker has built its model), so the workers start together."""
        fut: Future = Future()
        with self.lock:
            self._waiting.append(fut)
            self._release_barrier()
            done = self._take_done()
        _complete(done)
        return fut

    ready = barrier

    def pull(self, rank: int) -> tuple[torch.Tensor, int]:
        with self.lock:
            flat = flat_params(self.model)  # a new tensor (torch.cat)
            self.bytes_sent += flat.numel() * flat.element_size()
            if self.mode == "dcasgd":
                self._read[rank] = flat
            return flat, self.version

    def push(self, rank: int, grad: torch.Tensor, version_read: int, local_samples: int,
             buffers: tuple[torch.Tensor, torch.Tensor] | None = None) -> Future:
        """Apply (or gather) worker ``rank``'s gradient; ``buffers`` are its (floating-point,
        integer) buffers, flat. The Future resolves to (weights, version, total samples, stop)."""
        fut: Future = Future()
        with self.lock:
            self.counts[rank] = local_samples
            self.clocks[rank] += 1
            if buffers is not None:
                self._buffers[rank], self._ints = buffers
            if self.mode == "sync-ps":
                self._gathered[rank] = (grad, fut)
                self._maybe_finish_round()
            else:
                self._apply_async(rank, grad, version_read, fut)
            self._release_held()
            done = self._take_done()
        _complete(done)
        return fut

    def _apply_async(self, rank: int, grad: torch.Tensor, version_read: int, fut: Future) -> None:
        tau = self.version - version_read
        self.staleness[tau] += 1
        if self.mode == "dcasgd":
            grad = self._compensate(rank, grad)
        if self.cfg.staleness_lr and tau > 1:
            grad = grad / tau
        self._apply(grad, self._lr())
        if self.mode == "ssp" and self._ahead(rank):
            self._held.append((rank, fut))  # answered, with the newest weights, once it may go on
            return
        answer = self._answer()
        if self.mode == "dcasgd":
            self._read[rank] = answer[0]
        self._done.append((fut, answer))

    def elastic(self, rank: int, x: torch.Tensor, ints: torch.Tensor,
                local_samples: int) -> tuple[torch.Tensor, int, int, bool]:
        """Asynchronous EASGD: d = x - centre; centre += alpha d; the worker gets d back. ``x`` holds
        the worker's parameters and floating-point buffers; ``ints`` its integer buffers."""
        with self.lock:
            self.counts[rank] = local_samples
            centre = averaged(self.model)
            diff = x - flatten(centre)
            unflatten_into(flatten(centre) + elastic_alpha(self.cfg, self.workers) * diff, centre)
            unflatten_into(ints, int_buffers(self.model))
            self.version += 1
            self.bytes_sent += diff.numel() * diff.element_size()
            if self.on_update is not None:
                self.on_update(self.total_samples())
            return diff, self.version, self.total_samples(), self.stop

    def finished(self, rank: int, local_samples: int | None = None) -> None:
        """Worker ``rank`` is done (or dead): stop waiting for it."""
        with self.lock:
            if local_samples is not None:
                self.counts[rank] = local_samples
            self.active.discard(rank)
            if self.mode == "sync-ps":
                self._maybe_finish_round()
            self._release_held()
            self._release_barrier()
            done = self._take_done()
        _complete(done)

    def sync_buffers(self) -> None:
        """Give the server's model the workers' buffers (call with the lock held): the mean of each
        worker's most recent floating-point buffers, the latest integer ones."""
        if self._buffers:
            ranks = sorted(self._buffers)
            total = self._buffers[ranks[0]].clone()
            for r in ranks[1:]:  # a fixed order: float sums depend on it
                total += self._buffers[r]
            unflatten_into(total / len(ranks), float_buffers(self.model))
        if self._ints is not None:
            unflatten_into(self._ints, int_buffers(self.model))

    # -- inside the lock --------------------------------------------------------------------
    def _take_done(self) -> list[tuple[Future, Any]]:
        done, self._done = self._done, []
        return done

    def total_samples(self) -> int:
        return sum(self.counts)

    def _lr(self) -> float:
        return lr_at(self.cfg, self.total_samples() / self.samples_per_epoch, self.total_epochs)

    def _apply(self, grad: torch.Tensor, lr: float) -> None:
        offset = 0
        for p in self.params:
            n = p.numel()
            p.grad = grad[offset:offset + n].view_as(p)  # views: grad is this update's own tensor
            offset += n
        set_lr(self.optimizer, lr)
        self.optimizer.step()
        self.version += 1
        if self.on_update is not None:
            self.on_update(self.total_samples())

    def _answer(self) -> tuple[torch.Tensor, int, int, bool]:
        flat = flat_params(self.model)
        self.bytes_sent += flat.numel() * flat.element_size()
        return flat, self.version, self.total_samples(), self.stop

    def _compensate(self, rank: int, grad: torch.Tensor) -> torch.Tensor:
        lam = dc_lambda(self.cfg)
        if self.cfg.dc_adaptive:  # DC-ASGD-a: MeanSquare starts at 0
            decay = 0.95
            if self._meansq is None:
                self._meansq = torch.zeros_like(grad)
            self._meansq.mul_(decay).add_((1 - decay) * grad * grad)
            lam_t: torch.Tensor | float = lam / torch.sqrt(self._meansq + 1e-7)
        else:
            lam_t = lam
        w = flat_params(self.model)
        return grad + lam_t * grad * grad * (w - self._read[rank])

    def _maybe_finish_round(self) -> None:
        if not self._gathered or len(self._gathered) < len(self.active):
            return
        n = len(self._gathered)
        self.staleness[0] += n
        ranks = sorted(self._gathered)
        total = self._gathered[ranks[0]][0].clone()
        for r in ranks[1:]:  # a fixed order: float sums depend on it
            total += self._gathered[r][0]
        self._apply(total / n, self._lr())
        answer = self._answer()
        self._done.extend((self._gathered[r][1], answer) for r in ranks)
        self._gathered = {}

    def _release_barrier(self) -> None:
        if not self._waiting or len(self._waiting) < len(self.active):
            return
        if not self._started:
            self._started = True
            if self.on_start is not None:
                self.on_start()
        waiting, self._waiting = self._waiting, []
        self._done.extend((f, None) for f in waiting)

    def _ahead(self, rank: int) -> bool:
        others = [self.clocks[r] for r in self.active if r != rank]
        slowest = min(others) if others else self.clocks[rank]
        return self.clocks[rank] - slowest > self.cfg.staleness

    def _release_held(self) -> None:
        still = []
        for rank, fut in self._held:
            if self._ahead(rank) and rank in self.active:
                still.append((rank, fut))
            else:
                self._done.append((fut, self._answer()))
        self._held = still

    # -- checkpoints (sync-ps: taken between rounds, when no gradient is pending) --------------
    def state_dict(self) -> dict[str, Any]:
        """The server's state (call with the lock held)."""
        self.sync_buffers()
        return {"model": {k: v.detach().clone() for k, v in self.model.state_dict().items()},
                "optimizer": self.optimizer.state_dict(), "version": self.version, "counts": list(self.counts),
                "clocks": list(self.clocks), "staleness": {str(k): v for k, v in self.staleness.items()},
                "bytes_sent": self.bytes_sent, "buffers": {str(r): b.clone() for r, b in self._buffers.items()},
                "ints": self._ints}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.model.load_state_dict(state["model"])
        self._buffers = {int(r): b for r, b in state["buffers"].items()}
        self._ints = state["ints"]
        self.optimizer.load_state_dict(state["optimizer"])
        self.version, self.bytes_sent = state["version"], state["bytes_sent"]
        self.counts, self.clocks = list(state["counts"]), list(state["clocks"])
        self.staleness = Counter({int(k): v for k, v in state["staleness"].items()})

    # -- reporting -----------------------------------------------------------------------------
    def staleness_summary(self) -> dict[str, Any]:
        return staleness_stats(self.staleness)


def _complete(done: list[tuple[Future, Any]]) -> None:
    """Resolve futures (and so serialise RPC replies) outside the server's lock."""
    for fut, value in done:
        fut.set_result(value)


def staleness_stats(hist: Counter[int]) -> dict[str, Any]:
    n = sum(hist.values())
    if n == 0:
        return {"mean": None, "p50": None, "p99": None, "max": None, "histogram": {}}
    ordered = sorted(hist.items())

    def quantile(q: float) -> int:
        need = math.ceil(q * n)
        seen = 0
        for value, count in ordered:
            seen += count
            if seen >= need:
                return value
        return ordered[-1][0]

    return {"mean": sum(v * c for v, c in ordered) / n, "p50": quantile(0.5), "p99": quantile(0.99),
            "max": ordered[-1][0], "histogram": {str(v): c for v, c in ordered}}


# --- RPC plumbing: module-level functions the workers call on the server process --------------
_SERVER: ParameterServer | None = None
_ROLE: "ServerRole | None" = None

try:  # the handler returns a Future; the RPC thread is free while a worker waits
    from torch.distributed.rpc.functions import async_execution as _async_execution
except ImportError:  # pragma: no cover - a torch build without RPC
    def _async_execution(fn: Callable) -> Callable:
        return fn


def _rpc_pull(rank: int) -> tuple[torch.Tensor, int]:
    assert _SERVER is not None
    return _SERVER.pull(rank)


@_async_execution
def _rpc_push(rank: int, grad: torch.Tensor, version_read: int, local_samples: int,
              buffers: tuple[torch.Tensor, torch.Tensor] | None) -> Future:
    assert _SERVER is not None
    return _SERVER.push(rank, grad, version_read, local_samples, buffers)


def _rpc_done(rank: int, local_samples: int) -> None:
    assert _SERVER is not None
    _SERVER.finished(rank, local_samples)


def _rpc_elastic(rank: int, x: torch.Tensor, ints: torch.Tensor,
                 local_samples: int) -> tuple[torch.Tensor, int, int, bool]:
    assert _SERVER is not None
    return _SERVER.elastic(rank, x, ints, local_samples)


@_async_execution
def _rpc_ready() -> Future:
    assert _SERVER is not None
    return _SERVER.ready()


@_async_execution
def _rpc_barrier() -> Future:
    assert _SERVER is not None
    return _SERVER.barrier()


def _rpc_checkpoint_state() -> dict[str, Any]:
    assert _ROLE is not None
    return _ROLE.state_dict()



class ServerAlgorithm(Algorithm):
    """The worker side of every parameter-server mode: push the gradient, take the new weights."""

    topology = SERVER
    mode = "asgd"
    checkpoints = False  # sync-ps only: the asynchronous modes have no round at which all agree

    @classmethod
    def check(cls, cfg: RunConfig) -> None:
        if cfg.optimizer != "sgd" and cls.mode == "dcasgd":
            raise ConfigError("dcasgd compensates SGD gradients: use --optimizer sgd")

    def setup(self, ctx: WorkerContext, model: nn.Module) -> nn.Module:
        from torch.distributed import rpc

        self.rpc = rpc
        self.me = ctx.rank + 1  # data rank r is RPC rank r + 1; the server is rank 0
        self.chief = ctx.rank == 0
        self.local = 0
        flat, self.version = rpc.rpc_sync("ps", _rpc_pull, args=(self.me,))
        self.params = params(model)
        unflatten_into(flat, self.params)
        self.floats, self.ints = float_buffers(model), int_buffers(model)
        self.total = 0
        self.stop = False
        return model

    def before_training(self, ctx: WorkerContext) -> None:
        self.rpc.rpc_sync("ps", _rpc_ready)

    def apply_step(self, ctx: WorkerContext, optimizer: torch.optim.Optimizer) -> None:
        pass  # the server steps; see after_step

    def after_step(self, ctx: WorkerContext, model: nn.Module, local_samples: int) -> None:
        self.local = local_samples
        grad = flatten([p.grad if p.grad is not None else torch.zeros_like(p) for p in self.params])
        buffers = (flatten(self.floats), flatten(self.ints)) if self.floats or self.ints else None
        flat, self.version, self.total, self.stop = self.rpc.rpc_sync(
            "ps", _rpc_push, args=(self.me, grad, self.version, local_samples, buffers))
        self.bytes_sent += sum(t.numel() * t.element_size() for t in (grad, *(buffers or ())))
        unflatten_into(flat, self.params)

    def global_samples(self, ctx: WorkerContext, local_samples: int) -> int:
        return max(self.total, local_samples)

    def keep_going(self, ctx: WorkerContext) -> bool:
        return not self.stop

    def finish(self, ctx: WorkerContext, model: nn.Module) -> nn.Module:
        self.rpc.rpc_sync("ps", _rpc_done, args=(self.me, self.local))
        return model

    def summary(self) -> dict[str, Any]:
        return {"bytes_sent": self.bytes_sent}

    # -- checkpoints ------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        state = {**super().state_dict(), "version": self.version, "total": self.total}
        if self.chief:  # worker 0's file carries the server's state, as of this round
            state["server"] = self.rpc.rpc_sync("ps", _rpc_checkpoint_state)
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.version, self.total = state["version"], state["total"]

    def barrier(self, ctx: WorkerContext) -> None:
        self.rpc.rpc_sync("ps", _rpc_barrier)


class ServerRole:
    """The server role: hold the model, apply pushes until every worker is done, then evaluate.

    Built before RPC starts (so the first pull finds it), then ``run()``. Like Hogwild!, the model
    is copied every ``eval_every`` samples (inside the update lock, so each copy is one consistent
    version) and the copies are evaluated after training; with ``stop_at_target`` the copy is
    evaluated at once, with the clock paused since the workers wait on the lock, and the workers
    are told to stop. With ``cfg.resume`` it starts from the server state saved in worker 0's
    checkpoint file.
    """

    def __init__(self, cfg: RunConfig, mode: str, spec: Any, dataset: Any, workers: int, sink: Any) -> None:
        global _SERVER, _ROLE
        from distsgd.data.partition import shard_size
        from distsgd.metrics import TrainClock
        from distsgd.models import build_model
        from distsgd.train.evaluate import Snapshots

        torch.set_num_threads(1)
        self.cfg = cfg
        self.model = build_model(spec, dataset.input_shape, dataset.num_classes, cfg.init, seed=cfg.seed)
        per_epoch = shard_size(len(dataset.y_train), workers, cfg.partition) * workers
        self.snapshots = Snapshots(cfg, spec, dataset, per_epoch, sink)
        self.clock = TrainClock()
        self.earlier_s = 0.0  # training time before the checkpoint resumed from
        self.server = ParameterServer(cfg, self.model, workers, mode, per_epoch, self._on_update,
                                      on_start=self._start_clock)
        if cfg.resume:
            from pathlib import Path

            from distsgd.checkpoint import load_worker_state

            self.load_state_dict(load_worker_state(Path(cfg.resume), 0)["algo"]["server"])
        _SERVER, _ROLE = self.server, self

    def _start_clock(self) -> None:
        self.clock.restart()
        self.clock.add(self.earlier_s)

    def state_dict(self) -> dict[str, Any]:
        with self.server.lock:
            return {**self.server.state_dict(), **self.snapshots.state_dict(), "train_wall_s": self.clock.elapsed()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.server.load_state_dict(state)
        self.snapshots.load_state_dict(state)
        self.earlier_s = state["train_wall_s"]

    def _state(self) -> dict[str, torch.Tensor]:
        """A copy of the server's model with the workers' buffers (call with the lock held)."""
        self.server.sync_buffers()
        return {k: v.detach().clone() for k, v in self.model.state_dict().items()}

    def _on_update(self, total: int) -> None:  # runs inside the server's lock
        if not self.snapshots.due(total):
            return
        self.clock.pause()
        if self.snapshots.take(total, self.clock.elapsed(), self._state()):
            self.server.stop = True
        self.clock.resume()

    def run(self, dead: Callable[[], set[int]] = set) -> Any:
        """Serve until every worker has finished or died; return the chief WorkerResult."""
        global _SERVER, _ROLE
        from distsgd.train.loop import WorkerResult

        server = self.server
        while server.active:
            for rank in dead() & server.active:
                log.warning("worker %d died; the server carries on without it", rank - 1)
                server.finished(rank)
            time.sleep(0.01)
        train_wall_s = self.clock.elapsed()
        total = server.total_samples()
        evals = self.snapshots.finish(total, train_wall_s, self._state())
        extra = {"staleness": server.staleness_summary(), "server_updates": server.version,
                 "server_updates_per_s": server.version / train_wall_s if train_wall_s > 0 else 0.0,
                 "bytes_sent": server.bytes_sent, "server_bytes_sent": server.bytes_sent,
                 "samples_per_worker": server.counts[1:]}
        _SERVER = _ROLE = None
        final = evals[-1]
        return WorkerResult(rank=0, samples=0, global_samples=total, train_wall_s=train_wall_s, evals=evals,
                            final_test_accuracy=final["test_accuracy"], final_test_loss=final["test_loss"],
                            model=self.model, extra=extra)


@register
class ASGD(ServerAlgorithm):
    name = "asgd"
    mode = "asgd"
    summary_line = "asynchronous SGD on a parameter server; --staleness-lr divides lr by the staleness"


@register
class SyncPS(ServerAlgorithm):
    name = "sync-ps"
    mode = "sync-ps"
    checkpoints = True
    summary_line = "parameter server that waits for all workers' gradients, then steps once (the seeds')"


@register
class SSP(ServerAlgorithm):
    name = "ssp"
    mode = "ssp"
    summary_line = "stale synchronous parallel: no worker runs more than --staleness pushes ahead"


@register
class DCASGD(ServerAlgorithm):
    name = "dcasgd"
    mode = "dcasgd"
    summary_line = "delay-compensated ASGD: g + lambda g*g*(w - w_read); --dc-adaptive"


__all__ = ["ParameterServer", "staleness_stats", "MODES"]
