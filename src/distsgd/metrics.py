"""Metrics: the events a run emits, the files they go to, and the progress display.

Every event is one JSON object on one line of ``metrics.jsonl``:

- ``{"event": "progress", "samples", "epoch", "rank", "loss", "lr", "train_wall_s", "samples_per_s"}``
  (``epoch`` null in a user's loop that reads a stream: its epochs are not known; ``loss`` null in
  one that calls ``loss.backward()`` itself, not ``run.backward(loss)``) from a reporting worker (``rank``; several report in Hogwild! and parameter-server runs), plus
  the algorithm's own figures (``Algorithm.progress_figures``): ``bytes_sent`` for algorithms
  that communicate through a process group or a token ring (all workers' bytes so far); with
  ``--precision fp16``, ``loss_scale``, the reporting worker's GradScaler scale.
- ``{"event": "eval", "samples", "epoch", "train_wall_s", "test_accuracy", "test_loss"}``; a
  language model's also ``test_perplexity`` (exp of the loss per token) and ``test_bits_per_token``
  (the loss / ln 2); its ``test_accuracy`` is next-token accuracy over every token.
- ``{"event": "server", "samples", "train_wall_s", "server_updates", "bytes_sent", "staleness_mean",
  "staleness_max"}`` from a parameter server, as often as progress events: its updates so far,
  the bytes the server and its workers have sent so far (what summary.json's ``bytes_sent`` adds
  up at the end), and how stale the applied gradients were so far (versions; absent when the
  server applies no gradients, as in async easgd).
- ``{"event": "checkpoint", "seq", "samples", "epoch", "train_wall_s"}`` (``epoch``: the epochs
  trained, as a progress event's, not the index a resume goes on in; absent from Hogwild!'s and a
  parameter server's, whose checkpoints are taken apart from the workers' loops)

``samples`` always counts training samples processed by all workers together; ``train_wall_s``
is the training clock, which stops while the model is evaluated.

Sinks take these events: :class:`JsonlWriter` (``metrics.jsonl``), :class:`TensorBoardWriter`
(``--tensorboard``), the progress displays; :class:`Fanout` sends each event to several.
"""

from __future__ import annotations

import contextlib
import csv
import importlib
import json
import math
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, TextIO

from distsgd.errors import HOLD, ConfigError, DistsgdError, OutputError
from distsgd.rundir import record

if TYPE_CHECKING:
    from distsgd.config import RunConfig


class Sink(Protocol):
    def emit(self, event: dict[str, Any]) -> None: ...


class NullSink:
    def emit(self, event: dict[str, Any]) -> None:
        pass


class JsonlWriter:
    """Appends one JSON event per line and flushes, so a crashed run keeps what it logged."""

    def __init__(self, path: Path) -> None:
        self.path = path  # (in the run directory's ledger: open_sinks records it)
        self._fh = path.open("a", encoding="utf-8")

    def emit(self, event: dict[str, Any]) -> None:
        with self._naming_the_file():
            self._fh.write(json.dumps(event, separators=(",", ":")) + "\n")
            self._fh.flush()

    def close(self) -> None:
        with self._naming_the_file():
            self._fh.close()

    @contextlib.contextmanager
    def _naming_the_file(self) -> Iterator[None]:
        """A failed write (a full disk) names this file: the write's own error does not."""
        try:
            yield
        except OSError as exc:
            raise OSError(exc.errno, exc.strerror, str(self.path)) from exc


