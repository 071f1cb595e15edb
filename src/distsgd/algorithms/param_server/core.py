"""The parameter server's mechanics, whatever its update rule (:mod:`.rules`).

Concurrency: every change to the server's state (gradients, optimiser step, version, counters)
happens under one lock, so updates are atomic with respect to each other; nothing is accumulated
into shared state outside it. Workers keep computing while the server applies other gradients.
Waiting (sync-ps, ssp, barriers) uses futures; they are completed after the lock is released,
so replies are sent outside the critical section. The core knows no transport: tests drive it
directly, in a chosen order.
"""

from __future__ import annotations

import logging
import math
import threading
from collections import Counter
from typing import TYPE_CHECKING, Any, Callable, Iterator

import torch
from torch import nn
from torch.futures import Future

from distsgd import checkpoint as ckpt
from distsgd.algorithms.averaging import flat_view_, float_buffers, int_buffers, params
from distsgd.algorithms.param_server.hyper import Hyperparameters
from distsgd.config import RunConfig
from distsgd.errors import BadField, CheckpointError
from distsgd.train.optim import build_optimizer

if TYPE_CHECKING:
    from distsgd.algorithms.param_server.rules import Rule

Answer = tuple[torch.Tensor, int, int, bool]  # weights, version, all workers' samples, stop
Present = list[bool] | None  # which parameters a push has a gradient of, in the model's order (None: all)

log = logging.getLogger(__name__)

# the most samples a step of a user's loop may add (2**31: a forged count of 2**62 is still refused)
OWN_MAX_STEP = 1 << 31


