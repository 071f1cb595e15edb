"""local-sgd: local SGD with periodic model averaging (Stich, ICLR 2019; Lin et al., "Don't Use
Large Mini-Batches, Use Local SGD", ICLR 2020).

Update rule: every worker takes H plain SGD steps on its own shard,
x_r <- x_r - lr * grad L(x_r; batch_r), then all workers average their parameters,
x_r <- (1/W) sum_s x_s, with one all-reduce. ``--sync-every H`` sets H; ``--sync-every epoch`` is
the seeds' per-epoch model averaging. ``--warmup-steps K`` first runs K steps of synchronous
all-reduce SGD (gradients averaged every step) before going local: post-local SGD.

Communication: one model's worth every H steps instead of one gradient's worth every step, so
H = 8 sends 1/8 of what ``allreduce`` does per sample. **Optimiser state stays local**: each
worker keeps its own momentum buffer, which is not averaged. The final model is the average.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from distsgd.algorithms.averaging import allreduce_mean_, params
from distsgd.algorithms.base import GroupAlgorithm, register
from distsgd.config import RunConfig, parse_every
from distsgd.train.loop import WorkerContext


def parse_sync_every(value: str) -> int | None:
    """'epoch' -> None (average at each epoch's end), else a positive number of steps."""
    return parse_every(value, "--sync-every", "steps")


@register
class LocalSGD(GroupAlgorithm):
    name = "local-sgd"
    summary_line = "local SGD: H local steps, then average the models (--sync-every H|epoch, --warmup-steps)"

    @classmethod
    def check(cls, cfg: RunConfig) -> None:
        parse_sync_every(cfg.sync_every)

    def setup(self, ctx: WorkerContext, model: nn.Module) -> nn.Module:
        self.world = ctx.world
        self.every = parse_sync_every(self.cfg.sync_every)
        self.params = params(model)
        self.steps = 0
        self.averagings = 0
        self.dirty = False
        if not ctx.resumed:  # start from one model (a resumed worker keeps its own)
            allreduce_mean_(self.params, self.world)
        return model

    def after_backward(self, ctx: WorkerContext, model: nn.Module) -> None:
        if self.steps < self.cfg.warmup_steps:  # post-local SGD: synchronous first
            grads = [p.grad for p in self.params if p.grad is not None]
            self.sent(allreduce_mean_(grads, self.world), self.world)

    def after_step(self, ctx: WorkerContext, model: nn.Module, local_samples: int) -> None:
        self.steps += 1
        self.dirty = self.steps > self.cfg.warmup_steps
        if self.steps > self.cfg.warmup_steps and self.every is not None \
                and (self.steps - self.cfg.warmup_steps) % self.every == 0:
            self._average()

    def on_epoch_end(self, ctx: WorkerContext, model: nn.Module, epoch: int) -> None:
        if self.every is None:
            self._average()

    def finish(self, ctx: WorkerContext, model: nn.Module) -> nn.Module:
        if self.dirty:  # return the average, not rank 0's own model
            self._average()
        return model

    def _average(self) -> None:
        self.sent(allreduce_mean_(self.params, self.world), self.world)
        self.averagings += 1
        self.dirty = False

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "steps": self.steps, "averagings": self.averagings, "dirty": self.dirty}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.steps, self.averagings, self.dirty = state["steps"], state["averagings"], state["dirty"]

    def summary(self) -> dict[str, Any]:
        return {**super().summary(), "averagings": self.averagings}
