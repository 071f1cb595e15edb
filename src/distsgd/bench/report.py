"""Derived figures, the markdown table and the plots of a bench."""

from __future__ import annotations

import datetime as _dt
import json
import logging
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from distsgd.algorithms.registry import baseline as baseline_name
from distsgd.config import RunConfig
from distsgd.rundir import record

log = logging.getLogger(__name__)


def _stats(values: Sequence[float | None]) -> dict[str, float] | None:
    """Median, min and max of the values given (None: not measured, left out)."""
    present = [v for v in values if v is not None]
    if not present:
        return None
    return {"median": statistics.median(present), "min": min(present), "max": max(present)}


SETTINGS = (
    "dataset",
    "model",
    "epochs",
    "max_samples",
    "batch_size",
    "lr",
    "momentum",
    "optimizer",
    "eval_every",
    "target_accuracy",
    "target_loss",
    "context",
    "threads_per_worker",
    "partition",
    "straggler",
    "seed",
)  # shown above a table


def derive(runs: list[dict[str, Any]], machine: dict[str, Any], base: RunConfig, repeats: int) -> dict[str, Any]:
    """A bench's report: its runs grouped by (algorithm, workers), medians with min-max over repeats."""
    settings = {k: v for k, v in base.to_dict().items() if k in SETTINGS}
    return {
        "date": _dt.date.today().isoformat(),
        "machine": machine,
        "settings": settings,
        "repeats": repeats,
        "rows": rows(runs),
        "runs": runs,
    }


WORKLOAD = ("dataset", "model", "batch_size", "context", "precision", "device")  # a scaling baseline's, alike


def _workload(summary: dict[str, Any]) -> tuple[Any, ...]:
    return tuple(summary.get(k) for k in WORKLOAD)


