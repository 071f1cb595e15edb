"""The ``distsgd`` command: a thin layer that parses flags, builds a RunConfig and calls the API.

    distsgd train --algo single --dataset fashion-mnist --model mnist_net --epochs 10
    distsgd eval --checkpoint runs/<run>/model.pt
    distsgd datasets
    distsgd algorithms
    distsgd bench --algos single,allreduce --workers 2
    distsgd compare runs/a runs/b

A user mistake prints one ``error: ...`` line on stderr and exits 2.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import sys
import threading
import time
import warnings
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, NoReturn

from distsgd import __version__, _early, options
from distsgd import config as config_mod
from distsgd.config import RunConfig
from distsgd.errors import ConfigError, DistsgdError, Terminated, on_sigterm, one_line


class _Parser(argparse.ArgumentParser):
    commands: dict[str, "_Parser"] = {}  # the top parser's sub-commands' parsers, by name

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        # No abbreviations: argparse would read a mistyped --epoch as --epochs (and --lr as
        # --lr-gamma once a flag is added beside it); a flag no parser knows is one error line.
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:  # one line, like every other user mistake
        sys.stderr.write(f"error: {one_line(message)} (see `{self.prog} --help`)\n")
        raise SystemExit(2)

    # argparse's overloads also take a namespace to fill and return; distsgd never gives one
    def parse_args(  # type: ignore[override]
        self, args: Iterable[str] | None = None, namespace: None = None
    ) -> argparse.Namespace:
        """As argparse's, but a flag no parser knows is the sub-command's error, naming its help."""
        parsed, extra = self.parse_known_args(args, namespace)
        if extra:
            command: str | None = getattr(parsed, "command", None)
            named = self.commands.get(command, self) if command is not None else self
            named.error(f"unrecognized arguments: {' '.join(extra)}")
        return parsed


def _add_flag(parser: Any, f: dataclasses.Field, help_text: str | None) -> None:
    """The flag of a setting (a RunConfig field or an algorithm's option): its type from the field."""
    flag, how = options.flag_of(f), options.kind(f)
    if how == "bool":
        parser.add_argument(flag, dest=f.name, action="store_true", default=None, help=help_text)
        return
    conv: Any = {"int": int, "float": float}.get(how, str)
    metavar = f.metadata.get("metavar") or f.name.split("_")[-1].upper()
    optional = {} if f.metadata.get("const") is None else {"nargs": "?", "const": f.metadata["const"]}
    parser.add_argument(flag, dest=f.name, type=conv, default=None, help=help_text, metavar=metavar, **optional)


def _add_run_flags(
    parser: argparse.ArgumentParser, skip: tuple[str, ...] = (), helps: dict[str, str] | None = None
) -> None:
    """One flag per RunConfig field, with the help text the field carries (``helps``: the command's
    own, where the setting means something else there); then one per option of any algorithm, its
    help naming the algorithms that take it (made from their Options)."""
    from distsgd.data import dataset_help
    from distsgd.models import model_help

    listed = {"dataset": dataset_help, "model": model_help}  # help made from the registries
    parser.add_argument("--config", metavar="FILE.toml", help="read settings from a TOML file (flags override it)")
    for f in dataclasses.fields(RunConfig):
        if f.name not in skip and f.name != "options":
            own = (helps or {}).get(f.name)
            _add_flag(parser, f, own or options.help_text(f, listed[f.name]() if f.name in listed else None))
    group = parser.add_argument_group("the algorithms' own options (each applies to the algorithms it names)")
    for name, (f, text) in algorithm_options().items():
        _add_flag(group, f, text)


def algorithm_options() -> dict[str, tuple[dataclasses.Field, str]]:
    """Every algorithm option: its field (the first declaration) and a help text naming the
    algorithms that take it, with each one's default where they differ."""
    from distsgd.algorithms import registry

    out: dict[str, tuple[dataclasses.Field, str]] = {}
    for name, owners in registry.option_owners().items():
        decls = [{f.name: f for f in dataclasses.fields(registry.get(o).Options)}[name] for o in owners]
        texts = [f.metadata.get("help", "") for f in decls]
        defaults = [options.default_words(f) for f in decls]
        if len(set(texts)) == 1 and len(set(defaults)) == 1:
            text = f"{', '.join(owners)}: {options.help_text(decls[0])}"
        else:  # each algorithm's own words, or its own default
            same = len(set(texts)) == 1
            text = f"{', '.join(owners)}: {texts[0]}" if same else "; ".join(f"{o}: {t}" for o, t in zip(owners, texts))
            text += "; default " + ", ".join(f"{d} ({o})" for o, d in zip(owners, defaults))
        out[name] = (decls[0], text)
    return out


BENCH_OUT = "runs/bench-<timestamp>"  # where distsgd bench writes without --out


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="distsgd", description="Train PyTorch models with parallel and distributed SGD.")
    parser.add_argument("--version", action="version", version=f"distsgd {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="log more (dataset locations, workers)")
    sub = parser.add_subparsers(dest="command", parser_class=_Parser, metavar="COMMAND")
    parser.commands = sub.choices
    train = sub.add_parser("train", help="train a model")
    _add_run_flags(train)
    ev = sub.add_parser("eval", help="measure a saved model on its test set")
    ev.add_argument("--checkpoint", required=True, help="model.pt or model.safetensors, or a run directory")
    ev.add_argument(
        "--dataset",
        help="dataset to evaluate on (default: the one it was trained on; a FILE.py:FUNC "
        "it names runs only when named here)",
    )
    ev.add_argument(
        "--model",
        help="the model's path/file.py:ClassName, when the checkpoint names one: eval runs "
        "no file that is not named on its command line",
    )
    ev.add_argument("--data-dir")
    ev.add_argument("--json", action="store_true", help="print the result as JSON")
    ds = sub.add_parser("datasets", help="list the built-in datasets and where their files are")
    ds.add_argument("--data-dir")
    algos = sub.add_parser("algorithms", help="list the algorithms and their options")
    algos.add_argument("--markdown", action="store_true", help="as the README's table")
    bench = sub.add_parser("bench", help="run algorithms side by side and report them")
    bench.add_argument(
        "--algos",
        required=True,
        help="comma-separated algorithms, each optionally with settings of its own: NAME[option=value;option=value]",
    )
    bench.add_argument(
        "--workers", dest="bench_workers", default="2", help="comma-separated worker counts; default %(default)s"
    )
    bench.add_argument("--repeats", type=int, default=1, help="runs of each configuration; default %(default)s")
    bench.add_argument(
        "--network",
        metavar="RATE[,delay=MS]",
        help="run each configuration as hosts (network namespaces, needs root) on links shaped "
        "with tc, e.g. 10mbit,delay=20ms",
    )
    bench.add_argument(
        "--hosts",
        type=int,
        help="with --network: hosts, one worker each (a parameter server on one more); default 2",
    )
    _add_run_flags(
        bench,
        skip=("algo", "workers", "resume"),  # (each configuration runs afresh: a --resume resumed the first alone)
        helps={
            "out": f"the bench's directory: bench.json, bench.md, the plots, and runs/ with each "
            f"configuration's run; default {BENCH_OUT}",
            "overwrite": "replace an existing bench directory (one distsgd wrote)",
        },
    )
    cmp = sub.add_parser("compare", help="the bench's table and plots for runs that already exist")
    cmp.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="run directories (each with its summary.json)")
    cmp.add_argument(
        "--out",
        help="where compare.md, compare.json and the plots go (created if need be; other "
        "files there are left alone); default compare-<timestamp>",
    )
    cmp.add_argument("--quiet", action="store_true", help="print nothing but errors")
    return parser


