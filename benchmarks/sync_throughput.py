"""Throughput of synchronous data parallel against the single-process baseline, in one run.

    python benchmarks/sync_throughput.py [--samples 60000] [--repeats 3]

Fashion-MNIST, `mnist_net`, SGD lr 0.01 momentum 0.5, batch 64 per worker. `single` runs with 1
thread; `allreduce` and `ddp` with 2 workers of 1 thread each. Configurations alternate, so slow
phases of the machine hit them alike; the median of the repeats is reported. Scaling efficiency
is the 2-worker throughput over twice the 1-thread single throughput.
"""

from __future__ import annotations

import argparse
import platform
import statistics

import torch

import distsgd
from distsgd.data import load_dataset

CONFIGS = [("single", 1, 1), ("allreduce", 2, 1), ("ddp", 2, 1), ("single", 1, 2)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--samples", type=int, default=60_000)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    ds = load_dataset("fashion-mnist")
    rates: dict[tuple, list[float]] = {c: [] for c in CONFIGS}
    accs: dict[tuple, list[float]] = {c: [] for c in CONFIGS}
    for r in range(args.repeats):
        for algo, workers, threads in CONFIGS:
            s = distsgd.train(model="mnist_net", data=ds, algo=algo, workers=workers, threads_per_worker=threads,
                              max_samples=args.samples, lr=0.01, momentum=0.5, batch_size=64, seed=r,
                              eval_every=10**9, quiet=True).summary
            rates[(algo, workers, threads)].append(s["samples_per_s"])
            accs[(algo, workers, threads)].append(s["final_test_accuracy"])
            print(f"repeat {r}: {algo} {workers}x{threads}: {s['samples_per_s']:.0f} samples/s, "
                  f"acc {s['final_test_accuracy']:.4f}", flush=True)
    med = {c: statistics.median(v) for c, v in rates.items()}
    base = med[("single", 1, 1)]
    print(f"\nmachine: {platform.node()}, torch {torch.__version__}, {args.samples} samples a run, "
          f"{args.repeats} repeats")
    print("| algorithm | workers x threads | samples/s (median) | min-max | scaling efficiency | test acc (median) |")
    print("|---|---|---|---|---|---|")
    for (algo, workers, threads), m in med.items():
        eff = f"{m / (workers * base):.2f}" if threads == 1 else "-"
        lo, hi = min(rates[(algo, workers, threads)]), max(rates[(algo, workers, threads)])
        print(f"| {algo} | {workers} x {threads} | {m:.0f} | {lo:.0f}-{hi:.0f} | {eff} | "
              f"{statistics.median(accs[(algo, workers, threads)]):.4f} |")
    print(f"\nallreduce / ddp = {med[('allreduce', 2, 1)] / med[('ddp', 2, 1)]:.3f}")


if __name__ == "__main__":
    main()
