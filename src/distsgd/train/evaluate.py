"""Test loss and accuracy of a model, and the one watcher of models that other processes train."""

from __future__ import annotations

import contextlib
import math
import time
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

from distsgd.callbacks import stops
from distsgd.checkpoint import count, evaluations, of_type, seconds
from distsgd.config import EVALS, RunConfig
from distsgd.data import TrainingData
from distsgd.metrics import Sink, TrainClock, lm_figures
from distsgd.models import logits_of
from distsgd.schedule import Periodic
from distsgd.train import device
from distsgd.train.context import ENDED_HERE, Job
from distsgd.train.objective import loss_function


class Cut(Exception):
    """An evaluation given up between two batches: the run was asked to stop (``evaluate``'s ``cut``)."""


@torch.no_grad()
@device.float32_exact()  # what distsgd eval measures on the CPU: float32, not TF32
def evaluate(
    model: nn.Module,
    data: TrainingData,
    batch_size: int,
    loss_fn: Callable = F.cross_entropy,
    cut: Callable[[], bool] | None = None,
) -> tuple[float | None, float]:
    """(accuracy in 0..1, or None for regression; mean loss) over ``data``'s test set, on the
    model's device; restores train/eval mode. Each batch's mean loss is weighted by its size.
    Always in float32, whatever ``--precision`` trained with: the number describes the saved
    model, which ``distsgd eval`` scores in float32 too. A language model's: the mean loss per
    token, and next-token accuracy over every token. Raises :class:`Cut` before a batch where
    ``cut()`` is true."""
    was_training = model.training
    model.eval()
    correct, loss_sum, n = 0, 0.0, 0
    classify = data.task in ("classification", "lm")
    where = next(iter(model.parameters()), torch.empty(0)).device
    onto_gpu = where.type == "cuda"  # a copy to the host must not be asynchronous: it is read at once
    try:
        for x, y in data.test_batches(batch_size):  # only the test set goes to the model's device
            if cut is not None and cut():
                raise Cut()
            x, y = x.to(where, non_blocking=onto_gpu), y.to(where, non_blocking=onto_gpu)
            out = model(x)
            loss_sum += float(loss_fn(out, y)) * y.numel()
            if classify:
                correct += int((logits_of(out).argmax(dim=-1 if y.dim() == 2 else 1) == y).sum())
            n += y.numel()
    finally:
        model.train(was_training)
    n = max(1, n)
    return (correct / n if classify else None), loss_sum / n


