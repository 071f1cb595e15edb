"""hogwild++: HogWild++ (Zhang, Hsieh, Akella, ICDM 2016): clusters of Hogwild! workers, kept
together by a token passed around a ring.

Workers form clusters of ``--cluster-size C`` processes; each cluster runs Hogwild! on its own
model w_i in shared memory (n = workers / C clusters). A token travels round the ring of clusters.
The cluster holding it, once it has made ``--update-delay`` local updates since it last held it:

    delta   = w_i - w_i_old
    w_next <- w_next + beta * delta
    w_i    <- lambda * w_next + (1 - lambda) * w_i + (beta + lambda - 1) * delta
    w_i_old <- w_i

and passes the token to the next cluster. beta solves beta^n + beta - 1 = 0 and
lambda = 1 - beta^(n - 1), so that, as the paper shows, the models' average is preserved.

On one machine (``--workers N``) the clusters' models all live in shared memory and the worker
that finds the token ready makes the pass; ``bytes_sent`` counts the delta each pass hands to the
next cluster. Across machines (torchrun, one process per node) each torchrun process is one
cluster: it starts ``--cluster-size`` local Hogwild! workers on its model in shared memory and
passes the token to the next process with torch.distributed point-to-point messages
(:class:`TokenRing`): the holder sends delta, the next cluster adds beta * delta to its model and
answers with it, and the holder applies the rule above as an increment (so the local updates made
during the round trip are kept). There ``bytes_sent`` counts both messages. The model evaluated
and saved is the average of the cluster models. Optimiser state is per worker, as in Hogwild!.
"""

from __future__ import annotations

import copy
import threading
import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from distsgd.algorithms.averaging import flatten, unflatten_into
from distsgd.algorithms.base import register
from distsgd.algorithms.hogwild import Hogwild, bind_to_shared
from distsgd.config import RunConfig
from distsgd.errors import ConfigError
from distsgd.train.loop import WorkerContext


def ring_constants(n: int) -> tuple[float, float]:
    """(beta, lambda): beta in (0, 1) solves beta^n + beta - 1 = 0; lambda = 1 - beta^(n - 1)."""
    lo, hi = 0.0, 1.0
    for _ in range(200):
        mid = (lo + hi) / 2
        if mid ** n + mid - 1 > 0:
            hi = mid
        else:
            lo = mid
    beta = (lo + hi) / 2
    return beta, 1 - beta ** (n - 1)


def token_pass(w_i: torch.Tensor, w_next: torch.Tensor, w_old: torch.Tensor, beta: float,
               lam: float) -> tuple[torch.Tensor, torch.Tensor]:
    """One pass of the token on flat tensors: returns the new (w_i, w_next); w_i_old becomes w_i."""
    delta = w_i - w_old
    w_next = w_next + beta * delta
    w_i = lam * w_next + (1 - lam) * w_i + (beta + lam - 1) * delta
    return w_i, w_next


def holder_increment(w_i: torch.Tensor, w_next: torch.Tensor, delta: torch.Tensor, beta: float,
                     lam: float) -> torch.Tensor:
    """Across processes the holder adds this to w_i, where w_next is the next cluster's model after
    it added beta * delta: w_i + increment is the new w_i of :func:`token_pass`. As an increment it
    keeps the local updates made to w_i while the token's messages travelled."""
    return lam * (w_next - w_i) + (beta + lam - 1) * delta


