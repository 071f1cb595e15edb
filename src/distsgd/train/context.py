"""What a worker knows about its run, what it returns, and the loop's small shared types.

The launcher builds a :class:`WorkerContext` for each worker; the algorithms read it; the loop
returns a :class:`WorkerResult`. Nothing here knows an algorithm or a launcher.
"""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import nn

from distsgd.config import RunConfig
from distsgd.data import TrainingData
from distsgd.metrics import NullSink, Sink
from distsgd.models import ModelSpec

ENDED_HERE = "ended_here"  # Job.resume_from's (not the manifest file's): the run finished at its checkpoint


@dataclass
class Job:
    """What to train: the settings, the model, the data, and the user code settings cannot hold
    (each a module-level function, so that it can travel to worker processes)."""

    cfg: RunConfig
    model: ModelSpec
    data: TrainingData  # distsgd.data.Dataset (tensors) or TorchData (any torch Dataset)
    loss: Callable | None = None  # loss(output, target) -> scalar; None: cfg.loss
    optimizer: Callable | None = None  # optimizer(model) -> torch.optim.Optimizer; None: cfg.optimizer
    param_groups: Callable | None = None  # param_groups(model) -> [{"params": [...], "lr": ...}, ...]
    main: Callable | None = None  # main(run): the user's own loop (distsgd.spawn); None: distsgd's loop
    callbacks: tuple = ()  # objects with on_eval / on_checkpoint / on_end (distsgd.callbacks)
    settings_given: tuple[str, ...] = ()  # the optimiser's settings spawn() was given (a loop's own must match)
    # the manifest of the checkpoint a local launcher chose to resume from (the newest whole one, or
    # the one before a damaged newest, which a run resumed elsewhere leaves unnamed in the run it
    # reads); None: the manifest of ``cfg.resume`` as it is (torchrun's ranks, or no resume). Its
    # ENDED_HERE says the run read from finished at that checkpoint
    resume_from: dict[str, Any] | None = None

    def replace(self, **changes: Any) -> "Job":
        return dataclasses.replace(self, **changes)

    @property
    def may_stop(self) -> bool:
        """Whether an evaluation may stop the run (--stop-at-target, or a callback's on_eval): then
        each is made when due, not after training."""
        return self.cfg.stop_at_target or any(callable(getattr(cb, "on_eval", None)) for cb in self.callbacks)


@dataclass
class WorkerContext:
    """What one worker knows about the run: its data rank among ``world`` data ranks, where its
    events go, and whether it reports progress and evaluates. Nothing about its topology: what
    the topology's launcher hands a worker (shared models, a server's address) is the algorithm's
    seat (``Algorithm(cfg, seat)``)."""

    job: Job
    rank: int = 0
    world: int = 1
    sink: Sink = field(default_factory=NullSink)
    reports: bool = True  # emits progress events (rank 0; every Hogwild! worker)
    evaluates: bool | None = None  # evaluates the model (default: same as reports)
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))  # where it trains (--device)
    # the shard of the data this worker reads, as (rank, world), where it is not its place in the
    # group (a group that lost a worker: the survivors keep their shards); None: (rank, world)
    shard: tuple[int, int] | None = None
    departed_samples: int = 0  # samples trained by workers the group has lost (--min-workers)
    # where a user's loop tells its figures (LoopEnd) before its last word to its server, where the
    # server cannot get its result otherwise (torchrun's rank 0); None: its result travels whole
    tell_end: Callable[["LoopEnd"], None] | None = None

    def __post_init__(self) -> None:
        if self.evaluates is None:
            self.evaluates = self.reports

    @property
    def cfg(self) -> RunConfig:
        return self.job.cfg

    @property
    def data_rank(self) -> int:
        return self.shard[0] if self.shard is not None else self.rank

    @property
    def data_world(self) -> int:
        return self.shard[1] if self.shard is not None else self.world

    @property
    def dataset(self) -> TrainingData:
        return self.job.data

    @property
    def model_spec(self) -> ModelSpec:
        return self.job.model


class Start(enum.Enum):
    """How a worker begins (``Algorithm.setup``'s ``start``)."""

    FRESH = "fresh"  # a new run: the algorithm makes every worker start from one model
    RESUMED = "resumed"  # from this worker's part of a checkpoint: it keeps what it saved
    REPLACEMENT = "replacement"  # in place of a worker that died: it rejoins the running model


@dataclass(frozen=True)
class Step:
    """The step a worker is taking, as its loop counts it, handed to the algorithm's hooks:
    ``number`` counts its steps, this one included (the first is 1); ``samples`` its samples once
    this step's batch is counted."""

    number: int
    samples: int


@dataclass
class Figures:
    """What a worker (or a coordinator: the shared-memory launcher, a parameter server) measured
    beyond the loop's counts, for summary.json: every field that is not None becomes a key. An
    algorithm returns its own subclass from ``Algorithm.figures``."""

    bytes_sent: int | None = None  # what this process sent; None: the algorithm does not communicate
    # True: the model returned is the one the run started from, trained on none of its samples
    # (DiLoCo's --partial-round theta, ended before its first outer step); None otherwise
    untrained: bool | None = None

    def summary(self) -> dict[str, Any]:
        return {k: v for k, v in dataclasses.asdict(self).items() if v is not None}

    def run_bytes(self, results: list["WorkerResult"]) -> tuple[int, list[int] | None] | None:
        """(every byte the run sent, each worker's) from all the results, rank 0's first; None
        when the algorithm does not communicate. A ring all-reduce's share is counted by each
        worker, so the run's bytes are the sum."""
        if self.bytes_sent is None:
            return None
        each = [r.figures.bytes_sent or 0 for r in results]
        return sum(each), each


@dataclass
class Attendance:
    """Who took part, as a launcher saw it (None: not recorded by this launcher)."""

    samples_per_worker: list[int] | None = None
    failed_workers: list[int] | None = None
    worker_errors: dict[str, str] | None = None  # worker -> its error, when any failed
    restarts: list[dict[str, Any]] | None = None  # one {worker, reason, at} per restart
    # --min-workers: one per worker lost and trained through ({worker, reason, generation, at_s,
    # recovery_s, samples, workers})
    recoveries: list[dict[str, Any]] | None = None

    def summary(self) -> dict[str, Any]:
        """Its keys for summary.json: those recorded, and ``restarts`` only where there were some
        (every launcher keeps the list; an empty one in every run's summary said nothing)."""
        return {k: v for k, v in dataclasses.asdict(self).items() if v is not None and (v or k != "restarts")}


@dataclass
class LoopEnd:
    """What a user's loop measured of its data and steps (its :class:`WorkerResult`'s fields)."""

    data_len: int | None
    steps: int | None
    step_samples: int | None


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
    figures: Figures = field(default_factory=Figures)
    attendance: Attendance | None = None
    where: dict[str, Any] | None = None  # its device and precision (train.device.describe)
    data_len: int | None = None  # a user's loop: an epoch of its run.loader's passes, as a training set's length
    steps: int | None = None  # a user's loop: the optimiser steps this worker took (its samples a step)
    step_samples: int | None = None  # the samples of those steps (a replacement's predecessor's are not)
    stale: str | None = None  # a user's loop: why its last evaluation is not the model returned's (no final figures)
    checkpoints: int | None = None  # a user's loop (not a replacement's): the checkpoints it saved its part of
    generation: int | None = None  # --min-workers: the generation of the group it finished in
    callbacks: list | None = None  # the worker that ran the callbacks: their attributes at its end (callbacks.states)
