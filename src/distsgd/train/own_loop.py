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
import logging
import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

import torch
from torch import nn

from distsgd.checkpoint import Checkpointer, RngState, Stateful, count, evaluations, load_model_state, scatter, seconds
from distsgd.config import Periodic, threads_per_worker
from distsgd.data.partition import epoch_indices, mix_seed, shard_size
from distsgd.errors import ConfigError
from distsgd.metrics import TrainClock
from distsgd.metrics import reached as target_reached
from distsgd.models import build_model
from distsgd.train import device
from distsgd.train.context import Start, Step, WorkerContext, WorkerResult
from distsgd.train.evaluate import eval_event
from distsgd.train.optim import schedule_lr

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
        self.start = 0  # where the next batch begins in this epoch's order
        self.local = 0  # this worker's samples
        self.steps = 0
        self.seq = 0  # checkpoints written
        self.train_wall_s = 0.0
        self.evals: list[dict[str, Any]] = []
        self.evals_at, self.checkpoints_at = Periodic(eval_every), Periodic(checkpoint_every)

    _COUNTERS = ("epoch", "start", "local", "steps", "seq", "train_wall_s", "evals")
    _WHOLE = ("epoch", "start", "local", "steps", "seq")  # of the counters, those that count (>= 0)

    def state_dict(self) -> dict[str, Any]:
        return {
            **{k: getattr(self, k) for k in self._COUNTERS},
            "evals_at": self.evals_at.state_dict(),
            "checkpoints_at": self.checkpoints_at.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for k in self._WHOLE:
            setattr(self, k, count(state, k))
        self.train_wall_s = seconds(state, "train_wall_s")
        self.evals = evaluations(state, "evals")
        self.evals_at.load_state_dict(state["evals_at"])
        self.checkpoints_at.load_state_dict(state["checkpoints_at"])


class Run:
    """One worker's handle on the run: what ``main(run)`` is given (see the module's docstring).
    distsgd's own loop (:mod:`distsgd.train.loop`) drives the same object, so each algorithm's
    step, setup and ending are defined here once for both."""

    def __init__(self, ctx: WorkerContext, algo: "Algorithm", replacement: bool = False) -> None:
        self._ctx, self._algo, self.cfg = ctx, algo, ctx.cfg
        self._replacement = replacement  # in place of a worker that died (--restart-workers)
        self.rank, self.world, self.device = ctx.rank, ctx.world, ctx.device
        self.state = LoopState()  # the counters (distsgd's loop gives its own, with its periods)
        self._user = _UserState()  # a user's loop's own state, in its checkpoints
        self.resumed: dict[str, Any] | None = None  # that state, in a run resumed from a checkpoint
        self._checkpointer: Checkpointer | None = None
        self._skip = 0  # samples of the resumed epoch trained before its checkpoint
        self._first_epoch = 0  # epochs before this one were trained before a resume or a replacement
        self._rejoined: int | None = None  # a replacement: the samples its rank had trained
        self._batch_samples = 0  # samples of the batches yielded since the last step
        self._model: nn.Module | None = None
        self._optimizer: torch.optim.Optimizer | None = None
        self._stepper: Any = None
        self._returned: nn.Module | None = None
        self._stopped = False  # --stop-at-target: a figure run.log was given reached the target
        self.clock = TrainClock(sync=device.synchronizer(ctx.device))  # waits for the GPU before a reading
        self._train_wall_s: float | None = None
        self._loss_sum, self._loss_n = torch.zeros((), device=ctx.device), 0
        self._nonfinite = (0, 0, 0)  # reports of a nan or inf loss: how many, the first's and last's samples
        self.scaler = torch.amp.GradScaler(ctx.device.type) if self.cfg.precision == "fp16" else None
        self.autocast = device.autocast(ctx.device, self.cfg.precision)
        warmup, clip = self.cfg.lr_warmup_steps, self.cfg.clip_grad_norm
        assert warmup is not None and clip is not None, "a settled configuration"
        self._warmup, self._clip = warmup, clip
        n = getattr(ctx.dataset, "n_train", 0) or 0
        self.per_epoch = shard_size(n, ctx.world, self.cfg.partition)  # this worker's samples an epoch (0: unknown)
        self.global_per_epoch = self.per_epoch * ctx.world
        cfg = self.cfg
        self.total_epochs = (
            cfg.epochs
            if cfg.max_samples is None or not self.global_per_epoch
            else cfg.max_samples / self.global_per_epoch
        )
        torch.set_num_threads(threads_per_worker(self.cfg))

    # -- setting up ------------------------------------------------------------------------------
    def setup(
        self, optimizer: Callable[[nn.Module], torch.optim.Optimizer] | str | None = None
    ) -> tuple[nn.Module, "Optimizer"]:
        """The model, joined to the algorithm, and its optimiser. ``optimizer``: a function
        ``optimizer(model) -> torch.optim.Optimizer``, or None for the run's settings (``--optimizer``,
        ``--lr``, ...; DiLoCo's inner optimiser; ``distsgd.spawn(optimizer=...)``)."""
        if self._model is not None:
            raise ConfigError("run.setup() was called twice: set up one model and one optimiser per run")
        if optimizer is not None and self._algo.topology.kind == "server":
            raise ConfigError(
                f"under {self.cfg.algo} the parameter server steps, with its own optimiser: give "
                f"distsgd.spawn(optimizer=...) (or the run's --optimizer settings), not run.setup()"
            )
        if isinstance(optimizer, str):
            self.cfg = self._algo.cfg = self.cfg.replace(optimizer=optimizer)
        elif optimizer is not None:
            self._ctx.job = self._ctx.job.replace(optimizer=optimizer)
        ctx, cfg = self._ctx, self.cfg
        self._checkpointer = Checkpointer(cfg.out, cfg.resume, ctx.rank, ctx.world)
        saved = self._checkpointer.load()
        # as in distsgd's loop: a replacement (or, resumed, a rank with no part in the checkpoint)
        # rejoins the running model and goes on from the samples its rank had trained
        start = (
            Start.REPLACEMENT
            if self._replacement or (cfg.resume and saved is None)
            else Start.RESUMED
            if saved is not None
            else Start.FRESH
        )
        model = self.build(saved["model"] if saved is not None else None, start)
        if saved is not None:
            scatter({k: v for k, v in self.pieces().items() if k != "model"}, saved)
        if start is Start.RESUMED:
            self.resumed = self._user.value
            self._skip, self._first_epoch = self.state.start, self.state.epoch
        elif start is Start.REPLACEMENT:
            self.state.local = self._rejoined = self._algo.starting_samples(ctx)
        self.begin(self.state.train_wall_s)
        return model, Optimizer(self, self.optimizer)

    def pieces(self) -> dict[str, Stateful]:
        """What a checkpoint holds of this worker: the model, the optimiser, the algorithm's state,
        the counters, the random state, --precision's scaler and (a user's loop) its own state."""
        pieces: dict[str, Stateful] = {
            "model": self._algo.unwrap(self._need_setup("run.checkpoint()")),
            "optimizer": self.optimizer,
            "algo": self._algo,
            "loop": self.state,
            "rng": RngState(),
        }
        if self.scaler is not None:
            pieces["scaler"] = self.scaler
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
        cfg, st = self.cfg, self.state
        if not cfg.out:
            raise ConfigError("run.checkpoint() needs out= (the run directory it saves into)")
        checkpointer = self._checkpointer
        assert checkpointer is not None  # setup made it, with the model
        with self.paused():
            st.seq += 1
            st.train_wall_s = self.clock.elapsed()
            self._user.value = state
            checkpointer.save(st.seq, self.pieces())
            where = {"samples": self.global_samples(), "epoch": st.epoch}
            seq = st.seq

            def commit() -> None:
                checkpointer.commit(seq, {**where, "algo": cfg.algo})
                self._ctx.sink.emit({"event": "checkpoint", "seq": seq, **where, "train_wall_s": st.train_wall_s})

            self._algo.checkpoint_saved(self._ctx, seq, commit)

    def build(self, saved: dict[str, torch.Tensor] | None = None, start: Start = Start.FRESH) -> nn.Module:
        """The model on this worker's device (the same weights in every replica: one seed; ``saved``:
        a checkpoint's), the algorithm's setup, --compile, the optimiser and --precision's pieces."""
        ctx, cfg, algo = self._ctx, self.cfg, self._algo
        ds = ctx.dataset
        model = build_model(ctx.model_spec, ds.input_shape, ds.num_classes, cfg.init, seed=cfg.seed).to(ctx.device)
        model.train()
        if saved is not None:
            load_model_state(model, saved)
        self._model = algo.setup(ctx, model, start)
        if cfg.compile:
            algo.unwrap(self._model).compile()  # in place: the module, its state and its wrappers stay
        self._optimizer = algo.make_optimizer(ctx, self._model)
        self._stepper = device.ScaledOptimizer(self._optimizer, self.scaler) if self.scaler else self._optimizer
        torch.manual_seed(mix_seed(cfg.seed, 7919, ctx.rank))  # dropout differs between workers
        return self._model

    def begin(self, earlier_s: float = 0.0) -> None:
        """Training starts: every worker together (the algorithm's barrier), the clock from here
        (plus ``earlier_s`` of a resumed run)."""
        self._algo.before_training(self._ctx)
        self.clock.restart()
        self.clock.add(earlier_s)

    @property
    def samples(self) -> int:
        """This worker's samples so far (stepped on)."""
        return self.state.local

    @property
    def steps(self) -> int:
        return self.state.steps

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
        epoch: int = 0,
        collate_fn: Callable | None = None,
        num_workers: int = 0,
    ) -> "_Shard":
        """This worker's batches of ``dataset`` (map-style: ``len`` and ``dataset[i]``) in ``epoch``:
        the indices ``distsgd train`` gives this worker (``--partition``, ``--seed``), ``batch_size``
        (default ``--batch-size``) at a time, collated by torch's DataLoader (tuples, dicts, ...)
        and moved to this worker's device. Ends early once the run must stop. ``len()`` is its
        number of batches. It is for the training data (it counts the samples each step takes):
        evaluate with a DataLoader of your own. In a resumed run (or a worker that replaced a dead
        one) it goes on where the run was: an epoch trained before is empty, the one it stopped in
        goes on from there."""
        self._need_setup("run.loader()")
        from torch.utils.data import DataLoader, TensorDataset

        size = batch_size or self.cfg.batch_size
        st = self.state
        if self._rejoined is not None:  # a replacement: its rank's samples so far, in its own shard
            per_epoch = shard_size(len(dataset), self.world, self.cfg.partition)
            st.epoch, st.start = divmod(self._rejoined, per_epoch) if per_epoch else (0, 0)
            self._skip, self._first_epoch, self._rejoined = st.start, st.epoch, None
        if epoch < self._first_epoch:
            return _Shard(self, [])
        skip = self._skip if epoch == st.epoch else 0  # a resumed run goes on inside the epoch it stopped in
        self._skip = 0
        if epoch != st.epoch:
            st.epoch, st.start = epoch, 0
        order = epoch_indices(len(dataset), epoch, self.rank, self.world, self.cfg.seed, self.cfg.partition)[skip:]
        if isinstance(dataset, TensorDataset) and collate_fn is None and not num_workers:
            # tensors in memory: index them a batch at a time, as distsgd's loop does (a DataLoader
            # fetches and stacks sample by sample)
            return _Shard(self, _TensorBatches(dataset.tensors, order, size))
        batches = [order[i : i + size].tolist() for i in range(0, len(order), size)]
        return _Shard(self, DataLoader(dataset, batch_sampler=batches, collate_fn=collate_fn, num_workers=num_workers))

    def count(self, samples: int) -> None:
        """Count ``samples`` for the next step (``run.loader`` does it for its batches; call it for
        batches from a loader of your own)."""
        self._batch_samples += samples

    def global_samples(self) -> int:
        """All workers' samples so far, as this worker knows them."""
        return self._algo.global_samples(self._ctx, self.samples)

    def should_stop(self) -> bool:
        """True once the run must end: ``--max-samples`` reached (all workers'), a figure given to
        ``run.log`` reached ``--stop-at-target``'s target, or the algorithm says so (a Hogwild!
        stop, a parameter server gone)."""
        cfg = self.cfg
        if self._stopped or cfg.max_samples is not None and self.global_samples() >= cfg.max_samples:
            return True
        return not self._algo.keep_going(self._ctx)

    # -- a step ----------------------------------------------------------------------------------
    def backward(self, loss: torch.Tensor, weight: float = 1.0) -> None:
        """``(loss * weight).backward()``, scaled under ``--precision fp16``; ``loss`` (unweighted)
        counts in the progress lines' mean loss."""
        self._need_setup("run.backward()")
        weighted = loss * weight if weight != 1.0 else loss
        (self.scaler.scale(weighted) if self.scaler is not None else weighted).backward()
        self._loss_sum += loss.detach().float()
        self._loss_n += 1

    def no_sync(self) -> contextlib.AbstractContextManager:
        """Around the backward passes of all but the last micro-batch of an accumulated step: the
        algorithm does not synchronise gradients there (DDP's no_sync)."""
        return self._algo.no_sync(self._ctx, self._need_setup("run.no_sync()"))

    def step(self) -> None:
        """The algorithm's whole step on the gradients accumulated since the last: the learning
        rate's schedule and warm-up, the gradient sync, --precision's unscaling, clipping, the
        update, the parameter sync; then the counters (the samples ``count``ed since the last)."""
        ctx, algo, cfg = self._ctx, self._algo, self.cfg
        model = self._need_setup("optimizer.step()")
        n = self._batch_samples
        if n == 0:
            raise ConfigError(
                "optimizer.step() with no batch from run.loader() since the last step: take batches "
                "from run.loader() (or run.count(len(batch))) so that the run counts its samples"
            )
        if cfg.schedule != "constant" or self.steps < self._warmup:
            # the run's progress (all workers'), not this worker's; the warm-up by this worker's own steps
            progress = self.global_samples() / self.global_per_epoch if self.global_per_epoch else 0.0
            schedule_lr(self.optimizer, cfg, progress, self.total_epochs, self.steps + 1)
        step = Step(number=self.steps + 1, samples=self.samples + n)
        algo.after_backward(ctx, model, step)
        if self.scaler is not None:  # once the gradients are synchronised: every worker finds the same overflow
            self.scaler.unscale_(self.optimizer)
        if self._clip:  # the synchronised gradient (every replica clips alike), before the update
            torch.nn.utils.clip_grad_norm_(model.parameters(), self._clip)
        algo.apply_step(ctx, self._stepper, step)
        self.state.local += n
        self.state.start += n
        self.state.steps += 1
        self._batch_samples = 0
        algo.after_step(ctx, model, step)
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
        values = {k: float(v.detach()) if isinstance(v, torch.Tensor) else v for k, v in figures.items()}
        ctx, cfg = self._ctx, self.cfg
        writes = ctx.reports or ctx.evaluates
        if "test_accuracy" in values or "test_loss" in values:
            reached = False
            with self.paused():
                if writes:
                    event = eval_event(
                        ctx.dataset,
                        self.global_samples(),
                        self.epoch(),
                        self.clock.elapsed(),
                        values.get("test_accuracy"),
                        values.get("test_loss"),
                    )
                    event.update({k: v for k, v in values.items() if k not in event})
                    self.record(event)
                    reached = target_reached(event, cfg.target_accuracy, cfg.target_loss)
                # every worker of a process group gets here (the reporting one decides); a Hogwild!
                # worker that reached it stops the others
                if cfg.stop_at_target and self._algo.agree(ctx, reached):
                    self._stopped = True
        elif writes:
            ctx.sink.emit(
                {
                    "event": "log",
                    "samples": self.global_samples(),
                    "rank": self.rank,
                    "train_wall_s": self.clock.elapsed(),
                    **values,
                }
            )

    def record(self, event: dict[str, Any]) -> None:
        """An evaluation: kept for the summary and emitted."""
        self.state.evals.append(event)
        self._ctx.sink.emit(event)

    def epoch(self) -> float:
        return round(self.samples / self.per_epoch, 4) if self.per_epoch else 0.0

    def _progress(self) -> None:
        elapsed = self.clock.elapsed()
        samples = self.global_samples()
        mean_loss = float(self._loss_sum) / self._loss_n if self._loss_n else math.nan
        if not math.isfinite(mean_loss):  # said once, and how often at the end: a diverged run says it every report
            count, first, _ = self._nonfinite
            if not count:
                log.warning("training loss is %s at %d samples: lower --lr?", mean_loss, samples)
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
                **({"loss_scale": self.scaler.get_scale()} if self.scaler is not None else {}),
                **self._algo.progress_figures(self._ctx),
            }
        )
        self._loss_sum.zero_()
        self._loss_n = 0

    # -- the model -------------------------------------------------------------------------------
    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """The training clock stopped (your evaluation, your logging): not counted in samples/s."""
        was_running = self.clock.running
        self.clock.pause()
        try:
            yield
        finally:
            if was_running:
                self.clock.resume()

    def evaluation_model(self) -> nn.Module:
        """The model the algorithm would return now (the average, theta, the shared model, the
        module inside a DDP wrapper). Every worker must call it at the same point: it may be a
        collective. Evaluate it in eval mode under ``run.paused()``; do not train it."""
        model = self._need_setup("run.evaluation_model()")
        with self.paused():
            return self._algo.evaluation_model(self._ctx, model)

    def final_model(self) -> nn.Module:
        """The model the algorithm returns, after its last synchronisation (every worker calls it,
        once, after its last step). Return it from ``main``: it is what distsgd saves. The
        training clock stops here; the algorithm's checks of that model run after it."""
        if self._returned is not None:
            return self._returned
        model = self._need_setup("run.final_model()")
        if self.steps == 0 and self._batch_samples > 0:
            raise ConfigError(
                "batches were taken but the optimiser run.setup() returned never stepped: call its "
                "step(), not another optimiser's (the algorithm acts in it)"
            )
        self._returned = self._algo.finish(self._ctx, model)
        self.clock.pause()
        self._train_wall_s = self.clock.elapsed()
        self._algo.verify(self._ctx, self._returned)
        if self._nonfinite[0] > 1:
            log.warning("training loss was nan or inf in %d progress reports, from %d to %d samples", *self._nonfinite)
        return self._returned

    @property
    def train_wall_s(self) -> float:
        """Training time: up to the final model once it is made, else so far."""
        return self._train_wall_s if self._train_wall_s is not None else self.clock.elapsed()

    def _need_setup(self, what: str) -> nn.Module:
        if self._model is None:
            raise ConfigError(f"{what} before run.setup(): call model, opt = run.setup(...) first")
        return self._model

    def result(self, returned: Any = None) -> WorkerResult:
        """What this worker tells the launcher once ``main`` returned ``returned``."""
        final = self.final_model()
        if returned is not None and returned is not final:
            unwrapped = self._algo.unwrap(self._model) if self._model is not None else None
            if returned is not unwrapped and returned is not self._model:
                raise ConfigError(
                    "main(run) returned a model that is not run.final_model(): return run.final_model() (or nothing)"
                )
        evals = self.state.evals
        last = evals[-1] if evals else None
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
            where=device.describe(self._ctx.device, self.cfg.precision),
        )


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


