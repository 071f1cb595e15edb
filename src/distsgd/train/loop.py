"""The one training loop every algorithm runs in each of its workers.

Per step: the next batch of this worker's shard, forward, loss, backward, ``algo.after_backward``
(gradient sync), ``algo.apply_step`` (the update), ``algo.after_step`` (parameter sync). The
reporting worker emits progress. At every evaluation point every worker asks the algorithm for
the model it would return now (``evaluation_model``: the average, the centre, ...) and the
evaluating worker measures it with the training clock paused. A checkpoint saves the stateful
pieces (model, optimiser, algorithm, loop counters, random state) through one Checkpointer.
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch

from distsgd.checkpoint import Checkpointer, RngState, scatter
from distsgd.config import eval_period, threads_per_worker, value
from distsgd.data.partition import mix_seed, epoch_indices, shard_size
from distsgd.errors import ConfigError
from distsgd.metrics import TrainClock
from distsgd.metrics import reached as target_reached
from distsgd.models import build_model
from distsgd.train import device
from distsgd.train.context import Every, Start, Step, WorkerContext, WorkerResult
from distsgd.train.evaluate import equal_states, eval_event, evaluate, snapshot
from distsgd.train.objective import loss_function
from distsgd.train.optim import schedule_lr

if TYPE_CHECKING:
    from distsgd.algorithms.base import Algorithm

log = logging.getLogger(__name__)

Batch = tuple[torch.Tensor, torch.Tensor]


def run_worker(ctx: WorkerContext, algo: "Algorithm", replacement: bool = False) -> WorkerResult:
    """Train this worker's share of the run and return what it measured. ``replacement``: it
    takes the place of a worker that died (its launcher started it again). A run whose loop is the
    user's (``distsgd.spawn``) calls their ``main(run)`` instead."""
    if ctx.job.main is not None:
        from distsgd.train.own_loop import run_own_loop

        return run_own_loop(ctx, algo)
    w = _Worker(ctx, algo, replacement)  # model, optimiser, counters; restored from --resume
    algo.before_training(ctx)
    w.clock.restart()
    w.clock.add(w.state.train_wall_s)
    stop = False
    while not stop and w.more_epochs():
        batches = ctx.dataset.batches(w.epoch_order(), w.state.start, ctx.cfg.batch_size)
        for micro in _groups(batches, ctx.cfg.accumulate):
            if w.out_of_samples() or not algo.keep_going(ctx):
                stop = True
                break
            w.step(micro)
            if w.state.evals_at.due(w.gs) and w.evaluate():
                stop = True
                break
            if w.state.checkpoints_at.due(w.gs):
                w.checkpoint()
        if stop:
            break
        w.end_epoch()
        if w.eval_every is None and not w.out_of_samples():
            stop = w.evaluate()
        if w.checkpoint_each_epoch:
            w.checkpoint()
    return w.finish()


def _groups(batches: Iterator[Batch], k: int) -> Iterator[list[Batch]]:
    """The micro-batches of each step: ``k`` at a time (the epoch's last step may have fewer)."""
    group: list[Batch] = []
    for batch in batches:
        group.append(batch)
        if len(group) == k:
            yield group
            group = []
    if group:
        yield group


