"""Who wins at which bandwidth: the low-communication benchmark (needs root for the namespaces).

Two suites. ``mlp``: a 352k-parameter MLP (benchmarks/models/wide_mlp.py) on Fashion-MNIST, to a
target test accuracy. ``gpt``: the built-in GPT (2 layers, width 128, context 64, 0.44M
parameters) on Python's standard library as byte tokens, to a target test loss per token. Each:
2 workers, each configuration on two hosts joined by a veth pair (``distsgd bench --network``):
unshaped, then shaped to each RATE.

Unshaped, every configuration runs until it reaches the target (or the sample cap). On a shaped
link a run to the target could take an hour, so each runs for about ``--budget`` seconds (its
sample cap set from its unshaped bytes per sample and the link's rate, never beyond its unshaped
samples to target): if it reaches the target, its time is measured; if not, its time to target is
projected as (unshaped samples to target) / (shaped samples/s), and marked so. For the
synchronous algorithms the samples to target do not depend on the link (same seed, same steps),
so the projection only assumes the shaped throughput holds. asgd and hogwild++ need more or fewer
samples on a slower link (more staleness, fewer token passes), so they run for the whole budget
or to the target, and a projection for them also assumes the unshaped samples to target.

    sudo python benchmarks/low_comm.py                       # about 30 min on 2 cores
    sudo python benchmarks/low_comm.py --only "asgd,diloco[sync_every=500]"   # those again, the rest kept
    sudo python benchmarks/low_comm.py --suite gpt           # the language model, about 25 min
    python benchmarks/low_comm.py --render                   # the table and plot from results
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
MODEL = HERE / "models" / "wide_mlp.py"


class Suite:
    """A model, its data, its target and the configurations compared on it."""

    def __init__(
        self,
        name: str,
        out: str,
        networks: tuple[str, ...],
        configs: tuple[str, ...],
        common: list[str],
        cap: int,
        target: str,
        title: str,
    ) -> None:
        self.name, self.out, self.networks, self.configs, self.common = (
            name,
            HERE / "results" / out,
            networks,
            configs,
            common,
        )
        self.cap, self.target, self.title = cap, target, title


SUITES = {
    "mlp": Suite(
        "mlp",
        "low_comm",
        ("unshaped", "100mbit", "10mbit"),
        (
            "allreduce",
            "ddp[compress=fp16]",
            "ddp[compress=powersgd:2]",
            "allreduce[compress=powersgd:2]",
            "allreduce[compress=powersgd:4]",
            "local-sgd[sync_every=8]",
            "local-sgd[sync_every=64]",
            "local-sgd[sync_every=8;compress=powersgd:2]",
            "diloco[sync_every=64;lr=0.001]",
            "diloco[sync_every=500;lr=0.001]",
            "diloco[sync_every=500;lr=0.0004;weight_decay=0.1]",
            "streaming-diloco[sync_every=500;lr=0.001;fragments=4;overlap=1]",
            "streaming-diloco[sync_every=500;lr=0.001;fragments=4;overlap=1;merge=0]",
            "hogwild++",
            "asgd",
        ),
        [
            "--dataset",
            "fashion-mnist",
            "--model",
            f"{MODEL}:WideMLP",
            "--workers",
            "2",
            "--batch-size",
            "64",
            "--lr",
            "0.05",
            "--momentum",
            "0.9",
            "--target-accuracy",
            "0.85",
            "--stop-at-target",
            "--eval-every",
            "2000",
            "--threads-per-worker",
            "1",
        ],
        600_000,
        "85%",
        "Fashion-MNIST, 352k-parameter MLP, 2 hosts",
    ),
    # The language model: AdamW (gpt's own defaults: lr 1e-3, decay 0.1 on weights, warm-up 20, clip
    # 1.0) for every configuration, DiLoCo's inner AdamW at the same lr; the target a test loss.
    "gpt": Suite(
        "gpt",
        "low_comm_gpt",
        ("unshaped", "10mbit"),
        (
            "allreduce",
            "allreduce[compress=powersgd:4]",
            "local-sgd[sync_every=8]",
            "diloco[sync_every=50;lr=0.001]",
            "streaming-diloco[sync_every=50;lr=0.001;fragments=2;overlap=1]",
            "asgd",
        ),
        [
            "--dataset",
            "python-stdlib",
            "--model",
            "gpt[layers=2,heads=4,width=128]",
            "--context",
            "64",
            "--workers",
            "2",
            "--batch-size",
            "16",
            "--target-loss",
            "2.0",
            "--stop-at-target",
            "--eval-every",
            "3200",
            "--eval-batch-size",
            "500",
            "--threads-per-worker",
            "1",
        ],
        64_000,
        "loss 2.0",
        "Python sources as bytes, GPT 2x128 (0.44M parameters), 2 hosts",
    ),
}
SUITE = SUITES["mlp"]


def rate_bytes(network: str) -> float:
    m = re.match(r"(\d+)([km]?)bit", network)
    assert m is not None
    return float(m[1]) * {"": 1, "k": 1e3, "m": 1e6}[m[2]] / 8


def _median(stat: dict[str, float] | None) -> float | None:
    return None if stat is None else stat["median"]


def run(config: str, network: str, max_samples: int, again: bool) -> dict[str, Any]:
    """One configuration on one link: its bench.json row (an earlier run's with the same sample
    cap unless ``again``)."""
    name = re.sub(r"[^a-z0-9]+", "_", f"{config}_{network}".lower()).strip("_")
    out = SUITE.out / "runs" / name
    done = out / "bench.json"
    if again or not done.exists() or json.loads(done.read_text())["settings"]["max_samples"] != max_samples:
        cmd = [
            sys.executable,
            "-m",
            "distsgd",
            "bench",
            "--algos",
            config,
            "--network",
            network,
            "--max-samples",
            str(max_samples),
            "--out",
            str(out),
            "--overwrite",
            *SUITE.common,
        ]
        print(f"# {config} on {network}, at most {max_samples} samples", flush=True)
        res = subprocess.run(cmd, capture_output=True, text=True)
        if res.returncode != 0:
            raise SystemExit(f"error: {config} on {network} failed: {res.stderr.strip().splitlines()[-1:]}")
    bench = json.loads(done.read_text())
    row = bench["rows"][0]
    largest = [r["summary"].get("largest_transfer_bytes") for r in bench["runs"]]
    return {
        "config": config,
        "network": network,
        "max_samples": max_samples,
        "largest_transfer_bytes": max(largest) if largest and None not in largest else None,
        "samples_per_s": _median(row["samples_per_s"]),
        "time_to_target_s": _median(row["time_to_target_s"]),
        "samples_to_target": _median(row["samples_to_target"]),
        "final_test_accuracy": _median(row["final_test_accuracy"]),
        "bytes_per_sample": _median(row["bytes_sent_per_sample"]),
    }


ASYNCHRONOUS = ("asgd", "hogwild++")  # their samples to target depend on the link (staleness, token passes)


def shaped_cap(config: str, base: dict[str, Any], network: str, budget: float) -> int:
    """Samples for about ``budget`` seconds on the link; for a synchronous configuration at most
    its unshaped samples to target (the same steps: reaching it there proves nothing new)."""
    per_sample = base["bytes_per_sample"] or 1.0
    est = min(base["samples_per_s"], rate_bytes(network) / per_sample)  # one direction's rate
    want = int(est * budget) // 128 * 128
    if config.split("[")[0] in ASYNCHRONOUS or not base["samples_to_target"]:
        return max(1280, min(SUITE.cap, want))
    ceiling = -(-int(base["samples_to_target"]) // 128) * 128
    return max(1280, min(ceiling, want))


def measure(budget: float, again: bool, only: list[str], kept: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Every configuration (or those in ``only``; the others' rows are ``kept`` from the last run)."""
    todo = [c for c in SUITE.configs if not only or c in only]
    rows = [r for r in kept if r["config"] not in todo]
    base = {}
    for config in todo:
        base[config] = run(config, "unshaped", SUITE.cap, again)
        rows.append(base[config])
    for network in SUITE.networks[1:]:
        for config in todo:
            rows.append(run(config, network, shaped_cap(config, base[config], network, budget), again))
    return rows


