"""The run configuration: one dataclass, filled from defaults, a TOML file and CLI flags.

Precedence is the usual one: a flag on the command line beats the TOML file, which beats the
defaults below. ``validate`` turns every impossible setting into a one-line ``ConfigError``.
"""

from __future__ import annotations

import dataclasses
import math
import os
import sys
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from distsgd.errors import ConfigError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on Python 3.10 only
    import tomli as tomllib

OPTIMIZERS = ("sgd", "adam", "adamw")
SCHEDULES = ("constant", "step", "cosine")
INITS = ("default", "xavier")
PARTITIONS = ("sharded", "replicated")
BACKENDS = ("gloo", "nccl", "mpi")


@dataclass
class RunConfig:
    """Everything that defines a run. Field names are the CLI flags with ``-`` as ``_``."""

    algo: str = "single"
    workers: int = 1
    dataset: str = "fashion-mnist"
    data_dir: str | None = None
    model: str = "mnist_net"
    epochs: int = 1
    max_samples: int | None = None
    batch_size: int = 64
    lr: float = 0.01
    momentum: float = 0.5
    nesterov: bool = False
    optimizer: str = "sgd"
    weight_decay: float = 0.0
    schedule: str = "constant"
    lr_step_epochs: int = 1
    lr_gamma: float = 0.1
    init: str = "default"
    seed: int = 0
    partition: str = "sharded"
    eval_every: int | None = None
    eval_batch_size: int = 1000
    target_accuracy: float | None = None
    stop_at_target: bool = False
    threads_per_worker: int | None = None
    log_every: int = 50
    out: str | None = None
    overwrite: bool = False
    quiet: bool = False
    # Process groups (used by the multi-process algorithms).
    backend: str = "gloo"
    init_method: str | None = None
    timeout_s: float = 300.0
    # allreduce: size of one gradient bucket.
    bucket_mb: float = 25.0
    # hogwild: take a lock around every update (for comparison with lock-free).
    hogwild_lock: bool = False
    # parameter server: staleness-aware lr (asgd), bound S (ssp), delay compensation (dcasgd).
    staleness_lr: bool = False
    staleness: int = 2
    dc_lambda: float | None = None
    dc_adaptive: bool = False
    # local-sgd: average every H steps (or "epoch"), after K synchronous warm-up steps.
    sync_every: str = "8"
    warmup_steps: int = 0
    # easgd: exchange every tau steps with elastic strength alpha (default 0.9 / workers).
    tau: int = 8
    alpha: float | None = None
    easgd_mode: str = "sync"
    # hogwild++: processes per cluster, and local updates between token passes.
    cluster_size: int = 1
    update_delay: int = 16
    # Checkpoints: every N samples (all workers) or "epoch"; --resume DIR continues a run.
    checkpoint_every: str | None = None
    resume: str | None = None
    # Benchmarks: "RANK:FACTOR" makes worker RANK FACTOR times slower (it sleeps after each step).
    straggler: str | None = None
    # Extra settings an algorithm may read; kept so a TOML file round-trips.
    extra: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def replace(self, **changes: Any) -> "RunConfig":
        return dataclasses.replace(self, **changes)


_FIELDS = {f.name: f for f in fields(RunConfig)}


def _coerce(name: str, value: Any) -> Any:
    """Check a TOML or API value against the field's declared type."""
    annotation = str(_FIELDS[name].type)
    if value is None:
        if "None" in annotation:
            return None
        raise ConfigError(f"setting '{name}' cannot be empty")
    if name == "extra":
        if not isinstance(value, dict):
            raise ConfigError("setting 'extra' must be a table")
        return value
    if "bool" in annotation:
        if not isinstance(value, bool):
            raise ConfigError(f"setting '{name}' must be true or false, got {value!r}")
        return value
    if "int" in annotation and "float" not in annotation:
        if isinstance(value, bool) or not isinstance(value, int):
            if isinstance(value, float) and value.is_integer():
                return int(value)
            raise ConfigError(f"setting '{name}' must be a whole number, got {value!r}")
        return value
    if "float" in annotation:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"setting '{name}' must be a number, got {value!r}")
        return float(value)
    if name in ("sync_every", "checkpoint_every") and isinstance(value, int) and not isinstance(value, bool):
        return str(value)
    if "str" in annotation:
        if not isinstance(value, (str, os.PathLike)):
            raise ConfigError(f"setting '{name}' must be a string, got {value!r}")
        return str(value)
    return value


