"""The README's quick start on a fresh clone, timed: idle and beside one busy process.

    python benchmarks/quickstart.py [--repeats 2] [--out benchmarks/results/quickstart]

Each attempt clones this repository's committed HEAD into a new temporary directory and runs the
README's first command there, as a newcomer would: ``python3 -m venv .venv && ... && distsgd train``
(the ``sh`` block under "Quick start", read from the README, not restated here). It records the
command's wall time from start to exit (venv, install, training), the training clock's seconds
and the test accuracy from the run's ``summary.json``. A busy process is one PyTorch matmul loop
of one thread, started a second before the command. Loads alternate (idle, busy, idle, busy, ...).
The log, with the machine and the date, goes to ``--out``/quickstart.txt.
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
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BUSY = "import torch\ntorch.set_num_threads(1)\na = torch.randn(512, 512)\nwhile True:\n    a @ a"


def quick_start_command() -> str:
    """The first ``sh`` block of the README's Quick start section."""
    readme = (ROOT / "README.md").read_text()
    section = readme.split("## Quick start", 1)[1]
    match = re.search(r"```sh\n(.+?)\n```", section, re.S)
    if match is None:
        raise SystemExit("error: README.md's Quick start has no sh block")
    return match.group(1).strip()


def attempt(command: str, busy: bool) -> dict[str, object]:
    with tempfile.TemporaryDirectory(prefix="quickstart-") as tmp:
        clone = Path(tmp) / "distsgd"
        subprocess.run(["git", "clone", "-q", str(ROOT), str(clone)], check=True)
        env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH")}
        env["PATH"] = os.pathsep.join(p for p in env.get("PATH", "").split(os.pathsep) if ".venv" not in p)
        hog = subprocess.Popen([sys.executable, "-c", BUSY]) if busy else None
        try:
            if hog is not None:
                time.sleep(1.0)
            started = time.perf_counter()
            done = subprocess.run(["bash", "-c", command], cwd=clone, env=env, capture_output=True, text=True)
            wall = time.perf_counter() - started
        finally:
            if hog is not None:
                hog.kill()
                hog.wait()
        if done.returncode != 0:
            raise SystemExit(f"error: the quick start failed ({done.returncode}):\n{done.stderr[-2000:]}")
        summaries = sorted((clone / "runs").glob("*/summary.json"))
        summary = json.loads(summaries[-1].read_text())
        return {
            "load": "1 busy process" if busy else "idle",
            "command_s": round(wall, 1),
            "train_wall_s": round(summary["train_wall_s"], 2),
            "threads_per_worker": summary.get("threads_per_worker"),
            "final_test_accuracy": summary["final_test_accuracy"],
        }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/quickstart")
    args = ap.parse_args()
    command = quick_start_command()
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout
    rows = []
    for r in range(args.repeats):
        for busy in (False, True):
            row = attempt(command, busy)
            print(json.dumps(row), flush=True)
            rows.append(row)
    lines = [
        f"# benchmarks/quickstart.py, {_dt.datetime.now(_dt.timezone.utc):%Y-%m-%d %H:%M} UTC, commit {head.strip()}",
        f"# {platform.node()}: {os.cpu_count()} cores, {platform.platform()}, Python {platform.python_version()}",
        f"# command: {command}",
        *[json.dumps(row) for row in rows],
    ]
    for load in ("idle", "1 busy process"):
        mine = [row for row in rows if row["load"] == load]
        lines.append(
            f"# {load}: command {statistics.median(float(r['command_s']) for r in mine):.1f} s, "
            f"training {statistics.median(float(r['train_wall_s']) for r in mine):.2f} s (medians of {len(mine)})"
        )
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "quickstart.txt").write_text("\n".join(lines) + "\n")
    print("\n".join(lines[-2:]))


if __name__ == "__main__":
    main()