class CsvWriter:
    """``--logger csv``: metrics.jsonl's events as a table, one row per event, a column per figure
    (``event``, ``samples``, ``epoch``, ``train_wall_s`` first, then each new figure as it first
    appears; a figure an event does not have is an empty cell; lists and dicts as JSON). A figure
    seen for the first time rewrites the file with the wider header, so the file is a whole table
    at every moment (a run has a few thousand events at most)."""

    FIRST = ("event", "samples", "epoch", "train_wall_s")

    def __init__(self, path: Path) -> None:
        self.path = path  # (in the run directory's ledger: open_sinks records it)
        self.columns: list[str] = list(self.FIRST)
        self.rows: list[dict[str, Any]] = []
        if path.is_file():  # a run resumed in place: its rows so far stay (as metrics.jsonl's lines do)
            with path.open(encoding="utf-8", newline="") as f:
                earlier = csv.DictReader(f)
                self.rows = [dict(r) for r in earlier]
                self.columns += [c for c in earlier.fieldnames or () if c not in self.columns]
        self._fh = path.open("w", encoding="utf-8", newline="")
        self._write(rewrite=True)

    def emit(self, event: dict[str, Any]) -> None:
        row = {k: json.dumps(v, separators=(",", ":")) if isinstance(v, (list, dict)) else v for k, v in event.items()}
        self.rows.append(row)
        new = [k for k in row if k not in self.columns]
        self.columns += new
        self._write(rewrite=bool(new))

    def _write(self, rewrite: bool) -> None:
        try:
            if rewrite:
                self._fh.seek(0)
                self._fh.truncate()
                out = csv.DictWriter(self._fh, self.columns, restval="")
                out.writeheader()
                out.writerows(self.rows)
            else:
                csv.DictWriter(self._fh, self.columns, restval="").writerow(self.rows[-1])
            self._fh.flush()
        except OSError as exc:
            raise OSError(exc.errno, exc.strerror, str(self.path)) from exc

    def close(self) -> None:
        self._fh.close()


def _tree(folder: Path) -> list[Path]:
    """Every file under ``folder`` (to record in the run directory's ledger)."""
    return [p for p in folder.rglob("*") if p.is_file() or p.is_symlink()] if folder.is_dir() else []


BOOKKEEPING = ("event", "samples", "rank", "train_wall_s", "epoch")  # an event's axes and origin: no figure


def _tags(event: dict[str, Any]) -> dict[str, str]:
    """An event's figures' tags: distsgd's own under TensorBoard's names (``train/loss``,
    ``test/accuracy``, ...), and those of a user's loop by their names, a ``run.log(grad_norm=...)``
    under ``log/grad_norm`` and an evaluation's other figure, ``test_f1``, under ``test/f1`` (they
    reached metrics.jsonl and metrics.csv alone before 2026-11-29)."""
    kind = event.get("event", "")
    tags = dict(TensorBoardWriter.TAGS.get(kind, {}))
    if kind in ("log", "eval"):
        for key in event:
            if key not in tags and key not in BOOKKEEPING:
                tags[key] = f"log/{key}" if kind == "log" else f"test/{key.removeprefix('test_')}"
    return tags


def _figures(event: dict[str, Any]) -> dict[str, float]:
    """An event's figures under their tags (:func:`_tags`): the numbers a logger plots, the same
    names in every logger."""
    return {
        tag: float(event[key])
        for key, tag in _tags(event).items()
        if isinstance(event.get(key), (int, float)) and not isinstance(event.get(key), bool)
    }


def _summary_figures(summary: dict[str, Any]) -> dict[str, float]:
    figures = {f"summary/{k}": summary.get(k) for k in TensorBoardWriter.SUMMARY}
    return {k: float(v) for k, v in figures.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}


class WandbWriter:
    """``--logger wandb``: the run's figures in a W&B run (``wandb.init``), its settings the run's
    config, its summary figures the run's summary. Offline unless ``WANDB_MODE`` says otherwise: a
    run folder under ``<out>/wandb`` that ``wandb sync`` uploads later (no network meanwhile);
    ``WANDB_PROJECT`` names the project (default ``distsgd``). The x axis is ``samples`` (a metric
    every figure is plotted against, as TensorBoard's step), since the events of several reporting
    workers (Hogwild!, a parameter server) need not come in order of W&B's own step. A run
    resumed in place (``--resume`` into its own directory) goes on in the W&B run it started: the
    same id (a second offline folder of it, which ``wandb sync`` adds to the first), its changed
    settings updated in the config."""

    def __init__(self, out: Path, name: str, config: dict[str, Any], resumed: bool = False) -> None:
        import wandb

        self.out = out
        earlier = self.earlier_id(out) if resumed else None
        self.run = wandb.init(
            project=os.environ.get("WANDB_PROJECT") or "distsgd",
            name=name,
            dir=str(out),
            config=config if earlier is None else None,
            mode=os.environ.get("WANDB_MODE") or "offline",  # type: ignore[arg-type]
            settings=wandb.Settings(silent=True, console="off", x_disable_stats=True),
            id=earlier,
            resume="allow" if earlier is not None else None,
        )
        if earlier is not None:
            self.run.config.update(config, allow_val_change=True)
        self.run.define_metric("samples")
        self.run.define_metric("*", step_metric="samples")

    def emit(self, event: dict[str, Any]) -> None:
        figures = _figures(event)
        if figures:
            self.run.log({"samples": int(event["samples"]), **figures})

    def write_summary(self, summary: dict[str, Any]) -> None:
        self.run.summary.update(_summary_figures(summary))

    @staticmethod
    def earlier_id(out: Path) -> str | None:
        """The id of the W&B run this run directory's last run wrote (its folder,
        ``[offline-]run-<time>-<id>[-k]``), or None."""
        folders = sorted(p.name for p in (out / "wandb").glob("*run-*-*") if p.is_dir())
        if not folders:
            return None
        parts = folders[-1].split("-")
        return parts[3] if parts[0] == "offline" else parts[2]

    def close(self) -> None:
        self.run.finish(exit_code=1 if sys.exc_info()[0] is not None else 0)  # a run that failed says so
        record(*_tree(self.out / "wandb"))


