"""easgd: elastic averaging SGD (Zhang, Choromanska, LeCun, "Deep learning with Elastic Averaging
SGD", NIPS 2015).

Workers train their own models x_i, tied to a centre variable x~ by an elastic force. At every
step t that ``--tau`` divides (t counting the steps taken, from 0), with alpha = ``--alpha``
(default: beta / N with beta = N alpha = 0.9) and g_i the gradient just computed at x_i:

    x_i <- x_i - alpha (x_i - x~) - lr g_i(x_i)      on every worker
    x~  <- x~  + alpha sum_i (x_i - x~)               the centre moves towards the workers

both from the same x_i, before the step: the paper's simultaneous update (its equations 5-6, and
Algorithm 1 for the asynchronous form: x = x_i; x_i <- x_i - alpha (x - x~); x~ <- x~ +
alpha (x - x~); x_i <- x_i - lr g(x)). At other steps x_i <- x_i - lr g_i(x_i) alone (with the
chosen optimiser: lr g is its update).

``--easgd-mode sync`` (default): every worker keeps the same copy of x~ and the sum is one
all-reduce of the elastic differences. ``--easgd-mode async``: x~ lives on the parameter server;
every tau steps a worker sends its x_i, the server computes d = x_i - x~, moves x~ <- x~ + alpha d
under its lock and returns d, and the worker sets x_i <- x_i - alpha d (the paper's asynchronous
EASGD). Between exchanges each worker runs its own optimiser (its momentum stays local), and
hears nothing of the others' samples: under ``--max-samples`` each trains its share (1/N) of the
budget. The model evaluated and saved is the centre x~.

Buffers (BatchNorm statistics): floating-point buffers take part in the elastic exchange exactly
like parameters (x_i and x~ include them), so the centre carries statistics the workers learnt;
the centre's integer buffers (``num_batches_tracked``) are copied from the worker that exchanged
(in sync mode every worker's are equal).

The learning rate: an exchange leaves N x_mean + x~ unchanged (the workers lose what the centre
gains), and only the workers' gradient steps move that sum. Once the centre follows the workers,
it therefore advances at N / (N + 1) of the rate at which averaged SGD (allreduce, local-sgd) would
at the same lr. To match their progress per sample, scale the lr by (N + 1) / N (docs/BENCHMARKS.md,
"EASGD with the learning rate scaled by (N + 1) / N").
"""

from __future__ import annotations

import copy
import logging
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.distributed as dist
from torch import nn

from distsgd.algorithms.averaging import (
    BufferVersions,
    adopt_buffers_,
    averaged,
    elastic_alpha,
    flatten,
    int_buffers,
    unflatten_into,
)
from distsgd.algorithms.base import Algorithm, GroupAlgorithm, GroupFigures, Topology, register
from distsgd.algorithms.param_server.rules import Elastic
from distsgd.algorithms.param_server.worker import ServerAlgorithm, ServerTopology
from distsgd.config import RunConfig
from distsgd.errors import ConfigError
from distsgd.options import Options, option
from distsgd.schedule import Periodic
from distsgd.train import membership
from distsgd.train.context import Figures, Start, Step, WorkerContext

log = logging.getLogger(__name__)


def sync_elastic_step(
    x: list[torch.Tensor], center: list[torch.Tensor], alpha: float, world: int
) -> tuple[int, torch.Tensor]:
    """One synchronous EASGD exchange: the centre moves; returns the bytes all-reduced and x_i's
    elastic move, alpha (x_i - x~), which the caller subtracts after its gradient step (both from
    x_i^t, the paper's update, its weight decay included)."""
    diff = flatten(x) - flatten(center)
    total = diff.clone()  # a new buffer each time: an all-reduce abandoned with a lost worker writes nowhere used
    if world > 1:
        membership.call(dist.all_reduce, total)
    unflatten_into(flatten(center) + alpha * total, center)
    return total.numel() * total.element_size(), alpha * diff


