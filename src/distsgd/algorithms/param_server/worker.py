"""The parameter-server topology, the workers' side of it, and the registered algorithms asgd,
sync-ps, ssp and dcasgd (their rules: :mod:`.rules`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, ClassVar, TypeVar

import torch
from torch import nn

from distsgd.algorithms.averaging import flat_view_, float_buffers, int_buffers, params, refuse_sparse
from distsgd.algorithms.base import Algorithm, Server, ServerSeat, Topology, register
from distsgd.algorithms.param_server import transport, wire
from distsgd.algorithms.param_server.hyper import (
    Hyperparameters,
    describe_optimizer,
    optimizer_difference,
    settings_change,
    settings_of,
)
from distsgd.algorithms.param_server.role import ServerFigures, ServerRole
from distsgd.algorithms.param_server.rules import Asynchronous, BoundedStaleness, DelayCompensated, Rule, SyncRound
from distsgd.checkpoint import count
from distsgd.config import RunConfig
from distsgd.errors import ConfigError
from distsgd.metrics import Sink
from distsgd.options import Options, option
from distsgd.train.context import Figures, Job, Start, Step, WorkerContext, WorkerResult


class ServerTopology(Server):
    """What the parameter-server launcher asks of an algorithm: be the server. ``rule`` is the
    update rule's class, built from the run's settings and the algorithm's options."""

    def __init__(self, rule: type[Rule], exact_checkpoints: bool = False) -> None:
        self.rule, self.exact_checkpoints = rule, exact_checkpoints

    def serve(
        self,
        job: Job,
        algo_cls: type[Algorithm],
        workers: int,
        address: str,
        sink: Sink,
        publish: Callable[[str], None] | None = None,
        given_up: torch.Tensor | None = None,
        secret: bytes = b"",
    ) -> WorkerResult:
        """Be the server of ``workers`` workers at ``address`` (``host:port``; port 0: any free one,
        told to ``publish``) until they are all done, admitting only those that know ``secret``.
        ``given_up[rank]``: the local launcher will start no replacement for that rank
        (:class:`.role.ServerRole`)."""
        opts = algo_cls.parse_options(job.cfg)
        rule = self.rule(job.cfg, opts)
        role = ServerRole(
            job,
            rule,
            workers,
            sink,
            exact=self.exact_checkpoints,
            given_up=given_up,
            accept_nonfinite=getattr(opts, "accept_nonfinite", False),
        )
        layout = wire.Layout.of(role.model, role.server.hypers.count)
        service = transport.Service(role.server, role, layout, address, silence_s=job.cfg.timeout_s, secret=secret)
        if publish is not None:
            publish(service.address)
        service.start()
        try:
            result = role.run()
        finally:
            service.close()
        assert isinstance(result.figures, ServerFigures)  # the role's run made them
        result.figures.refused_connections = service.refused
        return result


@dataclass(frozen=True)
class ServerOptions(Options):
    accept_nonfinite: bool = option(
        False,
        "apply gradients with NaN or inf too (by default the server takes them "
        "as zero and counts them: nonfinite_pushes)",
    )


@dataclass(frozen=True)
class StalenessOptions(ServerOptions):
    staleness_lr: bool = option(False, "divide each gradient by its staleness (staleness-aware ASGD)")


@dataclass(frozen=True)
class SSPOptions(StalenessOptions):
    staleness: int = option(2, "how many pushes a worker may run ahead of the slowest", metavar="S")

    def check(self, cfg: RunConfig) -> None:
        if self.staleness < 0:
            raise ConfigError(f"--staleness must be >= 0, got {self.staleness}")


@dataclass(frozen=True)
class DCASGDOptions(StalenessOptions):
    dc_lambda: float | None = option(
        None,
        "the compensation strength lambda (lambda0 with --dc-adaptive)",
        default_help="0.04, adaptive 2",
        metavar="LAMBDA",
    )
    dc_adaptive: bool = option(False, "adaptive lambda0 / sqrt(mean square of gradients) (DC-ASGD-a)")

    def check(self, cfg: RunConfig) -> None:
        if self.dc_lambda is not None and self.dc_lambda < 0:
            raise ConfigError(f"--dc-lambda must be >= 0, got {self.dc_lambda}")


ServerOptionsT = TypeVar("ServerOptionsT", bound=Options)


