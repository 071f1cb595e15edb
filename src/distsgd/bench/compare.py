"""distsgd compare: the bench's table and plots for runs that already exist.

Each run directory gives its ``summary.json`` (the table's figures, the accuracy curves), its
``config.toml`` (the settings the runs share, shown above the table) and its ``metrics.jsonl``
(the samples/s curve of ``throughput_vs_time.png``). Nothing is re-run. The report is written
by :func:`.report.write`, as a bench's is: ``compare.json``, ``compare.md`` and the PNGs.
"""

from __future__ import annotations

import datetime as _dt
import json
import logging
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from distsgd import config as config_mod
from distsgd import rundir
from distsgd.algorithms import registry
from distsgd.bench import report
from distsgd.errors import ConfigError, DistsgdError

log = logging.getLogger(__name__)

# What the table and the plots read from each summary.json.
NEEDED = (
    "algo",
    "workers",
    "samples",
    "samples_per_s",
    "threads_per_worker",
    "final_test_accuracy",
    "time_to_target_s",
    "samples_to_target",
    "evals",
)


def compare_runs(run_dirs: list[Path], out: Path) -> dict[str, Any]:
    """Read every run in ``run_dirs``, write the report into ``out`` (created if need be; only the
    report's own files are replaced) and return it."""
    if not run_dirs:
        raise ConfigError("compare needs at least one run directory")
    entries = [load_run(d) for d in _with_benches_runs(run_dirs)]
    for entry, label in zip(entries, _labels(entries)):
        entry["algo"] = label
    result = {
        "kind": "compare",
        "date": _dt.date.today().isoformat(),
        "settings": _shared_settings(entries),
        "repeats": 1,
        "rows": report.rows(entries),
        "runs": entries,
    }
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--out {out} exists and is not a directory")
    _not_the_users(out)
    out.mkdir(parents=True, exist_ok=True)
    report.write(result, out, "compare")
    return result


# what a compare writes: its report and, as the runs make them, these plots
REPORT_FILES = (
    ("compare.json", "compare.md")
    + tuple(f"{what}_vs_{x}.png" for what in ("accuracy", "loss") for x in ("time", "samples"))
    + ("throughput_vs_time.png", "throughput_vs_workers.png")
)


def _not_the_users(out: Path) -> None:
    """Refuse, before writing anything, an ``--out`` that holds a file of the report's names which
    distsgd did not write (its ledger does not list it, nor an earlier compare's compare.json
    there): until 2026-12-01 the user's compare.md (or a plot's name) was replaced, an audit's.
    Other files there are left alone."""
    if not out.is_dir():
        return
    try:
        earlier = json.loads((out / "compare.json").read_text())
    except (OSError, ValueError):
        earlier = None
    ours: set[str] = set()
    if isinstance(earlier, dict) and earlier.get("kind") == "compare":
        ours = {"compare.json", "compare.md", *(p for p in earlier.get("plots", []) if isinstance(p, str))}
    theirs = [n for n in REPORT_FILES if (out / n).exists() and n not in ours and not rundir.wrote(out / n)]
    if theirs:
        raise ConfigError(
            f"--out {out} holds {', '.join(theirs)}, which distsgd did not write, and a compare writes files of "
            f"those names: choose another --out"
        )


def _with_benches_runs(run_dirs: list[Path]) -> list[Path]:
    """``run_dirs``, a bench's directory among them replaced by its runs (``DIR/runs/*``): those
    that finished (an interrupted bench's others are skipped, saying so). A bench's directory is
    one distsgd made (``bench.json``, or its marker) with ``runs/`` and no summary.json of its own
    (so ``distsgd compare runs/*`` takes a bench written under runs/). Another directory holding
    ``runs/`` (the one a user trains from) is no bench: until 2026-12-01 it was taken for one, its
    runs compared and a bench among them called unfinished, exit 0 (an audit's)."""
    out = []
    for d in run_dirs:
        runs = d / "runs"
        bench = (d / "bench.json").is_file() or rundir.is_ours(d)
        if d.is_dir() and runs.is_dir() and bench and not (d / "summary.json").exists():
            inside = sorted(p for p in runs.iterdir() if p.is_dir())
            for p in inside:
                if (p / "summary.json").is_file():
                    out.append(p)
                else:
                    log.warning("skipping %s: it did not finish (no summary.json)", p)
            if not any((p / "summary.json").is_file() for p in inside):
                raise ConfigError(f"{d} is a bench whose runs in {runs} have not finished (none has a summary.json)")
        else:
            out.append(d)
    return out


def load_run(run_dir: Path) -> dict[str, Any]:
    """A run as the report reads it: {run_dir, workers, repeat, summary, settings, throughput}."""
    if not run_dir.is_dir():
        raise ConfigError(f"{run_dir} is not a directory (compare takes run directories)")
    path = run_dir / "summary.json"
    if not path.is_file():
        raise ConfigError(f"{run_dir} has no summary.json: not a finished distsgd run")
    try:
        summary = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ConfigError(f"cannot read {path}: {exc}") from None
    missing = [k for k in NEEDED if not isinstance(summary, dict) or k not in summary]
    if missing:
        raise ConfigError(f"{path} is not a distsgd summary (no {', '.join(missing)})")
    _check(path, summary)
    return {
        "algo": summary["algo"],
        "workers": summary["workers"],
        "repeat": 0,
        "run_dir": str(run_dir),
        "summary": summary,
        "settings": _settings(run_dir, summary),
        "throughput": _throughput(run_dir),
    }