def config_from_args(args: argparse.Namespace) -> RunConfig:
    from distsgd.algorithms import registry

    names = registry.option_names()
    given = {
        k: v
        for k, v in vars(args).items()
        if v is not None and (k in names or k in {f.name for f in dataclasses.fields(RunConfig)})
    }
    given.pop("options", None)
    if args.command == "bench":
        given.pop("workers", None)
    if given.get("resume"):  # the saved run's settings, with the flags given now on top
        if getattr(args, "config", None):  # (until 2026-12-01 the file was read by nothing, exit 0)
            raise ConfigError(
                f"--config {args.config} with --resume: a resumed run takes its own settings (its config.toml); "
                f"give the ones to change as flags"
            )
        return config_mod.for_resume(given["resume"], given, option_names=names, options_of=registry.own_options)
    cfg = config_mod.load_toml(args.config, option_names=names) if args.config else RunConfig()
    return config_mod.from_mapping(given, cfg, source="the command line", option_names=names)


def cmd_train(args: argparse.Namespace) -> int:
    from distsgd.api import default_algo, default_out, run
    from distsgd.launch import environment

    cfg = config_from_args(args)
    _hush(cfg.quiet)
    algo = cfg.algo
    if algo is None:
        algo, said = default_algo(cfg, environment.detect())
        if said and not cfg.quiet:
            sys.stderr.write(said + "\n")
    cfg = cfg.replace(algo=algo)
    if cfg.out is None:
        cfg = cfg.replace(out=str(default_out(algo, beside=_saved_run(args))))
    result = run(cfg, fresh=_early.the_command())  # this process is the command: nothing has run in it yet
    s = result.summary
    if not cfg.quiet and result.out is not None:  # under torchrun, only rank 0 reports
        target = ""
        goal = (
            f"{s['target_accuracy']:.2%}"
            if s["target_accuracy"] is not None
            else f"test loss {s['target_loss']:.4g}"
            if s.get("target_loss") is not None
            else None
        )
        if goal is not None:
            reached = s["time_to_target_s"]
            target = (
                f"; reached {goal} after {reached:.1f} s, {s['samples_to_target']} samples"
                if reached is not None
                else f"; did not reach {goal}"
            )
        acc = s["final_test_accuracy"]
        if s.get("task") == "lm":  # per token: loss, perplexity, bits, next-token accuracy; the unigram baseline
            print(
                f"{s['algo']} x{s['workers']}: test loss {s['final_test_loss']:.4f} nats/token (perplexity "
                f"{s['final_test_perplexity']:.3f}, {s['final_test_bits_per_token']:.3f} bits/token; the corpus's "
                f"unigram entropy {s.get('unigram_entropy', float('nan')):.4f} nats/token), next-token accuracy {acc:.4f}, "
                f"{s['tokens']} tokens in {s['train_wall_s']:.1f} s ({s['tokens_per_s']:.0f} tokens/s){target}"
            )
        else:
            print(
                f"{s['algo']} x{s['workers']}: "
                + (f"test accuracy {acc:.4f}, " if acc is not None else "")
                + f"test loss {s['final_test_loss']:.4f}{_as_of(s)}, {s['samples']} samples in {s['train_wall_s']:.1f} s "
                f"({s['samples_per_s']:.0f} samples/s){target}"
            )
        print(f"run saved in {result.out}")
    return 0


