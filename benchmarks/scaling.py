"""Time per sample at N workers, from each algorithm's communication pattern and the compute time
measured here: checked against the 2- and 4-host runs of benchmarks/hosts.py, then projected to many
machines (docs/SCALING.md has the model, its assumptions and the tables).

    python benchmarks/scaling.py                # the projection tables -> results/scaling/projection.md
    python benchmarks/scaling.py --check        # projected against measured (results/hosts/rows.json)
    python benchmarks/scaling.py --measure      # measure the models' compute time per sample again (~2 min)
    python benchmarks/scaling.py --params 350e6 --compute 3ms --batch 8 --bandwidth 25gbit --latency 20us
    python benchmarks/scaling.py --model my_net.py:Net --input 3,224,224 --classes 1000 --bandwidth 10gbit

A worker takes a step of ``batch`` samples in ``batch x compute`` seconds; every machine has one
worker and a link of ``bandwidth`` bytes/s each way (full duplex, to a switch that is never the
bottleneck) and ``latency`` seconds per message. Each algorithm adds the time its communication
costs a step that compute does not hide (the functions below, one per algorithm, with the
algorithm's own defaults read from its options). The result is the time per step; samples/s is
N x batch / that, and the efficiency compute / that.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import re
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results" / "scaling"
HOSTS_ROWS = HERE / "results" / "hosts" / "rows.json"

BACKWARD = (
    2 / 3
)  # of a step's compute: the backward pass (twice the forward's work), which bucketed all-reduces overlap
UNSHAPED = 8.1e9 / 8  # bytes/s: a veth pair between two namespaces here, one Python socket stream (docs/SCALING.md)
LATENCY = 50e-6  # s per message: the projections' assumption (a data-centre TCP round trip is ~100 us)
# not measured here (no GPU): an H100 at 40% of its 989 TFLOP/s dense bf16 peak, for the what-if GPT row
ACCELERATOR_FLOPS = 0.4 * 989e12
WORKERS = (8, 16, 32, 64, 128, 256, 512, 1024)
GBITS = (1, 10, 100)
ALGOS = (
    "allreduce",
    "ddp",
    "asgd",
    "sync-ps",
    "ssp",
    "dcasgd",
    "easgd",
    "local-sgd",
    "diloco",
    "streaming-diloco",
    "hogwild++",
)


@dataclass(frozen=True)
class Link:
    bandwidth: float  # bytes/s each way, per machine
    latency: float  # s per message


@dataclass(frozen=True)
class Job:
    params: int  # P, float32 values exchanged
    compute: float  # c: seconds of one worker's compute per sample
    batch: int  # b: samples per worker per step
    matrices: tuple[tuple[int, int], ...] = ()  # weight shapes, for PowerSGD; () with --params: square, --width
    width: int = 1024

    @property
    def nbytes(self) -> float:
        return 4.0 * self.params

    @property
    def step(self) -> float:
        return self.compute * self.batch


def ring_allreduce(nbytes: float, n: int, link: Link) -> float:
    """A ring all-reduce of ``nbytes`` on n machines: a reduce-scatter and an all-gather, each n - 1
    steps that send nbytes / n (Patarasuk and Yuan 2009; Thakur, Rabenseifner, Gropp 2005:
    2 (n - 1) alpha + 2 (n - 1) / n n beta). The reduction's arithmetic is left out."""
    return 0.0 if n < 2 else 2 * (n - 1) * (link.latency + nbytes / n / link.bandwidth)


def ring_allgather(nbytes_each: float, n: int, link: Link) -> float:
    """Every machine's ``nbytes_each`` to every other: n - 1 steps round a ring."""
    return 0.0 if n < 2 else (n - 1) * (link.latency + nbytes_each / link.bandwidth)


def per(period: int, steps: float | None) -> float:
    """Exchanges per step, one every ``period`` steps: in the long run 1 / period; over a run of
    ``steps``, the last partial period's exchange (owed at the end) counted too."""
    return 1 / period if steps is None else math.ceil(steps / period) / steps