def _number(v: Any) -> bool:
    """A JSON number that a float holds (NaN and infinity too; not true or false)."""
    return isinstance(v, float) or (isinstance(v, int) and not isinstance(v, bool) and abs(v) <= sys.float_info.max)


def _whole(v: Any) -> bool:
    return _number(v) and isinstance(v, int)


def _hosts(v: Any) -> bool:
    keys = {"host", "address", "processes", "cores", "threads_per_process"}
    return not v or (isinstance(v, list) and all(isinstance(h, dict) and keys <= h.keys() for h in v))


def _staleness(v: Any) -> bool:
    return not isinstance(v, dict) or v.get("mean") is None or all(_number(v.get(k)) for k in ("mean", "p99", "max"))


TEXT = ("text", lambda v: isinstance(v, str))
COUNT = ("a whole number of at least 1", lambda v: _whole(v) and v >= 1)
NUMBER = ("a number", _number)
OR_NULL = ("a number or null", lambda v: v is None or _number(v))
# What compare and the report read from a summary.json (NEEDED: always there; the others may be
# absent), and what each must hold: (in words, the test).
FIELDS: dict[str, tuple[str, Callable[[Any], bool]]] = {
    "algo": TEXT,
    "workers": COUNT,
    "samples": NUMBER,
    "samples_per_s": NUMBER,
    "threads_per_worker": COUNT,
    "final_test_accuracy": OR_NULL,
    "time_to_target_s": OR_NULL,
    "samples_to_target": OR_NULL,
    "evals": ("a list of evaluations", lambda v: isinstance(v, list)),  # each one's fields: EVAL
    "final_test_loss": OR_NULL,
    "final_test_perplexity": OR_NULL,
    "bytes_sent_per_sample": OR_NULL,
    "target_accuracy": OR_NULL,  # settings, when the run has no config.toml
    "target_loss": OR_NULL,
    "host": TEXT,
    "failed_workers": ("a list of whole numbers", lambda v: isinstance(v, list) and all(map(_whole, v))),
    "staleness": ("an object with numbers mean, p99 and max", _staleness),
    "hosts": ("a list of hosts (objects with host, address, processes, cores, threads_per_process)", _hosts),
}
EVAL = {"samples": NUMBER, "train_wall_s": NUMBER, "test_accuracy": OR_NULL, "test_loss": OR_NULL}


def _check(path: Path, summary: dict[str, Any]) -> None:
    """Refuse (one line: the file, the key, what it holds and what it should) a summary whose
    fields the report cannot read."""

    def bad(key: str, value: Any, what: str) -> ConfigError:
        shown = json.dumps(value)
        return ConfigError(f'{path}: "{key}" is {shown if len(shown) <= 40 else shown[:37] + "..."}, not {what}')

    for key, (what, fits) in FIELDS.items():
        if key in summary and not fits(summary[key]):
            raise bad(key, summary[key], what)
    for i, entry in enumerate(summary["evals"]):
        if not isinstance(entry, dict):
            raise bad(f"evals[{i}]", entry, "an evaluation (an object)")
        for key, (what, fits) in EVAL.items():
            if key not in entry and key in ("samples", "train_wall_s"):
                raise ConfigError(f'{path}: "evals[{i}]" has no "{key}"')
            if key in entry and not fits(entry[key]):
                raise bad(f"evals[{i}].{key}", entry[key], what)


def _settings(run_dir: Path, summary: dict[str, Any]) -> dict[str, Any]:
    """The run's settings from its config.toml (the summary's few when it has none, or a bad one)."""
    path = run_dir / "config.toml"
    try:
        values = (
            config_mod.load_toml(path, option_names=registry.option_names()).to_dict() if path.is_file() else summary
        )
    except DistsgdError as exc:
        log.warning("%s: %s; using its summary.json", path, exc)
        values = summary
    return {k: values.get(k) for k in report.SETTINGS}


def _throughput(run_dir: Path) -> list[tuple[float, float]]:
    """(training time, samples/s) of every progress event in metrics.jsonl, in time order; lines a
    crashed run left half-written are skipped."""
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        log.warning("%s has no metrics.jsonl: no throughput curve for it", run_dir)
        return []
    points = []
    with path.open(encoding="utf-8", errors="replace") as fh:
        for line in fh:
            try:
                event = json.loads(line)
            except json.JSONDecodeError:
                continue
            if (
                isinstance(event, dict)
                and event.get("event") == "progress"
                and isinstance(event.get("train_wall_s"), (int, float))
                and isinstance(event.get("samples_per_s"), (int, float))
            ):
                points.append((float(event["train_wall_s"]), float(event["samples_per_s"])))
    return sorted(points)


def _shared_settings(entries: list[dict[str, Any]]) -> dict[str, Any]:
    """The settings every run has alike (so the table's header can name them once)."""
    first = entries[0]["settings"]
    return {k: v for k, v in first.items() if all(e["settings"].get(k) == v for e in entries[1:])}


def _labels(entries: list[dict[str, Any]]) -> list[str]:
    """Each run's name in the table: its directory's name, with the algorithm when the name lacks
    it; the path as given when two directories have the same name."""
    names = [Path(e["run_dir"]).name or e["run_dir"] for e in entries]
    if len(set(names)) < len(names):
        names = [e["run_dir"] for e in entries]
    labels = [n if e["summary"]["algo"] in n else f"{n} ({e['summary']['algo']})" for n, e in zip(names, entries)]
    seen: dict[str, int] = {}
    for i, label in enumerate(labels):  # the same directory given twice
        seen[label] = seen.get(label, 0) + 1
        if seen[label] > 1:
            labels[i] = f"{label} #{seen[label]}"
    return labels
