"""Running the configurations of a bench, one after another."""

from __future__ import annotations

import contextlib
import logging
import platform
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from distsgd import config as config_mod
from distsgd import rundir
from distsgd.algorithms import registry
from distsgd.api import run
from distsgd.config import RunConfig
from distsgd.data import check_name as check_dataset_name
from distsgd.errors import ConfigError
from distsgd.models import check_name as check_model_name

log = logging.getLogger(__name__)

_SPEC = re.compile(r"^(?P<name>[a-z0-9+_-]+)(\[(?P<opts>[^\]]*)\])?$")


@dataclass(frozen=True)
class AlgoSpec:
    """An algorithm with settings of its own: ``local-sgd[sync_every=8]``, ``easgd[easgd_mode=async]``."""

    name: str
    options: tuple[tuple[str, Any], ...] = field(default_factory=tuple)

    @property
    def label(self) -> str:
        if not self.options:
            return self.name
        return self.name + "[" + ";".join(f"{k}={v}" for k, v in self.options) + "]"  # as --algos takes it


def _value(text: str) -> Any:
    for conv in (int, float):
        try:
            return conv(text)
        except ValueError:
            pass
    return {"true": True, "false": False}.get(text.lower(), text)


BENCH_OWN = ("out", "overwrite", "resume", "seed")  # settings the bench gives each run itself (seed: --seed + repeat)


def parse_algos(text: str) -> list[AlgoSpec]:
    """``allreduce,local-sgd[sync_every=8;warmup_steps=100],asgd`` -> specs (``;`` between options)."""
    specs = []
    for part in _split_top(text):
        m = _SPEC.match(part.strip())
        if not m:
            raise ConfigError(f"cannot read algorithm '{part}' (write NAME or NAME[key=value;key=value])")
        registry.get(m["name"])
        opts: list[tuple[str, Any]] = []
        for item in filter(None, (m["opts"] or "").split(";")):
            key, sep, value = item.partition("=")
            if not sep:
                raise ConfigError(f"option '{item}' of {m['name']} needs key=value")
            key = key.strip().replace("-", "_")
            if key in dict(opts):  # (the last one was taken, silently)
                raise ConfigError(f"{m['name']}[...] sets {key} twice: give it once")
            if key in BENCH_OWN:  # (each run's directory is the bench's to name)
                raise ConfigError(f"{m['name']}[{key}=...]: the bench sets {key} for each run; leave it out")
            opts.append((key, _value(value.strip())))
        specs.append(AlgoSpec(m["name"], tuple(opts)))
    if not specs:
        raise ConfigError("--algos is empty")
    return specs


def _split_top(text: str) -> list[str]:
    """Split on commas outside brackets."""
    parts, depth, cur = [], 0, ""
    for ch in text:
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
        if ch == "," and depth == 0:
            parts.append(cur)
            cur = ""
        else:
            cur += ch
    if cur.strip():
        parts.append(cur)
    return [p for p in parts if p.strip()]


def _check_shared_options(base: RunConfig, algos: list[AlgoSpec]) -> None:
    """An option given to the whole bench must be one of at least one of its algorithms."""
    taken = {name for spec in algos for name in registry.get(spec.name).Options.names()}
    for key in base.options:
        if key not in taken:
            owners = registry.option_owners().get(key, [])
            raise ConfigError(
                f"--{key.replace('_', '-')} is an option of {', '.join(owners) or 'no algorithm'}, "
                f"and the bench runs none of them"
            )


def machine_facts() -> dict[str, Any]:
    cpu = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {
        "host": platform.node(),
        "cpu": cpu or platform.processor(),
        "cores": config_mod.cores(),
        "torch_version": torch.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
    }


def _plan(
    base: RunConfig, algos: list[AlgoSpec], workers: list[int], network: str | None, hosts: int
) -> list[tuple[AlgoSpec, int, RunConfig]]:
    """Each configuration the bench will run, once: (its spec, its workers, its settings); one that
    cannot run at one of the worker counts (single with 2 workers; Hogwild! across --network) is
    skipped with a warning. A spec that can run at none of them (a bad value, an option of another
    algorithm) is bad input: one line naming it."""
    from distsgd.bench.network import layout

    plan = []
    seen = set()
    for spec in algos:
        refused: list[ConfigError] = []
        # options given to the whole bench apply to the algorithms that take them
        mine = {k: v for k, v in base.options.items() if k in registry.get(spec.name).Options.names()}
        for w in workers:
            # an algorithm's own options may fix its worker count: single[workers=1]
            cfg = config_mod.from_mapping(
                dict(spec.options),
                base.replace(algo=spec.name, workers=w, options=mine),
                spec.label,
                option_names=registry.option_names(),
            )
            try:
                config_mod.validate(cfg)
                assert cfg.algo is not None  # set just above, to the spec's
                algo_cls = registry.class_for(cfg.algo, cfg)
                registry.options_of(cfg, algo_cls)
                algo_cls.check(cfg)
                if network is not None and layout(cfg, hosts) is None:
                    raise ConfigError(f"{cfg.algo} runs on one machine only, not across --network")
            except ConfigError as exc:
                refused.append(exc)
                log.warning("skipping %s with %d workers: %s", spec.label, w, exc)
                continue
            if (spec.label, cfg.workers) not in seen:
                seen.add((spec.label, cfg.workers))
                plan.append((spec, cfg.workers, cfg))
        if len(refused) == len(workers):
            _check_alone(spec, base.replace(options=mine))
    return plan