def compressed(job: Job, how: str, rank: int) -> tuple[float, int]:
    """(bytes, all-reduces) of one exchange of the parameters under ``--compress``: fp16 halves
    them; PowerSGD sends r (n + m) values for an n x m matrix that it compresses (when that is less
    than half of n m, as torch's hook decides), P and Q in two all-reduces, and vectors as they are."""
    if how == "none":
        return job.nbytes, 1
    if how == "fp16":
        return job.nbytes / 2, 1
    shapes = job.matrices or ((job.width, job.width),) * max(1, round(job.params / job.width**2))
    sent, covered = 0, 0
    for n, m in shapes:
        r = min(n, m, rank)
        sent += r * (n + m) if r * (n + m) * 2 < n * m else n * m
        covered += n * m
    return 4.0 * (sent + max(0, job.params - covered)), 2


# -- one function per algorithm: seconds per step of one worker, N alike -----------------------


def allreduce(job: Job, n: int, link: Link, opts: Any, steps: float | None) -> float:
    """Every step a gradient all-reduce. Uncompressed, in buckets of ``--bucket-mb`` started during
    backward: all but the last bucket can hide behind the backward pass. Compressed, all at once
    after backward."""
    how, rank = parse_compress(opts.compress)
    if how != "none":
        nbytes, calls = compressed(job, how, rank)
        return job.step + ring_allreduce(nbytes, n, link) + (calls - 1) * ring_allreduce(0, n, link)
    k = max(1, math.ceil(job.nbytes / (opts.bucket_mb * 2**20)))
    one = ring_allreduce(job.nbytes / k, n, link)
    return job.step + max(one, k * one - BACKWARD * job.step)


def averaging(job: Job, n: int, link: Link, opts: Any, steps: float | None) -> float:
    """local-sgd and diloco: H steps alone, then one all-reduce of the parameters (or of their
    change, through ``--compress``), with the workers waiting for it."""
    if opts.sync_every.count is None:
        raise SystemExit("error: sync_every=epoch is not a number of steps here: give sync_every=H")
    nbytes, calls = compressed(job, *parse_compress(opts.compress))
    exchange = ring_allreduce(nbytes, n, link) + (calls - 1) * ring_allreduce(0, n, link)
    return job.step + per(opts.sync_every.count, steps) * exchange


