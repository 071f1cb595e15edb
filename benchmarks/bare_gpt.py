"""``distsgd train --model gpt`` against a bare PyTorch loop training the same GPT (issue 32).

    python benchmarks/bare_gpt.py [--max-samples 6000] [--repeats 3] [--out DIR]
    python benchmarks/bare_gpt.py --no-eval                               # and distsgd without its evaluations
    python benchmarks/bare_gpt.py --profile [--max-samples 1000]          # where distsgd's time goes
    python benchmarks/bare_gpt.py --profile bare --profiler torch         # the bare loop, by aten op

The job is ``distsgd train --model gpt`` with every default: the built-in GPT (4 layers, 4 heads,
width 128, context 128, seed 0) on python-stdlib's byte tokens, one worker, batch 64, gpt's own
settings from ``distsgd.models.RECOMMENDED`` (AdamW lr 1e-3, weight decay 0.1 on the weights
only, not on biases nor LayerNorm scales; gradient norm clipped to 1.0; the lr warmed up over the
first 20 steps), threads = the cores this process may use.

- ``bare``: the same model (``build_model("gpt", ...)``, seed 0) and the same tensors
  (``load_dataset("python-stdlib", context=128)``), a plain loop: shuffle each epoch, index a
  batch, forward, mean cross-entropy per token, backward, clip, AdamW step. Only the training
  steps are timed (``perf_counter`` round the loop; no evaluation).
- ``distsgd``: ``distsgd.train(model="gpt", max_samples=N, quiet=True)``; its figure is
  ``tokens_per_s`` from the summary: the training clock, which excludes start-up and the
  evaluations it runs on its own schedule (5 in a run this short, each over the whole test set).
- ``spawn`` (``--spawn``): the bare loop written as a user's loop on distsgd (``distsgd.spawn``,
  ``algo="single"``, ``run.loader`` / ``run.backward`` / the optimiser ``run.setup`` returns) with
  gpt's settings given to ``spawn`` (the model is the user's factory, so no model defaults apply)
  and no evaluation; its figure is the summary's samples/s x 128 (the training clock).
- ``distsgd-noeval`` (``--no-eval``): the same with ``eval_every`` beyond the run, so its only
  evaluation is the final one, after the clock stops: whether the evaluations, though off the
  clock, slow the steps after them (memory, caches).

Each run is a fresh Python process (this script with ``--one KIND``); the pairs alternate, the
order within a pair reversed every other repeat (bare first, then distsgd first, ...). Reported:
each run's tokens/s, the medians, and the ratio to bare of each pair and of the medians.

``--profile [distsgd|bare]`` runs one short run of that loop in this process under cProfile
(``--profiler cprofile``, the default: the top entries by self time, then distsgd's own functions
by cumulative time), ``torch.profiler`` (``--profiler torch``: operators by self CPU time) or
nothing (``--profiler none``), then the training steps phase by phase (forward: the batch,
zero_grad, forward and loss; backward; step: clipping, the schedule, AdamW and distsgd's
counters): the median wall time, CPU time and minor page faults of each, and the steps that
follow one of distsgd's evaluations. ``--threads 1`` makes CPU time a figure that other
processes on the machine hardly disturb. Nothing else should run on the machine while measuring.
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
import time
from pathlib import Path
from typing import Any

KINDS = ("bare", "distsgd")
NO_EVAL = "distsgd-noeval"  # --no-eval: distsgd with no evaluation during training (only the final one)
SPAWN = "spawn"  # --spawn: the bare loop as a user's loop on distsgd (distsgd.spawn, algo single)
CONTEXT = 128
BATCH = 64


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


class Bare:
    """The bare loop's pieces, built before the clock starts: data, model, AdamW."""

    def __init__(self, threads: int | None = None) -> None:
        import torch
        import torch._dynamo  # noqa: F401  (torch.optim imports it lazily: not part of training)

        from distsgd.data import load_dataset
        from distsgd.models import RECOMMENDED, build_model

        torch.set_num_threads(threads or _cores())  # distsgd's default for one worker: every core
        rec = RECOMMENDED["gpt"]
        self.lr, self.warmup, self.clip = float(rec["lr"]), int(rec["lr_warmup_steps"]), float(rec["clip_grad_norm"])
        ds = load_dataset("python-stdlib", None, context=CONTEXT)
        self.x, self.y, self.vocab = ds.x_train, ds.y_train, ds.num_classes
        self.model = build_model("gpt", ds.input_shape, ds.num_classes, "default", seed=0)
        self.model.train()
        params = [p for p in self.model.parameters() if p.requires_grad]
        groups = [
            {"params": [p for p in params if p.dim() >= 2], "weight_decay": float(rec["weight_decay"])},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
        ]  # weights decay, not 1-D
        self.opt = torch.optim.AdamW(groups, lr=self.lr)
        self.gen = torch.Generator().manual_seed(0)

    def batches(self, samples: int) -> Any:
        """Batch indices, a fresh shuffle each epoch, until ``samples`` are done."""
        import torch

        done = 0
        while done < samples:
            order = torch.randperm(len(self.y), generator=self.gen)
            for first in range(0, len(order), BATCH):
                if done >= samples:
                    return
                idx = order[first : first + BATCH]
                done += len(idx)
                yield idx

    def train(self, samples: int, mark: Any = None) -> tuple[int, float, float]:
        """(samples, seconds, last loss) of ``samples`` training samples, timed round the loop.
        ``mark(phase)``: called at the end of each phase of a step (``--profile``)."""
        import torch
        import torch.nn.functional as F

        model, opt, x, y = self.model, self.opt, self.x, self.y
        done, step, loss = 0, 0, None
        start = time.perf_counter()
        for idx in self.batches(samples):
            step += 1
            if step <= self.warmup:  # lr x step / warm-up, then the lr itself
                for group in opt.param_groups:
                    group["lr"] = self.lr * step / self.warmup
            opt.zero_grad(set_to_none=True)
            logits = model(x[idx])
            loss = F.cross_entropy(logits.reshape(-1, self.vocab), y[idx].reshape(-1))
            if mark is not None:
                mark("forward")
            loss.backward()
            if mark is not None:
                mark("backward")
            torch.nn.utils.clip_grad_norm_(model.parameters(), self.clip)
            opt.step()
            done += len(idx)
            if mark is not None:
                mark("step")
        elapsed = time.perf_counter() - start
        return done, elapsed, float(loss.detach()) if loss is not None else float("nan")


