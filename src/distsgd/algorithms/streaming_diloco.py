"""streaming-diloco: Streaming DiLoCo (Douillard, Donchev, Rush, Kale, Kuncoro, Ranzato, Szlam, ...,
"Streaming DiLoCo with overlapping communication: Towards a Distributed Free Lunch", 2025).

DiLoCo (``diloco``) with three changes that cut its peak bandwidth and hide its latency:

1. **Fragments.** The parameters are split into P fragments (``--fragments``), each synchronised
   on its own schedule, H inner steps apart as in DiLoCo, but staggered by H/P: fragment p sends at
   steps t = o_p - tau + k H, with o_p = (p + 1) H / P. So one fragment travels at a time, and the
   peak bandwidth is 1/P of DiLoCo's for the same bytes per sample.
2. **Overlap.** At a send, fragment p's pseudo-gradient is taken, Delta_p = theta_p - x_p (its
   global values since its last outer step minus this worker's values now), and its all-reduce
   starts without waiting; the workers take tau = ``--overlap`` more inner steps while it travels.
   Then the average arrives, the outer optimiser steps theta_p <- OuterSGD_p(theta_p, mean Delta_p)
   (Nesterov momentum, ``--outer-lr``, ``--outer-momentum``, one momentum per fragment), and the
   worker merges: x_p <- alpha x_p + (1 - alpha) theta_p, alpha = ``--merge`` (0 takes the global
   values and drops what the tau overlapped steps did to the fragment; the paper uses 0.5).
3. **Quantised outer gradients.** ``--outer-dtype fp16|bf16`` sends Delta in that dtype; the
   workers' values are gathered and averaged in float32, as the paper accumulates in FP32.

With P = 1, tau = 0 and alpha = 0 it is DiLoCo, step for step (its test checks it). The inner
optimiser and its defaults are DiLoCo's (AdamW at the paper's lr 4e-4, weight decay 0.1).

Fragments are contiguous 1/P slices of the flat parameter vector (a tensor may be cut between two),
not the paper's groups of transformer blocks: those models have many equal blocks, while the small
models here often keep most weights in one layer, and only slices divide the peak by P. torchft's
implementation (``torchft/local_sgd.py``, ``_StreamingDiLoCoFragment``) orders the work as here:
the pseudo-gradient when the all-reduce starts, the outer step on the stored global copy, then the
merge; its first sync of fragment p also comes after (p + 1) H / P steps.

Buffers (BatchNorm statistics): averaged (floating-point) and copied from rank 0 (integer) when
fragment 0's average lands, and kept with the global model, as in DiLoCo.

What is returned: the global model, every fragment's theta. At the end the fragment in flight
lands (its round was full), then each fragment with inner steps since its last send ends as
``--partial-round`` says, one fragment at a time (the peak stays 1/P): by default the workers'
values averaged, as DiLoCo's partial round (see diloco.py). An evaluation in the middle of training makes that same
ending on copies, so what is measured is what would be returned. Checkpoints hold theta, the outer
momenta and a fragment in flight (its average, waited for): a resumed run ends with exactly the
loss of an uninterrupted one.

Training through a lost worker (``--min-workers``): every wait goes through the membership; a
fragment in flight when the group lost a worker is dropped (``regrouped``).

Communication: ``bytes_sent`` counts every all-reduce (a ring's 2 (W-1)/W share) and, for fp16 or
bf16, every all-gather ((W-1) x the fragment's bytes); ``largest_transfer_bytes`` is the largest
single collective one worker took part in.
"""

from __future__ import annotations

import copy
import logging
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn

from distsgd.algorithms.averaging import adopt_buffers_, average_buffers_, broadcast_, flat_view_, params
from distsgd.algorithms.base import GroupFigures, register
from distsgd.algorithms.diloco import InnerOuter, OuterOptions
from distsgd.algorithms.periodic import averaged_once, period_option, untrained_by_theta
from distsgd.checkpoint import count
from distsgd.config import Period, RunConfig
from distsgd.errors import ConfigError
from distsgd.options import option
from distsgd.schedule import Periodic
from distsgd.train import membership
from distsgd.train.context import Start, Step, WorkerContext
from distsgd.train.optim import internal

