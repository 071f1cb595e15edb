"""A user's own loop under ``distsgd.spawn`` against ``distsgd train`` on the same job (issue 32).

    python benchmarks/own_loop.py [--samples 60000] [--repeats 5] [--only single,allreduce,hogwild,asgd]
    python benchmarks/own_loop.py --out benchmarks/results/own_loop     # also rows.json and own_loop.md there

The job: mnist_net (built by the module-level factory :func:`mnist_net`, the same class for both)
on Fashion-MNIST, ``--samples`` training samples (all workers together), every other setting at
distsgd's default (SGD, lr 0.01, batch 64, threads per worker = cores / workers). For each
algorithm (``single`` with 1 worker; ``allreduce``, ``hogwild``, ``asgd`` with 2), two ways:

- ``train``: ``distsgd.train(model=mnist_net, data=<Fashion-MNIST as a distsgd Dataset>, algo=...,
  workers=..., max_samples=N, quiet=True)``: distsgd's own loop (tensor indexing into the data,
  its evaluations on its own schedule with the training clock paused);
- ``spawn``: ``distsgd.spawn(main, model=mnist_net, same settings)``, ``main`` a plain loop
  (:func:`main`): ``run.loader(TensorDataset(x_train, y_train))`` (a DataLoader over this
  worker's shard, each pass the next epoch), ``F.cross_entropy``, a plain ``loss.backward()``
  (the algorithm's sync queued at its end), ``opt.step()``; no evaluation.

Each run is a fresh Python process (this script with ``--one KIND --algo ALGO``): no fork server,
allocator or cache state carried from one run to the next. Repeats alternate (repeat 1 of every
run, then repeat 2, ...) and within each repeat the two ways swap order (train first in odd
repeats, spawn first in even), so drift on the machine falls on both alike. The figure is
``samples_per_s`` from the run's summary: the training clock (start-up, data loading and
evaluation excluded). Reported: each way's median (min-max) and the ratio of the medians,
spawn / train, against the target 0.97. Nothing else should run on the machine meanwhile.
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
from pathlib import Path
from typing import Any

ALGOS = ("single", "allreduce", "hogwild", "asgd")
WORKERS = {"single": 1, "allreduce": 2, "hogwild": 2, "asgd": 2}
KINDS = ("train", "spawn")
TARGET = 0.97  # spawn / train, samples/s (medians)


def mnist_net() -> Any:
    """distsgd's default model, as a factory both ``train`` and ``spawn`` take (workers import it)."""
    from distsgd.models import build_model

    return build_model("mnist_net", (1, 28, 28), 10, "default")


def main(run: Any) -> Any:
    """The user's loop: a plain PyTorch epoch loop with distsgd's five calls."""
    import torch.nn.functional as F
    from torch.utils.data import TensorDataset

    from distsgd.data import load_dataset

    fashion = load_dataset("fashion-mnist")  # before run.setup(): the training clock starts there
    train_set = TensorDataset(fashion.x_train, fashion.y_train)
    model, opt = run.setup()  # the run's optimiser settings, as distsgd train's
    batches = run.loader(train_set)  # each pass the next epoch
    while not run.should_stop():
        for x, y in batches:
            opt.zero_grad()
            loss = F.cross_entropy(model(x), y)
            loss.backward()  # the algorithm's sync at its end, as run.backward's
            opt.step()
    return run.final_model()


def one(kind: str, algo: str, samples: int) -> dict[str, Any]:
    """One run in this process: its summary's figures."""
    import distsgd
    from distsgd.data import load_dataset

    settings: dict[str, Any] = {"algo": algo, "workers": WORKERS[algo], "max_samples": samples, "quiet": True}
    if kind == "train":
        result = distsgd.train(model=mnist_net, data=load_dataset("fashion-mnist"), **settings)
    else:
        result = distsgd.spawn(main, model=mnist_net, train_size=60_000, **settings)
    s = result.summary
    return {
        "samples_per_s": s["samples_per_s"],
        "samples": s["samples"],
        "train_wall_s": s["train_wall_s"],
        "threads_per_worker": s.get("threads_per_worker"),
    }