class MlflowWriter:
    """``--logger mlflow``: the run's figures as an MLflow run's metrics (step: ``samples``), its
    settings the run's params, its summary figures metrics under ``summary/``, in the tracking
    store ``MLFLOW_TRACKING_URI`` names or else ``<out>/mlflow.db`` (SQLite, the store MLflow
    recommends since its file store went into maintenance: ``mlflow ui --backend-store-uri
    sqlite:///<out>/mlflow.db`` reads it); ``MLFLOW_EXPERIMENT_NAME`` names the experiment
    (default ``distsgd``). The run is tagged with its directory (``distsgd.out``): a run resumed in
    place goes on in it (its status RUNNING again, its metrics continued at their samples);
    MLflow's params cannot change, so a setting the resumed run changed is a tag
    ``distsgd.resumed.<name>`` (the latest value), and a new one a param."""

    OUT_TAG = "distsgd.out"

    def __init__(self, out: Path, name: str, config: dict[str, Any], resumed: bool = False) -> None:
        from mlflow.entities import Param, RunTag
        from mlflow.tracking import MlflowClient

        self.out = out
        uri = os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{(out / 'mlflow.db').resolve()}"
        self.client = MlflowClient(tracking_uri=uri)
        experiment = os.environ.get("MLFLOW_EXPERIMENT_NAME") or "distsgd"
        found = self.client.get_experiment_by_name(experiment)
        exp_id = found.experiment_id if found is not None else self.client.create_experiment(experiment)
        where = str(out.resolve())
        earlier = (
            self.client.search_runs(
                [exp_id], f"tags.`{self.OUT_TAG}` = '{where}'", order_by=["attributes.start_time DESC"], max_results=1
            )
            if resumed and "'" not in where
            else []
        )
        logged: dict[str, str] = {}
        if earlier:
            self.run_id = earlier[0].info.run_id
            logged = dict(earlier[0].data.params)
            self.client.update_run(self.run_id, status="RUNNING")
        else:
            self.run_id = self.client.create_run(exp_id, run_name=name, tags={self.OUT_TAG: where}).info.run_id
        values = {k: str(v)[:6000] for k, v in sorted(config.items()) if v is not None}
        params = [Param(k, v) for k, v in values.items() if k not in logged]
        changed = [RunTag(f"distsgd.resumed.{k}", v) for k, v in values.items() if k in logged and logged[k] != v]
        for i in range(0, len(params), 100):  # MLflow takes at most 100 params a batch
            self.client.log_batch(self.run_id, params=params[i : i + 100])
        if changed:
            self.client.log_batch(self.run_id, tags=changed)

    def emit(self, event: dict[str, Any]) -> None:
        from mlflow.entities import Metric

        figures = _figures(event)
        if figures:
            now, step = int(time.time() * 1000), int(event["samples"])
            self.client.log_batch(self.run_id, metrics=[Metric(k, v, now, step) for k, v in figures.items()])

    def write_summary(self, summary: dict[str, Any]) -> None:
        from mlflow.entities import Metric

        now, step = int(time.time() * 1000), int(summary.get("samples") or 0)
        figures = _summary_figures(summary)
        self.client.log_batch(self.run_id, metrics=[Metric(k, v, now, step) for k, v in figures.items()])

    def close(self) -> None:
        self.client.set_terminated(self.run_id, "FAILED" if sys.exc_info()[0] is not None else "FINISHED")
        record(*(p for p in self.out.glob("mlflow.db*") if p.is_file()), *_tree(self.out / "mlartifacts"))


