"""The algorithm interface and the registry of algorithm names.

One training loop (:mod:`distsgd.train.loop`) serves every algorithm. An algorithm is one class
with a registered ``name``, a ``topology`` (how its processes are arranged, which decides the
launcher: :mod:`distsgd.launch`), and the loop's hooks, called in this order:

- ``check(cfg)`` (class method): reject settings the algorithm cannot honour, before any process
  starts; the algorithm's own options (``--tau``, ``--staleness``, ...) are judged here.
- ``variant(cfg)`` (class method): the class that runs these settings (easgd's async mode is a
  parameter-server algorithm).
- ``default_settings(cfg)`` (class method): its own defaults for common settings the user left
  unset, where the generic default is wrong for it (DiLoCo's inner AdamW: its paper's lr and
  weight decay).
- ``setup(ctx, model) -> model``: before the first step; may wrap or replace the model.
- ``make_optimizer(ctx, model)``: the optimiser (default: ``--optimizer`` on every parameter).
- ``before_training(ctx)``: everything is built; the training clock starts when this returns.
- ``keep_going(ctx)``: checked before every step; False stops this worker.
- ``no_sync(ctx, model)``: a context for the backward of a micro-batch that is not a step's
  last (``--accumulate``): gradients accumulate locally, nothing is synchronised.
- ``after_backward(ctx, model)``: gradients are ready; synchronise them here.
- ``apply_step(ctx, optimizer)``: apply the update (plain, under a lock, or by a server).
- ``after_step(ctx, model, local_samples)``: the update is applied; synchronise parameters here.
- ``global_samples(ctx, local_samples)``: all workers' samples, as this worker knows them.
- ``on_epoch_end(ctx, model, epoch)``.
- ``evaluation_model(ctx, model)``: the model the algorithm would return now. Called on every
  worker at every evaluation point (so it may be a collective); the evaluating worker measures it.
- ``agree(ctx, flag)``: every worker reaches the same stop decision (rank 0's).
- ``barrier(ctx)``: every worker got here.
- ``checkpoint_saved(ctx, seq, commit)``: this worker wrote its part of checkpoint ``seq``. In
  lockstep, every worker waits for the others and rank 0 calls ``commit``; an algorithm with a
  coordinator (the shared-memory launcher, the parameter server) tells it instead, and it
  commits once every live worker has.
- ``starting_samples(ctx)``: for a worker that replaces one that died, the samples its rank had
  trained (it carries on from there in its shard).
- ``finish(ctx, model) -> model``: the model to evaluate, return and save.
- ``unwrap(model)``: this worker's own module, without the wrapper ``setup`` put round it.
- ``state_dict()`` / ``load_state_dict(state)``: the algorithm's part of a checkpoint.
- ``summary()``: extra keys for summary.json (``bytes_sent``, ``staleness``, ...).
- ``progress_figures(ctx)``: extra keys for the reporting worker's ``progress`` events (and so
  for metrics.jsonl, TensorBoard and the progress display), as of now: ``bytes_sent``, all
  workers' bytes so far, for algorithms that communicate. It runs every ``--log-every`` steps,
  so it must be cheap and must not communicate.

Each algorithm's docstring states its update rule, its paper, and what happens to buffers
(BatchNorm statistics) at each synchronisation.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any, Callable, ClassVar

import torch
import torch.distributed as dist
from torch import nn

from distsgd.algorithms.averaging import max_abs_diff
from distsgd.config import RunConfig
from distsgd.errors import ConfigError
from distsgd.train.optim import build_optimizer

if TYPE_CHECKING:
    from distsgd.train.context import WorkerContext

# How processes are arranged; each has its launcher module in distsgd.launch.
SINGLE = "single"  # one process
GROUP = "group"  # symmetric workers in a torch.distributed process group
SHARED = "shared"  # workers on one machine sharing one model in shared memory
SERVER = "server"  # a parameter server (rank 0) and workers, point-to-point over gloo


class Algorithm:
    """Base class: a single process with no synchronisation at all."""

    name: ClassVar[str] = ""
    topology: ClassVar[str] = SINGLE
    summary_line: ClassVar[str] = ""
    checkpoints: ClassVar[bool] = True  # whether --checkpoint-every / --resume work with it
    compresses: ClassVar[bool] = False  # whether --compress applies to what it sends

    def __init__(self, cfg: RunConfig) -> None:
        self.cfg = cfg
        self.bytes_sent = 0

    @classmethod
    def check(cls, cfg: RunConfig) -> None:
        """Reject settings this algorithm cannot honour (raise ConfigError)."""

    @classmethod
    def variant(cls, cfg: RunConfig) -> type["Algorithm"]:
        """The class that runs ``cfg`` (an algorithm may have modes with other topologies)."""
        return cls

    @classmethod
    def default_settings(cls, cfg: RunConfig) -> dict[str, Any]:
        """Defaults of its own for settings of ``config.GENERIC`` that the user left unset."""
        return {}

    def setup(self, ctx: "WorkerContext", model: nn.Module) -> nn.Module:
        return model

    def make_optimizer(self, ctx: "WorkerContext", model: nn.Module) -> torch.optim.Optimizer:
        return build_optimizer(self.cfg, self.unwrap(model), ctx.job.optimizer, ctx.job.param_groups)

    def before_training(self, ctx: "WorkerContext") -> None:
        pass

    def keep_going(self, ctx: "WorkerContext") -> bool:
        return True

    def no_sync(self, ctx: "WorkerContext", model: nn.Module) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def after_backward(self, ctx: "WorkerContext", model: nn.Module) -> None:
        pass

    def apply_step(self, ctx: "WorkerContext", optimizer: torch.optim.Optimizer) -> None:
        optimizer.step()

    def after_step(self, ctx: "WorkerContext", model: nn.Module, local_samples: int) -> None:
        pass

    def global_samples(self, ctx: "WorkerContext", local_samples: int) -> int:
        """Samples processed by all workers, as this worker knows it (lockstep: local x world)."""
        return local_samples * ctx.world

    def on_epoch_end(self, ctx: "WorkerContext", model: nn.Module, epoch: int) -> None:
        pass

    def evaluation_model(self, ctx: "WorkerContext", model: nn.Module) -> nn.Module:
        """What this algorithm would return at this moment (the average, the centre, the module a
        DDP wrapper holds). Every worker calls it at an evaluation point, so it may communicate."""
        return self.unwrap(model)

    def agree(self, ctx: "WorkerContext", flag: bool) -> bool:
        return flag

    def barrier(self, ctx: "WorkerContext") -> None:
        """Wait until every worker got here."""

    def checkpoint_saved(self, ctx: "WorkerContext", seq: int, commit: Callable[[], None]) -> None:
        """Lockstep: a checkpoint is whole once every worker wrote its part; then rank 0 commits."""
        self.barrier(ctx)
        if ctx.rank == 0:
            commit()

    def starting_samples(self, ctx: "WorkerContext") -> int:
        """The samples a replacement worker's rank had trained (see ``WorkerContext.replacement``)."""
        return 0

    def finish(self, ctx: "WorkerContext", model: nn.Module) -> nn.Module:
        return self.unwrap(model)

    def unwrap(self, model: nn.Module) -> nn.Module:
        """This worker's own module, without any wrapper ``setup`` put round it (DDP's)."""
        return model

    def state_dict(self) -> dict[str, Any]:
        """The algorithm's own state for a checkpoint (plain values and tensors only)."""
        return {"bytes_sent": self.bytes_sent}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.bytes_sent = state["bytes_sent"]

    def summary(self) -> dict[str, Any]:
        return {}

    def progress_figures(self, ctx: "WorkerContext") -> dict[str, Any]:
        """Figures for this worker's next progress event (none: it does not communicate). A
        parameter server's staleness and bytes come from the server's own ``server`` events."""
        return {}