def measure(kind: str, algo: str, samples: int) -> dict[str, Any]:
    cmd = [sys.executable, __file__, "--one", kind, "--algo", algo, "--samples", str(samples)]
    out = subprocess.run(cmd, check=True, stdout=subprocess.PIPE, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def machine() -> str:
    import torch

    try:
        usable = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        usable = os.cpu_count() or 1
    return (
        f"Machine: {platform.node()} ({platform.platform()}, {platform.processor() or platform.machine()}), "
        f"{os.cpu_count()} cores ({usable} usable), torch {torch.__version__}, Python {platform.python_version()}; "
        f"{_dt.date.today().isoformat()}"
    )


def render(facts: str, rows: list[dict[str, Any]]) -> str:
    lines = [
        facts,
        "",
        "| algorithm | workers | train: samples/s, median (min-max) | spawn: samples/s, median (min-max) "
        f"| spawn / train (medians) | target >= {TARGET} |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        cells = [r["algo"], str(r["workers"])]
        for kind in KINDS:
            v = r[kind]
            cells.append(f"{statistics.median(v):.0f} ({min(v):.0f}-{max(v):.0f})")
        cells += [f"{r['ratio']:.3f}", "met" if r["met"] else "not met"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def cli() -> None:
    parser = argparse.ArgumentParser(
        allow_abbrev=False, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--samples", type=int, default=60_000, help="training samples per run, all workers; default 60000 (one epoch)"
    )
    parser.add_argument("--repeats", type=int, default=5, help="alternating repeats; default 5")
    parser.add_argument("--only", default=",".join(ALGOS), help="comma-separated algorithms; default all four")
    parser.add_argument("--out", help="also write rows.json and own_loop.md into this folder")
    parser.add_argument("--one", choices=KINDS, help=argparse.SUPPRESS)  # a single run, in its own process
    parser.add_argument("--algo", choices=ALGOS, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        print(json.dumps(one(args.one, args.algo, args.samples)))
        return
    algos = [a.strip() for a in args.only.split(",") if a.strip()]
    unknown = [a for a in algos if a not in ALGOS]
    if unknown:
        raise SystemExit(
            f"error: not an algorithm of this benchmark: {', '.join(unknown)} (choose from {', '.join(ALGOS)})"
        )
    runs: dict[tuple[str, str], list[dict[str, Any]]] = {(a, k): [] for a in algos for k in KINDS}
    for r in range(args.repeats):
        order = KINDS if r % 2 == 0 else KINDS[::-1]
        for algo in algos:
            for kind in order:
                res = measure(kind, algo, args.samples)
                runs[algo, kind].append(res)
                print(
                    f"repeat {r + 1}: {algo} {kind}: {res['samples_per_s']:.0f} samples/s", file=sys.stderr, flush=True
                )
    rows = []
    for algo in algos:
        rates = {k: [x["samples_per_s"] for x in runs[algo, k]] for k in KINDS}
        ratio = statistics.median(rates["spawn"]) / statistics.median(rates["train"])
        rows.append(
            {
                "algo": algo,
                "workers": WORKERS[algo],
                **rates,
                "ratio": ratio,
                "met": ratio >= TARGET,
                "threads_per_worker": runs[algo, "train"][0]["threads_per_worker"],
            }
        )
    facts = (
        f"{machine()}; mnist_net on Fashion-MNIST, {args.samples} samples a run, every other setting "
        f"distsgd's default; {args.repeats} alternating repeats, each run a fresh process; samples/s from "
        f"the training clock"
    )
    table = render(facts, rows)
    print(table)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "rows.json").write_text(
            json.dumps({"facts": facts, "samples": args.samples, "repeats": args.repeats, "rows": rows}, indent=1)
            + "\n"
        )
        (out / "own_loop.md").write_text(table + "\n")


if __name__ == "__main__":
    cli()