@dataclass(frozen=True)
class EASGDOptions(Options):
    tau: int = option(8, "steps between elastic exchanges")
    alpha: float | None = option(None, "elastic strength", default_help="0.9 / workers (beta = N alpha = 0.9)")
    easgd_mode: str = option("sync", "sync (all-reduce) or async (centre on a parameter server)", metavar="MODE")

    def check(self, cfg: RunConfig) -> None:
        if self.tau < 1:
            raise ConfigError(f"--tau must be at least 1 step, got {self.tau}")
        if self.easgd_mode not in ("sync", "async"):
            raise ConfigError(f"--easgd-mode must be sync or async, got '{self.easgd_mode}'")
        alpha = elastic_alpha(self, cfg.workers)
        if not 0 < alpha * cfg.workers < 2:  # the paper's stability condition on beta = N alpha
            raise ConfigError(
                f"--alpha {alpha} gives beta = N alpha = {alpha * cfg.workers:.3g}; it must lie in (0, 2)"
            )


@dataclass
class EASGDFigures(GroupFigures):
    alpha: float | None = None
    tau: int | None = None
    easgd_mode: str | None = None


@dataclass
class AsyncEASGDFigures(Figures):
    alpha: float | None = None
    tau: int | None = None
    easgd_mode: str | None = None


