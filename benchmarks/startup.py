"""What a short run of the ``distsgd`` command costs besides training: wall time and CPU, start to exit.

    python benchmarks/startup.py [--repeats 5] [--ab /path/to/other/src] [--out benchmarks/results/startup]

Each case is a whole command (``python -m distsgd train ...``, digits, a few hundred samples a
worker: training is a tenth of a second of it), so what is measured is everything else: imports,
the fork server, the workers' start, the evaluation, the exit. The CPU is the whole machine's,
from /proc/stat's busy ticks before and after (so that a fork server the command does not wait for
counts too): run it on an otherwise idle machine. With ``--ab SRC`` every case also runs with
``PYTHONPATH=SRC`` (another checkout's ``src``), the two in turn (A B A B ...), and the table gives
each one's median and the ratio of the medians. The log, with the machine and the date, goes to
``--out``/startup.txt.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

CASES = {
    "single": ["--algo", "single"],
    "allreduce x2": ["--algo", "allreduce", "--workers", "2"],
    "hogwild x2": ["--algo", "hogwild", "--workers", "2"],
    "asgd x2": ["--algo", "asgd", "--workers", "2"],
}
COMMON = ["--dataset", "digits", "--model", "mlp", "--max-samples", "1000", "--quiet"]


def _busy_ticks() -> int:
    with open("/proc/stat") as f:
        fields = [int(v) for v in f.readline().split()[1:9]]
    return sum(fields) - fields[3] - fields[4]  # all but idle and iowait


def once(args: list[str], src: str | None) -> tuple[float, float]:
    """(wall seconds, CPU seconds of the whole machine) of one command."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["DISTSGD_OFFLINE"] = "1"
    if src is not None:
        env["PYTHONPATH"] = src
    with tempfile.TemporaryDirectory(prefix="startup-") as tmp:
        ticks, started = _busy_ticks(), time.perf_counter()
        done = subprocess.run(
            [sys.executable, "-m", "distsgd", "train", *args, *COMMON, "--out", f"{tmp}/run"],
            env=env,
            capture_output=True,
            text=True,
        )
        wall, cpu = time.perf_counter() - started, (_busy_ticks() - ticks) / os.sysconf("SC_CLK_TCK")
    if done.returncode != 0:
        raise SystemExit(f"error: {' '.join(args)} failed: {done.stderr.strip()[-500:]}")
    return wall, cpu


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--ab", metavar="SRC", help="another checkout's src directory, run in turn with this one")
    parser.add_argument("--out", default="benchmarks/results/startup")
    args = parser.parse_args()
    sides = {"this": None} | ({"other": args.ab} if args.ab else {})
    lines = [
        f"# startup.py, {_dt.datetime.now(_dt.timezone.utc):%Y-%m-%d %H:%M} UTC, {platform.node()}, "
        f"{os.cpu_count()} cores, torch {torch.__version__}, Python {platform.python_version()}",
        f"# {args.repeats} repeats, the sides in turn" + (f"; other = {args.ab}" if args.ab else ""),
    ]
    for name, case in CASES.items():
        once(case, None)  # one unrecorded run: the page cache warm for both sides
        got: dict[str, list[tuple[float, float]]] = {side: [] for side in sides}
        for _ in range(args.repeats):
            for side, src in sides.items():
                got[side].append(once(case, src))
        medians = {
            side: (statistics.median(w for w, _ in runs), statistics.median(c for _, c in runs))
            for side, runs in got.items()
        }
        row = [name] + [f"{side}: wall {w:.2f} s, cpu {c:.2f} s" for side, (w, c) in medians.items()]
        if args.ab:
            (wa, ca), (wb, cb) = medians["this"], medians["other"]
            row.append(f"this/other: wall {wa / wb:.2f}, cpu {ca / cb:.2f}")
        lines.append(" | ".join(row))
        print(lines[-1], flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "startup.txt").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