def rows(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per (label, workers) of ``runs`` (entries {algo: label, workers, repeat, summary}):
    the figures of the table, each a median with min-max over the group's repeats. A row's scaling
    baseline is the 1-worker single runs of its workload (:data:`WORKLOAD`: compare's runs may
    differ), else its own algorithm's 1-worker runs."""
    groups: dict[tuple[str, int], list[dict[str, Any]]] = {}
    for entry in runs:
        groups.setdefault((entry["algo"], entry["workers"]), []).append(entry["summary"])
    singles = [s for (a, w), ss in groups.items() if w == 1 for s in ss if s["algo"] == baseline_name()]
    out = []
    for (algo, workers), summaries in groups.items():
        work = _workload(summaries[0])
        single = [s["samples_per_s"] for s in singles if _workload(s) == work]
        own_one = [s["samples_per_s"] for s in groups.get((algo, 1), [])]
        baseline = statistics.median(single) if single else (statistics.median(own_one) if own_one else None)
        throughput = _stats([s["samples_per_s"] for s in summaries])
        reached = [s for s in summaries if s["time_to_target_s"] is not None]
        targets = {
            _goal(s) for s in summaries if s.get("target_accuracy") is not None or s.get("target_loss") is not None
        }
        stale = [
            s["staleness"]
            for s in summaries
            if isinstance(s.get("staleness"), dict) and s["staleness"].get("mean") is not None
        ]
        out.append(
            {
                "algo": algo,
                "workers": workers,
                "repeats": len(summaries),
                "threads_per_worker": summaries[0]["threads_per_worker"],
                "samples_per_s": throughput,
                "scaling_efficiency": (throughput["median"] / (workers * baseline))
                if baseline and throughput
                else None,
                "time_to_target_s": _stats([s["time_to_target_s"] for s in reached]),
                "samples_to_target": _stats([s["samples_to_target"] for s in reached]),
                # "-": none of its runs had a target; its target where the table's header cannot name it
                "reached_target": f"{len(reached)}/{len(summaries)}" if targets else "-",
                "target": targets.pop() if len(targets) == 1 else None,
                "final_test_accuracy": _stats([s["final_test_accuracy"] for s in summaries]),
                "final_test_loss": _stats([s.get("final_test_loss") for s in summaries]),
                "final_test_perplexity": _stats([s.get("final_test_perplexity") for s in summaries]),
                "lm": any(s.get("task") == "lm" for s in summaries),
                "samples": _stats([s["samples"] for s in summaries]),
                "bytes_sent_per_sample": _stats([s.get("bytes_sent_per_sample") for s in summaries]),
                "staleness_mean": _stats([st["mean"] for st in stale]),
                "staleness_p99": _stats([st["p99"] for st in stale]),
                "staleness_max": _stats([st["max"] for st in stale]),
                "failed_workers": sorted({w for s in summaries for w in s.get("failed_workers", [])}),
            }
        )
    return out


def write(report: dict[str, Any], out: Path, name: str) -> list[str]:
    """What bench and compare both write into ``out``: ``<name>.json`` (the report), ``<name>.md``
    (:func:`markdown`) and the plots (:func:`plots`); returns the plots' file names."""
    record(out / f"{name}.json", out / f"{name}.md")
    (out / f"{name}.json").write_text(json.dumps(report, indent=2) + "\n")  # kept even if plotting fails
    (out / f"{name}.md").write_text(markdown(report))
    report["plots"] = plots(report, out)
    (out / f"{name}.json").write_text(json.dumps(report, indent=2) + "\n")
    return report["plots"]


def _fmt(stat: dict[str, float] | None, fmt: str = "{:.0f}", spread: bool = True) -> str:
    if stat is None:
        return "-"
    text = fmt.format(stat["median"])
    if spread and stat["min"] != stat["max"]:
        text += f" ({fmt.format(stat['min'])}-{fmt.format(stat['max'])})"
    return text


def table(report: dict[str, Any]) -> tuple[list[str], list[list[str]]]:
    """The table's header and rows as text cells (the markdown table, and compare's terminal table)."""
    goal = _goal(report["settings"])
    lm = any(r.get("lm") for r in report["rows"])  # language models: the loss per token and its perplexity too
    # a regression's figure is its loss alone (no accuracy): a loss column wherever one is in the table
    losses = lm or any(r["final_test_accuracy"] is None and r.get("final_test_loss") for r in report["rows"])
    header = [
        "run" if report.get("kind") == "compare" else "algorithm",
        "workers",
        "threads/worker",
        "samples/s",
        "scaling eff.",
        f"time to {goal} (s)",
        f"samples to {goal}",
        "reached",
        "final acc",
        *(["final loss"] if losses else []),
        *(["final perplexity"] if lm else []),
        "bytes/sample",
        "staleness mean / p99",
    ]
    cells = []
    for r in report["rows"]:
        stale = (
            "-"
            if r["staleness_mean"] is None
            else f"{r['staleness_mean']['median']:.2f} / {r['staleness_p99']['median']:.0f}"
        )
        eff = "-" if r["scaling_efficiency"] is None else f"{r['scaling_efficiency']:.2f}"
        cells.append(
            [
                r["algo"],
                str(r["workers"]),
                str(r["threads_per_worker"]),
                _fmt(r["samples_per_s"]),
                eff,
                _fmt(r["time_to_target_s"], "{:.1f}"),
                _fmt(r["samples_to_target"], "{:.0f}"),
                r["reached_target"] + (f" of {r['target']}" if r.get("target") and goal != r["target"] else ""),
                _fmt(r["final_test_accuracy"], "{:.4f}"),
                *([_fmt(r.get("final_test_loss"), "{:.4f}")] if losses else []),
                *([_fmt(r.get("final_test_perplexity"), "{:.3f}")] if lm else []),
                _fmt(r["bytes_sent_per_sample"], "{:.0f}", False),
                stale,
            ]
        )
    return header, cells


def markdown(report: dict[str, Any]) -> str:
    """``bench.md`` or ``compare.md``: what was compared, the table, and how to read it."""
    lines = _compare_heading(report) if report.get("kind") == "compare" else _bench_heading(report)
    header, cells = table(report)
    lines += ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in cells]
    for r in report["rows"]:
        if r["failed_workers"]:
            lines.append(f"\n{r['algo']} x{r['workers']}: failed workers {r['failed_workers']}")
    hosts = [
        (e["algo"], e["summary"]["hosts"]) for e in report["runs"] if e["repeat"] == 0 and e["summary"].get("hosts")
    ]
    if hosts:
        lines.append("\nHosts (cores of this machine each host ran on; threads per process):")
        lines += [
            f"- {algo}: "
            + "; ".join(
                f"host {h['host']} ({h['address']}): {h['processes']} process(es) on "
                f"core(s) {','.join(map(str, h['cores']))}, {h['threads_per_process']} "
                f"thread(s) each"
                for h in each
            )
            for algo, each in hosts
        ]
    lines.append("")
    if report.get("kind") == "compare":
        lines.append(
            f"Scaling efficiency: samples/s over (workers x the median samples/s of the 1-worker {baseline_name()} "
            f"runs among those compared of the same {', '.join(WORKLOAD)}; - without one)."
        )
    else:
        lines.append(
            f"Scaling efficiency: samples/s over (workers x the 1-worker {baseline_name()} samples/s, or the "
            f"algorithm's own 1-worker run when {baseline_name()} is not in the bench)."
        )
    return "\n".join(lines) + "\n"


