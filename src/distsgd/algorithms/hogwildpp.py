"""hogwild++: HogWild++ (Zhang, Hsieh, Akella, ICDM 2016): clusters of Hogwild! workers, kept
together by a token passed around a ring.

Workers form clusters of ``--cluster-size C`` processes; each cluster runs Hogwild! on its own
model w_i in shared memory (n = workers / C clusters). A token travels round the ring of
clusters 0 -> 1 -> ... -> n-1 -> 0. The cluster that receives the token at once exchanges with
the next cluster, coordinate by coordinate, as the authors' code does (huanzhang12/hogwildpp @
6aaf9ef, ``src/numasvm/svm_exec.hxx``, ``ModelUpdate``, l. 46-130), w_next being read *before* it
receives beta * delta:

    delta = eta * (w_i - w_i_old)
    if |delta| > tol:  w_i <- lambda * w_next + (1 - lambda) * w_i + (beta + lambda - 1) * delta
                       w_next <- w_next + beta * delta;  w_i_old <- w_i
    else:              w_i <- lambda * w_next + (1 - lambda) * w_i + lambda * delta
                       w_i_old <- w_i - delta    (w_next unchanged: delta waits for a later pass)

then keeps the token for tau0 = ``--update-delay`` more optimiser steps per worker, and passes it
on. beta is the root in [0.6, 1] of beta^n + beta - 1 = 0 and lambda = 1 - beta^(n - 1)
(``src/numasvm_main.cc``, ``SolveBeta``, l. 90-110, and l. 354-355; they bisect to |error| <=
1e-3, we solve exactly).

eta is ``--ring-scale``. In the authors' code it is their SVM's SGD step size of the current
epoch, stepinitial * step_decay^epoch (``PostUpdate`` multiplies it by step_decay after each
epoch; defaults 0.05 and 0.8, ``numasvm_main.cc`` l. 227-232). ``--ring-scale lr`` is the
holder's learning rate at the exchange (its optimiser's first parameter group's, as the run's
schedule and warm-up set it), so it decays with the schedule: ``--schedule step --lr-gamma 0.8
--lr-step-epochs 1`` is the authors' per-epoch decay. A number is a fixed eta; 1.0 passes the
model's change itself. What eta does: passed round the ring with no other updates, one local
update settles in every model at 1.0 of itself for n = 2, 0.87 for n = 3 and 0.78 for n = 4 with
eta = 1, and at 0.39 (n = 2) and 0.12 (n = 4) with eta = 0.05. A small eta passes little of an
update on and spends the rest pulling the holder towards its neighbour: the ring acts more as a
gossip average than as a relay of updates, and the run learns as with a smaller learning rate.
The default is 1.0, not the authors' ``lr``, which trained worse on the default job
(docs/BENCHMARKS.md, "HogWild++'s ring factor"). tol is ``--ring-tolerance``; the authors'
driver uses 1e-2 (l. 232), ours defaults to 0, where the else-branch only meets coordinates whose
delta is exactly 0, and changes nothing there.

Where this differs from the authors' code, and why: tau0 counts the cluster's optimiser steps
divided by C (the authors count the holding thread's own updates, one example each: the same on
average), so any worker of the holding cluster may pass the token and a dead worker cannot stall
the ring. The steps are counted from the cluster's samples, as samples / (``--batch-size`` x
``--accumulate``), so ``--accumulate`` does not shorten tau0 (an epoch's last, short step counts
as a part of one). The authors' tau0 defaults to 256 examples (their README advises 64 with
fewer than 4 clusters); ours, 16, counts steps of 64 examples by default. Both models are
changed by increments, so Hogwild! updates that other workers make meanwhile are kept.

What is evaluated and saved: the average of the cluster models (floating-point buffers averaged,
integer ones, ``num_batches_tracked``, taken from cluster 0, never averaged). The authors test
the model of the cluster that last passed the token (``GetLatestModel``: (token - 1) mod n) and
never average. We keep the average: the ring keeps the models close (a lone update settles at
the same value in all of them), so their average is a model of the same run with each cluster's
latest unshared steps weighed 1/n rather than all or nothing; it does not depend on which cluster
happened to pass the token last when the run stopped (a matter of timing between processes); and
under torchrun it is one all-reduce, with no agreement needed on who passed last. Buffers
(BatchNorm statistics) stay with their cluster's model during training, shared by its workers as
in Hogwild!.

On one machine (``--workers N``) the clusters' models all live in shared memory and a worker of
the holding cluster makes the exchange; ``bytes_sent`` counts the delta it hands to the next
cluster. Across machines (torchrun, one process per node) each torchrun process is one cluster:
it starts ``--cluster-size`` local Hogwild! workers (:class:`ClusterWorker`) on its model in
shared memory and a thread (:class:`TokenRing`) runs the ring over torch.distributed
point-to-point messages: the holder sends the delta it passes on, the next cluster answers with
its model as it was before adding beta * delta, and the holder applies the rule as an increment;
after tau0 it sends the token. There ``bytes_sent`` counts delta, the answer and the two
messages' headers. Optimiser state is per worker, as in Hogwild!.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import threading
import time
from dataclasses import dataclass
from multiprocessing.context import BaseContext
from typing import ClassVar

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from distsgd.algorithms.averaging import add_into, average_model_, flatten, mean_state, params
from distsgd.algorithms.base import Algorithm, SharedSeat, Topology, register
from distsgd.algorithms.hogwild import (
    HogwildFigures,
    HogwildMemory,
    HogwildOptions,
    OwnedLock,
    SharedModel,
    bind_to_shared,
)
from distsgd.config import RunConfig
from distsgd.errors import ConfigError
from distsgd.options import option
from distsgd.train.context import Figures, Start, Step, WorkerContext
from distsgd.train.optim import settled_lr


def ring_constants(n: int) -> tuple[float, float]:
    """(beta, lambda): beta in (0, 1) solves beta^n + beta - 1 = 0; lambda = 1 - beta^(n - 1)."""
    lo, hi = 0.0, 1.0
    for _ in range(200):
        mid = (lo + hi) / 2
        if mid**n + mid - 1 > 0:
            hi = mid
        else:
            lo = mid
    beta = (lo + hi) / 2
    return beta, 1 - beta ** (n - 1)


def token_pass(
    w_i: torch.Tensor,
    w_next: torch.Tensor,
    w_old: torch.Tensor,
    beta: float,
    lam: float,
    scale: float = 1.0,
    tolerance: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One exchange on flat tensors, the authors' rule (the module's docstring): returns the new
    (w_i, w_next, w_i_old). w_next is mixed in as it was before receiving beta * delta."""
    delta, sent = split_delta(w_i, w_old, scale, tolerance)
    new_i = w_i + holder_increment(w_i, w_next, delta, sent, beta, lam)
    return new_i, w_next + beta * sent, new_i - (delta - sent)