DTYPES = {"float32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}

Count = Callable[[int, int, str], None]  # counts a collective's bytes: the algorithm's own sent, or sent_to_evaluate

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class StreamingOptions(OuterOptions):
    sync_every: Period = period_option(100, "inner steps H between two outer steps of a fragment (the paper's 100)")
    fragments: int = option(
        2, "P: fragments the parameters are split into, synchronised in turn H/P steps apart", metavar="P"
    )
    overlap: int = option(
        1,
        "tau: inner steps taken while a fragment's all-reduce travels, before its average is used (under H/P; 0: none)",
        metavar="TAU",
    )
    merge: float = option(
        0.5,
        "alpha: a fragment's local share when its new global values arrive, x <- alpha x + (1 - alpha) theta",
        metavar="ALPHA",
    )
    outer_dtype: str = option(
        "float32",
        "float32, fp16 or bf16: the dtype outer gradients travel in (averaged in float32)",
        metavar="DTYPE",
    )

    def check(self, cfg: RunConfig) -> None:
        super().check(cfg)
        h = self.sync_every.count
        if h is None:
            raise ConfigError("streaming-diloco synchronises fragments every H steps: give --sync-every a number")
        if not 1 <= self.fragments <= h:
            raise ConfigError(f"--fragments must be between 1 and --sync-every ({h}), got {self.fragments}")
        if not 0 <= self.overlap < h // self.fragments:
            raise ConfigError(
                f"--overlap must be at least 0 and under H/P = {h // self.fragments} steps (one fragment "
                f"in flight at a time), got {self.overlap}"
            )
        if not 0 <= self.merge <= 1:
            raise ConfigError(f"--merge must be in [0, 1], got {self.merge}")
        if self.outer_dtype not in DTYPES:
            raise ConfigError(f"--outer-dtype must be one of {', '.join(DTYPES)}, got '{self.outer_dtype}'")


@dataclass
class StreamingFigures(GroupFigures):
    outer_steps: int | None = None  # fragment syncs, all fragments together
    fragments: int | None = None


@dataclass
class Flight:
    """A fragment's outer gradient on its way: sent at a step, used at ``lands``."""

    fragment: int
    lands: int
    handle: dist.Work | None = None
    payload: torch.Tensor | list[torch.Tensor] | None = None  # what was all-reduced (float32), or gathered (fp16, bf16)
    mean: torch.Tensor | None = None  # the average, once waited for

    def average(self, world: int) -> torch.Tensor:
        if self.mean is None:
            assert self.handle is not None and self.payload is not None  # started, not yet waited for
            membership.wait(self.handle)
            if isinstance(self.payload, list):
                self.mean = torch.stack([g.float() for g in self.payload]).sum(dim=0) / world
            else:
                self.mean = self.payload / world
            self.handle, self.payload = None, None
        return self.mean


@dataclass
class Globals:
    """The global side of the model: each fragment's theta, its outer optimiser, and the module
    they make together (with the averaged buffers). Copied whole for an evaluation's ending."""

    thetas: list[torch.Tensor]
    outers: list[torch.optim.Optimizer]
    model: nn.Module
    flat: torch.Tensor = field(default_factory=lambda: torch.empty(0))  # the model's parameters, one buffer


@register
class StreamingDiLoCo(InnerOuter[StreamingOptions]):
    name = "streaming-diloco"
    binds_storage = True  # views of one flat buffer, its fragments' slices
    kind = "low communication"
    summary_line = (
        "Streaming DiLoCo: DiLoCo's outer steps fragment by fragment, staggered, each all-reduce "
        "overlapped with inner steps (--fragments, --overlap, --merge, --outer-dtype)"
    )
    collective_evaluation = True  # in the middle of a round, the average of the workers' models
    # every wait through the membership; a fragment in flight in a lost group is dropped (regrouped)
    trains_through = True
    local_model = True

    periods: list[Periodic]  # fragment p sends at steps o_p - tau + k H; whether it owes one (checkpointed)
    dtype: torch.dtype  # what outer gradients travel in
    flight: Flight | None  # the fragment on its way, if one is (checkpointed, its average waited for)
    rounds: int  # fragments' outer steps taken (checkpointed)
    untrained: bool  # the model returned is the starting one (--partial-round theta, no outer step)
    # built by setup:
    flat: torch.Tensor  # x: this worker's parameters, one buffer they are views of (a fragment is a slice)
    bounds: list[tuple[int, int]]  # each fragment's slice of flat
    globals: Globals  # theta, the outer optimisers and the global model (checkpointed)

    def __init__(self, cfg: RunConfig, seat: object = None) -> None:
        super().__init__(cfg, seat)
        h, p = self.opts.sync_every.count, self.opts.fragments
        assert h is not None  # StreamingOptions.check: a number of steps
        self.periods = [Periodic(h, (i + 1) * h // p - self.opts.overlap) for i in range(p)]
        self.dtype = DTYPES[self.opts.outer_dtype]
        self.flight = None
        self.rounds = 0
        self.untrained = False

    def setup(self, ctx: WorkerContext, model: nn.Module, start: Start) -> nn.Module:
        model = super().setup(ctx, model, start)
        if start is Start.FRESH:  # one starting point (a resumed worker restores theta below)
            broadcast_(params(model) + list(model.buffers()))
        self.flat = flat_view_(params(model))
        n, p = self.flat.numel(), self.opts.fragments
        self.bounds = [(n * i // p, n * (i + 1) // p) for i in range(p)]
        self.globals = self._make_globals(model)
        return model

    def _make_globals(self, model: nn.Module, like: Globals | None = None) -> Globals:
        """theta (this worker's values, or a copy of ``like``'s), an outer optimiser per fragment,
        and the global module whose parameters are views of one flat buffer."""
        target = copy.deepcopy(model)
        flat = flat_view_(params(target))  # (a deep copy's parameters are clones, not views: bind anew)
        thetas = (
            [t.clone() for t in like.thetas]
            if like is not None
            else [self.flat[a:b].detach().clone() for a, b in self.bounds]
        )
        outers: list[torch.optim.Optimizer] = [
            internal(
                torch.optim.SGD(
                    [t], lr=self.opts.outer_lr, momentum=self.opts.outer_momentum, nesterov=self.opts.outer_momentum > 0
                )
            )
            for t in thetas
        ]
        if like is not None:
            for outer, saved in zip(outers, like.outers):
                outer.load_state_dict(copy.deepcopy(saved.state_dict()))
        return Globals(thetas, outers, target, flat)

    def weights_loaded(self, ctx: WorkerContext, model: nn.Module) -> None:
        """Weights the user's loop loaded (on every worker) are the new theta of every fragment; a
        fragment in flight, whose outer gradient was measured from the old theta, is dropped (its
        all-reduce waited for, every worker alike)."""
        if self.flight is not None:
            self.flight.average(self.world)
            self.flight = None
        self.globals.model.load_state_dict(self.unwrap(model).state_dict())
        with torch.no_grad():
            for theta, (a, b) in zip(self.globals.thetas, self.bounds):
                theta.copy_(self.flat[a:b])

    def regrouped(self, ctx: WorkerContext) -> None:
        """A lost worker (``--min-workers``): a fragment whose average had not arrived went with
        the old group, and is dropped: that fragment skips this round's outer step, and its
        pseudo-gradient (theta_p - x_p, still measured from the same theta) goes with its next send,
        H steps on. One whose average had arrived (waited for by an evaluation) still lands. The
        survivors then take the most advanced one's state, flight included."""
        super().regrouped(ctx)
        if self.flight is not None and self.flight.mean is None:
            self.flight = None

    # -- the schedule ----------------------------------------------------------------------------
    def after_step(self, ctx: WorkerContext, model: nn.Module, step: Step) -> None:
        for period in self.periods:
            period.stepped()
        if self.flight is not None and step.number >= self.flight.lands:
            self._land(self.flight, self.globals, self.flat, model, self.sent)
            self.flight = None
        for p, period in enumerate(self.periods):
            if period.due(step.number):
                self.flight = self._send(p, step.number + self.opts.overlap)
                period.synced()
                if self.opts.overlap == 0:
                    self._land(self.flight, self.globals, self.flat, model, self.sent)
                    self.flight = None

    def _send(self, p: int, lands: int) -> Flight:
        """Start fragment p's outer gradient on its way (no wait)."""
        a, b = self.bounds[p]
        delta = self.globals.thetas[p] - self.flat[a:b].detach()
        flight = Flight(p, lands)
        self._start(flight, delta, count=self.sent)
        return flight

    def _start(self, flight: Flight, delta: torch.Tensor, count: Count) -> None:
        """All-reduce ``delta`` (float32), or all-gather it in fp16 / bf16, asynchronously."""
        if self.dtype == torch.float32:
            flight.payload = delta.clone()
            flight.handle = dist.all_reduce(flight.payload, async_op=True)
            count(delta.numel() * 4, self.world, "all_reduce")
        else:
            sent = delta.to(self.dtype)
            flight.payload = [torch.empty_like(sent) for _ in range(self.world)]
            flight.handle = dist.all_gather(flight.payload, sent, async_op=True)
            count(sent.numel() * sent.element_size(), self.world, "all_gather")

    def _land(
        self,
        flight: Flight,
        g: Globals,
        local: torch.Tensor,
        model: nn.Module,
        count: Count,
        buffers: bool = True,
        outer: bool = True,
    ) -> None:
        """Fragment ``flight.fragment``'s average arrived: the outer step of its theta (``outer``
        False: theta <- theta - Delta, the workers' values averaged), then the merge of the worker's
        values (``local``); fragment 0 also averages the buffers."""
        p = flight.fragment
        a, b = self.bounds[p]
        mean = flight.average(self.world)
        if outer:
            # a copy: the optimiser may change its gradient in place (foreach Nesterov SGD, what torch
            # runs on CUDA, adds the momentum into it), and an evaluation's copies share the average
            g.thetas[p].grad = mean.clone()
            g.outers[p].step()
            g.thetas[p].grad = None
        alpha = self.opts.merge
        with torch.no_grad():
            if not outer:
                g.thetas[p].sub_(mean)
            local[a:b].mul_(alpha).add_(g.thetas[p], alpha=1 - alpha)
        if p == 0 and buffers:
            self._average_buffers(model, g, count)
        if count == self.sent and outer:  # the algorithm's own outer steps, not an evaluation's copies
            self.rounds += 1

    def _average_buffers(self, model: nn.Module, g: Globals, count: Count) -> None:
        """The workers' buffers averaged (integer ones rank 0's), into the global model and back."""
        with torch.no_grad():
            for local, global_ in zip(model.buffers(), g.model.buffers()):
                global_.copy_(local)
        count(average_buffers_(g.model, self.world), self.world, "all_reduce")
        with torch.no_grad():
            for local, global_ in zip(model.buffers(), g.model.buffers()):
                local.copy_(global_)

    # -- the end, and what an evaluation measures --------------------------------------------------
    def _ending(
        self,
        g: Globals,
        local: torch.Tensor,
        model: nn.Module,
        flight: Flight | None,
        pending: list[bool],
        count: Count,
    ) -> nn.Module:
        """Land the fragment in flight, then end each fragment with inner steps since its last send
        as ``--partial-round`` says (one fragment at a time: the peak stays 1/P); return the global
        model."""
        if flight is not None:
            self._land(flight, g, local, model, count)
        rule = self.opts.partial_round
        owed = [p for p, due in enumerate(pending) if due] if rule != "theta" else []
        for p in owed:
            a, b = self.bounds[p]
            last = Flight(p, 0)
            self._start(last, g.thetas[p] - local[a:b].detach(), count)
            self._land(last, g, local, model, count, buffers=False, outer=rule == "step")
        if owed:
            self._average_buffers(model, g, count)
        with torch.no_grad():
            for (a, b), theta in zip(self.bounds, g.thetas):
                g.flat[a:b].copy_(theta)
        return g.model

    def evaluation_model(self, ctx: WorkerContext, model: nn.Module) -> nn.Module:
        """What :meth:`final_model` would return now, made on copies of theta, the outer momenta,
        the worker's values and buffers (every worker takes part; its bytes are eval_bytes_sent)."""
        pending = [p.pending for p in self.periods]
        if self.flight is None and not any(pending):
            return self._ending(self.globals, self.flat, model, None, pending, self.sent_to_evaluate)
        g = self._make_globals(self.globals.model, like=self.globals)
        scratch = copy.deepcopy(model)
        local = flat_view_(params(scratch))
        flight = None
        if self.flight is not None:
            self.flight.average(self.world)  # waits once; the real landing uses the same average
            flight = Flight(self.flight.fragment, self.flight.lands, mean=self.flight.mean)
        return self._ending(g, local, scratch, flight, pending, self.sent_to_evaluate)

    def final_model(self, ctx: WorkerContext, model: nn.Module) -> nn.Module:
        pending = [p.pending for p in self.periods]
        self.untrained = (
            self.rounds == 0 and self.flight is None and any(pending) and self.opts.partial_round == "theta"
        )
        if self.untrained and ctx.rank == 0:
            log.warning("%s", untrained_by_theta(self.opts.sync_every, self.name))
        elif self.rounds == 0 and self.flight is None and any(pending) and ctx.rank == 0:
            if self.opts.partial_round == "average":
                log.warning("%s", averaged_once(self.opts.sync_every, self.name))
        landing = self.flight is not None or any(pending)
        final = self._ending(self.globals, self.flat, model, self.flight, pending, self.sent)
        if not landing and ctx.job.main is not None:  # a loop's update_bn after the last landing: theta's
            changed = any(not torch.equal(a, b) for a, b in zip(model.buffers(), final.buffers()))
            self.sent(adopt_buffers_(final, model, changed, self.world), self.world)
        self.flight = None
        for p in self.periods:
            p.synced()
        return final

    # -- checkpoints --------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        flight = None
        if self.flight is not None:  # wait for it: its average is what the resumed run will use
            flight = {
                "fragment": self.flight.fragment,
                "lands": self.flight.lands,
                "mean": self.flight.average(self.world).clone(),
            }
        return {
            **super().state_dict(),
            "rounds": self.rounds,
            "flight": flight,
            "periods": [p.state_dict() for p in self.periods],
            "thetas": [t.clone() for t in self.globals.thetas],
            "outers": [o.state_dict() for o in self.globals.outers],
            "global": {k: v.clone() for k, v in self.globals.model.state_dict().items()},
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.rounds = count(state, "rounds")
        f = state["flight"]
        self.flight = None if f is None else Flight(f["fragment"], f["lands"], mean=f["mean"].to(self.flat.device))
        for period, saved in zip(self.periods, state["periods"]):
            period.load_state_dict(saved)
        self.globals.model.load_state_dict(state["global"])
        with torch.no_grad():
            for theta, saved in zip(self.globals.thetas, state["thetas"]):
                theta.copy_(saved)
        for outer, saved in zip(self.globals.outers, state["outers"]):
            outer.load_state_dict(saved)

    def figures(self) -> StreamingFigures:
        return StreamingFigures(
            **{**vars(super().figures()), "untrained": self.untrained or None},
            outer_steps=self.rounds,
            fragments=self.opts.fragments,
        )