def streaming(job: Job, n: int, link: Link, opts: Any, steps: float | None) -> float:
    """Streaming DiLoCo: P fragments, each sent once every H steps (P sends in H steps), each send
    overlapped with tau inner steps; in fp16 or bf16 an all-gather. At a run's end every fragment
    is averaged once more, one after another, with nothing to overlap."""
    fragments, h, tau = opts.fragments, opts.sync_every.count, opts.overlap
    if h is None:
        raise SystemExit("error: sync_every=epoch is not a number of steps here: give sync_every=H")
    frag = job.nbytes / fragments
    if opts.outer_dtype == "float32":
        send = ring_allreduce(frag, n, link)
    else:  # each worker's fragment in half precision, to every other
        send = ring_allgather(frag / 2, n, link)
    exposed = max(0.0, send - tau * job.step)
    if steps is None:
        return job.step + fragments * exposed / h
    return job.step + (fragments * (steps // h) * exposed + fragments * send) / steps


def easgd(job: Job, n: int, link: Link, opts: Any, steps: float | None) -> float:
    """Every tau steps the elastic exchange: one all-reduce (sync), or, async, each worker's x_i up
    to the centre on the parameter server and the difference back."""
    if opts.easgd_mode == "async":
        return server(job, n, link, steps, every=opts.tau)
    return job.step + per(opts.tau, steps) * ring_allreduce(job.nbytes, n, link)


def server(job: Job, n: int, link: Link, steps: float | None, every: int = 1) -> float:
    """asgd, ssp, dcasgd: every step a worker pushes its gradient (S up) and waits for the weights
    (S back). The server's link carries all N workers' pushes in and replies out: two queues that
    N workers go round, with their compute and the messages' latency between visits. Solved as a
    closed queueing network by mean value analysis: from the lone worker's cycle (C + 2 S/B + 2 L)
    it tends to the server link's capacity (N S/B a cycle), slower in between, where workers meet
    in the queues. Workers of equal speed never meet ssp's bound, which costs nothing here."""
    cycle = closed_network(n, [job.nbytes / link.bandwidth] * 2, every * job.step + 2 * link.latency)
    return cycle / every


def closed_network(n: int, demands: list[float], think: float) -> float:
    """Seconds a customer takes to go round a closed network of n customers: queues of service
    demands ``demands`` and a delay of ``think`` (exact mean value analysis, Reiser and Lavenberg
    1980)."""
    queued = [0.0] * len(demands)
    cycle = think + sum(demands)
    for k in range(1, n + 1):
        resident = [d * (1 + q) for d, q in zip(demands, queued)]
        cycle = think + sum(resident)
        queued = [k * r / cycle for r in resident]
    return cycle


def sync_server(job: Job, n: int, link: Link, steps: float | None) -> float:
    """sync-ps: all N gradients in through the server's link, one step, all N replies out."""
    return job.step + 2 * n * job.nbytes / link.bandwidth + 2 * link.latency


def hogwildpp(job: Job, n: int, link: Link, opts: Any, steps: float | None) -> float:
    """hogwild++: the token's exchanges run in a thread beside the workers, which never wait for
    them; at a run's end the token goes round once more (each holder's exchange: S out, S back)
    and the clusters' models are averaged with one all-reduce."""
    if steps is None:
        return job.step
    end = n * (2 * job.nbytes / link.bandwidth + 2 * link.latency) + ring_allreduce(job.nbytes, n, link)
    return job.step + end / steps


def token_lap(job: Job, n: int, link: Link, opts: Any) -> float:
    """Seconds for hogwild++'s token to go round: each holder exchanges (S out, S back), then keeps
    it for --update-delay steps of its cluster."""
    return n * (2 * job.nbytes / link.bandwidth + 2 * link.latency + opts.update_delay * job.step)


MODEL: dict[str, Callable[[Job, int, Link, Any, float | None], float]] = {
    "allreduce": allreduce,
    "ddp": allreduce,
    "asgd": lambda job, n, link, opts, steps: server(job, n, link, steps),
    "ssp": lambda job, n, link, opts, steps: server(job, n, link, steps),
    "dcasgd": lambda job, n, link, opts, steps: server(job, n, link, steps),
    "sync-ps": lambda job, n, link, opts, steps: sync_server(job, n, link, steps),
    "easgd": easgd,
    "local-sgd": averaging,
    "diloco": averaging,
    "streaming-diloco": streaming,
    "hogwild++": hogwildpp,
}


def parse_compress(text: str) -> tuple[str, int]:
    from distsgd.algorithms import compress

    return compress.parse(text)


def algorithms(text: str) -> list[tuple[str, str, Any]]:
    """``allreduce,local-sgd[sync_every=64]`` -> (label, name, its options: those given, the others
    its defaults) for each."""
    from distsgd.algorithms import registry
    from distsgd.bench import parse_algos

    out = []
    for algo in parse_algos(text):
        if algo.name not in MODEL:
            raise SystemExit(f"error: {algo.name} runs on one machine: no model of it here")
        out.append((algo.label, algo.name, registry.get(algo.name).Options.from_mapping(dict(algo.options))))
    return out


def step_time(spec: str, job: Job, n: int, link: Link, steps: float | None = None) -> float:
    """Seconds per step of one of ``n`` workers; ``steps``: over a run that long, else in the long run."""
    ((_, name, opts),) = algorithms(spec)
    return MODEL[name](job, n, link, opts, steps)


def samples_per_s(spec: str, job: Job, n: int, link: Link, steps: float | None = None) -> float:
    return n * job.batch / step_time(spec, job, n, link, steps)


# -- units --------------------------------------------------------------------------------------


def rate(text: str) -> float:
    """``25gbit``, ``100mbit`` -> bytes/s."""
    m = re.fullmatch(r"(\d+(?:\.\d+)?)([kmg]?)bit", text.strip().lower())
    if not m:
        raise SystemExit(f"error: a rate is a number and kbit, mbit or gbit, e.g. 25gbit, got '{text}'")
    return float(m[1]) * {"": 1, "k": 1e3, "m": 1e6, "g": 1e9}[m[2]] / 8


def seconds(text: str) -> float:
    """``20us``, ``3ms``, ``0.5s`` -> seconds."""
    m = re.fullmatch(r"(\d+(?:\.\d+)?(?:e-?\d+)?)(us|ms|s)", text.strip().lower())
    if not m:
        raise SystemExit(f"error: a time is a number and us, ms or s, e.g. 20us, got '{text}'")
    return float(m[1]) * {"us": 1e-6, "ms": 1e-3, "s": 1.0}[m[2]]


# -- compute time per sample, measured here ------------------------------------------------------

# name: (model spec, input shape, classes, batch per worker in the projection)
MODELS: dict[str, tuple[str, tuple[int, ...], int, int]] = {
    "logreg": ("logreg", (1, 28, 28), 10, 64),
    "mlp": ("mlp", (1, 28, 28), 10, 64),
    "mnist_net": ("mnist_net", (1, 28, 28), 10, 64),
    "cifar_net": ("cifar_net", (3, 32, 32), 10, 64),
    "resnet20": ("resnet20", (3, 32, 32), 10, 64),
    "gpt": ("gpt", (128,), 256, 64),
    "wide_mlp (hosts.py's)": (f"{HERE / 'models' / 'wide_mlp.py'}:WideMLP", (1, 28, 28), 10, 64),
    "gpt-124M": ("gpt[layers=12,heads=12,width=768]", (1024,), 50257, 8),
}


def measure_model(spec: str, shape: tuple[int, ...], classes: int, batch: int, budget_s: float = 3.0) -> dict:
    """Seconds of one thread's forward, backward and optimiser step per sample, on random inputs
    (AdamW for a language model, SGD otherwise), after a warm-up step; and the weight shapes."""
    import torch

    from distsgd.models import build_model, logits_of

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = build_model(spec, shape, classes)
    lm = len(shape) == 1
    opt = torch.optim.AdamW(model.parameters()) if lm else torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    x = torch.randint(0, classes, (batch, *shape)) if lm else torch.randn(batch, *shape)
    y = torch.randint(0, classes, (batch, *shape) if lm else (batch,))

    def step() -> None:
        opt.zero_grad()
        out = logits_of(model(x))
        torch.nn.functional.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1)).backward()
        opt.step()

    step()
    done, start = 0, time.perf_counter()
    while done < 2 or time.perf_counter() - start < budget_s:
        step()
        done += 1
        if time.perf_counter() - start > 10 * budget_s:  # one step of a big model is enough
            break
    per_sample = (time.perf_counter() - start) / (done * batch)
    params = [p for p in model.parameters()]
    return {
        "params": sum(p.numel() for p in params),
        "compute_s": per_sample,
        "measured_batch": batch,
        "steps": done,
        "matrices": [[p.shape[0], p.numel() // p.shape[0]] for p in params if p.dim() > 1],
    }


def compute_table(again: bool) -> dict[str, dict]:
    path = RESULTS / "compute.json"
    if path.exists() and not again:
        return json.loads(path.read_text())["models"]
    models = {}
    for name, (spec, shape, classes, batch) in MODELS.items():
        measured = 1 if name == "gpt-124M" else 64  # one 1024-token sequence a step: ~20 s on one core
        models[name] = {**measure_model(spec, shape, classes, measured), "batch": batch}
        print(f"# {name}: {models[name]['params']} parameters, {models[name]['compute_s'] * 1e6:.1f} us a sample")
    from distsgd.bench.runner import machine_facts

    m = machine_facts()
    facts = f"{m['cpu']}, 1 thread, torch {m['torch_version']}, {datetime.date.today().isoformat()}"
    RESULTS.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"facts": facts, "models": models}, indent=1))
    return models


