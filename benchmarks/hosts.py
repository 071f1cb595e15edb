"""Two and four hosts: every algorithm that runs across machines, each with its defaults, on 2 and 4
hosts, unshaped and shaped to 100 and 10 Mbit/s (``distsgd bench --network RATE --hosts H``; needs
root for the namespaces).

The job is low_comm.py's: the 352k-parameter MLP (benchmarks/models/wide_mlp.py) on Fashion-MNIST,
batch 64 per worker, one thread per worker, target 85% test accuracy. Every algorithm runs with its
own defaults; those whose optimiser is SGD take low_comm's lr 0.05 and momentum 0.9 (the generic
0.01 and 0.5 took a million samples to 85% with mnist_net in docs/BENCHMARKS.md's main table),
while diloco and streaming-diloco keep their inner AdamW (lr 4e-4, weight decay 0.1). H hosts are
H workers, one a host; a parameter server's runs take one host more (see distsgd.bench.network).

Unshaped, each configuration runs to the target (or ``--cap`` samples), evaluated every 2,000
samples. On a shaped link each runs for about ``--budget`` seconds of training, its sample cap set
from its unshaped bytes per sample and the link's rate. A synchronous algorithm takes the same steps
on any link (same seed, same order), so it reaches the target after its unshaped samples to target
however slow the link: it runs at most that far and is evaluated once, at its end (an evaluation
inside a round costs DiLoCo and local SGD an all-reduce, a second or more at 10 Mbit/s), so its time
to target is measured when it gets there within the budget, and otherwise projected as (unshaped
samples to target) / (shaped samples/s) and marked ``~N*``. The asynchronous ones (the parameter
server's asgd, ssp, dcasgd; hogwild++) need more or fewer samples on a slower link: they are
evaluated every 2,000 samples as unshaped (their evaluations cross no link) and run to the target or
the budget; a projection for them assumes the unshaped samples to target. The limit column compares
a cell's samples/s with the unshaped cell's at the same host count: within 20%, the CPU limits it
(unshaped, the link is memory copies on the same two cores, so the CPU limits it by definition);
below, the link. Two ``single`` runs (1 worker, 1 thread, no network; SGD, and AdamW as DiLoCo's
inner steps) give the compute time per sample that benchmarks/scaling.py's check starts from.

    sudo python benchmarks/hosts.py                     # every cell (67 runs), about 35 minutes on 2 cores
    sudo python benchmarks/hosts.py --only asgd,diloco  # those again, the other rows (and single's) kept
    python benchmarks/hosts.py --render                 # the table from results/hosts/rows.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results" / "hosts"
MODEL = HERE / "models" / "wide_mlp.py"
CONFIGS = (
    "allreduce",
    "ddp",
    "asgd",
    "sync-ps",
    "ssp",
    "dcasgd",
    "easgd",
    "local-sgd",
    "diloco",
    "streaming-diloco",
    "hogwild++",
)
ADAMW = ("diloco", "streaming-diloco")  # their own inner optimiser and its defaults
# one worker, no network: the compute time per sample of each optimiser (AdamW at DiLoCo's defaults)
SINGLE = {"sgd": "single", "adamw": "single[optimizer=adamw;lr=0.0004;weight_decay=0.1]"}
ASYNCHRONOUS = ("asgd", "ssp", "dcasgd", "hogwild++")  # samples to target depend on the link
SERVER = ("asgd", "sync-ps", "ssp", "dcasgd")
HOSTS = (2, 4)
NETWORKS = ("unshaped", "100mbit", "10mbit")
BATCH = 64
COMMON = [
    "--dataset",
    "fashion-mnist",
    "--model",
    f"{MODEL}:WideMLP",
    "--batch-size",
    str(BATCH),
    "--target-accuracy",
    "0.85",
    "--stop-at-target",
    "--threads-per-worker",
    "1",
]
SGD = ["--lr", "0.05", "--momentum", "0.9"]
EVAL_EVERY = 2000


def rate_bytes(network: str) -> float:
    m = re.match(r"(\d+)([kmg]?)bit", network)
    assert m is not None
    return float(m[1]) * {"": 1, "k": 1e3, "m": 1e6, "g": 1e9}[m[2]] / 8


def _median(stat: dict[str, float] | None) -> float | None:
    return None if stat is None else stat["median"]


def run(
    out: Path,
    config: str,
    hosts: int | None,
    network: str | None,
    max_samples: int,
    again: bool,
    eval_every: int = EVAL_EVERY,
) -> dict[str, Any]:
    """One cell, its bench under ``out``/runs: its row (an earlier run's with the same sample cap
    and evaluations unless ``again``). ``hosts`` None: the single run, on no network."""
    where = ["--network", network, "--hosts", str(hosts)] if hosts else ["--workers", "1"]
    name = re.sub(r"[^a-z0-9]+", "_", f"{config}_{hosts or 1}h_{network or 'local'}".lower()).strip("_")
    out = out / "runs" / name
    done = out / "bench.json"
    settings = {"max_samples": max_samples, "eval_every": eval_every}
    if again or not done.exists() or settings.items() - json.loads(done.read_text())["settings"].items():
        cmd = [sys.executable, "-m", "distsgd", "bench", "--algos", config, *where, "--eval-every", str(eval_every)]
        cmd += ["--max-samples", str(max_samples), "--out", str(out), "--overwrite", "--quiet", *COMMON]
        cmd += [] if optimizer(config) == "adamw" else SGD
        print(
            f"# {config} on {hosts or 1} host(s), {network or 'no network'}, at most {max_samples} samples", flush=True
        )
        res = subprocess.run(cmd, capture_output=True, text=True)
        if res.returncode != 0:
            raise SystemExit(
                f"error: {config} on {hosts} hosts, {network} failed: {res.stderr.strip().splitlines()[-1:]}"
            )
    bench = json.loads(done.read_text())
    row, summary = bench["rows"][0], bench["runs"][0]["summary"]
    return {
        "config": config,
        "optimizer": optimizer(config),
        "hosts": hosts,
        "network": network,
        "workers": summary["workers"],
        "max_samples": max_samples,
        "samples": summary["samples"],
        "samples_per_s": _median(row["samples_per_s"]),
        "time_to_target_s": _median(row["time_to_target_s"]),
        "samples_to_target": _median(row["samples_to_target"]),
        "final_test_accuracy": _median(row["final_test_accuracy"]),
        "bytes_per_sample": _median(row["bytes_sent_per_sample"]),
        "placement": summary.get("hosts"),  # each host's address, processes and cores
    }


def optimizer(config: str) -> str:
    return "adamw" if config in ADAMW or config == SINGLE["adamw"] else "sgd"


def shaped_cap(config: str, base: dict[str, Any], network: str, budget: float, cap: int) -> int:
    """Samples for about ``budget`` seconds on the link (2 steps a worker at least); a synchronous
    configuration's at most its unshaped samples to target (the same steps reach it there)."""
    per_sample = base["bytes_per_sample"] or 1.0
    # a server's link carries every push in and every reply out; otherwise each host carries 1/N
    links = 2 if config in SERVER else base["workers"]
    est = min(base["samples_per_s"], rate_bytes(network) * links / per_sample)
    step = base["workers"] * BATCH
    want = max(2 * step, int(est * budget) // step * step)
    if config in ASYNCHRONOUS or not base["samples_to_target"]:
        return min(cap, want)
    return min(-(-int(base["samples_to_target"]) // step) * step, want)


def measure(
    out: Path, budget: float, cap: int, again: bool, only: list[str], kept: list[dict[str, Any]]
) -> list[dict[str, Any]]:
    todo = [c for c in CONFIGS if not only or c in only]
    # an --only run keeps the other rows, the single runs' too: scaling.py's check of every row starts from them
    rows = [r for r in kept if r["config"] not in todo]
    if not any(r["hosts"] is None for r in rows):
        rows += [run(out, single, None, None, 64_000, again) for single in SINGLE.values()]
    for hosts in HOSTS:
        base = {}
        for config in todo:
            base[config] = run(out, config, hosts, "unshaped", cap, again)
            rows.append(base[config])
        for network in NETWORKS[1:]:
            for config in todo:
                cap_here = shaped_cap(config, base[config], network, budget, cap)
                once = config not in ASYNCHRONOUS  # evaluated at the end only: see the docstring
                rows.append(run(out, config, hosts, network, cap_here, again, cap_here if once else EVAL_EVERY))
    return rows


def time_to_target(row: dict[str, Any], base: dict[str, Any]) -> tuple[float | None, bool]:
    """(seconds, projected?)"""
    if row["time_to_target_s"] is not None:
        return row["time_to_target_s"], False
    if base["samples_to_target"] is None:
        return None, False
    return base["samples_to_target"] / row["samples_per_s"], True


def limit(row: dict[str, Any], base: dict[str, Any]) -> str:
    """What limits a cell: within 20% of the unshaped samples/s at the same host count, the CPU."""
    if row["network"] == "unshaped":
        return "CPU"
    ratio = row["samples_per_s"] / base["samples_per_s"]
    return f"CPU ({ratio:.2f})" if ratio >= 0.8 else f"link ({ratio:.2f})"


def render(rows: list[dict[str, Any]], facts: str) -> str:
    lines = [facts, ""]
    for r in rows:
        if r["hosts"] is None:
            lines.append(
                f"{r['config']} (1 worker, 1 thread, no network): {r['samples_per_s']:.0f} samples/s, "
                f"{1e6 / r['samples_per_s']:.1f} us a sample."
            )
    lines += [
        "",
        "| algorithm | hosts | bytes/sample | samples to 85% | "
        + " | ".join(f"{n}: samples/s | {n}: time to 85% (s) | {n}: limit" for n in NETWORKS)
        + " |",
        "|---|---|---|---|" + "---|---|---|" * len(NETWORKS),
    ]
    for config in CONFIGS:
        for hosts in HOSTS:
            cells = {r["network"]: r for r in rows if r["config"] == config and r["hosts"] == hosts}
            if "unshaped" not in cells:
                continue
            b = cells["unshaped"]
            line = [
                config,
                str(hosts),
                f"{b['bytes_per_sample']:.0f}" if b["bytes_per_sample"] else "-",
                f"{b['samples_to_target']:.0f}" if b["samples_to_target"] else f"not in {b['max_samples']}",
            ]
            for network in NETWORKS:
                r = cells.get(network)
                if r is None:
                    line += ["-", "-", "-"]
                    continue
                t, projected = time_to_target(r, b)
                shown = "-" if t is None else (f"~{t:.0f}*" if projected else f"{t:.1f}")
                line += [f"{r['samples_per_s']:.0f}", shown, limit(r, b)]
            lines.append("| " + " | ".join(line) + " |")
    lines += [
        "",
        "`~N*`: projected, (unshaped samples to target) / (samples/s on that link); the run was cut at its "
        "sample cap (its budget of training time, above) before the target. Limit: a shaped cell's samples/s over the unshaped cell's at the same host "
        "count (in brackets); 0.8 or more: the CPU, below: the link.",
    ]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    ap.add_argument("--render", action="store_true", help="only rebuild the table from results")
    ap.add_argument("--again", action="store_true", help="run every cell again, even those already in results")
    ap.add_argument("--budget", type=float, default=10.0, help="seconds of training per shaped run, about; default 10")
    ap.add_argument("--cap", type=int, default=300_000, help="samples at most per run; default 300,000")
    ap.add_argument("--only", help="comma-separated algorithms to run (again); the others' rows are kept")
    ap.add_argument("--out", type=Path, default=RESULTS, help="where rows.json, table.md and runs/ go")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    data = args.out / "rows.json"
    if not args.render:
        only = [c for c in (args.only or "").split(",") if c]
        unknown = [c for c in only if c not in CONFIGS]
        if unknown:
            raise SystemExit(f"error: not a configuration of this benchmark: {', '.join(unknown)}")
        kept = json.loads(data.read_text())["rows"] if only and data.exists() else []
        rows = measure(args.out, args.budget, args.cap, args.again or bool(only), only, kept)
        from distsgd.bench.runner import machine_facts

        m, today = machine_facts(), datetime.date.today().isoformat()
        facts = (
            f"Machine: {m['host']}, {m['cpu']}, {m['cores']} cores, torch {m['torch_version']}; {today}; one run "
            f"per cell; shaped runs about {args.budget:.0f} s, at most {args.cap} samples"
        )
        if only and data.exists():
            facts = json.loads(data.read_text())["facts"] + f"; re-run on {today}: {', '.join(only)}"
        data.write_text(
            json.dumps({"facts": facts, "parameters": parameters(), "batch": BATCH, "rows": rows}, indent=1)
        )
    saved = json.loads(data.read_text())
    (args.out / "table.md").write_text(render(saved["rows"], saved["facts"]) + "\n")
    print((args.out / "table.md").read_text())


def parameters() -> int:
    """The bench model's parameters (for scaling.py's check)."""
    sys.path.insert(0, str(MODEL.parent))
    from wide_mlp import WideMLP

    return sum(p.numel() for p in WideMLP().parameters())


if __name__ == "__main__":
    main()