class ServerAlgorithm(Algorithm[ServerOptionsT]):
    """The worker side of every parameter-server rule: push the gradient, take the new weights.
    Its seat is the server's address; a replacement worker rejoins under its rank. Workers may
    compute on GPUs; the server steps on the CPU (what it sends and receives are host bytes).

    The worker's optimiser never steps (but async EASGD's, between exchanges); it holds the
    settings the server steps with. It is built in ``setup``, before the worker connects, so
    that the HELLO describes its parameter groups (:mod:`.hyper`); each step, ``apply_step``
    reads its lr, momentum, betas and weight decay as the run's schedule or a user's LR scheduler
    left them, and ``after_step`` pushes them with the gradient and which parameters have one (a
    frozen or unused one has none: the server's optimiser skips it, as PyTorch's would)."""

    kind = "parameter server"
    topology: ClassVar[Topology] = ServerTopology(Asynchronous)
    binds_storage = True  # views of the flat buffer the server's weights come into
    keeps_buffers = True  # the ones each push carries

    seat: ServerSeat
    local: int  # this worker's samples, as it last told the server
    version: int  # the version of the weights it holds (checkpointed)
    total: int  # every worker's samples, as the server last told it (checkpointed)
    stop: bool  # the server said stop
    # built by setup:
    params: list[torch.Tensor]
    weights: torch.Tensor  # the parameters, one buffer they are views of: the server's answers land here
    landed: int  # the parameters' version counters summed once the last answer landed in them
    floats: list[torch.Tensor]  # the buffers each push carries: floating-point ones
    ints: list[torch.Tensor]  # and the others (integer, bool)
    optimizer: torch.optim.Optimizer  # the worker's: whose settings each push carries (make_optimizer returns it)
    # a user's loop's optimiser (run.setup) and its settings a push does not carry, as they were
    # then: held to them all through the run (the server's optimiser was built with them)
    theirs: tuple[torch.optim.Optimizer, list[dict[str, Any]]] | None
    hypers: Hyperparameters  # what of them travels (nothing where the server's optimiser never steps)
    pushed: list[float]  # their values at the step being taken (apply_step reads them, after_step pushes)
    client: transport.Client  # the connection to the server
    # the parameters whose gradient's layout is not yet seen (refuse_sparse looks at each one's first)
    unseen: set[int]

    def __init__(self, cfg: RunConfig, seat: object = None) -> None:
        assert isinstance(seat, ServerSeat), "a parameter-server worker runs under the server launcher"
        super().__init__(cfg, seat)
        self.local = self.version = self.total = 0
        self.stop = False
        self.unseen = set()  # (filled at setup)
        self.theirs = None

    @classmethod
    def check(cls, cfg: RunConfig) -> None:
        super().check(cfg)
        if cfg.precision == "fp16":
            raise ConfigError(
                f"{cfg.algo} sends gradients to a server that steps with them, and fp16's loss scaling "
                f"would leave them scaled and unchecked for overflow there: use --precision bf16"
            )

    def setup(self, ctx: WorkerContext, model: nn.Module, start: Start) -> nn.Module:
        wire.Layout.of(model)  # before flat_view_: it refuses parameters of several dtypes
        self.params = params(model)
        self.unseen = {id(p) for p in self.params}
        self.weights = flat_view_(self.params)
        self.floats, self.ints = float_buffers(model), int_buffers(model)
        self.optimizer = super().make_optimizer(ctx, model)
        self.hypers = Hyperparameters.of(self.optimizer, model) if self.server_steps() else Hyperparameters.none()
        self.pushed = []
        self.client = transport.Client(
            ctx.rank + 1,
            self.weights,
            wire.Layout.of(model, self.hypers.count),
            self.seat.address,
            self.cfg.timeout_s,
            rejoining=start is Start.REPLACEMENT,  # data rank r is rank r + 1
            secret=self.seat.secret,
            hypers=self.hypers,
        )
        # the weights, and every worker's samples (a replacement's schedule starts from the run's progress)
        self.version = self.client.pull()
        self.landed = sum(p._version for p in self.params)
        self.total = self.client.total
        # this rank's samples as the server counts them (a replacement's, a resumed run's): what its
        # first message claims to follow (async EASGD's first exchange comes before any after_step)
        self.local = self.client.samples
        return model

    def make_optimizer(self, ctx: WorkerContext, model: nn.Module) -> torch.optim.Optimizer:
        return self.optimizer  # the one whose groups the HELLO described

    def check_optimizer_name(self, ctx: WorkerContext, name: str) -> None:
        """``run.setup(name)``: the server built its optimiser (the run's ``--optimizer``, or
        ``spawn(optimizer=...)``'s function) before any worker's loop ran, so another name is refused
        here, naming the call (the server's refusal of the worker's HELLO said neither the call nor
        the fix). Where the server's optimiser never steps (async EASGD) the workers' is theirs."""
        if not self.server_steps():
            return
        if ctx.job.optimizer is not None:
            raise ConfigError(
                f"run.setup('{name}'): under {self.name} the server steps the model with the optimiser "
                f"distsgd.spawn(optimizer=...)'s function builds: call run.setup() without a name"
            )
        if name != self.cfg.optimizer:
            raise ConfigError(
                f"run.setup('{name}'): under {self.name} the server steps the model with the run's optimiser "
                f"({self.cfg.optimizer}), built before the workers' loops start: give distsgd.spawn(optimizer="
                f"'{name}') (or --optimizer {name}), and call run.setup() without it"
            )

    def optimizers_ready(self, ctx: WorkerContext, optimizers: list[torch.optim.Optimizer]) -> None:
        """A user's loop's own optimiser (``run.setup(model, opt)``, or a function): the server
        steps with its optimiser, the one ``spawn(optimizer=...)`` or the run's settings build (the
        worker's ``self.optimizer``, as the HELLO described it), taking each push's lr, momentum,
        betas and weight decay; so the user's must be that one in all but those, or one line."""
        if len(optimizers) > 1:
            raise ConfigError(
                f"under {self.cfg.algo} the server steps the model with one optimiser: put the parameters "
                f"of the other {len(optimizers) - 1} optimiser(s) in parameter groups of that one"
            )
        problem = optimizer_difference(optimizers[0], self.optimizer)
        if problem is not None:
            raise ConfigError(
                f"under {self.cfg.algo} the server steps the model with the optimiser distsgd.spawn(optimizer=...) "
                f"or the run's settings build ({describe_optimizer(self.optimizer)}), taking the lr, momentum, "
                f"betas and weight decay of each push: {problem}; give distsgd.spawn(optimizer=...) a "
                f"function that builds yours"
            )
        self.theirs = (optimizers[0], settings_of(optimizers[0]))

    def before_training(self, ctx: WorkerContext) -> None:
        self.client.barrier()  # every worker is built: start together (a replacement: at once)

    def apply_step(self, ctx: WorkerContext, optimizer: torch.optim.Optimizer, step: Step) -> None:
        """The server steps (see after_step), with this optimiser's settings at this step."""
        if self.hypers.count:
            self.pushed = self.hypers.read(optimizer, step.number)

    def after_step(self, ctx: WorkerContext, model: nn.Module, step: Step) -> None:
        self.local = step.samples
        # which parameters have a gradient (host knowledge: no look at a GPU's values); those without
        # (frozen, unused in the forward) travel as zeros and the server's optimiser skips them
        # a write through a parameter since the last answer landed (a clamp, a momentum target moved in
        # place): a look at their version counters (the flat weights' own does not move with them)
        if sum(p._version for p in self.params) != self.landed and self.client.changed_since_answer():
            raise ConfigError(self._changed_weights())
        present = [p.grad is not None for p in self.params]
        if self.unseen:  # (a sparse gradient: each parameter's first push's look; frozen ones never have one)
            for p, has in zip(self.params, present):
                if has and id(p) in self.unseen:
                    refuse_sparse(p, self.name, "the flat gradient it pushes")
                    self.unseen.discard(id(p))
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.params]
        buffers = (self.floats, self.ints) if self.floats or self.ints else None
        self.version, self.total, self.stop = self.client.push(
            grads, self.version, step.samples, buffers, self.pushed if self.hypers.count else None, present
        )
        self.landed = sum(p._version for p in self.params)

    def global_samples(self, ctx: WorkerContext, local_samples: int) -> int:
        return max(self.total, local_samples)

    def agree(self, ctx: WorkerContext, flag: bool) -> bool:
        """A worker whose own evaluation (a user's loop) reached the target tells the server, which
        stops every worker at its next request."""
        if flag:
            self.client.reached()
            self.stop = True
        return flag

    def keep_going(self, ctx: WorkerContext) -> bool:
        return not self.stop

    def weights_loaded(self, ctx: WorkerContext, model: nn.Module) -> None:
        raise ConfigError(
            f"under {self.cfg.algo} the server holds the model: weights loaded into a worker's copy "
            f"after run.setup() would be overwritten at its next step; load them in the model "
            f"factory given to distsgd.spawn(model=...), or resume a distsgd run with resume="
        )

    def optimizer_state_loaded(self, ctx: WorkerContext) -> None:
        if self.server_steps():  # the worker's optimiser never does
            raise ConfigError(
                f"under {self.cfg.algo} the server steps the model with its own optimiser: a state loaded "
                f"into a worker's (opt.load_state_dict) would never be used; resume a distsgd run with "
                f"resume=, whose checkpoint holds the server's optimiser"
            )

    def finish(self, ctx: WorkerContext, model: nn.Module) -> nn.Module:
        """Done: the buffers travel once more, as they are now (BatchNorm statistics recomputed
        after the last step are the model's the server returns)."""
        self.client.done(self.local, (self.floats, self.ints) if self.buffers_at_end() else None)
        return model

    @classmethod
    def server_steps(cls) -> bool:
        """Whether the server's optimiser steps the model (not async EASGD's centre, which moves by
        the elastic force while each worker steps its own)."""
        topology = cls.topology
        assert isinstance(topology, ServerTopology)
        return topology.rule.steps

    def buffers_at_end(self) -> bool:
        """Whether the buffers go with the DONE: where the server steps, always (each push carried
        them: the last push's unless changed since)."""
        return self.server_steps() and bool(self.floats or self.ints)

    def check_untouched(self, ctx: WorkerContext) -> None:
        """The loop's optimiser still matches the server's in what a push does not carry (Adam's
        eps raised mid-run was ignored, silently), and the worker's weights are still the server's
        last reply (a momentum target the loop moved in place after each step, a clamp, were
        overwritten by the next reply, silently): a look at the groups' settings, a copy to the host
        on a GPU, and a compare."""
        changed = settings_change(*self.theirs) if self.theirs is not None else None
        if changed is not None:
            raise ConfigError(
                f"your loop changed its optimiser during the run: {changed}; under {self.cfg.algo} the server "
                f"steps with its own, and a push carries only the lr, momentum, betas and weight decay, so the "
                f"change would be ignored; set it from the start (distsgd.spawn(optimizer=...))"
            )
        if self.client.changed_since_answer():
            raise ConfigError(self._changed_weights())

    def _changed_weights(self) -> str:
        """The line for weights the loop changed since the server's last reply (found at the next
        push, where the parameters' version moved, and at the checks between steps)."""
        return (
            f"your loop changed the model's weights since the server's last reply (a momentum target "
            f"updated in place, a clamp?): under {self.cfg.algo} the server holds them and its next "
            f"reply overwrites them, so the change is lost; keep a network your loop updates itself "
            f"outside the model given to run.setup(), and clamp in the forward (x.clamp(max=...)) "
            f"rather than the parameter after the step"
        )

    def sent(self) -> int:
        """Every byte this worker sent the server: headers, gradients, buffers (and, resumed, before)."""
        return self.bytes_sent + self.client.bytes_sent

    def figures(self) -> Figures:
        return Figures(bytes_sent=self.sent())

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "bytes_sent": self.sent(), "version": self.version, "total": self.total}

    def checkpoint_saved(self, ctx: WorkerContext, seq: int, commit: Callable[[], None]) -> None:
        """The server commits, with its own state, once every live worker has saved its part."""
        self.client.checkpointed(seq, self.local)

    def starting_samples(self, ctx: WorkerContext) -> int:
        return self.client.samples

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.version, self.total = count(state, "version"), count(state, "total")