class _Shard:
    """A worker's batches of one epoch (``run.loader``): counted, on its device, stopped when due."""

    def __init__(self, run: Run, data: Any) -> None:
        self.run, self.data = run, data

    def __len__(self) -> int:
        return len(self.data)

    def __iter__(self) -> Iterator[Any]:
        run = self.run
        for batch in self.data:
            if run.should_stop():
                return
            run.count(_count(batch))
            yield _to(batch, run.device)


class Optimizer:
    """The user's optimiser as the algorithm steps it: ``step()`` is the algorithm's whole step
    (gradient sync, clipping, the update, parameter sync); everything else is the optimiser's."""

    def __init__(self, run: Run, inner: torch.optim.Optimizer) -> None:
        self._run, self.optimizer = run, inner

    def step(self, closure: Callable[[], object] | None = None) -> None:
        if closure is not None:
            raise ConfigError(
                "optimizer.step(closure) is not supported under distsgd: compute the loss, "
                "run.backward(loss), then optimizer.step()"
            )
        self._run.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def __getattr__(self, name: str) -> Any:  # param_groups, state_dict, ...
        return getattr(self.optimizer, name)


def run_own_loop(ctx: WorkerContext, algo: "Algorithm", replacement: bool = False) -> WorkerResult:
    """Call the user's ``main(run)`` in this worker (``replacement``: in place of one that died)
    and return what it measured."""
    run = Run(ctx, algo, replacement)
    main = ctx.job.main
    assert main is not None, "run_worker calls this for a user's loop only"
    returned = main(run)
    if run._model is None:
        raise ConfigError("main(run) never called run.setup(): distsgd had no model to train")
    return run.result(returned)


def _count(batch: Any) -> int:
    """The samples in a batch: the length of its first tensor (in a tuple, list or dict)."""
    if isinstance(batch, torch.Tensor):
        return int(batch.shape[0]) if batch.dim() else 1
    if isinstance(batch, dict):
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


def _to(batch: Any, where: torch.device) -> Any:
    if isinstance(batch, torch.Tensor):
        return batch.to(where, non_blocking=True)
    if isinstance(batch, dict):
        return type(batch)({k: _to(v, where) for k, v in batch.items()})
    if isinstance(batch, (tuple, list)):
        moved = [_to(v, where) for v in batch]
        return type(batch)(moved) if not hasattr(batch, "_fields") else type(batch)(*moved)
    return batch


__all__ = ["Run", "Optimizer", "LoopState", "run_own_loop"]
