"""Fault trials for --min-workers (docs/RELIABILITY.md): a random worker of a 3-worker allreduce
run SIGKILLed at a random moment, trained through by the others, side by side with the same kill
under --restart-workers (the group restarts from its last checkpoint).

Each trial: the same kill (worker, moment after the workers started) in both runs, and, once, an
unkilled run of the same budget. Reported per trial and as medians: finished (exit 0), replicas
apart (max abs difference, must be 0), accuracy against the unkilled run, the recovery (kill seen
by the launcher to the next committed step, as the survivors measure it), and the wall time of
each run.

    python benchmarks/train_through.py --trials 10     # about 6 min on 2 cores
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BUDGET = 60_000
COMMON = [
    "--algo", "allreduce", "--workers", "3", "--dataset", "digits", "--model", "mlp", "--batch-size", "16",
    "--lr", "0.05", "--schedule", "cosine", "--max-samples", str(BUDGET), "--eval-every", "20000", "--quiet",
]  # fmt: skip


def run(out: Path, extra: list[str], kill: tuple[int, float] | None) -> dict:
    """One run into ``out``; ``kill``: (worker rank, seconds after the workers were listed)."""
    started = time.monotonic()
    proc = subprocess.Popen(
        [sys.executable, "-m", "distsgd", "train", *COMMON, *extra, "--out", str(out)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    killed = False
    if kill is not None:
        listed = out / "workers.json"
        while not listed.exists() and proc.poll() is None:
            time.sleep(0.02)
        time.sleep(kill[1])
        try:
            pids = {e["rank"]: e["pid"] for e in json.loads(listed.read_text()) if e["role"] == "worker"}
            os.kill(pids[kill[0]], signal.SIGKILL)
            killed = True
        except (OSError, ValueError, KeyError):  # the run ended first
            pass
    _, err = proc.communicate(timeout=600)
    wall = time.monotonic() - started
    summary = json.loads((out / "summary.json").read_text()) if proc.returncode == 0 else {}
    return {"rc": proc.returncode, "killed": killed, "wall_s": wall, "summary": summary, "stderr": err[-3000:]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trials", type=int, default=10)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    rng = random.Random(args.seed)
    with tempfile.TemporaryDirectory() as tmp:
        base = run(Path(tmp) / "clean", [], None)
        clean_acc = base["summary"]["final_test_accuracy"]
        print(f"unkilled: accuracy {clean_acc:.4f}, {base['wall_s']:.1f} s", flush=True)
        rows = []
        for t in range(args.trials):
            kill = (rng.randrange(3), rng.uniform(0.5, 6.0))
            through = run(Path(tmp) / f"through{t}", ["--min-workers", "2"], kill)
            restart = run(Path(tmp) / f"restart{t}", ["--restart-workers", "1", "--checkpoint-every", "6000"], kill)
            s = through["summary"]
            rec = (s.get("recoveries") or [{}])[0]
            row = {
                "worker": kill[0],
                "at_s": round(kill[1], 2),
                "killed": through["killed"],
                "finished": through["rc"] == 0,
                "replica_diff": s.get("replica_max_abs_diff"),
                "acc_diff": round(s["final_test_accuracy"] - clean_acc, 4) if s else None,
                "samples": s.get("samples"),
                "recovery_s": rec.get("recovery_s"),
                "wall_s": round(through["wall_s"], 2),
                "restart_finished": restart["rc"] == 0,
                "restart_acc_diff": round(restart["summary"]["final_test_accuracy"] - clean_acc, 4)
                if restart["summary"]
                else None,
                "restart_wall_s": round(restart["wall_s"], 2),
            }
            if not row["finished"]:
                row["stderr"] = through["stderr"]
            rows.append(row)
            print(json.dumps(row), flush=True)
    killed = [r for r in rows if r["killed"]]
    done = [r for r in killed if r["finished"]]
    print(
        f"\n{len(done)}/{len(killed)} killed runs finished without a restart; replicas equal in "
        f"{sum(r['replica_diff'] == 0.0 for r in done)}; accuracy difference to the unkilled run: median "
        f"{statistics.median(r['acc_diff'] for r in done):+.4f}, largest {max((r['acc_diff'] for r in done), key=abs):+.4f}; "
        f"recovery median {statistics.median(r['recovery_s'] for r in done if r['recovery_s'] is not None):.2f} s; "
        f"wall median {statistics.median(r['wall_s'] for r in done):.1f} s against "
        f"{statistics.median(r['restart_wall_s'] for r in killed):.1f} s restarting from a checkpoint "
        f"(unkilled {base['wall_s']:.1f} s)"
    )


if __name__ == "__main__":
    main()