class Fanout:
    """Sends every event to several sinks (the file and the progress display), but the evaluations
    ``logged`` names (:func:`logged_evals`: those a run resumed in place already holds)."""

    def __init__(self, *sinks: Sink, logged: frozenset[tuple[Any, Any]] = frozenset()) -> None:
        self.sinks, self.logged = sinks, logged

    def emit(self, event: dict[str, Any]) -> None:
        if self.logged and event.get("event") == "eval" and _eval_key(event) in self.logged:
            return
        with HOLD.held():  # a signal's stop once every sink has the event
            for sink in self.sinks:
                sink.emit(event)


def _eval_key(event: dict[str, Any]) -> tuple[Any, Any]:
    return event.get("samples"), event.get("train_wall_s")


def eval_events(path: Path) -> list[dict[str, Any]]:
    """The ``eval`` events ``path`` (a run directory's metrics.jsonl) holds, in order; a line a killed
    run left torn is skipped, and a missing or unreadable file (a device, /dev/full in a test,
    reads for ever) holds none."""
    if not path.is_file():
        return []
    found = []
    try:
        with path.open(encoding="utf-8", errors="replace") as fh:
            for line in fh:
                try:
                    event = json.loads(line)
                except ValueError:
                    continue
                if isinstance(event, dict) and event.get("event") == "eval":
                    found.append(event)
    except OSError:
        return []
    return found


def logged_evals(path: Path) -> frozenset[tuple[Any, Any]]:
    """The evaluations ``path`` (a run directory's metrics.jsonl) holds, by samples and training
    time. A run resumed in place evaluates the copies its checkpoint filed but had not measured
    (Hogwild!'s and the parameter server's watcher measure them once training ends), and the part
    before it, if it reached its end, logged them then: they are not logged twice."""
    return frozenset(_eval_key(event) for event in eval_events(path))


def require_logger(name: str) -> None:
    """Fail early, with the command that fixes it, when the package ``--logger name`` needs is missing."""
    module = {"tensorboard": "torch.utils.tensorboard", "wandb": "wandb", "mlflow": "mlflow.tracking"}.get(name)
    if module is None:
        return
    try:
        importlib.import_module(module)
    except ImportError:
        raise ConfigError(f"--logger {name} needs the {name} package: pip install 'distsgd[{name}]'") from None


def require_tensorboard() -> None:
    """Fail early, with the command that fixes it, when the tensorboard package is missing."""
    try:
        from torch.utils.tensorboard import SummaryWriter  # noqa: F401
    except ImportError:
        raise ConfigError("--tensorboard needs the tensorboard package: pip install 'distsgd[tensorboard]'") from None