@register
class ASGD(ServerAlgorithm[StalenessOptions]):
    name = "asgd"
    summary_line = (
        "parameter server (one TCP connection per worker), gradients applied as they arrive "
        "(--staleness-lr divides each by its staleness)"
    )


@register
class SyncPS(ServerAlgorithm[ServerOptions]):
    """sync-ps's checkpoints are exact: every worker saves its loop state at the same round, and
    the server, once all have told it (before the next round can start), saves its own state
    (weights, optimiser, counters, evaluations) as of that round."""

    name = "sync-ps"
    topology = ServerTopology(SyncRound, exact_checkpoints=True)
    clips_combined = True  # the server clips the round's mean gradient
    summary_line = "the same server waiting for all N gradients, then one step"


@register
class SSP(ServerAlgorithm[SSPOptions]):
    name = "ssp"
    topology = ServerTopology(BoundedStaleness)
    summary_line = "stale synchronous parallel: no worker more than --staleness S pushes ahead of the slowest"


@register
class DCASGD(ServerAlgorithm[DCASGDOptions]):
    name = "dcasgd"
    topology = ServerTopology(DelayCompensated)
    summary_line = "delay-compensated ASGD: g + lambda g*g*(w - w_read) (--dc-lambda, --dc-adaptive for DC-ASGD-a)"


__all__ = ["ServerTopology", "ServerAlgorithm", "ASGD", "SyncPS", "SSP", "DCASGD", "StalenessOptions"]
