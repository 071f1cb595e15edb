"""diloco: DiLoCo (Douillard, Feng, Rusu, Chhaparia, Donchev, Kuncoro, Ranzato, Szlam, Shen,
"DiLoCo: Distributed Low-Communication Training of Language Models", 2023).

Update rule: every worker starts a round from the global parameters theta, takes H inner steps
(``--sync-every H``, 500 by default as in the paper) on its own shard with the inner optimiser
(``--inner-optimizer``, AdamW by default, at ``--lr`` and ``--weight-decay``: by default the paper's
4e-4 and 0.1 for AdamW, not the generic 0.01 and 0, unless the model has its own (gpt: 1e-3, 0.1),
which come first; its state is kept from round to round),
reaching theta_r. Then the outer step, with one all-reduce:

    Delta  = (1/W) sum_r (theta - theta_r)          the averaged pseudo-gradient
    theta <- OuterSGD(theta, Delta)                 Nesterov momentum, --outer-lr 0.7, --outer-momentum 0.9

(PyTorch's SGD with ``nesterov=True``: b <- mu b + Delta; theta <- theta - lr (Delta + mu b)),
and every worker continues from the new theta. With ``--compress fp16|powersgd[:R]`` the
pseudo-gradient travels through the compressor (PowerSGD with error feedback). Communication is
one model's worth every H steps: with H = 500, 1/500 of what ``allreduce`` sends per sample.

Buffers (BatchNorm statistics): floating-point buffers are averaged at each outer step, integer
ones copied from rank 0, as in local-sgd. The model evaluated and returned is the global one,
theta (with the buffers of the last outer step).

Only full rounds take an outer step (the paper's Algorithm 1; torchft's ``DiLoCo`` likewise).
A round cut short, by the run's end or by an evaluation inside it, ends as ``--partial-round``
says: ``average`` (the default) returns the workers' models averaged, theta - Delta, through the
compressor, with no outer step and no momentum; ``step`` takes the outer step as on a full round
(with momentum 0.9 it moves ~1.3x the partial pseudo-gradient even after one inner step);
``theta`` returns the last full round's theta, dropping the round's steps. Measured on the same
workers' models (benchmarks/partial_round.py; docs/BENCHMARKS.md, "DiLoCo's partial round"),
``average`` is the default: ``step`` overshoots, and ``theta`` returns an untrained model for runs
shorter than H. An evaluation inside a round makes
that same ending on copies of theta, the outer momentum and the compressor's state (its bytes are
``eval_bytes_sent``), so the model that reaches a target is the model saved.
Checkpoints hold theta, the outer momentum and the inner optimiser's state: a resumed run ends
with exactly the loss of an uninterrupted one.
"""

from __future__ import annotations

import copy
import logging
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
from torch import nn

from distsgd.algorithms import compress
from distsgd.algorithms.averaging import adopt_buffers_, average_buffers_, broadcast_, params
from distsgd.algorithms.base import GroupAlgorithm, GroupFigures, register
from distsgd.algorithms.periodic import averaged_once, period_option, refuse_epochs_in_own_loop, untrained_by_theta
from distsgd.checkpoint import count
from distsgd.config import OPTIMIZERS, Period, RunConfig
from distsgd.errors import ConfigError
from distsgd.options import Options, option
from distsgd.schedule import Periodic
from distsgd.train.context import Start, Step, WorkerContext
from distsgd.train.optim import build_optimizer, internal

PARTIAL_ROUNDS = ("average", "theta", "step")

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class OuterOptions(Options):
    """The inner and outer optimisers of DiLoCo and the algorithms built on it."""

    inner_optimizer: str = option(
        "adamw",
        "the workers' inner optimiser (sgd, adam, adamw) at --lr and --weight-decay",
        metavar="NAME",
    )
    outer_lr: float = option(0.7, "the outer SGD's learning rate on the averaged pseudo-gradient")
    outer_momentum: float = option(0.9, "the outer SGD's Nesterov momentum", metavar="MU")
    partial_round: str = option(
        "average",
        "what a round cut short returns (the run's end, an evaluation inside "
        "a round): average (the workers' models averaged), theta (the last "
        "outer step's model, the round's steps dropped) or step (an outer step "
        "on the partial pseudo-gradient)",
        metavar="RULE",
    )

    def check(self, cfg: RunConfig) -> None:
        if self.inner_optimizer not in OPTIMIZERS:
            raise ConfigError(
                f"unknown --inner-optimizer '{self.inner_optimizer}' (choose from {', '.join(OPTIMIZERS)})"
            )
        if not self.outer_lr > 0:
            raise ConfigError(f"--outer-lr must be positive, got {self.outer_lr}")
        if not 0 <= self.outer_momentum < 1:
            raise ConfigError(f"--outer-momentum must be in [0, 1), got {self.outer_momentum}")
        if self.partial_round not in PARTIAL_ROUNDS:
            raise ConfigError(f"--partial-round must be one of {', '.join(PARTIAL_ROUNDS)}, got '{self.partial_round}'")