def _threads(threads: int | None) -> dict[str, Any]:
    """distsgd's settings for ``--threads`` (none: its default, every core)."""
    return {"threads_per_worker": threads} if threads else {}


def gpt() -> Any:
    """The user's model factory for ``spawn``: the built-in GPT for python-stdlib, seed 0."""
    from distsgd.data import load_dataset
    from distsgd.models import build_model

    ds = load_dataset("python-stdlib", None, context=CONTEXT)
    return build_model("gpt", ds.input_shape, ds.num_classes, "default", seed=0)


def user_loop(run: Any) -> Any:
    """The bare loop as a user converts it: epochs until the run says stop (--max-samples)."""
    import torch.nn.functional as F
    from torch.utils.data import TensorDataset

    from distsgd.data import load_dataset

    ds = load_dataset("python-stdlib", None, context=CONTEXT)
    data = TensorDataset(ds.x_train, ds.y_train)
    model, opt = run.setup()
    epoch = 0
    while not run.should_stop():
        for x, y in run.loader(data, batch_size=BATCH, epoch=epoch):
            opt.zero_grad(set_to_none=True)
            logits = model(x)
            run.backward(F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1)))
            opt.step()
        epoch += 1
    return run.final_model()


def one(kind: str, samples: int, threads: int | None = None) -> dict[str, Any]:
    """One run in this process: samples/s and tokens/s of its training steps."""
    if kind == SPAWN:
        import distsgd
        from distsgd.models import RECOMMENDED

        settings = {k: v for k, v in RECOMMENDED["gpt"].items() if k != "dataset"}
        s = distsgd.spawn(
            user_loop, model=gpt, algo="single", max_samples=samples, quiet=True, **_threads(threads), **settings
        ).summary
        return {
            "samples": s["samples"],
            "train_wall_s": s["train_wall_s"],
            "samples_per_s": s["samples_per_s"],
            "tokens_per_s": s["samples_per_s"] * CONTEXT,
            "threads_per_worker": s.get("threads_per_worker"),
        }
    if kind == "bare":
        done, elapsed, loss = Bare(threads).train(samples)
        return {
            "samples": done,
            "train_wall_s": elapsed,
            "samples_per_s": done / elapsed,
            "tokens_per_s": done * CONTEXT / elapsed,
            "last_train_loss": loss,
        }
    import distsgd

    no_eval = {"eval_every": 10**15} if kind == NO_EVAL else {}  # never due: only the final evaluation
    s = distsgd.train(model="gpt", max_samples=samples, quiet=True, **_threads(threads), **no_eval).summary
    return {
        k: s[k]
        for k in ("samples", "train_wall_s", "samples_per_s", "tokens_per_s", "final_test_loss", "threads_per_worker")
    }