def from_mapping(values: dict[str, Any], base: RunConfig | None = None, source: str = "settings") -> RunConfig:
    """Build a config from ``values`` (keys may use ``-`` or ``_``) over ``base``."""
    cfg = base or RunConfig()
    changes: dict[str, Any] = {}
    for key, value in values.items():
        name = key.replace("-", "_")
        if name not in _FIELDS:
            close = _close_match(name)
            hint = f" (did you mean '{close}'?)" if close else ""
            raise ConfigError(f"unknown setting '{key}' in {source}{hint}")
        changes[name] = _coerce(name, value)
    return dataclasses.replace(cfg, **changes)


def _close_match(name: str) -> str | None:
    import difflib

    found = difflib.get_close_matches(name, list(_FIELDS), n=1, cutoff=0.7)
    return found[0] if found else None


def load_toml(path: str | Path, base: RunConfig | None = None) -> RunConfig:
    """Read a TOML config. Keys are top-level, or under a ``[train]`` table."""
    path = Path(path)
    try:
        with path.open("rb") as fh:
            data = tomllib.load(fh)
    except FileNotFoundError:
        raise ConfigError(f"config file not found: {path}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config file {path} is not valid TOML: {exc}") from None
    if set(data) == {"train"} and isinstance(data["train"], dict):
        data = data["train"]
    return from_mapping(data, base, source=str(path))


def to_toml(cfg: RunConfig) -> str:
    """The resolved configuration as TOML (settings that are unset are left out)."""
    lines = ["# distsgd run configuration (resolved). Re-run with: distsgd train --config config.toml"]
    extra = {}
    for name, value in cfg.to_dict().items():
        if name == "extra":
            extra = value
            continue
        if value is None:
            continue
        lines.append(f"{name} = {_toml_value(value)}")
    if extra:
        lines.append("")
        lines.append("[extra]")
        for key, value in extra.items():
            lines.append(f"{key} = {_toml_value(value)}")
    return "\n".join(lines) + "\n"


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        if isinstance(value, float) and not math.isfinite(value):
            raise ConfigError(f"cannot write {value!r} to TOML")
        return repr(value)
    if isinstance(value, str):
        escaped = value.replace("\\", "\\\\").replace('"', '\\"')
        return f'"{escaped}"'
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    raise ConfigError(f"cannot write {value!r} to TOML")