class Watcher:
    """Evaluation of a model that other processes train (Hogwild! workers, a parameter server's
    pushes): the one loop-side view of such a model, with the run's training clock.

    ``state()`` gives a consistent copy of the model now (in host memory: the watcher keeps one per
    evaluation point), evaluated on ``device``. Every ``eval_every`` samples (default:
    :func:`eval_period`) :meth:`observe` files a copy, evaluated after training (:meth:`finish`) so that
    evaluation takes no CPU from the workers; with ``stop_at_target`` the copy is evaluated at once,
    to know when to stop. ``pause_to_copy``: the trainers wait while the copy is taken (the server's
    lock), so the clock stops meanwhile; so it does while ``hold`` holds them. Trainers that nothing
    holds (other machines' clusters under torchrun) train on while a copy is measured, and the clock
    runs on with them. Each evaluation is emitted to ``sink`` as an ``eval`` event.
    """

    def __init__(
        self,
        job: Job,
        per_epoch: int,
        sink: Sink,
        state: Callable[[], dict[str, torch.Tensor]],
        pause_to_copy: bool = False,
        device: torch.device = torch.device("cpu"),
    ) -> None:
        self.cfg, self.spec, self.dataset, self.per_epoch, self.sink = job.cfg, job.model, job.data, per_epoch, sink
        self.callbacks, self.may_stop = job.callbacks, job.may_stop
        self.device = device  # where the data is, and the copies are evaluated
        self.loss_fn = loss_function(job.cfg.loss, job.loss, job.data.task)
        self.state, self.pause_to_copy = state, pause_to_copy
        # per_epoch 0: a user's loop, whose data the watcher never sees (it evaluates what it wants)
        self.at = Periodic(eval_period(self.cfg, per_epoch) or per_epoch or None)
        self.clock = TrainClock()
        self.earlier_s = 0.0  # training time before the checkpoint this run resumed from
        self.pending: list[tuple[int, float, dict[str, torch.Tensor]]] = []
        self.evals: list[dict[str, Any]] = []
        self.last: dict[str, torch.Tensor] | None = None  # the last copy filed or evaluated
        self.reached: dict[str, torch.Tensor] | None = None  # the copy that reached the target (stop_at_target)
        self.reached_at: tuple[int, float] | None = None  # its samples and training time
        # what holds the trainers while a copy that may stop the run is taken and measured (None:
        # nothing does, they train on, as other machines' do), and the samples trained then (None:
        # those ``observe`` is given)
        self.hold: Callable[[], contextlib.AbstractContextManager] | None = None
        self.count: Callable[[], int] | None = None
        # A finished run resumed to train on: its final evaluation, made after its last checkpoint
        # (which holds none of it), of the model this run starts from; and those of the runs
        # before it in a chain of resumes (its checkpoint's). Each goes in its place among the
        # evaluations once the filed copies are measured (else the summary's time and samples to
        # target lost it)
        ended = (job.resume_from or {}).get(ENDED_HERE)
        self.ended: list[dict[str, Any]] = [ended] if ended else []

    def start(self) -> None:
        """Training starts now (the clock counts from here, plus any resumed run's time)."""
        self.clock.restart()
        self.clock.add(self.earlier_s)

    def observe(self, samples: int) -> bool:
        """Note that ``samples`` have been trained; True when the target accuracy is reached. Once
        it is, nothing more is evaluated: the trainers are stopping, and the copy that reached the
        target is the model returned, so its evaluation stays the last."""
        if self.reached is not None:
            return True
        if not self.at.due(samples):
            return False
        if not self.may_stop:
            if self.pause_to_copy:
                self.clock.pause()
            self.last, made_s = self.copy()
            self.pending.append((samples, made_s, self.last))
            self.clock.resume()
            return False
        # the clock stops only while the trainers wait: time they train on while a copy is measured is theirs
        waits = self.pause_to_copy or self.hold is not None
        with self.hold() if self.hold is not None else contextlib.nullcontext():
            if waits:
                self.clock.pause()
            copy, made_s = self.copy()
            samples = self.count() if self.count is not None else samples
            self.last = copy
            event = self.evaluate(samples, made_s, copy)
            reached = stops(event, self.cfg, self.callbacks)
            if reached:
                self.reached, self.reached_at = copy, (samples, event["train_wall_s"])
            self.clock.resume()
        return reached

    def copy(self) -> tuple[dict[str, torch.Tensor], float]:
        """A copy of the model now, and the training-clock time at which it existed: the copy is the
        model evaluated (and, once it reached the target, returned), and making it may be the
        average that makes the model (hogwild++'s clusters' mean), so its time counts even while
        the clock is paused for it (a running clock counts it anyway)."""
        began = time.perf_counter()
        state = self.state()
        return state, self.clock.elapsed() + (0.0 if self.clock.running else time.perf_counter() - began)

    def evaluate(self, samples: int, train_s: float, state: dict[str, torch.Tensor]) -> dict[str, Any]:
        from distsgd.models import build_model

        probe = build_model(self.spec, self.dataset.input_shape, self.dataset.num_classes, self.cfg.init)
        probe.to(self.device).load_state_dict(state)
        acc, loss = evaluate(probe, self.dataset, self.cfg.eval_batch_size, self.loss_fn)
        epoch = round(samples / self.per_epoch, 4) if self.per_epoch else None  # a stream's: not known
        event = eval_event(self.dataset, samples, epoch, train_s, acc, loss)
        self.evals.append(event)
        self.sink.emit(event)
        return event

    def _with_ended(self) -> list[dict[str, Any]]:
        """The evaluations, with the earlier runs' final ones each in its place by samples (unless
        one at its samples measured that model again)."""
        evals = list(self.evals)
        for ended in self.ended:
            if not any(e["samples"] == ended["samples"] for e in evals):
                at = next((i for i, e in enumerate(evals) if e["samples"] > ended["samples"]), len(evals))
                evals.insert(at, dict(ended))
        return evals

    def finish(self, samples: int) -> tuple[float, list[dict[str, Any]], dict[str, torch.Tensor], int]:
        """Training is over: (training time, every evaluation, the model to return, the samples it
        was trained on). The model to return is the copy that reached the target
        (``stop_at_target``: the trainers stopped a step or so later; its time and samples are the
        copy's, not theirs), else the model now, after ``samples``, its training time read once it
        is made (hogwild++'s clusters averaged); the last evaluation is of it (unless the last copy
        holds exactly its values, and so was already of it)."""
        if self.reached is not None and self.reached_at is not None:
            final, (samples, train_s) = self.reached, self.reached_at
        else:
            final = self.state()
            train_s = self.clock.elapsed()
        for n, t, st in self.pending:
            self.evaluate(n, t, st)
        self.pending = []
        if not equal_states(final, self.last):
            self.evaluate(samples, train_s, final)
            self.last = final
        self.evals, self.ended = self._with_ended(), []
        return train_s, self.evals, final, samples

    def state_dict(self) -> dict[str, Any]:
        return {
            "evals_at": self.at.state_dict(),
            "evals": list(self.evals),
            "ended": list(self.ended),  # merged with the evaluations once the copies are measured
            "train_wall_s": self.clock.elapsed(),
            "snapshots": [{"samples": n, "train_s": t, "state": st} for n, t, st in self.pending],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.at.load_state_dict(state["evals_at"])
        self.last = None
        self.evals = list(evaluations(state, "evals"))
        self.ended = [*(evaluations(state, "ended") if "ended" in state else []), *self.ended]
        snapshots = of_type(state, "snapshots", list, "a list of model copies")
        self.pending = [
            (count(s, "samples"), seconds(s, "train_s"), of_type(s, "state", dict, "a model's state"))
            for s in snapshots
        ]
        self.earlier_s = seconds(state, "train_wall_s")


def eval_period(cfg: RunConfig, per_epoch: int) -> int | None:
    """Samples (all workers') between evaluations: ``--eval-every``; unset, None (each epoch's end)
    for a run of at least :data:`EVALS` epochs, else its planned samples over :data:`EVALS`, so a
    short run draws a curve too. ``per_epoch``: all workers' samples in an epoch (0: a stream's, not
    known; then --max-samples over :data:`EVALS`, or each pass's end). Worked out where
    it is used, not written back into the settings: a re-run with another budget gets its own."""
    if cfg.eval_every is not None:
        return cfg.eval_every
    if not per_epoch:  # a stream, whose epochs' length is not known: its budget's, else each pass's end
        return None if cfg.max_samples is None else max(1, math.ceil(cfg.max_samples / EVALS))
    planned = cfg.max_samples if cfg.max_samples is not None else cfg.epochs * per_epoch
    return None if planned >= EVALS * per_epoch else max(1, math.ceil(planned / EVALS))


def eval_event(
    data: TrainingData, samples: int, epoch: float | None, train_s: float, accuracy: float | None, loss: float | None
) -> dict[str, Any]:
    """The ``eval`` event of one evaluation (a language model's with its perplexity and bits per
    token); ``epoch`` None: not known (a user's loop that reads a stream)."""
    event = {
        "event": "eval",
        "samples": samples,
        "epoch": epoch,
        "train_wall_s": train_s,
        "test_accuracy": accuracy,
        "test_loss": loss,
    }
    if data.task == "lm" and loss is not None:  # a user's run.log may give an accuracy alone
        event.update(lm_figures(loss))
    return event


def snapshot(model: nn.Module) -> dict[str, torch.Tensor]:
    """A copy of every parameter and buffer of ``model``."""
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def equal_states(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor] | None) -> bool:
    """Whether two state dicts hold exactly the same values (``b`` None: nothing to compare)."""
    return b is not None and a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
