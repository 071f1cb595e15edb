"""Fault trials for --min-workers (docs/RELIABILITY.md, docs/BENCHMARKS.md): a random worker of a
3-worker run SIGKILLed at a random moment and trained through by the others (``through``); the
same with ``--restart-workers 1``, where its replacement joins the others and takes a live peer's
state (``join``); and the same kill where the group restarts from its last checkpoint instead
(``--restart-workers 1 --checkpoint-every B/10``, ``restart``, B the samples a run, ``--samples``,
60,000 by default); and trained through with checkpoints all along (``--min-workers 2
--checkpoint-every B/10``, ``checkpointed``: those taken after the loss hold the survivors' parts,
the last one's listed as ``ckpt_ranks``).

Each trial makes the same kill (worker, moment after the workers were listed) in every mode;
each algorithm has one unkilled run of the same budget, and the kills fall in 10-90% of its time
from the workers' listing to its end (``--window``). Reported per trial and per mode: finished
(exit 0), replicas apart (max abs difference, must be 0), accuracy against the unkilled run, the
recovery (a failed collective to the next completed step, as the survivors measure it), the join
(the replacement ready to its first step with the others) and the wall time.

    python benchmarks/train_through.py --trials 10                       # allreduce, ~6 min on 2 cores
    python benchmarks/train_through.py --algos local-sgd,diloco --trials 5
    python benchmarks/train_through.py --algos diloco --modes through,join --window 0,0.1   # early kills
    python benchmarks/train_through.py --algos allreduce,diloco --modes through,restart --samples 300000
    python benchmarks/train_through.py --torchrun --modes through,join,restart --trials 5

``--torchrun``: the same 3 workers as ``torchrun --standalone --nproc-per-node 3`` (each process
keeps one worker with --min-workers: the kill is of that worker, found under its torchrun process;
``restart`` is then torchrun's own ``--max-restarts 1`` with ``--checkpoint-every``).
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

TORCHRUN = [*"-m torch.distributed.run --standalone --nproc-per-node 3".split()]

BUDGET = 60_000  # samples a run (--samples); three evaluations, and a checkpoint every tenth (restart, checkpointed)
COMMON = [
    "--workers", "3", "--dataset", "digits", "--model", "mlp", "--batch-size", "16", "--schedule", "cosine", "--quiet",
]  # fmt: skip
ALGOS = {
    "allreduce": ["--lr", "0.05"],
    "ddp": ["--lr", "0.05"],  # its all-reduces waited on in a communication hook
    "local-sgd": ["--lr", "0.05", "--sync-every", "8"],
    "diloco": ["--sync-every", "20"],  # its own inner AdamW
    "easgd": ["--lr", "0.05", "--tau", "4"],  # sync mode
    "streaming-diloco": [
        "--sync-every",
        "20",
        "--fragments",
        "4",
        "--overlap",
        "2",
    ],  # a fragment in flight 2 of every 5 steps
}
MODES = {
    "through": ["--min-workers", "2"],
    "join": ["--min-workers", "2", "--restart-workers", "1"],
    "restart": ["--restart-workers", "1", "--checkpoint-every", "{every}"],
    # trained through, checkpointed all along: a checkpoint after the loss holds the survivors' parts
    "checkpointed": ["--min-workers", "2", "--checkpoint-every", "{every}"],
}


def budget_flags(budget: int) -> list[str]:
    return ["--max-samples", str(budget), "--eval-every", str(budget // 3)]


def mode_flags(mode: str, budget: int) -> list[str]:
    return [a.format(every=budget // 10) for a in MODES[mode]]


def _children() -> dict[int, list[int]]:
    """Every process's children, from /proc."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                ppid = int(Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    return children


def torchrun_workers(agent: int, kept: bool) -> dict[int, int]:
    """Each rank's worker under torchrun: the processes torchrun's agent started (RANK in their
    environment) or, with --min-workers (``kept``), the child of the fork server each of those started."""
    children, workers = _children(), {}
    for process in children.get(agent, []):  # (python -m torch.distributed.run: this process is the agent)
        try:
            text = Path(f"/proc/{process}/environ").read_text()
        except OSError:
            continue
        env = dict(kv.split("=", 1) for kv in text.split("\0") if "=" in kv)
        if "RANK" not in env:
            continue
        if not kept:
            workers[int(env["RANK"])] = process
        for server in children.get(process, []) if kept else []:
            for worker in children.get(server, []):
                workers[int(env["RANK"])] = worker
    return workers