class ParameterServer:
    """The server's state. ``pull(rank)`` returns (weights, version); ``push(rank, grad,
    version_read, local_samples, buffers, hypers, present)`` returns a Future of an :data:`Answer`;
    ``exchange`` is async EASGD's elastic exchange. Worker ranks are 1..N.

    A parameter that has no gradient on the worker (frozen, or unused in the forward: its ``.grad``
    is None there) is absent from the push (``present``): as in plain PyTorch, the optimiser skips
    it, with no weight decay and no momentum (sync-ps: see :class:`.rules.SyncRound`).

    The optimiser steps with the hyperparameters each push carries (``hypers``: the worker's
    optimiser's at that step, laid out as :attr:`hypers` says): they are the one source of the lr,
    momentum, betas and weight decay, the run's ``--schedule`` and ``--lr-warmup-steps`` included
    (the worker's loop applies those to its optimiser). A push without them (a test driving the
    core) steps with the groups as they stand."""

    def __init__(
        self,
        cfg: RunConfig,
        model: nn.Module,
        workers: int,
        rule: "Rule",
        on_update: Callable[[int], None] | None = None,
        on_start: Callable[[], None] | None = None,
        optimizer: torch.optim.Optimizer | None = None,
        accept_nonfinite: bool = False,
        own: bool = False,
    ) -> None:
        self.cfg, self.model, self.workers = cfg, model, workers
        self.accept_nonfinite = accept_nonfinite
        self.nonfinite = 0  # gradients (or exchanges) with NaN or inf, not applied
        # the most samples a worker can have trained between two of its messages: a user's loop
        # (``own``) batches as it likes (run.loader(batch_size=...), its own micro-batches, run.count),
        # so only a count no step could reach is refused there
        steps = getattr(rule, "steps_per_message", 1)
        self.max_step = OWN_MAX_STEP * steps if own else cfg.batch_size * cfg.accumulate * steps
        self.rule = rule
        self.params = params(model)
        self.flat = flat_view_(self.params)  # one buffer: an answer is one copy, not a concatenation
        self.spans = list(_spans(self.params))  # where each parameter lies in a flat gradient
        self.optimizer = optimizer if optimizer is not None else build_optimizer(cfg, model)
        # what each push carries of the worker's optimiser (nothing where the optimiser never steps)
        self.hypers = Hyperparameters.of(self.optimizer, model) if rule.steps else Hyperparameters.none()
        self.on_update, self.on_start = on_update, on_start
        self.lock = threading.Lock()
        self.version = 0
        self.counts = [0] * (workers + 1)  # local samples reported by each worker rank (1..N)
        self.clocks = [0] * (workers + 1)  # pushes by each worker
        self.active = set(range(1, workers + 1))  # neither finished nor failed
        self.staleness: Counter[int] = Counter()
        self.stop = False
        self.bytes_sent = 0  # what the server sends its workers, and receives from them, as the
        self.bytes_received = 0  # transport counts it (every byte on the wire: count())
        self.received_by = [0] * (workers + 1)  # bytes_received by worker rank (1..N): what each sent
        self.received_by_known = True  # (not where resumed from a checkpoint that has no such count)
        self._waiting: list[Future] = []  # workers at a barrier
        self._started = False
        self._buffers: dict[int, list[torch.Tensor]] = {}  # every worker's latest floating-point buffers
        self._ints: list[torch.Tensor] | None = None  # the latest other (integer, bool) buffers
        self._done: list[tuple[Future, Answer | None]] = []  # futures to complete once the lock is released

    # -- what the workers call (each takes the lock, then completes futures outside it) ----------
    def barrier(self) -> Future:
        """The start of training: resolves once every live worker has called it (every worker has
        built its model), so the workers start together. Once training has started it resolves at
        once: a replacement worker (``--restart-workers``) joins a running server and must not
        wait for workers that passed it long ago (under ssp they would in turn wait for it)."""
        fut: Future = Future()
        with self.lock:
            if self._started:
                self._done.append((fut, None))
            else:
                self._waiting.append(fut)
                self._release_barrier()
            done = self._take_done()
        _complete(done)
        return fut

    def pull(self, rank: int) -> tuple[torch.Tensor, int]:
        with self.lock:
            flat = self.flat.clone()
            self.rule.on_pull(self, rank, flat)
            return flat, self.version

    def check_samples(self, rank: int, samples: int, done: bool = False) -> None:
        """A worker's sample count must grow by at most what it can have trained since its last
        message (a forged count of 2**62 would otherwise end the run or stall the server)."""
        with self.lock:
            before = self.counts[rank]
        if not before <= samples <= before + self.max_step:
            raise ConnectionError(
                f"worker {rank - 1} claimed {samples} samples after {before}: at most {self.max_step} more a message"
            )

    def _finite(self, *tensors: torch.Tensor, counted: bool = True) -> bool:
        """Whether ``tensors`` may be applied: finite, or the user accepts NaN and inf. ``counted``:
        a refusal counts as a non-finite push (said once); not for a worker's last buffers."""
        if self.accept_nonfinite or all(bool(torch.isfinite(t).all()) for t in tensors):
            return True
        if not counted:
            return False
        self.nonfinite += 1
        if self.nonfinite == 1:
            log.warning(
                "a worker sent NaN or inf; the server does not apply such gradients (see nonfinite_pushes "
                "in summary.json; lower --lr?)"
            )
        return False

    def push(
        self,
        rank: int,
        grad: torch.Tensor,
        version_read: int,
        local_samples: int,
        buffers: tuple[list[torch.Tensor], list[torch.Tensor]] | None = None,
        hypers: list[float] | None = None,
        present: Present = None,
    ) -> Future:
        """Worker ``rank``'s flat gradient, its (floating-point, other) buffers, each flat, in
        the model's order, its optimiser's hyperparameters at that step, and which parameters it
        has a gradient of (``present``; None: all). The server keeps ``grad`` (the transport's own
        copy) and zeroes it where a parameter is absent, whatever it held there. A gradient with NaN
        or inf is taken as zero (the rule's rounds stay in step), unless ``accept_nonfinite``;
        hyperparameters the optimiser cannot step with (NaN, a negative lr) are a lie: a
        ConnectionError, and nothing changes."""
        if hypers is not None:
            problem = self.hypers.invalid(hypers)
            if problem is not None:
                raise ConnectionError(f"worker {rank - 1} pushed {problem}")
        if present is not None:
            if len(present) != len(self.spans):
                raise ConnectionError(
                    f"worker {rank - 1} said which of {len(present)} parameters it has, not {len(self.spans)}"
                )
            if all(present):
                present = None
            for has, (offset, n) in zip(present or [], self.spans):
                if not has:
                    grad[offset : offset + n].zero_()
        fut: Future = Future()
        if not self._finite(grad, *(buffers[0] if buffers else [])):
            grad = torch.zeros_like(grad)
            buffers = None
        with self.lock:
            self.counts[rank] = local_samples
            self.clocks[rank] += 1
            if buffers is not None:
                self._buffers[rank], self._ints = buffers
            self.rule.on_push(self, rank, grad, version_read, hypers, present, fut)
            self.rule.release(self)
            done = self._take_done()
        _complete(done)
        return fut

    def exchange(
        self, rank: int, x: torch.Tensor, floats: list[torch.Tensor], ints: list[torch.Tensor], local_samples: int
    ) -> tuple[tuple[torch.Tensor, list[torch.Tensor]], int, int, bool]:
        """Async EASGD's elastic exchange (:class:`.rules.Elastic`) of the flat parameters ``x`` and
        the floating-point buffers: returns ((d of both), version, samples, stop)."""
        if not self._finite(x, *floats):  # not moved, nor moving the centre
            with self.lock:
                self.counts[rank] = local_samples
                return (
                    (torch.zeros_like(x), [torch.zeros_like(f) for f in floats]),
                    self.version,
                    self.total_samples(),
                    self.stop,
                )
        with self.lock:
            self.counts[rank] = local_samples
            diff = self.rule.exchange(self, rank, x, floats, ints)
            self.version += 1
            if self.on_update is not None:
                self.on_update(self.total_samples())
            return diff, self.version, self.total_samples(), self.stop

    def rejoin(self, rank: int) -> None:
        """A replacement for worker ``rank`` (which died) joins: it is waited for again, and its
        clock starts at the slowest live worker's, so a staleness bound neither stops it nor
        the others."""
        with self.lock:
            others = [self.clocks[r] for r in self.active]
            self.clocks[rank] = min(others) if others else self.clocks[rank]
            self.active.add(rank)

    def finished(
        self,
        rank: int,
        local_samples: int | None = None,
        buffers: tuple[list[torch.Tensor], list[torch.Tensor]] | None = None,
    ) -> None:
        """Worker ``rank`` is done (or dead): stop waiting for it. ``buffers``: its own as it ended
        (finite ones replace those of its last push)."""
        if buffers is not None and not self._finite(*buffers[0], counted=False):
            buffers = None
        with self.lock:
            if local_samples is not None:
                self.counts[rank] = local_samples
            if buffers is not None:
                self._buffers[rank], self._ints = buffers
            self.active.discard(rank)
            self.rule.on_leave(self, rank)
            self.rule.release(self)
            self._release_barrier()
            done = self._take_done()
        _complete(done)

    def count(self, sent: int = 0, received: int = 0, rank: int = 0) -> None:
        """Bytes the transport moved: ``sent`` to workers, ``received`` from them (from worker
        ``rank``)."""
        with self.lock:
            self.bytes_sent += sent
            self.bytes_received += received
            self.received_by[rank] += received

    # -- for the rules and the role (call with the lock held) ------------------------------------
    def total_samples(self) -> int:
        return sum(self.counts)

    def apply(
        self, grad: torch.Tensor, hypers: list[float] | None = None, present: Present = None, clip: float | None = None
    ) -> None:
        """One optimiser step with ``grad`` (flat), its groups set to ``hypers`` first (checked by
        :meth:`push`; None: as they stand); a parameter absent from ``present`` (None: none is)
        gets no ``.grad``, so the optimiser skips it (no weight decay, no momentum), as PyTorch's
        does a parameter without a gradient. ``clip``: the gradients' global norm clipped to it
        first, as ``clip_grad_norm_`` does a process's."""
        for i, (p, (offset, n)) in enumerate(zip(self.params, self.spans)):
            # views: grad is this update's own tensor
            p.grad = grad[offset : offset + n].view_as(p) if present is None or present[i] else None
        if clip:
            torch.nn.utils.clip_grad_norm_([p for p in self.params if p.grad is not None], clip)
        if hypers is not None:
            self.hypers.apply(self.optimizer, hypers)
        self.optimizer.step()
        self.version += 1
        if self.on_update is not None:
            self.on_update(self.total_samples())

    def answer(self) -> Answer:
        flat = self.flat.clone()  # this version's weights
        return flat, self.version, self.total_samples(), self.stop

    def reply(self, fut: Future, value: Answer) -> None:
        """Complete ``fut`` with ``value`` once the lock is released."""
        self._done.append((fut, value))

    def sync_buffers(self) -> None:
        """Give the server's model the workers' buffers: the mean of each worker's most recent
        floating-point buffers (summed in rank order), the latest integer ones."""
        if self._buffers:
            ranks = sorted(self._buffers)
            with torch.no_grad():
                for i, b in enumerate(float_buffers(self.model)):
                    total = self._buffers[ranks[0]][i].clone()
                    for r in ranks[1:]:
                        total += self._buffers[r][i]
                    b.copy_((total / len(ranks)).view_as(b))
        if self._ints is not None:
            with torch.no_grad():
                for b, v in zip(int_buffers(self.model), self._ints):
                    b.copy_(v.view_as(b))

    def _take_done(self) -> list[tuple[Future, Answer | None]]:
        done, self._done = self._done, []
        return done

    def _release_barrier(self) -> None:
        if not self._waiting or len(self._waiting) < len(self.active):
            return
        if not self._started:
            self._started = True
            if self.on_start is not None:
                self.on_start()
        waiting, self._waiting = self._waiting, []
        self._done.extend((f, None) for f in waiting)

    # -- checkpoints (sync-ps: taken between rounds, when no gradient is pending) ----------------
    def state_dict(self) -> dict[str, Any]:
        """The server's state (call with the lock held)."""
        self.sync_buffers()
        return {
            "model": {k: v.detach().clone() for k, v in self.model.state_dict().items()},
            "optimizer": self.optimizer.state_dict(),
            "version": self.version,
            "counts": list(self.counts),
            "clocks": list(self.clocks),
            "staleness": {str(k): v for k, v in self.staleness.items()},
            "bytes_sent": self.bytes_sent,
            "bytes_received": self.bytes_received,
            "received_by": list(self.received_by),
            "buffers": {str(r): [b.clone() for b in bs] for r, bs in self._buffers.items()},
            "ints": None if self._ints is None else [b.clone() for b in self._ints],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        ckpt.restore(self.model, ckpt.of_type(state, "model", dict, "the model's state"))
        ckpt.restore(self.optimizer, ckpt.of_type(state, "optimizer", dict, "the optimiser's state"))
        self.version = ckpt.count(state, "version")
        self.bytes_sent, self.bytes_received = ckpt.count(state, "bytes_sent"), ckpt.count(state, "bytes_received")
        self.counts, self.clocks = self._per_worker(state, "counts"), self._per_worker(state, "clocks")
        self.received_by_known = "received_by" in state  # (none in a checkpoint of before 2026-11-29)
        self.received_by = self._per_worker(state, "received_by") if self.received_by_known else [0] * len(self.counts)
        staleness = ckpt.of_type(state, "staleness", dict, "a dict of staleness counts")
        self.staleness = Counter({int(k): ckpt.count(staleness, k) for k in staleness})
        self._buffers = {int(r): _fitting(b, float_buffers(self.model)) for r, b in state["buffers"].items()}
        self._ints = None if state["ints"] is None else _fitting(state["ints"], int_buffers(self.model))

    def _per_worker(self, state: dict[str, Any], key: str) -> list[int]:
        """``state[key]``: a count for the server and each worker, as :meth:`state_dict` writes it."""
        values = ckpt.of_type(state, key, list, "a list of counts")
        if len(values) != len(self.counts):
            raise BadField(key, values, f"a list of {len(self.counts)} counts (the server's and each worker's)")
        return [ckpt.count({key: v}, key) for v in values]

    def staleness_summary(self) -> dict[str, Any]:
        return staleness_stats(self.staleness)

    def figures(self) -> dict[str, float]:
        """The server's figures so far, for a ``server`` event (call with the lock held): updates,
        every byte sent by the server and its workers, and the staleness of applied gradients."""
        out: dict[str, float] = {"server_updates": self.version, "bytes_sent": self.bytes_sent + self.bytes_received}
        n = sum(self.staleness.values())
        if n:
            out["staleness_mean"] = sum(v * c for v, c in self.staleness.items()) / n
            out["staleness_max"] = max(self.staleness)
        return out


def _spans(tensors: list[torch.Tensor]) -> Iterator[tuple[int, int]]:
    """(offset, numel) of each of ``tensors`` in their flat concatenation."""
    offset = 0
    for t in tensors:
        yield offset, t.numel()
        offset += t.numel()


def _fitting(saved: list[torch.Tensor], like: list[torch.Tensor]) -> list[torch.Tensor]:
    """Saved buffers, one flat tensor per buffer of ``like`` (the model's), each of its size."""
    if not isinstance(saved, list) or [t.numel() for t in saved] != [b.numel() for b in like]:
        raise CheckpointError("the server's saved buffers do not fit its model (one flat tensor per buffer)")
    return saved


def _complete(done: list[tuple[Future, Answer | None]]) -> None:
    """Resolve futures (and so let replies be sent) outside the server's lock."""
    for fut, value in done:
        fut.set_result(value)


def staleness_stats(hist: Counter[int]) -> dict[str, Any]:
    """{mean, p50, p99, max, histogram} of how many versions old each applied gradient was."""
    n = sum(hist.values())
    if n == 0:
        return {"mean": None, "p50": None, "p99": None, "max": None, "histogram": {}}
    ordered = sorted(hist.items())

    def quantile(q: float) -> int:
        need = math.ceil(q * n)
        seen = 0
        for value, count in ordered:
            seen += count
            if seen >= need:
                return value
        return ordered[-1][0]

    return {
        "mean": sum(v * c for v, c in ordered) / n,
        "p50": quantile(0.5),
        "p99": quantile(0.99),
        "max": ordered[-1][0],
        "histogram": {str(v): c for v, c in ordered},
    }