class TensorBoardWriter:
    """Writes the run's events as TensorBoard scalars (``torch.utils.tensorboard``), one run per
    directory, so ``tensorboard --logdir runs/`` compares runs.

    Every scalar's step is ``samples`` (all workers' training samples) and its wall time is the
    run's start plus ``train_wall_s``, so TensorBoard's STEP axis reads samples and its WALL and
    RELATIVE axes read training time (evaluation excluded).
    """

    TAGS: dict[str, dict[str, str]] = {
        "progress": {
            "loss": "train/loss",
            "lr": "train/lr",
            "samples_per_s": "train/samples_per_s",
            "bytes_sent": "comm/bytes_sent",
            "loss_scale": "train/loss_scale",
        },
        "eval": {
            "test_accuracy": "test/accuracy",
            "test_loss": "test/loss",
            "test_perplexity": "test/perplexity",
            "test_bits_per_token": "test/bits_per_token",
        },
        "server": {
            "staleness_mean": "server/staleness_mean",
            "staleness_max": "server/staleness_max",
            "server_updates": "server/updates",
            "bytes_sent": "comm/bytes_sent",
        },
    }
    SUMMARY = (
        "final_test_accuracy",
        "final_test_loss",
        "final_test_perplexity",
        "samples_per_s",
        "tokens_per_s",
        "time_to_target_s",
        "samples_to_target",
        "bytes_sent_per_sample",
        "server_updates_per_s",
    )

    def __init__(self, logdir: Path, started: float, config_text: str = "") -> None:
        require_tensorboard()
        from torch.utils.tensorboard import SummaryWriter

        self.logdir, self.started = logdir, started
        self.failed: OSError | None = None  # a write's (a full disk), here or in its writer thread
        before = set(logdir.iterdir()) if logdir.is_dir() else set()
        _hold_tensorboard_failures()
        threads = set(threading.enumerate())
        self.threads: set[threading.Thread] = set()
        with self._naming_the_folder():
            self.writer = SummaryWriter(log_dir=str(logdir), flush_secs=10)
        self.threads = set(threading.enumerate()) - threads  # its writer thread
        record(*(set(logdir.iterdir()) - before))  # its event file, named by TensorBoard
        if config_text:
            with self._naming_the_folder():
                self.writer.add_text("config", "```\n" + config_text + "```", 0, walltime=started)

    def emit(self, event: dict[str, Any]) -> None:
        tags = _tags(event)
        if tags:
            self._scalars(tags, event, int(event["samples"]), float(event.get("train_wall_s", 0.0)))

    def write_summary(self, summary: dict[str, Any]) -> None:
        """summary.json's headline figures, under ``summary/``, at the run's last step."""
        figures = {k: summary.get(k) for k in self.SUMMARY}
        stale = summary.get("staleness")
        if isinstance(stale, dict):
            figures.update(staleness_mean=stale.get("mean"), staleness_p99=stale.get("p99"))
        self._scalars(
            {k: f"summary/{k}" for k in figures}, figures, int(summary["samples"]), float(summary["train_wall_s"])
        )

    def _scalars(self, tags: dict[str, str], values: dict[str, Any], step: int, train_s: float) -> None:
        with self._naming_the_folder():
            for key, tag in tags.items():
                value = values.get(key)
                if isinstance(value, (int, float)) and not isinstance(value, bool):
                    self.writer.add_scalar(tag, value, step, walltime=self.started + train_s)

    def close(self) -> None:
        with self._naming_the_folder():
            self.writer.close()

    @contextlib.contextmanager
    def _naming_the_folder(self) -> Iterator[None]:
        """A failed write (a full disk), here or in TensorBoard's writer thread, names the folder:
        the write's own error does not (and the thread's would print its traceback)."""
        if self.failed is None:
            try:
                yield
            except OSError as exc:
                self.failed = exc
        self.failed = self.failed or next((_FAILED[t] for t in self.threads if t in _FAILED), None)
        if self.failed is not None:
            raise OSError(self.failed.errno, self.failed.strerror, str(self.logdir)) from self.failed


_FAILED: dict[threading.Thread, OSError] = {}  # TensorBoard's writer threads that met an OSError


def _hold_tensorboard_failures() -> None:
    """TensorBoard's writer threads re-raise a failed write (a full disk), which threading prints
    as a traceback: an ``OSError`` of theirs is kept in ``_FAILED`` instead, for their writer to
    say in one line (TensorBoard's writer also raises it again at its next call)."""
    if getattr(threading.excepthook, "holds_tensorboard_failures", False):
        return  # (a test framework may have put its own back since)
    previous = threading.excepthook

    def hook(args: Any) -> None:
        thread = args.thread
        if (
            thread is not None
            and type(thread).__module__.startswith("tensorboard.")
            and isinstance(args.exc_value, OSError)
        ):
            _FAILED[thread] = args.exc_value
            return
        previous(args)

    hook.holds_tensorboard_failures = True  # type: ignore[attr-defined]
    threading.excepthook = hook


class TrainClock:
    """Wall time spent training: ``pause()`` around evaluation so it does not count. ``sync``: what
    to call before a reading (a GPU's synchronize: work queued on it counts when it is done)."""

    def __init__(self, sync: Callable[[], None] | None = None) -> None:
        self.sync = sync
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
            if self.sync is not None:
                self.sync()
            self._paused_at = time.perf_counter()

    def resume(self) -> None:
        if self._paused_at is not None:
            self._paused_total += time.perf_counter() - self._paused_at
            self._paused_at = None

    @property
    def running(self) -> bool:
        return self._paused_at is None

    def elapsed(self) -> float:
        if self._paused_at is None and self.sync is not None:
            self.sync()
        now = self._paused_at if self._paused_at is not None else time.perf_counter()
        return now - self._start - self._paused_total