def _bench_heading(bench: dict[str, Any]) -> list[str]:
    m, s = bench["machine"], bench["settings"]
    return [
        f"# distsgd bench, {bench['date']}",
        "",
        f"Machine: {m['host']}, {m['cpu']}, {m['cores']} cores; torch {m['torch_version']}, Python {m['python']}.",
        "Settings: " + ", ".join(_setting(k, v, bench["repeats"]) for k, v in s.items() if v is not None) + ".",
        f"Medians over {bench['repeats']} repeat(s), with (min-max) where they differ. Configurations ran one "
        "after another.",
        *(
            [
                f"Network (--network {bench['network']}): each run as {bench['link']}; the hosts are listed below "
                "the table."
            ]
            if bench.get("network")
            else []
        ),
        "",
    ]


def _setting(name: str, value: Any, repeats: int) -> str:
    """A setting as the Settings line shows it; repeat r of a bench runs with seed + r."""
    if name == "seed" and repeats > 1:
        return f"seed={value}..{value + repeats - 1} (repeat r: {value} + r)"
    return f"{name}={value}"


def _compare_heading(report: dict[str, Any]) -> list[str]:
    hosts = sorted({e["summary"].get("host", "?") for e in report["runs"]})
    lines = [f"# distsgd compare, {report['date']}", "", "| run | directory | started | host |", "|---|---|---|---|"]
    lines += [
        f"| {e['algo']} | {e['run_dir']} | {e['summary'].get('started_at', '-')} | {e['summary'].get('host', '-')} |"
        for e in report["runs"]
    ]
    shared = ", ".join(f"{k}={v}" for k, v in report["settings"].items() if v is not None)
    lines += ["", f"Settings all runs share: {shared or 'none'}."]
    if len(hosts) > 1:
        lines.append(f"The runs ran on different machines ({', '.join(hosts)}): compare their speeds with care.")
    lines += ["Each run is its own row: figures from its summary.json.", ""]
    return lines


def _pct(target: float | None) -> str:
    """A target accuracy as a percentage, with the digits it was given (0.755 is 75.5%, not 76%)."""
    return "target" if target is None else f"{float(f'{100 * target:.6g}'):g}%"


def _goal(settings: dict[str, Any]) -> str:
    """The target's name in headers: an accuracy, else a test loss."""
    if settings.get("target_accuracy") is None and settings.get("target_loss") is not None:
        return f"loss {settings['target_loss']:g}"
    return _pct(settings.get("target_accuracy"))