@register
class EASGD(GroupAlgorithm[EASGDOptions]):
    name = "easgd"
    kind = "model averaging"
    trains_through = True  # its one collective through the membership, on a fresh buffer
    local_model = True  # x_i
    keeps_buffers = True  # x_i's, which the elastic exchange moves
    summary_line = "elastic averaging SGD: workers tied to a centre every --tau steps (--easgd-mode sync|async)"

    period: Periodic  # exchanges at steps 0, tau, 2 tau, ... (counting those taken before; checkpointed)
    exchanged_at: int  # the step whose exchange was made (a user's loop steps several optimisers a step)
    moved: bool  # an exchange after training began moved the centre (or a resume's checkpoint held one)
    move: torch.Tensor | None  # x_i's elastic move, owed once this step's optimisers have stepped
    # built by setup:
    alpha: float  # the elastic strength (its default depends on the workers)
    center_model: nn.Module  # x~, the centre: what is evaluated and returned
    center: list[torch.Tensor]  # x~'s parameters and floating-point buffers (checkpointed, flat)
    x: list[torch.Tensor]  # x_i, this worker's (the same parts)
    x_ints: list[torch.Tensor]  # this worker's integer buffers, which the centre copies
    center_ints: list[torch.Tensor]
    watch: BufferVersions | None  # a user's loop's: x_i's buffers as at its last step (update_bn since?)

    def __init__(self, cfg: RunConfig, seat: object = None) -> None:
        super().__init__(cfg, seat)
        self.period = Periodic(self.opts.tau, first=0)
        self.exchanged_at = 0
        self.move = None

    @classmethod
    def variant(cls, cfg: RunConfig) -> type[Algorithm]:
        """``--easgd-mode async`` runs on the parameter server."""
        return AsyncEASGD if EASGDOptions.pick(cfg.options).easgd_mode == "async" else cls

    def setup(self, ctx: WorkerContext, model: nn.Module, start: Start) -> nn.Module:
        model = super().setup(ctx, model, start)
        self.alpha = elastic_alpha(self.opts, ctx.world)
        self.moved = start is not Start.FRESH
        if start is Start.FRESH:
            for p in model.parameters():  # one starting point for workers and centre
                membership.call(dist.broadcast, p.data, src=0)
        self.center_model = copy.deepcopy(model)
        self.center = averaged(self.center_model)
        self.x = averaged(model)
        self.x_ints, self.center_ints = int_buffers(model), int_buffers(self.center_model)
        self.watch = BufferVersions(model) if ctx.job.main is not None else None
        return model

    def regrouped(self, ctx: WorkerContext) -> None:
        """A lost worker (``--min-workers``): the default strength follows the workers (beta = N alpha
        stays 0.9); the survivors then take the most advanced one's centre, and keep their own x_i."""
        super().regrouped(ctx)
        self.alpha = elastic_alpha(self.opts, ctx.world)
        self.move = None  # (of a step abandoned with the lost worker)

    def apply_step(self, ctx: WorkerContext, optimizer: torch.optim.Optimizer, step: Step) -> None:
        """At a step that tau divides, the elastic exchange from x_i as it was when the gradient
        was computed; then the optimiser's step, also from there (its weight decay: the paper's L2
        term is part of the gradient); x_i's elastic move once every optimiser stepped (after_step)."""
        if self.period.due(step.number - 1) and step.number != self.exchanged_at:
            self.exchanged_at = step.number
            self.moved = self.moved or step.number > 1  # (the first, at step 1, is from one starting point)
            sent, self.move = sync_elastic_step(self.x, self.center, self.alpha, self.world)
            self.sent(sent, self.world)
            unflatten_into(flatten(self.x_ints), self.center_ints)
        optimizer.step()
        if self.watch is not None:
            self.watch.mark()

    def after_step(self, ctx: WorkerContext, model: nn.Module, step: Step) -> None:
        super().after_step(ctx, model, step)
        if self.move is not None:
            with torch.no_grad():
                unflatten_into(flatten(self.x) - self.move, self.x)
            self.move = None

    def weights_loaded(self, ctx: WorkerContext, model: nn.Module) -> None:
        """Weights the user's loop loaded (on every worker) are the centre's too: otherwise the
        elastic force would pull the workers back towards the old centre."""
        self.center_model.load_state_dict(self.unwrap(model).state_dict())

    def evaluation_model(self, ctx: WorkerContext, model: nn.Module) -> nn.Module:
        return self.center_model

    def state_dict(self) -> dict[str, Any]:
        return {
            **super().state_dict(),
            "center": flatten(self.center),
            "center_ints": flatten(self.center_ints),  # the counters copied at the last exchange
            "period": self.period.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        unflatten_into(state["center"], self.center)
        if "center_ints" in state:  # (checkpoints written before it was kept: the model's, as it loads)
            unflatten_into(state["center_ints"], self.center_ints)
        self.period.load_state_dict(state["period"])

    def final_model(self, ctx: WorkerContext, model: nn.Module) -> nn.Module:
        """The centre; with the workers' buffers where one changed them after its last step
        (BatchNorm statistics recomputed after training), which no exchange would carry."""
        if self.watch is not None:  # (every worker alike: a user's loop's)
            self.sent(
                adopt_buffers_(self.center_model, self.unwrap(model), self.watch.changed(), self.world), self.world
            )
        if not self.moved and ctx.rank == 0 and self.exchanged_at:
            # (a fine-tune of tau steps or fewer returned its pretrained weights bit for bit, unsaid: an audit's)
            log.warning(
                "easgd: the run ended before an exchange after its first step (--tau %d steps): the centre it "
                "returns took nothing from the workers' training, it is the starting model; give a smaller --tau "
                "(or a longer run)",
                self.opts.tau,
            )
        return self.center_model

    def figures(self) -> EASGDFigures:
        return EASGDFigures(**vars(super().figures()), alpha=self.alpha, tau=self.opts.tau, easgd_mode="sync")


class AsyncEASGD(ServerAlgorithm[EASGDOptions]):
    """The worker side of asynchronous EASGD: exchange elastic differences with the server."""

    name = "easgd"
    kind = "model averaging"
    topology: ClassVar[Topology] = ServerTopology(Elastic)

    period: Periodic  # exchanges at steps tau divides, as in sync mode (checkpointed)
    move: torch.Tensor | None  # x_i's elastic move, owed once this step's optimisers have stepped
    # built by setup:
    alpha: float  # the elastic strength
    watch: BufferVersions | None  # a user's loop's: x_i's buffers as at its last step (update_bn since?)

    def __init__(self, cfg: RunConfig, seat: object = None) -> None:
        super().__init__(cfg, seat)
        self.period = Periodic(self.opts.tau, first=0)
        self.move = None

    def setup(self, ctx: WorkerContext, model: nn.Module, start: Start) -> nn.Module:
        """A fresh worker, or one that replaces a dead one, starts from the centre (pulled); a
        resumed one goes on from its own x_i, its checkpoint's (which the pull would replace)."""
        own = [p.detach().clone() for p in model.parameters()] if start is Start.RESUMED else None
        model = super().setup(ctx, model, start)
        if own is not None:
            with torch.no_grad():
                for p, mine in zip(model.parameters(), own):
                    p.copy_(mine)
        self.alpha = elastic_alpha(self.opts, ctx.world)
        self.watch = BufferVersions(model) if ctx.job.main is not None else None
        return model

    def buffers_at_end(self) -> bool:
        """The centre's buffers move by the exchanges; a worker's changed after its last step
        (BatchNorm statistics recomputed after training) go with its DONE, and the centre takes
        the mean of those sent."""
        return self.watch is not None and self.watch.changed()

    def optimizers_ready(self, ctx: WorkerContext, optimizers: list[torch.optim.Optimizer]) -> None:
        """Any optimisers of a user's loop: the workers step locally (the server's never steps)."""

    def check_untouched(self, ctx: WorkerContext) -> None:
        """Each worker steps its own weights between exchanges: nothing the server sends overwrites them."""

    def apply_step(self, ctx: WorkerContext, optimizer: torch.optim.Optimizer, step: Step) -> None:
        """At a step that tau divides, the exchange of x_i as it was when the gradient was computed
        (the server moves the centre by alpha d, d = x_i - x~; x_i moves by -alpha d once every
        optimiser stepped, in after_step: the optimiser takes its weight decay at x_i^t too, as the
        paper's L2 term); local steps between exchanges."""
        if self.period.due(step.number - 1):  # (once a step: due moves on to the next exchange)
            (diff, diffs), self.version, self.total, self.stop = self.client.exchange(
                self.weights, self.floats, self.ints, self.local
            )
            self.move = self.alpha * diff
            with torch.no_grad():
                for b, d in zip(self.floats, diffs):
                    b.sub_((self.alpha * d).view_as(b))
        optimizer.step()
        if self.watch is not None:
            self.watch.mark()

    def after_step(self, ctx: WorkerContext, model: nn.Module, step: Step) -> None:
        self.local = step.samples
        if self.move is not None:
            with torch.no_grad():
                self.weights.sub_(self.move)  # x_i <- x_i - alpha d: the parameters are views of weights
            self.move = None

    def keep_going(self, ctx: WorkerContext) -> bool:
        """Until the server says stop and, under --max-samples, until this worker has trained its
        share of the budget (1/N of it, as a worker in lockstep counts). A worker hears of the
        others' samples only at its exchanges, every tau steps, so the server's total it holds may
        be tau steps a worker behind, and the budget alone would let every worker run up to tau
        steps past it; its own share keeps the run within one step a worker of the budget, as the
        other algorithms are. As under --epochs, a worker faster than the others stops at its share
        rather than take over a slower one's samples, and a worker that died unreplaced leaves its
        share untrained."""
        budget = self.cfg.max_samples
        return super().keep_going(ctx) and (budget is None or self.local * ctx.world < budget)

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "period": self.period.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.period.load_state_dict(state["period"])

    def figures(self) -> AsyncEASGDFigures:
        return AsyncEASGDFigures(**vars(super().figures()), alpha=self.alpha, tau=self.opts.tau, easgd_mode="async")