def measure(kind: str, samples: int, threads: int | None) -> dict[str, Any]:
    cmd = [sys.executable, __file__, "--one", kind, "--max-samples", str(samples)]
    if threads:
        cmd += ["--threads", str(threads)]
    out = subprocess.run(cmd, check=True, stdout=subprocess.PIPE, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


# -- --profile -------------------------------------------------------------------------------------

# a step's phases: batch, zero_grad, forward, loss | backward | clipping, schedule, AdamW, counters
PHASES = ("forward", "backward", "step")


class StepTimes:
    """The training loop's steps, phase by phase: wall time, this process's CPU time (all its
    threads: less disturbed than wall time by other processes) and minor page faults of each phase,
    marked at the end of each (``mark(phase)``). An evaluation (distsgd's, clock paused) is taken
    out of the phase it falls in, and the step after it is noted. The first step is left out."""

    MEASURES = ("wall ms", "CPU ms", "faults")

    def __init__(self) -> None:
        self.last: tuple[float, ...] | None = None  # the measures' readings at the last mark
        self.current: dict[str, tuple[float, ...]] = {}
        self.steps: list[dict[str, tuple[float, ...]]] = []
        self.after_eval: set[int] = set()
        self.paused: tuple[float, ...] = (0.0, 0.0, 0.0)

    @staticmethod
    def now() -> tuple[float, ...]:
        import resource

        use = resource.getrusage(resource.RUSAGE_SELF)
        return time.perf_counter() * 1e3, (use.ru_utime + use.ru_stime) * 1e3, float(use.ru_minflt)

    def mark(self, phase: str) -> None:
        now = self.now()
        if self.last is not None:
            self.current[phase] = tuple(n - last - p for n, last, p in zip(now, self.last, self.paused))
            if phase == PHASES[-1]:
                self.steps.append(self.current)
                self.current = {}
        elif phase != PHASES[-1]:
            return  # the first step: counting starts at its end
        self.last, self.paused = now, (0.0, 0.0, 0.0)

    def evaluated(self, start: tuple[float, ...], end: tuple[float, ...]) -> None:
        self.paused = tuple(p + e - s for p, s, e in zip(self.paused, start, end))
        self.after_eval.add(len(self.steps))  # the step that follows

    def report(self) -> str:
        steps = [s for s in self.steps if all(p in s for p in PHASES)]
        if not steps:
            return "no step times (too few steps)"
        totals = [tuple(sum(s[p][i] for p in PHASES) for i in range(3)) for s in steps]
        lines = [
            f"{len(steps)} steps (the first left out), medians per step:",
            f"  {'phase':9s}" + "".join(f"{m:>10s}" for m in self.MEASURES) + "  share of wall time",
        ]
        for p in PHASES:
            med = [statistics.median(s[p][i] for s in steps) for i in range(3)]
            share = sum(s[p][0] for s in steps) / sum(t[0] for t in totals)
            lines.append(f"  {p:9s}" + "".join(f"{m:10.1f}" for m in med) + f"  {share:6.1%}")
        lines.append(
            f"  {'step':9s}"
            + "".join(f"{statistics.median(t[i] for t in totals):10.1f}" for i in range(3))
            + f"  (min {min(t[0] for t in totals):.1f}, max {max(t[0] for t in totals):.1f} ms wall)"
        )
        after = [i for i in sorted(self.after_eval) if i < len(steps)]
        if after:
            lines.append(
                "steps right after an evaluation (wall ms, CPU ms, faults): "
                + "; ".join(", ".join(f"{v:.0f}" for v in totals[i]) for i in after)
            )
        return "\n".join(lines)


def _hook_distsgd(times: StepTimes) -> None:
    """Mark distsgd's phases (``Run.backward``'s start and end, ``Run.step``'s end) and time its
    evaluations (``_Worker.evaluate``)."""
    from distsgd.train import loop, own_loop

    backward, step, evaluate = own_loop.Run.backward, own_loop.Run.step, loop._Worker.evaluate

    def marked_backward(self: Any, loss: Any, weight: float = 1.0) -> None:
        times.mark("forward")
        backward(self, loss, weight)
        times.mark("backward")

    def marked_step(self: Any) -> None:
        step(self)
        times.mark("step")

    def timed_evaluate(self: Any) -> bool:
        start = times.now()
        try:
            return evaluate(self)
        finally:
            times.evaluated(start, times.now())

    own_loop.Run.backward = marked_backward  # type: ignore[method-assign]
    own_loop.Run.step = marked_step  # type: ignore[method-assign]
    loop._Worker.evaluate = timed_evaluate  # type: ignore[method-assign]


def profile(kind: str, samples: int, profiler: str, top: int, threads: int | None = None) -> None:
    """One short run of ``kind`` here, profiled (``profiler``: cprofile, torch or none); the top
    entries, then the step times by phase."""
    import cProfile
    import pstats

    import torch

    times = StepTimes()
    if kind == "bare":
        bare = Bare(threads)

        def work() -> Any:
            return bare.train(samples, mark=times.mark)
    else:
        import distsgd
        from distsgd.data import load_dataset

        _hook_distsgd(times)
        data = load_dataset("python-stdlib", None, context=CONTEXT)  # loaded before the profile starts

        def work() -> Any:
            return distsgd.train(model="gpt", data=data, max_samples=samples, quiet=True, **_threads(threads)).summary

    if profiler == "torch":
        from torch.profiler import ProfilerActivity
        from torch.profiler import profile as torch_profile

        with torch_profile(activities=[ProfilerActivity.CPU]) as prof:
            result = work()
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=top))
    elif profiler == "cprofile":
        prof = cProfile.Profile()
        prof.enable()
        result = work()
        prof.disable()
        stats = pstats.Stats(prof, stream=sys.stdout)
        stats.strip_dirs().sort_stats("tottime").print_stats(top)
        if kind == "distsgd":  # distsgd's own functions, by time spent in them and what they call
            stats = pstats.Stats(prof, stream=sys.stdout)
            stats.sort_stats("cumulative").print_stats(r"distsgd/(train|algorithms|metrics|data)", top)
    else:
        result = work()
    under = "" if profiler == "none" else f" (under {profiler})"
    if kind == "bare":
        done, elapsed, _ = result
        print(f"bare: {done} samples in {elapsed:.2f} s of training: {done * CONTEXT / elapsed:.0f} tokens/s{under}")
    else:
        print(
            f"distsgd: {result['samples']} samples in {result['train_wall_s']:.2f} s of training (wall "
            f"{result['wall_s']:.2f} s): {result['tokens_per_s']:.0f} tokens/s{under}"
        )
    print(times.report())
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {_cores()} cores")