def cores() -> int:
    """Cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        return os.cpu_count() or 1


def threads_per_worker(cfg: RunConfig) -> int:
    if cfg.threads_per_worker is not None:
        return cfg.threads_per_worker
    local = int(os.environ.get("LOCAL_WORLD_SIZE", 0)) or cfg.workers  # torchrun: workers on this node
    return max(1, cores() // local)


def validate(cfg: RunConfig) -> RunConfig:
    """Reject impossible settings with one clear line each."""

    def need(ok: bool, message: str) -> None:
        if not ok:
            raise ConfigError(message)

    need(cfg.workers >= 1, f"--workers must be at least 1, got {cfg.workers}")
    need(cfg.batch_size >= 1, f"--batch-size must be at least 1, got {cfg.batch_size}")
    need(cfg.epochs >= 1, f"--epochs must be at least 1, got {cfg.epochs}")
    need(cfg.max_samples is None or cfg.max_samples >= 1, f"--max-samples must be at least 1, got {cfg.max_samples}")
    need(math.isfinite(cfg.lr) and cfg.lr > 0, f"--lr must be a positive number, got {cfg.lr}")
    need(0 <= cfg.momentum < 1, f"--momentum must be in [0, 1), got {cfg.momentum}")
    need(not cfg.nesterov or cfg.momentum > 0, "--nesterov needs a --momentum above 0")
    need(cfg.weight_decay >= 0, f"--weight-decay must be >= 0, got {cfg.weight_decay}")
    need(cfg.optimizer in OPTIMIZERS, f"unknown optimizer '{cfg.optimizer}' (choose from {', '.join(OPTIMIZERS)})")
    need(cfg.schedule in SCHEDULES, f"unknown schedule '{cfg.schedule}' (choose from {', '.join(SCHEDULES)})")
    need(cfg.lr_step_epochs >= 1, f"--lr-step-epochs must be at least 1, got {cfg.lr_step_epochs}")
    need(0 < cfg.lr_gamma <= 1, f"--lr-gamma must be in (0, 1], got {cfg.lr_gamma}")
    need(cfg.init in INITS, f"unknown init '{cfg.init}' (choose from {', '.join(INITS)})")
    need(cfg.partition in PARTITIONS, f"unknown partition '{cfg.partition}' (choose from {', '.join(PARTITIONS)})")
    need(cfg.eval_every is None or cfg.eval_every >= 1, f"--eval-every must be at least 1 sample, got {cfg.eval_every}")
    need(cfg.eval_batch_size >= 1, f"--eval-batch-size must be at least 1, got {cfg.eval_batch_size}")
    need(
        cfg.target_accuracy is None or 0 < cfg.target_accuracy <= 1,
        f"--target-accuracy must be in (0, 1], got {cfg.target_accuracy}",
    )
    need(not cfg.stop_at_target or cfg.target_accuracy is not None, "--stop-at-target needs --target-accuracy")
    need(
        cfg.threads_per_worker is None or cfg.threads_per_worker >= 1,
        f"--threads-per-worker must be at least 1, got {cfg.threads_per_worker}",
    )
    need(cfg.log_every >= 1, f"--log-every must be at least 1 step, got {cfg.log_every}")
    need(cfg.backend in BACKENDS, f"unknown backend '{cfg.backend}' (choose from {', '.join(BACKENDS)})")
    need(cfg.timeout_s > 0, f"--timeout must be positive, got {cfg.timeout_s}")
    need(cfg.bucket_mb > 0, f"--bucket-mb must be positive, got {cfg.bucket_mb}")
    need(cfg.staleness >= 0, f"--staleness must be >= 0, got {cfg.staleness}")
    need(cfg.dc_lambda is None or cfg.dc_lambda >= 0, f"--dc-lambda must be >= 0, got {cfg.dc_lambda}")
    need(cfg.warmup_steps >= 0, f"--warmup-steps must be >= 0, got {cfg.warmup_steps}")
    need(cfg.cluster_size >= 1, f"--cluster-size must be at least 1, got {cfg.cluster_size}")
    need(cfg.update_delay >= 1, f"--update-delay must be at least 1, got {cfg.update_delay}")
    if cfg.checkpoint_every is not None:
        checkpoint_interval(cfg.checkpoint_every)
        need(cfg.out is not None, "--checkpoint-every needs a run directory (--out)")
    if cfg.straggler is not None:
        rank, factor = parse_straggler(cfg.straggler)
        need(rank < cfg.workers, f"--straggler names worker {rank}, but there are only {cfg.workers} workers")
    from distsgd.algorithms import registry

    registry.get(cfg.algo)  # raises ConfigError for an unknown name
    return cfg


def parse_every(text: str, flag: str, unit: str) -> int | None:
    """'epoch' -> None (at each epoch's end), else a positive whole number of ``unit``."""
    if text == "epoch":
        return None
    try:
        count = int(text)
    except ValueError:
        count = 0
    if count < 1:
        raise ConfigError(f"{flag} must be a positive number of {unit} or 'epoch', got '{text}'")
    return count


def checkpoint_interval(text: str) -> int | None:
    return parse_every(text, "--checkpoint-every", "samples")


def for_resume(run_dir: str | Path, overrides: dict[str, Any]) -> RunConfig:
    """The configuration of the run saved in ``run_dir``, with ``overrides`` (e.g. a new --epochs) on top.

    It writes back into ``run_dir`` unless ``overrides`` names another ``out``.
    """
    run_dir = Path(run_dir)
    if not (run_dir / "config.toml").is_file():
        raise ConfigError(f"--resume {run_dir}: not a distsgd run directory (no config.toml)")
    base = load_toml(run_dir / "config.toml")
    changes = {k: v for k, v in overrides.items() if k != "resume"}
    cfg = from_mapping(changes, base, source="the resumed run's settings")
    return cfg.replace(resume=str(run_dir), out=cfg.out if "out" in changes else str(run_dir))


def parse_straggler(text: str) -> tuple[int, float]:
    """'1:3' -> (worker 1, 3x slower)."""
    rank_text, sep, factor_text = text.partition(":")
    try:
        rank, factor = int(rank_text), float(factor_text)
    except ValueError:
        rank, factor = -1, 0.0
    if not sep or rank < 0 or not math.isfinite(factor) or factor < 1:
        raise ConfigError(f"--straggler must be RANK:FACTOR with RANK >= 0 and FACTOR >= 1, got '{text}'")
    return rank, factor