def job_of(entry: dict, compute: float | None = None, batch: int | None = None) -> Job:
    return Job(
        params=entry["params"],
        compute=compute or entry["compute_s"],
        batch=batch or entry["batch"],
        matrices=tuple(tuple(m) for m in entry["matrices"]),
    )


# -- the tables -----------------------------------------------------------------------------------


def efficiency_table(
    job: Job, algos: tuple[str, ...], workers: tuple[int, ...], gbits: tuple[float, ...], latency: float
) -> list[str]:
    """Rows: algorithms; columns: N; cells: compute / step time at each rate, ``1G / 10G / 100G``."""
    links = [Link(g * 1e9 / 8, latency) for g in gbits]
    lines = [
        "| algorithm | " + " | ".join(f"N={n}" for n in workers) + " |",
        "|---|" + "---|" * len(workers),
    ]
    for spec in algos:
        cells = [" / ".join(f"{job.step / step_time(spec, job, n, link):.2f}" for link in links) for n in workers]
        lines.append(f"| {spec} | " + " | ".join(cells) + " |")
    ((_, _, opts),) = algorithms("hogwild++")
    laps = [" / ".join(_short(token_lap(job, n, link, opts)) for link in links) for n in workers]
    lines.append("| (hogwild++'s token lap, s) | " + " | ".join(laps) + " |")
    return lines


def _time(s: float) -> str:
    return f"{s * 1e6:.3g} us" if s < 1e-3 else f"{s * 1e3:.3g} ms" if s < 1 else f"{s:.3g} s"