# -- the comparison --------------------------------------------------------------------------------


def machine() -> str:
    import torch

    return (
        f"Machine: {platform.node()} ({platform.platform()}, {platform.processor() or platform.machine()}), "
        f"{os.cpu_count()} cores ({_cores()} usable), torch {torch.__version__}, Python "
        f"{platform.python_version()}; {_dt.date.today().isoformat()}"
    )


def render(facts: str, pairs: list[dict[str, Any]]) -> str:
    kinds = [k for k in (*KINDS, NO_EVAL, SPAWN) if k in pairs[0]]
    others = kinds[1:]
    med = {k: statistics.median(p[k]["tokens_per_s"] for p in pairs) for k in kinds}
    lines = [
        facts,
        "",
        "| pair | order | "
        + " | ".join(f"{k}: tokens/s" for k in kinds)
        + " | "
        + " | ".join(f"{k} / bare" for k in others)
        + " |",
        "|---|---|" + "---|" * (len(kinds) + len(others)),
    ]
    for i, p in enumerate(pairs, 1):
        t = {k: p[k]["tokens_per_s"] for k in kinds}
        lines.append(
            f"| {i} | {', '.join(p['order'])} | "
            + " | ".join(f"{t[k]:.0f}" for k in kinds)
            + " | "
            + " | ".join(f"{t[k] / t['bare']:.3f}" for k in others)
            + " |"
        )
    lines.append(
        "| median | | "
        + " | ".join(f"{med[k]:.0f}" for k in kinds)
        + " | "
        + " | ".join(f"{med[k] / med['bare']:.3f} (of the medians)" for k in others)
        + " |"
    )
    return "\n".join(lines)