@dataclass(frozen=True)
class DiLoCoOptions(OuterOptions, compress.CompressOptions):
    sync_every: Period = period_option(500, "inner steps H between outer steps (the paper's 500), or 'epoch'")

    def check(self, cfg: RunConfig) -> None:
        OuterOptions.check(self, cfg)
        compress.CompressOptions.check(self, cfg)


@dataclass
class DiLoCoFigures(GroupFigures):
    outer_steps: int | None = None


def paper_inner_defaults(inner_optimizer: str) -> dict[str, Any]:
    """The paper's inner AdamW (Douillard et al. 2023, its hyperparameter table): lr 4e-4, weight
    decay 0.1. (SGD or Adam inside keep the generic defaults.)"""
    return {"lr": 4e-4, "weight_decay": 0.1} if inner_optimizer == "adamw" else {}


OuterOptionsT = TypeVar("OuterOptionsT", bound=OuterOptions)


class InnerOuter(GroupAlgorithm[OuterOptionsT]):
    """What DiLoCo and its streaming variant share: the inner optimiser (--inner-optimizer, at the
    paper's defaults for AdamW)."""

    @classmethod
    def default_settings(cls, cfg: RunConfig) -> dict[str, Any]:
        """The paper's inner settings, and --optimizer recorded as the inner optimiser (config.toml
        says what the workers step). An --optimizer of another name is refused: it would be ignored
        (`--algo diloco --optimizer sgd` trained AdamW, at SGD's lr, silently)."""
        inner = cls.parse_options(cfg).inner_optimizer
        if cfg.optimizer is not None and cfg.optimizer != inner:
            raise ConfigError(
                f"under {cls.name} the workers' optimiser is --inner-optimizer ({inner}, its lr and weight "
                f"decay the paper's unless given): use --inner-optimizer {cfg.optimizer}, not --optimizer {cfg.optimizer}"
            )
        return {**paper_inner_defaults(inner), "optimizer": inner}

    def check_optimizer_name(self, ctx: WorkerContext, name: str) -> None:
        raise ConfigError(
            f"under {self.name} the workers' optimiser is --inner-optimizer, whose lr and weight decay "
            f"default to its paper's: give distsgd.spawn(inner_optimizer='{name}', lr=...), not run.setup('{name}')"
        )

    def make_optimizer(self, ctx: WorkerContext, model: nn.Module) -> torch.optim.Optimizer:
        """The inner optimiser: --inner-optimizer (or the user's optimizer= / param_groups=)."""
        return build_optimizer(
            self.cfg.replace(optimizer=self.opts.inner_optimizer), model, ctx.job.optimizer, ctx.job.param_groups
        )


