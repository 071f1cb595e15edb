"""The server process: the core with its rule, a watcher evaluating its model, checkpoints."""

from __future__ import annotations

import copy
import logging
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from distsgd.algorithms.param_server.core import ParameterServer
from distsgd.algorithms.param_server.rules import Rule
from distsgd.callbacks import states
from distsgd.checkpoint import (
    CHECKPOINT_DIR,
    COORDINATOR,
    Stateful,
    commit_checkpoint,
    commit_coordinator_only,
    gather,
    load_worker_state,
    save_worker_state,
    scatter,
    worker_file,
)
from distsgd.config import checkpoint_record
from distsgd.data.partition import samples_per_epoch
from distsgd.errors import OutputError, Terminated
from distsgd.metrics import Sink
from distsgd.models import build_model
from distsgd.schedule import Periodic
from distsgd.train.context import Attendance, Figures, Job, WorkerResult
from distsgd.train.evaluate import Watcher
from distsgd.train.optim import build_optimizer

log = logging.getLogger(__name__)

Taken = tuple[int, dict[str, Any], int, list[int]]  # a checkpoint to write: seq, the server's state, samples, ranks


@dataclass
class ServerFigures(Figures):
    """A parameter server's: how stale the applied gradients were, its updates, and the bytes it
    sent and received (every byte either end sent, also under torchrun, where the workers' own
    counts are in other processes: the run's ``bytes_sent`` is their sum)."""

    staleness: dict[str, Any] | None = None  # {mean, p50, p99, max, histogram}
    nonfinite_pushes: int | None = None  # gradients or exchanges with NaN or inf, not applied
    refused_connections: int | None = None  # connections without a valid HELLO and the run's secret
    server_updates: int | None = None
    server_updates_per_s: float | None = None
    server_bytes_sent: int | None = None
    server_bytes_received: int | None = None
    # what the server received from each worker, over the whole run (a resumed run's workers count
    # only their own part: one that had finished at the checkpoint saved none of its count)
    received_by: list[int] | None = None
    rule: dict[str, Any] | None = None  # the rule's own settings (async easgd's alpha, tau, mode): Rule.figures

    def summary(self) -> dict[str, Any]:
        # received_by is bytes_sent_per_worker (run_bytes); the rule's figures go in as their own keys
        own = {k: v for k, v in super().summary().items() if k not in ("received_by", "rule")}
        return {**own, **(self.rule or {})}

    def run_bytes(self, results: list[WorkerResult]) -> tuple[int, list[int] | None]:
        # each worker's: as the server received them, else as the workers counted (none under torchrun)
        each = self.received_by or [r.figures.bytes_sent or 0 for r in results[1:]] or None
        return (self.server_bytes_sent or 0) + (self.server_bytes_received or 0), each


