"""The one training loop every algorithm runs in each of its workers.

Per step: take the next batch of this worker's partition (tensor indexing only), forward,
cross-entropy loss, backward, ``algo.after_backward`` (gradient sync), optimiser step,
``algo.after_step`` (parameter sync). The reporting worker (rank 0) evaluates every
``eval_every`` samples (default: each epoch) with the training clock paused, and emits events.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from distsgd.algorithms.base import Algorithm
from distsgd.config import RunConfig, checkpoint_interval, parse_straggler, threads_per_worker
from distsgd.data import Dataset
from distsgd import checkpoint
from distsgd.errors import ConfigError
from distsgd.data.partition import _mix, epoch_indices, shard_size
from distsgd.metrics import NullSink, Sink, TrainClock
from distsgd.models import ModelSpec, build_model
from distsgd.train.evaluate import evaluate
from distsgd.train.optim import lr_at, set_lr

log = logging.getLogger(__name__)


@dataclass
class WorkerContext:
    """What one worker knows about the run."""

    cfg: RunConfig
    dataset: Dataset
    model_spec: ModelSpec
    rank: int = 0
    world: int = 1
    sink: Sink = field(default_factory=NullSink)
    reports: bool = True  # emits progress events (rank 0; every Hogwild worker)
    evaluates: bool | None = None  # evaluates the model (default: same as reports)

    def __post_init__(self) -> None:
        if self.evaluates is None:
            self.evaluates = self.reports
    state: dict[str, Any] = field(default_factory=dict)  # the algorithm's per-worker scratch
    resumed: bool = False  # continuing from a checkpoint: do not re-synchronise the start


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


def run_worker(ctx: WorkerContext, algo: Algorithm) -> WorkerResult:
    """Train this worker's share of the run and return what it measured."""
    cfg, ds = ctx.cfg, ctx.dataset
    torch.set_num_threads(threads_per_worker(cfg))
    # Same seed in every worker: every replica starts from the same weights.
    model = build_model(ctx.model_spec, ds.input_shape, ds.num_classes, cfg.init, seed=cfg.seed)
    model.train()
    resume = checkpoint.load_worker_state(Path(cfg.resume), ctx.rank) if cfg.resume else None
    ctx.resumed = resume is not None
    if resume is not None:
        model.load_state_dict(resume["model"])
    model = algo.setup(ctx, model)
    optimizer = algo.make_optimizer(ctx, model)
    torch.manual_seed(_mix(cfg.seed, 7919, ctx.rank))  # dropout differs between workers
    if resume is not None:
        optimizer.load_state_dict(resume["optimizer"])
        algo.load_state_dict(resume["algo"])
        torch.set_rng_state(resume["rng"])
    ckpt_every = checkpoint_interval(cfg.checkpoint_every) if cfg.checkpoint_every else None
    ckpt_dir = Path(cfg.out) / checkpoint.CHECKPOINT_DIR if cfg.out else None

    x_all, y_all = ds.x_train, ds.y_train
    n = len(y_all)
    per_epoch = shard_size(n, ctx.world, cfg.partition)
    if per_epoch == 0:
        raise ConfigError(f"{n} training samples cannot be shared among {ctx.world} workers")
    global_per_epoch = per_epoch * ctx.world
    slowdown = 0.0  # a simulated straggler sleeps (factor - 1) x its own step time after each step
    if cfg.straggler is not None:
        slow_rank, factor = parse_straggler(cfg.straggler)
        slowdown = factor - 1 if slow_rank == ctx.rank else 0.0
    total_epochs = cfg.epochs if cfg.max_samples is None else cfg.max_samples / global_per_epoch
    constant_lr = cfg.schedule == "constant"

    algo.before_training(ctx)
    clock = TrainClock()
    evals: list[dict[str, Any]] = []
    local = 0
    steps = 0
    loss_sum = torch.zeros(())
    loss_steps = 0
    next_eval = cfg.eval_every
    next_ckpt = ckpt_every
    stop = False
    last_eval_at = -1
    epoch, first_start, seq = 0, 0, 0
    if resume is not None:
        epoch, first_start, local, steps = resume["epoch"], resume["start"], resume["local"], resume["steps"]
        evals, next_eval, last_eval_at, seq = resume["evals"], resume["next_eval"], resume["last_eval_at"], resume["seq"]
        next_ckpt = resume["next_ckpt"] if ckpt_every is not None else None
        clock.add(resume["train_wall_s"])

    def global_now() -> int:
        return algo.global_samples(ctx, local)

    def do_eval(epoch_f: float, decide: bool = True) -> bool:
        """Evaluate on rank 0 with the clock paused; return whether every worker should stop."""
        nonlocal last_eval_at
        reached = False
        gs = global_now()
        last_eval_at = gs
        clock.pause()
        returned = algo.evaluation_model(ctx, model)  # on every worker: it may be a collective
        clock.resume()
        if ctx.evaluates:
            clock.pause()
            acc, loss = evaluate(returned, ds.x_test, ds.y_test, cfg.eval_batch_size)
            event = {"event": "eval", "samples": gs, "epoch": round(epoch_f, 4), "train_wall_s": clock.elapsed(),
                     "test_accuracy": acc, "test_loss": loss}
            evals.append(event)
            ctx.sink.emit(event)
            clock.resume()
            reached = cfg.stop_at_target and cfg.target_accuracy is not None and acc >= cfg.target_accuracy
        return algo.agree(ctx, reached) if cfg.stop_at_target and decide else False

    def save_checkpoint(epoch_next: int, start_next: int) -> None:
        """Every worker writes its state; rank 0 then points the manifest at the new set."""
        nonlocal seq
        clock.pause()
        seq += 1
        state = {"model": algo.unwrap(model).state_dict(), "optimizer": optimizer.state_dict(),
                 "algo": algo.state_dict(), "rng": torch.get_rng_state(), "epoch": epoch_next, "start": start_next,
                 "local": local, "steps": steps, "evals": evals, "next_eval": next_eval, "next_ckpt": next_ckpt,
                 "last_eval_at": last_eval_at, "seq": seq, "train_wall_s": clock.elapsed()}
        checkpoint.save_worker_state(ckpt_dir, seq, ctx.rank, state)
        algo.barrier(ctx)
        if ctx.rank == 0:
            checkpoint.commit_checkpoint(ckpt_dir, seq, ctx.world, {"samples": global_now(), "epoch": epoch_next,
                                                                    "algo": cfg.algo})
            ctx.sink.emit({"event": "checkpoint", "seq": seq, "samples": global_now(), "epoch": epoch_next,
                           "train_wall_s": clock.elapsed()})
        clock.resume()

    gs = global_now()  # all workers' samples, read once per step (for Hogwild! it sums a shared tensor)
    while not stop and (cfg.max_samples is not None or epoch < cfg.epochs):
        order = epoch_indices(n, epoch, ctx.rank, ctx.world, cfg.seed, cfg.partition)
        for start in range(first_start, len(order), cfg.batch_size):
            if (cfg.max_samples is not None and gs >= cfg.max_samples) or not algo.keep_going(ctx):
                stop = True
                break
            if slowdown:
                step_start = time.perf_counter()
            idx = order[start:start + cfg.batch_size]
            x, y = x_all[idx], y_all[idx]
            if not constant_lr:  # the run's progress (all workers'), not this worker's
                set_lr(optimizer, lr_at(cfg, gs / global_per_epoch, total_epochs))
            optimizer.zero_grad(set_to_none=True)
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            algo.after_backward(ctx, model)
            algo.apply_step(ctx, optimizer)
            local += len(idx)
            algo.after_step(ctx, model, local)
            if slowdown:
                time.sleep(slowdown * (time.perf_counter() - step_start))
            steps += 1
            gs = global_now()
            loss_sum += loss.detach()
            loss_steps += 1
            if ctx.reports and steps % cfg.log_every == 0:
                elapsed = clock.elapsed()
                mean_loss = float(loss_sum) / loss_steps
                if not math.isfinite(mean_loss):
                    log.warning("training loss is %s at %d samples: lower --lr?", mean_loss, gs)
                ctx.sink.emit({"event": "progress", "samples": gs, "epoch": round(local / per_epoch, 4),
                               "rank": ctx.rank, "loss": mean_loss, "lr": optimizer.param_groups[0]["lr"],
                               "train_wall_s": elapsed, "samples_per_s": gs / elapsed if elapsed > 0 else 0.0})
                loss_sum.zero_()
                loss_steps = 0
            if next_eval is not None and gs >= next_eval:
                while next_eval <= gs:
                    next_eval += cfg.eval_every
                if do_eval(local / per_epoch):
                    stop = True
                    break
            if next_ckpt is not None and gs >= next_ckpt:
                while next_ckpt <= gs:
                    next_ckpt += ckpt_every
                save_checkpoint(epoch, start + cfg.batch_size)
        first_start = 0
        if stop:
            break
        algo.on_epoch_end(ctx, model, epoch)
        epoch += 1
        gs = global_now()
        if cfg.eval_every is None and (cfg.max_samples is None or gs < cfg.max_samples):
            stop = do_eval(local / per_epoch)
        if cfg.checkpoint_every == "epoch":
            save_checkpoint(epoch, 0)
    train_wall_s = clock.elapsed()
    model = algo.finish(ctx, model)
    if global_now() != last_eval_at:  # the final model is always evaluated
        do_eval(local / per_epoch, decide=False)
    final = evals[-1] if evals else None
    return WorkerResult(
        rank=ctx.rank, samples=local, global_samples=global_now(), train_wall_s=train_wall_s, evals=evals,
        final_test_accuracy=final["test_accuracy"] if final else None,
        final_test_loss=final["test_loss"] if final else None,
        model=model if ctx.evaluates else None,
        extra=algo.summary(),
    )


__all__ = ["WorkerContext", "WorkerResult", "run_worker"]