def _as_of(s: dict[str, Any]) -> str:
    """Which model the final figures describe, where the samples alone would mislead: the model
    returned, as it was at its last evaluation, when steps trained after it never reached it; or
    the one the run started from (DiLoCo's --partial-round theta before its first outer step)."""
    if s.get("untrained"):
        return f" (of the model returned: the one the run started from, which none of the {s['samples']} samples trained reached)"
    at = s.get("final_eval_samples")
    if at is None or at >= s["samples"]:
        return ""
    return (
        f" (of the model returned, as it was at {at} samples: the {s['samples'] - at} trained after never reached it)"
    )


def _hush(quiet: bool) -> None:
    """--quiet: nothing but errors from this process (its workers: see procs.begin_worker), neither
    warnings logged nor Python's (torch's) own."""
    if quiet:
        logging.getLogger().setLevel(logging.ERROR)
        warnings.simplefilter("ignore")


def _saved_run(args: argparse.Namespace) -> Path | None:
    """The run directory whose own config.toml ``--config`` names, if it does: a re-run of it goes
    beside it (not into it, nor into a runs/ folder inside it when run from there)."""
    from distsgd import rundir

    if not args.config or args.resume:
        return None
    folder = Path(args.config).parent
    return folder if Path(args.config).name == "config.toml" and rundir.is_ours(folder) else None