class ServerRole:
    """Hold the model, apply pushes until every worker is done or dead, then evaluate.

    Built before the transport serves (so the first pull finds it), then :meth:`run`. A :class:`Watcher`
    copies the model every ``eval_every`` samples (inside the update lock, so each copy is one
    consistent version, with the clock paused since the workers wait on the lock) and evaluates
    the copies after training. It coordinates checkpoints: once every live worker has saved its
    part of one, it saves its own state and commits (:meth:`checkpointed`); with ``cfg.resume``
    it starts from that state.

    While it serves, the role emits a ``server`` event (updates, bytes sent, staleness so far:
    :meth:`.core.ParameterServer.figures`) each time the run passes another ``log_every`` steps of
    every worker, and once at the end. The server reports staleness, not the workers: it is the
    one that knows every push's (a worker sees only its own, and under ssp a held worker's reply
    carries versions applied while it waited), and it has the run's sink under torchrun too.
    """

    def __init__(
        self,
        job: Job,
        rule: Rule,
        workers: int,
        sink: Sink,
        exact: bool = False,
        given_up: torch.Tensor | None = None,
        accept_nonfinite: bool = False,
    ) -> None:
        torch.set_num_threads(1)
        cfg, data = job.cfg, job.data
        self.cfg, self.sink, self.data = cfg, sink, data
        self.job_callbacks = job.callbacks  # (run here, by the watcher: their state goes back with the result)
        self.report_at = Periodic(cfg.log_every * cfg.batch_size * workers)  # as often as a worker's progress
        self.model = build_model(job.model, data.input_shape, data.num_classes, cfg.init, seed=cfg.seed)
        per_epoch = samples_per_epoch(data.n_train, workers, cfg.partition)
        self.watcher = Watcher(job, per_epoch, sink, self._state, pause_to_copy=True)
        self.own = job.main is not None  # the user's loop evaluates what it wants (its first worker logs it)
        self.may_stop = job.may_stop  # a worker's evaluation may stop the run (its target, a callback)
        optimizer = build_optimizer(cfg, self.model, job.optimizer, job.param_groups)
        self.server = ParameterServer(
            cfg,
            self.model,
            workers,
            rule,
            self._on_update,
            on_start=self.watcher.start,
            optimizer=optimizer,
            accept_nonfinite=accept_nonfinite,
            own=job.main is not None,
        )
        self.pieces: dict[str, Stateful] = {"server": self.server, "watcher": self.watcher}
        self.workers = workers
        self.exact = exact  # a checkpoint needs every worker's part (sync-ps), not only the live ones
        self.saved: dict[int, dict[int, int]] = {}  # checkpoint seq -> {worker rank: its samples then}
        # a user's loop's workers that finished: a checkpoint needs their parts too, since a resume
        # without one starts that worker's loop again from nothing (its run.resumed None), counted again
        self.done: set[int] = set()
        self.writing = threading.Lock()  # one checkpoint written at a time, outside the server's lock
        self.committed = -1  # the newest checkpoint committed (an older one taken meanwhile is not written)
        self.failure: Exception | None = None  # a checkpoint that could not be written: the run stops
        # Who is still to be waited for. The local launcher decides whether a dead worker is
        # replaced; it sets given_up[rank] once it will start none (a local run: see
        # launch/server.py). Until then a rank that died is waited for, since a replacement may be
        # on its way; a rank that died before it ever connected is dropped. Under torchrun
        # (given_up None) a death is final: torchrun restarts the whole group, or stops it.
        self.given_up = given_up
        self.connected: set[int] = set()  # ranks whose current process has said HELLO and not left
        self.lost: dict[int, float] = {}  # ranks whose connection broke, and when
        self.dropped: dict[int, str] = {}  # ranks that left without finishing (none came back), and why
        if cfg.resume:
            saved = load_worker_state(Path(cfg.resume), COORDINATOR, job.resume_from)
            if saved is not None:
                scatter(self.pieces, saved)

    def checkpointed(self, rank: int, seq: int, samples: int) -> None:
        """Worker ``rank`` saved its part of checkpoint ``seq``; once every live worker has, save the
        server's state (the model, optimiser, counters, evaluations) and commit. A worker writes its
        file before it says so: a claim with no file (a forged number) is refused, and nothing is
        written for it."""
        part = worker_file(Path(self.cfg.out) / CHECKPOINT_DIR, seq, rank - 1) if self.cfg.out else None
        if part is None or not part.is_file():
            raise ConnectionError(
                f"worker {rank - 1} said it saved its part of checkpoint {seq}, and there is no "
                f"{part or 'run directory'}"
            )
        with self.server.lock:
            self.saved.setdefault(seq, {})[rank] = samples
            taken = self._take_whole()
        self._commit(taken)

    def _take_whole(self) -> Taken | None:
        """The newest checkpoint every live worker has saved, with a copy of the server's state as
        of now (call with the lock held; the writing happens after it is released)."""
        needed = set(range(1, self.workers + 1)) if self.exact else self.server.active | self.done
        whole = [seq for seq, ranks in self.saved.items() if set(ranks) >= needed]
        if not whole or not self.cfg.out or self.failure is not None:
            return None
        seq = max(whole)
        state = copy.deepcopy(gather(self.pieces))  # the optimiser's buffers move on once the lock is released
        for rank, samples in self.saved[seq].items():  # what each worker had when it saved (a sync-ps
            state["server"]["counts"][rank] = samples  # worker may already have pushed the next round)
        ranks = sorted(r - 1 for r in self.saved[seq])
        self.saved = {s: r for s, r in self.saved.items() if s > seq}
        # the samples its resume goes on from, each worker's when it saved (until 2026-12-01 the server's
        # count now, past theirs: a short run's checkpoints all gave its final count)
        return seq, state, sum(state["server"]["counts"]), ranks

    def _commit(self, taken: Taken | None) -> None:
        """Write and commit a checkpoint taken by :meth:`_take_whole`, outside the server's lock. A
        write that fails (a full disk) stops the run with that error, not as a dead worker."""
        if taken is None:
            return
        seq, state, total, ranks = taken
        assert self.cfg.out  # _take_whole takes none without a run directory
        ckpt_dir = Path(self.cfg.out) / CHECKPOINT_DIR
        with self.writing:
            if seq <= self.committed:  # a newer one was written meanwhile, by another connection's thread
                return
            try:
                save_worker_state(ckpt_dir, seq, COORDINATOR, state)
                commit_checkpoint(
                    ckpt_dir,
                    seq,
                    self.workers,
                    {"samples": total, **checkpoint_record(self.cfg, self.data)},
                    ranks=ranks,
                    coordinator=True,
                )
            except OSError as exc:
                self.failure = OutputError.of(exc)
                self.server.stop = True  # the workers stop at their next push
                log.info("%s; stopping the run", self.failure)  # the run's error line says it once
                return
            self.committed = seq
        self.sink.emit(
            {"event": "checkpoint", "seq": seq, "samples": total, "train_wall_s": self.watcher.clock.elapsed()}
        )

    def _final_checkpoint(self) -> None:
        """A signal stops the run: the server's state (the model, the optimiser, each worker's
        samples, the evaluations) saved as a checkpoint of its own, numbered past every one
        before, with no worker's part. ``--resume`` then starts every worker as one that replaces
        a dead worker, from the samples the server counted for its rank, so nothing trained is
        lost (a worker's own state is its random state and counters; the optimiser is the
        server's). The workers are told to stop at their next request first, and the state is
        copied under the server's lock: one version of it.

        Not under sync-ps, whose checkpoints hold every worker's part of one round so that a resume
        is exact, nor for a user's loop, whose ``run.checkpoint(**state)`` state is in the workers'
        parts (a resume without them would restart its own counters, its schedule, silently): those
        keep their last one. In a local run, only when the launcher was stopped by the
        signal (``given_up[0]``, set before it passes the signal on), not when it stops the server
        after a failure: that run resumes from its last checkpoint, as it says. A signal to the
        whole process group may reach the server first: it waits a moment for the launcher's word."""
        if not self.cfg.out or self.failure is not None or self.exact or self.own:
            return
        if self.given_up is not None:
            deadline = time.monotonic() + 2.0
            while not self.given_up[0] and time.monotonic() < deadline:
                time.sleep(0.01)
            if not self.given_up[0]:
                return
        out = Path(self.cfg.out)
        with self.server.lock:
            self.server.stop = True
            state = copy.deepcopy(gather(self.pieces))
            total = self.server.total_samples()
        with self.writing:
            meta = {"samples": total, **checkpoint_record(self.cfg, self.data)}
            seq = commit_coordinator_only(out, state, self.workers, meta, above=[self.committed, *self.saved])
            if seq is None:
                return
            self.committed = seq
        self.sink.emit(
            {"event": "checkpoint", "seq": seq, "samples": total, "train_wall_s": self.watcher.clock.elapsed()}
        )

    def worker_hello(self, rank: int, rejoining: bool) -> None:
        """Worker ``rank`` connected; with ``rejoining``, it replaces one that died."""
        if rejoining:
            self.server.rejoin(rank)
        with self.server.lock:
            self.connected.add(rank)
            self.lost.pop(rank, None)
            self.dropped.pop(rank, None)

    def reached(self, rank: int) -> None:
        """Worker ``rank``'s loop (a user's: it evaluates) measured --stop-at-target's target: every
        worker stops at its next request. Refused where the server decides (distsgd's loop: it
        evaluates) or the run does not stop at a target."""
        if not (self.own and self.may_stop):
            raise ConnectionError(f"worker {rank - 1} asked to stop the run, which stops at no target of its workers'")
        log.info("worker %d measured the target; stopping the run", rank - 1)
        self.server.stop = True

    def worker_done(
        self, rank: int, samples: int, buffers: tuple[list[torch.Tensor], list[torch.Tensor]] | None = None
    ) -> None:
        """Worker ``rank`` finished its training (with its buffers as it ended, where it sent them)."""
        with self.server.lock:
            self.connected.discard(rank)
            if self.own:  # (on 30aa15c `if run.rank == 0: run.checkpoint()` committed, timing allowing, once
                self.done.add(rank)  # worker 1 had finished; the resume trained its part again: 244 samples of 192)
        self.server.finished(rank, samples, buffers)

    def worker_gone(self, rank: int, why: str) -> None:
        """Worker ``rank``'s connection broke (it died, or fell silent: ``why``): carry on without
        it, or, in a local run, until the launcher says no replacement is coming (or ``--timeout``
        passes), wait for one. Unless one comes, the summary lists it in ``failed_workers``."""
        self.commit_after(self.leave(rank, why))

    def leave(self, rank: int, why: str) -> Taken | None:
        """The bookkeeping of :meth:`worker_gone`, quick (the transport calls it while it holds its
        membership lock); returns the checkpoint this completes, for :meth:`commit_after`."""
        with self.server.lock:
            self.connected.discard(rank)
            self.lost[rank] = time.monotonic()
            self.dropped[rank] = why
        self.server.finished(rank)
        with self.server.lock:
            return self._take_whole()

    def commit_after(self, taken: Taken | None) -> None:
        """Write a checkpoint that :meth:`leave` completed (slow: never under a lock)."""
        self._commit(taken)

    def _settle(self) -> bool:
        """Drop the ranks the launcher gave up on that never connected (they died before saying
        HELLO: no connection will break for them). True while a worker is still to come: live,
        or dead with a replacement possibly on its way."""
        server = self.server
        if self.given_up is None:
            return bool(server.active)
        with server.lock:
            dropped = [r for r in server.active if self.given_up[r] and r not in self.connected]
        for rank in dropped:
            log.warning("worker %d died before it reached the server; the server carries on without it", rank - 1)
            self.worker_gone(rank, "it died before it reached the server")
        with server.lock:
            now = time.monotonic()
            self.lost = {r: t for r, t in self.lost.items() if not self.given_up[r] and now - t < self.cfg.timeout_s}
            return bool(server.active) or bool(self.lost)

    def _state(self) -> dict[str, torch.Tensor]:
        """A copy of the server's model with the workers' buffers (call with the lock held)."""
        self.server.sync_buffers()
        return {k: v.detach().clone() for k, v in self.model.state_dict().items()}

    def _on_update(self, total: int) -> None:  # runs inside the server's lock
        if not self.own and self.watcher.observe(total):
            self.server.stop = True

    def _report(self, final: bool = False) -> None:
        """Emit a ``server`` event if the run passed another reporting point (or at the end). The
        lock is held only to read the figures; the event is sent outside it."""
        total = self.server.total_samples()
        if not self.report_at.due(total) and not final:
            return
        with self.server.lock:
            figures = self.server.figures()
            total = self.server.total_samples()
        self.sink.emit({"event": "server", "samples": total, "train_wall_s": self.watcher.clock.elapsed(), **figures})

    def run(self) -> WorkerResult:
        """Serve until every worker has finished or died (and no replacement is on its way);
        return the chief WorkerResult."""
        server = self.server
        try:
            while self._settle():
                self._report()
                time.sleep(0.01)
        except Terminated:  # SIGTERM or SIGUSR1 (the launcher's, passed on; a process group's)
            self._final_checkpoint()
            raise
        if self.failure is not None:
            raise self.failure
        self._report(final=True)
        total = server.total_samples()
        server.sync_buffers()  # the model returned carries the workers' statistics
        evals: list[dict[str, Any]]
        if self.own:
            train_wall_s, evals, final = self.watcher.clock.elapsed(), [], self._state()
        else:
            train_wall_s, evals, final, total = self.watcher.finish(total)
        self.model.load_state_dict(final)  # the copy that reached the target, if the run stopped there
        figures = ServerFigures(
            bytes_sent=server.bytes_sent,
            staleness=server.staleness_summary() if server.rule.stale else None,
            server_updates=server.version,
            server_updates_per_s=server.version / train_wall_s if train_wall_s > 0 else 0.0,
            server_bytes_sent=server.bytes_sent,
            server_bytes_received=server.bytes_received,
            received_by=server.received_by[1:] if server.received_by_known else None,
            nonfinite_pushes=server.nonfinite,
            rule=server.rule.figures(self.workers),
        )
        last = evals[-1] if evals else {"test_accuracy": None, "test_loss": None}
        dropped = {str(r - 1): f"dropped by the server: {why}" for r, why in sorted(self.dropped.items())}
        attendance = Attendance(
            samples_per_worker=server.counts[1:],
            failed_workers=[int(r) for r in dropped],
            worker_errors=dropped or None,
        )
        return WorkerResult(
            rank=0,
            samples=0,
            global_samples=total,
            train_wall_s=train_wall_s,
            evals=evals,
            final_test_accuracy=last["test_accuracy"],
            final_test_loss=last["test_loss"],
            model=self.model,
            figures=figures,
            attendance=attendance,
            callbacks=states(self.job_callbacks),
        )
