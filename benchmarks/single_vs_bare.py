"""Throughput of distsgd's `single` against a bare PyTorch loop: same model, data, batch, threads.

    python benchmarks/single_vs_bare.py [--samples 30000] [--repeats 3] [--threads 1]

Both sides train `mnist_net` on Fashion-MNIST tensors already in memory, with SGD (lr 0.01,
momentum 0.5) and batch 64, one thread. They alternate, and the median of the repeats is reported.
distsgd's figure is its own `samples_per_s` (training clock, evaluation excluded).
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time

import torch
import torch.nn.functional as F

import distsgd
from distsgd.data import load_dataset
from distsgd.models import MnistNet


def bare_loop(x: torch.Tensor, y: torch.Tensor, samples: int, batch: int, seed: int) -> float:
    torch.manual_seed(seed)
    model = MnistNet()
    model.train()
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.5)
    perm = torch.randperm(len(y))
    start = time.perf_counter()
    done = 0
    for i in range(0, samples, batch):
        idx = perm[i:i + batch]
        opt.zero_grad()
        loss = F.nll_loss(model(x[idx]), y[idx])
        loss.backward()
        opt.step()
        done += len(idx)
    return done / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--samples", type=int, default=30_000)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    ds = load_dataset("fashion-mnist")
    bare, ours = [], []
    for r in range(args.repeats):
        bare.append(bare_loop(ds.x_train, ds.y_train, args.samples, 64, r))
        summary, _ = distsgd.train(model="mnist_net", data=ds, algo="single", max_samples=args.samples, lr=0.01,
                                   momentum=0.5, batch_size=64, threads_per_worker=args.threads, seed=r,
                                   eval_every=10**9, quiet=True)
        ours.append(summary["samples_per_s"])
        print(f"repeat {r}: bare {bare[-1]:.0f} samples/s, distsgd single {ours[-1]:.0f} samples/s", flush=True)
    b, o = statistics.median(bare), statistics.median(ours)
    print(f"\nmachine: {platform.node()}, {torch.get_num_threads()} thread(s), torch {torch.__version__}, "
          f"{args.samples} samples x {args.repeats} repeats")
    print(f"| loop | samples/s, median | best | worst |")
    print("|---|---|---|---|")
    print(f"| bare PyTorch loop | {b:.0f} | {max(bare):.0f} | {min(bare):.0f} |")
    print(f"| distsgd single | {o:.0f} | {max(ours):.0f} | {min(ours):.0f} |")
    print(f"\nratio distsgd / bare: median {o / b:.3f}, best {max(ours) / max(bare):.3f}")


if __name__ == "__main__":
    main()