def cli() -> None:
    parser = argparse.ArgumentParser(
        allow_abbrev=False, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--max-samples",
        type=int,
        default=None,
        help=f"training samples per run (sequences of {CONTEXT} tokens); default 6000 (--profile: 1000)",
    )
    parser.add_argument("--repeats", type=int, default=3, help="alternating pairs (with --no-eval, triples); default 3")
    parser.add_argument("--out", help="also write rows.json and bare_gpt.md into this folder")
    parser.add_argument(
        "--profile",
        nargs="?",
        const="distsgd",
        choices=KINDS,
        help="profile one short run of distsgd's loop (or of the bare one) in this process",
    )
    parser.add_argument(
        "--profiler",
        choices=("cprofile", "torch", "none"),
        default="cprofile",
        help="with --profile: cProfile (Python functions), torch.profiler (operators), or none "
        "(the step times alone, undisturbed)",
    )
    parser.add_argument("--top", type=int, default=25, help="with --profile: entries shown; default 25")
    parser.add_argument(
        "--threads",
        type=int,
        help="torch threads of both loops (distsgd: --threads-per-worker); default every core, distsgd's default",
    )
    parser.add_argument(
        "--no-eval",
        action="store_true",
        help=f"also run distsgd with no evaluation during "
        f"training ({NO_EVAL}; --eval-every beyond the run): what its evaluations cost the steps",
    )
    parser.add_argument(
        "--spawn",
        action="store_true",
        help=f"also run the bare loop as a user's loop on distsgd ({SPAWN}: distsgd.spawn, algo single)",
    )
    parser.add_argument(
        "--only",
        nargs="+",
        choices=(*KINDS, NO_EVAL, SPAWN),
        help="run these kinds only (bare is always run: the ratios are to it)",
    )
    parser.add_argument(
        "--one", choices=(*KINDS, NO_EVAL, SPAWN), help=argparse.SUPPRESS
    )  # a single run, in its own process
    args = parser.parse_args()
    if args.max_samples is None:
        args.max_samples = 1000 if args.profile else 6000
    if args.one:
        print(json.dumps(one(args.one, args.max_samples, args.threads)))
        return
    if args.profile:
        profile(args.profile, args.max_samples, args.profiler, args.top, args.threads)
        return
    kinds = (*KINDS, *((NO_EVAL,) if args.no_eval else ()), *((SPAWN,) if args.spawn else ()))
    if args.only:
        kinds = tuple(k for k in (*KINDS, NO_EVAL, SPAWN) if k == "bare" or k in args.only)
    pairs = []
    for r in range(args.repeats):
        order = kinds if r % 2 == 0 else kinds[::-1]
        pair: dict[str, Any] = {"order": list(order)}
        for kind in order:
            pair[kind] = measure(kind, args.max_samples, args.threads)
            print(f"pair {r + 1}: {kind}: {pair[kind]['tokens_per_s']:.0f} tokens/s", file=sys.stderr, flush=True)
        pairs.append(pair)
    threads = args.threads or _cores()
    facts = (
        f"{machine()}; gpt (every default) on python-stdlib, {args.max_samples} samples of {CONTEXT} tokens a "
        f"run, batch {BATCH}, one worker of {threads} thread{'s' if threads != 1 else ''}; {args.repeats} "
        f"alternating {'pairs' if len(kinds) == 2 else 'groups of ' + str(len(kinds))}, each run a fresh process; tokens/s of the "
        f"training steps (distsgd: its training clock)"
    )
    table = render(facts, pairs)
    print(table)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "rows.json").write_text(
            json.dumps({"facts": facts, "max_samples": args.max_samples, "threads": threads, "pairs": pairs}, indent=1)
            + "\n"
        )
        (out / "bare_gpt.md").write_text(table + "\n")


if __name__ == "__main__":
    cli()
