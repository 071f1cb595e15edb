"""Regenerate docs/BENCHMARKS.md for this machine.

    python benchmarks/run_all.py                # run every part (about an hour on 2 cores), then render
    python benchmarks/run_all.py --part main    # one part: seeds | main | easgd_tau | easgd_lr | hogwildpp_torchrun | straggler | limits | data_path | low_comm
    python benchmarks/run_all.py --render       # only rebuild docs/BENCHMARKS.md from benchmarks/results/

Every part stores what it measured under benchmarks/results/ (bench.json, bench.md and plots from
`distsgd bench`, or the printed table of a script), so the document can be rebuilt without
re-running, and each number in it traces back to a file. Settings are the seeds': Fashion-MNIST,
mnist_net, SGD lr 0.01 momentum 0.5, batch 64 per worker, one thread per worker, target 85%.
Nothing else should run on the machine meanwhile.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
DOC = HERE.parent / "docs" / "BENCHMARKS.md"

SEEDS = [
    "--dataset",
    "fashion-mnist",
    "--model",
    "mnist_net",
    "--lr",
    "0.01",
    "--momentum",
    "0.5",
    "--batch-size",
    "64",
    "--threads-per-worker",
    "1",
    "--target-accuracy",
    "0.85",
]
MAIN_ALGOS = (
    "single[workers=1],allreduce,ddp,hogwild,asgd,sync-ps,ssp,dcasgd,"
    "local-sgd[sync_every=1],local-sgd[sync_every=8],local-sgd[sync_every=64],local-sgd[sync_every=epoch],"
    "easgd,easgd[easgd_mode=async],hogwild++"
)
MAIN_BUDGET = "1200000"  # samples: 20 epochs of Fashion-MNIST
STRAGGLER_ALGOS = "allreduce,local-sgd[sync_every=8],hogwild,asgd,ssp"
STRAGGLER_BUDGET = "120000"


def bench(name: str, algos: str, extra: list[str]) -> None:
    """Run `distsgd bench` into a scratch folder; keep its json, table and plots in results/<name>."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / name
        cmd = [
            sys.executable,
            "-m",
            "distsgd",
            "bench",
            "--algos",
            algos,
            "--workers",
            "2",
            "--out",
            str(out),
            *SEEDS,
            *extra,
        ]
        print("+", " ".join(cmd), flush=True)
        subprocess.run(cmd, check=True)
        dest = RESULTS / name
        shutil.rmtree(dest, ignore_errors=True)
        dest.mkdir(parents=True)
        for f in (
            "bench.json",
            "bench.md",
            "accuracy_vs_time.png",
            "accuracy_vs_samples.png",
            "throughput_vs_workers.png",
        ):
            if (out / f).exists():
                shutil.copy(out / f, dest / f)


def script(name: str, args: list[str]) -> None:
    cmd = [sys.executable, str(HERE / f"{name}.py"), *args]
    print("+", " ".join(cmd), flush=True)
    text = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"{name}.txt").write_text(text)


def seeds_single() -> None:
    """Issue 2's check: the seeds' model and settings, 10 epochs, one process (default threads)."""
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [
            sys.executable,
            "-m",
            "distsgd",
            "train",
            "--algo",
            "single",
            "--dataset",
            "fashion-mnist",
            "--model",
            "mnist_net",
            "--epochs",
            "10",
            "--lr",
            "0.01",
            "--momentum",
            "0.5",
            "--batch-size",
            "64",
            "--target-accuracy",
            "0.84",
            "--out",
            f"{tmp}/run",
            "--quiet",
        ]
        print("+", " ".join(cmd), flush=True)
        subprocess.run(cmd, check=True)
        dest = RESULTS / "seeds_single"
        dest.mkdir(parents=True, exist_ok=True)
        shutil.copy(f"{tmp}/run/summary.json", dest / "summary.json")


