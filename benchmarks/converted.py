"""pytorch/examples' mnist_hogwild, converted (examples/mnist_hogwild/), against `distsgd train`
with the same settings, under several algorithms and seeds.

    python benchmarks/converted.py [--seeds 1,2,3] [--algos hogwild,asgd,allreduce,local-sgd,diloco] [--epochs 1]

Both: mnist_net (the example's Net), Fashion-MNIST's 60,000 images, the example's settings (batch
64, SGD lr 0.01 momentum 0.5, 2 processes, each shuffling the whole training set every epoch: the
replicated partition), ``--epochs`` epochs, the seed given. The figure is the final test accuracy
(the example's own test on the model it trained; distsgd train's final_test_accuracy). Medians
per algorithm and the seeds' spread are printed and written to ``--out``.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
COMMON = ["--batch-size", "64", "--lr", "0.01", "--momentum", "0.5"]  # the example's defaults


def example(algo: str, seed: int, epochs: int) -> float:
    cmd = [sys.executable, str(ROOT / "examples" / "mnist_hogwild" / "main.py"), "--algo", algo, "--seed", str(seed)]
    cmd += [*COMMON, "--epochs", str(epochs), "--num-processes", "2", "--log-interval", "100000"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    found = re.search(r"Accuracy: ([0-9]+)/([0-9]+)", r.stdout)
    if r.returncode or not found:
        raise SystemExit(f"example {algo} seed {seed} failed: {r.stderr[-2000:]}")
    return int(found.group(1)) / int(found.group(2))


def train(algo: str, seed: int, epochs: int) -> float:
    with tempfile.TemporaryDirectory() as out:
        cmd = [sys.executable, "-m", "distsgd", "train", "--algo", algo, "--workers", "2", "--seed", str(seed)]
        inner = "--inner-optimizer" if "diloco" in algo else "--optimizer"  # DiLoCo's workers step its inner one
        cmd += ["--model", "mnist_net", "--dataset", "fashion-mnist", "--epochs", str(epochs), inner, "sgd"]
        cmd += [*COMMON, "--weight-decay", "0", "--partition", "replicated", "--quiet", "--out", out]
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
        if r.returncode:
            raise SystemExit(f"train {algo} seed {seed} failed: {r.stderr[-2000:]}")
        return json.loads((Path(out) / "summary.json").read_text())["final_test_accuracy"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", default="1,2,3")
    ap.add_argument("--algos", default="hogwild,asgd,allreduce,local-sgd,diloco")
    ap.add_argument("--epochs", type=int, default=1)
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "converted")
    args = ap.parse_args()
    seeds = [int(s) for s in args.seeds.split(",")]
    rows = []
    for algo in args.algos.split(","):
        got: dict[str, list[float]] = {"example": [], "train": []}
        for seed in seeds:  # alternating: the example, then distsgd train, per seed
            got["example"].append(example(algo, seed, args.epochs))
            got["train"].append(train(algo, seed, args.epochs))
            print(f"{algo} seed {seed}: example {got['example'][-1]:.4f}, train {got['train'][-1]:.4f}", flush=True)
        e, t = (statistics.median(got[k]) for k in ("example", "train"))
        rows.append(
            f"{algo} | {e:.4f} ({min(got['example']):.4f}-{max(got['example']):.4f}) | "
            f"{t:.4f} ({min(got['train']):.4f}-{max(got['train']):.4f}) | {e - t:+.4f}"
        )
    lines = [
        f"# benchmarks/converted.py, {platform.node()}, {os.cpu_count()} cores, "
        f"{_dt.datetime.now(_dt.timezone.utc).isoformat(timespec='minutes')}, seeds {args.seeds}, "
        f"{args.epochs} epoch(s)",
        "algo | example median (range) | distsgd train median (range) | difference",
        *rows,
    ]
    print("\n".join(lines))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "accuracy.txt").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