def run(out: Path, args: list[str], kill: tuple[int, float] | None, torchrun: list[str] | None = None) -> dict:
    """One run into ``out``; ``kill``: (worker rank, seconds after the workers were listed: under
    torchrun (``torchrun``: its own flags), once every rank's worker is found)."""
    started = time.monotonic()
    command = (
        [*TORCHRUN, *torchrun, "-m", "distsgd", "train", *COMMON[2:]]
        if torchrun is not None
        else ["-m", "distsgd", "train", *COMMON]
    )
    proc = subprocess.Popen(
        [sys.executable, *command, *args, "--out", str(out)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"} if torchrun is not None else None,
    )
    killed = False
    listed = out / "workers.json"

    def workers() -> dict[int, int]:
        if torchrun is not None:  # (those seen twice, 0.2 s apart: not the fork server's short-lived warm-up)
            first = torchrun_workers(proc.pid, "--min-workers" in args)
            time.sleep(0.2)
            return {
                r: pid for r, pid in torchrun_workers(proc.pid, "--min-workers" in args).items() if first.get(r) == pid
            }
        try:
            return {e["rank"]: e["pid"] for e in json.loads(listed.read_text()) if e["role"] == "worker"}
        except (OSError, ValueError):
            return {}

    # the moment kills count from: the workers listed (local); under torchrun, the run's metrics
    # file made (rank 0 is about to start its worker: its processes, torchrun's, started before
    # the data loaded, and with --min-workers each starts its worker after a fork server of its own)
    started_training = (
        (lambda: (out / "metrics.jsonl").exists()) if torchrun is not None else lambda: len(workers()) == 3
    )
    while not started_training() and proc.poll() is None:
        time.sleep(0.02)
    listed_at = time.monotonic()
    if kill is not None:
        time.sleep(kill[1])
        while len(workers()) < 3 and proc.poll() is None:
            time.sleep(0.02)
        try:
            os.kill(workers()[kill[0]], signal.SIGKILL)
            killed = True
        except (OSError, KeyError):  # the run ended first
            pass
    _, err = proc.communicate(timeout=600)
    wall = time.monotonic() - started
    summary = json.loads((out / "summary.json").read_text()) if proc.returncode == 0 else {}
    try:  # the last checkpoint's workers (its parts), where the run took checkpoints
        ranks = json.loads((out / "checkpoint" / "manifest.json").read_text())["ranks"]
    except (OSError, ValueError, KeyError):
        ranks = None
    return {
        "ckpt_ranks": ranks,
        "rc": proc.returncode,
        "killed": killed,
        "wall_s": wall,
        "window_s": time.monotonic() - listed_at,  # from the workers' listing to the end
        "summary": summary,
        "stderr": "\n".join([line for line in err.splitlines() if line.startswith("error:")] + [err[-1500:]]),
    }


def row(mode: str, r: dict, clean_acc: float) -> dict:
    s = r["summary"]
    recs = s.get("recoveries") or []
    lost = [x for x in recs if not x.get("joined")]
    joined = [x for x in recs if x.get("joined")]
    out = {
        "mode": mode,
        "killed": r["killed"],
        "finished": r["rc"] == 0,
        "replica_diff": s.get("replica_max_abs_diff"),
        "acc_diff": round(s["final_test_accuracy"] - clean_acc, 4) if s else None,
        "samples": s.get("samples"),
        "recovery_s": lost[0].get("recovery_s") if lost else None,
        "join_s": joined[0].get("recovery_s") if joined else None,
        "restarts": len(s.get("restarts") or []),
        "wall_s": round(r["wall_s"], 2),
    }
    if r["ckpt_ranks"] is not None:
        out["ckpt_ranks"] = r["ckpt_ranks"]
    if r["rc"]:
        out["stderr"] = r["stderr"]
    return out


def median(values: list) -> str:
    values = [v for v in values if v is not None]
    return f"{statistics.median(values):.2f}" if values else "-"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--algos", default="allreduce")
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--trials", type=int, default=10)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--torchrun", action="store_true", help="the workers as torchrun's 3 processes on this machine")
    ap.add_argument("--samples", type=int, default=BUDGET, help="samples a run (default %(default)s)")
    ap.add_argument(
        "--window",
        default="0.1,0.9",
        help="where the kills fall, as fractions of the unkilled run's time from the workers' listing to "
        "its end (0,0.1: while the workers start, build and take their first steps)",
    )
    args = ap.parse_args()
    lo, hi = (float(x) for x in args.window.split(","))
    rng = random.Random(args.seed)
    modes = args.modes.split(",")
    with tempfile.TemporaryDirectory() as tmp:
        for algo in args.algos.split(","):
            own = ["--algo", algo, *ALGOS[algo], *budget_flags(args.samples)]
            base = run(Path(tmp) / f"{algo}-clean", own, None, [] if args.torchrun else None)
            clean_acc = base["summary"]["final_test_accuracy"]
            print(f"{algo} unkilled: accuracy {clean_acc:.4f}, {base['wall_s']:.1f} s", flush=True)
            rows = []
            for t in range(args.trials):
                kill = (rng.randrange(3), rng.uniform(lo, hi) * base["window_s"])  # within the unkilled run
                for mode in modes:  # alternating, the same kill in each
                    flags, launcher = mode_flags(mode, args.samples), None
                    if args.torchrun:  # restart: torchrun's own restart of the group, from the checkpoint
                        launcher = ["--max-restarts", "1"] if mode == "restart" else []
                        flags = flags[2:] if mode == "restart" else flags  # (not --restart-workers 1)
                    r = row(mode, run(Path(tmp) / f"{algo}-{mode}{t}", own + flags, kill, launcher), clean_acc)
                    rows.append({"algo": algo, "trial": t, "worker": kill[0], "at_s": round(kill[1], 2), **r})
                    print(json.dumps(rows[-1]), flush=True)
            for mode in modes:
                mine = [r for r in rows if r["mode"] == mode and r["killed"]]
                done = [r for r in mine if r["finished"]]
                print(
                    f"{algo} {mode}: {len(done)}/{len(mine)} killed runs finished; replicas equal in "
                    f"{sum(r['replica_diff'] == 0.0 for r in done)}; accuracy against the unkilled run: median "
                    f"{median([r['acc_diff'] for r in done])}, largest "
                    f"{max((r['acc_diff'] for r in done), key=abs, default=0):+.4f}; recovery median "
                    f"{median([r['recovery_s'] for r in done])} s, join median {median([r['join_s'] for r in done])} s; "
                    f"wall median {median([r['wall_s'] for r in done])} s (unkilled {base['wall_s']:.1f} s)",
                    flush=True,
                )


if __name__ == "__main__":
    main()
