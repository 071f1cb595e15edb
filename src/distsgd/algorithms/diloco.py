"""diloco: DiLoCo (Douillard, Feng, Rusu, Chhaparia, Donchev, Kuncoro, Ranzato, Szlam, Shen,
"DiLoCo: Distributed Low-Communication Training of Language Models", 2023).

Update rule: every worker starts a round from the global parameters theta, takes H inner steps
(``--sync-every H``, 500 by default as in the paper) on its own shard with the inner optimiser (``--inner-optimizer``, AdamW by
default, at ``--lr``; its state is kept from round to round), reaching theta_r. Then the outer
step, with one all-reduce:

    Delta  = (1/W) sum_r (theta - theta_r)          the averaged pseudo-gradient
    theta <- OuterSGD(theta, Delta)                 Nesterov momentum, --outer-lr 0.7, --outer-momentum 0.9

(PyTorch's SGD with ``nesterov=True``: b <- mu b + Delta; theta <- theta - lr (Delta + mu b)),
and every worker continues from the new theta. With ``--compress fp16|powersgd[:R]`` the
pseudo-gradient travels through the compressor (PowerSGD with error feedback). Communication is
one model's worth every H steps: with H = 500, 1/500 of what ``allreduce`` sends per sample.

Buffers (BatchNorm statistics): floating-point buffers are averaged at each outer step, integer
ones copied from rank 0, as in local-sgd. The model evaluated and returned is the global one,
theta (with the buffers of the last outer step); the last, partial round ends with an outer step.
Checkpoints hold theta, the outer momentum and the inner optimiser's state: a resumed run ends
with exactly the loss of an uninterrupted one.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn

from distsgd.algorithms import compress
from distsgd.algorithms.averaging import average_buffers_, broadcast_, params
from distsgd.algorithms.base import GroupAlgorithm, register
from distsgd.config import OPTIMIZERS, Period, RunConfig
from distsgd.errors import ConfigError
from distsgd.train.context import WorkerContext
from distsgd.train.optim import build_optimizer


DEFAULT_H = Period(500)  # the paper's inner steps per round


@register
class DiLoCo(GroupAlgorithm):
    name = "diloco"
    compresses = True
    summary_line = "DiLoCo: H inner AdamW steps, then outer Nesterov SGD on the averaged pseudo-gradient"

    @classmethod
    def check(cls, cfg: RunConfig) -> None:
        cfg.sync_period  # parses --sync-every
        if cfg.inner_optimizer not in OPTIMIZERS:
            raise ConfigError(f"unknown --inner-optimizer '{cfg.inner_optimizer}' (choose from {', '.join(OPTIMIZERS)})")
        if not cfg.outer_lr > 0:
            raise ConfigError(f"--outer-lr must be positive, got {cfg.outer_lr}")
        if not 0 <= cfg.outer_momentum < 1:
            raise ConfigError(f"--outer-momentum must be in [0, 1), got {cfg.outer_momentum}")

    def make_optimizer(self, ctx: WorkerContext, model: nn.Module) -> torch.optim.Optimizer:
        """The inner optimiser: --inner-optimizer (or the user's optimizer= / param_groups=)."""
        return build_optimizer(self.cfg.replace(optimizer=self.cfg.inner_optimizer), model, ctx.job.optimizer,
                               ctx.job.param_groups)

    def setup(self, ctx: WorkerContext, model: nn.Module) -> nn.Module:
        self.world = ctx.world
        self.every = (self.cfg.sync_period or DEFAULT_H).count  # None: at each epoch's end
        self.params = params(model)
        if not ctx.resumed:  # one starting point (a resumed worker restores theta below)
            broadcast_(self.params + list(model.buffers()))
        self.global_model = copy.deepcopy(model)  # theta and the buffers of the last outer step
        self.theta = params(self.global_model)
        self.outer = torch.optim.SGD(self.theta, lr=self.cfg.outer_lr, momentum=self.cfg.outer_momentum,
                                     nesterov=self.cfg.outer_momentum > 0)
        self.compressor = compress.make(self.cfg.compress)
        self.steps = 0
        self.rounds = 0
        self.dirty = False
        return model

    def after_step(self, ctx: WorkerContext, model: nn.Module, local_samples: int) -> None:
        self.steps += 1
        self.dirty = True
        if self.every is not None and self.steps % self.every == 0:
            self.outer_step(model)

    def on_epoch_end(self, ctx: WorkerContext, model: nn.Module, epoch: int) -> None:
        if self.every is None:
            self.outer_step(model)

    def outer_step(self, model: nn.Module) -> None:
        """Average the pseudo-gradients, step theta, and start the next round from it."""
        delta = [t - p.detach() for t, p in zip(self.theta, self.params)]
        self.sent(self.compressor.allreduce_mean_(delta, self.world), self.world)
        for t, d in zip(self.theta, delta):
            t.grad = d
        self.outer.step()
        with torch.no_grad():
            for p, t in zip(self.params, self.theta):
                p.copy_(t)
        self.sent(average_buffers_(model, self.world), self.world)
        for mine, kept in zip(model.buffers(), self.global_model.buffers()):
            kept.copy_(mine)
        self.rounds += 1
        self.dirty = False

    def evaluation_model(self, ctx: WorkerContext, model: nn.Module) -> nn.Module:
        """theta: the global model, the same on every worker (no communication)."""
        return self.global_model

    def final_model(self, ctx: WorkerContext, model: nn.Module) -> nn.Module:
        if self.dirty:  # the last, partial round
            self.outer_step(model)
        return self.global_model

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "steps": self.steps, "rounds": self.rounds, "dirty": self.dirty,
                "global": {k: v.clone() for k, v in self.global_model.state_dict().items()},
                "outer": self.outer.state_dict(), "compressor": self.compressor.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.steps, self.rounds, self.dirty = state["steps"], state["rounds"], state["dirty"]
        self.global_model.load_state_dict(state["global"])
        self.outer.load_state_dict(state["outer"])
        self.compressor.load_state_dict(state["compressor"])

    def summary(self) -> dict[str, Any]:
        return {**super().summary(), "outer_steps": self.rounds}
