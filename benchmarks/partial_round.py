"""What DiLoCo should return when a round is cut short: the candidates measured side by side.

A run whose length H does not divide (or an evaluation inside a round) ends with a partial round:
the workers took k < H inner steps since the last outer step. The candidates (``--partial-round``):

- ``step``: an outer Nesterov step on the partial pseudo-gradient, as if the round were full;
- ``theta``: the global model of the last full round (the partial round's steps dropped);
- ``average``: the workers' models averaged (theta - Delta: what local SGD would return).

Each case trains once, 2 workers, with a checkpoint at its last step; each candidate then resumes
from that checkpoint and ends at once, so the candidates are compared on exactly the same workers'
models (a paired comparison: the training before the end does not depend on the rule).

    python benchmarks/partial_round.py --out /tmp/partial            # both suites, about 25 min on 2 cores
    python benchmarks/partial_round.py --suite fashion --out DIR
    python benchmarks/partial_round.py --render DIR                   # the markdown table again
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any

import distsgd

RULES = ("step", "theta", "average")
WORKERS, BATCH = 2, 64
PER_STEP = WORKERS * BATCH  # samples all workers take per step

# suite -> (common settings, [(H, steps per worker)], seeds). Each length leaves a partial round of
# steps % H (H = 500 is DiLoCo's default: the whole run is one partial round).
SUITES: dict[str, tuple[dict[str, Any], list[tuple[int, int]], list[int]]] = {
    "fashion": (
        {"model": "mnist_net", "data": "fashion-mnist"},
        [(100, 310), (100, 350), (100, 390), (500, 300)],
        [0, 1, 2],
    ),
    "gpt": ({"model": "gpt", "data": "python-stdlib"}, [(20, 45), (20, 55), (500, 47)], [0, 1]),
}


def case(suite: str, h: int, steps: int, seed: int, out: Path) -> dict[str, Any]:
    common, _, _ = SUITES[suite]
    samples = steps * PER_STEP
    base = out / f"{suite}-h{h}-s{steps}-seed{seed}"
    settings = dict(
        algo="diloco", workers=WORKERS, batch_size=BATCH, seed=seed, max_samples=samples, sync_every=str(h), quiet=True
    )
    trained = distsgd.train(
        **common, **settings, partial_round="step", checkpoint_every=samples, out=str(base / "trained"), overwrite=True
    ).summary
    row: dict[str, Any] = {
        "suite": suite,
        "H": h,
        "steps": steps,
        "partial": steps % h,
        "seed": seed,
        "task": trained.get("task", "classification"),
        "trained_step": _score(trained),
    }
    for rule in RULES:
        s = distsgd.train(
            resume=str(base / "trained"), partial_round=rule, out=str(base / rule), overwrite=True, quiet=True
        ).summary
        row[rule] = _score(s)
    return row


def _score(summary: dict[str, Any]) -> float:
    """Test accuracy for classification, test loss for a language model."""
    return summary["final_test_loss"] if summary.get("task") == "lm" else summary["final_test_accuracy"]


def render(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| suite | H | steps per worker | partial round | seeds | " + " | ".join(RULES) + " | best |",
        "|---|---|---|---|---|" + "---|" * len(RULES) + "---|",
    ]
    keys = sorted({(r["suite"], r["H"], r["steps"]) for r in rows}, key=lambda k: (k[0], k[1], k[2]))
    for suite, h, steps in keys:
        group = [r for r in rows if (r["suite"], r["H"], r["steps"]) == (suite, h, steps)]
        lm = group[0]["task"] == "lm"
        med = {rule: statistics.median(r[rule] for r in group) for rule in RULES}
        best = (min if lm else max)(RULES, key=lambda rule: med[rule])
        cells = [f"{med[rule]:.4f} ({', '.join(f'{r[rule]:.4f}' for r in group)})" for rule in RULES]
        lines.append(
            f"| {suite} ({'test loss' if lm else 'test accuracy'}) | {h} | {steps} | {steps % h} | "
            f"{len(group)} | " + " | ".join(cells) + f" | {best} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("/tmp/partial_round"))
    parser.add_argument("--suite", choices=list(SUITES), action="append")
    parser.add_argument("--render", type=Path, metavar="DIR", help="print the table of DIR/rows.json")
    args = parser.parse_args()
    if args.render:
        print(render(json.loads((args.render / "rows.json").read_text())))
        return
    args.out.mkdir(parents=True, exist_ok=True)
    rows_file = args.out / "rows.json"
    rows = json.loads(rows_file.read_text()) if rows_file.exists() else []
    done = {(r["suite"], r["H"], r["steps"], r["seed"]) for r in rows}
    for suite in args.suite or list(SUITES):
        _, cases, seeds = SUITES[suite]
        for h, steps in cases:
            for seed in seeds:
                if (suite, h, steps, seed) in done:
                    continue
                rows.append(case(suite, h, steps, seed, args.out))
                rows_file.write_text(json.dumps(rows, indent=1))
                print(json.dumps(rows[-1]), flush=True)
    print(render(rows))


if __name__ == "__main__":
    main()
