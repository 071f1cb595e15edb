"""Throughput at the machine's limit: distsgd against bare PyTorch, side by side in one run.

    python benchmarks/limits.py [--samples 60000] [--repeats 3] [--only single,hogwild,...]
    python benchmarks/limits.py --ab /path/to/other/src   # and each distsgd run on another checkout, interleaved

Configurations, each in a fresh process, alternating (repeat 1 of every configuration, then
repeat 2, ...), medians reported:

- ``bare``: a single-thread PyTorch loop (mnist_net, SGD lr 0.01 momentum 0.5, batch 64).
- ``probe``: two plain ``torch.multiprocessing`` processes of one thread each stepping one model
  in shared memory with no lock, each on its half of the data (Hogwild! with no framework).
- distsgd ``single`` (1 thread), ``hogwild`` (2 x 1), ``asgd`` (server + 2 workers of 1
  thread), ``allreduce``, ``ddp`` and ``diloco`` (2 x 1, its defaults), through the CLI; their
  figure is ``samples_per_s`` from summary.json (the training clock: start-up and evaluation
  excluded).

The bare loops read Fashion-MNIST through distsgd's loader (data only) and time the training
loop alone, as distsgd's training clock does. Nothing else should run on the machine meanwhile.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CONFIGS = ("bare", "probe", "single", "hogwild", "asgd", "allreduce", "ddp", "diloco")
WORKERS = {"single": 1, "hogwild": 2, "asgd": 2, "allreduce": 2, "ddp": 2, "diloco": 2}
TARGETS = [  # (numerator, denominator, at least)
    ("single", "bare", 0.98),
    ("hogwild", "probe", 0.95),
    ("hogwild", "single", 1.85),
    ("asgd", "hogwild", 0.85),
    ("allreduce", "ddp", 1.0),
]


def _data():
    import torch
    import torch._dynamo  # noqa: F401  (torch.optim imports it at the first step: not part of training)

    from distsgd.data import load_dataset

    torch.set_num_threads(1)
    ds = load_dataset("fashion-mnist")
    return ds.x_train, ds.y_train


def _train(model, x, y, order, samples: int, batch: int = 64) -> int:
    import torch
    import torch.nn.functional as F

    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.5)
    done = 0
    for i in range(0, samples, batch):
        idx = order[i : i + batch]
        opt.zero_grad()
        F.nll_loss(model(x[idx]), y[idx]).backward()
        opt.step()
        done += len(idx)
    return done


def bare(samples: int) -> float:
    import torch

    from distsgd.models import MnistNet

    x, y = _data()
    torch.manual_seed(0)
    model = MnistNet()
    order = torch.randperm(len(y))
    start = time.perf_counter()
    done = _train(model, x, y, order, samples)
    return done / (time.perf_counter() - start)


def _probe_worker(rank: int, model, x, y, samples: int, barrier, out) -> None:
    import torch
    import torch._dynamo  # noqa: F401  (as in _data: imported before the clock starts)

    torch.set_num_threads(1)
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(rank))[rank::2]
    barrier.wait()
    out[rank] = _train(model, x, y, order, samples // 2)
    barrier.wait()


def probe(samples: int) -> float:
    import torch
    import torch.multiprocessing as mp

    from distsgd.models import MnistNet

    x, y = _data()
    x.share_memory_()
    y.share_memory_()
    torch.manual_seed(0)
    model = MnistNet()
    model.share_memory()
    ctx = mp.get_context("spawn")
    barrier, out = ctx.Barrier(3), ctx.Array("l", 2)
    procs = [ctx.Process(target=_probe_worker, args=(r, model, x, y, samples, barrier, out)) for r in range(2)]
    for p in procs:
        p.start()
    barrier.wait()  # both built and waiting: start the clock
    start = time.perf_counter()
    barrier.wait()  # both done
    elapsed = time.perf_counter() - start
    for p in procs:
        p.join()
    return sum(out) / elapsed


def distsgd_run(algo: str, samples: int, pythonpath: str | None) -> float:
    env = dict(os.environ)
    if pythonpath:
        env["PYTHONPATH"] = pythonpath
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [
            sys.executable,
            "-m",
            "distsgd",
            "train",
            "--algo",
            algo,
            "--workers",
            str(WORKERS[algo]),
            "--dataset",
            "fashion-mnist",
            "--model",
            "mnist_net",
            "--lr",
            "0.01",
            "--momentum",
            "0.5",
            "--batch-size",
            "64",
            "--threads-per-worker",
            "1",
            "--max-samples",
            str(samples),
            "--out",
            f"{tmp}/run",
            "--quiet",
        ]
        subprocess.run(cmd, check=True, env=env)
        return json.loads(Path(f"{tmp}/run/summary.json").read_text())["samples_per_s"]


def measure(config: str, samples: int, ab: str | None) -> float:
    if config.endswith("@ab"):
        return distsgd_run(config[:-3], samples, ab)
    if config in WORKERS:
        return distsgd_run(config, samples, None)
    cmd = [sys.executable, __file__, "--inner", config, "--samples", str(samples)]
    return float(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.split()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(
        allow_abbrev=False, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--samples", type=int, default=60_000, help="training samples per run (all workers)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--only", default=",".join(CONFIGS), help="comma-separated configurations")
    parser.add_argument(
        "--ab",
        help="also run each distsgd configuration from this source folder (NAME@ab), "
        "interleaved: an A/B against another checkout",
    )
    parser.add_argument("--inner", choices=("bare", "probe"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.inner:  # a bare loop in its own process
        print(bare(args.samples) if args.inner == "bare" else probe(args.samples))
        return
    configs = [c.strip() for c in args.only.split(",") if c.strip()]
    if args.ab:
        configs = [x for c in configs for x in ([c, f"{c}@ab"] if c in WORKERS else [c])]
    rates: dict[str, list[float]] = {c: [] for c in configs}
    for r in range(args.repeats):
        for c in configs:
            rates[c].append(measure(c, args.samples, args.ab))
            print(f"repeat {r + 1}: {c}: {rates[c][-1]:.0f} samples/s", file=sys.stderr, flush=True)
    med = {c: statistics.median(v) for c, v in rates.items()}
    import torch

    print(
        f"Machine: {platform.node()}, {os.cpu_count()} cores, torch {torch.__version__}, "
        f"Python {platform.python_version()}; {_dt.date.today().isoformat()}; {args.samples} samples a run, "
        f"{args.repeats} alternating repeats" + (f"; NAME@ab: distsgd from {args.ab}" if args.ab else "")
    )
    print("\n| configuration | samples/s (median) | min-max |\n|---|---|---|")
    for c in configs:
        print(f"| {c} | {med[c]:.0f} | {min(rates[c]):.0f}-{max(rates[c]):.0f} |")
    print("\n| ratio (medians) | measured | target |\n|---|---|---|")
    targets = TARGETS + [(c, f"{c}@ab", None) for c in configs if f"{c}@ab" in med]
    for num, den, target in targets:
        if target is None:
            print(f"| {num} / {den} | {med[num] / med[den]:.3f} | (this checkout / the other) |")
        elif num in med and den in med:
            ratio = med[num] / med[den]
            print(f"| {num} / {den} | {ratio:.3f} | >= {target} {'(met)' if ratio >= target else '(not met)'} |")


if __name__ == "__main__":
    main()
