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

Here the clusters are on one machine and w_next lives in shared memory too; ``bytes_sent``
counts the delta each pass hands to the next cluster (what a pass would send between machines).
The model evaluated and saved is the average of the cluster models. Optimiser state is per worker,
as in Hogwild!.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
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


@register
class HogwildPP(Hogwild):
    name = "hogwild++"
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