def _check_alone(spec: AlgoSpec, base: RunConfig) -> None:
    """A spec that can run at none of the bench's worker counts: if it cannot run with one worker
    on this machine either, its settings are bad (a value, an option of another algorithm): one
    line naming it, not a skip a bench that then runs the rest would hide."""
    try:
        cfg = config_mod.from_mapping(
            dict(spec.options),
            base.replace(algo=spec.name, workers=1),
            spec.label,
            option_names=registry.option_names(),
        )
        config_mod.validate(cfg)
        algo_cls = registry.class_for(spec.name, cfg)
        registry.options_of(cfg, algo_cls)
        algo_cls.check(cfg)
    except ConfigError as exc:
        raise ConfigError(f"--algos {spec.label}: {exc}") from None


# What a bench tells its caller of each run: (its number, from 1; the runs in all; its entry:
# algo, workers, repeat, run_dir, and once it has ended its summary).
Report = Callable[[int, int, dict[str, Any]], None]


def run_bench(
    base: RunConfig,
    algos: list[AlgoSpec],
    workers: list[int],
    repeats: int,
    out: Path,
    overwrite: bool = False,
    on_run: Report | None = None,
    network: str | None = None,
    hosts: int | None = None,
    on_start: Report | None = None,
) -> dict[str, Any]:
    """Run every configuration in turn; write bench.json, bench.md and plots into ``out``. With ``network``
    (``RATE[,delay=D]``), each run crosses the shaped links of ``hosts`` (default 2) namespaces, a worker each.
    ``on_start`` hears of each run as it starts (its entry without a summary), ``on_run`` as it ends."""
    from distsgd.bench import report
    from distsgd.bench.network import Network, describe, settle_hosts

    hosts = settle_hosts(network, hosts)
    if network is not None:
        workers = [hosts]  # one worker a host: see distsgd.bench.network

    if repeats < 1:
        raise ConfigError(f"--repeats must be at least 1, got {repeats}")
    if not workers or min(workers) < 1:
        raise ConfigError(f"--workers must list positive counts, got {workers}")
    _check_shared_options(base, algos)
    plan = _plan(base, algos, workers, network, hosts)
    if not plan:
        raise ConfigError("no configuration of the bench can run (see the warnings above)")
    for _, _, cfg in plan:  # a name no run could take, before the bench's directory is made
        check_model_name(cfg.model)
        if cfg.dataset is not None:
            check_dataset_name(cfg.dataset)
    runs: list[dict[str, Any]] = []
    # the hosts and their link first: a network that cannot be made leaves no bench directory behind
    with Network(network, hosts) if network is not None else contextlib.nullcontext() as net:
        out = rundir.prepare(out, overwrite, None, "bench")
        total = len(plan) * repeats
        for spec, w, cfg in plan:
            for r in range(repeats):
                run_dir = out / "runs" / f"{spec.label}-w{w}-r{r}".replace("[", "_").replace("]", "").replace(";", "_")
                cfg_r = cfg.replace(seed=base.seed + r, out=str(run_dir.resolve()), overwrite=True, quiet=True)
                entry: dict[str, Any] = {
                    "algo": spec.label,
                    "workers": w,
                    "repeat": r,
                    "run_dir": str(run_dir.relative_to(out)),
                }
                if on_start is not None:
                    on_start(len(runs) + 1, total, entry)
                entry["summary"] = net.run(cfg_r) if net is not None else run(cfg_r).summary
                runs.append(entry)
                if on_run is not None:
                    on_run(len(runs), total, entry)
    bench = report.derive(runs, machine_facts(), base, repeats)
    if network is not None:
        bench["network"] = network
        bench["hosts"] = hosts
        bench["link"] = describe(network, hosts)
    report.write(bench, out, "bench")
    return bench