def cmd_eval(args: argparse.Namespace) -> int:
    from distsgd.api import evaluate_checkpoint

    res = evaluate_checkpoint(args.checkpoint, args.dataset, args.data_dir, model=args.model)
    if args.json:
        print(json.dumps(res))
    else:
        acc = f"accuracy {res['test_accuracy']:.4f}, " if res["test_accuracy"] is not None else ""
        ppl = f" (perplexity {res['test_perplexity']:.3f})" if "test_perplexity" in res else ""
        print(
            f"{res['model']} on {res['dataset']} ({res['test_samples']} test samples): {acc}loss "
            f"{res['test_loss']:.4f}{ppl}"
        )
    return 0


def cmd_datasets(args: argparse.Namespace) -> int:
    from distsgd.data import FORMATS, available
    from distsgd.errors import ConfigError

    if args.data_dir is not None and not Path(args.data_dir).is_dir():  # (it was passed over, without a word)
        raise ConfigError(f"--data-dir {args.data_dir} is not a directory")
    rows = available(args.data_dir)
    width = max(len(r[0]) for r in rows + [(f.usage,) for f in FORMATS])
    for name, status, where in rows:
        print(f"{name:<{width}}  {status:<12}  {where}")
    for fmt in FORMATS:
        print(f"{fmt.usage:<{width}}  {'user data':<12}  {fmt.help}")
    return 0


def algorithms_table() -> str:
    """The README's table of algorithms, made from the registry."""
    from distsgd.algorithms import registry

    lines = ["| name | family | workers cooperate by | its options |", "|---|---|---|---|"]
    for name in registry.names():
        cls = registry.get(name)
        flags = ", ".join(f"`{options.flag_of(f)}`" for f in dataclasses.fields(cls.Options)) or "-"
        lines.append(f"| `{name}` | {cls.kind} | {cls.summary_line.replace('|', chr(92) + '|')} | {flags} |")
    return "\n".join(lines)


def cmd_algorithms(args: argparse.Namespace) -> int:
    from distsgd.algorithms import registry

    if args.markdown:
        print(algorithms_table())
        return 0
    flags = {f.name: options.flag_of(f) for f in dataclasses.fields(RunConfig)}
    for name in registry.names():
        cls = registry.get(name)
        print(f"{name:<17} {cls.kind:<18} {cls.topology.kind:<7} {cls.summary_line}")
        for f in dataclasses.fields(cls.Options):
            print(f"{'':<19}{options.flag_of(f)}: {options.help_text(f)}")
        own = cls.default_settings(RunConfig(algo=name))  # with its options' defaults
        if own:  # what --lr's help and --weight-decay's send the reader here for
            said = ", ".join(f"{flags[k]} {_number(v)}" for k, v in own.items())
            print(
                f"{'':<19}its own defaults for settings left unset: {said} (with its options at their "
                f"defaults; a built-in model's own come first: gpt's)"
            )
    return 0


def _number(value: Any) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value)


