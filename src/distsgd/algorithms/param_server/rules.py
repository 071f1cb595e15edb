"""The parameter server's update rules, one small class each. g_r is worker r's gradient,
computed on weights of version v_r; v is the server's version. Every method runs inside the
server's lock (:class:`~.core.ParameterServer` takes it) and answers workers through
``ps.reply``, which completes their futures once the lock is released.

- :class:`Asynchronous` (``asgd``): apply every gradient on arrival, w <- w - lr * g_r. Its
  staleness is tau = v - v_r. ``--staleness-lr`` (any asynchronous rule) divides the stale
  gradient by max(1, tau) before the optimiser sees it (Zhang, Gupta, Lian, Liu,
  "Staleness-aware Async-SGD", IJCAI 2016: the gradient is scaled, so momentum history and weight
  decay are not).
- :class:`SyncRound` (``sync-ps``): wait for the gradients of all N live
  workers, step once with their mean (summed in rank order, so a run is deterministic; the mean
  clipped to ``--clip-grad-norm``); equal to one process taking the global batch.
- :class:`BoundedStaleness` (``ssp``, stale synchronous parallel, Ho et al., NIPS 2013): apply
  on arrival as asgd, but a worker more than ``--staleness S`` pushes ahead of the slowest live
  worker waits for it.
- :class:`DelayCompensated` (``dcasgd``, Zheng et al., ICML 2017): apply
  g_r + lambda * g_r * g_r * (w - w_r), w_r being the weights worker r read: a first-order Taylor
  correction of the stale gradient towards the current weights. ``--dc-lambda`` is the constant
  lambda (default 0.04, DC-ASGD-c); ``--dc-adaptive`` uses lambda0 / sqrt(m + eps) as the paper's
  DC-ASGD-a: m <- 0.95 m + 0.05 g * g, starting from 0, eps = 1e-7, lambda0 by default 2.
  The paper steps with SGD on the corrected gradient; the correction estimates the gradient at the
  current weights (a property of the loss, not of the step), so the server hands it to the run's
  optimiser: SGD by default, the model's own where it has one (AdamW for gpt, on which SGD did not
  get below the unigram entropy in a short run).
- :class:`Elastic` (async ``easgd``, Zhang, Choromanska, LeCun, NIPS 2015): the server holds the
  centre x~; a worker sends x_i, the server computes d = x_i - x~, moves x~ <- x~ + alpha d and
  returns d (the worker then moves x_i <- x_i - alpha d).

The optimiser's settings: every rule that steps the server's optimiser (all but Elastic) steps it
on g_r with the hyperparameters worker r's optimiser held when it computed g_r (its lr, momentum,
betas and weight decay, as its schedule or a user's LR scheduler set them: :mod:`.hyper`), set on
the server's groups just before that step. So lr_r below is the lr of the push, not of the server:

- asgd, ssp: w <- step(g_r; lr_r, momentum_r, ...): plain SGD is w <- w - lr_r g_r.
- ``--staleness-lr`` divides the gradient, not the lr: plain SGD takes w <- w - (lr_r / tau) g_r
  for tau > 1, while momentum history and weight decay keep their pushed coefficients (weight decay
  is added to g_r / tau, at lr_r). A schedule and the staleness scaling multiply: a push made at a
  quarter of the base lr, three versions stale, moves plain SGD's weights by (lr / 4) / 3 g_r.
- dcasgd: the compensation is computed first, from g_r and the weights alone (it estimates the
  gradient at the current weights; no lr enters it), then divided by tau under ``--staleness-lr``,
  then stepped at lr_r: w <- w - lr_r (g_r + lambda g_r * g_r * (w - w_r)) for plain SGD.
- sync-ps: one step on the mean of the round's gradients, with the hyperparameters of the round's
  lowest live rank (every worker's schedule is at the same step; a round whose workers pushed
  different values steps with that rank's, and the server warns once).

A parameter without a gradient on the worker (frozen, or unused in the forward) is absent from its
push, as plain PyTorch's optimiser would skip it: asgd, ssp, dcasgd step without it (its ``.grad``
None: no weight decay, no momentum); sync-ps's mean counts a push without it as zero (as DDP
averages), and a parameter absent from every push of the round is skipped.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch.futures import Future

from distsgd.algorithms.averaging import elastic_alpha, float_buffers, int_buffers
from distsgd.config import RunConfig
from distsgd.options import Options

if TYPE_CHECKING:  # the algorithms' options, in the modules that import these rules
    from distsgd.algorithms.easgd import EASGDOptions
    from distsgd.algorithms.param_server.core import ParameterServer
    from distsgd.algorithms.param_server.worker import DCASGDOptions, SSPOptions, StalenessOptions


log = logging.getLogger(__name__)

Hypers = list[float] | None  # a push's hyperparameters (.hyper.Hyperparameters.read), or none
Present = list[bool] | None  # which parameters a push has a gradient of (.core.Present; None: all)


def dc_lambda(opts: DCASGDOptions) -> float:
    """lambda (DC-ASGD-c) or lambda0 (DC-ASGD-a): ``--dc-lambda``, else the paper's 0.04 or 2."""
    if opts.dc_lambda is not None:
        return opts.dc_lambda
    return 2.0 if opts.dc_adaptive else 0.04