def _short(x: float) -> str:
    return f"{x:.2g}" if x < 100 or x >= 1e5 else f"{x:.0f}"


def projection(models: dict[str, dict], latency: float) -> str:
    out = []
    gpt = models["gpt-124M"]
    # training takes 6 FLOPs per parameter per token (Kaplan et al. 2020, section 2.1); 1024 tokens a sequence
    what_if = {**gpt, "compute_s": 6 * gpt["params"] * 1024 / ACCELERATOR_FLOPS}
    for name, entry in [*models.items(), ("gpt-124M on an accelerator (assumed, not measured)", what_if)]:
        job = job_of(entry)
        out += [
            f"### {name}: {job.params:,} parameters ({job.nbytes / 1e6:.3g} MB), {_time(job.compute)} a sample, "
            f"batch {job.batch} a worker ({_time(job.step)} of compute a step)",
            "",
            *efficiency_table(job, ALGOS, WORKERS, GBITS, latency),
            "",
        ]
    return "\n".join(out)


# -- the check against benchmarks/hosts.py ---------------------------------------------------------


def sharing(row: dict) -> int:
    """Worker processes that shared a core in this row's run (a server's host left out): each of
    them computed at 1 / that of a core."""
    hosts = row["placement"]
    server = row["config"] in ("asgd", "sync-ps", "ssp", "dcasgd")
    workers = hosts[1:] if server else hosts
    load: dict[int, float] = {}
    for h in workers:
        for core in h["cores"]:
            load[core] = load.get(core, 0) + h["processes"] / len(h["cores"])
    return max(1, math.ceil(max(load.values())))


def check(path: Path, latency: float) -> str:
    saved = json.loads(path.read_text())
    rows = saved["rows"]
    compute = {r["optimizer"]: 1 / r["samples_per_s"] for r in rows if r["hosts"] is None}  # the single runs
    networks = list(dict.fromkeys(r["network"] for r in rows if r["hosts"]))
    lines = [
        f"Rows: {path.relative_to(HERE.parent) if path.is_relative_to(HERE.parent) else path} ({saved['facts']}).",
        "Compute: "
        + ", ".join(f"{c * 1e6:.1f} us a sample with {name}" for name, c in compute.items())
        + " (single: 1 worker, 1 thread), times the workers that shared a core; "
        f"{saved['parameters']:,} parameters, batch {saved['batch']}; links: unshaped {UNSHAPED * 8 / 1e9:.1f} Gbit/s, "
        f"latency {latency * 1e6:.0f} us; each run's own length (its last exchanges counted).",
        "",
        "| algorithm | hosts | cores shared by | "
        + " | ".join(f"{n}: measured | {n}: projected | {n}: error" for n in networks)
        + " |",
        "|---|---|---|" + "---|---|---|" * len(networks),
    ]
    errors: dict[str, list[tuple[str, float]]] = {}
    for config in dict.fromkeys(r["config"] for r in rows if r["hosts"]):
        for hosts in sorted({r["hosts"] for r in rows if r["config"] == config}):
            cells = {r["network"]: r for r in rows if r["config"] == config and r["hosts"] == hosts}
            share = sharing(next(iter(cells.values())))
            line = [config, str(hosts), str(share)]
            for network in networks:
                r = cells.get(network)
                if r is None:
                    line += ["-", "-", "-"]
                    continue
                job = Job(params=saved["parameters"], compute=compute[r["optimizer"]] * share, batch=saved["batch"])
                link = Link(UNSHAPED if network == "unshaped" else rate(network), latency)
                steps = r["samples"] / (r["workers"] * saved["batch"])
                projected = samples_per_s(config, job, r["workers"], link, steps)
                error = projected / r["samples_per_s"] - 1
                errors.setdefault(config, []).append((network, error))
                line += [f"{r['samples_per_s']:.0f}", f"{projected:.0f}", f"{error:+.0%}"]
            lines.append("| " + " | ".join(line) + " |")
    lines += [
        "",
        "Error: projected / measured - 1. Per algorithm, the median and the largest (by absolute value) over its "
        "shaped cells (100 and 10 Mbit/s, 2 and 4 hosts) and over its unshaped ones:",
        "",
        "| algorithm | shaped: median error | shaped: largest | unshaped: median error | unshaped: largest |",
        "|---|---|---|---|---|",
    ]
    for config, cells in errors.items():
        line = [config]
        for part in (
            [e for network, e in cells if network != "unshaped"],
            [e for network, e in cells if network == "unshaped"],
        ):
            line += [f"{median(part):+.0%}", f"{max(part, key=abs):+.0%}"] if part else ["-", "-"]
        lines.append("| " + " | ".join(line) + " |")
    return "\n".join(lines)