@register
class DiLoCo(InnerOuter[DiLoCoOptions]):
    name = "diloco"
    kind = "low communication"
    trains_through = True  # every collective through the averaging helpers and compressors, on fresh buffers
    local_model = True
    summary_line = "DiLoCo: H inner AdamW steps, then outer Nesterov SGD on the averaged pseudo-gradient"
    collective_evaluation = True  # in the middle of a round, the average of the workers' models

    period: Periodic  # an outer step every H inner steps; whether one is owed (checkpointed)
    rounds: int  # outer steps taken (checkpointed)
    untrained: bool  # the model returned is the starting one (--partial-round theta, no outer step)
    compressor: compress.Compressor  # how the pseudo-gradients are averaged (checkpointed)
    # built by setup:
    params: list[torch.Tensor]  # this worker's, theta_r
    global_model: nn.Module  # theta and the buffers of the last outer step (checkpointed)
    theta: list[torch.Tensor]  # global_model's parameters
    outer: torch.optim.Optimizer  # the outer Nesterov SGD on theta (checkpointed)

    @classmethod
    def check_own_loop(cls, cfg: RunConfig) -> None:
        refuse_epochs_in_own_loop(cls.parse_options(cfg).sync_every, cls.name)

    def __init__(self, cfg: RunConfig, seat: object = None) -> None:
        super().__init__(cfg, seat)
        self.period = Periodic.of(self.opts.sync_every)
        self.rounds = 0
        self.untrained = False
        self.compressor = compress.make(self.opts.compress)

    def setup(self, ctx: WorkerContext, model: nn.Module, start: Start) -> nn.Module:
        model = super().setup(ctx, model, start)
        self.params = params(model)
        if start is Start.FRESH:  # one starting point (a resumed worker restores theta below)
            broadcast_(self.params + list(model.buffers()))
        self.global_model = copy.deepcopy(model)
        self.theta = params(self.global_model)
        self.outer = self._make_outer(self.theta)
        return model

    def _make_outer(self, theta: list[torch.Tensor]) -> torch.optim.Optimizer:
        return internal(
            torch.optim.SGD(
                theta, lr=self.opts.outer_lr, momentum=self.opts.outer_momentum, nesterov=self.opts.outer_momentum > 0
            )
        )

    def after_step(self, ctx: WorkerContext, model: nn.Module, step: Step) -> None:
        self.period.stepped()
        if self.period.due(step.number):
            self.outer_step(model)

    def on_epoch_end(self, ctx: WorkerContext, model: nn.Module, epoch: int) -> None:
        if self.period.each_epoch:
            self.outer_step(model)

    def outer_step(self, model: nn.Module) -> None:
        """Average the pseudo-gradients, step theta, and start the next round from it."""
        self.sent(self._outer_step_on(model, self.global_model, self.outer, self.compressor), self.world)
        with torch.no_grad():
            for p, t in zip(self.params, self.theta):
                p.copy_(t)
            for local, global_ in zip(model.buffers(), self.global_model.buffers()):
                local.copy_(global_)
        self.rounds += 1
        self.period.synced()

    def _outer_step_on(
        self, model: nn.Module, target: nn.Module, outer: torch.optim.Optimizer | None, compressor: compress.Compressor
    ) -> int:
        """One outer step of ``target`` (theta) with ``outer`` on the pseudo-gradients of this
        worker's ``model``, averaged through ``compressor`` (``outer`` None: theta <- theta - Delta,
        the workers' models averaged, no momentum); ``target``'s buffers become the average of the
        workers' (integer ones rank 0's). Returns the bytes all-reduced. The worker's model is left
        alone, so that an evaluation can make the step on copies."""
        theta = params(target)
        delta = [t.detach() - p.detach() for t, p in zip(theta, self.params)]
        sent = compressor.allreduce_mean_(delta, self.world)
        if outer is None:
            with torch.no_grad():
                for t, d in zip(theta, delta):
                    t.sub_(d)
        else:
            for t, d, p in zip(theta, delta, self.params):
                if p.requires_grad:
                    t.grad = d
                else:  # frozen (by the user's loop, during the run): the round's average, and no
                    # outer momentum to carry it on, as an optimiser leaves a parameter without a gradient
                    with torch.no_grad():
                        t.sub_(d)
                    t.grad = None
            outer.step()
        with torch.no_grad():
            for local, global_ in zip(model.buffers(), target.buffers()):
                global_.copy_(local)
        return sent + average_buffers_(target, self.world)

    def weights_loaded(self, ctx: WorkerContext, model: nn.Module) -> None:
        """Weights the user's loop loaded (on every worker) are the new theta: the next outer step's
        pseudo-gradient counts the inner steps from them, not from the old theta."""
        self.global_model.load_state_dict(self.unwrap(model).state_dict())

    def evaluation_model(self, ctx: WorkerContext, model: nn.Module) -> nn.Module:
        """What :meth:`final_model` would return now: theta after the last outer step or, in the
        middle of a round, what ``--partial-round`` makes of the round so far, on copies of theta,
        the outer momentum and the compressor's state (every worker takes part: one all-reduce,
        whose bytes count as ``eval_bytes_sent``, not as the algorithm's)."""
        rule = self.opts.partial_round
        if not self.period.pending or rule == "theta":
            return self.global_model
        target = copy.deepcopy(self.global_model)
        outer = None
        if rule == "step":
            outer = self._make_outer(params(target))
            outer.load_state_dict(copy.deepcopy(self.outer.state_dict()))
        self.sent_to_evaluate(self._outer_step_on(model, target, outer, copy.deepcopy(self.compressor)), self.world)
        return target

    def final_model(self, ctx: WorkerContext, model: nn.Module) -> nn.Module:
        """theta; a last, partial round ends as ``--partial-round`` says."""
        rule = self.opts.partial_round
        self.untrained = self.period.pending and rule == "theta" and self.rounds == 0
        if self.untrained and ctx.rank == 0:
            log.warning("%s", untrained_by_theta(self.opts.sync_every, self.name))
        if self.period.pending and rule == "average" and self.rounds == 0 and ctx.rank == 0:
            log.warning("%s", averaged_once(self.opts.sync_every, self.name))
        if self.period.pending and rule == "step":
            self.outer_step(model)
        elif self.period.pending and rule == "average":
            self.sent(self._outer_step_on(model, self.global_model, None, self.compressor), self.world)
            self.period.synced()
        elif not self.period.pending and ctx.job.main is not None:  # a loop's update_bn after the last outer step
            changed = any(not torch.equal(a, b) for a, b in zip(model.buffers(), self.global_model.buffers()))
            self.sent(adopt_buffers_(self.global_model, model, changed, self.world), self.world)
        return self.global_model

    def state_dict(self) -> dict[str, Any]:
        return {
            **super().state_dict(),
            "rounds": self.rounds,
            "period": self.period.state_dict(),
            "global": {k: v.clone() for k, v in self.global_model.state_dict().items()},
            "outer": self.outer.state_dict(),
            "compressor": self.compressor.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.rounds = count(state, "rounds")
        self.period.load_state_dict(state["period"])
        self.global_model.load_state_dict(state["global"])
        self.outer.load_state_dict(state["outer"])
        self.compressor.load_state_dict(state["compressor"], self.params[0].device)

    def figures(self) -> DiLoCoFigures:
        return DiLoCoFigures(
            **{**vars(super().figures()), "untrained": self.untrained or None}, outer_steps=self.rounds
        )
