"""Derived figures, the markdown table and the plots of a bench."""

from __future__ import annotations

import datetime as _dt
import logging
import statistics
from pathlib import Path
from typing import Any

from distsgd.config import RunConfig

log = logging.getLogger(__name__)


def _stats(values: list[float]) -> dict[str, float] | None:
    values = [v for v in values if v is not None]
    if not values:
        return None
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def derive(runs: list[dict[str, Any]], machine: dict[str, Any], base: RunConfig, repeats: int) -> dict[str, Any]:
    """Group the runs by (algorithm, workers) and compute medians with min-max over repeats."""
    groups: dict[tuple[str, int], list[dict[str, Any]]] = {}
    for entry in runs:
        groups.setdefault((entry["algo"], entry["workers"]), []).append(entry["summary"])
    single = [s["samples_per_s"] for (a, w), ss in groups.items() if a.split("[")[0] == "single" and w == 1
              for s in ss]
    rows = []
    for (algo, workers), summaries in groups.items():
        own_one = [s["samples_per_s"] for s in groups.get((algo, 1), [])]
        baseline = statistics.median(single) if single else (statistics.median(own_one) if own_one else None)
        throughput = _stats([s["samples_per_s"] for s in summaries])
        reached = [s for s in summaries if s["time_to_target_s"] is not None]
        stale = [s["staleness"] for s in summaries if isinstance(s.get("staleness"), dict)
                 and s["staleness"].get("mean") is not None]
        rows.append({
            "algo": algo, "workers": workers, "repeats": len(summaries),
            "threads_per_worker": summaries[0]["threads_per_worker"],
            "samples_per_s": throughput,
            "scaling_efficiency": (throughput["median"] / (workers * baseline)) if baseline and throughput else None,
            "time_to_target_s": _stats([s["time_to_target_s"] for s in reached]),
            "samples_to_target": _stats([s["samples_to_target"] for s in reached]),
            "reached_target": f"{len(reached)}/{len(summaries)}",
            "final_test_accuracy": _stats([s["final_test_accuracy"] for s in summaries]),
            "samples": _stats([s["samples"] for s in summaries]),
            "bytes_sent_per_sample": _stats([s.get("bytes_sent_per_sample") for s in summaries]),
            "staleness_mean": _stats([st["mean"] for st in stale]),
            "staleness_p99": _stats([st["p99"] for st in stale]),
            "staleness_max": _stats([st["max"] for st in stale]),
            "failed_workers": sorted({w for s in summaries for w in s.get("failed_workers", [])}),
        })
    settings = {k: v for k, v in base.to_dict().items()
                if k in ("dataset", "model", "epochs", "max_samples", "batch_size", "lr", "momentum", "optimizer",
                         "eval_every", "target_accuracy", "threads_per_worker", "partition", "straggler", "seed")}
    return {"date": _dt.date.today().isoformat(), "machine": machine, "settings": settings, "repeats": repeats,
            "rows": rows, "runs": runs}


def _fmt(stat: dict[str, float] | None, fmt: str = "{:.0f}", spread: bool = True) -> str:
    if stat is None:
        return "-"
    text = fmt.format(stat["median"])
    if spread and stat["min"] != stat["max"]:
        text += f" ({fmt.format(stat['min'])}-{fmt.format(stat['max'])})"
    return text


def markdown(bench: dict[str, Any]) -> str:
    m, s = bench["machine"], bench["settings"]
    target = s.get("target_accuracy")
    lines = [
        f"# distsgd bench, {bench['date']}",
        "",
        f"Machine: {m['host']}, {m['cpu']}, {m['cores']} cores; torch {m['torch_version']}, Python {m['python']}.",
        "Settings: " + ", ".join(f"{k}={v}" for k, v in s.items() if v is not None) + ".",
        f"Medians over {bench['repeats']} repeat(s), with (min-max) where they differ. Configurations ran one "
        "after another.",
        "",
        f"| algorithm | workers | threads/worker | samples/s | scaling eff. | time to {_pct(target)} (s) "
        f"| samples to {_pct(target)} | reached | final acc | bytes/sample | staleness mean / p99 |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in bench["rows"]:
        stale = "-" if r["staleness_mean"] is None else \
            f"{r['staleness_mean']['median']:.2f} / {r['staleness_p99']['median']:.0f}"
        eff = "-" if r["scaling_efficiency"] is None else f"{r['scaling_efficiency']:.2f}"
        lines.append(
            f"| {r['algo']} | {r['workers']} | {r['threads_per_worker']} | {_fmt(r['samples_per_s'])} | {eff} "
            f"| {_fmt(r['time_to_target_s'], '{:.1f}')} | {_fmt(r['samples_to_target'], '{:.0f}', False)} "
            f"| {r['reached_target']} | {_fmt(r['final_test_accuracy'], '{:.4f}')} "
            f"| {_fmt(r['bytes_sent_per_sample'], '{:.0f}', False)} | {stale} |")
    failed = [r for r in bench["rows"] if r["failed_workers"]]
    for r in failed:
        lines.append(f"\n{r['algo']} x{r['workers']}: failed workers {r['failed_workers']}")
    lines.append("")
    lines.append("Scaling efficiency: samples/s over (workers x the 1-worker `single` samples/s, or the "
                 "algorithm's own 1-worker run when `single` is not in the bench).")
    return "\n".join(lines) + "\n"


def _pct(target: float | None) -> str:
    return "target" if target is None else f"{target:.0%}"


def plots(bench: dict[str, Any], out: Path) -> list[str]:
    """accuracy_vs_time.png, accuracy_vs_samples.png, throughput_vs_workers.png (needs matplotlib)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log.warning("matplotlib is not installed: no plots (pip install 'distsgd[bench]')")
        return []
    firsts = [e for e in bench["runs"] if e["repeat"] == 0]
    colors = plt.get_cmap("tab20").colors
    styles = ["-", "--", "-.", ":"]
    written = []
    for x_key, name, xlabel in (("train_wall_s", "accuracy_vs_time.png", "training time (s)"),
                                ("samples", "accuracy_vs_samples.png", "training samples (all workers)")):
        fig, ax = plt.subplots(figsize=(8, 5))
        for i, e in enumerate(firsts):
            evals = e["summary"]["evals"]
            ax.plot([v[x_key] for v in evals], [v["test_accuracy"] for v in evals], marker=".", markersize=3,
                    color=colors[(2 * i) % 20 if i < 10 else (2 * i + 1) % 20], linestyle=styles[i // 5 % 4],
                    label=f"{e['algo']} x{e['workers']}")
        target = bench["settings"].get("target_accuracy")
        if target:
            ax.axhline(target, color="grey", linestyle="--", linewidth=1)
        ax.set_xlabel(xlabel)
        ax.set_ylabel("test accuracy")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, ncol=2)
        fig.tight_layout()
        fig.savefig(out / name, dpi=110)
        plt.close(fig)
        written.append(name)
    fig, ax = plt.subplots(figsize=(6, 4))
    by_algo: dict[str, list[tuple[int, float]]] = {}
    for r in bench["rows"]:
        if r["samples_per_s"]:
            by_algo.setdefault(r["algo"], []).append((r["workers"], r["samples_per_s"]["median"]))
    for algo, points in by_algo.items():
        points.sort()
        ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=algo)
    ax.set_xlabel("workers")
    ax.set_ylabel("samples/s (median)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "throughput_vs_workers.png", dpi=110)
    plt.close(fig)
    written.append("throughput_vs_workers.png")
    return written
