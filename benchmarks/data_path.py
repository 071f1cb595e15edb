"""The torch Dataset path against PyTorch's own DataLoader loop over the same Dataset.

    python benchmarks/data_path.py [--samples 60000] [--repeats 3] [--loader-workers 0,1]

Both sides train `mnist_net` (SGD lr 0.01, momentum 0.5, batch 64, one training thread) on a
map-style Dataset of Fashion-MNIST samples (``__getitem__`` returns one image and its label, the
usual recipe), read through a DataLoader with N worker processes:

- ``pytorch``: ``DataLoader(ds, batch_size=64, shuffle=True, num_workers=N)`` and a plain loop;
- ``distsgd``: ``distsgd.train(data=(train, test), loader_workers=N)`` (algo single), whose
  figure is its ``samples_per_s`` (training clock, evaluation excluded).

They alternate; the median of the repeats is reported, with the ratio distsgd / pytorch.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import os
import platform
import statistics
import time

import torch
import torch._dynamo  # noqa: F401  (torch.optim imports it at the first step; not part of training)
import torch.nn.functional as F

import distsgd
from distsgd.data import load_dataset
from distsgd.models import MnistNet


class Samples(torch.utils.data.Dataset):
    """One (image, label) per item, as a user's Dataset returns them."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor) -> None:
        self.x, self.y = x, y
        self.classes = list(range(10))

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        return self.x[i], int(self.y[i])


def pytorch_loop(ds: Samples, samples: int, workers: int) -> float:
    torch.manual_seed(0)
    model = MnistNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.5)
    loader = torch.utils.data.DataLoader(ds, batch_size=64, shuffle=True, num_workers=workers)
    start, done = time.perf_counter(), 0
    for x, y in loader:
        opt.zero_grad()
        F.nll_loss(model(x), y).backward()
        opt.step()
        done += len(y)
        if done >= samples:
            break
    return done / (time.perf_counter() - start)


def distsgd_run(train: Samples, test: Samples, samples: int, workers: int) -> float:
    s = distsgd.train(
        model="mnist_net",
        data=(train, test),
        algo="single",
        max_samples=samples,
        lr=0.01,
        momentum=0.5,
        batch_size=64,
        threads_per_worker=1,
        loader_workers=workers,
        eval_every=10**9,
        quiet=True,
    ).summary
    return s["samples_per_s"]


def main() -> None:
    parser = argparse.ArgumentParser(
        allow_abbrev=False, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--samples", type=int, default=60_000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--loader-workers", default="0,1")
    args = parser.parse_args()
    torch.set_num_threads(1)
    ds = load_dataset("fashion-mnist")
    train, test = Samples(ds.x_train, ds.y_train), Samples(ds.x_test, ds.y_test)
    counts = [int(w) for w in args.loader_workers.split(",")]
    rates: dict[tuple[str, int], list[float]] = {(k, w): [] for w in counts for k in ("pytorch", "distsgd")}
    for r in range(args.repeats):
        for w in counts:
            rates[("pytorch", w)].append(pytorch_loop(train, args.samples, w))
            rates[("distsgd", w)].append(distsgd_run(train, test, args.samples, w))
            print(
                f"repeat {r + 1}, {w} loader workers: pytorch {rates[('pytorch', w)][-1]:.0f}, "
                f"distsgd {rates[('distsgd', w)][-1]:.0f} samples/s",
                flush=True,
            )
    print(
        f"\nMachine: {platform.node()}, {os.cpu_count()} cores, torch {torch.__version__}; "
        f"{_dt.date.today().isoformat()}; {args.samples} samples a run, {args.repeats} alternating repeats\n"
    )
    print("| loader workers | PyTorch DataLoader loop (samples/s) | distsgd, Dataset path | distsgd / PyTorch |")
    print("|---|---|---|---|")
    for w in counts:
        p, d = statistics.median(rates[("pytorch", w)]), statistics.median(rates[("distsgd", w)])
        print(f"| {w} | {p:.0f} | {d:.0f} | {d / p:.3f} |")


if __name__ == "__main__":
    main()