def time_to_target(row: dict[str, Any], base: dict[str, Any]) -> tuple[float | None, bool]:
    """(seconds, projected?)"""
    if row["time_to_target_s"] is not None:
        return row["time_to_target_s"], False
    if base["samples_to_target"] is None:
        return None, False
    return base["samples_to_target"] / row["samples_per_s"], True


def render(rows: list[dict[str, Any]], facts: str) -> str:
    base = {r["config"]: r for r in rows if r["network"] == "unshaped"}
    ref = base["allreduce"]
    lines = [
        f"{facts}",
        "",
        f"| configuration | bytes/sample | x fewer than allreduce | largest transfer (bytes) | samples to "
        f"{SUITE.target} | "
        + " | ".join(f"{n}: samples/s | {n}: time to {SUITE.target} (s)" for n in SUITE.networks)
        + " |",
        "|---|---|---|---|---|" + "---|---|" * len(SUITE.networks),
    ]
    for config in SUITE.configs:
        b = base[config]
        cells = [
            config,
            f"{b['bytes_per_sample']:.0f}" if b["bytes_per_sample"] else "-",
            f"{ref['bytes_per_sample'] / b['bytes_per_sample']:.1f}" if b["bytes_per_sample"] else "-",
            f"{b['largest_transfer_bytes']:.0f}" if b.get("largest_transfer_bytes") else "-",
            str(b["samples_to_target"]) if b["samples_to_target"] else f"not in {SUITE.cap}",
        ]
        for network in SUITE.networks:
            r = next(x for x in rows if x["config"] == config and x["network"] == network)
            t, projected = time_to_target(r, b)
            cells += [f"{r['samples_per_s']:.0f}", "-" if t is None else (f"~{t:.0f}*" if projected else f"{t:.1f}")]
        lines.append("| " + " | ".join(cells) + " |")
    lines += [
        "",
        "`~N*`: projected, (unshaped samples to target) / (samples/s on that link); the run was cut "
        "at its sample cap (about a minute) before the target.",
    ]
    return "\n".join(lines)


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    base = {r["config"]: r for r in rows if r["network"] == "unshaped"}
    xs = {"unshaped": 10_000.0, "100mbit": 100.0, "10mbit": 10.0}  # veth unshaped: drawn at 10 Gbit/s
    fig, ax = plt.subplots(figsize=(8, 5))
    colours = plt.get_cmap("tab20").colors
    for i, config in enumerate(SUITE.configs):
        pts = []
        for network in SUITE.networks:
            r = next(x for x in rows if x["config"] == config and x["network"] == network)
            t, projected = time_to_target(r, base[config])
            if t is not None:
                pts.append((xs[network], t, projected))
        if pts:
            colour, marker = colours[(2 * i) % 20 + (2 * i) // 20], "osD^v"[i % 5]
            ax.plot([p[0] for p in pts], [p[1] for p in pts], color=colour, marker=marker, label=config)
            hollow = [p for p in pts if p[2]]  # projected: open markers
            ax.scatter(
                [p[0] for p in hollow],
                [p[1] for p in hollow],
                s=60,
                marker=marker,
                color="white",
                edgecolors=colour,
                zorder=3,
            )
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("link rate, Mbit/s (unshaped veth drawn at 10,000)")
    ax.set_ylabel(f"time to {SUITE.target} (test), s (open marker: projected)")
    ax.set_title(SUITE.title)
    ax.legend(fontsize=7)
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    ap.add_argument("--render", action="store_true", help="only rebuild the table and plot from results")
    ap.add_argument("--again", action="store_true", help="run every cell again, even those already in results")
    ap.add_argument("--budget", type=float, default=60.0, help="seconds per shaped run, about; default 60")
    ap.add_argument("--only", help="comma-separated configurations to run (again); the others' rows are kept")
    ap.add_argument("--suite", choices=sorted(SUITES), default="mlp", help="the model and data; default mlp")
    args = ap.parse_args()
    global SUITE
    SUITE = SUITES[args.suite]
    SUITE.out.mkdir(parents=True, exist_ok=True)
    data = SUITE.out / "rows.json"
    if not args.render:
        only = [c for c in re.split(r",(?![^\[]*\])", args.only or "") if c]
        unknown = [c for c in only if c not in SUITE.configs]
        if unknown:
            raise SystemExit(f"error: not a configuration of this benchmark: {', '.join(unknown)}")
        kept = json.loads(data.read_text())["rows"] if only and data.exists() else []
        rows = measure(args.budget, args.again or bool(only), only, kept)
        from distsgd.bench.runner import machine_facts

        m = machine_facts()
        import datetime

        today = datetime.date.today().isoformat()
        facts = (
            f"Machine: {m['host']}, {m['cpu']}, {m['cores']} cores, torch {m['torch_version']}; "
            f"{today}; one run per cell"
        )
        if only and data.exists():
            facts = json.loads(data.read_text())["facts"] + f"; re-run on {today}: {', '.join(only)}"
        data.write_text(json.dumps({"facts": facts, "rows": rows}, indent=1))
    saved = json.loads(data.read_text())
    (SUITE.out / "table.md").write_text(render(saved["rows"], saved["facts"]) + "\n")
    plot(saved["rows"], SUITE.out / "time_to_target.png")
    print((SUITE.out / "table.md").read_text())


if __name__ == "__main__":
    main()
