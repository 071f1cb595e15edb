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
  it may communicate); ``run.final_model()``: the model it returns (the last synchronisation).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

import torch
from torch import nn

from distsgd.config import threads_per_worker, value
from distsgd.data.partition import epoch_indices, mix_seed
from distsgd.errors import ConfigError
from distsgd.metrics import TrainClock
from distsgd.models import build_model
from distsgd.train import device
from distsgd.train.context import Start, Step, WorkerContext, WorkerResult
from distsgd.train.evaluate import eval_event
from distsgd.train.optim import schedule_lr

if TYPE_CHECKING:
    from distsgd.algorithms.base import Algorithm


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
            raise ConfigError("--augment and --loader-workers apply to distsgd's own loop: in your loop, give "
                              "run.loader() your transforms and num_workers")
        return self

    def to(self, device: torch.device) -> "OwnData":
        return self

    def share_memory_(self) -> "OwnData":
        return self

    def is_shared(self) -> bool:
        return False


class Run:
    """One worker's handle on the run: what ``main(run)`` is given (see the module's docstring)."""

    def __init__(self, ctx: WorkerContext, algo: "Algorithm") -> None:
        self._ctx, self._algo, self.cfg = ctx, algo, ctx.cfg
        self.rank, self.world, self.device = ctx.rank, ctx.world, ctx.device
        self.samples = 0  # this worker's samples, stepped on
        self.steps = 0
        self._batch_samples = 0  # samples of the batches yielded since the last step
        self._model: nn.Module | None = None
        self._optimizer: torch.optim.Optimizer | None = None
        self._returned: nn.Module | None = None
        self._evals: list[dict[str, Any]] = []
        self._clock = TrainClock(sync=device.synchronizer(ctx.device))
        self._train_wall_s: float | None = None
        self._loss_sum, self._loss_n = 0.0, 0
        self.scaler = torch.amp.GradScaler(ctx.device.type) if self.cfg.precision == "fp16" else None
        self.autocast = device.autocast(ctx.device, self.cfg.precision)
        self._warmup, self._clip = value(self.cfg, "lr_warmup_steps"), value(self.cfg, "clip_grad_norm")
        torch.set_num_threads(threads_per_worker(self.cfg))

    # -- setting up ------------------------------------------------------------------------------
    def setup(self, optimizer: Callable[[nn.Module], torch.optim.Optimizer] | str | None = None
              ) -> tuple[nn.Module, "Optimizer"]:
        """The model, joined to the algorithm, and its optimiser. ``optimizer``: a function
        ``optimizer(model) -> torch.optim.Optimizer``, or None for the run's settings (``--optimizer``,
        ``--lr``, ...; DiLoCo's inner optimiser)."""
        if self._model is not None:
            raise ConfigError("run.setup() was called twice: set up one model and one optimiser per run")
        ctx, cfg = self._ctx, self.cfg
        model = build_model(ctx.model_spec, (), 0, cfg.init, seed=cfg.seed).to(ctx.device)
        model.train()
        self._model = self._algo.setup(ctx, model, Start.FRESH)
        if cfg.compile:
            self._algo.unwrap(self._model).compile()
        if optimizer is not None and self._algo.topology.kind == "server":
            raise ConfigError(f"under {cfg.algo} the parameter server steps, with its own optimiser: give "
                              f"distsgd.spawn(optimizer=...) (or the run's --optimizer settings), not run.setup()")
        if isinstance(optimizer, str) or optimizer is None:
            if isinstance(optimizer, str):
                self.cfg = cfg = cfg.replace(optimizer=optimizer)
                self._algo.cfg = cfg
            inner = self._algo.make_optimizer(ctx, self._model)
        else:
            ctx.job = ctx.job.replace(optimizer=optimizer)
            inner = self._algo.make_optimizer(ctx, self._model)
        self._optimizer = inner
        torch.manual_seed(mix_seed(cfg.seed, 7919, ctx.rank))  # dropout differs between workers
        self._algo.before_training(ctx)
        self._clock.restart()
        return self._model, Optimizer(self, inner)

    # -- data ------------------------------------------------------------------------------------
    def loader(self, dataset: Any, batch_size: int | None = None, epoch: int = 0,
               collate_fn: Callable | None = None, num_workers: int = 0) -> Iterator[Any]:
        """This worker's batches of ``dataset`` (map-style: ``len`` and ``dataset[i]``) in ``epoch``:
        the indices ``distsgd train`` gives this worker (``--partition``, ``--seed``), ``batch_size``
        (default ``--batch-size``) at a time, collated by torch's DataLoader (tuples, dicts, ...)
        and moved to this worker's device. Ends early once the run must stop."""
        self._need_setup("run.loader()")
        from torch.utils.data import DataLoader

        size = batch_size or self.cfg.batch_size
        order = epoch_indices(len(dataset), epoch, self.rank, self.world, self.cfg.seed, self.cfg.partition)
        batches = [order[i:i + size].tolist() for i in range(0, len(order), size)]
        data = DataLoader(dataset, batch_sampler=batches, collate_fn=collate_fn, num_workers=num_workers)
        for batch in data:
            if self.should_stop():
                return
            self._batch_samples += _count(batch)
            yield _to(batch, self.device)

    def should_stop(self) -> bool:
        """True once the run must end: ``--max-samples`` reached (all workers'), or the algorithm
        says so (a Hogwild! stop, a parameter server gone)."""
        cfg = self.cfg
        if cfg.max_samples is not None and self._algo.global_samples(self._ctx, self.samples) >= cfg.max_samples:
            return True
        return not self._algo.keep_going(self._ctx)

    # -- a step ----------------------------------------------------------------------------------
    def backward(self, loss: torch.Tensor) -> None:
        """``loss.backward()``, scaled under ``--precision fp16``."""
        model = self._need_setup("run.backward()")
        (self.scaler.scale(loss) if self.scaler is not None else loss).backward()
        self._loss_sum += float(loss.detach())
        self._loss_n += 1
        del model

    def no_sync(self) -> contextlib.AbstractContextManager:
        """Around the backward passes of all but the last micro-batch of an accumulated step: the
        algorithm does not synchronise gradients there (DDP's no_sync)."""
        return self._algo.no_sync(self._ctx, self._need_setup("run.no_sync()"))

    def _step(self, inner: torch.optim.Optimizer) -> None:
        ctx, algo, cfg = self._ctx, self._algo, self.cfg
        model = self._need_setup("optimizer.step()")
        n = self._batch_samples
        if n == 0:
            raise ConfigError("optimizer.step() with no batch from run.loader() since the last step: take batches "
                              "from run.loader() so that the run counts its samples")
        if cfg.schedule != "constant" or self.steps < self._warmup:
            per_epoch = max(1, self._per_epoch())
            schedule_lr(inner, cfg, algo.global_samples(ctx, self.samples) / per_epoch,
                        cfg.epochs if cfg.max_samples is None else cfg.max_samples / per_epoch, self.steps + 1)
        step = Step(number=self.steps + 1, samples=self.samples + n)
        algo.after_backward(ctx, model, step)
        if self.scaler is not None:
            self.scaler.unscale_(inner)
        if self._clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), self._clip)
        stepper = device.ScaledOptimizer(inner, self.scaler) if self.scaler is not None else inner
        algo.apply_step(ctx, stepper, step)
        self.samples += n
        self.steps += 1
        self._batch_samples = 0
        algo.after_step(ctx, model, step)
        if ctx.reports and self.steps % cfg.log_every == 0:
            self._progress()

    def _per_epoch(self) -> int:
        return getattr(self._ctx.dataset, "n_train", 0) or 0

    # -- reporting -------------------------------------------------------------------------------
    def log(self, **figures: Any) -> None:
        """Report figures (numbers or 0-d tensors). ``test_accuracy`` and ``test_loss`` make an
        evaluation event (progress, metrics.jsonl, summary.json's evals and final figures);
        anything else a ``log`` event. Only the reporting worker's are written."""
        values = {k: float(v.detach()) if isinstance(v, torch.Tensor) else v for k, v in figures.items()}
        if not self._ctx.reports and not self._ctx.evaluates:
            return
        gs = self._algo.global_samples(self._ctx, self.samples)
        if "test_accuracy" in values or "test_loss" in values:
            self._clock.pause()
            event = eval_event(self._ctx.dataset, gs, 0.0, self._clock.elapsed(), values.get("test_accuracy"),
                               values.get("test_loss", math.nan))
            event.update({k: v for k, v in values.items() if k not in event})
            self._evals.append(event)
            self._ctx.sink.emit(event)
            self._clock.resume()
        else:
            self._ctx.sink.emit({"event": "log", "samples": gs, "rank": self.rank,
                                 "train_wall_s": self._clock.elapsed(), **values})

    def _progress(self) -> None:
        elapsed = self._clock.elapsed()
        gs = self._algo.global_samples(self._ctx, self.samples)
        loss = self._loss_sum / self._loss_n if self._loss_n else math.nan
        self._ctx.sink.emit({"event": "progress", "samples": gs, "epoch": 0.0, "rank": self.rank, "loss": loss,
                             "lr": self._optimizer.param_groups[0]["lr"] if self._optimizer else None,
                             "train_wall_s": elapsed, "samples_per_s": gs / elapsed if elapsed > 0 else 0.0,
                             **self._algo.progress_figures(self._ctx)})
        self._loss_sum, self._loss_n = 0.0, 0

    # -- the model -------------------------------------------------------------------------------
    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """The training clock stopped (your evaluation, your logging): not counted in samples/s."""
        self._clock.pause()
        try:
            yield
        finally:
            self._clock.resume()

    def evaluation_model(self) -> nn.Module:
        """The model the algorithm would return now (the average, theta, the shared model, the
        module inside a DDP wrapper). Every worker must call it at the same point: it may be a
        collective. Evaluate it in eval mode under ``run.paused()``; do not train it."""
        model = self._need_setup("run.evaluation_model()")
        with self.paused():
            return self._algo.evaluation_model(self._ctx, model)

    def final_model(self) -> nn.Module:
        """The model the algorithm returns, after its last synchronisation (every worker calls it,
        once, after its last step). Return it from ``main``: it is what distsgd saves."""
        if self._returned is not None:
            return self._returned
        model = self._need_setup("run.final_model()")
        self._returned = self._algo.finish(self._ctx, model)
        self._clock.pause()
        self._train_wall_s = self._clock.elapsed()
        self._algo.verify(self._ctx, self._returned)
        return self._returned

    def _need_setup(self, what: str) -> nn.Module:
        if self._model is None:
            raise ConfigError(f"{what} before run.setup(): call model, opt = run.setup(...) first")
        return self._model

    def result(self, returned: Any) -> WorkerResult:
        """What this worker tells the launcher once ``main`` returned ``returned``."""
        final = self.final_model()
        if returned is not None and returned is not final:
            unwrapped = self._algo.unwrap(self._model) if self._model is not None else None
            if returned is not unwrapped and returned is not self._model:
                raise ConfigError("main(run) returned a model that is not run.final_model(): return "
                                  "run.final_model() (or nothing)")
        gs = self._algo.global_samples(self._ctx, self.samples)
        last = self._evals[-1] if self._evals else None
        assert self._train_wall_s is not None
        return WorkerResult(rank=self.rank, samples=self.samples, global_samples=gs, train_wall_s=self._train_wall_s,
                            evals=self._evals, final_test_accuracy=last.get("test_accuracy") if last else None,
                            final_test_loss=last.get("test_loss") if last else None,
                            model=final if self._ctx.evaluates else None, figures=self._algo.figures(),
                            where=device.describe(self._ctx.device, self.cfg.precision))


class Optimizer:
    """The user's optimiser as the algorithm steps it: ``step()`` is the algorithm's whole step
    (gradient sync, clipping, the update, parameter sync); everything else is the optimiser's."""

    def __init__(self, run: Run, inner: torch.optim.Optimizer) -> None:
        self._run, self.optimizer = run, inner

    def step(self, closure: Any = None) -> None:
        if closure is not None:
            raise ConfigError("optimizer.step(closure) is not supported under distsgd: compute the loss, "
                              "run.backward(loss), then optimizer.step()")
        self._run._step(self.optimizer)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def __getattr__(self, name: str) -> Any:  # param_groups, state_dict, ...
        return getattr(self.optimizer, name)


def run_own_loop(ctx: WorkerContext, algo: "Algorithm") -> WorkerResult:
    """Call the user's ``main(run)`` in this worker and return what it measured."""
    run = Run(ctx, algo)
    returned = ctx.job.main(run)  # type: ignore[misc]
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


__all__ = ["Run", "Optimizer", "run_own_loop"]