def cmd_bench(args: argparse.Namespace) -> int:
    from distsgd.bench import parse_algos, run_bench
    from distsgd.errors import ConfigError

    base = config_from_args(args)
    _hush(base.quiet)
    algos = parse_algos(args.algos)
    try:
        workers = [int(w) for w in args.bench_workers.split(",") if w.strip()]
    except ValueError:
        raise ConfigError(f"--workers must be comma-separated numbers, got '{args.bench_workers}'") from None
    out = Path(base.out) if base.out else Path(BENCH_OUT.replace("<timestamp>", time.strftime("%Y%m%d-%H%M%S")))
    args.out = str(out)  # (for the line of a bench interrupted: where its finished runs are)
    started = 0.0

    def which(n: int, total: int, entry: dict) -> str:
        return f"[{n}/{total}] {entry['algo']} x{entry['workers']} repeat {entry['repeat']}"

    heartbeat = _Heartbeat()

    def starting(n: int, total: int, entry: dict) -> None:  # a run may take minutes: say what is running
        nonlocal started
        started = time.monotonic()
        if not base.quiet:
            print(f"{which(n, total, entry)}: running, in {out / entry['run_dir']}", flush=True)
            heartbeat.start(which(n, total, entry), out / entry["run_dir"] / "metrics.jsonl")

    def ended(n: int, total: int, entry: dict) -> None:
        heartbeat.stop()
        if base.quiet:
            return
        s = entry["summary"]
        reached = "-" if s["time_to_target_s"] is None else f"{s['time_to_target_s']:.1f}s"
        print(
            f"{which(n, total, entry)}: {s['samples_per_s']:.0f} samples/s, "
            + (  # a language model's, or a regression's (no accuracy): the loss
                f"test loss {s['final_test_loss']:.4f}"
                if s.get("task") == "lm" or s.get("final_test_accuracy") is None
                else f"acc {s['final_test_accuracy']:.4f}"
            )
            + f", to target {reached}; done in {time.monotonic() - started:.0f} s",
            flush=True,
        )

    try:
        bench = run_bench(
            base,
            algos,
            workers,
            args.repeats,
            out,
            overwrite=base.overwrite,
            on_run=ended,
            network=args.network,
            hosts=args.hosts,
            on_start=starting,
        )
    finally:
        heartbeat.stop()
    if not base.quiet:
        print(f"wrote {out / 'bench.json'}, {out / 'bench.md'}" + "".join(f", {out / p}" for p in bench["plots"]))
    return 0


HEARTBEAT_S = 10.0  # how often distsgd bench says how far the configuration that is training is