class Rule:
    """What the server does with what workers send (the base: nothing). ``opts``: the
    algorithm's options (each rule declares the class it reads)."""

    steps: ClassVar[bool] = True  # the server's optimiser steps on pushed gradients, with pushed hyperparameters
    stale: ClassVar[bool] = True  # what is applied has a staleness (a gradient's versions since its weights were read)
    cfg: RunConfig
    opts: Options

    def __init__(self, cfg: RunConfig, opts: Options) -> None:
        self.cfg, self.opts = cfg, opts

    def figures(self, workers: int) -> dict[str, Any]:
        """The rule's own settings as the run's summary records them, with ``workers`` workers
        (as the algorithm's worker side records them in a run of its own)."""
        return {}

    def on_pull(self, ps: "ParameterServer", rank: int, weights: torch.Tensor) -> None:
        """Worker ``rank`` read ``weights``."""

    def on_push(
        self,
        ps: "ParameterServer",
        rank: int,
        grad: torch.Tensor,
        version_read: int,
        hypers: Hypers,
        present: Present,
        fut: Future,
    ) -> None:
        raise NotImplementedError(f"{type(self).__name__} takes no gradients")

    def on_leave(self, ps: "ParameterServer", rank: int) -> None:
        """Worker ``rank`` finished or died: stop waiting for it."""

    def release(self, ps: "ParameterServer") -> None:
        """After every push or departure: answer workers that may now go on."""

    def exchange(
        self, ps: "ParameterServer", rank: int, x: torch.Tensor, floats: list[torch.Tensor], ints: list[torch.Tensor]
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        raise NotImplementedError(f"{type(self).__name__} makes no elastic exchanges")


class Asynchronous(Rule):
    """asgd: every gradient applied on arrival."""

    opts: StalenessOptions

    def on_push(
        self,
        ps: "ParameterServer",
        rank: int,
        grad: torch.Tensor,
        version_read: int,
        hypers: Hypers,
        present: Present,
        fut: Future,
    ) -> None:
        tau = ps.version - version_read
        ps.staleness[tau] += 1
        grad = self.correct(ps, rank, grad, present)
        if self.opts.staleness_lr and tau > 1:
            grad = grad / tau
        ps.apply(grad, hypers, present)
        if not self.hold(ps, rank, fut):
            self.answer(ps, rank, fut)

    def correct(self, ps: "ParameterServer", rank: int, grad: torch.Tensor, present: Present) -> torch.Tensor:
        """The gradient to apply (delay compensation changes it); ``present`` as in ``on_push``."""
        return grad

    def hold(self, ps: "ParameterServer", rank: int, fut: Future) -> bool:
        """Keep this worker waiting (ssp)? Then it is answered later, by ``release``."""
        return False

    def answer(self, ps: "ParameterServer", rank: int, fut: Future) -> None:
        ps.reply(fut, ps.answer())


class BoundedStaleness(Asynchronous):
    """ssp: no worker more than ``--staleness`` pushes ahead of the slowest live one."""

    opts: SSPOptions
    held: list[tuple[int, Future]]  # workers kept waiting, answered once they may go on

    def __init__(self, cfg: RunConfig, opts: Options) -> None:
        super().__init__(cfg, opts)
        self.held = []

    def _ahead(self, ps: "ParameterServer", rank: int) -> bool:
        others = [ps.clocks[r] for r in ps.active if r != rank]
        slowest = min(others) if others else ps.clocks[rank]
        return ps.clocks[rank] - slowest > self.opts.staleness

    def hold(self, ps: "ParameterServer", rank: int, fut: Future) -> bool:
        if not self._ahead(ps, rank):
            return False
        self.held.append((rank, fut))  # answered, with the newest weights, once it may go on
        return True

    def release(self, ps: "ParameterServer") -> None:
        still = []
        for rank, fut in self.held:
            if self._ahead(ps, rank) and rank in ps.active:
                still.append((rank, fut))
            else:
                self.answer(ps, rank, fut)
        self.held = still


class DelayCompensated(Asynchronous):
    """dcasgd: the stale gradient corrected towards the current weights."""

    opts: DCASGDOptions
    read: dict[int, torch.Tensor]  # the weights each worker read
    meansq: torch.Tensor | None  # DC-ASGD-a's MeanSquare, from the first gradient on

    def __init__(self, cfg: RunConfig, opts: Options) -> None:
        super().__init__(cfg, opts)
        self.read = {}
        self.meansq = None

    def on_pull(self, ps: "ParameterServer", rank: int, weights: torch.Tensor) -> None:
        self.read[rank] = weights

    def correct(self, ps: "ParameterServer", rank: int, grad: torch.Tensor, present: Present) -> torch.Tensor:
        lam: torch.Tensor | float = dc_lambda(self.opts)
        if self.opts.dc_adaptive:  # MeanSquare starts at 0
            if self.meansq is None:
                self.meansq = torch.zeros_like(grad)
            # a parameter absent from the push (no gradient on the worker) keeps its MeanSquare, as
            # an optimiser's state of a parameter it skips (its gradient, and so its correction, is 0)
            absent = [span for has, span in zip(present or [], ps.spans) if not has]
            kept = [self.meansq[o : o + n].clone() for o, n in absent]
            self.meansq.mul_(0.95).add_(0.05 * grad * grad)
            for (o, n), saved in zip(absent, kept):
                self.meansq[o : o + n].copy_(saved)
            lam = lam / torch.sqrt(self.meansq + 1e-7)
        return grad + lam * grad * grad * (ps.flat - self.read[rank])

    def answer(self, ps: "ParameterServer", rank: int, fut: Future) -> None:
        reply = ps.answer()
        self.read[rank] = reply[0]
        ps.reply(fut, reply)


class SyncRound(Rule):
    """sync-ps: one step with the mean of every live worker's gradient (zero where a worker had
    none of a parameter; one that no worker of the round had is not stepped)."""

    gathered: dict[int, tuple[torch.Tensor, Hypers, Present, Future]]  # this round's pushes so far, by rank
    mixed: bool  # a round's workers pushed different hyperparameters (warned of once)

    def __init__(self, cfg: RunConfig, opts: Options) -> None:
        super().__init__(cfg, opts)
        self.gathered = {}
        self.mixed = False

    def on_push(
        self,
        ps: "ParameterServer",
        rank: int,
        grad: torch.Tensor,
        version_read: int,
        hypers: Hypers,
        present: Present,
        fut: Future,
    ) -> None:
        self.gathered[rank] = (grad, hypers, present, fut)
        self._maybe_step(ps)

    def on_leave(self, ps: "ParameterServer", rank: int) -> None:
        self._maybe_step(ps)

    def _maybe_step(self, ps: "ParameterServer") -> None:
        if not self.gathered or len(self.gathered) < len(ps.active):
            return
        ranks = sorted(self.gathered)
        ps.staleness[0] += len(ranks)
        total = self.gathered[ranks[0]][0].clone()
        for r in ranks[1:]:  # a fixed order: float sums depend on it
            total += self.gathered[r][0]
        hypers = self.gathered[ranks[0]][1]
        if not self.mixed and any(self.gathered[r][1] != hypers for r in ranks[1:]):
            self.mixed = True
            log.warning(
                "the workers of a sync-ps round pushed different optimiser settings (lr, momentum, ...); "
                "the server steps with worker %d's (the round's lowest rank), here and in every such round",
                ranks[0] - 1,
            )
        present = _any_present([self.gathered[r][2] for r in ranks])
        ps.apply(total / len(ranks), hypers, present, clip=self.cfg.clip_grad_norm)  # the mean's norm clipped
        reply = ps.answer()
        for r in ranks:
            ps.reply(self.gathered[r][3], reply)
        self.gathered = {}


def _any_present(pushes: list[Present]) -> Present:
    """The parameters any of a round's pushes has a gradient of (None: all)."""
    partial = [present for present in pushes if present is not None]
    if len(partial) < len(pushes):
        return None
    union = [any(has) for has in zip(*partial)]
    return None if all(union) else union


class Elastic(Rule):
    """Async easgd's centre: x and the centre include floating-point buffers; the centre copies the
    exchanging worker's integer buffers. A worker exchanges every ``tau`` steps."""

    opts: EASGDOptions
    steps = False  # the centre moves by the elastic force; each worker steps its own optimiser
    stale = False  # an exchange moves the centre toward the worker's x_i as it is now

    def figures(self, workers: int) -> dict[str, Any]:
        return {"alpha": elastic_alpha(self.opts, workers), "tau": self.opts.tau, "easgd_mode": self.opts.easgd_mode}

    @property
    def steps_per_message(self) -> int:
        return self.opts.tau

    def exchange(
        self, ps: "ParameterServer", rank: int, x: torch.Tensor, floats: list[torch.Tensor], ints: list[torch.Tensor]
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """d = x_i - x~ (the flat parameters, and each floating-point buffer); x~ <- x~ + alpha d."""
        alpha = elastic_alpha(self.opts, ps.workers)
        diff = x - ps.flat
        ps.flat.add_(alpha * diff)
        diffs = []
        with torch.no_grad():
            for b, v in zip(float_buffers(ps.model), floats):
                d = v - b.reshape(-1)
                b.add_((alpha * d).view_as(b))
                diffs.append(d)
            for b, v in zip(int_buffers(ps.model), ints):
                b.copy_(v.view_as(b))
        return diff, diffs


__all__ = ["Rule", "Asynchronous", "SyncRound", "BoundedStaleness", "DelayCompensated", "Elastic", "dc_lambda"]
