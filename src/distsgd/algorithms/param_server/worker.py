"""The workers' side of the parameter server, and the registered algorithms asgd, sync-ps, ssp
and dcasgd (their rules: :mod:`.rules`)."""

from __future__ import annotations

from typing import Any, Callable, ClassVar

import torch
from torch import nn

from distsgd.algorithms.averaging import flat_view_, float_buffers, int_buffers, params
from distsgd.algorithms.base import SERVER, Algorithm, register
from distsgd.algorithms.param_server import transport
from distsgd.algorithms.param_server.role import ServerRole
from distsgd.algorithms.param_server.rules import (Asynchronous, BoundedStaleness, DelayCompensated, Rule,
                                                   SyncRound)
from distsgd.config import RunConfig
from distsgd.errors import ConfigError
from distsgd.metrics import Sink
from distsgd.train.context import Job, WorkerContext, WorkerResult


class ServerAlgorithm(Algorithm):
    """The worker side of every parameter-server rule: push the gradient, take the new weights."""

    topology = SERVER
    rule: ClassVar[type[Rule]] = Asynchronous
    exact_checkpoints: ClassVar[bool] = False  # sync-ps: exact, so a dead worker stops a checkpointed run

    @classmethod
    def check(cls, cfg: RunConfig) -> None:
        if cfg.staleness < 0:
            raise ConfigError(f"--staleness must be >= 0, got {cfg.staleness}")
        if cfg.dc_lambda is not None and cfg.dc_lambda < 0:
            raise ConfigError(f"--dc-lambda must be >= 0, got {cfg.dc_lambda}")

    # -- what the parameter-server launcher asks of the algorithm (a class method) -----------------
    @classmethod
    def serve(cls, job: Job, workers: int, address: str, sink: Sink,
              publish: Callable[[str], None] | None = None, given_up: torch.Tensor | None = None) -> WorkerResult:
        """Be the server of ``workers`` workers at ``address`` (``host:port``; port 0: any free one,
        told to ``publish``) until they are all done. ``given_up[rank]``: the local launcher will
        start no replacement for that rank (:class:`.role.ServerRole`)."""
        role = ServerRole(job, cls.rule(job.cfg), workers, sink, exact=cls.exact_checkpoints, given_up=given_up)
        service = transport.Service(role.server, role, transport.Layout.of(role.model), address,
                                    silence_s=job.cfg.timeout_s)
        if publish is not None:
            publish(service.address)
        service.start()
        try:
            result = role.run()
        finally:
            service.close()
        return result

    # -- the worker ------------------------------------------------------------------------------
    def setup(self, ctx: WorkerContext, model: nn.Module) -> nn.Module:
        layout = transport.Layout.of(model)  # before flat_view_: it refuses parameters of several dtypes
        self.params = params(model)
        self.weights = flat_view_(self.params)  # the server's answers land here, in the model itself
        self.floats, self.ints = float_buffers(model), int_buffers(model)
        assert ctx.server is not None, "a parameter-server worker needs the server's address"
        self.client = transport.Client(ctx.rank + 1, self.weights, layout, ctx.server, self.cfg.timeout_s,
                                       rejoining=ctx.replacement)  # data rank r is rank r + 1; the server 0
        self.local = 0
        self.version = self.client.pull()
        self.total = 0
        self.stop = False
        return model

    def before_training(self, ctx: WorkerContext) -> None:
        self.client.barrier()  # every worker is built: start together (a replacement: at once)

    def apply_step(self, ctx: WorkerContext, optimizer: torch.optim.Optimizer) -> None:
        pass  # the server steps; see after_step

    def after_step(self, ctx: WorkerContext, model: nn.Module, local_samples: int) -> None:
        self.local = local_samples
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.params]
        buffers = (self.floats, self.ints) if self.floats or self.ints else None
        self.version, self.total, self.stop = self.client.push(grads, self.version, local_samples, buffers)

    def global_samples(self, ctx: WorkerContext, local_samples: int) -> int:
        return max(self.total, local_samples)

    def keep_going(self, ctx: WorkerContext) -> bool:
        return not self.stop

    def finish(self, ctx: WorkerContext, model: nn.Module) -> nn.Module:
        self.client.done(self.local)
        return model

    def sent(self) -> int:
        """Every byte this worker sent the server: headers, gradients, buffers (and, resumed, before)."""
        return self.bytes_sent + self.client.bytes_sent

    def summary(self) -> dict[str, Any]:
        return {"bytes_sent": self.sent()}

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "bytes_sent": self.sent(), "version": self.version, "total": self.total}

    def checkpoint_saved(self, ctx: WorkerContext, seq: int, commit: Callable[[], None]) -> None:
        """The server commits, with its own state, once every live worker has saved its part."""
        self.client.checkpointed(seq, self.local)

    def starting_samples(self, ctx: WorkerContext) -> int:
        return self.client.samples

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.version, self.total = state["version"], state["total"]


@register
class ASGD(ServerAlgorithm):
    name = "asgd"
    rule = Asynchronous
    summary_line = "asynchronous SGD on a parameter server; --staleness-lr divides each gradient by its staleness"


@register
class SyncPS(ServerAlgorithm):
    """sync-ps's checkpoints are exact: every worker saves its loop state at the same round, and
    the server, once all have told it (before the next round can start), saves its own state
    (weights, optimiser, counters, evaluations) as of that round."""

    name = "sync-ps"
    rule = SyncRound
    exact_checkpoints = True
    summary_line = "parameter server that waits for all workers' gradients, then steps once (the seeds')"


@register
class SSP(ServerAlgorithm):
    name = "ssp"
    rule = BoundedStaleness
    summary_line = "stale synchronous parallel: no worker runs more than --staleness pushes ahead"


@register
class DCASGD(ServerAlgorithm):
    name = "dcasgd"
    rule = DelayCompensated
    summary_line = "delay-compensated ASGD: g + lambda g*g*(w - w_read); --dc-adaptive"

    @classmethod
    def check(cls, cfg: RunConfig) -> None:
        super().check(cfg)
        if cfg.optimizer != "sgd":
            raise ConfigError("dcasgd compensates SGD gradients: use --optimizer sgd")


__all__ = ["ServerAlgorithm", "ASGD", "SyncPS", "SSP", "DCASGD"]
