"""Hogwild! on this machine: throughput against single, and time to 85% on Fashion-MNIST.

    python benchmarks/hogwild.py [--repeats 3] [--samples 60000] [--target 0.85] [--budget 1200000]

1. Throughput: `single` with 1 thread against `hogwild` with 2 workers of 1 thread, alternating,
   median of the repeats.
2. Time to the target: `hogwild` 2 x 1 thread at the seeds' settings (mnist_net, lr 0.01,
   momentum 0.5, batch 64), lock-free and locked, replicated (as pytorch/examples' mnist_hogwild)
   and sharded, evaluated every 20,000 samples on snapshots of the shared model (no pause).
"""

from __future__ import annotations

import argparse
import platform
import statistics

import torch

import distsgd
from distsgd.data import load_dataset

SEEDS = dict(model="mnist_net", lr=0.01, momentum=0.5, batch_size=64)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--samples", type=int, default=60_000)
    parser.add_argument("--target", type=float, default=0.85)
    parser.add_argument("--budget", type=int, default=1_200_000, help="samples for the time-to-target runs")
    parser.add_argument("--skip-throughput", action="store_true")
    parser.add_argument("--skip-time-to-target", action="store_true")
    args = parser.parse_args()
    ds = load_dataset("fashion-mnist")
    print(f"machine: {platform.node()}, torch {torch.__version__}")
    if not args.skip_throughput:
        rates: dict[str, list[float]] = {"single 1x1": [], "hogwild 2x1": []}
        for r in range(args.repeats):
            for name, algo, workers in (("single 1x1", "single", 1), ("hogwild 2x1", "hogwild", 2)):
                s = distsgd.train(data=ds, algo=algo, workers=workers, threads_per_worker=1, max_samples=args.samples,
                                  seed=r, eval_every=10**9, quiet=True, **SEEDS).summary
                rates[name].append(s["samples_per_s"])
                print(f"repeat {r}: {name}: {s['samples_per_s']:.0f} samples/s", flush=True)
        med = {k: statistics.median(v) for k, v in rates.items()}
        print("\n| run | samples/s (median) | min-max |\n|---|---|---|")
        for k, v in rates.items():
            print(f"| {k} | {med[k]:.0f} | {min(v):.0f}-{max(v):.0f} |")
        print(f"\nhogwild 2x1 / single 1x1 = {med['hogwild 2x1'] / med['single 1x1']:.2f}\n", flush=True)
    if args.skip_time_to_target:
        return
    print(f"| partition | lock | time to {args.target:.0%} | samples to {args.target:.0%} | samples/s "
          f"| final acc ({args.budget} samples) |\n|---|---|---|---|---|---|")
    for partition, lock in (("replicated", False), ("sharded", False), ("replicated", True)):
        s = distsgd.train(data=ds, algo="hogwild", workers=2, threads_per_worker=1, max_samples=args.budget,
                          partition=partition, hogwild_lock=lock, eval_every=20_000, target_accuracy=args.target,
                          quiet=True, **SEEDS).summary
        t = f"{s['time_to_target_s']:.1f} s" if s["time_to_target_s"] is not None else "not reached"
        print(f"| {partition} | {'yes' if lock else 'no'} | {t} | {s['samples_to_target']} | {s['samples_per_s']:.0f} "
              f"| {s['final_test_accuracy']:.4f} |", flush=True)


if __name__ == "__main__":
    main()