def split_delta(
    w_i: torch.Tensor, w_old: torch.Tensor, scale: float, tolerance: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(delta, sent): delta = scale * (w_i - w_old); sent is delta where |delta| > tolerance and 0
    elsewhere, what the next cluster receives (beta times). The rest waits in w_i_old."""
    delta = (w_i - w_old) * scale
    sent = delta if tolerance <= 0 else torch.where(delta.abs() > tolerance, delta, torch.zeros_like(delta))
    return delta, sent


def holder_increment(
    w_i: torch.Tensor, w_next: torch.Tensor, delta: torch.Tensor, sent: torch.Tensor, beta: float, lam: float
) -> torch.Tensor:
    """What the holder adds to w_i: the new w_i minus w_i, where w_next is the next cluster's model
    before it received beta * sent: lambda * (w_next - w_i), plus (beta + lambda - 1) * delta where
    delta is sent and lambda * delta where it is not. Added as an increment, it keeps the local
    updates made to w_i meanwhile. The holder's new w_i_old is w_i + this - (delta - sent)."""
    return lam * (w_next - w_i) + (beta + lam - 1) * sent + lam * (delta - sent)


RING_SCALE: float | str = 1.0
RING_TOLERANCE = 0.0
UPDATE_DELAY = 16


def parse_ring_scale(given: str | float) -> float | str:
    """``--ring-scale``: 'lr' (the holder's learning rate at the exchange) or a positive number."""
    if given == "lr":
        return "lr"
    try:
        scale = float(given)
    except (TypeError, ValueError):
        scale = math.nan
    if not (math.isfinite(scale) and scale > 0):
        raise ConfigError(f"--ring-scale must be 'lr' or a positive number, got '{given}'")
    return scale


@dataclass
class RingState:
    """The token ring's state in shared memory, one machine (the :class:`Ring` topology's extras)."""

    old: list[torch.Tensor]  # each cluster's w_i_old, flat
    token: torch.Tensor  # the cluster holding the token
    synced: torch.Tensor  # whether the holder has made its exchange yet
    synced_at: torch.Tensor  # the holding cluster's steps at that exchange
    passes: torch.Tensor  # exchanges made
    lock: OwnedLock  # one exchange at a time (a holder that dies in it does not stop the ring)


@dataclass(frozen=True)
class RingOptions(HogwildOptions):
    cluster_size: int = option(1, "worker processes per cluster", metavar="C")
    update_delay: int = option(
        UPDATE_DELAY,
        "tau0: optimiser steps per worker (each --accumulate micro-batches) the "
        "holding cluster makes after its exchange before passing the token on",
        metavar="TAU0",
    )
    ring_scale: float | str = option(
        RING_SCALE,
        "eta, the factor on the delta a token holder passes on: 'lr' (its "
        "learning rate at the exchange, following the schedule, as the "
        "authors' code uses its step size) or a fixed number (1: the model's "
        "change itself)",
        parse=parse_ring_scale,
        metavar="lr|ETA",
    )
    ring_tolerance: float = option(
        RING_TOLERANCE,
        "coordinates whose scaled delta is at most this are not passed "
        "on but wait in the holder's old model (the authors' code: 1e-2)",
        metavar="TOL",
    )

    def check(self, cfg: RunConfig) -> None:
        if self.cluster_size < 1:
            raise ConfigError(f"--cluster-size must be at least 1, got {self.cluster_size}")
        if self.update_delay < 1:
            raise ConfigError(f"--update-delay must be at least 1, got {self.update_delay}")
        if cfg.workers % self.cluster_size:
            raise ConfigError(f"--workers {cfg.workers} is not a multiple of --cluster-size {self.cluster_size}")
        if not (math.isfinite(self.ring_tolerance) and self.ring_tolerance >= 0):
            raise ConfigError(f"--ring-tolerance must be a number >= 0, got {self.ring_tolerance}")


@dataclass
class RingFigures(HogwildFigures):
    token_passes: int | None = None
    clusters: int | None = None
    ring_beta: float | None = None
    ring_lambda: float | None = None


class Ring(HogwildMemory):
    """hogwild++'s shared memory: one model a cluster, the token ring's state; under torchrun one
    cluster a process, linked by a :class:`TokenRing`."""

    def models(self, cfg: RunConfig) -> int:
        return cfg.workers // RingOptions.from_mapping(cfg.options).cluster_size

    def extras(self, cfg: RunConfig, mpc: BaseContext, models: list[nn.Module]) -> RingState:
        def shared_int() -> torch.Tensor:
            return torch.zeros(1, dtype=torch.int64).share_memory_()

        return RingState(
            old=[flatten(params(m)).share_memory_() for m in models],
            token=shared_int(),
            synced=shared_int(),
            synced_at=shared_int(),
            passes=shared_int(),
            lock=OwnedLock(),
        )

    def combine(self, states: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        """The model returned: the clusters' average (integer buffers from cluster 0)."""
        return mean_state(states)

    def figures(self, workers: list[Figures], extras: object) -> Figures:
        assert isinstance(extras, RingState)  # made by extras() above
        merged = vars(super().figures(workers, extras))  # a RingFigures' fields, or a HogwildFigures' (none left)
        return RingFigures(**{**merged, "token_passes": int(extras.passes[0])})  # the final count

    def local_workers(self, cfg: RunConfig) -> int:
        return RingOptions.from_mapping(cfg.options).cluster_size

    def per_machine(self, cfg: RunConfig, workers: int) -> RunConfig:
        return cfg.replace(options={**cfg.options, "cluster_size": workers})

    def node_algorithm(self, algo_cls: type[Algorithm]) -> type[Algorithm]:
        return ClusterWorker  # each process is one cluster: Hogwild! on its model, linked by the ring

    def link(self, cfg: RunConfig, rank: int, n: int, model: nn.Module, seat: SharedSeat) -> "TokenRing":
        assert isinstance(seat.extras, torch.Tensor)  # ClusterMemory's, the cluster's learning rate
        return TokenRing(cfg, rank, n, model, seat.counts, seat.stop, seat.extras)

    def merge_nodes(self, per_node: list[Figures]) -> Figures:
        first = per_node[0]
        assert isinstance(first, RingFigures)  # every node's TokenRing made its figures
        return dataclasses.replace(first, token_passes=sum(getattr(c, "token_passes", 0) or 0 for c in per_node))


def current_lr(optimizer: torch.optim.Optimizer) -> float:
    """The learning rate ``--ring-scale lr`` scales delta by: the first parameter group's, as the
    run's schedule and warm-up last set it."""
    return float(optimizer.param_groups[0]["lr"])


def refuse_loaded_weights() -> None:
    """Weights a user's loop loads after run.setup(), each cluster its copy: the ring's exchanges
    pass on each cluster's change since its last exchange (its w_i_old), so the load would reach
    the next cluster, which loaded them too, a second time (0.48 from them), and a cluster whose
    workers step before another's load exchanges with the weights of setup: refused, whatever
    the timing."""
    raise ConfigError(
        "under hogwild++ the clusters pass on their changes round the token ring: weights loaded after "
        "run.setup() would be passed on as a change, and the clusters' loads and first exchanges race; "
        "load them in the model factory given to distsgd.spawn(model=...)"
    )


class ClusterMemory(HogwildMemory):
    """Under torchrun, one cluster's shared memory: Hogwild!'s, and its extras, one float64 that its
    workers set to their learning rate after every step, for the :class:`TokenRing` to read."""

    def extras(self, cfg: RunConfig, mpc: BaseContext, models: list[nn.Module]) -> torch.Tensor:
        return torch.full((1,), float(settled_lr(cfg)), dtype=torch.float64).share_memory_()


class ClusterWorker(SharedModel[HogwildOptions]):
    """Under torchrun, a worker of one cluster (one process): Hogwild! on the cluster's model, and
    it tells the ring its learning rate (the shared float of :class:`ClusterMemory`)."""

    topology: ClassVar[Topology] = ClusterMemory()

    lr_now: np.ndarray  # a numpy view of the shared float
    optimizer: torch.optim.Optimizer  # set by optimizers_ready (the first): whose lr it tells

    def __init__(self, cfg: RunConfig, seat: object = None) -> None:
        super().__init__(cfg, seat)
        assert isinstance(self.seat.extras, torch.Tensor)  # ClusterMemory's
        self.lr_now = self.seat.extras.numpy()

    def optimizers_ready(self, ctx: WorkerContext, optimizers: list[torch.optim.Optimizer]) -> None:
        self.optimizer = optimizers[0]

    def after_step(self, ctx: WorkerContext, model: nn.Module, step: Step) -> None:
        super().after_step(ctx, model, step)
        self.lr_now[0] = current_lr(self.optimizer)

    def weights_loaded(self, ctx: WorkerContext, model: nn.Module) -> None:
        refuse_loaded_weights()


@register
class HogwildPP(SharedModel[RingOptions]):
    name = "hogwild++"
    topology: ClassVar[Topology] = Ring()
    summary_line = (
        "HogWild++: clusters of Hogwild! workers synced by a token ring (--cluster-size, --update-delay = tau0)"
    )

    ring: RingState  # the ring's state in shared memory: the token, every cluster's w_i_old, the passes
    n: int  # clusters
    beta: float  # the ring's constants for n clusters
    lam: float
    hold_steps: int  # the holding cluster's steps between its exchange and passing the token (tau0 per worker)
    step_samples: int  # the samples of one optimiser step (--accumulate micro-batches)
    optimizer: torch.optim.Optimizer  # set by optimizers_ready (the first): whose lr --ring-scale lr reads
    # built by setup:
    cluster: int  # this worker's cluster
    members: slice  # its cluster's slots in counts
    mine: list[torch.Tensor]  # the cluster's model's parameters, w_i
    next_params: list[torch.Tensor]  # the next cluster's, w_next (none with one cluster)
    old: torch.Tensor  # this cluster's w_i_old, flat (in the ring's state)
    exchange_bytes: int  # what one exchange hands the next cluster

    def __init__(self, cfg: RunConfig, seat: object = None) -> None:
        super().__init__(cfg, seat)
        assert isinstance(self.seat.extras, RingState)  # the Ring topology's
        self.ring = self.seat.extras
        self.n = len(self.seat.states)
        self.beta, self.lam = ring_constants(self.n)
        self.hold_steps = self.opts.update_delay * self.opts.cluster_size
        self.step_samples = cfg.batch_size * cfg.accumulate

    def shared_state(self, ctx: WorkerContext) -> dict[str, torch.Tensor]:
        return self.seat.states[ctx.rank // self.opts.cluster_size]

    def setup(self, ctx: WorkerContext, model: nn.Module, start: Start) -> nn.Module:
        size = self.opts.cluster_size
        self.cluster = ctx.rank // size
        self.members = slice(self.cluster * size, (self.cluster + 1) * size)
        model = super().setup(ctx, model, start)
        self.mine = params(model)
        states = self.seat.states
        nxt = bind_to_shared(copy.deepcopy(model), states[(self.cluster + 1) % self.n]) if self.n > 1 else None
        self.next_params = params(nxt) if nxt is not None else []
        self.old = self.ring.old[self.cluster]
        self.exchange_bytes = sum(p.numel() * p.element_size() for p in self.mine)
        return model

    def after_step(self, ctx: WorkerContext, model: nn.Module, step: Step) -> None:
        super().after_step(ctx, model, step)
        ring = self.ring
        if self.n == 1 or int(ring.token) != self.cluster:
            return
        cluster_steps = int(self.counts[self.members].sum()) // self.step_samples
        if ring.synced[0] and cluster_steps - int(ring.synced_at[0]) < self.hold_steps:
            return
        if not ring.lock.acquire(block=False):
            return
        try:
            if int(ring.token) != self.cluster:  # another worker of this cluster passed it already
                return
            if not ring.synced[0]:  # the token just arrived: exchange with the next cluster
                self._exchange()
                ring.synced.fill_(1)
                ring.synced_at.fill_(cluster_steps)
            elif cluster_steps - int(ring.synced_at[0]) >= self.hold_steps:  # held tau0: pass it on
                ring.synced.fill_(0)
                ring.token.fill_((self.cluster + 1) % self.n)
        finally:
            ring.lock.release()

    def optimizers_ready(self, ctx: WorkerContext, optimizers: list[torch.optim.Optimizer]) -> None:
        self.optimizer = optimizers[0]

    def weights_loaded(self, ctx: WorkerContext, model: nn.Module) -> None:
        refuse_loaded_weights()

    def scale(self) -> float:
        """eta for an exchange now: this worker's learning rate, or the fixed --ring-scale."""
        ring_scale = self.opts.ring_scale
        return current_lr(self.optimizer) if ring_scale == "lr" else float(ring_scale)

    def _exchange(self) -> None:
        w_i, w_next = flatten(self.mine), flatten(self.next_params)
        new_i, new_next, new_old = token_pass(
            w_i, w_next, self.old, self.beta, self.lam, self.scale(), self.opts.ring_tolerance
        )
        add_into(new_next - w_next, self.next_params)  # increments: updates made meanwhile stay
        add_into(new_i - w_i, self.mine)
        self.old.copy_(new_old)
        self.synchronize()  # done on the device before the ring's lock is released
        self.bytes_sent += w_i.numel() * w_i.element_size()
        self.ring.passes += 1

    def progress_figures(self, ctx: WorkerContext) -> dict[str, float]:
        """Every cluster's exchanges so far (counted in shared memory), each one model's weights."""
        return {"bytes_sent": int(self.ring.passes[0]) * self.exchange_bytes}

    def figures(self) -> RingFigures:
        return RingFigures(
            **{**vars(super().figures()), "bytes_sent": self.bytes_sent},
            token_passes=int(self.ring.passes[0]),
            clusters=self.n,
            ring_beta=self.beta,
            ring_lambda=self.lam,
        )


SYNC, TOKEN, STOP = 0, 1, 2  # kinds of ring message


class TokenRing:
    """The token ring between clusters in different processes (one per node under torchrun).

    Runs in a thread of each cluster's launching process, beside its local Hogwild! workers, over
    the default process group (one rank per cluster). ``model`` is the cluster's model, bound to
    the tensors its workers share; ``counts`` the samples of each of the cluster's workers
    (shared); ``lr`` their learning rate (shared, set by each :class:`ClusterWorker` after every
    step), for ``--ring-scale lr``. The holder sends SYNC (then the delta it passes on; the next
    cluster answers with its model as it was before adding beta * delta), waits tau0 steps per
    worker, then sends TOKEN. Each message is
    a header [kind, origin, stop, counts..., done...]: every holder writes its samples and whether
    its workers are done, so every cluster knows the others' progress as of the token's last
    visit. When a holder sees every cluster done, it sends STOP round the ring. ``request_stop()``
    (the target accuracy was reached) travels with the token and raises each cluster's stop flag.
    """

    def __init__(
        self,
        cfg: RunConfig,
        rank: int,
        n: int,
        model: nn.Module,
        counts: torch.Tensor,
        stop_flag: torch.Tensor,
        lr: torch.Tensor,
    ) -> None:
        self.cfg, self.rank, self.n = cfg, rank, n
        self.opts = RingOptions.from_mapping(cfg.options)
        self.lr = lr  # the cluster's learning rate, as its workers last set it (shared)
        self.model, self.params, self.counts, self.stop_flag = model, params(model), counts, stop_flag
        self.next, self.prev = (rank + 1) % n, (rank - 1) % n
        self.beta, self.lam = ring_constants(n)
        self.known = torch.zeros(n, dtype=torch.int64)  # samples of each cluster, as last heard
        self.done = torch.zeros(n, dtype=torch.int64)
        self.stop_all = 0
        self.local_done = threading.Event()
        self.passes = 0
        self.bytes_sent = 0
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._guarded, name="distsgd-token-ring", daemon=True)

    def start(self) -> None:
        if self.n > 1:
            self.thread.start()

    def samples(self) -> int:
        return int(self.counts.sum())

    def steps(self) -> int:
        """This cluster's optimiser steps (each ``--accumulate`` micro-batches)."""
        return self.samples() // (self.cfg.batch_size * self.cfg.accumulate)

    def scale(self) -> float:
        """eta for an exchange now: the cluster's learning rate, or the fixed --ring-scale."""
        ring_scale = self.opts.ring_scale
        return float(self.lr[0]) if ring_scale == "lr" else float(ring_scale)

    def global_samples(self) -> int:
        """All clusters' samples: this one's now, the others' as of the token's last visit."""
        return int(self.known.sum() - self.known[self.rank]) + int(self.samples())

    def request_stop(self) -> None:
        self.stop_all = 1
        self.stop_flag.fill_(1)

    # -- the ring thread ---------------------------------------------------------------------
    def _send_header(self, kind: int, origin: int) -> None:
        self.known[self.rank] = self.samples()
        self.done[self.rank] = int(self.local_done.is_set())
        header = torch.cat([torch.tensor([kind, origin, self.stop_all]), self.known, self.done])
        dist.send(header, self.next, tag=1)
        self.bytes_sent += header.numel() * header.element_size()

    def _read_header(self, header: torch.Tensor) -> tuple[int, int]:
        kind, origin, stop_all = (int(v) for v in header[:3])
        mine = int(self.known[self.rank])
        self.known = torch.maximum(self.known, header[3 : 3 + self.n])
        self.known[self.rank] = mine
        self.done = torch.maximum(self.done, header[3 + self.n :])
        if stop_all and not self.stop_all:
            self.request_stop()
        return kind, origin

    def _guarded(self) -> None:
        try:
            self._run()
        except BaseException as exc:  # reported by finish()
            self.error = exc

    def _run(self) -> None:
        old = self._flat()
        header = torch.zeros(3 + 2 * self.n, dtype=torch.int64)
        holding = self.rank == 0
        while True:
            if holding:
                old = self._exchange(old)
                synced_at = self.steps()
                while (
                    not self.local_done.is_set()
                    and self.steps() - synced_at < self.opts.update_delay * self.opts.cluster_size
                ):
                    time.sleep(0.0005)
                self.done[self.rank] = int(self.local_done.is_set())
                if bool(self.done.all()):
                    self._send_header(STOP, self.rank)
                    return
                self._send_header(TOKEN, -1)
                holding = False
                continue
            dist.recv(header, self.prev, tag=1)
            kind, origin = self._read_header(header)
            if kind == STOP:
                if self.next != origin:
                    dist.send(header, self.next, tag=1)
                    self.bytes_sent += header.numel() * header.element_size()
                return
            if kind == TOKEN:
                holding = True
                continue
            sent = torch.empty_like(old)  # SYNC: the holder's delta; answer with the model before adding beta * it
            dist.recv(sent, self.prev, tag=2)
            w = self._flat()
            dist.send(w, self.prev, tag=3)
            self.bytes_sent += w.numel() * w.element_size()
            add_into((self.beta * sent).to(self.params[0].device), self.params)

    def _flat(self) -> torch.Tensor:
        """This cluster's model, flat, on the CPU (gloo's point-to-point messages take host memory)."""
        return flatten(self.params).cpu()

    def _exchange(self, old: torch.Tensor) -> torch.Tensor:
        """The holder's exchange with the next cluster; returns the new w_i_old."""
        w = self._flat()
        delta, sent = split_delta(w, old, self.scale(), self.opts.ring_tolerance)
        self._send_header(SYNC, -1)
        dist.send(sent, self.next, tag=2)
        w_next = torch.empty_like(w)
        dist.recv(w_next, self.next, tag=3)
        step = holder_increment(w, w_next, delta, sent, self.beta, self.lam)
        add_into(step.to(self.params[0].device), self.params)
        self.bytes_sent += sent.numel() * sent.element_size()
        self.passes += 1
        return w + step - (delta - sent)

    def finish(self) -> int:
        """This cluster's workers are done: keep passing until every cluster is; then make every
        cluster's model the average of all (the model to evaluate and save; floating-point buffers
        averaged, integer ones rank 0's) and return the samples of all clusters."""
        self.local_done.set()
        if self.n > 1:
            self.thread.join()
        if self.error is not None:
            raise RuntimeError(f"the token ring failed: {self.error}") from self.error
        total = torch.tensor([int(self.samples())])
        if self.n > 1:
            average_model_(self.model, self.n)
            dist.all_reduce(total)
        return int(total)

    def figures(self, workers: Figures) -> RingFigures:
        """This cluster's figures: its workers' (``workers``), the passes it made and the bytes it sent."""
        return RingFigures(
            **{**vars(workers), "bytes_sent": self.bytes_sent},
            clusters=self.n,
            ring_beta=self.beta,
            ring_lambda=self.lam,
            token_passes=self.passes,
        )
