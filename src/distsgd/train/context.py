"""What a worker knows about its run, what it returns, and the loop's small shared types.

The launcher builds a :class:`WorkerContext` for each worker; the algorithms read it; the loop
returns a :class:`WorkerResult`. Nothing here knows an algorithm or a launcher.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import nn

from distsgd.config import RunConfig
from distsgd.metrics import NullSink, Sink
from distsgd.models import ModelSpec


@dataclass
class SharedHandles:
    """What the shared-memory launcher hands each worker of a Hogwild!-family algorithm."""

    states: list[dict[str, torch.Tensor]]  # every model in shared memory (Hogwild!: one; hogwild++: one a cluster)
    counts: torch.Tensor  # samples done, one int64 slot per worker of this machine (shared)
    stop: torch.Tensor  # one shared byte: 1 tells every worker to stop (read with no lock)
    slot: int = 0  # this worker's slot in ``counts``
    machines: int = 1  # under torchrun: the processes (clusters) of the run, each with a share like this one's
    lock: Any = None  # --hogwild-lock: one lock around every update
    extras: Any = None  # the algorithm's own shared state (its ``shared_extras``)
    start_together: Callable[[], None] | None = None  # set in the worker: say ready, wait for the go
    checkpointed: Callable[[int, int], None] | None = None  # set in the worker: "saved seq, at these samples"


@dataclass
class Job:
    """What to train: the settings, the model, the data, and the user code settings cannot hold
    (each a module-level function, so that it can travel to worker processes)."""

    cfg: RunConfig
    model: ModelSpec
    data: Any  # distsgd.data.Dataset (tensors) or TorchData (any torch Dataset)
    loss: Callable | None = None  # loss(output, target) -> scalar; None: cfg.loss
    optimizer: Callable | None = None  # optimizer(model) -> torch.optim.Optimizer; None: cfg.optimizer
    param_groups: Callable | None = None  # param_groups(model) -> [{"params": [...], "lr": ...}, ...]

    def replace(self, **changes: Any) -> "Job":
        return dataclasses.replace(self, **changes)


@dataclass
class WorkerContext:
    """What one worker knows about the run."""

    job: Job
    rank: int = 0
    world: int = 1
    sink: Sink = field(default_factory=NullSink)
    reports: bool = True  # emits progress events (rank 0; every Hogwild! worker)
    evaluates: bool | None = None  # evaluates the model (default: same as reports)
    shared: SharedHandles | None = None  # set by the shared-memory launcher
    server: str | None = None  # the parameter server's host:port (its workers')
    replacement: bool = False  # replaces a worker that died (--restart-workers): carries on from its samples
    resumed: bool = False  # continuing from a checkpoint: do not re-synchronise the start

    def __post_init__(self) -> None:
        if self.evaluates is None:
            self.evaluates = self.reports

    @property
    def cfg(self) -> RunConfig:
        return self.job.cfg

    @property
    def dataset(self) -> Any:
        return self.job.data

    @property
    def model_spec(self) -> ModelSpec:
        return self.job.model


@dataclass
class WorkerResult:
    rank: int
    samples: int  # this worker's training samples
    global_samples: int  # all workers', as this worker counted them
    train_wall_s: float
    evals: list[dict[str, Any]]
    final_test_accuracy: float | None
    final_test_loss: float | None
    model: nn.Module | None
    extra: dict[str, Any] = field(default_factory=dict)


class Every:
    """Fires once each time a count passes the next multiple of ``period`` (never when None):
    evaluations and checkpoints every N samples."""

    def __init__(self, period: int | None) -> None:
        self.period = period
        self.next = period

    def due(self, count: int) -> bool:
        if self.next is None or count < self.next:
            return False
        while self.next <= count:
            self.next += self.period
        return True

    def state_dict(self) -> dict[str, Any]:
        return {"next": self.next}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.next = state["next"] if self.period is not None else None