class _Heartbeat:
    """While one configuration of ``distsgd bench`` trains, a line every :data:`HEARTBEAT_S`
    seconds of how far it is: the last progress its run directory's metrics.jsonl holds (a line
    flushed per event), so a configuration that trains for minutes is seen to."""

    def __init__(self) -> None:
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self, label: str, metrics: Path) -> None:
        self.stop()
        self._stop = stop = threading.Event()
        began = time.monotonic()

        def beat() -> None:
            while not stop.wait(HEARTBEAT_S):
                last = _last_progress(metrics)
                if last is not None and not stop.is_set():
                    print(
                        f"{label}: {last['samples']} samples, {last.get('samples_per_s') or 0:.0f} samples/s, "
                        f"{time.monotonic() - began:.0f} s so far",
                        flush=True,
                    )

        self._thread = threading.Thread(target=beat, name="distsgd-bench-progress", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None


def _last_progress(metrics: Path) -> dict[str, Any] | None:
    """The last progress event in a run's metrics.jsonl (None: none yet, or no file yet)."""
    try:
        lines = metrics.read_text(encoding="utf-8").splitlines()
    except OSError:
        return None
    for line in reversed(lines):
        try:
            event = json.loads(line)
        except ValueError:  # the line being written
            continue
        if isinstance(event, dict) and event.get("event") == "progress":
            return event
    return None


def cmd_compare(args: argparse.Namespace) -> int:
    from distsgd.bench import compare_runs
    from distsgd.bench.report import table

    _hush(args.quiet)
    out = Path(args.out) if args.out else Path(f"compare-{time.strftime('%Y%m%d-%H%M%S')}")
    report = compare_runs([Path(d) for d in args.run_dirs], out)
    if not args.quiet:
        header, rows = table(report)
        widths = [max(len(cells[i]) for cells in [header, *rows]) for i in range(len(header))]
        for cells in [header, ["-" * w for w in widths], *rows]:
            print("  ".join(c.ljust(w) for c, w in zip(cells, widths)).rstrip())
        print(f"wrote {out / 'compare.md'}, {out / 'compare.json'}" + "".join(f", {out / p}" for p in report["plots"]))
    return 0


def _resume_hint(args: argparse.Namespace | None) -> str:
    """For a stopped run that checkpoints: where its last whole checkpoint is, and how to go on."""
    from distsgd.checkpoint import read_manifest

    out = getattr(args, "out", None) or getattr(args, "resume", None)
    if args is not None and args.command == "bench" and out and (Path(out) / "runs").is_dir():
        done = sum((run / "summary.json").is_file() for run in (Path(out) / "runs").iterdir())
        return f"; {done} run(s) finished in {out}/runs: distsgd compare {out} tabulates them" if done else ""
    try:
        manifest = read_manifest(Path(out)) if out and args is not None and args.command == "train" else None
    except DistsgdError:
        return ""
    if manifest is None:
        return ""
    return (
        f"; its last whole checkpoint ({manifest.get('samples', '?')} samples) goes on with "
        f"distsgd train --resume {out}"
    )


COMMANDS = {
    "train": cmd_train,
    "eval": cmd_eval,
    "datasets": cmd_datasets,
    "algorithms": cmd_algorithms,
    "bench": cmd_bench,
    "compare": cmd_compare,
}


def _ended() -> Callable[[], None]:
    """The command has ended: a SIGTERM, SIGUSR1 or Ctrl-C from now on (srun's --kill-on-bad-exit
    ends a task that has just said its peer failed; a second Ctrl-C) asks for what is already
    happening, so it is ignored rather than raised inside the handler that says how the command
    ended. (One that came before this, while the command's exception was on its way here, is caught
    below as any Terminated or KeyboardInterrupt is.) Returns what puts Ctrl-C's handler back (main's
    end puts SIGTERM's and SIGUSR1's back)."""
    import signal

    if threading.current_thread() is not threading.main_thread():
        return lambda: None
    for sig in (signal.SIGTERM, signal.SIGUSR1):
        signal.signal(sig, signal.SIG_IGN)
    interrupt = signal.signal(signal.SIGINT, signal.SIG_IGN)

    def put_back() -> None:
        signal.signal(signal.SIGINT, interrupt)

    return put_back


def _quiet_teardown(argv: list[str] | None) -> None:
    """A signal ended the command, its line said: what torch was building when it came (a
    DataLoader's iterator half made, its loader processes ended by the same signal) complains as
    the interpreter collects it ("Exception ignored in ..."), after that line. Not news: silenced,
    in the command's own process only (``argv`` None: a caller of main() keeps its hook)."""
    if argv is None:
        sys.unraisablehook = lambda unraisable: None


def main(argv: list[str] | None = None) -> int:
    restore = on_sigterm()  # from here to the end, as from the command's first instruction (distsgd._early)
    _early.settled()
    root = logging.getLogger()
    level, filters = root.level, warnings.filters[:]  # what --quiet changes, put back at the end
    args: argparse.Namespace | None = None
    interrupts: Callable[[], None] = lambda: None  # noqa: E731
    try:
        try:
            parser = build_parser()  # imports every algorithm: a signal may come meanwhile
            args = parser.parse_args(argv)
            if args.command is None:
                parser.print_help()
                return 2
            logging.basicConfig(
                level=logging.INFO if args.verbose else logging.WARNING, format="%(levelname)s: %(message)s"
            )
            code = COMMANDS[args.command](args)
        except BaseException:
            interrupts = _ended()  # the line below says how it ended; a SIGTERM raised now would escape it
            raise
        interrupts = _ended()
        return code
    except DistsgdError as exc:
        sys.stderr.write(f"error: {one_line(exc)}\n")
        return exc.exit_code
    except Terminated as exc:
        sys.stderr.write(f"error: terminated by {exc.signal_name}{_resume_hint(args)}\n")
        _quiet_teardown(argv)
        return 128 + exc.signal_number
    except KeyboardInterrupt:
        sys.stderr.write(f"error: interrupted{_resume_hint(args)}\n")
        _quiet_teardown(argv)
        return 130
    except OSError as exc:  # a path the user gave that cannot be read or written: their mistake
        where = f" {exc.filename}" if exc.filename else ""
        sys.stderr.write(f"error: {one_line(f'cannot write or read{where}: {exc.strerror or exc}')}\n")
        return 2
    finally:
        # The command has ended and said how: a SIGTERM from now on (srun's --kill-on-bad-exit,
        # after this task's own error line) must not raise inside the interpreter's exit and print
        # a traceback there, nor say a second line; it ends the process as a SIGTERM does.
        restore()
        interrupts()
        _early.settled()
        # a command called in this process (a test, a notebook) leaves no --quiet behind it
        root.setLevel(level)
        warnings.filters[:] = filters  # type: ignore[index]  # a list, typed as a Sequence


if __name__ == "__main__":
    raise SystemExit(main())
