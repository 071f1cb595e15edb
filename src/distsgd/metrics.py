"""Metrics: the events a run emits, the files they go to, and the progress display.

Every event is one JSON object on one line of ``metrics.jsonl``:

- ``{"event": "progress", "samples", "epoch", "loss", "lr", "train_wall_s", "samples_per_s"}``
- ``{"event": "eval", "samples", "epoch", "train_wall_s", "test_accuracy", "test_loss"}``

``samples`` always counts training samples processed by all workers together; ``train_wall_s``
is the training clock, which stops while the model is evaluated.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any, Protocol, TextIO


class Sink(Protocol):
    def emit(self, event: dict[str, Any]) -> None: ...


class NullSink:
    def emit(self, event: dict[str, Any]) -> None:
        pass


class JsonlWriter:
    """Appends one JSON event per line and flushes, so a crashed run keeps what it logged."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._fh = path.open("a", encoding="utf-8")

    def emit(self, event: dict[str, Any]) -> None:
        self._fh.write(json.dumps(event, separators=(",", ":")) + "\n")
        self._fh.flush()

    def close(self) -> None:
        self._fh.close()


class Fanout:
    """Sends every event to several sinks (the file and the progress display)."""

    def __init__(self, *sinks: Sink) -> None:
        self.sinks = sinks

    def emit(self, event: dict[str, Any]) -> None:
        for sink in self.sinks:
            sink.emit(event)


class TrainClock:
    """Wall time spent training: ``pause()`` around evaluation so it does not count."""

    def __init__(self) -> None:
        self.restart()

    def restart(self) -> None:
        self._start = time.perf_counter()
        self._paused_total = 0.0
        self._paused_at: float | None = None

    def add(self, seconds: float) -> None:
        """Count ``seconds`` of earlier training (a resumed run)."""
        self._start -= seconds

    def pause(self) -> None:
        if self._paused_at is None:
            self._paused_at = time.perf_counter()

    def resume(self) -> None:
        if self._paused_at is not None:
            self._paused_total += time.perf_counter() - self._paused_at
            self._paused_at = None

    def elapsed(self) -> float:
        now = self._paused_at if self._paused_at is not None else time.perf_counter()
        return now - self._start - self._paused_total


class LineProgress:
    """Plain progress lines (for logs and pipes): one per evaluation and at most one per 10 s."""

    def __init__(self, stream: TextIO | None = None, every_s: float = 10.0) -> None:
        self.stream = stream or sys.stderr
        self.every_s = every_s
        self._last = 0.0
        self._acc: float | None = None

    def emit(self, event: dict[str, Any]) -> None:
        kind = event.get("event")
        if kind == "eval":
            self._acc = event["test_accuracy"]
            acc = f"test_acc={event['test_accuracy']:.4f} " if event["test_accuracy"] is not None else ""
            self._write(f"eval  samples={event['samples']} epoch={event['epoch']:.2f} "
                        f"{acc}test_loss={event['test_loss']:.4f} train_s={event['train_wall_s']:.1f}")
        elif kind == "progress" and time.monotonic() - self._last >= self.every_s:
            self._last = time.monotonic()
            self._write(f"train samples={event['samples']} epoch={event['epoch']:.2f} loss={event['loss']:.4f} "
                        f"samples/s={event['samples_per_s']:.0f}")

    def _write(self, line: str) -> None:
        self.stream.write(line + "\n")
        self.stream.flush()

    def close(self) -> None:
        pass


class BarProgress:
    """A tqdm bar on a terminal: samples, loss, samples/s and the last test accuracy."""

    def __init__(self, total: int | None, desc: str) -> None:
        from tqdm import tqdm

        self.bar = tqdm(total=total, unit="sample", unit_scale=True, desc=desc, dynamic_ncols=True, file=sys.stderr)
        self._acc: float | None = None

    def emit(self, event: dict[str, Any]) -> None:
        kind = event.get("event")
        if kind == "eval":
            self._acc = event["test_accuracy"] if event["test_accuracy"] is not None else self._acc
        if kind in ("progress", "eval"):
            self.bar.update(max(0, event["samples"] - self.bar.n))
            post = {"loss": f"{event['loss']:.4f}"} if "loss" in event else {}
            if self._acc is not None:
                post["test_acc"] = f"{self._acc:.4f}"
            if post:
                self.bar.set_postfix(post, refresh=False)

    def close(self) -> None:
        self.bar.close()


def make_progress(quiet: bool, total: int | None, desc: str) -> Any:
    """The display that fits: nothing with ``quiet``, a bar on a terminal, plain lines otherwise."""
    if quiet:
        return NullSink()
    if sys.stderr.isatty():
        return BarProgress(total, desc)
    return LineProgress()


def reached(event: dict[str, Any], target_accuracy: float | None, target_loss: float | None = None) -> bool:
    """Whether an evaluation reached the target: the accuracy if one is set, else the loss."""
    if target_accuracy is not None:
        return event["test_accuracy"] is not None and event["test_accuracy"] >= target_accuracy
    return target_loss is not None and event["test_loss"] <= target_loss


def first_reaching(evals: list[dict[str, Any]], target_accuracy: float | None,
                   target_loss: float | None = None) -> dict[str, Any] | None:
    """The first evaluation that reached the target (accuracy, else loss)."""
    for e in evals:
        if reached(e, target_accuracy, target_loss):
            return e
    return None
