"""The algorithm interface, the topologies algorithms declare, and the registry of names.

An algorithm is one module of this package (found by :mod:`.registry`, which imports them all):
a subclass of :class:`Algorithm` registered with :func:`register`, declaring

- ``name``, ``kind`` (its family, for listings) and ``summary_line``;
- its options: a frozen dataclass of :func:`distsgd.options.option` fields with help texts and a
  ``check``, given as the type argument of its base (``class LocalSGD(GroupAlgorithm[LocalSGDOptions])``),
  which makes it the class's ``Options`` and types ``self.opts``. The command line's flags, TOML
  keys, ``distsgd.train`` keywords and bench's ``NAME[key=value]`` come from it; nothing else in the
  package names its options;
- its state, in its class body: each attribute annotated with its type and what it holds. What
  the settings and the seat give is set in ``__init__``; what needs the model or the worker's
  context (its parameters, copies of it) is declared under "built by setup" and set there;
  ``state_dict`` saves, each under its own key, what a resumed run needs, and ``load_state_dict``
  reads those keys and no others;
- ``topology``: a small object saying how its processes are arranged, which picks the launcher
  (:mod:`distsgd.launch`) and holds what that launcher asks of the algorithm: :class:`Single`,
  :class:`Group`, :class:`SharedMemory` or :class:`Server`. A worker of a topology that hands
  its workers something (the shared models, the server's address) receives it as its ``seat``;
- the loop's hooks, called in this order:

  - ``check(cfg)`` (class method): reject settings it cannot honour, before any process starts
    (by default its options' ``check``);
  - ``variant(cfg)`` (class method): the class that runs these settings (easgd's async mode is a
    parameter-server algorithm);
  - ``default_settings(cfg)`` (class method): its own defaults for common settings the user left
    unset, where the generic default is wrong for it (DiLoCo's inner AdamW: its paper's lr);
  - ``setup(ctx, model, start) -> model``: before the first step; ``start`` says whether the
    worker is new, resumed from its part of a checkpoint or a replacement of a dead one;
  - ``make_optimizer(ctx, model)``: the optimiser (default: ``--optimizer`` on every parameter),
    unless the user's loop gave its own (``run.setup(model, opt)``, or several);
  - ``check_optimizer_name(ctx, name)``: a user's loop's ``run.setup("adam")``: refuse it if the
    workers' optimiser is a setting of the algorithm's own;
  - ``optimizers_ready(ctx, optimizers)``: the optimisers the run steps, however they were made;
  - ``before_training(ctx)``: everything is built; the training clock starts when this returns;
  - ``keep_going(ctx)``: checked before every step; False stops this worker;
  - ``no_sync(ctx, model)``: a context for the backward of a micro-batch that is not a step's
    last (``--accumulate``): gradients accumulate locally, nothing is synchronised;
  - ``after_backward(ctx, model, step)``: gradients are ready; synchronise them here (every
    ``run.backward`` outside ``no_sync`` calls it, so what the user does before the step sees the
    synchronised gradients; several in one step accumulate: a synchronisation must be linear in
    the gradients, or refuse a second one in ``check_resynced``). ``step``
    (:class:`~distsgd.train.context.Step`) is the step being taken, as the loop counts it (the
    loop owns the count: algorithms time their synchronisations by it, see :mod:`.periodic`);
  - ``check_resynced(ctx)``: the gradients were synchronised more than once before this step
    (accumulation without ``no_sync``): raise ConfigError if the algorithm cannot honour that;
  - ``apply_step(ctx, optimizer, step)``: apply the update (plain, under a lock, by a server);
    once for each optimiser of the user's loop, with the same ``step``;
  - ``after_step(ctx, model, step)``: the update is applied; synchronise parameters here;
  - ``global_samples(ctx, local_samples)``: all workers' samples, as this worker knows them;
  - ``on_epoch_end(ctx, model, epoch)``;
  - ``evaluation_model(ctx, model)``: the model the algorithm would return now. Called on every
    worker at every evaluation point (so it may be a collective: then say so with
    ``collective_evaluation``); the evaluating worker measures it;
  - ``weights_loaded(ctx, model)``: the user's loop loaded weights into the model after setup
    (``model.load_state_dict``): make them the algorithm's (DiLoCo's anchor), or refuse;
  - ``agree(ctx, flag)``: every worker reaches the same stop decision (rank 0's);
  - ``max_of(ctx, values)``: every worker's values, their largest (a signal asked one to stop);
  - ``sum_started(ctx, values)``: every worker's values summed, begun now, read later (a user's
    loop's samples, where its workers' batches differ);
  - ``barrier(ctx)``: every worker got here;
  - ``checkpoint_saved(ctx, seq, commit)``: this worker wrote its part of checkpoint ``seq``. In
    lockstep, every worker waits for the others and rank 0 calls ``commit``; an algorithm with a
    coordinator (the shared-memory launcher, the parameter server) tells it instead;
  - ``starting_samples(ctx)``: for a replacement worker, the samples its rank had trained;
  - ``finish(ctx, model) -> model``: the model to return; the loop then evaluates exactly it;
  - ``unwrap(model)``: this worker's own module, without the wrapper ``setup`` put round it;
  - ``state_dict()`` / ``load_state_dict(state)``: the algorithm's part of a checkpoint;
  - ``figures()``: its typed figures for summary.json (a :class:`~distsgd.train.context.Figures`);
  - ``progress_figures(ctx)``: extra keys for the reporting worker's ``progress`` events, as of
    now (``bytes_sent``, all workers' bytes so far). It runs every ``--log-every`` steps, so it
    must be cheap and must not communicate.

Each algorithm's docstring states its update rule, its paper, and what happens to buffers
(BatchNorm statistics) at each synchronisation.
"""

