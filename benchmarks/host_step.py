"""The host's cost of a step around a CUDA graph's replay, measured on the CPU (issue 45).

    python benchmarks/host_step.py                      # single, Hogwild! 1 and 2 threads, 3 repeats
    python benchmarks/host_step.py --runs hogwild:4 --repeats 5

With ``--cuda-graphs`` a GPU step is one replay, a launch of some microseconds: what else a worker
does on the host each step (its batch, the copies into the graph's buffers, the counters, the
algorithm's bookkeeping) then sets how many steps a second it can take, and, for Hogwild!'s threads
on one GPU, how they share one interpreter. Here the capture is stood in for by a replay that does
nothing (``distsgd.train.device.capture_step``) and ``--cuda-graphs`` is allowed on the CPU, so a
run of ``logreg`` on digits at batch 16 measures that host work alone: microseconds per step of
one worker (its training time over its steps). Medians of alternating repeats, one process each.
Not a GPU measurement: a GPU's launches cost more than these CPU ops, and its threads release the
GIL in other places.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent

ONE = """
import json, sys
from types import SimpleNamespace
sys.path.insert(0, {src!r})
import distsgd
from distsgd import api
from distsgd.train import device

device.capture_step = lambda step, stream: SimpleNamespace(replay=lambda: None)  # a replay that does nothing
api.graphs_refusal = lambda cfg, kind: None  # --cuda-graphs on the CPU
if __name__ == "__main__":
    algo, workers, epochs = {algo!r}, {workers}, {epochs}
    extra = {{"hogwild_threads": "on"}} if algo == "hogwild" else {{}}
    s = distsgd.train(model="logreg", data="digits", batch_size=16, epochs=epochs, lr=0.01, quiet=True,
                      cuda_graphs=True, algo=algo, workers=workers, **extra).summary
    steps = s["samples"] / 16 / workers  # each worker's
    print(json.dumps({{"us_per_step": 1e6 * s["train_wall_s"] / steps, "samples_per_s": s["samples_per_s"],
                      "replays": s.get("graph_replays")}}))
"""


def measure(algo: str, workers: int, epochs: int) -> dict:
    code = ONE.format(src=str(HERE.parent / "src"), algo=algo, workers=workers, epochs=epochs)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", default="single:1,hogwild:1,hogwild:2", help="ALGO:WORKERS,...")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--epochs", type=int, default=40)
    args = ap.parse_args()
    runs = [(a, int(w)) for a, w in (r.split(":") for r in args.runs.split(","))]
    seen: dict[tuple[str, int], list[dict]] = {r: [] for r in runs}
    for _ in range(args.repeats):  # alternating: each repeat runs every configuration once
        for algo, workers in runs:
            seen[(algo, workers)].append(measure(algo, workers, args.epochs))
    print("| run | us per step of a worker (median) | all | samples/s, all workers (median) |")
    print("|---|---|---|---|")
    for (algo, workers), rows in seen.items():
        us = [r["us_per_step"] for r in rows]
        sps = statistics.median(r["samples_per_s"] for r in rows)
        print(f"| {algo} x{workers} | {statistics.median(us):.1f} | {', '.join(f'{u:.0f}' for u in us)} | {sps:,.0f} |")


if __name__ == "__main__":
    main()
