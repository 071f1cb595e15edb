"""Threads on a busy machine: `distsgd train` idle and beside one or two busy processes.

    python benchmarks/threads.py --ab /path/to/other/src [--repeats 3] [--models mlp,mnist_net]
    python benchmarks/threads.py --ab /path/to/other/src --env GOMP_SPINCOUNT=30000 --env OMP_WAIT_POLICY=PASSIVE

Each configuration is `distsgd train --model M --max-samples 6400` in a fresh process; the figure
is summary.json's ``samples_per_s`` (the training clock). A busy process is one PyTorch matmul loop
of one thread. For each load (0, 1, 2 busy processes), repeats alternate the variants:

- ``this default``: this checkout, no thread setting (the launcher's choice from the cores left);
- ``other default``: the ``--ab`` checkout (31e7de9 and before: cores / workers threads);
- ``--threads-per-worker 1``: this checkout, one thread;
- each ``--env NAME=VALUE``: the ``--ab`` checkout with that variable (OpenMP's wait policy, say).

Medians are printed as a table and written with the machine and the date to ``--out``.
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

HERE = Path(__file__).resolve().parent.parent / "src"
BUSY = "import torch\ntorch.set_num_threads(1)\na = torch.randn(512, 512)\nwhile True:\n    a @ a"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ab", required=True, help="another checkout's src/ (today's default)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--models", default="mlp,mnist_net")
    ap.add_argument("--samples", type=int, default=6400)
    ap.add_argument("--env", action="append", default=[], help="NAME=VALUE: a variant of the --ab checkout")
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/threads"))
    args = ap.parse_args()
    variants: dict[str, tuple[str, dict[str, str], list[str]]] = {
        "this default": (str(HERE), {}, []),
        "other default": (args.ab, {}, []),
        "--threads-per-worker 1": (str(HERE), {}, ["--threads-per-worker", "1"]),
    }
    for item in args.env:
        name, _, value = item.partition("=")
        variants[f"other {name}={value}"] = (args.ab, {name: value}, [])
    rows: dict[tuple[int, str, str], list[float]] = {}
    for load in (0, 1, 2):
        busy = [subprocess.Popen([sys.executable, "-c", BUSY]) for _ in range(load)]
        time.sleep(1.0)
        try:
            for _ in range(args.repeats):
                for model in args.models.split(","):
                    for name, (src, extra_env, flags) in variants.items():
                        with tempfile.TemporaryDirectory() as tmp:
                            env = {
                                k: v for k, v in os.environ.items() if not k.startswith(("OMP_", "GOMP_", "DISTSGD_"))
                            }
                            env.update(PYTHONPATH=src, **extra_env)
                            cmd = [sys.executable, "-m", "distsgd", "train", "--model", model]
                            cmd += ["--max-samples", str(args.samples), "--quiet", "--out", tmp, *flags]
                            r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
                            if r.returncode:
                                print(f"{load} {model} {name}: failed: {r.stderr[-300:]}", flush=True)
                                continue
                            s = json.loads((Path(tmp) / "summary.json").read_text())
                        rows.setdefault((load, model, name), []).append(s["samples_per_s"])
                        print(
                            f"{load} {model} {name}: {s['samples_per_s']:.0f} ({s['threads_per_worker']} threads)",
                            flush=True,
                        )
        finally:
            for p in busy:
                p.kill()
                p.wait()
    lines = [
        f"# benchmarks/threads.py, {platform.node()}, {os.cpu_count()} cores, "
        f"{_dt.datetime.now(_dt.timezone.utc).isoformat(timespec='minutes')}, --ab {args.ab}, {args.repeats} repeats",
        "busy processes | model | variant | median samples/s | runs",
    ]
    for (load, model, name), v in rows.items():
        lines.append(f"{load} | {model} | {name} | {statistics.median(v):.0f} | {', '.join(f'{x:.0f}' for x in v)}")
    print("\n".join(lines))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "threads.txt").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