from __future__ import annotations

import contextlib
import logging
from abc import ABC, abstractmethod
from contextlib import AbstractContextManager
from dataclasses import dataclass
from multiprocessing.context import BaseContext
from typing import TYPE_CHECKING, Any, Callable, ClassVar, Generic, Protocol, TypeVar, cast, get_args

import torch
import torch.distributed as dist
from torch import nn

from distsgd.algorithms.averaging import max_abs_diff
from distsgd.checkpoint import count
from distsgd.config import RunConfig
from distsgd.errors import ConfigError
from distsgd.metrics import Sink
from distsgd.options import Options, flag_of
from distsgd.train import membership
from distsgd.train.context import Figures, Start, Step
from distsgd.train.optim import build_optimizer

if TYPE_CHECKING:
    from distsgd.train.context import Job, WorkerContext, WorkerResult

# The families algorithms belong to, in the order `distsgd algorithms` and the README list them.
KINDS = ("baseline", "data parallel", "shared memory", "parameter server", "model averaging", "low communication")


# -- topologies: how processes are arranged, and what each launcher asks of an algorithm ---------


class Topology(ABC):
    """How an algorithm's processes are arranged, and what follows from it: the code that runs,
    reports and checks a run asks these rather than which topology it is. What a topology cannot
    run without is abstract (``Server.serve``): a topology that lacks it cannot be made."""

    kind: ClassVar[str] = ""  # the launcher module that runs it (launch/<kind>.py), and its name in listings
    # every worker takes its steps with the others, so a stop asked for by a signal (a preemption)
    # can end them all at one step, with a final checkpoint there
    lockstep: ClassVar[bool] = False
    in_process: ClassVar[bool] = False  # one worker, trained in the calling process: no launcher
    process_group: ClassVar[bool] = False  # the workers are the ranks of one torch.distributed group
    # the workers step a model they do not own (the server's, or one in shared memory): none holds
    # a replica of its own to evaluate
    shared_model: ClassVar[bool] = False
    server: ClassVar[bool] = False  # a server process holds the model and applies the updates

    def spawns(self, torchrun: bool) -> bool:
        """Whether the run starts worker processes here (not in a launcher's group, whose ranks
        are the workers)."""
        return not self.in_process and not torchrun


class Single(Topology):
    """One process."""

    kind = "one"
    lockstep = True
    in_process = True
    process_group = True  # a group of one: what needs one works


class Group(Topology):
    """Symmetric workers in one torch.distributed process group, stepping in lockstep."""

    kind = "group"
    lockstep = True
    process_group = True


@dataclass
class SharedSeat:
    """What the shared-memory launcher hands each of its workers."""

    states: list[dict[str, torch.Tensor]]  # every model in shared memory (one, or one a cluster)
    counts: torch.Tensor  # samples done, one int64 slot per worker of this machine (shared)
    stop: torch.Tensor  # one shared byte: 1 tells every worker to stop (read with no lock)
    # --stop-at-target: hold[0] is the next evaluation point (samples, all workers'; -1: none): a
    # worker that finds the counts there waits before its next step until the launcher has measured
    # the model; hold[1 + slot] = 1 says that worker waits (or is done). None: never held
    hold: torch.Tensor | None = None
    slot: int = 0  # this worker's slot in ``counts``
    lock: AbstractContextManager[object] | None = None  # --hogwild-lock: one lock around every update
    extras: object = None  # the topology's own shared state (its ``extras``)
    start_together: Callable[[], None] | None = None  # set in the worker: say ready, wait for the go
    checkpointed: Callable[[int, int], None] | None = None  # set in the worker: "saved seq, at these samples"
    machines: int = 1  # under torchrun: the processes (clusters) of the run, each with a share like this one's
    device: str = "cpu"  # where the shared models live (a GPU: shared through CUDA IPC); the workers train there
    threads: bool = False  # the workers are threads of the launching process (sharing its models outright)


