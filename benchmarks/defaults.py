"""Every algorithm with every default, on each kind of built-in model: does the run train?

What a user who sets nothing but ``--algo``, ``--model`` and ``--workers`` gets: each algorithm x
{mnist_net on Fashion-MNIST, gpt on python-stdlib}, 2 workers (single: 1), a fixed sample budget,
every other setting at its default (but one evaluation, at the end). Reported: the final test accuracy (or test loss, against the
corpus's unigram entropy), and the same figure as ``distsgd eval`` measures it on the saved
model.pt (they must agree).

    python benchmarks/defaults.py --out /tmp/defaults           # about 30 min on 2 cores
    python benchmarks/defaults.py --render /tmp/defaults         # the markdown table again
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

MODELS = {"mnist_net": 30_000, "gpt": 6_000}  # model -> samples, all workers together


def algorithms() -> list[str]:
    out = subprocess.run(
        [sys.executable, "-m", "distsgd", "algorithms", "--markdown"], check=True, capture_output=True, text=True
    ).stdout
    return [line.split("`")[1] for line in out.splitlines() if line.startswith("| `")]


def one(algo: str, model: str, out: Path) -> dict[str, Any]:
    run = out / f"{model}-{algo}"
    workers = "1" if algo == "single" else "2"
    # --eval-every the budget: one evaluation, at the end (the others cost the GPT ~20 s each and do
    # not change training)
    cmd = [
        sys.executable,
        "-m",
        "distsgd",
        "train",
        "--algo",
        algo,
        "--model",
        model,
        "--workers",
        workers,
        "--max-samples",
        str(MODELS[model]),
        "--eval-every",
        str(MODELS[model]),
        "--out",
        str(run),
        "--overwrite",
        "--quiet",
    ]
    res = subprocess.run(cmd, capture_output=True, text=True)
    row: dict[str, Any] = {"algo": algo, "model": model, "workers": int(workers), "rc": res.returncode}
    if res.returncode != 0:
        row["error"] = res.stderr.strip().splitlines()[-1:] if res.stderr else []
        return row
    s = json.loads((run / "summary.json").read_text())
    ev = subprocess.run(
        [sys.executable, "-m", "distsgd", "eval", "--checkpoint", str(run / "model.pt"), "--json"],
        capture_output=True,
        text=True,
        check=True,
    )
    saved = json.loads(ev.stdout)
    row.update(
        samples=s["samples"],
        accuracy=s["final_test_accuracy"],
        loss=s["final_test_loss"],
        saved_accuracy=saved["test_accuracy"],
        saved_loss=saved["test_loss"],
        unigram_entropy=s.get("unigram_entropy"),
        optimizer=s.get("config", {}).get("optimizer"),
        lr=s.get("config", {}).get("lr"),
    )
    return row


def render(rows: list[dict[str, Any]]) -> str:
    by = {(r["algo"], r["model"]): r for r in rows}
    algos = list(dict.fromkeys(r["algo"] for r in rows))
    entropy = next((r["unigram_entropy"] for r in rows if r.get("unigram_entropy")), None)
    lines = [
        f"| algorithm | mnist_net, Fashion-MNIST, {MODELS['mnist_net']:,} samples: test accuracy "
        f"(saved model.pt) | gpt, python-stdlib, {MODELS['gpt']:,} samples: test loss, nats/token "
        f"(saved; unigram entropy {entropy:.4f}) |"
        if entropy
        else "| algorithm | mnist_net | gpt |",
        "|---|---|---|",
    ]

    def cell(r: dict[str, Any] | None, key: str) -> str:
        if r is None:
            return "not run"
        if r["rc"] != 0:
            return f"failed: {' '.join(r.get('error', []))}"
        return f"{r[key]:.4f} ({r['saved_' + key]:.4f})"

    for algo in algos:
        lines.append(
            f"| {algo} | {cell(by.get((algo, 'mnist_net')), 'accuracy')} | {cell(by.get((algo, 'gpt')), 'loss')} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("/tmp/defaults"))
    parser.add_argument("--render", type=Path, metavar="DIR")
    parser.add_argument("--models", default=",".join(MODELS))
    args = parser.parse_args()
    if args.render:
        print(render(json.loads((args.render / "rows.json").read_text())))
        return
    args.out.mkdir(parents=True, exist_ok=True)
    rows_file = args.out / "rows.json"
    rows = json.loads(rows_file.read_text()) if rows_file.exists() else []
    done = {(r["algo"], r["model"]) for r in rows if r["rc"] == 0}
    for model in args.models.split(","):
        for algo in algorithms():
            if (algo, model) in done:
                continue
            rows = [r for r in rows if (r["algo"], r["model"]) != (algo, model)] + [one(algo, model, args.out)]
            rows_file.write_text(json.dumps(rows, indent=1))
            print(json.dumps(rows[-1]), flush=True)
    print(render(rows))


if __name__ == "__main__":
    main()