# Said once, where a report would draw its plots and matplotlib (an extra) is not installed.
NO_PLOTS = "no plots: they need matplotlib, the bench extra: pip install 'distsgd[bench]'"


def plots(report: dict[str, Any], out: Path) -> list[str]:
    """accuracy_vs_time.png, accuracy_vs_samples.png (a language model's: loss_vs_*.png, of its test loss
    per token), and throughput_vs_workers.png (a bench) or
    throughput_vs_time.png (runs that carry their ``throughput`` curve: compare). Needs matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log.warning("%s", NO_PLOTS)
        return []
    firsts = [e for e in report["runs"] if e["repeat"] == 0]
    written = []
    # a language model's curves are of its test loss per token (lower is better), the others' of accuracy
    lm = any(e["summary"].get("task") == "lm" for e in firsts)
    what, key, ylabel, target = (
        ("loss", "test_loss", "test loss (nats per token)", report["settings"].get("target_loss"))
        if lm
        else ("accuracy", "test_accuracy", "test accuracy", report["settings"].get("target_accuracy"))
    )
    for x_key, name, xlabel in (
        ("train_wall_s", f"{what}_vs_time.png", "training time (s)"),
        ("samples", f"{what}_vs_samples.png", "training samples (all workers)"),
    ):
        fig, ax = plt.subplots(figsize=(8, 5))
        for i, e in enumerate(firsts):
            evals = e["summary"]["evals"]
            ax.plot(
                [v[x_key] for v in evals],
                [v.get(key) for v in evals],  # None: not measured then (a gap)
                marker=".",
                markersize=3,
                label=f"{e['algo']} x{e['workers']}",
                **_style(plt, i),
            )
        if target:
            ax.axhline(target, color="grey", linestyle="--", linewidth=1)
        _save(plt, fig, ax, xlabel, ylabel, out / name)
        written.append(name)
    if any(e.get("throughput") for e in firsts):
        written.append(_throughput_vs_time(plt, firsts, out))
    else:
        written.append(_throughput_vs_workers(plt, report["rows"], out))
    return written


def _style(plt: Any, i: int) -> dict[str, Any]:
    """Line i's colour and dash: 20 colours, then other dashes."""
    colors = plt.get_cmap("tab20").colors
    return {
        "color": colors[(2 * i) % 20 if i < 10 else (2 * i + 1) % 20],
        "linestyle": ["-", "--", "-.", ":"][i // 5 % 4],
    }


def _save(plt: Any, fig: Any, ax: Any, xlabel: str, ylabel: str, path: Path, legend_cols: int = 2) -> None:
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, ncol=legend_cols)
    fig.tight_layout()
    record(path)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _throughput_vs_workers(plt: Any, rows: list[dict[str, Any]], out: Path) -> str:
    fig, ax = plt.subplots(figsize=(6, 4))
    by_algo: dict[str, list[tuple[int, float]]] = {}
    for r in rows:
        if r["samples_per_s"]:
            by_algo.setdefault(r["algo"], []).append((r["workers"], r["samples_per_s"]["median"]))
    for algo, points in by_algo.items():
        points.sort()
        ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=algo)
    _save(plt, fig, ax, "workers", "samples/s (median)", out / "throughput_vs_workers.png", legend_cols=1)
    return "throughput_vs_workers.png"


def _throughput_vs_time(plt: Any, runs: list[dict[str, Any]], out: Path) -> str:
    """Each run's samples/s as its progress events reported it, against training time."""
    fig, ax = plt.subplots(figsize=(8, 5))
    for i, e in enumerate(runs):
        points = e.get("throughput") or []
        ax.plot([p[0] for p in points], [p[1] for p in points], label=f"{e['algo']} x{e['workers']}", **_style(plt, i))
    _save(plt, fig, ax, "training time (s)", "samples/s (all workers, since the start)", out / "throughput_vs_time.png")
    return "throughput_vs_time.png"
