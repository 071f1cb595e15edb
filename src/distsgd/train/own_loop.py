"""Your own training loop, run by any of distsgd's algorithms: the worker side of ``distsgd.spawn``.

``distsgd.spawn(main, model=..., algo=..., workers=...)`` starts the algorithm's workers as
``distsgd train`` does and calls ``main(run)`` in each; ``run`` is a :class:`Run`. The loop is the
user's (any batches: tuples, dicts, several inputs; any loss; their own evaluation); the algorithm
acts only through the calls below, on parameters, gradients and buffers:

- ``model, opt = run.setup(optimizer)``: the model (built from ``spawn``'s ``model=`` with the
  run's seed, on this worker's device, joined to the algorithm: averaged replicas, a DDP wrapper,
  ...) and an optimiser whose ``step()`` is the algorithm's step (the gradient sync, the update,
  the parameter sync: an all-reduce, an average every H steps, DiLoCo's outer step);
- ``run.loader(dataset, batch_size, epoch)``: this worker's shard of a map-style dataset (the
  partition ``distsgd train`` uses), batches on the worker's device; it ends early when the run
  must stop (``--max-samples`` reached, or the algorithm says so);
- ``run.backward(loss)``: backward under ``--precision``'s loss scaling;
- ``run.log(**figures)``: progress lines, metrics.jsonl, TensorBoard (from the reporting worker);
  ``test_accuracy=`` / ``test_loss=`` make an evaluation event;
- ``run.evaluation_model()``: the model the algorithm would return now (every worker calls it:
  it may communicate); ``run.final_model()``: the model it returns (the last synchronisation);
- ``run.checkpoint(**state)``: a checkpoint with the loop's own state; ``resume=`` restores it all
  in ``run.setup()`` and hands ``state`` back as ``run.resumed``.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import io
import itertools
import logging
import math
import os
import random
import re
import sys
import threading
import time
import types
import weakref
from collections.abc import Iterator, Mapping, MutableMapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, cast

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.autograd import Variable
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.utils.data import DataLoader, IterableDataset, TensorDataset

from distsgd.callbacks import states, stops
from distsgd.checkpoint import (
    Checkpointer,
    RngState,
    Stateful,
    count,
    evaluations,
    load_model_state,
    scatter,
    seconds,
)
from distsgd.config import RunConfig, checkpoint_record
from distsgd.data.partition import epoch_indices, mix_seed, shard_size
from distsgd.data.torchdata import STREAM_REPLICATED, StreamPart
from distsgd.errors import (
    NO_GROUP,
    TWICE,
    ConfigError,
    LoopError,
    loop_failure,
    one_line,
    stall_watch,
    waited_too_long,
)
from distsgd.metrics import TrainClock
from distsgd.models import build_model
from distsgd.schedule import Periodic
from distsgd.train import device, forwards, lockstep, membership, schedulers, sums
from distsgd.train.context import LoopEnd, Start, Step, WorkerContext, WorkerResult
from distsgd.train.evaluate import equal_states, eval_event, snapshot
from distsgd.train.forwards import Forwards
from distsgd.train.optim import build_optimizer, is_internal, schedule_lr, schedule_needs_epochs

if TYPE_CHECKING:
    from distsgd.algorithms.base import Algorithm

log = logging.getLogger(__name__)


@dataclass
class OwnData:
    """The training data of a run whose loop is the user's: distsgd never reads it (``main`` does,
    through ``run.loader``); ``n_train``, when the user says it, sizes an epoch for ``--schedule``."""

    name: str = "own loop"
    num_classes: int = 0
    n_train: int = 0
    n_test: int = 0
    input_shape: tuple[int, ...] = ()
    task: str = "own"

    def options(self, augment: bool = False, loader_workers: int = 0) -> "OwnData":
        if augment or loader_workers:
            raise ConfigError(
                "--augment and --loader-workers apply to distsgd's own loop: in your loop, give "
                "run.loader() your transforms and num_workers"
            )
        return self

    def batches(self, order: torch.Tensor, start: int, batch_size: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        raise ConfigError("distsgd reads no data of a run whose loop is the user's: main reads it")

    def test_batches(self, batch_size: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        raise ConfigError("distsgd reads no data of a run whose loop is the user's: main reads it")

    def to(self, device: torch.device) -> "OwnData":
        return self

    def share_memory_(self) -> "OwnData":
        return self

    def is_shared(self) -> bool:
        return False


class LoopState:
    """A worker's counters: what a checkpoint keeps of the loop (distsgd's or yours)."""

    def __init__(self, eval_every: int | None = None, checkpoint_every: int | None = None) -> None:
        self.epoch = 0
        self.start = 0  # where the next batch begins in this epoch's order (its passes' summed)
        self.starts: list[int] = []  # a user's loop: each pass of this epoch's, by the order they began
        self.local = 0  # this worker's samples
        self.steps = 0
        self.unstepped = 0  # of them, those no counted step took (a replacement's: its predecessor's)
        self.seq = 0  # checkpoints written
        self.train_wall_s = 0.0
        self.evals: list[dict[str, Any]] = []
        self.evals_at, self.checkpoints_at = Periodic(eval_every), Periodic(checkpoint_every)
        self.owed = False  # distsgd's loop: the evaluation at this step, which a signal cut short, is owed

    _COUNTERS = ("epoch", "start", "local", "steps", "unstepped", "seq", "train_wall_s", "evals")
    _WHOLE = ("epoch", "start", "local", "steps", "seq")  # of the counters, those that count (>= 0)

    def state_dict(self) -> dict[str, Any]:
        return {
            **{k: getattr(self, k) for k in self._COUNTERS},
            "starts": list(self.starts),
            "evals_at": self.evals_at.state_dict(),
            "checkpoints_at": self.checkpoints_at.state_dict(),
            "owed": self.owed,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for k in self._WHOLE:
            setattr(self, k, count(state, k))
        self.unstepped = count(state, "unstepped") if "unstepped" in state else 0  # (kept since 2026-11-29)
        starts = state.get("starts", [])  # (kept since 2026-11-30; before, one position: the first pass's)
        self.starts = [count({"start": v}, "start") for v in starts] if isinstance(starts, list) else []
        self.train_wall_s = seconds(state, "train_wall_s")
        self.evals = evaluations(state, "evals")
        self.evals_at.load_state_dict(state["evals_at"])
        self.checkpoints_at.load_state_dict(state["checkpoints_at"])
        self.owed = state.get("owed") is True  # (kept since 2026-12-01)


# run.all_reduce/all_gather's check that the workers' tensors agree: a tensor's dims, its dtype (an
# index in _DTYPES) and its first _ALIKE - 2 sizes
_ALIKE = 10
_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.int16,
           torch.int8, torch.uint8, torch.bool, torch.complex64, torch.complex128)  # fmt: skip

# steps between a user's loop's checks of what would go wrong silently (a lockstep group's lrs, the
# parameters' memory, what the algorithm overwrites): at steps 1, 17, 33, ..., a resumed loop's first, the end
CHECK_EVERY = 16


class Run:
    """One worker's handle on the run: what ``main(run)`` is given (see the module's docstring).
    distsgd's own loop (:mod:`distsgd.train.loop`) drives the same object, so each algorithm's
    step, setup and ending are defined here once for both."""

    _loaded_at = -1  # the evaluations there were when the loop last loaded weights into the model (-1: never)
    _steps_at_eval = -1  # this worker's steps at its last evaluation in this part of the run (-1: none)
    # the model run.final_model() returned, its tensors' in-place versions where its figures were
    # last its own: at run.final_model(), then at each evaluation after it (see _figures_stale)
    _returned_versions: list[tuple[int, int]] | None = None
    _asked = False  # whether the loop (or run.loader for it) ever asked run.should_stop()
    _past_steps = 0  # steps a user's loop took after the run's end (max_samples, a target reached)
    _pauses = 0  # run.paused() blocks open (any thread): the loop's stall watch waits for their end
    # an evaluation's pass over run.loader() read this worker's shard of a set, and no collective of the
    # loop's (run.all_reduce, dist.all_reduce, ...: _collectives_seen) nor step came since
    _share_read = False
    _warned_share = False
    _started = Start.FRESH  # how run.setup() started this worker (a fresh run, a resumed one, a replacement)
    _resumed_steps = -1  # a resumed run: the steps its checkpoint had taken
    # a resumed user's loop until its first step: each optimiser's settings as run.setup() restored them
    # (see _schedulers_resumed), with the step run.setup() gave it
    _restored: tuple[tuple[Any, list[dict[str, Any]]], ...] = ()
    # a resumed user's loop from its first pass to its first batch: the LR schedulers' steps a loop that
    # starts again at epoch 0 takes again (see schedulers.Replay); _replayed: over
    _replay: schedulers.Replay | None = None
    _replayed = False
    # the model's persistent buffers as an algorithm that keeps them took them (see _check_buffers):
    # the module holding each, its name there, the tensor and its memory (-1: the algorithm binds none)
    _buffers: tuple[tuple[str, nn.Module, str, torch.Tensor, int], ...] = ()
    # the model's parameters as the algorithm took them, by name (see _check_parameters)
    _params: tuple[tuple[str, nn.Parameter], ...] = ()
    # a resumed user's loop until its first step: its schedulers' loading as PyTorch's order leaves it
    _loads: schedulers.Loads | None = None
    _said_rest = False  # the warning of _unshuffled_rest
    _said_no_gradient = False  # the warning of _no_gradient
    # the tensors of run.resumed (a resumed run's load of its checkpoint's model back: see _same_state)
    _resumed_ids: frozenset[int] = frozenset()
    # samples of the resumed epoch each of its passes trained before the checkpoint (by the order they
    # began); passes begun in the state's epoch (this run's); each pass under way's place among them (by
    # its token); samples counted since the last step, by the pass's place
    _skips: tuple[int, ...] = ()
    _in_epoch = 0
    _begun_epoch = 0  # the epoch of the pass begun last (one begun beside it with no epoch= is its epoch's)
    _pass_of: dict[int, int]
    _pending: dict[int, int]
    _collectives = 0  # run.all_reduce() and run.all_gather() calls (their tensors checked at 1, 2, 17, 33, ...)
    _backwards_ever = 0  # backward passes through the model, the run's (a pass over run.loader took any?)
    # in a user's loop, the models that ran a forward from the last step's end, run.evaluation_model()
    # or run.final_model() to the loop's test figures (see forwards.Forwards)
    _forwards: Forwards | None = None
    _compiled = False  # the model given to run.setup() was torch.compile's (see _watch_forwards)
    _saved_at: tuple[int, dict[str, float]] | None = None  # main's last save of the model's weights (_saved)
    _train_wall_s: float | None = None  # the training clock at run.final_model()
    _nonfinite = (0, 0, 0)  # reports of a nan or inf loss: how many, the first's and last's samples
    _said_threads = False  # (see _threads_said)

    def __init__(self, ctx: WorkerContext, algo: "Algorithm", replacement: bool = False) -> None:
        self._ctx, self._algo, self.cfg = ctx, algo, ctx.cfg
        self._replacement = replacement  # in place of a worker that died (--restart-workers)
        self.rank, self.world, self.device = ctx.rank, ctx.world, ctx.device
        self._state = LoopState()  # the counters (distsgd's loop gives its own, with its periods)
        self._user = _UserState()  # a user's loop's own state, in its checkpoints
        self.resumed: dict[str, Any] | None = None  # that state, in a run resumed from a checkpoint
        self._checkpointer: Checkpointer | None = None
        self._pass_of, self._pending = {}, {}  # (see the class's annotations)
        self._first_epoch = 0  # epochs before this one were trained before a resume or a replacement
        self._rejoined: int | None = None  # a replacement: the samples its rank had trained
        # an epoch's samples as run.loader last saw it, as a training set's length (_epoch_len; None: a
        # stream or no loader yet): what an epoch is, for the progress lines and the summary's epochs
        self._data_len: int | None = None
        # the training passes under way (begun, not ended), by a token of each: their samples on this
        # worker and batch size (None: a stream). Passes read together (a labelled and an unlabelled
        # loader zipped) make one epoch, which ends with the one of fewest batches
        self._open: dict[int, tuple[int, int] | None] = {}
        self._passes = 0  # passes over run.loader()s given no epoch: the next one's epoch
        self._said_evaluation = False  # run.loader() read under torch.no_grad(): said once
        self._batch_samples = 0  # samples of the batches yielded since the last step
        self._drops = _Drops()  # gradients a zero_grad() may have dropped before any step
        self._model: nn.Module | None = None
        self._optimizer: torch.optim.Optimizer | None = None  # the first of _optimizers
        self._optimizers: list[torch.optim.Optimizer] = []  # what run.setup() returned, in its order
        self._real: list[_Real] = []  # each one's own update (its step() goes through the run)
        self._handles: list[Any] = []  # hooks removed when the run ends
        # this step so far: the optimisers that stepped, run.backward() calls, gradient syncs, and
        # whether the last backward was inside no_sync (its gradients not synchronised)
        self._current: Step | None = None
        self._stepped: set[int] = set()
        self._backwards = self._syncs = self._no_sync_depth = 0
        self._unsynced = self._in_backward = False  # (the latter: inside run.backward(), which synchronises itself)
        self._nested_done = False  # gradients of a reentrant backward pass, not yet synchronised
        self._nested_task: int | None = None  # the graph task of the last reentrant pass seen
        self._plain_task: int | None = None  # the autograd graph task of a plain loss.backward() seen last
        self._unscaled = False  # fp16: the gradients were unscaled this step (run.clip_gradients)
        self._grad_versions: list[int] | None = None  # fp16: the gradients as the last sync left them
        self._lr_set: list[float] | None = None  # the lrs --schedule set at the last step
        self._lr_sums: list[float] = []  # each group's lr sum and sum of squares since _check_lr_alike looked
        self._sums = sums.Sums()  # lockstep: the run's samples where the workers' batches differ
        self._evaluations = 0  # run.evaluation_model() calls (a barrier's key, where it is a collective)
        self._test_logs = 0  # run.log() calls with test figures (a barrier's key, with --stop-at-target)
        self._where: dict[str, Any] = {}  # more of how this worker computed, for summary.json (--cuda-graphs)
        self._returned: nn.Module | None = None
        # the parameters as the algorithm took them, until the first step (see _check_bound)
        self._bound: list[tuple[str, nn.Parameter, int]] | None = None  # (name, parameter, in-place version)
        self._storage: list[tuple[str, nn.Parameter, int]] = []  # where the algorithm binds them: their memory
        self._arrived = False  # at run.final_model(), in a lockstep group: its step count on the store
        self._stranded_why: str | None = None  # why this worker waits for ever for a peer (see lockstep.stranded)
        self.rewrote_at = -1  # the last step whose end rewrote the weights in place (model averaging's)
        self._made: tuple[int, float] | None = None  # steps and clock of run.evaluation_model()'s last model
        # test figures of a worker's own model, of another, or of the model beside a copy of it (said once)
        self._warned_own = self._warned_another = self._warned_both = False
        self._stopped = False  # --stop-at-target: a figure run.log was given reached the target
        self._end_seen = self._schedule_end_seen = False  # the run's end seen at a step (_past_the_end)
        self._clock = TrainClock(sync=device.synchronizer(ctx.device))  # waits for the GPU before a reading
        # distsgd's loop starts training itself (Run._begin) once --compile has warmed up: the start
        # barrier is what the asynchronous launchers' clocks start from, and the shared model's
        # buffers must not be put back while other workers train
        self._begin_later = False
        self._loss_sum, self._loss_n = torch.zeros((), device=ctx.device), 0
        self._before_main = (torch.initial_seed(), torch.get_default_dtype())  # (did main set them? _build)
        self._scaler = torch.amp.GradScaler(ctx.device.type) if self.cfg.precision == "fp16" else None
        device.autocast(ctx.device, self.cfg.precision)  # one line where this GPU lacks the precision
        warmup, clip = self.cfg.lr_warmup_steps, self.cfg.clip_grad_norm
        assert warmup is not None and clip is not None, "a settled configuration"
        self._warmup, self._clip = warmup, clip
        n = getattr(ctx.dataset, "n_train", 0) or 0
        # this worker's samples an epoch (0: unknown), of its shard: the group's first world's (a group that
        # trains through a loss keeps its shards; one built again after a loss before its first step too)
        self.per_epoch = shard_size(n, ctx.data_world, self.cfg.partition)
        self.global_per_epoch = self.per_epoch * ctx.data_world
        cfg = self.cfg
        self.total_epochs = (
            cfg.epochs
            if cfg.max_samples is None or not self.global_per_epoch
            else cfg.max_samples / self.global_per_epoch
        )
        torch.set_num_threads(device.threads_per_worker(self.cfg))

    # -- setting up ------------------------------------------------------------------------------
    def setup(self, *parts: Any, optimizer: Any = None) -> tuple[Any, ...]:
        """The model, joined to the algorithm, and its optimiser(s), as ``model, opt`` (or
        ``model, opt1, opt2, ...``). ``parts``, any of:

        - nothing: ``spawn``'s ``model=``, built with the run's seed on this worker's device, and the
          run's optimiser (``--optimizer``, ``--lr``, ...; DiLoCo's inner optimiser; ``spawn(optimizer=...)``);
        - functions ``optimizer(model) -> torch.optim.Optimizer``, one per optimiser;
        - a model you built (and maybe loaded), then the optimisers you built on its parameters
          (Fabric's ``setup``): it is moved to this worker's device and joined to the algorithm;
        - an ``--optimizer`` name (``"sgd"``, ``"adam"``, ``"adamw"``).

        Each returned optimiser is the one you built (or the one built for you): its ``step()`` is
        the algorithm's, and LR schedulers take it. With several, a step of the run is each of them
        stepping once (one stepping again starts the next)."""
        if self._model is not None:
            raise ConfigError("run.setup() was called twice: set up one model (and its optimisers) per run")
        given, compiled = _uncompiled(parts[0] if parts and isinstance(parts[0], nn.Module) else None)
        self._compiled = compiled is not None
        makers = [m for m in (*(parts[1:] if given is not None else parts), optimizer) if m is not None]
        objects = self._check_setup(given, makers)
        if len(makers) == 1 and isinstance(makers[0], str):
            self.cfg = self._algo.cfg = self.cfg.replace(optimizer=makers[0])
            makers = []
        ctx, cfg = self._ctx, self.cfg
        # a worker's files are named by its first rank (a group that lost a worker before its first
        # step builds again with the survivors' places in the new group: their shards stay their own)
        self._checkpointer = Checkpointer(cfg.out, cfg.resume, ctx.data_rank, ctx.data_world, ctx.job.resume_from)
        saved = self._checkpointer.load()
        # a lockstep group's checkpoint taken after it lost workers and trained through (--min-workers)
        # has no part of theirs: such a rank takes a peer's, as a replacement joining it would have
        peer = saved is None and bool(cfg.resume) and not self._replacement and self._algo.topology.lockstep
        if peer:
            saved = self._checkpointer.load_peers()
        # as in distsgd's loop: a replacement (or, resumed, a rank with no part in the checkpoint)
        # rejoins the running model and goes on from the samples its rank had trained
        start = (
            Start.REPLACEMENT
            if self._replacement or (cfg.resume and saved is None)
            else Start.RESUMED
            if saved is not None
            else Start.FRESH
        )
        model = self._build(saved["model"] if saved is not None else None, start, given, makers, objects)
        if saved is not None:  # (a peer's part: this rank keeps its own random state, and sent nothing yet)
            # distsgd's loop steps with the run's settings as given now (a resume's --lr, --momentum,
            # --weight-decay), the optimiser's state (momentum, moments) the checkpoint's; a user's
            # loop's optimisers are theirs, restored whole as torch's load_state_dict does
            settings = [_settings(opt) for opt in self._optimizers] if ctx.job.main is None else None
            scatter({k: v for k, v in self._pieces().items() if k != "model" and not (peer and k == "rng")}, saved)
            for opt, groups in zip(self._optimizers, settings or []):
                for group, now in zip(opt.param_groups, groups):
                    group.update(now)
            if peer:
                self._algo.restore_sent_counts({k: 0 for k in self._algo.sent_counts()})
        self._started = start
        if start is Start.RESUMED:
            self.resumed = self._user.value
            self._resumed_ids = frozenset(id(t) for t in _tensors_in(self.resumed))
            if ctx.job.main is not None:
                self._restored = tuple((r.opt.__dict__.get("step"), schedulers.settings_of(r.opt)) for r in self._real)
                self._loads = schedulers.Loads(r.opt for r in self._real)
            self._resumed_steps = self._state.steps
            self._skips, self._first_epoch = tuple(self._state.starts or [self._state.start]), self._state.epoch
            self._resumed_short(ctx, self._checkpointer.manifest)
        elif start is Start.REPLACEMENT:
            self._state.local = self._state.unstepped = self._rejoined = self._algo.starting_samples(ctx)
            if cfg.resume:  # (a checkpoint with no part of its, a coordinator's final one): number on above it
                manifest = self._checkpointer.manifest
                self._state.seq = max(self._state.seq, int(manifest["seq"]) if manifest is not None else 0)
        if self._ctx.job.main is not None:  # distsgd's loop calls run.backward and loads no weights itself
            self._own_loop_hooks()
            self._synced_norms_said(model)
        if not self._begin_later:
            self._begin(self._state.train_wall_s)
        return (_compiled_as(compiled, model), *self._optimizers)

    def _synced_norms_said(self, model: nn.Module) -> None:
        """One warning where the model holds ``nn.SyncBatchNorm`` (a DDP script's
        ``convert_sync_batchnorm``) and the workers form no process group (Hogwild!, the parameter
        server): torch's SyncBatchNorm then normalises each worker's batch alone, as BatchNorm does
        (an audit's, 2026-12-01: sync-ps ended with BatchNorm's weights to the bit, unsaid)."""
        synced = next((n for n, m in model.named_modules() if isinstance(m, nn.SyncBatchNorm)), None)
        alone = self.rank == 0 and self._ctx.reports and self.world > 1
        if synced is not None and not self._algo.topology.process_group and alone:
            log.warning(
                "%s is a SyncBatchNorm, and under %s the workers form no process group to synchronise its "
                "statistics over: it normalises each worker's batch alone, as BatchNorm does",
                synced or "the model",
                self.cfg.algo,
            )

    def _resumed_short(self, ctx: WorkerContext, manifest: dict[str, Any] | None) -> None:
        """Resumed from a lockstep group's checkpoint that lacks the parts of workers it had lost
        (``--min-workers``): every rank now trains on from the same counters, and the samples
        those workers did not train are told apart, so that the run's count (the manifest's at
        the checkpoint) goes on from where it was rather than from every rank's count x workers."""
        if manifest is None or manifest.get("coordinator") or not self._algo.topology.lockstep:
            return
        if len(manifest.get("ranks", range(manifest["world"]))) < manifest["world"]:
            ctx.departed_samples = int(manifest["samples"]) - self._state.local * ctx.world
        elif self._ctx.job.main is not None:  # (a loop whose workers' batches differed: see sums)
            self._sums.resumed(int(manifest["samples"]), self._algo.global_samples(ctx, self._state.local))

    def _check_setup(self, given: nn.Module | None, makers: list[Any]) -> list[torch.optim.Optimizer]:
        """What run.setup() was given, checked (one line for each mistake); the optimiser objects."""
        algo = self._algo
        for m in makers:
            if not (isinstance(m, (str, torch.optim.Optimizer)) or callable(m)):
                raise ConfigError(
                    f"run.setup() takes a model, then optimisers (or functions model -> optimiser), or "
                    f"an --optimizer name; got {type(m).__name__}"
                )
        if isinstance(given, nn.parallel.DistributedDataParallel):
            raise ConfigError(
                "run.setup() was given a DistributedDataParallel: give it the model inside (ddp_model.module); "
                "distsgd synchronises the workers as the algorithm says, and a DDP of yours would add its own"
            )
        objects = [m for m in makers if isinstance(m, torch.optim.Optimizer)]
        if any(isinstance(m, str) for m in makers):
            if len(makers) > 1:
                raise ConfigError("run.setup(): an --optimizer name comes alone, not with other optimisers")
            algo.check_optimizer_name(self._ctx, makers[0])
        if objects:
            if given is None:
                raise ConfigError("run.setup(opt): an optimiser you built needs its model first: run.setup(model, opt)")
            if len(objects) != len(makers):
                raise ConfigError("run.setup(model, ...): give optimisers you built, or functions, not both")
            own = {id(p) for p in given.parameters()}
            for i, opt in enumerate(objects):
                if any(id(p) not in own for g in opt.param_groups for p in g["params"]):
                    raise ConfigError(
                        f"run.setup(model, ...): optimiser {i + 1} ({type(opt).__name__}) steps parameters "
                        f"that are not the model's: build it on model.parameters()"
                    )
            _given_settings_kept(self._ctx.job.settings_given, self.cfg, objects[0])
        return objects

    def _own_loop_hooks(self) -> None:
        """What makes a user's habits take effect or fail in one line: weights loaded into the model
        after setup reach the algorithm (or are refused), and, where the server steps, an
        optimiser run.setup() did not return is refused when it steps."""
        module = self._algo.unwrap(self._need_setup("run.setup()"))
        run, target = weakref.ref(self), weakref.ref(module)

        same = [False]  # the state being loaded is the model's own (see _same_state)

        def loading(mod: nn.Module, state: Mapping[str, Any], prefix: str, *args: Any) -> None:
            me = run()
            if me is not None and mod is target() and not prefix:  # (run.resumed's, as every worker loads its own)
                tensors = [v for v in state.values() if isinstance(v, torch.Tensor)]
                mine = bool(tensors) and all(id(v) in me._resumed_ids for v in tensors)
                same[0] = mine and _same_state(mod, state)

        def loaded(mod: nn.Module, incompatible: Any) -> None:  # a function: a copy of the module keeps it
            me = run()
            if me is not None and mod is target():  # not a copy's (an average, theta)
                if not same[0]:
                    me._algo.weights_loaded(me._ctx, me._need_setup("model.load_state_dict()"))
                    me._loaded_at = len(me._state.evals)
                me._bind(mod)  # (weights every worker loads alike: the algorithm took them)
            same[0] = False

        self._bind(module)

        self._handles.append(module.register_load_state_dict_pre_hook(loading))
        self._handles.append(module.register_load_state_dict_post_hook(loaded))
        if self._algo.topology.process_group or self._ctx.job.main is not None:  # (a loop may form its own
            # group where the algorithm has none: its DDP's broadcast was refused as an in-place change)
            self._handles.append(self._need_setup("run.setup()").register_forward_pre_hook(_not_in_a_users_ddp))

        def accumulated(param: torch.Tensor) -> None:
            me = run()
            if me is not None:
                me._grad_accumulated(param)

        for param in module.parameters():
            if param.requires_grad:
                self._handles.append(param.register_post_accumulate_grad_hook(accumulated))
        if self._algo.topology.server:
            self._handles.append(register_optimizer_step_pre_hook(self._foreign_step))
        elif self.world > 1 or self._algo.kind == "shared memory":
            own = {id(p) for p in module.parameters()}
            checked: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

            def outside(opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
                me = run()
                if me is not None and not is_internal(opt):
                    if me._algo.local_model and not any(opt is mine for mine in me._optimizers):
                        me._foreign_on_local_models(opt, own)
                    me._outside_parameters(opt, own, checked)

            self._handles.append(register_optimizer_step_pre_hook(outside))
        self._optimizer_load_hooks()

    def _optimizer_load_hooks(self) -> None:
        """A state the loop loads into an optimiser run.setup() returned (``opt.load_state_dict``)
        is the algorithm's to take or refuse (the server's optimiser steps the model, not the
        worker's), and its tensors in shared memory (``spawn(args=...)`` sends them so; torch's
        loading keeps them) become this worker's own: every worker stepped the same buffers."""
        run = weakref.ref(self)

        def loading(opt: torch.optim.Optimizer, state: dict[str, Any]) -> dict[str, Any]:
            me = run()
            if me is not None:
                me._algo.optimizer_state_loaded(me._ctx)
            return _map_tensors(state, lambda t: t.clone() if t.is_shared() else t)

        for opt in self._optimizers:
            self._handles.append(opt.register_load_state_dict_pre_hook(loading))

    def _bind(self, module: nn.Module) -> None:
        """The parameters as the algorithm took them (each one's memory and in-place version), to
        find what the loop changed since (:meth:`_check_bound`, at the first step; where the algorithm
        binds their memory, :meth:`_check_untouched`, through the run). Not in one process that holds
        its model alone."""
        if self.world > 1 or self._algo.topology.server or self._algo.binds_storage:
            self._bound = [(name, p, p._version) for name, p in module.named_parameters()]
            self._params = self._params or _named_parameters(module)  # (a load keeps them: assign=True does not)
        if self._algo.keeps_buffers and (self.world > 1 or self._algo.topology.server or self._algo.binds_storage):
            binds = self._algo.kind == "shared memory"  # (its buffers' memory too; the server's bind the parameters')
            self._buffers = tuple(
                (f"{prefix}.{name}" if prefix else name, mod, name, b, b.data_ptr() if binds else -1)
                for prefix, mod in module.named_modules()
                for name, b in mod._buffers.items()
                if b is not None and name not in mod._non_persistent_buffers_set
            )
        if self._algo.binds_storage:
            self._storage = [(name, p, p.data_ptr()) for name, p in module.named_parameters()]

    def _check_bound(self) -> None:
        """At the first step: a parameter rewritten in place since run.setup() (``model.apply(init)``,
        DCGAN's habit: each worker's random state differs, so the replicas part, or the server's
        weights overwrite it) or, where the algorithm binds the parameters to its memory, replaced
        (``model.to(memory_format=torch.channels_last)``, ``.double()``: it trains apart from it).
        Neither said a word before. Weights loaded with ``model.load_state_dict()`` are the algorithm's."""
        bound, self._bound = self._bound, None
        algo, main = self._algo, threading.main_thread()
        # in a lockstep group, a change every replica made alike (SAM's perturbation and its undoing, a
        # momentum target moved in place before the forward) leaves them equal: no mistake, and allowed
        alike = algo.topology.lockstep and algo.topology.process_group and self._replicas_alike()
        for name, p, version in bound or []:  # (a replaced one: _check_untouched, before)
            # (Hogwild!'s threads, sharing one model, share its version counters too; its processes do not)
            changed = p._version != version and (algo.kind != "shared memory" or threading.current_thread() is main)
            if changed and not alike:
                raise ConfigError(
                    f"parameter {name} was changed in place after run.setup() (model.apply(init)? a weight "
                    f"perturbation, as SAM's first step, or a momentum target moved before the first step?): each worker's "
                    f"random state is its own, so under {algo.name} the workers would start from different weights "
                    f"(a server's, or each other's, would overwrite them); initialise the model in its constructor, "
                    f"or load one set of weights on every worker with model.load_state_dict(); move a momentum "
                    f"target after optimizer.step() (MoCo's code moves it in the forward, before the step)"
                )

    def _replicas_alike(self) -> bool:
        """Whether every worker's parameters are equal (their sum and sum of squares in float64, one
        small all-reduce), at the first step of a lockstep group."""
        module = self._algo.unwrap(self._need_setup("optimizer.step()"))
        with torch.no_grad():
            flat = [p.detach().double() for p in module.parameters()]
            sums = [float(sum(t.sum() for t in flat)), float(sum((t * t).sum() for t in flat))]
        low, high = self._algo.spread(self._ctx, sums)
        return low == high

    def _foreign_on_local_models(self, opt: torch.optim.Optimizer, own: set[int]) -> None:
        """An optimiser run.setup() did not return, stepping the model's parameters where the
        algorithm averages (or moves) the workers' own models inside the step of those it did:
        its step lands on one side of the averaging, each worker's alone (after it, the replicas
        part until the next; before it, the average is of weights it rewrote). Refused: it trained
        apart from local SGD over all the parameters (2.7e-4 in 6 steps, silently)."""
        if any(id(p) in own and p.grad is not None for g in opt.param_groups for p in g["params"]):
            raise ConfigError(
                f"under {self.cfg.algo} the workers' models are averaged (or moved) inside the step of the "
                f"optimisers run.setup() returned, and an optimiser it did not ({type(opt).__name__}) steps "
                f"the model's parameters: its step would land on one side of that, each worker's alone; "
                f"give it to run.setup(model, opt, {type(opt).__name__.lower()}) with the others"
            )

    def _outside_parameters(
        self, opt: torch.optim.Optimizer, own: set[int], checked: weakref.WeakKeyDictionary
    ) -> None:
        """An optimiser about to update parameters that are not the model's (a second optimiser's
        loss weights, a param group added after setup): the algorithm keeps only the model's alike
        on every worker, so each worker's copy of these would train apart (it did, silently)."""
        shape = tuple(len(g["params"]) for g in opt.param_groups)
        known = checked.get(opt)
        if known is None or known[0] != shape:  # (looked for again when a param group is added)
            known = (shape, [p for g in opt.param_groups for p in g["params"] if id(p) not in own])
            checked[opt] = known
        stepped = [p for p in known[1] if p.grad is not None]
        if stepped and not (_paused() and len(known[1]) == sum(len(g["params"]) for g in opt.param_groups)):
            raise ConfigError(
                f"an optimiser ({type(opt).__name__}) updates {len(stepped)} parameter(s) that are not the "
                f"model's (the first of shape {list(stepped[0].shape)}): under {self.cfg.algo} the workers "
                f"share the parameters of the model given to run.setup(), no others, so each worker's copy "
                f"of these would train apart; make them the model's (an nn.Parameter, or a module, inside it), "
                f"or, for an evaluation's own (a linear probe), step it inside `with run.paused():`"
            )

    def _threads_said(self) -> None:
        """At the first step: more threads than distsgd gave the worker (``torch.set_num_threads(8)``
        in main), said once, by rank 0: the workers' threads oversubscribe the cores and spin against
        each other (an audit's: 26% slower, 2 workers of 8 threads on 2 cores), silently."""
        self._said_threads = True
        n, given = torch.get_num_threads(), device.threads_per_worker(self.cfg)
        if n > given and self.rank == 0 and self._ctx.reports and self._ctx.device.type == "cpu":
            log.warning(
                "torch.set_num_threads(%d) in main: distsgd gave each of the %d worker(s) %d thread(s), its share "
                "of the cores; more oversubscribe them and the workers slow each other down: leave the threads "
                "to distsgd, or set threads_per_worker=",
                n,
                self.cfg.workers,
                given,
            )

    def _check_untouched(self, at_end: bool = False) -> None:
        """At the first step, every CHECK_EVERY and at the end: where the algorithm binds the
        parameters to its memory, none was replaced (``model.to(memory_format=...)`` after
        run.setup(); MoCo's and BYOL's momentum update of a target network, ``p.data = p.data * m
        + q.data * (1 - m)``: the target stayed where it started, silently); and what the algorithm
        would overwrite is as it left it (:meth:`Algorithm.check_untouched`)."""
        if self._ctx.job.main is None or (self.steps % CHECK_EVERY and not at_end):
            return
        self._check_parameters()
        self._check_buffers()
        algo = self._algo
        for name, p, ptr in self._storage:
            if p.data_ptr() == ptr:
                continue
            if self.steps == 0:
                raise ConfigError(
                    f"parameter {name} was replaced after run.setup() (model.to(memory_format=...), .double(), "
                    f".half()?): under {algo.name} the parameters are views of memory the algorithm holds, and a "
                    f"replaced one trains apart from it; convert the model before run.setup() (in its constructor)"
                )
            how = (
                "keep a network your loop updates itself (a momentum target) outside the model given to run.setup()"
                if algo.topology.server
                else "change it in place (p.mul_(m).add_(q, alpha=1 - m), under torch.no_grad())"
            )
            raise ConfigError(
                f"parameter {name} was replaced during the run (p.data = ..., as a momentum target's "
                f"update is often written?): under {algo.name} the parameters are views of memory the "
                f"algorithm holds, and the new tensor is apart from it; {how}"
            )
        algo.check_untouched(self._ctx)

    def _check_parameters(self) -> None:
        """The model's parameters are still the ones the algorithm took, under the same names: a
        parametrization registered during the run (``spectral_norm(model.l2)`` at epoch 2: ``l2.weight``
        becomes ``l2.parametrizations.weight.original``), a module replaced or a parameter assigned
        trained apart from what the algorithm holds, and the model returned under Hogwild! and the
        parameter server had the plain weight (0.30-0.35 from one process's outputs, exit 0, the
        audit of 2026-11-30); a process group's was refused only after the whole run."""
        if not self._params:
            return
        now = dict(_named_parameters(self._algo.unwrap(self._need_setup("optimizer.step()"))))
        if len(now) == len(self._params) and all(now.get(n) is p for n, p in self._params):
            return
        gone = next((n for n, p in self._params if n not in now), None)
        what = (
            f"parameter {gone} is no longer the model's"
            if gone is not None
            else "parameter " + next(n for n, p in self._params if now[n] is not p) + " was replaced"
            if any(now[n] is not p for n, p in self._params)
            else f"the model has {len(now) - len(self._params)} parameter(s) more"
        )
        raise parameters_changed(what, self._algo.name)

    def _check_buffers(self) -> None:
        """Where the algorithm keeps the model's buffers as it took them (hogwild's shared memory,
        the buffers a push carries, easgd's exchange), no persistent one was replaced by another
        tensor, or its memory by ``.data =`` where it binds it (DINO's ``self.center = self.center *
        m + c * (1 - m)``): the new one trained apart and the model returned held the old (the centre's
        zeros, 0.33 from one process's), silently. The other algorithms take the buffers afresh (DINO's
        habit works there); non-persistent buffers (a rotary embedding's cache) are the model's."""
        for name, mod, key, tensor, ptr in self._buffers:
            if mod._buffers.get(key) is not tensor or (ptr >= 0 and tensor.data_ptr() != ptr):
                attr = f"self.{key}"
                raise ConfigError(
                    f"buffer {name} was replaced during the run ({attr} = ..., {attr}.data = ..., or "
                    f"register_buffer() again): under {self._algo.name} the model's buffers are the ones "
                    f"run.setup() took (in memory the workers share, or sent with each step), and the new one "
                    f"is apart from them; update it in place ({attr}.mul_(m).add_(x, alpha=1 - m), or "
                    f"{attr}.copy_(new), under torch.no_grad())"
                )

    def _foreign_step(self, opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if _paused() and not self._steps_the_model(opt):  # (an evaluation's own: a linear probe's)
            return
        if not any(opt is mine for mine in self._optimizers):
            raise ConfigError(
                f"under {self.cfg.algo} the server holds the model and steps it with one optimiser: an "
                f"optimiser run.setup() did not return ({type(opt).__name__}) stepped, and its update "
                f"would be overwritten by the server's weights; put its parameters in a parameter group "
                f"of spawn(optimizer=...)'s optimiser (for an evaluation's own, a linear probe's, step it "
                f"inside `with run.paused():`)"
            )

    def _steps_the_model(self, opt: torch.optim.Optimizer) -> bool:
        own = {id(p) for p in self._need_setup("optimizer.step()").parameters()}
        return any(id(p) in own for g in opt.param_groups for p in g["params"])

    def _pieces(self) -> dict[str, Stateful]:
        """What a checkpoint holds of this worker: the model, the optimiser, the algorithm's state,
        the counters, the random state, --precision's scaler and (a user's loop) its own state."""
        pieces: dict[str, Stateful] = {
            "model": self._algo.unwrap(self._need_setup("run.checkpoint()")),
            "optimizer": self.optimizer,
            **{f"optimizer{i + 1}": opt for i, opt in enumerate(self._optimizers) if i},
            "algo": self._algo,
            "loop": self._state,
            "rng": RngState(),
        }
        if self._scaler is not None:
            pieces["scaler"] = self._scaler
        if self._ctx.job.main is not None:
            pieces["user"] = self._user
        return pieces

    def checkpoint(self, **state: Any) -> None:
        """Save this worker's part of a checkpoint in ``out``, with ``state`` (your loop's own:
        numbers, strings, tensors, lists and dicts of them: what loads with ``weights_only``),
        and, once every worker has, commit it. Every worker calls it at the same point. A run
        started with ``resume=out`` continues from the newest: ``run.setup()`` restores the
        model, the optimiser, the algorithm and the counters, and ``run.resumed`` is ``state``."""
        self._need_setup("run.checkpoint()")
        if not self.cfg.out:
            also = (
                f": resume={self.cfg.resume} only reads it; out={self.cfg.resume} saves there too"
                if self.cfg.resume
                else ""
            )
            raise ConfigError(f"run.checkpoint() needs out= (the run directory it saves into){also}")
        _loads_back(state)
        self._user.value = state
        if self._lockstep_store() is not None:  # (one alone, DDP's `if rank == 0: save`: it waited in a collective)
            self._all_here(
                f"checkpoint/{self._state.seq + 1}",
                "run.checkpoint()",
                "a checkpoint is every worker's part of it (the model, the optimiser, the counters, the random states)",
            )
        self._save_checkpoint(self._state.seq + 1)

    def _save_checkpoint(self, seq: int, samples: int | None = None) -> None:
        """This worker's pieces saved as checkpoint ``seq`` (``samples``: all workers' samples at
        it, if the caller knows them), committed once every worker has saved its own: what
        run.checkpoint() does, and distsgd's loop at its checkpoint points."""
        cfg, st, checkpointer = self.cfg, self._state, self._checkpointer
        assert checkpointer is not None  # setup made it, with the model
        with self.paused():
            st.seq = seq
            st.train_wall_s = self._clock.elapsed()
            checkpointer.save(seq, self._pieces())
            where = {"samples": self.global_samples() if samples is None else samples, "epoch": st.epoch}

            # a group that lost workers and trains through them (--min-workers) commits the parts
            # of the workers it has; a resume gives each of the others a peer's (Checkpointer.load_peers)
            member = membership.current()
            ranks = sorted(member.members) if member is not None and len(member.members) < member.first_world else None

            def commit() -> None:
                checkpointer.commit(seq, {**where, **checkpoint_record(cfg, self._ctx.dataset)}, ranks=ranks)
                # (the event's epoch the epochs trained, as a progress or eval event's; the manifest's
                # the epoch a resume goes on in: metrics.csv's one column held both until 2026-12-01)
                event = {"event": "checkpoint", "seq": seq, **where, "epoch": self.epoch()}
                self._ctx.sink.emit({**event, "train_wall_s": st.train_wall_s})

            self._algo.checkpoint_saved(self._ctx, seq, commit)

    def _build(
        self,
        saved: dict[str, torch.Tensor] | None = None,
        start: Start = Start.FRESH,
        given: nn.Module | None = None,
        makers: list[Callable] | None = None,
        objects: list[torch.optim.Optimizer] | None = None,
    ) -> nn.Module:
        """The model on this worker's device (``given``, or ``model=`` built with the run's seed, so
        the same weights in every replica; ``saved``: a checkpoint's), the algorithm's setup,
        --compile, the optimisers (``objects``, built by ``makers``, or the run's) and
        --precision's pieces: the training forward under autocast, the loss scaler."""
        ctx, cfg, algo = self._ctx, self.cfg, self._algo
        ds = ctx.dataset
        seed, dtype = self._before_main
        own = ctx.job.main is not None  # (a user's loop: distsgd's own sets neither)
        if own and given is None and torch.initial_seed() not in (seed, cfg.seed) and self.rank == 0 and ctx.reports:
            log.warning(
                "torch's seed was set in main before run.setup() (torch.manual_seed(%d)?), and chooses nothing of "
                "the run's: run.setup() builds the model with spawn(seed=)'s seed (%d) and seeds torch, numpy and "
                "random for each worker from it; pass seed=%d to spawn to choose the run's",
                torch.initial_seed(),
                cfg.seed,
                torch.initial_seed(),
            )
        if own and algo.topology.shared_model and torch.get_default_dtype() != dtype:
            _refuse_default_dtype(algo.name, algo.topology.server, dtype)
        if given is not None:
            _own_storage(given)
            model = given.to(ctx.device)
        else:
            model = build_model(ctx.model_spec, ds.input_shape, ds.num_classes, cfg.init, seed=cfg.seed)
            model = model.to(ctx.device)
        if not model.training:  # (a part frozen in eval mode, by the loop or the factory, stays so)
            model.train()
        if saved is not None:
            load_model_state(model, saved)
        shared = algo.topology.shared_model
        before = snapshot(model) if given is not None and start is Start.FRESH and shared else None
        self._model = algo.setup(ctx, model, start)
        if before is not None:
            if not equal_states(algo.unwrap(self._model).state_dict(), before):
                where = "the server's" if algo.topology.server else "the one shared"
                raise ConfigError(
                    f"under {cfg.algo} every worker trains {where} model, built from spawn(model=...) with "
                    f"the run's seed: the model given to run.setup() has other weights, which would be "
                    f"dropped; call run.setup() without a model, or load your weights in the factory"
                )
        autocast = None
        if cfg.precision != "fp32":
            where, dtype = ctx.device.type, device.DTYPES[cfg.precision]
            cache = not cfg.cuda_graphs  # a captured step must not keep autocast's casts of the weights
            autocast = functools.partial(torch.autocast, device_type=where, dtype=dtype, cache_enabled=cache)
        if cfg.compile:  # the module, its state and its wrappers stay; autocast round the compiled call
            around = functools.partial(_under_autocast, autocast) if autocast is not None else None
            device.compile_in_place(algo.unwrap(self._model), around)
        unwrapped = algo.unwrap(self._model)
        if objects:
            for opt in objects:
                _state_to(opt, ctx.device)
                for group in opt.param_groups:
                    group.setdefault("base_lr", group["lr"])
            self._optimizers = list(objects)
        elif makers:
            self._optimizers = [build_optimizer(cfg, unwrapped, m) for m in makers]
        else:
            self._optimizers = [algo.make_optimizer(ctx, self._model)]
        algo.optimizers_ready(ctx, self._optimizers)
        self._optimizer = self._optimizers[0]
        for i, opt in enumerate(self._optimizers):
            _route_step(opt, self, i)
        if autocast is not None and not cfg.compile:
            self._handles += _autocast_hooks(unwrapped, autocast)
        _seed_globals(mix_seed(cfg.seed, 7919, ctx.rank))
        return self._model

    def _begin(self, earlier_s: float = 0.0) -> None:
        """Training starts: every worker together (the algorithm's barrier), the clock from here
        (plus ``earlier_s`` of a resumed run)."""
        if not (self._replacement and membership.current() is not None):  # one that joined the others, past it
            self._algo.before_training(self._ctx)
        self._clock.restart()
        self._clock.add(earlier_s)

    @property
    def samples(self) -> int:
        """This worker's samples so far (stepped on)."""
        return self._state.local

    @property
    def steps(self) -> int:
        return self._state.steps

    @property
    def model(self) -> nn.Module:
        return self._need_setup("run.model")

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        self._need_setup("run.optimizer")
        assert self._optimizer is not None
        return self._optimizer

    # -- data ------------------------------------------------------------------------------------
    def loader(
        self,
        dataset: Any,
        batch_size: int | None = None,
        epoch: int | None = None,
        collate_fn: Callable | None = None,
        num_workers: int = 0,
        *,
        shuffle: bool = True,
        drop_last: bool = False,
        pin_memory: bool = False,
        **options: Any,
    ) -> "_Shard":
        """This worker's batches of ``dataset``, ``batch_size`` (default ``--batch-size``) at a
        time, collated by torch's DataLoader (tuples, dicts, ...) and moved to this worker's
        device; ends early once the run must stop; ``len()`` is its number of batches in an
        epoch. As a DataLoader, each pass over it (each ``for``) is the next epoch, reshuffled
        (``epoch=E`` names the epoch instead); it may be made before ``run.setup()``. A map-style
        dataset (``len`` and ``dataset[i]``) is split as ``distsgd train`` splits its data
        (``--partition``, reshuffled each epoch with ``--seed``; ``shuffle=False``: the same shard in
        the dataset's order); an ``IterableDataset`` (a stream) gives each worker every W-th item
        (and each of ``num_workers`` loader processes its share of those), so each worker reads the
        whole stream and keeps its part; the stream's last items that fill no row of W are left out,
        so that every worker takes as many steps. ``collate_fn``, ``num_workers``, ``drop_last``,
        ``pin_memory`` and any other DataLoader ``options`` are the DataLoader's. It is for the
        training data (it counts the samples each step takes); a pass begun under
        ``torch.no_grad()`` (an evaluation's) counts nothing and leaves the epochs alone, and reads
        this worker's shard (a warning says so): evaluate the whole set with a DataLoader of your
        own, or combine the workers' figures with :meth:`all_reduce`. In a resumed run (or a
        worker that replaced a dead one) it goes on where the run was: an epoch trained before is
        empty, the one it stopped in goes on from there."""
        if "sampler" in options or "batch_sampler" in options:
            raise ConfigError(
                "run.loader() chooses this worker's samples itself: leave out sampler and batch_sampler (for a "
                "sampler of your own, a WeightedRandomSampler, iterate a DataLoader of your own and call "
                "run.count(len(x)) before each step)"
            )
        if not isinstance(dataset, IterableDataset) and not hasattr(dataset, "__len__"):
            raise ConfigError(
                f"run.loader(): a {type(dataset).__name__} has no len() and is not a torch IterableDataset: "
                f"give a map-style dataset or an IterableDataset"
            )
        if epoch is not None and (not isinstance(epoch, int) or epoch < 0):
            raise ConfigError(f"run.loader(epoch=...) is an epoch number, 0 or more; got {epoch!r}")
        if isinstance(dataset, IterableDataset) and self.cfg.partition != "sharded":
            raise ConfigError(STREAM_REPLICATED)
        loader_options = {"collate_fn": collate_fn, "num_workers": num_workers, "pin_memory": pin_memory, **options}
        return _Shard(self, dataset, batch_size or self.cfg.batch_size, epoch, shuffle, drop_last, loader_options)

    def _rejoin(self, dataset: Any) -> None:
        """A replacement's first pass: its rank's samples so far, in its own shard, say where it is."""
        if self._rejoined is None:
            return
        st = self._state
        per_epoch = (
            0 if isinstance(dataset, IterableDataset) else shard_size(len(dataset), self.world, self.cfg.partition)
        )
        st.epoch, st.start = divmod(self._rejoined, per_epoch) if per_epoch else (0, self._rejoined)
        self._skips, self._first_epoch, self._rejoined = (st.start,), st.epoch, None
        st.starts = []

    def _epoch_order(self, shard: "_Shard", epoch: int, skip: int) -> torch.Tensor:
        """The indices of ``shard``'s dataset this worker takes in ``epoch``, the first ``skip`` left out."""
        n = len(shard.dataset)
        order = epoch_indices(n, epoch, self.rank, self.world, self.cfg.seed, self.cfg.partition, shard.shuffle)
        order = order[skip:]
        if shard.drop_last:
            order = order[: len(order) - len(order) % shard.size]
        return order

    def _upcoming_epoch(self, shard: "_Shard") -> tuple[int, int]:
        """The epoch a pass over ``shard`` would be now, and the samples of it already trained. A
        pass with no ``epoch=`` begun while another is under way (two loaders zipped) is that one's
        epoch: read together, they make one (each had an epoch of its own, and a resume inside it
        found the first trained before: the rest of it was lost)."""
        self._rejoin(shard.dataset)
        if shard.epoch is not None:
            epoch = shard.epoch
        else:
            epoch = self._begun_epoch if self._open else self._passes
        if epoch < self._first_epoch:
            return epoch, -1  # trained before the resume: empty
        if epoch != self._state.epoch:
            return epoch, 0
        place = self._in_epoch  # (its own position: zipped loaders' differ, one position skipped both by their sum)
        return epoch, self._skips[place] if place < len(self._skips) else 0

    def _pass(self, shard: "_Shard", token: object) -> Any:
        """A pass over ``shard``: its batches of the epoch it is (the state says so from here on);
        ``token`` names it among the passes under way until it ends (``_Shard.__iter__`` lets go)."""
        self._need_setup("iterating over run.loader()")
        epoch, skip = self._upcoming_epoch(shard)
        # (at a pass, the lr a loop logs at its first step is the one it steps with)
        if self._started is Start.RESUMED and not self._replayed and self._ctx.job.main is not None:
            self._schedulers_resumed(epoch)
        self._begun_epoch = epoch
        self._unshuffled_rest(shard)
        if shard.epoch is None and not self._open:  # (one begun beside another is its epoch's)
            if self._passes == 0 and self._started is Start.RESUMED and self._ctx.job.main is not None:
                self._check_resumed_pass(shard, skip)
            self._passes += 1
        self._open[id(token)] = (
            None if isinstance(shard.dataset, IterableDataset) else (self._pass_len(shard), shard.size)
        )
        self._data_len = self._epoch_len()
        if skip < 0:
            return [], None
        st = self._state
        if epoch != st.epoch:
            st.epoch, st.start, st.starts, self._in_epoch, self._skips = epoch, 0, [], 0, ()
        self._pass_of[id(token)] = place = self._in_epoch
        self._in_epoch += 1
        st.starts[len(st.starts) : place + 1] = [0] * (place + 1 - len(st.starts))
        st.starts[place] = skip
        return self._batches(shard, epoch, skip), self._sizes(shard, epoch, skip)

    def _pass_len(self, shard: "_Shard", skip: int = 0) -> int:
        """The samples of a pass over ``shard`` (a map-style dataset's) on this worker, ``skip`` in:
        its shard's, less what ``drop_last`` drops."""
        n = shard_size(len(shard.dataset), self.world, self.cfg.partition) - skip
        return n - n % shard.size if shard.drop_last else n

    def _epoch_len(self) -> int | None:
        """All workers' samples an epoch of the passes under way (None: one reads a stream), as
        ``shard_size`` reads a training set's length: their samples summed, without those
        ``drop_last`` drops (until 2026-12-01 in it: 1.88 epochs said for 2, an audit's). Passes
        zipped whose lengths differ are summed whole, right where the shorter is cycled
        (``zip(cycle(labelled), unlabelled)``), not where zip ends with it (0.848 epochs said for 2:
        ``spawn(train_size=)`` says what an epoch is)."""
        open_ = list(self._open.values())
        if not open_ or None in open_:
            return None
        per_worker = sum(n for n, _ in cast(list[tuple[int, int]], open_))
        return per_worker * self.world if self.cfg.partition == "sharded" else per_worker

    def _sizes(self, shard: "_Shard", epoch: int, skip: int) -> Iterator[int] | None:
        """The samples of each batch of a pass over a map-style dataset, by its indices (None: a
        stream's, counted from each batch). Counted from a batch, a collate that is not batch-first
        (a list of samples, torchvision's ``tuple(zip(*batch))``, pad_sequence's (T, B)) gave the
        first sample's length, or T: 140 samples and 2.8 epochs said for 100 and 2, and a budget
        stopped at 74 samples called 100 (an audit's)."""
        if isinstance(shard.dataset, IterableDataset):
            return None
        n = self._pass_len(shard, skip)
        return iter([min(shard.size, n - i) for i in range(0, n, shard.size)])

    def _schedulers_resumed(self, epoch: int = 0, first_step: bool = False) -> None:
        """A resumed user's loop at its first pass (and first step): its LR schedulers as PyTorch's
        order of loading would leave them (see :mod:`distsgd.train.schedulers`): those built since
        run.setup() and loaded unseen by ``schedulers.Loads`` take up the restored lr; the replay of the epochs trained before
        holds the steps the loaded ones had taken. Looks for them once (and at the first step again
        where one was built since)."""
        pending = [
            (opt, settings)
            for opt, (routed, settings) in zip(self._optimizers, self._restored)
            if schedulers.built_after(opt, routed)
        ]
        first_pass = self._replay is None and not self._replayed and not first_step
        if not pending and not first_pass:
            return
        found = schedulers.found_on(self._optimizers)
        for opt, settings in pending:
            schedulers.take_up(opt, settings, found)
        if pending:
            self._restored = ()
        if not first_pass:
            return
        fresh = [type(s).__name__ for s in found if schedulers.steps_taken(s) == 0]
        if fresh and self._resumed_steps > 0 and not schedulers.saves_a_scheduler(self.resumed):
            if self.rank == 0 and self._ctx.reports:
                log.warning(
                    "a resumed run: the LR scheduler %s starts its schedule again (last_epoch 0, the run %d "
                    "steps in): save its state, run.checkpoint(sched=scheduler.state_dict()), and load it "
                    "once built, scheduler.load_state_dict(run.resumed['sched'])",
                    fresh[0],
                    self._resumed_steps,
                )
        self._replay = schedulers.Replay(found, epoch)

    def _end_replay(self) -> None:
        if self._replay is not None:
            self._replay.end()
        self._replay, self._replayed = None, True

    def _end_loads(self) -> None:
        if self._loads is not None:
            self._loads.end()
        self._loads = None

    def _check_resumed_pass(self, shard: "_Shard", skip: int) -> None:
        """A resumed run's first pass over run.loader() with no ``epoch=``, from the end of its
        first epoch on: it is epoch 0, the epochs trained before empty (a loop that starts again at
        epoch 0, or a restarted group's), which a loop that starts where it saved (``for epoch in
        range(run.resumed["epoch"] + 1, E)``, PyTorch's habit) would take for its own: its first
        passes empty, it ended short (2 of 4 epochs, exit 0; an audit's). Said once, on worker 0:
        nothing tells the two loops apart, and the first is right."""
        stream = isinstance(shard.dataset, IterableDataset)
        past = self._first_epoch > 0 or (not stream and skip >= len(self._epoch_order(shard, 0, 0)))
        if past and self.rank == 0 and self._ctx.reports:
            log.warning(
                "a resumed run: run.loader()'s passes with no epoch= start again at epoch 0, the %d trained "
                "before empty; a loop that starts at the epoch after its checkpoint (range(run.resumed[...] + 1, "
                "E)) would skip as many: give each pass its epoch, run.loader(dataset, batch_size, epoch=epoch)",
                self._first_epoch if self._first_epoch > 0 else 1,
            )

    def _unshuffled_rest(self, shard: "_Shard") -> None:
        """``run.loader(shuffle=False)`` over N samples that W workers do not divide: each worker takes
        N // W, so the last N mod W of the dataset's order are never trained, every epoch (DDP's
        DistributedSampler pads instead; with shuffle a different few sit out each epoch). Said once."""
        n = None if isinstance(shard.dataset, IterableDataset) else len(shard.dataset)
        if shard.shuffle or n is None or self.cfg.partition != "sharded" or not n % self.world or self._said_rest:
            return
        self._said_rest = True
        if self.rank == 0 and self._ctx.reports:
            log.warning(
                "run.loader(shuffle=False) over %d samples and %d workers: each worker takes %d, so the last %d "
                "of the dataset's order are never trained, in any epoch; make its length a multiple of %d (pad "
                "it, as DDP's DistributedSampler does) to train them",
                n,
                self.world,
                n // self.world,
                n % self.world,
                self.world,
            )

    def _evaluation_pass(self, shard: "_Shard") -> Any:
        """A pass over ``shard`` begun under ``torch.no_grad()`` (an evaluation's): this worker's
        shard of the epoch it names (else the first), neither counted as trained nor moving the
        epochs and the position a checkpoint holds; the shards are equal, so that every worker reads
        as many batches (a collective a batch pairs). Said once: each worker reads its shard. Test
        figures logged after it with no collective of the loop's since are one worker's shard's
        (see :meth:`log`; until 2026-12-01 they were the run's final figures, an audit's: 0.80 said
        for a model scoring 0.619)."""
        if not self._said_evaluation and self.rank == 0 and self.world > 1:
            n = None if isinstance(shard.dataset, IterableDataset) else len(shard.dataset)
            log.warning(
                "run.loader() read under torch.no_grad() (an evaluation?): each worker reads its shard of "
                "it%s, and its batches count as no training; combine its figures over the workers with "
                "run.all_reduce(), or read the whole set with a DataLoader of your own",
                f" (equal shards: {n - n % self.world} of its {n} samples)" if n is not None and n % self.world else "",
            )
        self._said_evaluation = True
        self._share_read = self.world > 1 and (
            isinstance(shard.dataset, IterableDataset) or self.cfg.partition == "sharded"
        )
        return self._batches(shard, shard.epoch or 0, 0)

    def _batches(self, shard: "_Shard", epoch: int, skip: int) -> Any:
        """A loader over this worker's part of ``shard``'s dataset in ``epoch``, ``skip`` samples in."""
        dataset, size, options = shard.dataset, shard.size, shard.options
        if isinstance(dataset, IterableDataset):
            part = StreamPart(dataset, self.rank, self.world, skip)
            return DataLoader(part, batch_size=size, drop_last=shard.drop_last, **options)
        order = self._epoch_order(shard, epoch, skip)
        plain = options["collate_fn"] is None and not options["num_workers"] and len(options) == 3
        if isinstance(dataset, TensorDataset) and plain:
            # tensors in memory: index them a batch at a time, as distsgd's loop does (a DataLoader
            # fetches and stacks sample by sample); pinned once, so each batch's copy to the GPU may overlap
            tensors = tuple(t.pin_memory() for t in dataset.tensors) if options["pin_memory"] else dataset.tensors
            return _TensorBatches(tensors, order, size)
        batches = [order[i : i + size].tolist() for i in range(0, len(order), size)]
        return DataLoader(dataset, batch_sampler=batches, **options)

    def _batches_in(self, shard: "_Shard") -> int:
        """``len(shard)``: this worker's batches in an epoch, as a DataLoader's ``len``, in a resumed
        run too (where the pass over the epoch it stopped in takes the rest of them): it was that rest,
        or 0, and a schedule sized ``len(loader) * epochs`` (transformers' linear warm-up) gave an lr
        of 0 from there, exit 0 (an audit's)."""
        if isinstance(shard.dataset, IterableDataset):
            raise TypeError("a stream's batches are not known before it is read: len() of run.loader(IterableDataset)")
        return -(-len(self._epoch_order(shard, shard.epoch or 0, 0)) // shard.size)

    def to_device(self, batch: Any) -> Any:
        """``batch`` (a tensor, or tuples, lists and dicts of them) on this worker's device: for
        batches of your own (your evaluation's); ``run.loader``'s are moved already."""
        return _to(batch, self.device)

    def print(self, *args: Any, **kwargs: Any) -> None:
        """``print`` on worker 0 only (one line a run, not one per worker)."""
        if self.rank == 0:
            print(*args, **{"flush": True, **kwargs})

    def barrier(self) -> None:
        """Wait until every worker got here (a process group's barrier; the parameter server's)."""
        self._need_setup("run.barrier()")
        self._group_only("run.barrier()")
        self._algo.barrier(self._ctx)

    def all_reduce(self, value: Any, op: str = "mean") -> torch.Tensor:
        """``value`` (a number or a tensor) combined over every worker: ``mean``, ``sum``, ``max``
        or ``min``; every worker calls it at the same point (a collective), with a Python number (a
        float64, int or float alike) or a tensor of one shape and dtype on every worker (else one line
        naming each worker's, checked at the first two calls and every 16th). For figures: your
        evaluation's accuracy over every worker's share of the test set, say."""
        ops = {"sum": dist.ReduceOp.SUM, "mean": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}
        if op not in ops:
            raise ConfigError(f"run.all_reduce(op=...) is one of {', '.join(ops)}, got {op!r}")
        t = _number(value, self.device).clone()
        self._share_read = False  # (figures combined over the workers)
        if self.world > 1:
            self._group_only("run.all_reduce()")
            self._alike(t, "run.all_reduce()")
            work = t.double() if op in ("sum", "mean") and t.is_floating_point() else t
            dist.all_reduce(work, op=ops[op])
            t = work.to(t.dtype)
        return t / self.world if op == "mean" else t

    def all_gather(self, value: Any) -> torch.Tensor:
        """``value`` (a Python number, as a float64; or a tensor of one shape and dtype on every
        worker) from every worker, stacked in rank order (a collective, as :meth:`all_reduce`)."""
        t = _number(value, self.device)
        self._share_read = False  # (figures combined over the workers)
        if self.world == 1:
            self._no_gradient(value, "run.all_gather()", "all_gather")
            return t.unsqueeze(0)
        self._group_only("run.all_gather()")
        self._alike(t, "run.all_gather()")
        out = [torch.empty_like(t) for _ in range(self.world)]
        dist.all_gather(out, t.contiguous())
        self._no_gradient(value, "run.all_gather()", "all_gather")
        return torch.stack(out)

    def _no_gradient(self, value: Any, what: str, torchs: str) -> None:
        """``value`` (a tensor of one or more dimensions: embeddings, not a loss averaged for an LR
        plateau or a log) requires grad, and ``what``'s result is values with none (as
        torch.distributed's own all_gather): said once, since a loss through it trains nothing
        through that path (an audit's SimCLR over its gathered embeddings trained its temperature
        alone, the encoder not at all, unsaid). Not refused: the gathered values as constants (a
        loss's other workers' negatives beside the local ones) and figures (``.numpy()``) are habits."""
        if self._said_no_gradient or not (isinstance(value, torch.Tensor) and value.requires_grad and value.dim()):
            return
        if not torch.is_grad_enabled():
            return
        self._said_no_gradient = True
        if self.rank == 0 and self._ctx.reports:
            log.warning(
                "%s of a tensor that requires grad: its result carries no gradient back (the workers' values, as "
                "torch.distributed.%s's), so a loss through it trains nothing through that path; for a loss use "
                "torch.distributed.nn.functional.%s, which does, and pass value.detach() for figures or constants",
                what,
                torchs,
                torchs,
            )

    def _alike(self, t: torch.Tensor, what: str) -> None:
        """Every worker's ``t`` has one shape and dtype, or ``what`` fails in one line naming each
        worker's: one small all-reduce first (the maximum of each figure and of its negation: they
        agree where the two match), a gather of them only where they do not. A collective's tensors
        must agree: sizes that differ aborted the process (gloo: SIGABRT, a worker "killed"), and
        dtypes of one size (an int 0 where a worker had nothing to add, a float elsewhere) reduced
        the one's bits as the other's, silently (a mean of 2.3e18 for 1.25 on 3623a92)."""
        self._collectives += 1
        if self._collectives > 2 and self._collectives % CHECK_EVERY != 1:  # (as many calls on every worker)
            return
        shape = t.shape[: _ALIKE - 2]
        code = _DTYPES.index(t.dtype) if t.dtype in _DTYPES else 100 + sum(map(ord, str(t.dtype)))
        mine = torch.full((_ALIKE,), -1, dtype=torch.int64)
        mine[0], mine[1] = t.dim(), code
        mine[2 : 2 + len(shape)] = torch.tensor(shape, dtype=torch.int64)
        both = torch.cat([mine, -mine]).to(self.device)
        dist.all_reduce(both, op=dist.ReduceOp.MAX)
        if torch.equal(both.cpu(), torch.cat([mine, -mine])):  # (every worker sees a difference, or none)
            return
        seen = [torch.empty_like(mine, device=self.device) for _ in range(self.world)]
        dist.all_gather(seen, mine.to(self.device))
        every = [s.tolist() for s in seen]

        def said(d: list[int]) -> str:
            kind = str(_DTYPES[d[1]]).removeprefix("torch.") if d[1] < len(_DTYPES) else "another dtype"
            return f"{tuple(d[2 : 2 + min(d[0], _ALIKE - 2)])} {kind}"

        raise ConfigError(
            f"{what}: the workers gave tensors of different shapes or dtypes ("
            + ", ".join(f"worker {r}: {said(d)}" for r, d in enumerate(every))
            + "): every worker gives one shape and dtype (a float 0.0, not an int 0, where it has nothing to "
            "add; tensors of one length: pad them, or gather their lengths first)"
        )

    def _group_only(self, what: str) -> None:
        """``what`` needs the workers in one process group (or one worker)."""
        if self.world > 1 and (not self._algo.topology.process_group or not dist.is_initialized()):
            raise ConfigError(
                f"{what} needs a process group, and under {self.cfg.algo} the workers have none (they "
                f"share a model or a server): report each worker's figures with run.log(), or evaluate "
                f"the model the run returns with spawn(evaluate=...)"
            )

    def count(self, samples: int) -> None:
        """Count ``samples`` for the next step (``run.loader`` does it for its batches; call it for
        batches from a loader of your own)."""
        self._drop_untaken()
        self._batch_samples += samples
        if self._replay is not None:  # (a resumed loop's first batch: the epochs it replays are behind it)
            self._end_replay()

    def _count_in(self, token: object, samples: int) -> None:
        """A batch of run.loader's pass ``token``: counted, and its pass's position moves at the step."""
        self.count(samples)
        place = self._pass_of.get(id(token))
        if place is not None:
            self._pending[place] = self._pending.get(place, 0) + samples

    def _untaken(self, token: object, last: int) -> None:
        """A pass of run.loader ends (``last``: the samples of its last batch), its last batch
        counted after the last backward with no step since: read, and trained only if a backward
        comes before another batch is counted (``next(iter(run.loader(...)))``, whose pass ends at
        once, trains on its batch after); a batch counted first says it was dropped (zip(unlabelled,
        labelled) pulls a batch from the first and drops it when the second ends; a loop's break
        before training on the batch it took), and it is not counted (:meth:`count`; an audit's:
        220 samples said for 212)."""
        if last and not self._stepped and self._batch_samples - self._drops.backward >= last:
            self._drops.untaken = (last, self._pass_of.get(id(token)))

    def _drop_untaken(self) -> None:
        """A batch counted or a step begun with a pass's last batch untrained since (_untaken): it is
        not counted."""
        if self._drops.untaken is not None:
            last, place = self._drops.untaken
            self._drops.untaken = None
            self._batch_samples -= last
            if place is not None and self._pending.get(place, 0) >= last:
                self._pending[place] -= last

    def global_samples(self) -> int:
        """All workers' samples so far, as this worker knows them."""
        self._sums.read(self._algo, self._ctx)
        return self._algo.global_samples(self._ctx, self.samples) + self._sums.offset

    def should_stop(self) -> bool:
        """True once the run must end: ``--max-samples`` reached (all workers'), a figure given to
        ``run.log`` reached ``--stop-at-target``'s target, or the algorithm says so (a Hogwild!
        stop, a parameter server gone)."""
        self._asked = True  # (a loop that asks, even seldom, ends at its next asking)
        return self._ended() or not self._algo.keep_going(self._ctx)

    def _ended(self) -> bool:
        """--max-samples reached (all workers', as this worker knows them), or --stop-at-target's."""
        cfg = self.cfg
        return self._stopped or cfg.max_samples is not None and self.global_samples() >= cfg.max_samples

    def _past_the_end(self, position: tuple[float, float] | None) -> None:
        """A user's loop stepping on after the run's end, refused at its second step past it (the
        first: an asynchronous worker learns of the others' samples at its next exchange): the end
        of --max-samples or --stop-at-target where the loop never asks run.should_stop() (a
        DataLoader of the loop's own, which does not stop there: 12 times max_samples trained, exit
        0; a loop that asks, if only each epoch, ends at its next asking), and the end of --schedule
        cosine, whose lr is 0 from there (spawn's epochs=1, the default, under a loop of 3 epochs:
        two thirds of the run at lr 0, exit 0). ``position``: the schedule's, this step's."""
        cfg = self.cfg
        if self._ended():
            self._past_steps += 1
        if not self._asked and self._ended():
            if self._end_seen:
                end = f"max_samples={cfg.max_samples}" if not self._stopped else "--stop-at-target's target"
                raise ConfigError(
                    f"the run reached its end ({end}) and the loop, which never asks run.should_stop(), trained on: "
                    f"end it when run.should_stop() is True (run.loader's batches stop there; a DataLoader of your "
                    f"own does not)"
                )
            self._end_seen = True
        if cfg.schedule == "cosine" and position is not None:
            progress, total = position
            if progress >= total:
                if self._schedule_end_seen:
                    raise ConfigError(
                        f"--schedule cosine annealed the lr to 0 at the run's end, {total:g} epoch{'s' * (total != 1)} "
                        f"(spawn(epochs=...), or max_samples=), and the loop trained on: give spawn() the epochs "
                        f"your loop trains (or max_samples=), and train_size= where an epoch is not one pass over "
                        f"run.loader's dataset"
                    )
                self._schedule_end_seen = True

    # -- a step ----------------------------------------------------------------------------------
    def backward(self, loss: torch.Tensor, weight: float = 1.0) -> None:
        """``(loss * weight).backward()``, scaled under ``--precision fp16``, then the algorithm's
        gradient synchronisation (the all-reduce of allreduce, ddp and local-sgd's first steps): when
        it returns, the gradients are the ones the step will apply, so clipping or inspecting them
        between ``run.backward`` and ``opt.step()`` acts on those. Several backward passes before a
        step accumulate; wrapping all but the last in ``run.no_sync()`` only saves their
        synchronisations. ``loss`` (unweighted) counts in the progress lines' mean loss."""
        self._need_setup("run.backward()")
        weighted = loss * weight if weight != 1.0 else loss
        self._in_backward = True
        try:
            (self._scaler.scale(weighted) if self._scaler is not None else weighted).backward()
        finally:
            self._in_backward = False
        self._loss_sum += loss.detach().float()
        self._loss_n += 1
        self._backward_done()

    def _backward_done(self) -> None:
        """A backward pass through the model ended (run.backward's, or a plain loss.backward()):
        the algorithm's gradient synchronisation, unless inside run.no_sync()."""
        model = self._need_setup("run.backward()")
        self._nested_done = False
        if self._drops.at is not None:
            self._dropped_said()
        self._drops.backward, self._drops.untaken = self._batch_samples, None
        self._backwards += 1
        self._backwards_ever += 1
        if self._no_sync_depth:
            self._unsynced = True
            return
        self._algo.after_backward(self._ctx, model, self._upcoming())
        self._syncs += 1
        self._unsynced = False
        if self._scaler is not None:
            self._grad_versions = _grad_versions(self._optimizers)

    def _zeroed(self) -> None:
        """An optimiser run.setup() returned zeroes its gradients: after a backward and before any
        step, that backward's are gone, unless it is the step's own (an adversarial step's: backward,
        zero_grad(), a second backward on the same batch, step). Which of the two the next backward
        tells: a batch counted since the last one makes it a drop (_dropped_said). Whether the
        gradients dropped were finite is kept unread (no wait on a GPU): a GradScaler of the loop's
        skips a step on an inf, a drop of its own."""
        if self._backwards and not self._stepped and self._ctx.job.main is not None:
            if self._drops.said or self.rank != 0:  # (said once, by worker 0: nothing more to look at)
                return
            self._drops.at = self._drops.backward
            grads = [p.grad for opt in self._optimizers for g in opt.param_groups for p in g["params"]]
            dense = [t for t in grads if t is not None and t.layout == torch.strided]
            try:  # (the largest magnitude: an fp16 gradient's 2-norm may overflow where each value is finite)
                finite = torch.stack(torch._foreach_norm(dense, math.inf)).isfinite().all() if dense else None
                self._drops.finite = finite
            except RuntimeError:  # (gradients on several devices)
                self._drops.finite = None

    def _dropped_said(self) -> None:
        """A backward after a zero_grad() that followed another backward: with a batch counted between
        the two, the earlier one's gradients (its micro-batches') were dropped, and no step trained on
        them; the step counts them as read (its samples, its epochs and schedule's position). Said
        once, by worker 0: an accumulation over a number of batches an epoch its micro-batches do not
        divide drops each epoch's last ones (an audit's: 7,968 samples said for 7,936 stepped).
        Gradients with an inf or nan are not said: a GradScaler's skipped step, a loop's skip."""
        lost, finite, self._drops.at, self._drops.finite = self._drops.at, self._drops.finite, None, None
        if not lost or self._batch_samples <= self._drops.backward or self._drops.said or self.rank != 0:
            return
        if finite is not None and not bool(finite):
            return
        self._drops.said = True
        log.warning(
            "optimizer.zero_grad() after a backward and before any step dropped the gradients of %d "
            "samples, and no step trained on them (the run's samples and epochs count them as read): an "
            "accumulation whose micro-batches do not divide an epoch's batches? step at the epoch's end "
            "to train on them",
            lost,
        )

    def _grad_accumulated(self, param: torch.Tensor) -> None:
        """A gradient of the model was accumulated by a plain ``loss.backward()`` (not
        run.backward): once per backward pass, the synchronisation is queued for its end, as DDP
        queues its own, so that the gradients are the step's when ``backward()`` returns."""
        if self._in_backward:
            return
        task = torch._C._current_graph_task_id()
        if task == self._plain_task or task == self._nested_task:
            return
        if _in_a_functions_backward():  # a reentrant pass (checkpointing's) inside the loop's: the outer
            self._nested_done = True  # one's end synchronises (or, where none of its own is queued, the step)
            self._nested_task = task
            return
        self._plain_task = task
        if self._scaler is not None:
            raise ConfigError(
                "under --precision fp16 the loss must be scaled before backward: call run.backward(loss), "
                "not loss.backward()"
            )
        Variable._execution_engine.queue_callback(self._backward_done)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Around the backward passes of all but the last micro-batch of an accumulated step: the
        algorithm does not synchronise their gradients (DDP's no_sync), the last backward
        synchronises the sum. A speed-up only: without it every backward synchronises, with the
        same result."""
        model = self._need_setup("run.no_sync()")
        with self._algo.no_sync(self._ctx, model):
            self._no_sync_depth += 1
            try:
                yield
            finally:
                self._no_sync_depth -= 1

    def clip_gradients(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """``clip_grad_norm_`` of the model's gradients, unscaled first under ``--precision fp16``
        (whose gradients stay loss-scaled until the step: ``clip_grad_norm_`` of your own there is
        refused, as it would clip scaled values). Returns the total norm before clipping."""
        model = self._need_setup("run.clip_gradients()")
        self._unscale()
        return torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm, norm_type)

    def step(self) -> None:
        """Every optimiser run.setup() returned steps once: the algorithm's whole step (what
        ``opt.step()`` does with one optimiser)."""
        self._need_setup("run.step()")
        for opt in self._optimizers:
            opt.step()

    def _upcoming(self) -> Step:
        return Step(number=self.steps + 1, samples=self.samples + self._batch_samples)

    def _optimizer_step(self, index: int) -> None:
        """Optimiser ``index``'s ``step()``: the algorithm's update with it; the run's step ends
        when every optimiser has stepped (or this one steps a second time: the step it was in ends
        first)."""
        if index in self._stepped:
            self._end_step()
        if not self._stepped:
            self._begin_step()
        self._stepped.add(index)
        assert self._current is not None  # _begin_step set it
        stepper = cast(torch.optim.Optimizer, _Stepper(self._real[index], self._scaler))  # step() and its attributes
        self._algo.apply_step(self._ctx, stepper, self._current)
        if len(self._stepped) == len(self._optimizers):
            self._end_step()

    def _begin_step(self) -> None:
        """The first optimiser steps: what the step needs before any update (its checks, the
        schedule, fp16's unscaling, --clip-grad-norm)."""
        cfg = self.cfg
        model = self._need_setup("optimizer.step()")
        if self._nested_done:  # the backward's parameters were all inside its reentrant pass
            self._backward_done()
        self._drop_untaken()
        self._check_untouched()
        if not self._said_threads:
            self._threads_said()
        if self._bound is not None:
            self._check_bound()
        if self._batch_samples == 0:
            raise ConfigError(
                "optimizer.step() with no batch from run.loader() since the last step: take batches "
                "from run.loader() (or run.count(len(batch))) so that the run counts its samples"
            )
        if self._backwards == 0:
            raise ConfigError(
                "optimizer.step() with no backward pass through the model since the last step: call "
                "run.backward(loss) (or loss.backward()) before it"
            )
        if self._unsynced:
            raise ConfigError(
                "the step's last run.backward() was inside run.no_sync(), so its gradients were never "
                "synchronised: leave the last micro-batch's backward outside run.no_sync()"
            )
        if self._syncs > 1:
            self._algo.check_resynced(self._ctx)
        if self._restored:
            self._schedulers_resumed(first_step=True)
            self._restored = ()
        self._end_loads()
        if not self._replayed and self._ctx.job.main is not None:
            self._end_replay()
        position = self._schedule_position() if cfg.schedule != "constant" or self.steps < self._warmup else None
        if self._ctx.job.main is not None:
            self._past_the_end(position)
            self._end_forwards()
        if position is not None:
            groups = [g for opt in self._optimizers for g in opt.param_groups]
            # (the groups stepped before: one added since, an unfrozen layer's, takes its lr as its base)
            if self._lr_set is not None and [g["lr"] for g in groups][: len(self._lr_set)] != self._lr_set:
                raise ConfigError(
                    f"the learning rate changed between steps while --schedule {cfg.schedule} "
                    f"(or --lr-warmup-steps) sets it: use your LR scheduler or the run's schedule, not both"
                )
            # the run's progress (all workers'; by --epochs in lockstep, each worker's, the same); the
            # warm-up by this worker's own steps
            progress, total = position
            for opt in self._optimizers:
                schedule_lr(opt, cfg, progress, total, self.steps + 1)
            self._lr_set = [g["lr"] for g in groups]
        self._check_lr_alike()
        self._current = self._upcoming()
        if self._scaler is not None:
            if not self._unscaled and self._grad_versions != _grad_versions(self._optimizers):
                raise ConfigError(
                    "under --precision fp16 the gradients stay loss-scaled until the step, and they "
                    "changed after run.backward(): clip them with run.clip_gradients(max_norm), which "
                    "unscales them first"
                )
            self._unscale()  # once the gradients are synchronised: every worker finds the same overflow
        if self._clip and not self._algo.clips_combined:  # the synchronised gradient (every replica clips alike)
            torch.nn.utils.clip_grad_norm_(model.parameters(), self._clip)

    def _check_lr_alike(self, at_end: bool = False) -> None:
        """A user's loop in a lockstep group, at its first step, every CHECK_EVERY, a resumed loop's
        first and its end: the workers step with the same learning rates (a scheduler stepped on each worker's own loss,
        ``ReduceLROnPlateau(opt).step(loss)``, gave each its own, and the replicas parted, silently
        but for a warning at the end that blamed another cause). A collective of two numbers a
        parameter group, and of the workers' sample counts (:mod:`distsgd.train.sums`)."""
        algo, ctx = self._algo, self._ctx
        if self.world == 1 or ctx.job.main is None or not algo.topology.lockstep:
            return
        if not algo.topology.process_group:
            return
        lrs = [float(g["lr"]) for opt in self._optimizers for g in opt.param_groups]
        n = len(lrs)
        if len(self._lr_sums) != 2 * n:  # (the first step, or a parameter group added: every worker's alike)
            self._lr_sums = [0.0] * (2 * n)
        for i, lr in enumerate(lrs):
            self._lr_sums[i] += lr
            self._lr_sums[n + i] += lr * lr
        # this worker's samples once this step is taken (at the end: those stepped, not a batch counted
        # and left unstepped, a loop's last before its break)
        local = self._state.local + (0 if at_end else self._batch_samples)
        if self.steps % CHECK_EVERY and self.steps != self._resumed_steps and not at_end:  # (resumed: a look)
            self._sums.step(algo, ctx, local, parted=False)
            return
        sums, self._lr_sums = self._lr_sums, [0.0] * (2 * n)
        # the counts; at a resumed loop's first look, each worker's offset from its checkpoint too (the
        # counts may meet again there: a checkpoint's that parted are summed all the same)
        back = [float(self._sums.offset)] if self.steps == self._resumed_steps else []
        m = len(lrs) + len(sums)
        low, high = algo.spread(ctx, lrs + sums + [float(local)] + back)
        apart = low[m] != high[m] or any(low[m + 1 :]) or any(high[m + 1 :])
        self._sums.step(algo, ctx, local, parted=apart)
        low, high = low[:m], high[:m]
        if at_end:
            self._sums.read(algo, ctx)
        parted = [i for i, (lo, hi) in enumerate(zip(low, high)) if hi - lo > 1e-6 * abs(hi)]
        if parted:
            i = parted[0]
            when = f"{'at the end' if at_end else f'at step {self.steps + 1}'} the workers' learning rates differ"
            detail = f"from {low[i]:.3g} to {high[i]:.3g}"
            if i >= n:  # alike now, but not at every step since the last look
                i -= n
                window = (
                    "in the last steps"
                    if at_end
                    else f"between steps {max(1, self.steps + 1 - CHECK_EVERY)} and {self.steps + 1}"
                )
                when = f"{window} the workers' learning rates differed"
                detail = f"now {low[i]:.3g} to {high[i]:.3g}"
            raise ConfigError(
                f"{when} (parameter group {i + 1}: {detail}): under {self.cfg.algo} every worker steps alike, and a scheduler "
                f"stepped on each worker's own loss (ReduceLROnPlateau) sets each its own lr; step it on "
                f"a figure every worker shares, run.all_reduce(loss)"
            )

    def _abandon_step(self) -> None:
        """Forget the step in flight (its collective failed: the group lost a worker)."""
        self._batch_samples = self._backwards = self._syncs = self._no_sync_depth = self._drops.backward = 0
        self._drops.at = self._drops.finite = self._drops.untaken = None
        self._sums.forget()
        self._stepped.clear()
        self._pending.clear()
        self._current, self._unscaled, self._unsynced, self._in_backward = None, False, False, False
        for opt in self._optimizers:
            opt.zero_grad(set_to_none=True)

    def _replayed_step(self) -> None:
        """A step replayed from a CUDA graph (``--cuda-graphs``, distsgd's loop): its GPU work is
        queued (forward, backward, update, the loss added up); the rest of a step here."""
        self._loss_n += 1
        self._backwards = self._syncs = 1
        self._current = self._upcoming()
        self._end_step()

    def _unscale(self) -> None:
        if self._scaler is not None and not self._unscaled:
            for real in self._real:
                self._scaler.unscale_(cast(torch.optim.Optimizer, real))
            self._unscaled = True

    def _end_step(self) -> None:
        """Every optimiser has stepped: count the step, the algorithm's parameter sync, progress."""
        ctx, cfg = self._ctx, self.cfg
        step = self._current
        assert step is not None  # the step began
        if self._scaler is not None:
            self._scaler.update()
        n = self._batch_samples
        self._state.local += n
        self._state.start += n
        for place, taken in self._pending.items():  # each pass's own position (see _upcoming_epoch)
            if place < len(self._state.starts):
                self._state.starts[place] += taken
        self._pending.clear()
        self._state.steps += 1
        self._batch_samples = self._backwards = self._syncs = self._drops.backward = 0
        self._drops.at = self._drops.finite = self._drops.untaken = None
        self._share_read = False  # (a shard's figures are of the model before this step)
        self._stepped.clear()
        self._current, self._unscaled = None, False
        model = self._need_setup("optimizer.step()")
        # a step that sent is one whose end rewrote the model in place (an average, an outer step):
        # a graph made before it and backpropagated after it fails in autograd (see _with_why)
        sent = self._algo.bytes_sent
        self._algo.after_step(ctx, model, Step(step.number, self._state.local))
        if self._algo.local_model and self._algo.bytes_sent != sent:
            self.rewrote_at = self._state.steps
        if ctx.reports and self.steps % cfg.log_every == 0:
            self._progress()

    # -- reporting -------------------------------------------------------------------------------
    def log(self, **figures: Any) -> None:
        """Report figures (numbers or 0-d tensors). ``test_accuracy`` and ``test_loss`` make an
        evaluation event (progress, metrics.jsonl, summary.json's evals and final figures);
        anything else a ``log`` event. Only the reporting worker's are written. With
        ``--stop-at-target`` a test figure that reaches the target ends the run (``run.loader``
        stops, ``run.should_stop()`` is True): in a process group every worker calls ``run.log``
        with its test figures at the same point (as ``run.evaluation_model()``), the reporting
        one's decide; under Hogwild! any worker's figure stops them all."""
        ours = sorted(set(figures) & {"event", "samples", "rank", "train_wall_s"})
        if ours:  # (on 30aa15c a log event's were the loop's, metrics.jsonl's samples its own count, exit 0)
            raise ConfigError(
                f"run.log({ours[0]}=...): {ours[0]} is a field distsgd writes with each figure (the event, all "
                f"workers' samples so far, the worker, the training time): give yours another name"
            )
        values = {k: _figure(k, v) for k, v in figures.items()}
        ctx = self._ctx
        writes = ctx.reports or ctx.evaluates
        if "test_accuracy" in values or "test_loss" in values:
            reached = False
            with self.paused():
                whose = self._forwards.verdict() if self._forwards is not None else None
                if self._forwards is not None:
                    self._forwards.reset()
                if writes and self._of_a_workers_own_model(whose):
                    self._demoted(values)
                elif writes and whose == forwards.ANOTHER:
                    self._demoted(values, another="another")
                elif writes and whose == forwards.BOTH and not _names_the_copys(values):
                    self._demoted(values, another="both")
                elif writes and self._share_read:  # (no collective since the pass: one worker's shard's)
                    self._demoted(values, another="share")
                elif writes:
                    reached = self._evaluation(values)
                # every worker of a process group gets here (the reporting one decides); a Hogwild!
                # worker that reached it stops the others
                if ctx.job.may_stop and self._lockstep_store() is not None:
                    self._test_logs += 1
                    self._all_here(
                        f"test-log/{self._test_logs}",
                        "run.log() with test figures",
                        "with --stop-at-target they decide together whether the target is reached",
                    )
                if ctx.job.may_stop and self._algo.agree(ctx, reached):
                    self._stopped = True
        elif writes:
            ctx.sink.emit(
                {
                    "event": "log",
                    "samples": self.global_samples(),
                    "rank": self.rank,
                    "train_wall_s": self._clock.elapsed(),
                    **values,
                }
            )

    def _of_a_workers_own_model(self, whose: str | None) -> bool:
        """Whether test figures logged now were measured on this worker's own model where that is not
        the model the run returns (local-sgd's, DiLoCo's, EASGD's replicas between their averages):
        in a user's loop, of an algorithm whose models are local, with no run.evaluation_model()
        since the last step, or after it a forward of the worker's own model and none of its, before
        run.final_model()."""
        made = self._made
        evaluated = made is not None and made[0] == self.steps and whose != forwards.OWN
        return self._ctx.job.main is not None and self._algo.local_model and self._returned is None and not evaluated

    def _demoted(self, values: dict[str, Any], another: str | None = None) -> None:
        """Test figures of a worker's own model (:meth:`_of_a_workers_own_model`), or perhaps of
        another (``another``: "another", only other models ran a forward since the last step,
        run.evaluation_model() or run.final_model(); "both", the model and a copy of it with other
        weights, an EMA's, and the figures do not say which is which: see
        :mod:`distsgd.train.forwards`): a ``log`` event, not an evaluation (not the final figures,
        nor a time to target); said once."""
        if another == "share":
            if not self._warned_share:
                self._warned_share = True
                log.warning(
                    "run.log(test_...) after a pass over run.loader() under torch.no_grad() and no run.all_reduce() "
                    "since: the figures are this worker's shard of the set's, logged but not taken as the run's "
                    "evaluations (final figures, time to target); combine them over the workers with run.all_reduce() "
                    "(sums of correct and seen), or evaluate the whole set with a DataLoader of your own"
                )
        elif another == "both":
            if not self._warned_both:
                self._warned_both = True
                log.warning(
                    "run.log(test_...) after forwards of the model and of a copy of it with other weights (an "
                    "EMA's?): whose figures they are is not said, so they are logged but not taken as the figures "
                    "of the model returned and saved; log the model's as test_accuracy/test_loss and the copy's in "
                    "the same call under names that hold those (ema_test_accuracy=...), or log the model's before "
                    "the copy runs (to return the copy, load its weights into the model before run.final_model())"
                )
        elif another:
            if not self._warned_another:
                self._warned_another = True
                log.warning(
                    "run.log(test_...) after a forward of another model and none of the one the run returns "
                    "(since the last step, run.evaluation_model() or run.final_model()): the figures are another "
                    "model's (an EMA's?), logged but not taken as the figures of the model returned and saved; "
                    "evaluate that model (to return an EMA, load its weights into the model before "
                    "run.final_model())"
                )
        elif not self._warned_own:
            self._warned_own = True
            log.warning(
                "run.log(test_...) at %d samples: no run.evaluation_model() since the last step, so the "
                "figures are of this worker's own model, and %s returns another (its average): logged, but "
                "not taken as the run's evaluations (final figures, time to target); measure "
                "run.evaluation_model() (or the model run.final_model() returns)",
                self.global_samples(),
                self.cfg.algo,
            )
        self._ctx.sink.emit(
            {
                "event": "log",
                "samples": self.global_samples(),
                "rank": self.rank,
                "train_wall_s": self._clock.elapsed(),
                **values,
            }
        )

    def _evaluation(self, figures: dict[str, Any]) -> bool:
        """This worker's evaluation (its ``test_accuracy``, ``test_loss`` and any other figures):
        an event kept for the summary and emitted; whether it reaches --stop-at-target's target
        (or a callback stops the run there)."""
        ctx = self._ctx
        if self._evaluated_before(figures):
            ctx.sink.emit({"event": "log", "samples": self.global_samples(), "rank": self.rank, **figures})
            return False
        event = eval_event(
            ctx.dataset,
            self.global_samples(),
            self.epoch(),
            self._evaluated_at(),
            figures.get("test_accuracy"),
            figures.get("test_loss"),
        )
        event.update({k: v for k, v in figures.items() if k not in event})
        self._state.evals.append(event)
        self._steps_at_eval = self.steps
        if self._returned is not None:
            self._returned_versions = _versions(self._returned)
        ctx.sink.emit(event)
        return stops(event, self.cfg, ctx.job.callbacks)

    def _evaluated_before(self, figures: dict[str, Any]) -> bool:
        """Whether an evaluation now is the last one made again, on the same model: at its samples,
        with no step and no load since, the same figures (a loop whose passes ``run.loader`` left
        empty once ``--max-samples`` was reached evaluates after each: until 2026-12-01 each was
        another evaluation, 4 alike at 3,008 samples, an audit's); or, in a resumed run, the one the
        checkpoint it started from holds: before its first step and any load, at the samples of
        its last evaluation, the model restored being the one measured then (a loop that starts
        again at epoch 0 evaluates it after each empty pass: on 3623a92 each was another, and
        EarlyStopping(patience=2) stopped the resumed run before its first step, 2,048 samples of
        4,096, exit 0; an audit's). Logged, not an evaluation."""
        evals = self._state.evals
        if self._ctx.job.main is None or not evals or evals[-1].get("samples") != self.global_samples():
            return False
        if self._started is Start.RESUMED and self.steps == self._resumed_steps and self._loaded_at < 0:
            return True
        return (
            self.steps == self._steps_at_eval
            and self._loaded_at < len(evals)
            and all(evals[-1].get(k) == v for k, v in figures.items())
        )

    def _schedule_position(self) -> tuple[float, float]:
        """Where the run is in --schedule's epochs, and how many it has: all workers' samples over
        an epoch's (the training set's length, ``spawn(train_size=)``'s or run.loader's dataset's);
        by --epochs in a lockstep group, this worker's samples over its shard (the same on every
        worker, and still the run's end after a loss). A schedule over epochs of unknown length (a
        stream's) is refused: it would stay at its start."""
        cfg = self.cfg
        per_epoch = self.global_per_epoch or (
            shard_size(self._data_len, self.world, cfg.partition) * self.world if self._data_len else 0
        )
        if cfg.schedule == "constant":
            return 0.0, 1.0  # a warm-up alone
        if not per_epoch:
            raise ConfigError(schedule_needs_epochs(cfg.schedule, own_loop=True))
        if cfg.max_samples is None and self.per_epoch and self._algo.topology.lockstep:
            # by --epochs, in lockstep: every worker trains its shard's epochs, so the run is where each
            # worker is (the same number before a loss; after one, the run's samples count the lost
            # worker's shard short, and a schedule over them would end before its end)
            return self.samples / self.per_epoch, self.total_epochs
        total = self.total_epochs if self.global_per_epoch or cfg.max_samples is None else cfg.max_samples / per_epoch
        return self.global_samples() / per_epoch, total

    def epoch(self) -> float | None:
        """Epochs this worker has trained: its samples over its shard of the training set, whose
        length ``spawn(train_size=)`` gave or else run.loader's dataset has; None (nothing said)
        while neither is known: a loop that reads a stream."""
        per_epoch = self.per_epoch or (
            shard_size(self._data_len, self.world, self.cfg.partition) if self._data_len else 0
        )
        return round(self.samples / per_epoch, 4) if per_epoch else None

    def _progress(self) -> None:
        elapsed = self._clock.elapsed()
        samples = self.global_samples()
        # the mean of the losses run.backward was given (None: plain loss.backward() calls, unseen)
        mean_loss = float(self._loss_sum) / self._loss_n if self._loss_n else None
        # a nan or inf said once, and how often at the end: a diverged run says it every report
        if mean_loss is not None and not math.isfinite(mean_loss):
            count, first, _ = self._nonfinite
            if not count:
                log.warning(
                    "training loss is %s at %d samples: lower --lr? (or NaN/inf in the data)", mean_loss, samples
                )
            self._nonfinite = (count + 1, first if count else samples, samples)
        self._ctx.sink.emit(
            {
                "event": "progress",
                "samples": samples,
                "epoch": self.epoch(),
                "rank": self.rank,
                "loss": mean_loss,
                "lr": self._optimizer.param_groups[0]["lr"] if self._optimizer else None,
                "train_wall_s": elapsed,
                "samples_per_s": samples / elapsed if elapsed > 0 else 0.0,
                **({"loss_scale": self._scaler.get_scale()} if self._scaler is not None else {}),
                **self._algo.progress_figures(self._ctx),
            }
        )
        self._loss_sum.zero_()
        self._loss_n = 0

    # -- the model -------------------------------------------------------------------------------
    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """The training clock stopped (your evaluation, your logging, a save): not counted in
        samples/s, nor in --timeout's watch for a loop that makes no progress (an evaluation longer
        than --timeout is no stall; its peers' waits for it, at the next collective, still have
        --timeout's deadline). An optimiser of your evaluation's (a linear probe's on the model's
        features) may step there parameters that are not the model's: each worker's trains apart,
        as your evaluation's own."""
        was_running = self._clock.running
        self._clock.pause()
        _PAUSED.n = getattr(_PAUSED, "n", 0) + 1
        self._pauses += 1
        try:
            yield
        finally:
            self._pauses -= 1
            _PAUSED.n -= 1
            if was_running:
                self._clock.resume()

    def evaluation_model(self) -> nn.Module:
        """The model the algorithm would return now (the average, theta, the shared model, the
        module inside a DDP wrapper). Every worker must call it at the same point: it may be a
        collective. Evaluate it in eval mode under ``run.paused()``; do not train it."""
        model = self._need_setup("run.evaluation_model()")
        with self.paused():
            if self._algo.collective_evaluation and self._ctx.job.main is not None:
                self._evaluations += 1
                self._all_here(
                    f"evaluation/{self._evaluations}", "run.evaluation_model()", "it averages the workers' models"
                )
            began = time.perf_counter()
            returned = self._algo.evaluation_model(self._ctx, model)
            _modes_of(self._algo.unwrap(model), returned)
            if self._clock.sync is not None:  # a GPU's average is made when it is done, not when queued
                self._clock.sync()
            if self._returned is None:  # the final model's time is the clock's, stopped where it was made
                self._made = (self.steps, self._clock.elapsed() + time.perf_counter() - began)
                if returned is self._algo.unwrap(model):  # (model: the module, or a wrapper of it, DDP's)
                    self._watch_forwards(returned, also=model)
                else:  # an average, theta, a centre: the worker's model (and any wrapper of it) is its own
                    self._watch_forwards(returned, own=model)
            return returned

    def _watch_forwards(self, mine: nn.Module, own: nn.Module | None = None, also: nn.Module | None = None) -> None:
        """In a user's loop in a process group, note which models run a forward from here
        (run.evaluation_model(), run.final_model()) to its test figures (see :meth:`log`):
        ``mine``, the model the run returns (``also``: a wrapper of it), ``own``, the worker's
        replica where that is another (local-sgd's between averages: a loop that calls
        run.evaluation_model() but evaluates its ``model``, an ``evaluate(model)`` kept from the
        script, logged its replica's figures as the run's: 0.7483 final for a returned model of
        0.7672), or a copy of it with other weights (an EMA's: see :mod:`distsgd.train.forwards`).
        Not under Hogwild! and the parameter server, whose loop's figures are not the final ones
        (and a copy taken there is of weights the other workers move on); not for a compiled model
        (a global hook makes torch.compile warn, and recompile as it comes and goes)."""
        self._end_forwards()
        model = self._model
        compiled = self._compiled or (
            model is not None and any(getattr(m, "_compiled_call_impl", None) is not None for m in model.modules())
        )
        if self._ctx.job.main is not None and self._algo.topology.process_group and not compiled:
            self._forwards = Forwards(mine, own, also)

    def _end_forwards(self) -> None:
        """Remove the hook of :meth:`_watch_forwards` (a step began, main returned or raised)."""
        if self._forwards is not None:
            self._forwards.end()
            self._forwards = None

    def _evaluated_at(self) -> float:
        """The training-clock time an evaluation made now describes: when the model
        ``run.evaluation_model()`` returned since the last step existed, the time the algorithm
        took to make it included (the average of the workers' models in the middle of a period,
        DiLoCo's partial round), else now. The clock stays paused while that model is made (an
        evaluation's cost is not training), but the model did not exist before: a run ending
        there would have made it as its final model, on the clock, so a time to target counts it."""
        made = self._made
        return made[1] if made is not None and made[0] == self.steps else self._clock.elapsed()

    def _all_here(self, key: str, what: str, why: str) -> None:
        """Every worker of the group called ``what`` (its ``key``-th time; ``why`` they all do): a
        barrier on the group's store, not a collective, so a worker that called it alone fails in
        one line instead of pairing its collective with another kind on a peer (which gloo answers
        with an abort): once a peer is found waiting for it at a synchronisation, else after --timeout."""
        if self.world == 1 or not dist.is_initialized():
            return
        store = dist.distributed_c10d._get_default_store()
        if store.add(f"distsgd/{key}", 1) == self.world:
            store.set(f"distsgd/{key}/all", "1")
            return
        late = (
            f"worker {self.rank} called {what} and not every worker did within --timeout {self.cfg.timeout_s:g} s: "
            f"under {self._algo.name} {why}, so every worker calls it at the same point of the loop"
        )
        doing = f"called {what} (under {self._algo.name} {why})"  # (a peer's line: lockstep.stranded)
        lockstep.barrier(store, self.rank, [f"distsgd/{key}/all"], doing, self.cfg.timeout_s, late)

    def _evaluations_joined(self) -> None:
        """At the end of a user's loop under an algorithm whose evaluation is a collective: no peer
        waits in an evaluation this worker never called (it would wait for ever)."""
        if self._algo.collective_evaluation and self.world > 1 and dist.is_initialized():
            store = dist.distributed_c10d._get_default_store()
            if store.check([f"distsgd/evaluation/{self._evaluations + 1}"]):
                raise ConfigError(
                    f"another worker called run.evaluation_model() where worker {self.rank} did not: "
                    f"under {self.cfg.algo} it averages the workers' models, so every worker calls it "
                    f"at the same point of the loop"
                )

    def _lockstep_store(self) -> dist.Store | None:
        """The group's store, where a user's loop runs in a lockstep group (see
        :mod:`distsgd.train.lockstep`); None in one process, or where the group trains through a
        lost worker (a replacement counts its steps from when it joined)."""
        if not (self._algo.topology.lockstep and self.world > 1 and dist.is_initialized()):
            return None
        if membership.current() is not None:
            return None
        return dist.distributed_c10d._get_default_store()

    def _same_steps(self) -> None:
        """At the end of a user's loop in a lockstep group: every worker took as many steps (one
        that stopped early on its own criterion, ``if loss < x: break``, left the others' averages
        and samples to pair with its final collectives: local-sgd and DiLoCo ended, exit 0, with
        the samples of steps never taken; with a shorter period, and under allreduce, gloo aborted)."""
        store = self._lockstep_store()
        if store is not None:
            self._arrived = True
            backward = not self._algo.local_model  # (its gradients averaged in each backward pass)
            lockstep.arrive(store, self.rank, self.world, self.steps, self._algo.name, self.cfg.timeout_s, backward)

    def _check_stranded(self, in_backward: bool) -> None:
        """From the loop's watch, while this worker has waited at a synchronisation for a second
        (``in_backward``: or been in a backward pass, which under allreduce and ddp has one: one
        that lasts a second more than a peer's, once that peer has arrived, is of a step it never took)."""
        if in_backward and self._algo.local_model:  # (the others' steps are their own: a backward may lag)
            return
        store = None if self._arrived or self._returned is not None else self._lockstep_store()
        if store is not None and self._stranded_why is None:
            backward = not self._algo.local_model
            self._stranded_why = lockstep.stranded(store, self.rank, self.world, self.steps, self._algo.name, backward)

    def final_model(self) -> nn.Module:
        """The model the algorithm returns, after its last synchronisation (every worker calls it,
        once, after its last step). Return it from ``main``: it is what distsgd saves. In a process
        group it is then the model run.setup() returned (an average, centre or theta loaded into
        it). The training clock stops here; the algorithm's checks of that model run after it."""
        if self._returned is not None:
            return self._returned
        model = self._need_setup("run.final_model()")
        if self.steps == 0 and self._batch_samples > 0:
            raise ConfigError(
                "batches were taken but the optimiser run.setup() returned never stepped: call its "
                "step(), not another optimiser's (the algorithm acts in it), or a GradScaler of the loop's "
                "skipped every step (an inf in every gradient)"
            )
        # (a user's loop in a lockstep group, or alone: asynchronous workers share a budget others may
        # spend; a replacement, or a member of a group that trains through losses, may join at the end)
        own = self._ctx.job.main is not None and not self._replacement and membership.current() is None
        if own and (self._algo.topology.lockstep or self.world == 1) and self.steps == 0 and not self.cfg.resume:
            shard = f" of {self.per_epoch} samples" if self.per_epoch else ""
            raise ConfigError(
                f"worker {self.rank} reached run.final_model() without a step: its run.loader gave no batch (a "
                f"batch_size above its shard{shard}, with drop_last=True?), or the loop took none"
            )
        if self._stepped:  # several optimisers, not all of which stepped last: that step ends here
            self._end_step()
        if self._ctx.job.main is not None:
            self._evaluations_joined()
            self._same_steps()
            self._check_lr_alike(at_end=True)
            self._check_untouched(at_end=True)
        if self._ctx.tell_end is not None:  # before the algorithm's last word to its server
            self._ctx.tell_end(self._end())
        returned = self._algo.finish(self._ctx, model)
        self._unhook()
        self._clock.pause()
        self._train_wall_s = self._clock.elapsed()
        self._made = None  # the model returned existed at train_wall_s: its last average included
        self._algo.verify(self._ctx, returned)
        if self._ctx.job.main is not None and self._algo.topology.process_group:
            returned = _loaded_into(returned, self._algo.unwrap(model))
        self._returned = returned  # (made again from the start where a lost worker interrupted it)
        self._returned_versions = _versions(returned)
        self._watch_forwards(returned)
        self._said_saved(returned)
        if self.rank == 0 and self._ctx.reports:  # (one line: every Hogwild! worker reports)
            _say_nonfinite(returned)
        if self._nonfinite[0] > 1:
            log.warning("training loss was nan or inf in %d progress reports, from %d to %d samples", *self._nonfinite)
        if self._past_steps > 1 and self.rank == 0 and self._ctx.reports:
            end = f"max_samples={self.cfg.max_samples}" if not self._stopped else "--stop-at-target's target"
            log.warning(
                "the loop took %d steps after the run's end (%s) before it asked run.should_stop(): they are "
                "trained, and the summary counts them; ask it at each batch to end there",
                self._past_steps,
                end,
            )
        return self._returned

    def _saved(self, obj: Any) -> None:
        """``torch.save(obj)`` in main (see :func:`_saves_watched`): where ``obj`` holds this
        worker's model's weights (its state_dict's, the model's own) after a step and before
        run.final_model(), note their values' fingerprints, for :meth:`_said_saved`."""
        if self._model is None or self._returned is not None or self.steps == 0:
            return
        own = {(p.data_ptr(), p.shape): n for n, p in self._algo.unwrap(self._model).named_parameters()}
        found: dict[str, torch.Tensor] = {}

        def walk(value: Any, depth: int) -> None:
            if isinstance(value, nn.Module):
                value = dict(value.named_parameters())
            if isinstance(value, torch.Tensor) and value.layout == torch.strided:
                name = own.get((value.data_ptr(), value.shape))
                if name is not None:
                    found[name] = value
            elif isinstance(value, Mapping) and depth < 4:
                for item in value.values():
                    walk(item, depth + 1)
            elif isinstance(value, (list, tuple)) and depth < 4:
                for item in value:
                    walk(item, depth + 1)

        walk(obj, 0)
        if found:
            self._saved_at = (self.steps, _sums(found))

    def _said_saved(self, returned: nn.Module) -> None:
        """One warning where main saved this worker's model's weights after its last step, before
        run.final_model(), and the model the run returns is another: its own replica saved."""
        if self._saved_at is None or self._saved_at[0] != self.steps:
            return
        sums = self._saved_at[1]
        named = dict(returned.named_parameters())
        if _sums({k: named[k] for k in sums if k in named}) != sums:
            log.warning(
                "torch.save of the model's weights after the last step and before run.final_model(): under %s they "
                "are this worker's own replica, not the model the run returns and saves (the workers' average, "
                "theta or centre); save what run.final_model() returns, after it",
                self.cfg.algo,
            )

    def _unhook(self) -> None:
        """The model and optimisers as they were given: no hooks of the run's, their own step and
        forward (a ``single`` run's live on in the caller's process)."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        for real in self._real:
            real.restore()
        self._end_replay()
        self._end_loads()

    @property
    def train_wall_s(self) -> float:
        """Training time: up to the final model once it is made, else so far."""
        return self._train_wall_s if self._train_wall_s is not None else self._clock.elapsed()

    def _need_setup(self, what: str) -> nn.Module:
        if self._model is None:
            raise ConfigError(f"{what} before run.setup(): call model, opt = run.setup(...) first")
        return self._model

    def _end(self) -> LoopEnd:
        """What this worker's loop measured of its data and its steps."""
        return LoopEnd(
            data_len=self._data_len,
            steps=self.steps if self._ctx.job.main is not None else None,
            step_samples=self.samples - self._state.unstepped,
        )

    def _result(self, returned: Any = None) -> WorkerResult:
        """What this worker tells the launcher once ``main`` returned ``returned``."""
        final = self.final_model()
        self._end_forwards()
        if returned is not None and returned is not final:
            unwrapped = self._algo.unwrap(self._model) if self._model is not None else None
            if not isinstance(returned, nn.Module):
                raise ConfigError(
                    f"main(run) returned a {type(returned).__name__}: return run.final_model() (or nothing), "
                    f"and report figures with run.log(...)"
                )
            inside = getattr(returned, "_orig_mod", None)  # the loop's own compiled wrapper of it
            if not any(m is unwrapped or m is self._model for m in (returned, inside)):
                raise ConfigError(
                    "main(run) returned a model that is not run.final_model(): return run.final_model() (or nothing; "
                    "to return an EMA or another copy, load its weights into the model before run.final_model())"
                )
        evals = self._state.evals
        stale = self._figures_stale(final)
        last = evals[-1] if evals and stale is None else None
        end = self._end()
        return WorkerResult(
            rank=self.rank,
            samples=self.samples,
            global_samples=self.global_samples(),
            train_wall_s=self.train_wall_s,
            evals=evals,
            final_test_accuracy=last.get("test_accuracy") if last else None,
            final_test_loss=last.get("test_loss") if last else None,
            model=final if self._ctx.evaluates else None,
            figures=self._algo.figures(),
            data_len=end.data_len,
            steps=end.steps,
            step_samples=end.step_samples,
            stale=stale,
            checkpoints=self._state.seq if self._ctx.job.main is not None and not self._replacement else None,
            where={**device.describe(self._ctx.device, self.cfg.precision), **self._where},
            callbacks=states(self._ctx.job.callbacks) if self._ctx.evaluates else None,
        )

    def _figures_stale(self, final: nn.Module) -> str | None:
        """Why the loop's last evaluation is not of the model it returns (None: it is, or there is
        none): weights were loaded into the model after it (the best epoch's, as Hugging Face's
        load_best_model_at_end); or, in a process group (where the model returned is the
        worker's), samples trained after it (an evaluation every few epochs that missed the last), or
        the model returned changed after run.final_model() (a load, BatchNorm's statistics moved)
        and was not evaluated since. The summary gave that evaluation's figures as the final ones,
        exit 0 (0.7383 for a model that scored 0.6693; 0.748 for one that scored 0.934, the audit
        of 2026-11-30); it now has none (results.own_final_figures says why)."""
        evals = self._state.evals
        at = evals[-1].get("samples") if evals else None
        if not evals:
            return None
        if self._loaded_at == len(evals):
            return f"weights were loaded into the model after its last evaluation (at {at} samples)"
        if self._ctx.job.main is None or not self._algo.topology.process_group:
            return None
        if at != self.global_samples():
            return f"the model trained on from its last evaluation (at {at} samples) to {self.global_samples()} samples"
        if self._returned_versions is not None and _versions(final) != self._returned_versions:
            return (
                f"the model's weights changed after run.final_model() and its last evaluation (at {at} samples): "
                f"a load_state_dict(), or a forward in training mode that moved BatchNorm's statistics"
            )
        return None


def _given_settings_kept(names: tuple[str, ...], cfg: RunConfig, opt: torch.optim.Optimizer) -> None:
    """spawn()'s optimiser settings ``names`` (lr, momentum, weight_decay) where the loop built its
    optimiser itself, which steps with its own: one that differs from it (or that it has not) is
    refused in one line. Until 2026-12-01 spawn(lr=0.5) beside a loop's SGD(lr=0.1) trained at 0.1,
    and config.toml said 0.5 (an audit's)."""
    group = opt.param_groups[0]
    for name in names:
        wanted, own = getattr(cfg, name), group.get(name)
        own = float(own) if isinstance(own, torch.Tensor) and own.numel() == 1 else own  # (a tensor lr)
        if (
            isinstance(own, (int, float))
            and not isinstance(own, bool)
            and math.isclose(own, wanted, rel_tol=1e-6, abs_tol=1e-12)  # (float32's rounding)
        ):
            continue
        has = f"{name}={own}" if own is not None else f"no {name}"
        raise ConfigError(
            f"spawn({name}={wanted}) does nothing here: the loop built its optimiser ({type(opt).__name__}, {has}), "
            f"which steps with its own settings; leave {name} out of spawn(), or let run.setup(model) build the "
            f"optimiser from spawn()'s settings"
        )


def _number(value: Any, where: torch.device) -> torch.Tensor:
    """run.all_reduce/all_gather's ``value`` as a tensor on ``where``: a Python number (bool, int,
    float) a float64 one, so that a worker's int 0 beside another's float combine as numbers."""
    if isinstance(value, (bool, int, float)):
        return torch.tensor(float(value), dtype=torch.float64, device=where)
    return torch.as_tensor(value, device=where).detach()


# run.paused() in this thread (nested): an optimiser step there that updates no parameter of the
# model is an evaluation's (a linear probe's). Per thread, defensively: every run's step hooks see
# every optimiser's step in the process
_PAUSED = threading.local()


def _paused() -> bool:
    return getattr(_PAUSED, "n", 0) > 0


def _loads_back(state: dict[str, Any]) -> None:
    """``run.checkpoint(**state)``'s values load back as a resume loads them (``weights_only``), or
    one line naming the first that does not: a numpy value (``np.float64(acc)``, an array,
    ``np.random.get_state()``) was saved, and the resume then found the checkpoint "damaged" and went
    back to an older one (the audit of 2026-11-30). Tried on the values' shape, each tensor a 0-d one."""
    for key, value in state.items():
        buffer = io.BytesIO()
        try:
            torch.save(_map_tensors(value, lambda t: torch.zeros((), dtype=t.dtype)), buffer)
            buffer.seek(0)
            torch.load(buffer, map_location="cpu", weights_only=True)
        except Exception as exc:  # pickling, or weights_only's refusal of a global
            found = re.search(r"GLOBAL ([\w.]+)", str(exc))
            what = found.group(1) if found else _odd_leaf(value) or type(exc).__name__
            raise ConfigError(
                f"run.checkpoint({key}=...): a value in it ({what}) does not load back as a resume loads a "
                f"checkpoint (weights_only): keep numbers, strings, tensors, and lists, tuples and dicts of them "
                f"(float(x), torch.as_tensor(array); the checkpoint keeps torch's, numpy's and Python's random states itself)"
            ) from None


def _odd_leaf(x: Any) -> str | None:
    """The type of the first value in ``x`` that is no plain number, string or tensor (a numpy
    float64's ``numpy.float64``), looking into lists, tuples, sets and dicts."""
    if isinstance(x, (list, tuple, set, frozenset)) or type(x) is dict:
        items = x.values() if isinstance(x, dict) else x
        return next((odd for odd in map(_odd_leaf, items) if odd), None)
    if x is None or type(x) in (bool, int, float, complex, str, bytes) or isinstance(x, torch.Tensor):
        return None
    return f"{type(x).__module__}.{type(x).__qualname__}"


class _UserState:
    """A user's loop's own state in a checkpoint (``run.checkpoint(**state)``)."""

    def __init__(self) -> None:
        self.value: dict[str, Any] | None = None

    def state_dict(self) -> dict[str, Any]:
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.value = state["value"]


class _TensorBatches:
    """A TensorDataset's batches of ``order``, ``size`` at a time, indexed as they are taken."""

    def __init__(self, tensors: tuple[torch.Tensor, ...], order: torch.Tensor, size: int) -> None:
        self.tensors, self.order, self.size = tensors, order, size

    def __len__(self) -> int:
        return -(-len(self.order) // self.size)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, ...]]:
        for i in range(0, len(self.order), self.size):
            idx = self.order[i : i + self.size]
            yield tuple(t[idx] for t in self.tensors)


# a whole pass over run.loader() read with gradients on and no backward pass: a validation without
# torch.no_grad(), whose samples counted as trained and whose length became an epoch's (5 epochs
# said for 2 trained; with max_samples, training cut short by the reads), exit 0
_NO_BACKWARD_PASS = (
    "a pass over run.loader() ended, its {read} read with gradients on and no backward pass through "
    "the model: they count as trained samples; read an evaluation's under torch.no_grad(), where they count "
    "as none (or train on each batch as it comes, not on a list of them; a pass that needs gradients but no "
    "backward, an adversarial evaluation's: a DataLoader of your own)"
)


class _Shard:
    """``run.loader``'s batches: each pass over it (``iter``) the next epoch's (or the one named),
    counted, on the worker's device, stopped when due. ``dataset`` and ``batch_size`` as a
    DataLoader's."""

    def __init__(
        self, run: Run, dataset: Any, size: int, epoch: int | None, shuffle: bool, drop_last: bool, options: dict
    ) -> None:
        self.run, self.dataset, self.size, self.epoch = run, dataset, size, epoch
        self.shuffle, self.drop_last, self.options = shuffle, drop_last, options

    @property
    def batch_size(self) -> int:
        return self.size

    def __len__(self) -> int:
        return self.run._batches_in(self)

    def __iter__(self) -> Iterator[Any]:
        run = self.run
        if not torch.is_grad_enabled():  # an evaluation's pass (torch.no_grad, inference_mode)
            run._need_setup("iterating over run.loader()")
            for batch in run._evaluation_pass(self):
                yield _to(batch, run.device)
            return
        token, backwards, read, last = object(), run._backwards_ever, 0, 0
        try:
            batches, sizes = run._pass(self, token)
            for batch in batches:
                if run.should_stop():
                    return
                last = next(sizes) if sizes is not None else _count(batch)
                run._count_in(token, last)
                read += 1
                yield _to(batch, run.device)
            if read and run._backwards_ever == backwards and run._ctx.job.main is not None:
                raise ConfigError(_NO_BACKWARD_PASS.format(read=f"{read} batch{'es' * (read != 1)}"))
        finally:  # exhausted, left (a zip's shorter loader ended), or stopped
            run._untaken(token, last)
            run._open.pop(id(token), None)
            run._pass_of.pop(id(token), None)


class _Drops:
    """A user's loop's ``zero_grad()`` after a backward and before any step (Run._zeroed): the
    samples counted when that backward ended (``at``; None: none pending), whether its gradients
    were finite (a tensor not read yet), the samples counted at the last backward, and whether the
    drop was said (once, Run._dropped_said)."""

    def __init__(self) -> None:
        self.at: int | None = None
        self.finite: torch.Tensor | None = None
        self.backward = 0
        self.said = False
        self.untaken: tuple[int, int | None] | None = None  # a pass's last batch, perhaps never trained (Run._untaken)


class _Real:
    """An optimiser's own update, apart from the ``step()`` the run routes through the algorithm
    (what GradScaler and the algorithm's ``apply_step`` call); anything else is the optimiser's."""

    def __init__(self, opt: torch.optim.Optimizer, run: Run, index: int) -> None:
        self.opt = opt
        self.original = opt.__dict__.get("step")  # an LR scheduler made before run.setup() wraps it
        self.update = self.original if self.original is not None else types.MethodType(type(opt).step, opt)

        def step(_opt: torch.optim.Optimizer, closure: Callable[[], object] | None = None) -> None:
            if closure is not None and isinstance(_opt, torch.optim.LBFGS):
                raise ConfigError(
                    "LBFGS steps through a closure that evaluates the loss several times a step, which "
                    "distsgd's algorithms do not synchronise: use a first-order optimiser (SGD, Adam, ...)"
                )
            if closure is not None:
                raise ConfigError(
                    "optimizer.step(closure) is not supported under distsgd: compute the loss, "
                    "run.backward(loss), then optimizer.step()"
                )
            run._optimizer_step(index)

        if hasattr(self.original, "_wrapped_by_lr_sched"):
            step._wrapped_by_lr_sched = True  # type: ignore[attr-defined]  # that scheduler's mark
        opt.step = types.MethodType(step, opt)  # type: ignore[method-assign]
        self.original_zero = opt.__dict__.get("zero_grad")
        zero = self.original_zero if self.original_zero is not None else types.MethodType(type(opt).zero_grad, opt)

        def zero_grad(_opt: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> None:
            run._zeroed()
            zero(*args, **kwargs)

        opt.zero_grad = types.MethodType(zero_grad, opt)  # type: ignore[method-assign]

    def step(self, closure: Callable[[], object] | None = None) -> object:
        return self.update()

    def restore(self) -> None:
        if self.original is None:
            self.opt.__dict__.pop("step", None)
        else:
            self.opt.step = self.original  # type: ignore[method-assign]
        if self.original_zero is None:
            self.opt.__dict__.pop("zero_grad", None)
        else:
            self.opt.zero_grad = self.original_zero  # type: ignore[method-assign]

    def __getattr__(self, name: str) -> Any:  # param_groups, state, _step_supports_amp_scaling, ...
        return getattr(self.opt, name)


class _Stepper:
    """What an algorithm's ``apply_step`` steps: one optimiser's update, through --precision's
    GradScaler (which skips a step whose gradients overflowed); ``param_groups`` and the rest are
    that optimiser's."""

    def __init__(self, real: _Real, scaler: torch.amp.GradScaler | None) -> None:
        self.real, self._scaler = real, scaler

    def step(self) -> None:
        if self._scaler is not None:
            self._scaler.step(cast(torch.optim.Optimizer, self.real))
        else:
            self.real.step()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.real.opt, name)


def _route_step(opt: torch.optim.Optimizer, run: Run, index: int) -> None:
    """``opt.step()`` becomes the algorithm's step (the run's ``_optimizer_step``)."""
    run._real.append(_Real(opt, run, index))


def _under_autocast(
    autocast: Callable[[], contextlib.AbstractContextManager], call: Callable[..., Any], *args: Any, **kwargs: Any
) -> Any:
    """A compiled module's call under ``autocast`` as :func:`_autocast_hooks` makes an eager one's:
    a forward that records gradients in the lower precision, its outputs returned in float32; one
    under ``torch.no_grad()`` in float32. Outside the compiled code, which sees autocast's state."""
    if not torch.is_grad_enabled():
        return call(*args, **kwargs)
    with autocast():
        out = call(*args, **kwargs)
    return _in_float32(out)


def _in_float32(out: Any) -> Any:
    """A forward's floating-point outputs in float32 (the loss is computed in float32)."""
    return _map_tensors(out, lambda t: t.float() if t.is_floating_point() and t.dtype != torch.float32 else t)


def _autocast_hooks(module: nn.Module, autocast: Callable[[], contextlib.AbstractContextManager]) -> list[Any]:
    """``module``'s forward passes that record gradients (training) run under ``autocast``
    (--precision bf16 or fp16, as Fabric's precision plugins do), their floating-point outputs
    returned in float32, so that the loss is computed in float32; a forward under
    ``torch.no_grad()`` (an evaluation) runs in float32. Hooks, so that the module's class,
    state_dict and wrappers stay and a copy of it (an average, theta) computes with its own
    weights; each thread enters its own context."""
    entered = threading.local()

    def before(mod: nn.Module, args: Any) -> None:
        stack = entered.__dict__.setdefault("stack", [])
        if torch.is_grad_enabled():
            context = autocast()
            context.__enter__()
            stack.append(context)
        else:
            stack.append(None)

    def after(mod: nn.Module, args: Any, out: Any) -> Any:
        context = entered.stack.pop()
        if context is None:
            return None
        context.__exit__(None, None, None)
        return _in_float32(out)

    return [module.register_forward_pre_hook(before), module.register_forward_hook(after)]


def _own_storage(module: nn.Module) -> None:
    """``module``'s weights in memory of this worker's own, where they share memory with other
    processes (a model sent through ``spawn(args=...)`` travels in shared memory, as torch's
    multiprocessing sends tensors, and ``share_memory()`` puts it there): otherwise every worker
    would step the same weights. The algorithm decides what is shared (Hogwild! binds the model to
    its own shared copy). The parameters stay the same objects, so optimisers built on them stay valid."""
    with torch.no_grad():
        for param in module.parameters():
            if param.is_shared():
                param.data = param.data.clone()
        for sub in module.modules():
            for name, buffer in sub._buffers.items():
                if buffer is not None and buffer.is_shared():
                    sub._buffers[name] = buffer.clone()


def _refuse_default_dtype(algo: str, server: bool, before: torch.dtype) -> None:
    """``torch.set_default_dtype(torch.float64)`` in main before run.setup(), where the model the
    workers train is built in another process (the server's, the launcher's shared one), where main
    does not run: a server's worker waited for ever for twice the bytes the server sent (then
    blamed the server), and Hogwild!'s trained the float32 model, the setting silently unused. (At
    the script's top level every process runs it: it works there.)"""
    where = "the parameter server builds it in its own process" if server else "it is built once, in the launcher"
    raise ConfigError(
        f"torch.set_default_dtype({torch.get_default_dtype()}) in main does not reach the model under {algo}: "
        f"{where}, where main does not run ({before} there); set it at the script's top level (every process "
        f"runs that), or make the dtype the model's (its constructor, or the factory: model=lambda: Net().double())"
    )


def _modes_of(own: nn.Module, made: nn.Module) -> None:
    """Give ``made`` (the model run.evaluation_model() returns: DiLoCo's theta, EASGD's centre,
    kept from run.setup() on) each module's mode in the loop's ``own`` model. A loop that set
    ``model.eval()`` before asking for it (the HF/timm habit) evaluated theta or the centre in
    training mode, with dropout and BatchNorm's batch statistics: the final figures another
    model's (diloco 0.5625 logged, 0.734 for the model returned), and under easgd the test set's
    batches moved the centre's running statistics, which were saved (an audit's)."""
    if made is own:
        return
    theirs, mine = list(made.modules()), list(own.modules())
    if len(theirs) == len(mine):
        for a, b in zip(theirs, mine):
            a.training = b.training


def _seed_globals(seed: int) -> None:
    """Seed the global random streams a loop draws from, each worker its own (dropout, a Dataset's
    or the loop's augmentations), from the run's seed: torch's, Python's ``random`` (which a fork
    seeds from the OS, so ``seed=`` did not reproduce it) and numpy's (which a fork leaves as it
    was: every worker drew the same numbers)."""
    torch.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed % 2**32)


def _uncompiled(given: nn.Module | None) -> tuple[nn.Module | None, nn.Module | None]:
    """The model given to run.setup() and, where the loop compiled it first (``torch.compile(model)``
    before setup, Fabric's order), its compiled wrapper: the algorithm takes the module inside (the
    wrapper's state dict is the module's under '_orig_mod.': the run trained, then failed to save it,
    under hogwild and the server refused it at setup as a model of other weights)."""
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")  # imported where anything was compiled
    if eval_frame is not None and isinstance(given, eval_frame.OptimizedModule):
        return cast(nn.Module, given._orig_mod), given
    return given, None


def _compiled_as(compiled: nn.Module | None, model: nn.Module) -> nn.Module:
    """The model run.setup() returns: the algorithm's, compiled as the loop had compiled the one it
    gave (the loop's own wrapper where the algorithm put none round the module), so that the loop
    trains compiled, as after ``model = torch.compile(model)`` following run.setup()."""
    if compiled is None:
        return model
    if model is compiled._orig_mod:
        return compiled
    return type(compiled)(model, compiled.dynamo_ctx)


def _loaded_into(final: nn.Module, own: nn.Module) -> nn.Module:
    """``own``, the model run.setup() returned (unwrapped), holding ``final``'s weights where the
    algorithm returns another module (DiLoCo's theta, EASGD's centre): a loop that saves or
    evaluates its ``model`` after run.final_model() (``save_pretrained``, ``torch.save(model.
    state_dict())`` on rank 0) has the model distsgd returns and saves; before, the worker's own
    (0.034 from it under diloco, 0.058 under easgd), exit 0."""
    if final is own:
        return own
    theirs = {**dict(final.named_parameters()), **dict(final.named_buffers())}
    with torch.no_grad():
        for name, t in [*own.named_parameters(), *own.named_buffers()]:
            t.copy_(theirs[name])
    return own


def _tensors_in(value: Any) -> Iterator[torch.Tensor]:
    """The tensors in ``value`` (dicts, lists and tuples of them, as run.checkpoint keeps)."""
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, Mapping):
        for v in value.values():
            yield from _tensors_in(v)
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _tensors_in(v)


def _same_state(model: nn.Module, state: Mapping[str, Any]) -> bool:
    """``state`` holds ``model``'s own values, every one: with the state from ``run.resumed`` (nanoGPT's
    resume loads the checkpoint's model back, which ``run.setup()`` restored already), a load that
    changes nothing, which the algorithm need not take (on 30aa15c diloco, streaming diloco and easgd
    made each worker's weights of a round's middle their theta or centre, and the replicas parted:
    8.6e-3 from a run never stopped). Only from ``run.resumed``, where every worker loads its own
    part: a load of weights one worker holds (rank 0's, on every worker) is every worker's."""
    own = model.state_dict()
    if set(own) != set(state):
        return False
    for name, mine in own.items():
        given = state[name]
        if not isinstance(given, torch.Tensor) or given.shape != mine.shape:
            return False
        if not torch.equal(given.to(device=mine.device, dtype=mine.dtype), mine):
            return False
    return True


def parameters_changed(what: str, algo: str) -> ConfigError:
    """The one line for a model whose parameters are not the ones run.setup() took (``what``: which),
    said by the loop's check and by ddp's, whichever sees it first."""
    return ConfigError(
        f"{what} since run.setup() (a parametrization registered, as spectral_norm or weight_norm, a module "
        f"replaced, a parameter assigned, load_state_dict(assign=True)?): under {algo} the workers train the "
        f"parameters run.setup() took, and the model's new ones would train apart from them; make the change "
        f"in the model factory given to distsgd.spawn(model=...), before run.setup()"
    )


def _named_parameters(module: nn.Module) -> tuple[tuple[str, nn.Parameter], ...]:
    """``module``'s parameters under their names in its state (a wrapper's own prefix left out, as
    activation checkpointing's ``_checkpoint_wrapped_module.``; a parametrization's ``original`` in)."""
    return tuple((k, v) for k, v in module.state_dict(keep_vars=True).items() if isinstance(v, nn.Parameter))


def _versions(model: nn.Module) -> list[tuple[int, int]]:
    """``model``'s parameters and buffers and their in-place versions: a copy into its weights (a
    load) or an update changes it; a move to another device (``.cpu()`` before saving) does not."""
    return [(id(t), t._version) for t in itertools.chain(model.parameters(), model.buffers())]


def _state_to(opt: torch.optim.Optimizer, where: torch.device) -> None:
    """An optimiser's state (a resumed one's moments) on the model's device."""
    for state in opt.state.values():
        for k, v in state.items():
            if isinstance(v, torch.Tensor) and k != "step":
                state[k] = v.to(where)


def _settings(optimizer: torch.optim.Optimizer) -> list[dict[str, Any]]:
    """Each parameter group's settings (lr, momentum, weight decay, ...), without its parameters."""
    return [{k: v for k, v in group.items() if k != "params"} for group in optimizer.param_groups]


def _grad_versions(optimizers: list[torch.optim.Optimizer]) -> list[int]:
    """Each gradient's version counter: it moves when anything changes the gradient in place."""
    return [
        p.grad._version if p.grad is not None else -1
        for opt in optimizers
        for g in opt.param_groups
        for p in g["params"]
    ]


def run_own_loop(ctx: WorkerContext, algo: "Algorithm", replacement: bool = False) -> WorkerResult:
    """Call the user's ``main(run)`` in this worker (``replacement``: in place of one that died)
    and return what it measured. An exception of the user's code, or a loop that takes no step
    for ``--timeout`` while it trains, is raised as a :class:`~distsgd.errors.LoopError` naming
    this worker and the line: it ends the run under every algorithm."""
    run = Run(ctx, algo, replacement)
    main = ctx.job.main
    assert main is not None, "run_worker calls this for a user's loop only"
    worker = f"worker {ctx.rank}"

    def progress() -> int | None:  # watched from run.setup() to run.final_model(), outside run.paused()
        return run.samples if run._model is not None and run._returned is None else None

    try:
        with (
            stall_watch(worker, progress, ctx.cfg.timeout_s, run._check_stranded, lambda: run._pauses > 0),
            _combining_watched(run, algo),  # (inside the next's: that one sees the loop's own call)
            _no_gradient_average(run, algo),
            _saves_watched(run, algo),
        ):
            returned = main(run)
    except (Exception, SystemExit) as exc:
        if run._stranded_why is not None:  # its wait ended by the peer's exit: the line that peer failed with
            raise ConfigError(run._stranded_why) from None
        if isinstance(exc, SystemExit) and exc.code in (None, 0):  # sys.exit(0) in main: as a return
            returned = None
        else:  # an exception, or sys.exit(1) (or any other code): the worker failed
            failure = loop_failure(exc, worker)
            if failure is None:  # distsgd's own one-line refusal, or a fault elsewhere the launcher names
                _at_a_sync(exc, algo, ctx.cfg.timeout_s)
                raise
            raise _with_why(failure, exc, algo, run) from exc
    finally:  # main returned or raised (Ctrl-C too): no hook of the run's stays in this process
        run._end_forwards()
        run._end_replay()  # (the schedulers' classes as torch made them)
        run._end_loads()
    if run._model is None:
        raise ConfigError("main(run) never called run.setup(): distsgd had no model to train")
    return run._result(returned)


def _at_a_sync(exc: BaseException, algo: "Algorithm", timeout_s: float) -> None:
    """``exc``, raised where the loop synchronises with its peers, said as what it means where
    torch's words would not say it (else it is raised as it is)."""
    if not algo.topology.process_group:
        return
    if NO_GROUP in str(exc) and not dist.is_initialized():
        raise ConfigError(  # a converted script's cleanup() before the end, where distsgd still needs it
            "the workers' process group was destroyed in main (dist.destroy_process_group()?) before "
            "distsgd was done with it: call it after run.final_model(), or leave it to distsgd"
        ) from None
    waited = waited_too_long(exc, timeout_s)
    if waited is not None:  # a peer evaluating alone, inside run.paused() too
        raise waited from None


@contextlib.contextmanager
def _no_gradient_average(run: Run, algo: "Algorithm") -> Iterator[None]:
    """While ``main`` runs under an algorithm whose workers train models of their own between
    synchronisations (local-sgd, DiLoCo, EASGD), refuse ``dist.all_reduce`` of a parameter's
    gradient: pytorch.org's ``average_gradients(model)`` after ``backward()``, a converted script's,
    made every step synchronous SGD (local-sgd's weights bit for bit allreduce's), silently, its
    bytes uncounted (an audit's). A DDP wrapper's doing the same is refused at its forward."""
    if not (algo.local_model and algo.topology.process_group and dist.is_available()):
        yield
        return
    original = dist.all_reduce

    def all_reduce(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        model = run._model
        if (
            not _distsgds_call()
            and model is not None
            and isinstance(tensor, torch.Tensor)
            and tensor.layout == torch.strided
        ):
            at = tensor.untyped_storage().data_ptr()
            for name, p in algo.unwrap(model).named_parameters():
                grad = p.grad  # (a sparse one, nn.Embedding(sparse=True)'s, has no storage to compare)
                if grad is not None and grad.layout == torch.strided and grad.untyped_storage().data_ptr() == at:
                    raise ConfigError(
                        f"dist.all_reduce of {name}'s gradient in the loop (average_gradients(model)?) under "
                        f"{algo.name}: it would make every step synchronous SGD, where {algo.name}'s workers "
                        f"train apart between synchronisations; distsgd synchronises them as the algorithm says: "
                        f"drop the loop's gradient all-reduce (or choose an algorithm that averages every step)"
                    )
        return original(tensor, *args, **kwargs)

    with _replaced(dist, "all_reduce", all_reduce):
        yield


# torch.distributed's collectives that combine the workers' values: one of the loop's after an evaluation
# pass over run.loader (each worker's shard) makes the figures logged next the whole set's
_COMBINING = (
    "all_reduce",
    "all_gather",
    "all_gather_object",
    "all_gather_into_tensor",
    "reduce",
    "gather",
    "gather_object",
    "reduce_scatter",
    "reduce_scatter_tensor",
)


@contextlib.contextmanager
def _combining_watched(run: Run, algo: "Algorithm") -> Iterator[None]:
    """While ``main`` runs in a process group, a collective of torch.distributed's that combines
    (``dist.all_reduce(correct)``, a converted DDP script's) ends what an evaluation pass over
    run.loader left unsaid: figures logged after it are no longer one worker's shard's (see
    Run.log). A collective torch makes inside a module (DDP's broadcast of buffers at a forward)
    goes through none of these and changes nothing."""
    if not (algo.topology.process_group and dist.is_available()):
        yield
        return

    def combining(original: Callable) -> Callable:
        @functools.wraps(original)
        def call(*args: Any, **kwargs: Any) -> Any:
            run._share_read = False
            return original(*args, **kwargs)

        return call

    with contextlib.ExitStack() as stack:
        for name in _COMBINING:
            original = getattr(dist, name, None)
            if original is not None:
                stack.enter_context(_replaced(dist, name, combining(original)))
        yield


@contextlib.contextmanager
def _saves_watched(run: Run, algo: "Algorithm") -> Iterator[None]:
    """While ``main`` runs under an algorithm whose workers train models of their own between
    synchronisations: ``torch.save`` of this worker's model's weights (``model.state_dict()``, the
    model) is noted (:meth:`Run._saved`), so that one after the last step and before
    run.final_model(), which saved the worker's replica where the run returns an average, theta or
    a centre, is said (a converted script's ``if rank == 0: torch.save(model.state_dict(), ...)``
    before ``return run.final_model()``: local-sgd 0.025 and DiLoCo 0.118 from the model returned,
    silently, an audit's)."""
    if not algo.local_model:
        yield
        return
    original = torch.save

    def save(obj: Any, *args: Any, **kwargs: Any) -> Any:
        if not _distsgds_call():  # (not run.checkpoint's)
            run._saved(obj)
        return original(obj, *args, **kwargs)

    with _replaced(torch, "save", save):
        yield


@contextlib.contextmanager
def _replaced(owner: Any, name: str, replacement: Callable) -> Iterator[None]:
    """``owner.name`` is ``replacement`` while the block runs (``main``: see the watches above)."""
    original = getattr(owner, name)
    setattr(owner, name, replacement)
    try:
        yield
    finally:
        setattr(owner, name, original)


def _distsgds_call() -> bool:
    """Whether the caller of the function calling this is distsgd's own code (an algorithm's
    collective, run.checkpoint's save), not the user's."""
    return bool(sys._getframe(2).f_globals.get("__name__", "").startswith("distsgd."))


def _sums(tensors: Mapping[str, torch.Tensor]) -> dict[str, float]:
    """Each tensor's sum in float64: a fingerprint of the values a save held."""
    with torch.no_grad():
        return {name: float(t.detach().double().sum()) for name, t in tensors.items()}


INPLACE = "modified by an inplace operation"  # autograd's words for a weight changed under a graph


def _names_the_copys(values: dict[str, Any]) -> bool:
    """Whether figures logged together name a copy's apart from the model's: beside test_accuracy or
    test_loss, another name that holds one of those (``ema_test_accuracy``, ``test_loss_ema``)."""
    return any(k not in ("test_accuracy", "test_loss") and ("test_accuracy" in k or "test_loss" in k) for k in values)


def _not_in_a_users_ddp(module: nn.Module, args: Any) -> None:
    """A forward pre-hook on the model run.setup() returned, in a process group: refuse a forward
    run by a DistributedDataParallel the loop wrapped it in (``model = DDP(model)``, a converted
    script's habit). Its gradient all-reduce came on top of the algorithm's: under allreduce and ddp
    every gradient averaged twice, bytes_sent half the bytes; under local-sgd synchronous SGD,
    silently. (torch marks the DDP whose forward runs; this module's own, under ddp, is itself.)"""
    active = getattr(nn.parallel.DistributedDataParallel, "_active_ddp_module", None)
    if active is not None and active is not module:
        raise ConfigError(
            "the model run.setup() returned was wrapped in a DistributedDataParallel of the loop's: distsgd "
            "synchronises the workers as the algorithm says, and DDP's all-reduce of every gradient would come "
            "on top of it (under local-sgd or diloco, every step); train the model run.setup() returned, unwrapped"
        )


def _with_why(failure: LoopError, exc: BaseException, algo: "Algorithm", run: Run) -> LoopError:
    """``failure``, with why where distsgd's step caused it: autograd's "modified by an inplace
    operation" after a step whose end rewrote the weights in place (an average, an outer step) is
    a graph made before that step and backpropagated after it, a GAN's generator through its
    discriminator's step, whose optimiser alone was given to run.setup(): the audit's error said
    nothing of it. (Not after another step: a loop's own in-place change fails so in one process.)
    And torch's "Default process group has not been initialized" (a converted script's DDP(model),
    DistributedSampler(ds) or dist.get_rank()) where the algorithm has no torch process group."""
    if NO_GROUP in str(exc) and not algo.topology.process_group:
        return LoopError(
            f"{one_line(failure)} (under {algo.name} the workers form no torch process group: "
            f"run.rank and run.world say which worker this is, run.loader splits the data, distsgd "
            f"synchronises the model, and run.log reports from worker 0)"
        )
    if TWICE in str(exc) and algo.topology.process_group:  # a converted script's setup() kept
        return LoopError(
            f"{one_line(failure)} (under {algo.name} distsgd formed the workers' process group before main: "
            f"leave out the loop's init_process_group, or guard it with `if not dist.is_initialized()`)"
        )
    if isinstance(exc, AttributeError) and exc.name in ("no_sync", "module") and run._model is not None:
        if exc.obj is run._model or exc.obj is algo.unwrap(run._model):  # DDP's, on the model setup returned
            instead = "run.no_sync()" if exc.name == "no_sync" else "the model itself"
            return LoopError(
                f"{one_line(failure)} (under {algo.name} the model run.setup() returned is your module, not a "
                f"DistributedDataParallel: use {instead} for DDP's .{exc.name})"
            )
    why = algo.loop_failure_why(exc)  # (ddp's, for torch's paragraph on setting its DDP up)
    if why is not None:
        return LoopError(f"{one_line(failure).split(': ' + type(exc).__name__ + ': ', 1)[0]}: {why}")
    if not (INPLACE in str(exc) and run.rewrote_at == run.steps):
        return failure
    return LoopError(
        f"{one_line(failure)} (under {algo.name} the run's step ended at the step of the optimiser run.setup() "
        f"returned, and the weights were rewritten in place there: a graph made before it and backpropagated "
        f"after it, a GAN's generator's through its discriminator's step, sees them changed; give every "
        f"optimiser of a step to run.setup(opt_d, opt_g): the step then ends once each has stepped)"
    )


def _in_a_functions_backward() -> bool:
    """Whether this thread runs inside a custom autograd Function's backward: a backward pass it
    started is reentrant (``torch.utils.checkpoint(..., use_reentrant=True)`` runs one for its
    segment), and its end is not the end of the user's ``loss.backward()``."""
    frame: types.FrameType | None = sys._getframe(1)
    while frame is not None:
        code = frame.f_code
        if code.co_name == "apply" and code.co_filename.endswith(_FUNCTION_PY):
            return True
        frame = frame.f_back
    return False


_FUNCTION_PY = os.path.join("torch", "autograd", "function.py")  # BackwardCFunction.apply: a Function's backward


def _say_nonfinite(model: nn.Module) -> None:
    """One warning where the model returned holds NaN or inf (training diverged: with a plain
    loss.backward() no progress line says so, and the run returns and saves it)."""
    bad = [name for name, p in model.named_parameters() if not bool(torch.isfinite(p.detach()).all())]
    if bad:
        log.warning(
            "the model returned has NaN or inf in %d of its parameters (%s): training diverged (a lower lr, "
            "clipping, or --precision fp32 may help), or the data holds NaN or inf",
            len(bad),
            ", ".join(bad[:3]) + (", ..." if len(bad) > 3 else ""),
        )


def _figure(name: str, value: Any) -> Any:
    """A figure ``run.log`` was given, as metrics.jsonl writes it: a one-element tensor's number,
    a numpy scalar's (``np.float32``: JSON has none), a number, a string, True/False or None;
    anything else is refused in one line (the launcher, writing it, failed with a traceback)."""
    if isinstance(value, torch.Tensor):
        return float(value.detach())
    if type(value).__module__ == "numpy" and hasattr(value, "item") and getattr(value, "ndim", None) == 0:
        value = value.item()
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise ConfigError(
        f"run.log({name}=...) takes a number, a string or a one-element tensor, not {type(value).__name__}"
    )


def _count(batch: Any) -> int:
    """The samples in a batch: the length of its first tensor (in a tuple, list or mapping: a dict,
    transformers' BatchEncoding, a UserDict)."""
    if isinstance(batch, torch.Tensor):
        return int(batch.shape[0]) if batch.dim() else 1
    if isinstance(batch, Mapping):
        for v in batch.values():
            n = _count(v)
            if n:
                return n
    if isinstance(batch, (tuple, list)):
        for v in batch:
            n = _count(v)
            if n:
                return n
    return 0


def _map_tensors(batch: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """``batch`` with ``fn`` applied to every tensor in it (tuples, lists, named tuples, dicts)."""
    if isinstance(batch, torch.Tensor):
        return fn(batch)
    if isinstance(batch, dict):
        return type(batch)({k: _map_tensors(v, fn) for k, v in batch.items()})
    if isinstance(batch, MutableMapping):  # a UserDict (transformers' BatchEncoding, what its collators return):
        mapped = copy.copy(batch)  # its other attributes kept (a fast tokenizer's encodings); counted as
        for k, v in batch.items():  # a batch of none and left on the CPU before
            mapped[k] = _map_tensors(v, fn)
        return mapped
    if isinstance(batch, Mapping):  # read-only (counted as _count counts it): a dict of it
        return {k: _map_tensors(v, fn) for k, v in batch.items()}
    if isinstance(batch, (tuple, list)):
        moved = [_map_tensors(v, fn) for v in batch]
        return type(batch)(moved) if not hasattr(batch, "_fields") else type(batch)(*moved)
    return batch


def _to(batch: Any, where: torch.device) -> Any:
    return _map_tensors(batch, lambda t: t.to(where, non_blocking=True))


__all__ = ["Run", "LoopState", "run_own_loop"]
