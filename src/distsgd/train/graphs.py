"""``--cuda-graphs``: a worker's step captured once in a CUDA graph and replayed.

A small model's step is launch-bound on a GPU: the host takes longer to launch its kernels than the
GPU to run them (resnet20 at batch 128 on an H200: 17-22k samples/s eager, 25-28k captured,
docs/BENCHMARKS.md). Captured, the forward, the loss, the backward, --clip-grad-norm and the
optimiser's update are one launch. Following PyTorch's "whole network capture": the first
``WARMUP`` full batches train eagerly on a side stream (cuDNN picks its kernels, the optimiser
makes its state), then the step is captured with the batch in static buffers, and every later full
batch is copied into them and replayed. Where the training tensors are on the device (no
``--augment``), the graph gathers each batch from them itself, and only the batch's indices are
copied in: a step's host work is then one copy and the replay. What the step does on the host (the
counters, the algorithm's ``after_step``, progress) runs after each replay, as ``run.step`` would. A batch of
another shape (the epoch's last, partial one) and evaluations run eagerly; the gradients and the
optimiser's state are the same tensors either way (``zero_grad(set_to_none=False)``).

What a graph replays is fixed when it is captured: the settings that would change it are refused
(:func:`graphs_refusal`), and so are algorithms whose step talks to other processes
(``Algorithm.graphable``). A capture that fails (an optimiser without ``capturable``, an operation
a graph cannot hold) says why in one warning and the worker trains eagerly. The capture itself
runs nothing (the replay after it trains its batch): like ``--compile``'s compiling, it is kept
off a worker's training clock and reported (``capture_s``); Hogwild!'s run has one clock for all
its threads, which runs on while one of them captures.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any, TypeVar

import torch
from torch import nn

from distsgd.train import device

if TYPE_CHECKING:
    from distsgd.config import RunConfig
    from distsgd.train.own_loop import Run

log = logging.getLogger(__name__)

WARMUP = 3  # eager full-batch steps before the capture (PyTorch's examples take 3)


class _Gate:
    """Hogwild!'s threads' steps share it; a capture has it alone. Steps (replays, and eager steps in
    warm-up or on a partial batch) run beside each other, as the threads are there for; a capture
    waits for the steps under way to end, and steps that come meanwhile wait for it (one capture a
    thread, at its start). On an H200, 4 threads capturing beside the others' steps failed
    ("operation failed due to a previous error during capture"), and a capture that fails leaves
    the CUDA generator marked as capturing: every later dropout in the process then raised. Until
    2026-12-01 one lock was held round every step too: the threads' launches then took turns, and 4
    threads of mnist_net did 1.11x one thread's samples/s where a bare loop's threads do 2.3x."""

    def __init__(self) -> None:
        self._cond = threading.Condition(threading.Lock())
        self._steps = 0  # steps under way
        self._waiting = 0  # captures waiting for them to end
        self._capturing = False

    @contextlib.contextmanager
    def step(self) -> Iterator[None]:
        with self._cond:
            while self._waiting or self._capturing:
                self._cond.wait()
            self._steps += 1
        try:
            yield
        finally:
            with self._cond:
                self._steps -= 1
                if not self._steps:
                    self._cond.notify_all()

    @contextlib.contextmanager
    def alone(self) -> Iterator[None]:
        with self._cond:
            self._waiting += 1
            try:  # (a Ctrl-C while it waits: the gate is the process's, and the next run's steps would wait on)
                while self._steps or self._capturing:
                    self._cond.wait()
            finally:
                self._waiting -= 1
                self._cond.notify_all()
            self._capturing = True
        try:
            yield
        finally:
            with self._cond:
                self._capturing = False
                self._cond.notify_all()


_GPU = _Gate()
T = TypeVar("T")


def drawn_in_steps(make: Callable[[], Iterable[T]]) -> Iterator[T]:
    """The batches of ``make()``, each drawn (and ``make()`` called) inside a step of the gate: a
    batch made on the GPU allocates and launches there (the epoch's order moved to it, a gather,
    --augment's crops drawn on the default CUDA generator), which another thread's capture must
    not meet, as a step must not. Until 2026-12-01 Hogwild!'s threads drew theirs beside another's
    capture (a CPU test's stand-in capture saw crops made while it ran)."""
    with _GPU.step():
        batches = iter(make())
    while True:
        with _GPU.step():
            try:
                batch = next(batches)
            except StopIteration:
                return
        yield batch


def graphs_refusal(cfg: "RunConfig", kind: str) -> str | None:
    """Why a worker's step cannot be captured in a CUDA graph with these settings on a ``kind``
    device ('cuda' or 'cpu'; None: it can). What a graph replays is fixed at capture: kernels,
    shapes, and any number the host gave them."""
    if cfg.precision == "fp16":
        return "fp16's loss scaler reads the GPU every step to skip overflowed ones; use --precision bf16 or fp32"
    if cfg.schedule != "constant" or cfg.lr_warmup_steps:
        return "the learning rate is fixed in a captured step: --schedule constant, no --lr-warmup-steps"
    if cfg.accumulate != 1:
        return "one batch a step (--accumulate 1)"
    if cfg.compile:
        return "--compile is the other way to cut launches (torch.compile's own graphs): choose one"
    if kind != "cuda":
        return "needs a CUDA GPU (--device cuda), and this run's device is the CPU"
    return None


class GraphedSteps:
    """One worker's captured step (see the module's docstring)."""

    def __init__(
        self,
        run: "Run",
        model: nn.Module,
        loss_fn: Callable,
        where: torch.device,
        source: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> None:
        self.run, self.model, self.loss_fn = run, model, loss_fn
        # the training tensors on the device, when the graph gathers each batch from them itself:
        # a step is then one copy (the batch's indices) and the replay, where it was two gathers,
        # two copies and the replay (half the host's time a step, benchmarks/host_step.py)
        self.source = source
        self.stream = torch.cuda.Stream(where) if where.type == "cuda" else None
        self.graph: Any = None
        self.shape: tuple | None = None  # the full batch's shapes and dtypes, from the first batch
        self.warm = 0
        self.failed: str | None = None  # why the capture failed (the worker then trains eagerly)
        self.replays = 0
        self.capture_s = 0.0  # the seconds capturing took, off the training clock
        self.static: tuple[torch.Tensor, ...] | None = None  # the graph's inputs: (x, y), or (indices,)

    def take(self, batch: tuple[torch.Tensor, ...], eager: Callable[[], None]) -> None:
        """One step on ``batch``, (x, y) or, with ``source``, (indices into it,): replayed once
        captured, if the batch is a full one; else ``eager()``, the loop's own step."""
        key = tuple((tuple(t.shape), t.dtype) for t in batch)
        if self.shape is None:
            self.shape = key
        if self.graph is None and self.failed is None and key == self.shape and self.warm >= WARMUP:
            with _GPU.alone():
                try:
                    self._capture(batch)
                except Exception as exc:  # noqa: BLE001 - any capture failure: say so once, train eagerly
                    first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
                    self.failed = f"{type(exc).__name__}: {first}"
                    log.warning("--cuda-graphs: the step could not be captured (%s); training eagerly", self.failed)
                    self.graph = None
        with _GPU.step():
            if self.failed is not None or key != self.shape:
                eager()
            elif self.graph is None:  # warming up
                with self._side_stream():
                    eager()
                self.warm += 1
            else:
                self._replay(batch)

    @contextlib.contextmanager
    def _side_stream(self) -> Iterator[None]:
        if self.stream is None:
            yield
            return
        self.stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.stream):
            yield
        torch.cuda.current_stream().wait_stream(self.stream)

    def _capture(self, batch: tuple[torch.Tensor, ...]) -> None:
        self.static = tuple(t.clone() for t in batch)
        clock = self.run._clock
        running = clock.running
        clock.pause()  # (after the warm-up steps' GPU work, which trained: it counts)
        began = time.perf_counter()
        try:
            with self._side_stream():
                self.graph = device.capture_step(self._device_step, self.stream)
        finally:
            self.capture_s += time.perf_counter() - began
            if running:
                clock.resume()

    def _device_step(self) -> None:
        """The step's GPU work, as captured: no host bookkeeping here (it would run once only)."""
        run = self.run
        assert self.static is not None
        if self.source is not None:  # the batch gathered here, in the graph, from its indices
            sx, sy = (t.index_select(0, self.static[0]) for t in self.source)
        else:
            sx, sy = self.static
        for opt in run._optimizers:
            opt.zero_grad(set_to_none=False)
        loss = self.loss_fn(self.model(sx), sy)
        loss.backward()
        run._loss_sum += loss.detach().float()
        if run._clip:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), run._clip)
        for real in run._real:
            real.update()

    def _replay(self, batch: tuple[torch.Tensor, ...]) -> None:
        assert self.static is not None
        for static, t in zip(self.static, batch):
            static.copy_(t, non_blocking=True)
        self.graph.replay()
        self.replays += 1
        self.run._replayed_step()

    def summary(self) -> dict[str, Any]:
        """What summary.json says of it: whether steps were replayed, how many, why not."""
        return {
            "cuda_graphs": self.replays > 0,
            "graph_replays": self.replays,
            "capture_s": round(self.capture_s, 3),
            **({"cuda_graphs_failed": self.failed} if self.failed else {}),
        }


__all__ = ["GraphedSteps", "WARMUP"]