class SharedMemory(Topology):
    """Workers on one machine train models held in shared memory; the launching process watches,
    evaluates and checkpoints them. The defaults are Hogwild!'s: one model, nothing else shared."""

    kind = "shared"
    shared_model = True

    def spawns(self, torchrun: bool) -> bool:
        return True  # its workers, under torchrun too (one Hogwild! cluster a machine)

    def models(self, cfg: RunConfig) -> int:
        """How many models the launcher keeps in shared memory."""
        return 1

    def threads(self, cfg: RunConfig, own_loop: bool = False) -> bool:
        """Whether the workers run as threads of the launching process (sharing its models
        outright) rather than processes (sharing them through shared memory or CUDA IPC).
        ``own_loop``: the workers run a user's loop (``distsgd.spawn``)."""
        return False

    def extras(self, cfg: RunConfig, mpc: BaseContext, models: list[nn.Module]) -> object:
        """More shared state the workers need (handed over in their seat, opaque to the launcher)."""
        return None

    def lock(self, cfg: RunConfig, mpc: BaseContext) -> AbstractContextManager[object] | None:
        """A lock the workers take round every update (``SharedSeat.lock``); None: lock-free."""
        return None

    def combine(self, states: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        """The one model to evaluate and save, from the shared models."""
        return states[0]

    def figures(self, workers: list[Figures], extras: object) -> Figures:
        """The run's figures, from its workers' (lowest slot first) and the shared state at the end."""
        return workers[0] if workers else Figures()

    def local_workers(self, cfg: RunConfig) -> int | None:
        """Under torchrun, how many workers each process starts on its own model (one cluster per
        process); None: the algorithm runs on one machine only."""
        return None

    def per_machine(self, cfg: RunConfig, workers: int) -> RunConfig | None:
        """``cfg`` changed so that each torchrun process starts ``workers`` workers; None: the
        algorithm runs on one machine only."""
        return None

    def node_algorithm(self, algo_cls: type["Algorithm"]) -> type["Algorithm"]:
        """Under torchrun: the algorithm each process's local workers run on its one model."""
        return algo_cls

    def link(self, cfg: RunConfig, rank: int, n: int, model: nn.Module, seat: SharedSeat) -> "Link":
        """Under torchrun: what joins this process's model to the others'."""
        raise NotImplementedError

    def merge_nodes(self, per_node: list[Figures]) -> Figures:
        """Under torchrun: the run's figures from every process's own (rank 0's first)."""
        return per_node[0]


class Link(Protocol):
    """Under torchrun, what joins one process's shared model to the other processes' (hogwild++'s
    token ring), run beside its local workers."""

    def start(self) -> None: ...

    def global_samples(self) -> int:
        """Every process's samples, as this one knows them."""
        ...

    def request_stop(self) -> None:
        """Stop every process (the target was reached)."""

    def finish(self) -> int:
        """This process's workers are done: wait for the others, join the models; the run's samples."""
        ...

    def figures(self, workers: Figures) -> Figures:
        """This process's figures, from its workers' (``workers``)."""
        ...


@dataclass
class ServerSeat:
    """What the parameter-server launcher hands each worker: where the server listens, and the
    run's secret, which the server asks of every connection."""

    address: str
    secret: bytes = b""


class Server(Topology):
    """A server process (rank 0) holds the model; workers (ranks 1..N) reach it over TCP."""

    kind = "server"
    shared_model = server = True
    exact_checkpoints: bool = False  # every worker saves at the same round (sync-ps): lockstep restarts

    @abstractmethod
    def serve(
        self,
        job: "Job",
        algo_cls: type["Algorithm"],
        workers: int,
        address: str,
        sink: Sink,
        publish: Callable[[str], None] | None = None,
        given_up: torch.Tensor | None = None,
        secret: bytes = b"",
    ) -> "WorkerResult":
        """Be the server of ``workers`` workers of ``algo_cls`` at ``address`` until they are all done."""


# -- the interface --------------------------------------------------------------------------------


@dataclass(frozen=True)
class NoOptions(Options):
    """An algorithm without options of its own."""


OptionsT = TypeVar("OptionsT", bound=Options)


class Algorithm(Generic[OptionsT]):
    """Base class: a single process with no synchronisation at all, generic in its options' class."""

    name: ClassVar[str] = ""
    kind: ClassVar[str] = "baseline"  # one of KINDS
    summary_line: ClassVar[str] = ""
    topology: ClassVar[Topology] = Single()
    Options: ClassVar[type[Options]] = NoOptions  # the type argument (see __init_subclass__)
    checkpoints: ClassVar[bool] = True  # whether --checkpoint-every / --resume work with it
    # evaluation_model may communicate: a user's loop must call it on every worker at one point
    collective_evaluation: ClassVar[bool] = False
    # its step is the worker's GPU work alone (no collective, no server, no host lock), so that
    # --cuda-graphs can capture it whole (train/graphs.py)
    graphable: ClassVar[bool] = False
    # its workers can lose one and train on (--min-workers): its collectives wait through
    # distsgd.train.membership and its state is whole in state_dict (see regrouped)
    trains_through: ClassVar[bool] = False
    # between its synchronisations each worker's model and optimiser state are its own (model
    # averaging): after a regroup a survivor keeps them and takes only the shared state (the
    # algorithm's, the counters) from the most advanced member, so its work since the last
    # synchronisation is not lost. Otherwise (replicas kept equal) every member takes it all.
    local_model: ClassVar[bool] = False
    # its parameters are views of memory it holds (the shared model, a flat buffer the server's
    # weights are copied into): one replaced after setup (model.to(memory_format=...), .double())
    # would train apart from it
    binds_storage: ClassVar[bool] = False
    # it holds the model's buffers as it took them at setup (shared memory, the buffers a push
    # carries, the list an elastic exchange moves): one replaced by another tensor after setup
    # (``self.center = ...``) would train apart from it; the others take the model's buffers afresh
    keeps_buffers: ClassVar[bool] = False
    # --clip-grad-norm clips what it combines from the workers (sync-ps's server: the round's mean,
    # as one process would clip the global batch's gradient), not each worker's own
    clips_combined: ClassVar[bool] = False

    cfg: RunConfig
    opts: OptionsT  # its options, from cfg.options
    seat: object  # what its topology hands each worker (a SharedSeat, a ServerSeat; None: nothing)
    bytes_sent: int  # what this worker sent (checkpointed)

    def __init_subclass__(cls, **kwargs: object) -> None:
        super().__init_subclass__(**kwargs)
        for base in cls.__dict__.get("__orig_bases__", ()):  # class Mine(GroupAlgorithm[MyOptions]) -> MyOptions
            for arg in get_args(base):
                if isinstance(arg, type) and issubclass(arg, Options):
                    cls.Options = arg

    def __init__(self, cfg: RunConfig, seat: object = None) -> None:
        self.cfg = cfg
        self.opts = self.parse_options(cfg)
        self.seat = seat
        self.bytes_sent = 0

    @classmethod
    def parse_options(cls, cfg: RunConfig) -> OptionsT:
        """Its options, from ``cfg.options``."""
        # a ClassVar cannot be typed with OptionsT; __init_subclass__ made Options the type argument
        return cast(OptionsT, cls.Options.from_mapping(cfg.options))

    @classmethod
    def check(cls, cfg: RunConfig) -> None:
        """Reject settings this algorithm cannot honour (raise ConfigError)."""
        cls.parse_options(cfg).check(cfg)
        if cfg.trains_through and not cls.trains_through:
            able = ", ".join(sorted(a.name for a in _REGISTRY.values() if a.trains_through))
            raise ConfigError(
                f"--min-workers: {cls.name} cannot train on without a lost worker yet (only {able} can); "
                f"leave --min-workers out (--restart-workers restarts from the last checkpoint)"
            )

    @classmethod
    def check_own_loop(cls, cfg: RunConfig) -> None:
        """Reject settings a user's own loop (``distsgd.spawn``) cannot honour (raise ConfigError)."""

    @classmethod
    def variant(cls, cfg: RunConfig) -> type["Algorithm"]:
        """The class that runs ``cfg`` (an algorithm may have modes with other topologies)."""
        return cls

    @classmethod
    def default_settings(cls, cfg: RunConfig) -> dict[str, Any]:
        """Defaults of its own for settings of ``config.SETTLED`` that the user left unset."""
        return {}

    def setup(self, ctx: "WorkerContext", model: nn.Module, start: Start) -> nn.Module:
        return model

    def make_optimizer(self, ctx: "WorkerContext", model: nn.Module) -> torch.optim.Optimizer:
        return build_optimizer(self.cfg, self.unwrap(model), ctx.job.optimizer, ctx.job.param_groups)

    def check_optimizer_name(self, ctx: "WorkerContext", name: str) -> None:
        """A user's loop asked for ``run.setup(name)``, the run's ``--optimizer``: raise ConfigError
        if the algorithm's workers step another optimiser setting."""

    def optimizers_ready(self, ctx: "WorkerContext", optimizers: list[torch.optim.Optimizer]) -> None:
        """The optimisers the run steps (``make_optimizer``'s, or those of the user's loop)."""

    def before_training(self, ctx: "WorkerContext") -> None:
        pass

    def keep_going(self, ctx: "WorkerContext") -> bool:
        return True

    def no_sync(self, ctx: "WorkerContext", model: nn.Module) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def after_backward(self, ctx: "WorkerContext", model: nn.Module, step: Step) -> None:
        pass

    def loop_failure_why(self, exc: BaseException) -> str | None:
        """Why a user's loop failed in ``exc``, where the algorithm knows better than the
        exception's own words (None: they stand)."""
        return None

    def check_resynced(self, ctx: "WorkerContext") -> None:
        """Several synchronisations of one step's gradients add up (the default: linear ones)."""

    def apply_step(self, ctx: "WorkerContext", optimizer: torch.optim.Optimizer, step: Step) -> None:
        optimizer.step()

    def after_step(self, ctx: "WorkerContext", model: nn.Module, step: Step) -> None:
        pass

    def global_samples(self, ctx: "WorkerContext", local_samples: int) -> int:
        """Samples processed by all workers, as this worker knows it (lockstep: local x world, and
        what workers the group lost had trained)."""
        return local_samples * ctx.world + ctx.departed_samples

    def on_epoch_end(self, ctx: "WorkerContext", model: nn.Module, epoch: int) -> None:
        pass

    def regrouped(self, ctx: "WorkerContext") -> None:
        """The group lost a worker (``--min-workers``): ``ctx.rank`` and ``ctx.world`` are this
        worker's place in the new group, and its state is about to be the most advanced
        survivor's (``load_state_dict``). Forget what was in flight in the old group."""

    def sent_counts(self) -> dict[str, int]:
        """This worker's own counts of what it sent (kept when it takes another's state)."""
        return {"bytes_sent": self.bytes_sent}

    def restore_sent_counts(self, counts: dict[str, int]) -> None:
        for name, value in counts.items():
            setattr(self, name, value)

    def evaluation_model(self, ctx: "WorkerContext", model: nn.Module) -> nn.Module:
        """What this algorithm would return at this moment (the average, the centre, the module a
        DDP wrapper holds). Every worker calls it at an evaluation point, so it may communicate."""
        return self.unwrap(model)

    def check_untouched(self, ctx: "WorkerContext") -> None:
        """A user's loop, now and then between its steps (see own_loop's CHECK_EVERY): raise a
        ConfigError if the loop changed what this algorithm would silently overwrite (by default
        nothing is)."""

    def weights_loaded(self, ctx: "WorkerContext", model: nn.Module) -> None:
        """The user's loop loaded weights into ``model`` after setup (by default they are simply
        the model's: the next steps start from them)."""

    def optimizer_state_loaded(self, ctx: "WorkerContext") -> None:
        """The user's loop loads a state into the optimiser run.setup() returned (by default the
        optimiser's own: the next steps take it)."""

    def agree(self, ctx: "WorkerContext", flag: bool) -> bool:
        return flag

    def spread(self, ctx: "WorkerContext", values: list[float]) -> tuple[list[float], list[float]]:
        """Every worker's ``values`` (a user's loop's learning rates), element by element their
        smallest and largest (every worker calls it at the same step); a worker alone's own."""
        return values, values

    def max_of(self, ctx: "WorkerContext", values: list[int]) -> list[int] | None:
        """Every worker's ``values``, element by element their largest (every worker calls it at
        the same step: whether a signal asked any of them to stop, ...); a process group's as of
        the previous call (None at the first), its reduction overlapping the steps between."""
        return values

    def sum_started(self, ctx: "WorkerContext", values: list[int]) -> Callable[[], list[int]]:
        """Every worker's ``values`` summed, element by element (every worker calls it at the same
        step): begun now, and a function that waits for the sums (a worker alone's: its own)."""
        return lambda: values

    def barrier(self, ctx: "WorkerContext") -> None:
        """Wait until every worker got here."""

    def checkpoint_saved(self, ctx: "WorkerContext", seq: int, commit: Callable[[], None]) -> None:
        """Lockstep: a checkpoint is whole once every worker wrote its part; then rank 0 commits."""
        self.barrier(ctx)
        if ctx.rank == 0:
            commit()

    def starting_samples(self, ctx: "WorkerContext") -> int:
        """The samples a replacement worker's rank had trained."""
        return 0

    def finish(self, ctx: "WorkerContext", model: nn.Module) -> nn.Module:
        """The model this worker returns, after the algorithm's last synchronisation (timed)."""
        return self.unwrap(model)

    def verify(self, ctx: "WorkerContext", model: nn.Module) -> None:
        """Checks of the returned ``model`` that are not training (the clock is stopped)."""

    def unwrap(self, model: nn.Module) -> nn.Module:
        """This worker's own module, without any wrapper ``setup`` put round it (DDP's)."""
        return model

    def state_dict(self) -> dict[str, Any]:
        """The algorithm's own state for a checkpoint (plain values and tensors only)."""
        return {"bytes_sent": self.bytes_sent}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`'s keys, each checked (``distsgd.checkpoint.count``, ...):
        a value it never writes is one CheckpointError."""
        self.bytes_sent = count(state, "bytes_sent")

    def figures(self) -> Figures:
        """This worker's figures for summary.json (none: it does not communicate)."""
        return Figures()

    def progress_figures(self, ctx: "WorkerContext") -> dict[str, float]:
        """Figures for this worker's next progress event (none: it does not communicate). A
        parameter server's staleness and bytes come from the server's own ``server`` events."""
        return {}


# -- the registry ---------------------------------------------------------------------------------

_REGISTRY: dict[str, type[Algorithm]] = {}


# A process group's algorithm exchanges something through at least one of these (GroupAlgorithm's
# own do nothing of the kind): one that overrides none would train W models apart, silently
SYNC_HOOKS = ("setup", "after_backward", "apply_step", "after_step")


def register(cls: type[Algorithm]) -> type[Algorithm]:
    """Register an algorithm under its ``name``; its options get it as their owner (messages).
    What it must declare or define is checked here, at import, so that a forgotten one is an
    error and not a run that trains otherwise."""
    if not cls.name or cls.name in _REGISTRY:
        raise ValueError(f"bad or duplicate algorithm name {cls.name!r}")
    if cls.kind not in KINDS:
        raise ValueError(f"{cls.name}: kind {cls.kind!r} is not one of {KINDS}")
    if not cls.summary_line:
        raise ValueError(f"{cls.name}: give it a summary_line (`distsgd algorithms` and the README list it)")
    if isinstance(cls.topology, Group) and not any(
        getattr(cls, hook) is not getattr(GroupAlgorithm, hook) for hook in SYNC_HOOKS
    ):
        raise ValueError(
            f"{cls.name}: a process group's algorithm exchanges something in one of {', '.join(SYNC_HOOKS)}; "
            f"it defines none of them"
        )
    _REGISTRY[cls.name] = cls
    if cls.Options is not NoOptions and not cls.Options.__dict__.get("owner"):
        cls.Options.owner = cls.name
    return cls


def get(name: str) -> type[Algorithm]:
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ConfigError(f"unknown algorithm '{name}' (choose from {', '.join(names())})") from None


def class_for(name: str, cfg: RunConfig) -> type[Algorithm]:
    """The class that runs algorithm ``name`` with these settings."""
    return get(name).variant(cfg)


def baseline() -> str:
    """The algorithm every other is measured against (the first of kind "baseline")."""
    return names()[0]


def names() -> list[str]:
    """Every algorithm's name, family by family (KINDS), in the order they were registered."""
    order = list(_REGISTRY)
    return sorted(order, key=lambda n: (KINDS.index(_REGISTRY[n].kind), order.index(n)))


def option_owners() -> dict[str, list[str]]:
    """Every option name of every algorithm (its variants' included) -> the algorithms that take it."""
    owners: dict[str, list[str]] = {}
    for name in names():
        for field_name in _REGISTRY[name].Options.names():
            owners.setdefault(field_name, []).append(name)
    return owners


def options_of(cfg: RunConfig, algo_cls: type[Algorithm]) -> Options:
    """``algo_cls``'s options from ``cfg.options``, with a clear line for an option of another
    algorithm (``--tau is easgd's option, not local-sgd's``)."""
    own = set(algo_cls.Options.names())
    owners = option_owners()
    for key in cfg.options:
        if key not in own:
            whose = owners.get(key, [])
            flag = "--" + key.replace("_", "-")
            advice = (
                f": run it with --algo {whose[0]}" if len(whose) == 1 else (": choose one with --algo" if whose else "")
            )
            raise ConfigError(
                f"{flag} is an option of {', '.join(whose) or 'no algorithm'}, not of {algo_cls.name}{advice}"
            )
    return algo_cls.parse_options(cfg)


__all__ = [
    "Algorithm",
    "Topology",
    "Single",
    "Group",
    "SharedMemory",
    "SharedSeat",
    "Link",
    "Server",
    "ServerSeat",
    "NoOptions",
    "KINDS",
    "register",
    "get",
    "class_for",
    "names",
    "baseline",
    "option_owners",
    "options_of",
    "flag_of",
    "GroupAlgorithm",
    "Start",
    "Step",
]


# What one worker sends in a collective of ``n`` bytes among ``w`` workers (``n``: the tensor each
# passes in; an all-gather's piece is its own). Bandwidth-optimal algorithms, as NCCL and gloo run
# them on large tensors: a ring all-reduce sends each 1/W chunk W - 1 times in its reduce-scatter
# and again in its all-gather; an all-gather passes each piece on to the W - 1 others; a
# broadcast's root sends to the W - 1 others (the others send nothing: counted on the root); a
# point-to-point send (gossip, a token) sends n.
SHARES: dict[str, Callable[[int, int], int]] = {
    "all_reduce": lambda n, w: 2 * (w - 1) * n // w,
    "all_gather": lambda n, w: (w - 1) * n,
    "broadcast": lambda n, w: (w - 1) * n,
    "send": lambda n, w: n,
}
ALIKE = ("all_reduce", "all_gather")  # every worker sends the same share (a broadcast, a send: only the sender)


class GroupAlgorithm(Algorithm[OptionsT]):
    """Symmetric workers in a torch.distributed process group, stepping in lockstep."""

    topology: ClassVar[Topology] = Group()
    kind: ClassVar[str] = "data parallel"

    world: int  # the group's size (1 until setup knows it)
    sent_alike: int  # the part of bytes_sent that every worker sends alike (collectives; checkpointed)
    eval_share: int  # what this worker sent for evaluations, not for the algorithm (checkpointed)
    largest: int  # the largest single collective's share, for the peak a link must carry (checkpointed)
    replica_max_abs_diff: float | None  # how far the returned model's replicas are apart, once verify measured it
    _max: tuple[Any, torch.Tensor] | None  # max_of's reduction in flight (its work and its tensor)

    def __init__(self, cfg: RunConfig, seat: object = None) -> None:
        super().__init__(cfg, seat)
        self.world = 1
        self.sent_alike = self.eval_share = self.largest = 0
        self.replica_max_abs_diff = None
        self._max = None

    def setup(self, ctx: "WorkerContext", model: nn.Module, start: Start) -> nn.Module:
        self.world = ctx.world
        return model

    def before_training(self, ctx: "WorkerContext") -> None:
        """Start every worker's clock together, not when each finished building its model."""
        membership.call(dist.barrier)

    def barrier(self, ctx: "WorkerContext") -> None:
        membership.call(dist.barrier)

    def spread(self, ctx: "WorkerContext", values: list[float]) -> tuple[list[float], list[float]]:
        t = torch.tensor([*values, *(-v for v in values)], dtype=torch.float64, device=ctx.device)
        membership.call(dist.all_reduce, t, op=dist.ReduceOp.MAX)
        top = t.tolist()
        return [-v for v in top[len(values) :]], top[: len(values)]

    def agree(self, ctx: "WorkerContext", flag: bool) -> bool:
        """Rank 0 decides (it evaluates); everyone follows."""
        t = torch.tensor([1 if flag else 0], device=ctx.device)
        membership.call(dist.broadcast, t, src=0)
        return bool(t.item())

    def max_of(self, ctx: "WorkerContext", values: list[int]) -> list[int] | None:
        """As of every worker's previous call: each call's reduction runs while the workers train
        on, and is read at the next call (a blocking one every step cost a third of a small
        model's throughput on 2 cores)."""
        previous = self._max
        t = torch.tensor(values, dtype=torch.int64, device=ctx.device)
        self._max = (dist.all_reduce(t, op=dist.ReduceOp.MAX, async_op=True), t)
        if previous is None:
            return None
        membership.wait(previous[0])
        return [int(v) for v in previous[1].tolist()]

    def sum_started(self, ctx: "WorkerContext", values: list[int]) -> Callable[[], list[int]]:
        t = torch.tensor(values, dtype=torch.int64, device=ctx.device)
        work = dist.all_reduce(t, op=dist.ReduceOp.SUM, async_op=True)

        def done() -> list[int]:
            membership.wait(work)
            return [int(v) for v in t.tolist()]

        return done

    def regrouped(self, ctx: "WorkerContext") -> None:
        self.world = ctx.world
        self._max = None  # a reduction in the old group: the next call starts afresh

    def sent_counts(self) -> dict[str, int]:
        return {
            **super().sent_counts(),
            "sent_alike": self.sent_alike,
            "eval_share": self.eval_share,
            "largest": self.largest,
        }

    def sent(self, nbytes: int, world: int, collective: str = "all_reduce") -> None:
        """Count this worker's share of a ``collective`` (a name of :data:`SHARES`) of ``nbytes``
        among ``world`` workers. A broadcast or a send is counted by its sender alone."""
        share = SHARES[collective](nbytes, world)
        self.bytes_sent += share
        if collective in ALIKE:
            self.sent_alike += share
        self.largest = max(self.largest, share)

    def sent_to_evaluate(self, nbytes: int, world: int, collective: str = "all_reduce") -> None:
        """Count a collective that an evaluation needed (the average of the workers' models in the
        middle of a period, say), as :meth:`sent` does: sent, but not by the algorithm, so not in
        ``bytes_sent``; summary.json has it as ``eval_bytes_sent`` (all workers', so every
        worker's is alike: an all-reduce or an all-gather)."""
        assert collective in ALIKE, collective
        self.eval_share += SHARES[collective](nbytes, world)

    def progress_figures(self, ctx: "WorkerContext") -> dict[str, float]:
        """All workers' bytes so far, without asking them: every worker sends what ``sent`` counts
        alike, and only this reporting worker (rank 0) sends anything else (DDP's broadcasts: an
        algorithm whose other workers broadcast or send has its own)."""
        return {"bytes_sent": self.bytes_sent + (ctx.world - 1) * self.sent_alike}

    def state_dict(self) -> dict[str, Any]:
        return {
            **super().state_dict(),
            "sent_alike": self.sent_alike,
            "eval_share": self.eval_share,
            "largest": self.largest,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.sent_alike = count(state, "sent_alike")
        self.eval_share = count(state, "eval_share")
        self.largest = count(state, "largest")

    def finish(self, ctx: "WorkerContext", model: nn.Module) -> nn.Module:
        if self._max is not None:  # the last max_of's reduction, done before the collectives that follow
            membership.wait(self._max[0])
            self._max = None
        return self.final_model(ctx, model)

    def verify(self, ctx: "WorkerContext", model: nn.Module) -> None:
        """How far the returned model's replicas are apart (0.0: equal parameters and buffers): two
        float64 all-reduces of the whole state, counted as ``eval_bytes_sent`` (a check, not training)."""
        self.replica_max_abs_diff = max_abs_diff(model, ctx.world)
        state = sum(t.numel() for t in list(model.parameters()) + list(model.buffers()))
        self.sent_to_evaluate(2 * 8 * state, ctx.world)
        if self.replica_max_abs_diff > 0 and ctx.reports:
            logging.getLogger(__name__).warning(
                "the workers' models differ at the end (replica_max_abs_diff %.3g): something changed one "
                "worker's model only (weights loaded, or a parameter set, on one rank), and the model "
                "returned and saved is worker 0's",
                self.replica_max_abs_diff,
            )

    def final_model(self, ctx: "WorkerContext", model: nn.Module) -> nn.Module:
        """The model every replica returns (after any last synchronisation)."""
        return self.unwrap(model)

    def figures(self) -> "GroupFigures":
        return GroupFigures(
            bytes_sent=self.bytes_sent,
            eval_bytes_sent=self.eval_share * self.world,
            largest_transfer_bytes=self.largest,
            replica_max_abs_diff=self.replica_max_abs_diff,
        )


@dataclass
class GroupFigures(Figures):
    """A process group's: what the evaluations all-reduced (all workers'), and how far the
    returned model's replicas are apart (0.0: equal parameters and buffers)."""

    eval_bytes_sent: int | None = None
    largest_transfer_bytes: int | None = None  # the largest single collective, one worker's share
    replica_max_abs_diff: float | None = None