_REGISTRY: dict[str, type[Algorithm]] = {}


def register(cls: type[Algorithm]) -> type[Algorithm]:
    if not cls.name or cls.name in _REGISTRY:
        raise ValueError(f"bad or duplicate algorithm name {cls.name!r}")
    _REGISTRY[cls.name] = cls
    return cls


def get(name: str) -> type[Algorithm]:
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ConfigError(f"unknown algorithm '{name}' (choose from {', '.join(_REGISTRY)})") from None


def resolve(name: str, cfg: RunConfig) -> type[Algorithm]:
    """The class that runs algorithm ``name`` with these settings."""
    return get(name).variant(cfg)


def names() -> list[str]:
    return list(_REGISTRY)


class GroupAlgorithm(Algorithm):
    """Symmetric workers in a torch.distributed process group, stepping in lockstep."""

    topology: ClassVar[str] = GROUP

    def __init__(self, cfg: RunConfig) -> None:
        super().__init__(cfg)
        self.sent_alike = 0  # the part of bytes_sent that every worker sends alike (collectives)
        self.eval_share = 0  # what this worker sent for evaluations, not for the algorithm
        self.world = 1  # the group's size, once ``setup`` knows it

    def before_training(self, ctx: "WorkerContext") -> None:
        """Start every worker's clock together, not when each finished building its model."""
        dist.barrier()

    def barrier(self, ctx: "WorkerContext") -> None:
        dist.barrier()

    def agree(self, ctx: "WorkerContext", flag: bool) -> bool:
        """Rank 0 decides (it evaluates); everyone follows."""
        t = torch.tensor([1 if flag else 0])
        dist.broadcast(t, src=0)
        return bool(t.item())

    def sent(self, nbytes: int, world: int) -> None:
        """Count an all-reduce of ``nbytes``: a ring all-reduce sends 2 (W-1)/W of it per worker."""
        share = int(2 * (world - 1) * nbytes / world)
        self.bytes_sent += share
        self.sent_alike += share

    def sent_to_evaluate(self, nbytes: int, world: int) -> None:
        """Count an all-reduce of ``nbytes`` that an evaluation needed (the average of the workers'
        models in the middle of a period, say): sent, but not by the algorithm, so not in
        ``bytes_sent``; summary.json has it as ``eval_bytes_sent`` (all workers')."""
        self.eval_share += int(2 * (world - 1) * nbytes / world)

    def progress_figures(self, ctx: "WorkerContext") -> dict[str, Any]:
        """All workers' bytes so far, without asking them: every worker sends what ``sent`` counts
        alike, and only this reporting worker (rank 0) sends anything else (DDP's broadcasts)."""
        return {"bytes_sent": self.bytes_sent + (ctx.world - 1) * self.sent_alike}

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "sent_alike": self.sent_alike, "eval_share": self.eval_share}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.sent_alike = state.get("sent_alike", 0)  # checkpoints written before it was counted
        self.eval_share = state.get("eval_share", 0)

    def finish(self, ctx: "WorkerContext", model: nn.Module) -> nn.Module:
        """The model to return, then how far its replicas are apart (0.0: equal parameters and buffers)."""
        final = self.final_model(ctx, model)
        self.replica_max_abs_diff = max_abs_diff(final, ctx.world)
        return final

    def final_model(self, ctx: "WorkerContext", model: nn.Module) -> nn.Module:
        """The model every replica returns (after any last synchronisation)."""
        return self.unwrap(model)

    def summary(self) -> dict[str, Any]:
        out: dict[str, Any] = {"bytes_sent": self.bytes_sent,
                               "eval_bytes_sent": self.eval_share * self.world}
        if hasattr(self, "replica_max_abs_diff"):
            out["replica_max_abs_diff"] = self.replica_max_abs_diff
        return out