def median(xs: list[float]) -> float:
    xs = sorted(xs)
    return (xs[(len(xs) - 1) // 2] + xs[len(xs) // 2]) / 2


def main() -> None:
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    ap.add_argument(
        "--check",
        nargs="?",
        const=HOSTS_ROWS,
        type=Path,
        metavar="ROWS",
        help="projected against measured, from hosts.py's rows.json (default results/hosts/rows.json)",
    )
    ap.add_argument("--measure", action="store_true", help="measure the built-in models' compute time again")
    ap.add_argument("--params", type=float, help="your model's parameters (float32 values exchanged), e.g. 350e6")
    ap.add_argument("--compute", type=seconds, help="its compute time per sample on one worker, e.g. 3ms")
    ap.add_argument("--batch", type=int, help="samples per worker per step; default 64 (gpt-124M: 8)")
    ap.add_argument("--width", type=int, default=1024, help="with --params: its matrices' width, for PowerSGD")
    ap.add_argument("--model", help="a built-in model or path/file.py:Class to measure here (with --input, --classes)")
    ap.add_argument("--input", help="with --model: one sample's shape, e.g. 3,224,224 (a language model: 1024)")
    ap.add_argument("--classes", type=int, default=10, help="with --model: classes (a language model: vocabulary)")
    ap.add_argument("--bandwidth", type=rate, help="the link of one machine, each way, e.g. 25gbit")
    ap.add_argument("--latency", type=seconds, default=LATENCY, help="per message; default 50us")
    ap.add_argument("--workers", default=",".join(map(str, WORKERS)), help="comma-separated N; default 8..1024")
    ap.add_argument("--algos", default=",".join(ALGOS), help="algorithms, with options: diloco[sync_every=100]")
    args = ap.parse_args()
    if args.check:
        table = check(args.check, args.latency)
        RESULTS.mkdir(parents=True, exist_ok=True)
        (RESULTS / "check.md").write_text(table + "\n")
        print(table)
        return
    if args.params or args.model:
        yours(args)
        return
    models = compute_table(args.measure)
    text = projection(models, args.latency)
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "projection.md").write_text(text + "\n")
    print(text)


def yours(args: argparse.Namespace) -> None:
    """The table for one model and link: samples/s and efficiency at each N."""
    if args.model:
        if not args.input:
            raise SystemExit("error: --model needs --input, one sample's shape, e.g. 3,224,224")
        shape = tuple(int(s) for s in args.input.split(","))
        entry = measure_model(args.model, shape, args.classes, args.batch or 64)
        job = job_of({**entry, "batch": args.batch or 64}, args.compute)
    else:
        if not args.compute:
            raise SystemExit("error: --params needs --compute, one worker's compute time per sample, e.g. 3ms")
        job = Job(params=int(args.params), compute=args.compute, batch=args.batch or 64, width=args.width)
    if not args.bandwidth:
        raise SystemExit("error: give --bandwidth, one machine's link each way, e.g. 25gbit")
    link = Link(args.bandwidth, args.latency)
    workers = [int(n) for n in args.workers.split(",")]
    algos = algorithms(args.algos)
    print(
        f"{job.params:,} parameters, {job.compute * 1e3:.4g} ms a sample, batch {job.batch}; "
        f"{link.bandwidth * 8 / 1e9:g} Gbit/s, {link.latency * 1e6:g} us a message\n"
    )
    print("| algorithm | " + " | ".join(f"N={n}: samples/s (efficiency)" for n in workers) + " |")
    print("|---|" + "---|" * len(workers))
    for label, name, opts in algos:
        times = [MODEL[name](job, n, link, opts, None) for n in workers]
        cells = [f"{_count(n * job.batch / t)} ({job.step / t:.2f})" for n, t in zip(workers, times)]
        print(f"| {label} | " + " | ".join(cells) + " |")


def _count(x: float) -> str:
    return f"{x:,.0f}" if x >= 100 else f"{x:.3g}"


if __name__ == "__main__":
    sys.exit(main())
