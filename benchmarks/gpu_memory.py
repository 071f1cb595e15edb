"""Where a run's GPU memory is at its peak: the open question of issue 45's strict xfail
(``tests/test_gpu.py::test_hogwild_keeps_no_gpu_copy_per_evaluation_point[on]``: under Hogwild!
threads on one GPU the peak grew by 278,021,120 bytes from 1 evaluation point to about 29, the
same to the byte in two runs of 2026-11-28, an H100; with the workers as processes it does not).

    python benchmarks/gpu_memory.py --out results-gpu/memory

Runs the test's case (a 1.2M-parameter model on digits, hogwild, 2 workers, one epoch) under
PyTorch's allocator history (``torch.cuda.memory._record_memory_history``, Python stacks), at each
``--eval-every`` given, and writes into ``--out``: ``memory.json`` and ``memory.txt``, for each run
the peak as torch counts it (``max_memory_allocated``) and as the history replays it, and the
blocks alive at that peak grouped by where they were allocated (the innermost frames of distsgd's
code and this script's, or else the innermost); then the groups that grew between the first
``--eval-every`` and the last. A GPU alone can run it; :func:`live_at_peak` and :func:`grouped`
read a history, and are tested on the CPU with one of the format PyTorch writes.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "src"))

OURS = ("distsgd", "benchmarks")  # the frames a group is named by, where the stack has any


def live_at_peak(trace: list[dict[str, Any]]) -> tuple[int, list[dict[str, Any]]]:
    """The bytes allocated at the history's peak, and the entries (``alloc`` actions) alive then.
    The allocator's own count (``allocated_bytes``) rises at ``alloc`` and falls in its ``free()``,
    where it records ``free_requested`` (a block still used by another stream is completed later,
    but is no longer allocated); a block freed that was allocated before the history began is not
    counted. The history's sizes are the sizes asked for, not the allocator's rounded blocks, so its
    peak is a little under ``max_memory_allocated``."""

    def replay(upto: int | None) -> tuple[int, int, dict[int, dict[str, Any]]]:
        live: dict[int, dict[str, Any]] = {}
        total, peak, at = 0, 0, -1
        for i, entry in enumerate(trace if upto is None else trace[: upto + 1]):
            if entry["action"] == "alloc":
                live[entry["addr"]] = entry
                total += entry["size"]
            elif entry["action"] == "free_requested" and entry["addr"] in live:
                total -= live.pop(entry["addr"])["size"]
            if total > peak:
                peak, at = total, i
        return peak, at, live

    peak, at, _ = replay(None)
    if at < 0:
        return 0, []
    _, _, live = replay(at)
    return peak, list(live.values())


def where(entry: dict[str, Any], depth: int = 3) -> str:
    """The place an allocation is named by: its innermost ``depth`` frames in distsgd's code or this
    script's, else its innermost frames whatever they are; ``?`` where it has no stack."""
    frames = entry.get("frames") or []
    ours = [f for f in frames if any(part in f.get("filename", "") for part in OURS)]
    chosen = (ours or frames)[:depth]
    if not chosen:
        return "?"
    return " < ".join(f"{Path(f.get('filename', '?')).name}:{f.get('line', '?')} {f.get('name', '?')}" for f in chosen)


def grouped(live: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The live blocks by place, the largest total first: place, blocks, bytes, sizes seen."""
    groups: dict[str, list[int]] = defaultdict(list)
    for entry in live:
        groups[where(entry)].append(entry["size"])
    rows = [{"where": k, "blocks": len(v), "bytes": sum(v), "sizes": sorted(set(v))[:6]} for k, v in groups.items()]
    return sorted(rows, key=lambda r: -r["bytes"])


def growth(first: list[dict[str, Any]], last: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Places whose bytes at the peak differ between two runs' groups, the largest change first."""
    before = {r["where"]: r for r in first}
    after = {r["where"]: r for r in last}
    rows = []
    for place in set(before) | set(after):
        b, a = before.get(place, {"bytes": 0, "blocks": 0}), after.get(place, {"bytes": 0, "blocks": 0})
        if a["bytes"] != b["bytes"]:
            rows.append({"where": place, "bytes": a["bytes"] - b["bytes"], "blocks": a["blocks"] - b["blocks"]})
    return sorted(rows, key=lambda r: -abs(r["bytes"]))


class Wide(torch.nn.Module):
    """The xfail test's model: 1.2 M parameters (4.7 MB) on 8x8 digits."""

    def __init__(self, num_classes: int) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(
            torch.nn.Flatten(), torch.nn.Linear(64, 16384), torch.nn.ReLU(), torch.nn.Linear(16384, num_classes)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def measure(eval_every: int, threads: str) -> dict[str, Any]:
    import distsgd

    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    torch.cuda.memory._record_memory_history(enabled="all", context="alloc", stacks="python", max_entries=500_000)
    try:
        s = distsgd.train(
            model=Wide,
            data="digits",
            algo="hogwild",
            workers=2,
            epochs=1,
            lr=0.01,
            eval_every=eval_every,
            device="cuda",
            hogwild_threads=threads,
            quiet=True,
        ).summary
        torch.cuda.synchronize()
        snapshot = torch.cuda.memory._snapshot()
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    trace = snapshot["device_traces"][torch.cuda.current_device()]
    peak, live = live_at_peak(trace)
    return {
        "eval_every": eval_every,
        "threads": threads,
        "evaluations": len(s.get("evals", [])),
        "cuda_graphs": s.get("cuda_graphs"),
        "max_memory_allocated": torch.cuda.max_memory_allocated(),
        "history_entries": len(trace),
        "history_peak": peak,
        "at_peak": grouped(live),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--eval-every", default="2000,50", help="evaluation periods, in samples (the test's: 2000,50)")
    ap.add_argument("--threads", default="on", choices=["on", "off"], help="Hogwild!'s workers as threads (on)")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    runs = [measure(int(e), args.threads) for e in args.eval_every.split(",")]
    report = {"runs": runs, "growth": growth(runs[0]["at_peak"], runs[-1]["at_peak"]) if len(runs) > 1 else []}
    (out / "memory.json").write_text(json.dumps(report, indent=1))
    lines = []
    for r in runs:
        lines.append(
            f"eval_every {r['eval_every']} threads {r['threads']}: {r['evaluations']} evaluations, cuda_graphs "
            f"{r['cuda_graphs']}; max_memory_allocated {r['max_memory_allocated']:,}, history's peak "
            f"{r['history_peak']:,} ({r['history_entries']} entries)"
        )
        lines += [f"  {g['bytes']:>13,} in {g['blocks']:>4} blocks  {g['where']}" for g in r["at_peak"][:15]]
    lines.append("grown from the first run's peak to the last's:")
    lines += [f"  {g['bytes']:>+13,} in {g['blocks']:>+4} blocks  {g['where']}" for g in report["growth"][:15]]
    (out / "memory.txt").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