def hogwildpp_torchrun() -> None:
    """hogwild++ with its clusters in separate processes (as on separate nodes): torchrun, 2 x 1."""
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            "2",
            "-m",
            "distsgd",
            "train",
            "--algo",
            "hogwild++",
            "--cluster-size",
            "1",
            *SEEDS,
            "--max-samples",
            MAIN_BUDGET,
            "--eval-every",
            "30000",
            "--out",
            f"{tmp}/run",
            "--quiet",
        ]
        print("+", " ".join(cmd), flush=True)
        subprocess.run(cmd, check=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
        dest = RESULTS / "hogwildpp_torchrun"
        dest.mkdir(parents=True, exist_ok=True)
        shutil.copy(f"{tmp}/run/summary.json", dest / "summary.json")


PARTS = {
    "seeds": seeds_single,
    "main": lambda: bench("main", MAIN_ALGOS, ["--max-samples", MAIN_BUDGET, "--eval-every", "30000"]),
    "easgd_tau": lambda: bench(
        "easgd_tau", "easgd[tau=1],easgd[tau=2]", ["--max-samples", MAIN_BUDGET, "--eval-every", "30000"]
    ),
    "easgd_lr": lambda: bench(
        "easgd_lr",
        "easgd[lr=0.015],easgd[lr=0.015;easgd_mode=async]",
        ["--max-samples", MAIN_BUDGET, "--eval-every", "30000"],
    ),
    "hogwildpp_torchrun": hogwildpp_torchrun,
    "straggler": lambda: bench(
        "straggler", STRAGGLER_ALGOS, ["--max-samples", STRAGGLER_BUDGET, "--eval-every", "60000", "--straggler", "1:3"]
    ),
    "limits": lambda: script("limits", ["--repeats", "5"]),
    "data_path": lambda: script("data_path", []),
    "low_comm": lambda: low_comm(),
}


def low_comm() -> None:
    """Two network namespaces (root only): every cell measured again."""
    if os.geteuid() != 0:
        print("skipping low_comm: network namespaces need root", flush=True)
        return
    subprocess.run([sys.executable, str(HERE / "low_comm.py"), "--again"], check=True)


def load(name: str) -> dict[str, Any] | None:
    path = RESULTS / name / "bench.json"
    return json.loads(path.read_text()) if path.exists() else None


def row(b: dict[str, Any], algo: str) -> dict[str, Any] | None:
    return next((r for r in b["rows"] if r["algo"] == algo), None)


def med(stat: dict[str, float] | None) -> float | None:
    return None if stat is None else stat["median"]


def render() -> str:
    from distsgd.bench.report import markdown

    out = [
        "# Benchmarks",
        "",
        "Measured numbers only, each traceable to a file under `benchmarks/results/`. Tests never assert "
        "timings; this page is where speed is recorded. Regenerate with `python benchmarks/run_all.py` "
        "(about an hour on 2 cores; nothing else should run meanwhile).",
        "",
    ]
    main = load("main")
    if main:
        m = main["machine"]
        out += [
            f"**Machine**: {m['host']}, {m['cpu']}, {m['cores']} cores, no GPU; torch {m['torch_version']}, "
            f"Python {m['python']}. **Main bench run on {main['date']}.**",
            "",
        ]
        out += [
            "## Every algorithm at 2 workers (Fashion-MNIST, mnist_net, the seeds' settings)",
            "",
            "Each algorithm trains for 1.2M samples (20 epochs) with 2 workers of 1 thread (`single`: 1 "
            "worker of 1 thread); the model is evaluated every 30,000 samples, with the training clock "
            "stopped (synchronous algorithms) or on a copy taken without pausing the workers (Hogwild!, "
            "parameter server). One repeat each: differences of a few percent in samples/s are within "
            "this VM's noise (about +-10% run to run).",
            "",
        ]
        table = markdown(main).split("\n")
        out += [line for line in table if line.startswith("|")] + [""]
        out += [
            "![test accuracy against training time](../benchmarks/results/main/accuracy_vs_time.png)",
            "",
            "![test accuracy against samples](../benchmarks/results/main/accuracy_vs_samples.png)",
            "",
        ]
        out += highlights(main)
        notes = RESULTS / "NOTES.md"
        if notes.exists():
            out += [notes.read_text().strip(), ""]
    tau = load("easgd_tau")
    if tau:
        out += [
            "## EASGD with shorter exchange periods",
            "",
            f"`easgd` at the main bench's settings but exchanging every tau = 1 or 2 steps instead of 8 "
            f"(run on {tau['date']}, 2 workers of 1 thread, 1.2M samples):",
            "",
        ]
        out += [line for line in markdown(tau).split("\n") if line.startswith("|")] + [""]
    lr = load("easgd_lr")
    if lr:
        out += [
            "## EASGD with the learning rate scaled by (N + 1) / N",
            "",
            f"An elastic exchange conserves N x_mean + x~, so the centre advances at N / (N + 1) of averaged "
            f"SGD's pace at the same lr. `easgd` with lr 0.015 = 0.01 x 3/2, everything else as in the main "
            f"bench (run on {lr['date']}, 2 workers of 1 thread, tau 8, 1.2M samples):",
            "",
        ]
        out += [line for line in markdown(lr).split("\n") if line.startswith("|")] + [""]
    hpp = RESULTS / "hogwildpp_torchrun" / "summary.json"
    if hpp.exists() and main:
        h = json.loads(hpp.read_text())
        one = row(main, "hogwild++")
        out += [
            "## hogwild++ with its clusters in separate processes",
            "",
            f"The same settings as the main bench, but each of the 2 clusters (1 worker each) is its own "
            f"torchrun process, as it would be on its own node, and the token moves by gloo send/recv "
            f"(`torchrun --standalone --nproc-per-node 2 ... --algo hogwild++ --cluster-size 1`, run on "
            f"{h['started_at'][:10]}):",
            "",
            "| run | samples/s | time to 85% (s) | samples to 85% | final acc | token passes | bytes/sample |",
            "|---|---|---|---|---|---|---|",
        ]
        if one:
            out.append(
                f"| one process per worker, shared memory (main bench) | {med(one['samples_per_s']):.0f} | "
                f"{_fmt(med(one['time_to_target_s']))} | {_fmt(med(one['samples_to_target']), 0)} | "
                f"{med(one['final_test_accuracy']):.4f} | - | {med(one['bytes_sent_per_sample']):.0f} |"
            )
        out.append(
            f"| one torchrun process per cluster, point-to-point | {h['samples_per_s']:.0f} | "
            f"{_fmt(h['time_to_target_s'])} | {_fmt(h['samples_to_target'], 0)} | "
            f"{h['final_test_accuracy']:.4f} | {h['token_passes']} | {h['bytes_sent_per_sample']:.0f} |"
        )
        out += [
            "",
            "Across processes a pass costs two messages (delta out, the next cluster's weights back), "
            "so bytes per sample double. During the run rank 0 evaluates its own cluster's model, with the "
            "other cluster's samples as of the token's last visit, so time and samples to 85% are that "
            "cluster's; the final accuracy is the average of both clusters. The extra processes (a launcher "
            "per cluster) share the 2 cores with the workers.",
            "",
        ]
    strag = load("straggler")
    if strag and main:
        out += straggler_section(strag, main)
    seeds = RESULTS / "seeds_single" / "summary.json"
    if seeds.exists():
        s = json.loads(seeds.read_text())
        accs = ", ".join(f"{e['test_accuracy']:.4f}" for e in s["evals"])
        out += [
            "## The seeds' model and settings, one process, 10 epochs",
            "",
            f"`distsgd train --algo single --dataset fashion-mnist --model mnist_net --epochs 10 --lr 0.01 "
            f"--momentum 0.5 --batch-size 64` ({s['threads_per_worker']} threads), run on {s['started_at'][:10]}: "
            f"final test accuracy **{s['final_test_accuracy']:.4f}** (target >= 0.84), test loss "
            f"{s['final_test_loss']:.4f}, {s['samples_per_s']:.0f} samples/s, 84% reached after "
            f"{s['time_to_target_s']:.1f} s and {s['samples_to_target']} samples. Accuracy by epoch: {accs}.",
            "",
        ]
    for name, title in (
        ("limits", "Throughput at the machine's limit: distsgd against bare PyTorch"),
        ("data_path", "The torch Dataset path against PyTorch's own DataLoader loop"),
    ):
        path = RESULTS / f"{name}.txt"
        if path.exists():
            out += [
                f"## {title}",
                "",
                f"`python benchmarks/{name}.py`, stored in `benchmarks/results/{name}.txt`:",
                "",
                "```",
                path.read_text().strip(),
                "```",
                "",
            ]
    table = RESULTS / "low_comm" / "table.md"
    if table.exists():
        notes = RESULTS / "low_comm" / "NOTES.md"
        out += [
            "## Slow networks: who wins at which bandwidth",
            "",
            "`sudo python benchmarks/low_comm.py`: a 352k-parameter MLP (784-384-128-10, "
            "`benchmarks/models/wide_mlp.py`) on Fashion-MNIST, 2 workers, SGD lr 0.05 momentum 0.9 (diloco: "
            "AdamW inside at the lr its row names, weight decay 0.1 since 2026-11-23 (0 before), outer Nesterov "
            "SGD lr 0.7 momentum 0.9), batch 64 per worker, evaluated "
            "every 2,000 samples, target 85%. Each configuration runs on two hosts (network namespaces joined "
            "by a veth pair, `torchrun --nnodes 2`), unshaped and with the link shaped by `tc tbf` to 100 and "
            "10 Mbit/s each way. Stored in `benchmarks/results/low_comm/`.",
            "",
            table.read_text().strip(),
            "",
            "![time to 85% against link rate](../benchmarks/results/low_comm/time_to_target.png)",
            "",
        ]
        if notes.exists():
            out += [notes.read_text().strip(), ""]
    for name in ("transport_ab", "refactor_ab"):  # A/B runs of one change, kept as they were measured
        path = RESULTS / f"{name}.txt"
        if path.exists():
            title, command, *rest = path.read_text().strip().splitlines()
            out += [
                f"## A/B: {title}",
                "",
                f"`{command}`, stored in `benchmarks/results/{name}.txt`:",
                "",
                "```",
                "\n".join(rest).strip(),
                "```",
                "",
            ]
    more = RESULTS / "MORE.md"  # sections written by hand, each dated, for runs outside these parts
    if more.exists():
        out += [more.read_text().strip(), ""]
    return "\n".join(out) + "\n"


def _fmt(x: float | None, digits: int = 1) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def highlights(b: dict[str, Any]) -> list[str]:
    lines = ["### What the table says", ""]
    get = {r["algo"]: r for r in b["rows"]}

    def sps(a: str) -> float | None:
        return med(get[a]["samples_per_s"]) if a in get else None

    def acc(a: str) -> float | None:
        return med(get[a]["final_test_accuracy"]) if a in get else None

    def bps(a: str) -> float | None:
        return med(get[a]["bytes_sent_per_sample"]) if a in get else None

    if sps("hogwild") and sps("single[workers=1]"):
        lines.append(
            f"- hogwild (2 x 1 thread) / single (1 thread) throughput: "
            f"**{sps('hogwild') / sps('single[workers=1]'):.2f}x**."
        )
    if sps("allreduce") and sps("ddp"):
        lines.append(f"- allreduce / ddp throughput: **{sps('allreduce') / sps('ddp'):.3f}**.")
    if acc("asgd") is not None and acc("allreduce") is not None:
        lines.append(
            f"- After the same 1.2M samples, asgd {acc('asgd'):.4f} vs allreduce {acc('allreduce'):.4f}: "
            f"**{100 * (acc('asgd') - acc('allreduce')):+.2f} points**."
        )
    if sps("asgd") and sps("hogwild"):
        lines.append(
            f"- asgd / hogwild throughput: **{sps('asgd') / sps('hogwild'):.2f}** (the server is a third "
            f"process on 2 cores, and every step is a round trip to it)."
        )
    if bps("local-sgd[sync_every=8]") and bps("allreduce"):
        lines.append(
            f"- Bytes per sample, local-sgd H=8 / allreduce: "
            f"**{bps('local-sgd[sync_every=8]') / bps('allreduce'):.4f}** (1/8 = 0.125; the extra is the "
            f"final averaging of the last, partial period)."
        )
    lines.append("")
    lines.append("Staleness of the applied gradients (versions behind when applied):")
    lines.append("")
    lines.append("| algorithm | mean | p50 | p99 | max | histogram (staleness: count) |")
    lines.append("|---|---|---|---|---|---|")
    for e in b["runs"]:
        st = e["summary"].get("staleness")
        if isinstance(st, dict) and st.get("mean") is not None:
            hist = ", ".join(f"{k}: {v}" for k, v in st["histogram"].items())
            lines.append(f"| {e['algo']} | {st['mean']:.2f} | {st['p50']} | {st['p99']} | {st['max']} | {hist} |")
    lines.append("")
    return lines


def straggler_section(strag: dict[str, Any], main: dict[str, Any]) -> list[str]:
    lines = [
        "## One straggler: worker 1 three times slower",
        "",
        f"`--straggler 1:3` (worker 1 sleeps twice its own step time after each step), 2 workers, "
        f"{int(STRAGGLER_BUDGET):,} samples, run on {strag['date']}. Throughput is compared with the same "
        "algorithm's run in the main bench above (no straggler).",
        "",
        "| algorithm | samples/s, no straggler | samples/s, straggler 1:3 | kept | final acc (straggler) "
        "| samples per worker (straggler) |",
        "|---|---|---|---|---|---|",
    ]
    for r in strag["rows"]:
        base = row(main, r["algo"])
        fast = med(base["samples_per_s"]) if base else None
        slow = med(r["samples_per_s"])
        run = next(e for e in strag["runs"] if e["algo"] == r["algo"])
        per_worker = run["summary"].get("samples_per_worker", "-")
        kept = f"{slow / fast:.2f}" if fast and slow else "-"
        lines.append(
            f"| {r['algo']} | {fast:.0f} | {slow:.0f} | {kept} | {med(r['final_test_accuracy']):.4f} | {per_worker} |"
            if fast
            else f"| {r['algo']} | - | {slow:.0f} | - | - | - |"
        )
    lines += [
        "",
        "Synchronous algorithms move at the straggler's pace; asynchronous ones let the fast worker "
        "carry on (its share of the samples grows), ssp within its staleness bound.",
        "",
    ]
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(
        allow_abbrev=False, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--part", choices=["all", *PARTS], default="all")
    parser.add_argument("--render", action="store_true", help="only rebuild docs/BENCHMARKS.md from results/")
    args = parser.parse_args()
    if not args.render:
        for name, part in PARTS.items():
            if args.part in ("all", name):
                part()
    DOC.write_text(render())
    print(f"wrote {DOC} ({_dt.datetime.now():%Y-%m-%d %H:%M})")


if __name__ == "__main__":
    main()