def human_bytes(n: float) -> str:
    """1234567 -> '1.2MB' (powers of 1000)."""
    for unit in ("B", "kB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f}{unit}" if unit == "B" else f"{n:.1f}{unit}"
        n /= 1000
    return f"{n:.1f}TB"  # pragma: no cover - the loop returns


class _Figures:
    """What the displays show besides loss and accuracy, as it was last reported: bytes sent (a
    progress or server event) and a parameter server's staleness so far (a server event)."""

    def __init__(self) -> None:
        self.bytes_sent: float | None = None
        self.staleness: float | None = None

    def note(self, event: dict[str, Any]) -> None:
        if event.get("event") not in ("progress", "server"):
            return
        if event.get("bytes_sent") is not None:
            self.bytes_sent = event["bytes_sent"]
        if event.get("staleness_mean") is not None:
            self.staleness = event["staleness_mean"]

    def items(self) -> dict[str, str]:
        out = {}
        if self.bytes_sent is not None:
            out["sent"] = human_bytes(self.bytes_sent)
        if self.staleness is not None:
            out["staleness"] = f"{self.staleness:.2f}"
        return out


class LineProgress:
    """Plain progress lines (for logs and pipes): one per evaluation and at most one per 10 s,
    with the bytes sent so far and, for a parameter server, the mean staleness so far."""

    def __init__(self, stream: TextIO | None = None, every_s: float = 10.0) -> None:
        self.stream = stream or sys.stderr
        self.every_s = every_s
        self._last = 0.0
        self._acc: float | None = None
        self.figures = _Figures()

    def emit(self, event: dict[str, Any]) -> None:
        kind = event.get("event")
        self.figures.note(event)
        if kind == "eval":
            self._acc = event["test_accuracy"]
            shown = [
                *([f"test_acc={event['test_accuracy']:.4f}"] if event["test_accuracy"] is not None else []),
                *([f"test_loss={event['test_loss']:.4f}"] if event.get("test_loss") is not None else []),
                *([f"ppl={event['test_perplexity']:.3f}"] if "test_perplexity" in event else []),
                f"train_s={event['train_wall_s']:.1f}",
            ]
            self._write(f"eval  samples={event['samples']}{_epoch(event)} " + " ".join(shown))
        elif kind == "progress" and time.monotonic() - self._last >= self.every_s:
            self._last = time.monotonic()
            extra = "".join(f" {k}={v}" for k, v in self.figures.items().items())
            loss = f" loss={event['loss']:.4f}" if event.get("loss") is not None else ""
            self._write(
                f"train samples={event['samples']}{_epoch(event)}{loss} samples/s={event['samples_per_s']:.0f}{extra}"
            )

    def _write(self, line: str) -> None:
        self.stream.write(line + "\n")
        self.stream.flush()

    def close(self) -> None:
        pass


def _epoch(event: dict[str, Any]) -> str:
    """`` epoch=E`` of a progress line; nothing where the epoch is not known (a user's loop that
    reads a stream)."""
    return "" if event.get("epoch") is None else f" epoch={event['epoch']:.2f}"


class BarProgress:
    """A tqdm bar on a terminal: samples, loss, samples/s, the last test accuracy, the bytes sent
    so far and, for a parameter server, the mean staleness so far."""

    def __init__(self, total: int | None, desc: str) -> None:
        from tqdm import tqdm

        self.bar = tqdm(total=total, unit="sample", unit_scale=True, desc=desc, dynamic_ncols=True, file=sys.stderr)
        self._acc: float | None = None
        self._loss: float | None = None
        self._ppl: float | None = None
        self.figures = _Figures()

    def emit(self, event: dict[str, Any]) -> None:
        kind = event.get("event")
        self.figures.note(event)
        if kind == "eval":
            self._acc = event["test_accuracy"] if event["test_accuracy"] is not None else self._acc
            self._ppl = event.get("test_perplexity", self._ppl)
        if kind == "progress":
            self._loss = event["loss"]
        if kind in ("progress", "eval", "server"):
            self.bar.update(max(0, event["samples"] - self.bar.n))
            self.bar.set_postfix(self.postfix(), refresh=False)

    def postfix(self) -> dict[str, str]:
        post = {} if self._loss is None else {"loss": f"{self._loss:.4f}"}
        if self._acc is not None:
            post["test_acc"] = f"{self._acc:.4f}"
        if self._ppl is not None:
            post["test_ppl"] = f"{self._ppl:.3f}"
        return {**post, **self.figures.items()}

    def close(self) -> None:
        self.bar.close()


def make_progress(quiet: bool, total: int | None, desc: str) -> Sink:
    """The display that fits: nothing with ``quiet``, a bar on a terminal, plain lines otherwise."""
    if quiet:
        return NullSink()
    if sys.stderr.isatty():
        return BarProgress(total, desc)
    return LineProgress()


def lm_figures(loss: float) -> dict[str, float]:
    """A language model's test loss (nats per token) as perplexity and bits per token."""
    return {"test_perplexity": math.exp(min(loss, 700.0)), "test_bits_per_token": loss / math.log(2)}


def reached(event: dict[str, Any], target_accuracy: float | None, target_loss: float | None = None) -> bool:
    """Whether an evaluation reached the target: the accuracy if one is set, else the loss."""
    if target_accuracy is not None:
        return event["test_accuracy"] is not None and event["test_accuracy"] >= target_accuracy
    return target_loss is not None and event.get("test_loss") is not None and event["test_loss"] <= target_loss


def first_reaching(
    evals: list[dict[str, Any]], target_accuracy: float | None, target_loss: float | None = None
) -> dict[str, Any] | None:
    """The first evaluation that reached the target (accuracy, else loss)."""
    for e in evals:
        if reached(e, target_accuracy, target_loss):
            return e
    return None


def open_sinks(
    cfg: "RunConfig", out: Path | None, tb_dir: Path | None, started: float, settings_text: str
) -> list[Sink]:
    """A run's files of events: metrics.jsonl and ``--logger``'s sinks in the run directory ``out``
    (the chief's, which writes it), and ``--tensorboard``'s event file in ``tb_dir``."""
    made: list[Sink] = []
    try:
        if out is not None:
            tables = [out / "metrics.jsonl", *([out / "metrics.csv"] if "csv" in cfg.loggers else [])]
            record(*tables)  # in the run directory's ledger before they are written: what --overwrite may delete
            made += [JsonlWriter(tables[0]), *(CsvWriter(path) for path in tables[1:])]
            config = cfg.to_dict()
            in_place = cfg.resumes_in_place  # goes on in its logger runs
            for name, kind in (("wandb", WandbWriter), ("mlflow", MlflowWriter)):
                if name in cfg.loggers:
                    made.append(_started(name, lambda: kind(out, out.name, config, resumed=in_place)))
        if tb_dir is not None:
            made.append(TensorBoardWriter(tb_dir, started, settings_text))
    except BaseException:  # those started end as a failed run's (their files in the ledger: a rerun may replace them)
        close_sinks(made[::-1])
        raise
    return made


def close_sinks(sinks: list[Sink]) -> DistsgdError | None:
    """Closes every sink, whichever of them fails to (one that raised must not leave the others
    open: a logger's run unended, TensorBoard's last events unwritten). Returns the first failure
    as one line, for the caller to raise once the run's model is saved; None if all closed."""
    failed: DistsgdError | None = None
    for sink in sinks:
        close = getattr(sink, "close", None)
        if close is None:
            continue
        try:
            close()
        except OSError as exc:  # metrics.jsonl's or the event file's last write (a full disk)
            failed = failed or OutputError.of(exc)
        except Exception as exc:
            said = " ".join(line.strip() for line in str(exc).splitlines() if line.strip()) or type(exc).__name__
            what = {WandbWriter: "--logger wandb", MlflowWriter: "--logger mlflow"}.get(type(sink), type(sink).__name__)
            failed = failed or OutputError(f"{what} could not end its run: {said[:400]}")
    return failed


def _started(name: str, start: Callable[[], Sink]) -> Sink:
    """``--logger name``'s sink, or one line where it cannot start (its settings, WANDB_MODE or
    MLFLOW_TRACKING_URI; its store)."""
    try:
        return start()
    except Exception as exc:
        said = " ".join(line.strip() for line in str(exc).splitlines() if line.strip()) or type(exc).__name__
        raise ConfigError(f"--logger {name} could not start its run: {said[:400]}") from None


def require_extras(loggers: tuple[str, ...] | list[str], tensorboard: bool) -> None:
    """The packages ``--logger``'s names and ``--tensorboard`` need, there: else one line naming
    the extra."""
    if tensorboard:
        require_tensorboard()
    for name in loggers:
        require_logger(name)
