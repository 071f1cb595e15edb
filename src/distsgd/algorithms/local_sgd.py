"""local-sgd: local SGD with periodic model averaging (Stich, ICLR 2019; Lin et al., "Don't Use
Large Mini-Batches, Use Local SGD", ICLR 2020).

Update rule: every worker takes H plain SGD steps on its own shard,
x_r <- x_r - lr * grad L(x_r; batch_r), then all workers average their parameters,
x_r <- (1/W) sum_s x_s, with one all-reduce. ``--sync-every H`` sets H; ``--sync-every epoch`` is
per-epoch model averaging. ``--warmup-steps K`` first runs K steps of synchronous
all-reduce SGD (gradients averaged every step) before going local: post-local SGD.

Communication: one model's worth every H steps instead of one gradient's worth every step, so
H = 8 sends 1/8 of what ``allreduce`` does per sample. With ``--compress fp16|powersgd[:R]`` the
workers average the change of their parameters since the last averaging, x_r - x_last, through
the compressor (PowerSGD with error feedback), and x <- x_last + mean change. **Optimiser state stays local**: each
worker keeps its own momentum buffer, which is not averaged.

Buffers (BatchNorm statistics): averaged with the parameters (floating-point buffers in the same
all-reduce), integer ones copied from rank 0; during warm-up, averaged after every step.

What is evaluated and returned is the average, made the algorithm's way (with ``--compress``: the
anchor plus the compressed mean change): at an evaluation point between two averagings the
workers make that average on copies (the models, the anchor and the compressor's error feedback
are left alone; its bytes are ``eval_bytes_sent``), and the last, partial period is averaged at
the end the same way, so the model saved is the one evaluated.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from distsgd.algorithms import compress
from distsgd.algorithms.averaging import (
    allreduce_mean_,
    average_buffers_,
    average_model_,
    broadcast_,
    flagged_grads,
    float_buffers,
    params,
    take_flagged,
)
from distsgd.algorithms.base import GroupAlgorithm, GroupFigures, register
from distsgd.algorithms.periodic import period_option, refuse_epochs_in_own_loop
from distsgd.checkpoint import count
from distsgd.config import Period, RunConfig
from distsgd.errors import ConfigError
from distsgd.options import option
from distsgd.schedule import Periodic
from distsgd.train.context import Start, Step, WorkerContext


@dataclass(frozen=True)
class LocalSGDOptions(compress.CompressOptions):
    sync_every: Period = period_option(8, "average the models every H steps, or at each 'epoch' end")
    warmup_steps: int = option(0, "synchronous all-reduce steps before going local (post-local SGD)", metavar="K")

    def check(self, cfg: RunConfig) -> None:
        super().check(cfg)
        if self.warmup_steps < 0:
            raise ConfigError(f"--warmup-steps must be >= 0, got {self.warmup_steps}")


@dataclass
class LocalSGDFigures(GroupFigures):
    averagings: int | None = None


@register
class LocalSGD(GroupAlgorithm[LocalSGDOptions]):
    name = "local-sgd"
    kind = "model averaging"
    trains_through = True  # every collective through the averaging helpers and compressors, on fresh buffers
    local_model = True
    summary_line = "H local steps, then average the models (--sync-every H|epoch, --warmup-steps for post-local SGD)"
    collective_evaluation = True  # in the middle of a period, the average of the workers' models

    period: Periodic  # after steps K + H, K + 2H, ... (K warm-up steps); whether an averaging is owed (checkpointed)
    averagings: int  # averagings made (checkpointed)
    compressor: compress.Compressor | None  # --compress: averages the change since the anchor (checkpointed)
    # built by setup:
    params: list[torch.Tensor]
    anchor: list[torch.Tensor]  # x_last, with a compressor: the parameters at the last averaging (checkpointed)
    flags: torch.Tensor  # warm-up: one a parameter, 1 where it has a gradient (see averaging.flagged_grads)

    def __init__(self, cfg: RunConfig, seat: object = None) -> None:
        super().__init__(cfg, seat)
        every = self.opts.sync_every.count
        self.period = Periodic(every, None if every is None else self.opts.warmup_steps + every)
        self.averagings = 0
        self.compressor = compress.make(self.opts.compress) if self.opts.compress != "none" else None

    @classmethod
    def check_own_loop(cls, cfg: RunConfig) -> None:
        refuse_epochs_in_own_loop(cls.parse_options(cfg).sync_every, cls.name)

    def setup(self, ctx: WorkerContext, model: nn.Module, start: Start) -> nn.Module:
        model = super().setup(ctx, model, start)
        self.params = params(model)
        # warm-up: which parameters had a gradient on any rank, reduced with the gradients
        first = self.params[0] if self.params else torch.zeros(0, device=ctx.device)
        self.flags = torch.ones(len(self.params), dtype=first.dtype, device=first.device)
        if start is Start.FRESH:  # start from one model, rank 0's (a resumed worker keeps its own): the average
            # of models each rank built with its own seed (nanoGPT's habit) is none of them, its weights shrunk
            broadcast_([*model.parameters(), *model.buffers()])
        self.anchor = [p.detach().clone() for p in self.params] if self.compressor else []
        return model

    def after_backward(self, ctx: WorkerContext, model: nn.Module, step: Step) -> None:
        if step.number <= self.opts.warmup_steps:  # post-local SGD: synchronous first
            # as allreduce: a parameter with no gradient here counts as zero, and one no worker had a
            # gradient for keeps none (the optimiser leaves it alone); one flag a parameter says which
            if not self.params:
                return
            grads, absent = flagged_grads(self.params, self.flags)
            self.sent(allreduce_mean_([*grads, *float_buffers(model), self.flags], self.world), self.world)
            take_flagged(self.params, grads, self.flags, absent)

    def after_step(self, ctx: WorkerContext, model: nn.Module, step: Step) -> None:
        if step.number > self.opts.warmup_steps:
            self.period.stepped()
        if self.period.due(step.number):
            self._average(model)

    def on_epoch_end(self, ctx: WorkerContext, model: nn.Module, epoch: int) -> None:
        if self.period.each_epoch:
            self._average(model)

    def weights_loaded(self, ctx: WorkerContext, model: nn.Module) -> None:
        """Weights the user's loop loaded (on every worker): the compressor averages the change from them."""
        with torch.no_grad():
            for a, p in zip(self.anchor, self.params):
                a.copy_(p)

    def evaluation_model(self, ctx: WorkerContext, model: nn.Module) -> nn.Module:
        """What :meth:`final_model` would return now: the models averaged the algorithm's way
        (exactly, or through the compressor from the anchor), made on copies of the model, the
        anchor and the compressor's state, so that training goes on untouched. Its bytes count as
        ``eval_bytes_sent``, not as the algorithm's."""
        if not self.period.pending:
            return model
        scratch = copy.deepcopy(model)
        anchor = [a.clone() for a in self.anchor]
        self.sent_to_evaluate(self._average_into(scratch, anchor, copy.deepcopy(self.compressor)), self.world)
        return scratch

    def final_model(self, ctx: WorkerContext, model: nn.Module) -> nn.Module:
        if self.period.pending:  # the last, partial period: return the average, not rank 0's own model
            self._average(model)
        return model

    def _average(self, model: nn.Module) -> None:
        self.sent(self._average_into(model, self.anchor, self.compressor), self.world)
        self.averagings += 1
        self.period.synced()

    def _average_into(
        self, model: nn.Module, anchor: list[torch.Tensor], compressor: compress.Compressor | None
    ) -> int:
        """Average ``model`` across the workers, in place: exactly, or (with a compressor) as the
        ``anchor`` plus the compressed mean change since it, the anchor moving there too. Returns
        the bytes all-reduced."""
        if compressor is None:
            return average_model_(model, self.world)
        current = params(model)
        change = [p.detach() - a for p, a in zip(current, anchor)]
        sent = compressor.allreduce_mean_(change, self.world)
        with torch.no_grad():
            for p, a, c in zip(current, anchor, change):
                a.add_(c)
                p.copy_(a)
        return sent + average_buffers_(model, self.world)

    def state_dict(self) -> dict[str, Any]:
        state = {**super().state_dict(), "averagings": self.averagings, "period": self.period.state_dict()}
        if self.compressor is not None:
            state.update(compressor=self.compressor.state_dict(), anchor=[a.clone() for a in self.anchor])
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.averagings = count(state, "averagings")
        self.period.load_state_dict(state["period"])
        if self.compressor is not None:
            self.compressor.load_state_dict(state["compressor"], self.params[0].device)
            with torch.no_grad():  # into the anchor made by setup: on the parameters' device
                for anchor, saved in zip(self.anchor, state["anchor"]):
                    anchor.copy_(saved)

    def figures(self) -> LocalSGDFigures:
        return LocalSGDFigures(**vars(super().figures()), averagings=self.averagings)