class LoopState:
    """A worker's counters: what a checkpoint keeps of the loop."""

    def __init__(self, eval_every: int | None, checkpoint_every: int | None) -> None:
        self.epoch = 0
        self.start = 0  # where the next batch begins in this epoch's order
        self.local = 0  # this worker's samples
        self.steps = 0
        self.seq = 0  # checkpoints written
        self.train_wall_s = 0.0
        self.evals: list[dict[str, Any]] = []
        self.evals_at, self.checkpoints_at = Every(eval_every), Every(checkpoint_every)

    _COUNTERS = ("epoch", "start", "local", "steps", "seq", "train_wall_s", "evals")

    def state_dict(self) -> dict[str, Any]:
        return {**{k: getattr(self, k) for k in self._COUNTERS}, "evals_at": self.evals_at.state_dict(),
                "checkpoints_at": self.checkpoints_at.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for k in self._COUNTERS:
            setattr(self, k, state[k])
        self.evals_at.load_state_dict(state["evals_at"])
        self.checkpoints_at.load_state_dict(state["checkpoints_at"])


class _Worker:
    """One worker's run: its model, optimiser and counters, and the loop's steps."""

    def __init__(self, ctx: WorkerContext, algo: "Algorithm", replacement: bool = False) -> None:
        ctx.job = ctx.job.replace(data=ctx.job.data.to(ctx.device))  # the data on this worker's device, once
        cfg, ds = ctx.cfg, ctx.dataset
        self.ctx, self.algo, self.cfg = ctx, algo, cfg
        torch.set_num_threads(threads_per_worker(cfg))
        self.per_epoch = shard_size(ds.n_train, ctx.world, cfg.partition)
        if self.per_epoch == 0:
            raise ConfigError(f"{ds.n_train} training samples cannot be shared among {ctx.world} workers")
        self.loss_fn = loss_function(cfg.loss, ctx.job.loss, ds.task)
        self.global_per_epoch = self.per_epoch * ctx.world
        self.total_epochs = cfg.epochs if cfg.max_samples is None else cfg.max_samples / self.global_per_epoch
        period = cfg.checkpoint_period
        self.checkpoint_each_epoch = period is not None and period.each_epoch
        self.eval_every = eval_period(cfg, self.global_per_epoch)  # None: at each epoch's end
        self.state = LoopState(self.eval_every, period.count if period is not None else None)
        self.checkpointer = Checkpointer(cfg.out, cfg.resume, ctx.rank, ctx.world)
        saved = self.checkpointer.load()
        # a worker its launcher started again rejoins the running model (what it saved, if it did, is
        # loaded below but the running model is newer); so does, in a resumed asynchronous run, a rank
        # that had no part in the checkpoint (its worker had died); the others resume from their part
        start = Start.REPLACEMENT if replacement or (cfg.resume and saved is None) else \
            Start.RESUMED if saved is not None else Start.FRESH
        self._build(saved, start)
        if saved is not None:
            scatter({k: v for k, v in self.pieces.items() if k != "model"}, saved)
        if start is Start.REPLACEMENT:  # carry on from the samples this rank had trained, in its own shard
            st = self.state
            st.local = algo.starting_samples(ctx)
            st.epoch, st.start = divmod(st.local, self.per_epoch)
        straggler = cfg.straggler_spec  # a simulated straggler sleeps (factor - 1) x its own step time
        self.slowdown = straggler.factor - 1 if straggler is not None and straggler.rank == ctx.rank else 0.0
        self.clock = TrainClock(sync=device.synchronizer(ctx.device))  # it waits for the GPU before a reading
        self.evaluated: dict[str, torch.Tensor] | None = None  # the state of the model last evaluated
        self.loss_sum, self.loss_steps = torch.zeros((), device=ctx.device), 0
        self.warmup, self.clip = value(cfg, "lr_warmup_steps"), value(cfg, "clip_grad_norm")
        self.gs = algo.global_samples(ctx, self.state.local)  # all workers' samples, read once a step

    def _build(self, saved: dict[str, Any] | None, start: Start) -> None:
        """The model on this worker's device (the same weights in every replica: one seed), the
        algorithm's setup, the optimiser, --compile and --precision's pieces, what a checkpoint holds."""
        ctx, algo, cfg, ds = self.ctx, self.algo, self.cfg, self.ctx.dataset
        model = build_model(ctx.model_spec, ds.input_shape, ds.num_classes, cfg.init, seed=cfg.seed).to(ctx.device)
        model.train()
        if saved is not None:
            model.load_state_dict(saved["model"])
        self.model = algo.setup(ctx, model, start)
        if cfg.compile:
            algo.unwrap(self.model).compile()  # in place: the module, its state and its wrappers stay
        self.optimizer = algo.make_optimizer(ctx, self.model)
        self.autocast = device.autocast(ctx.device, cfg.precision)
        self.scaler = torch.amp.GradScaler(ctx.device.type) if cfg.precision == "fp16" else None
        self.stepper = device.ScaledOptimizer(self.optimizer, self.scaler) if self.scaler else self.optimizer
        torch.manual_seed(mix_seed(cfg.seed, 7919, ctx.rank))  # dropout differs between workers
        self.pieces = {"model": algo.unwrap(self.model), "optimizer": self.optimizer, "algo": algo,
                       "loop": self.state, "rng": RngState()}
        if self.scaler is not None:
            self.pieces["scaler"] = self.scaler

    def more_epochs(self) -> bool:
        return self.cfg.max_samples is not None or self.state.epoch < self.cfg.epochs

    def out_of_samples(self) -> bool:
        return self.cfg.max_samples is not None and self.gs >= self.cfg.max_samples

    def epoch_order(self) -> torch.Tensor:
        ctx, cfg = self.ctx, self.cfg
        return epoch_indices(ctx.dataset.n_train, self.state.epoch, ctx.rank, ctx.world, cfg.seed, cfg.partition)

    def step(self, micro: list[Batch]) -> None:
        """One update from ``micro`` (``--accumulate`` micro-batches): each one's loss is weighted
        by its share of the step's samples, so the gradient is the mean over all of them, and the
        algorithm synchronises only after the last one."""
        ctx, algo, st = self.ctx, self.algo, self.state
        started = time.perf_counter()
        if self.cfg.schedule != "constant" or st.steps < self.warmup:
            # the run's progress (all workers'), not this worker's; the warm-up by this worker's own steps
            schedule_lr(self.optimizer, self.cfg, self.gs / self.global_per_epoch, self.total_epochs, st.steps + 1)
        self.optimizer.zero_grad(set_to_none=True)
        n = sum(len(y) for _, y in micro)
        for i, (x, y) in enumerate(micro):
            with algo.no_sync(ctx, self.model) if i < len(micro) - 1 else contextlib.nullcontext():
                with self.autocast:
                    loss = self.loss_fn(self.model(x), y)
                weighted = loss * (len(y) / n) if len(micro) > 1 else loss
                (self.scaler.scale(weighted) if self.scaler else weighted).backward()
            self.loss_sum += loss.detach().float()
        step = Step(number=st.steps + 1, samples=st.local + n)
        algo.after_backward(ctx, self.model, step)
        if self.scaler is not None:  # once the gradients are synchronised: every worker finds the same overflow
            self.scaler.unscale_(self.optimizer)
        if self.clip:  # the synchronised gradient (every replica clips alike), before the update
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.clip)
        algo.apply_step(ctx, self.stepper, step)
        st.local += n
        st.start += n
        st.steps += 1
        algo.after_step(ctx, self.model, step)
        if self.slowdown:
            time.sleep(self.slowdown * (time.perf_counter() - started))
        self.gs = algo.global_samples(ctx, st.local)
        self.loss_steps += len(micro)
        if ctx.reports and st.steps % self.cfg.log_every == 0:
            self._progress()

    def _progress(self) -> None:
        elapsed = self.clock.elapsed()
        mean_loss = float(self.loss_sum) / self.loss_steps
        if not math.isfinite(mean_loss):
            log.warning("training loss is %s at %d samples: lower --lr?", mean_loss, self.gs)
        self.ctx.sink.emit({"event": "progress", "samples": self.gs, "epoch": round(self.state.local / self.per_epoch, 4),
                            "rank": self.ctx.rank, "loss": mean_loss, "lr": self.optimizer.param_groups[0]["lr"],
                            "train_wall_s": elapsed, "samples_per_s": self.gs / elapsed if elapsed > 0 else 0.0,
                            **self.algo.progress_figures(self.ctx)})
        self.loss_sum.zero_()
        self.loss_steps = 0

    def evaluate(self) -> bool:
        """Measure the model the algorithm would return now (clock paused); True: every worker stops."""
        cfg = self.cfg
        self.clock.pause()
        returned = self.algo.evaluation_model(self.ctx, self.model)  # on every worker: may be a collective
        reached = False
        if self.ctx.evaluates:
            event = self.measure(returned)
            reached = target_reached(event, cfg.target_accuracy, cfg.target_loss)
        self.clock.resume()
        return self.algo.agree(self.ctx, reached) if cfg.stop_at_target else False

    def measure(self, model: torch.nn.Module) -> dict[str, Any]:
        """Evaluate ``model`` (this worker evaluates), record the event and what was evaluated."""
        st = self.state
        acc, loss = evaluate(model, self.ctx.dataset, self.cfg.eval_batch_size, self.loss_fn)
        event = eval_event(self.ctx.dataset, self.gs, round(st.local / self.per_epoch, 4), self.clock.elapsed(), acc,
                           loss)
        st.evals.append(event)
        self.ctx.sink.emit(event)
        self.evaluated = snapshot(model)
        return event

    def checkpoint(self) -> None:
        """Every worker writes its pieces; once all have, the manifest points at the new set.
        A checkpoint's number is the one of the point it is taken at (the k-th multiple of
        --checkpoint-every samples, or the epoch), so workers that are not in lockstep agree."""
        st = self.state
        self.clock.pause()
        period = self.cfg.checkpoint_period
        st.seq = st.epoch if period is None or period.each_epoch else self.gs // period.count
        st.train_wall_s = self.clock.elapsed()
        self.checkpointer.save(st.seq, self.pieces)
        where = {"samples": self.gs, "epoch": st.epoch}

        def commit() -> None:
            self.checkpointer.commit(st.seq, {**where, "algo": self.cfg.algo})
            self.ctx.sink.emit({"event": "checkpoint", "seq": st.seq, **where, "train_wall_s": st.train_wall_s})

        self.algo.checkpoint_saved(self.ctx, st.seq, commit)
        self.clock.resume()

    def end_epoch(self) -> None:
        self.algo.on_epoch_end(self.ctx, self.model, self.state.epoch)
        self.state.epoch += 1
        self.state.start = 0
        self.gs = self.algo.global_samples(self.ctx, self.state.local)

    def finish(self) -> WorkerResult:
        """The model the algorithm returns, evaluated, unless the last evaluation was of exactly
        this model (the same values in every parameter and buffer): the final figures always
        describe the model returned and saved, whatever the algorithm did at its end (a last
        outer step, a last compressed average), and nothing changes that model afterwards. The
        training clock stops once the algorithm has made that model (its last synchronisation
        counts); what only checks it (``algo.verify``) runs with the clock stopped."""
        self.model = self.algo.finish(self.ctx, self.model)
        self.clock.pause()
        train_wall_s = self.clock.elapsed()
        self.algo.verify(self.ctx, self.model)
        self.gs = self.algo.global_samples(self.ctx, self.state.local)
        if self.ctx.evaluates and not equal_states(self.model.state_dict(), self.evaluated):
            self.measure(self.model)
        evals = self.state.evals
        final = evals[-1] if evals else None
        return WorkerResult(
            rank=self.ctx.rank, samples=self.state.local, global_samples=self.gs, train_wall_s=train_wall_s,
            evals=evals, final_test_accuracy=final["test_accuracy"] if final else None,
            final_test_loss=final["test_loss"] if final else None,
            model=self.model if self.ctx.evaluates else None, figures=self.algo.figures(),
            where=device.describe(self.ctx.device, self.cfg.precision))


__all__ = ["run_worker", "LoopState"]