@register
class HogwildPP(Hogwild):
    name = "hogwild++"
    across_nodes = True  # under torchrun: one cluster per process, see TokenRing
    summary_line = "HogWild++: clusters of Hogwild! workers synced by a token ring (--cluster-size, --update-delay)"

    @classmethod
    def check(cls, cfg: RunConfig) -> None:
        if cfg.workers % cfg.cluster_size:
            raise ConfigError(f"--workers {cfg.workers} is not a multiple of --cluster-size {cfg.cluster_size}")

    @classmethod
    def models(cls, cfg: RunConfig) -> int:
        return cfg.workers // cfg.cluster_size

    @classmethod
    def shared_extras(cls, cfg: RunConfig, mpc: Any, states: list[dict[str, torch.Tensor]]) -> dict[str, Any]:
        n = len(states)
        old = [flatten(list(s.values())).share_memory_() for s in states]
        return {"old": old, "token": torch.zeros(1, dtype=torch.int64).share_memory_(),
                "held_at": torch.zeros(n, dtype=torch.int64).share_memory_(),
                "passes": torch.zeros(1, dtype=torch.int64).share_memory_(), "ring_lock": mpc.Lock()}

    @classmethod
    def combine(cls, states: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        return {k: torch.stack([s[k].detach() for s in states]).mean(dim=0).to(states[0][k].dtype)
                for k in states[0]}

    def setup(self, ctx: WorkerContext, model: nn.Module) -> nn.Module:
        states = ctx.state["shared_states"]
        self.n = len(states)
        self.cluster = ctx.rank // self.cfg.cluster_size
        self.members = range(self.cluster * self.cfg.cluster_size, (self.cluster + 1) * self.cfg.cluster_size)
        ctx.state = {**ctx.state, "shared_state": states[self.cluster]}
        model = super().setup(ctx, model)
        self.mine = [p for p in model.parameters()]
        nxt = bind_to_shared(copy.deepcopy(model), states[(self.cluster + 1) % self.n]) if self.n > 1 else None
        self.next_params = [p for p in nxt.parameters()] if nxt is not None else []
        self.beta, self.lam = ring_constants(self.n)
        self.old = ctx.state["old"][self.cluster]
        self.token, self.held_at, self.passes = ctx.state["token"], ctx.state["held_at"], ctx.state["passes"]
        self.ring_lock = ctx.state["ring_lock"]
        self.steps = 0
        return model

    def after_step(self, ctx: WorkerContext, model: nn.Module, local_samples: int) -> None:
        super().after_step(ctx, model, local_samples)
        self.steps += 1
        if self.n == 1 or int(self.token) != self.cluster:
            return
        cluster_steps = int(self.counts[self.members.start:self.members.stop].sum()) // self.cfg.batch_size
        if cluster_steps - int(self.held_at[self.cluster]) < self.cfg.update_delay:
            return
        if not self.ring_lock.acquire(block=False):
            return
        try:
            if int(self.token) != self.cluster:  # another worker of this cluster passed it already
                return
            w_i, w_next = token_pass(flatten(self.mine), flatten(self.next_params), self.old, self.beta, self.lam)
            unflatten_into(w_next, self.next_params)
            unflatten_into(w_i, self.mine)
            self.old.copy_(w_i)
            self.bytes_sent += w_i.numel() * w_i.element_size()
            self.held_at[self.cluster] = cluster_steps
            self.passes += 1
            self.token.fill_((self.cluster + 1) % self.n)
        finally:
            self.ring_lock.release()

    def summary(self) -> dict[str, Any]:
        out = super().summary()
        out.update(bytes_sent=self.bytes_sent, token_passes=int(self.passes[0]), clusters=self.n,
                   ring_beta=self.beta, ring_lambda=self.lam)
        return out


PASS, STOP = 0, 1  # kinds of ring message


class TokenRing:
    """The token ring between clusters in different processes (one per node under torchrun).

    Runs in a thread of each cluster's launching process, beside its local Hogwild! workers, over
    the default process group (one rank per cluster). ``params`` are the cluster model's shared
    parameter tensors; ``counts`` the samples of each of the cluster's workers (shared). Each message starts with a
    header [kind, origin, stop, counts..., done...]: every holder writes its samples and whether
    its workers are done, so every cluster knows the others' progress as of the token's last
    visit. When a holder sees every cluster done, it sends STOP round the ring. ``request_stop()``
    (the target accuracy was reached) travels with the token and sets each cluster's stop event.
    """

    def __init__(self, cfg: RunConfig, rank: int, n: int, params: list[torch.Tensor], counts: torch.Tensor,
                 stop_event: Any) -> None:
        self.cfg, self.rank, self.n = cfg, rank, n
        self.params, self.counts, self.stop_event = params, counts, stop_event
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
        return self.samples() // self.cfg.batch_size

    def global_samples(self) -> int:
        """All clusters' samples: this one's now, the others' as of the token's last visit."""
        return int(self.known.sum() - self.known[self.rank]) + int(self.samples())

    def request_stop(self) -> None:
        self.stop_all = 1
        self.stop_event.set()

    # -- the ring thread ---------------------------------------------------------------------
    def _header(self, kind: int, origin: int) -> torch.Tensor:
        return torch.cat([torch.tensor([kind, origin, self.stop_all]), self.known, self.done])

    def _guarded(self) -> None:
        try:
            self._run()
        except BaseException as exc:  # reported by finish()
            self.error = exc

    def _run(self) -> None:
        holding = self.rank == 0
        old = flatten(self.params).clone()
        held_at = 0
        header = torch.zeros(3 + 2 * self.n, dtype=torch.int64)
        while True:
            if holding:
                while not self.local_done.is_set() and self.steps() - held_at < self.cfg.update_delay:
                    time.sleep(0.0005)
                self.known[self.rank] = int(self.samples())
                self.done[self.rank] = int(self.local_done.is_set())
                if bool(self.done.all()):
                    dist.send(self._header(STOP, self.rank), self.next, tag=1)
                    return
                w = flatten(self.params)
                delta = w - old
                dist.send(self._header(PASS, -1), self.next, tag=1)
                dist.send(delta, self.next, tag=2)
                w_next = torch.empty_like(w)
                dist.recv(w_next, self.next, tag=3)
                step = holder_increment(w, w_next, delta, self.beta, self.lam)
                self._add(step)
                old = w + step
                held_at = self.steps()
                self.passes += 1
                self.bytes_sent += header.numel() * header.element_size() + delta.numel() * delta.element_size()
                holding = False
            else:
                dist.recv(header, self.prev, tag=1)
                kind, origin, stop_all = (int(v) for v in header[:3])
                counts, done = header[3:3 + self.n], header[3 + self.n:]
                mine = int(self.known[self.rank])
                self.known = torch.maximum(self.known, counts)
                self.known[self.rank] = mine
                self.done = torch.maximum(self.done, done)
                if stop_all and not self.stop_all:
                    self.request_stop()
                if kind == STOP:
                    if self.next != origin:
                        dist.send(header, self.next, tag=1)
                    return
                delta = torch.empty_like(old)
                dist.recv(delta, self.prev, tag=2)
                self._add(self.beta * delta)
                w = flatten(self.params)
                dist.send(w, self.prev, tag=3)
                self.bytes_sent += w.numel() * w.element_size()
                holding = True

    def _add(self, flat: torch.Tensor) -> None:
        """Add ``flat`` to the shared parameters in place (the workers keep writing meanwhile)."""
        offset = 0
        with torch.no_grad():
            for p in self.params:
                k = p.numel()
                p.add_(flat[offset:offset + k].view_as(p))
                offset += k

    def finish(self) -> int:
        """This cluster's workers are done: keep passing until every cluster is; then make every
        cluster's model the average of all (the model to evaluate and save) and return the
        samples of all clusters."""
        self.local_done.set()
        if self.n > 1:
            self.thread.join()
        if self.error is not None:
            raise RuntimeError(f"the token ring failed: {self.error}") from self.error
        total = torch.tensor([int(self.samples())])
        if self.n > 1:
            flat = flatten(self.params)
            dist.all_reduce(flat)
            unflatten_into(flat / self.n, self.params)
            dist.all_reduce(total)
        return int(total)

    def summary(self) -> dict[str, Any]:
        """This cluster's part: the passes it made and the bytes it sent."""
        return {"clusters": self.n, "ring_beta": self.beta, "ring_lambda": self.lam, "token_passes": self.passes,
                "bytes_sent": self.bytes_sent}
