"""The run configuration: one dataclass, filled from defaults, a TOML file and CLI flags.

Precedence is the usual one: a flag on the command line beats the TOML file, which beats the
defaults below. ``validate`` turns every impossible setting into a one-line ``ConfigError``.
"""

from __future__ import annotations

import dataclasses
import functools
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
LOSSES = ("auto", "cross-entropy", "nll", "mse")
SCHEDULES = ("constant", "step", "cosine")
INITS = ("default", "xavier")
PARTITIONS = ("sharded", "replicated")
BACKENDS = ("gloo", "nccl", "mpi")


def setting(default: Any, help: str, flag: str | None = None, const: Any = None, metavar: str | None = None) -> Any:
    """A RunConfig field with its help text (the CLI's ``--help``) beside it.

    ``const``: the flag's value is optional, and the flag alone means ``const`` (so does ``True``
    in the Python API or a TOML file; ``False`` means unset). ``metavar`` names the value in
    ``--help``.
    """
    return field(default=default, metadata={"help": help, "flag": flag, "const": const, "metavar": metavar})


@dataclass(frozen=True)
class Period:
    """Every ``count`` units (samples, steps), or at each epoch's end when ``count`` is None."""

    count: int | None

    @property
    def each_epoch(self) -> bool:
        return self.count is None


@dataclass(frozen=True)
class Straggler:
    """Worker ``rank`` made ``factor`` times slower (it sleeps (factor - 1) x its step time)."""

    rank: int
    factor: float


@dataclass
class RunConfig:
    """Everything that defines a run. Field names are the CLI flags with ``-`` as ``_``; each field
    carries its help text. Strings with a structure (``checkpoint_every``, ``sync_every``,
    ``straggler``) stay as the user wrote them, for the TOML file, and are parsed once into the
    typed properties below."""

    algo: str = setting("single", "training algorithm (see `distsgd algorithms`); default single")
    workers: int = setting(1, "number of worker processes; default 1")
    dataset: str = setting("fashion-mnist", "mnist, fashion-mnist, kmnist, cifar10, digits, npz:PATH, folder:PATH, "
                                            "or path/file.py:function returning (train, test) torch Datasets; "
                                            "default fashion-mnist")
    data_dir: str | None = setting(None, "folder holding the dataset's files (searched first)")
    model: str = setting("mnist_net", "mnist_net, cifar_net, mlp, logreg, resnet20, or path/file.py:ClassName (runs "
                                      "that file); default mnist_net")
    epochs: int = setting(1, "passes over the training data; default 1")
    max_samples: int | None = setting(None, "stop after this many training samples (all workers together); "
                                            "overrides --epochs")
    batch_size: int = setting(64, "samples per micro-batch per worker; default 64")
    accumulate: int = setting(1, "micro-batches per step (gradient accumulation): a step on K x --batch-size "
                                 "samples; default 1")
    loss: str = setting("auto", "cross-entropy, nll or mse; default auto: cross-entropy for class labels, mse for "
                                "float targets")
    augment: bool = setting(False, "random crop (with padding) and horizontal flip of training images "
                                   "(built-in and folder: image datasets)")
    loader_workers: int = setting(0, "DataLoader processes per worker reading a torch Dataset or folder: images; "
                                     "default 0 (read on the training thread)")
    lr: float | None = setting(None, "learning rate; default 0.01 (diloco with adamw inside: 4e-4, the paper's)")
    momentum: float = setting(0.5, "SGD momentum; default 0.5")
    nesterov: bool = setting(False, "use Nesterov momentum (sgd)")
    optimizer: str = setting("sgd", "sgd, adam or adamw; default sgd")
    weight_decay: float | None = setting(None, "weight decay (L2 for sgd and adam, decoupled for adamw); default 0 "
                                               "(diloco with adamw inside: 0.1, the paper's)")
    schedule: str = setting("constant", "learning-rate schedule: constant, step or cosine; default constant")
    lr_step_epochs: int = setting(1, "step schedule: decay every this many epochs; default 1")
    lr_gamma: float = setting(0.1, "step schedule: multiply the rate by this; default 0.1")
    init: str = setting("default", "default (PyTorch's) or xavier initialisation")
    seed: int = setting(0, "seed for weights and data order; default 0")
    partition: str = setting("sharded", "sharded (disjoint shards) or replicated (every worker sees all data); "
                                        "default sharded")
    eval_every: int | None = setting(None, "evaluate on the test set every this many samples; default: each epoch")
    eval_batch_size: int = setting(1000, "batch size for evaluation; default 1000")
    target_accuracy: float | None = setting(None, "test accuracy (0..1) whose time and samples to reach are recorded")
    target_loss: float | None = setting(None, "test loss whose time and samples to reach are recorded (regression)")
    stop_at_target: bool = setting(False, "stop once --target-accuracy (or --target-loss) is reached")
    threads_per_worker: int | None = setting(None, "torch threads per worker; default max(1, cores // workers)")
    log_every: int = setting(50, "steps between progress events in metrics.jsonl; default 50")
    out: str | None = setting(None, "run directory; default runs/<timestamp>-<algo>")
    overwrite: bool = setting(False, "replace an existing run directory")
    quiet: bool = setting(False, "print nothing but errors")
    tensorboard: str | None = setting(None, "write TensorBoard event files into DIR ({out} is the run directory); "
                                            "the flag alone: <out>/tb", const="{out}/tb", metavar="DIR")
    # Process groups (the multi-process algorithms).
    backend: str = setting("gloo", "torch.distributed backend: gloo (CPU), nccl (GPU) or mpi; default gloo")
    init_method: str | None = setting(None, "process-group rendezvous: env://, tcp://HOST:PORT or file:///PATH; "
                                            "default a free port on 127.0.0.1")
    timeout_s: float = setting(300.0, "seconds before a collective or a silent worker counts as failed; default 300",
                               flag="--timeout")
    # Algorithms' own settings: each is checked by its algorithm's ``check``.
    bucket_mb: float = setting(25.0, "allreduce, ddp: gradient bucket size in MB; default 25 (not with "
                                     "allreduce --compress, nor ddp --compress powersgd on gloo: one bucket)")
    hogwild_lock: bool = setting(False, "hogwild: lock around every update (to compare with lock-free)")
    staleness_lr: bool = setting(False, "asgd, ssp, dcasgd: divide each gradient by its staleness "
                                        "(staleness-aware ASGD)")
    staleness: int = setting(2, "ssp: how many pushes a worker may run ahead of the slowest; default 2")
    dc_lambda: float | None = setting(None, "dcasgd: the compensation strength lambda (lambda0 with --dc-adaptive); "
                                            "default 0.04, adaptive 2")
    dc_adaptive: bool = setting(False, "dcasgd: adaptive lambda0 / sqrt(mean square of gradients) (DC-ASGD-a)")
    sync_every: str | None = setting(None, "local-sgd, diloco: synchronise every H steps, or 'epoch'; default 8 "
                                           "(local-sgd), 500 (diloco)")
    compress: str = setting("none", "allreduce, ddp, local-sgd, diloco: none, fp16 or powersgd[:RANK] (PowerSGD "
                                    "with error feedback, rank 2 by default); default none")
    inner_optimizer: str = setting("adamw", "diloco: the workers' inner optimiser (sgd, adam, adamw) at --lr; "
                                            "default adamw")
    outer_lr: float = setting(0.7, "diloco: the outer SGD's learning rate on the averaged pseudo-gradient; "
                                   "default 0.7")
    outer_momentum: float = setting(0.9, "diloco: the outer SGD's Nesterov momentum; default 0.9")
    warmup_steps: int = setting(0, "local-sgd: synchronous all-reduce steps before going local (post-local SGD); "
                                   "default 0")
    tau: int = setting(8, "easgd: steps between elastic exchanges; default 8")
    alpha: float | None = setting(None, "easgd: elastic strength; default 0.9 / workers")
    easgd_mode: str = setting("sync", "easgd: sync (all-reduce) or async (centre on a parameter server); default sync")
    cluster_size: int = setting(1, "hogwild++: worker processes per cluster; default 1")
    update_delay: int = setting(16, "hogwild++: tau0, local updates per worker the holding cluster makes after its "
                                    "exchange before passing the token on; default 16")
    # Checkpoints.
    checkpoint_every: str | None = setting(None, "save a checkpoint every N samples (all workers) or 'epoch' into "
                                                 "<out>/checkpoint")
    resume: str | None = setting(None, "continue the run saved in DIR (up to the --epochs or --max-samples given now), "
                                       "into DIR or --out")
    restart_workers: int = setting(0, "local runs: start a dead worker again, up to this many times in all "
                                      "(asynchronous algorithms: it rejoins; lockstep ones: the group restarts "
                                      "from the last checkpoint); default 0")
    # Benchmarks.
    straggler: str | None = setting(None, "RANK:FACTOR makes worker RANK FACTOR times slower (it sleeps in "
                                          "proportion to its step time)")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def replace(self, **changes: Any) -> "RunConfig":
        return dataclasses.replace(self, **changes)

    @functools.cached_property
    def checkpoint_period(self) -> Period | None:
        """``--checkpoint-every`` parsed: N samples, each epoch, or None (no checkpoints)."""
        if self.checkpoint_every is None:
            return None
        return parse_period(self.checkpoint_every, "--checkpoint-every", "samples")

    @functools.cached_property
    def sync_period(self) -> Period | None:
        """``--sync-every`` parsed: H steps, or each epoch; None: the algorithm's default."""
        return None if self.sync_every is None else parse_period(self.sync_every, "--sync-every", "steps")

    @property
    def tensorboard_dir(self) -> Path | None:
        """``--tensorboard`` resolved: ``{out}`` stands for the run directory; None: no TensorBoard."""
        if self.tensorboard is None:
            return None
        if "{out}" in self.tensorboard:
            if self.out is None:
                raise ConfigError("--tensorboard without a directory writes into the run directory: "
                                  "give --out (out= in Python) or --tensorboard DIR")
            return Path(self.tensorboard.replace("{out}", self.out))
        return Path(self.tensorboard)

    @functools.cached_property
    def straggler_spec(self) -> Straggler | None:
        return None if self.straggler is None else parse_straggler(self.straggler)


_FIELDS = {f.name: f for f in fields(RunConfig)}


def _coerce(name: str, value: Any) -> Any:
    """Check a TOML or API value against the field's declared type."""
    annotation = str(_FIELDS[name].type)
    const = _FIELDS[name].metadata.get("const")
    if const is not None and isinstance(value, bool):  # an optional-value flag: True means its const
        return const if value else None
    if value is None:
        if "None" in annotation:
            return None
        raise ConfigError(f"setting '{name}' cannot be empty")
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
    for name, value in cfg.to_dict().items():
        if value is not None:
            lines.append(f"{name} = {_toml_value(value)}")
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


# The generic defaults of the settings an algorithm may give defaults of its own (its paper's): a
# setting left unset (None) takes the algorithm's, else this.
GENERIC = {"lr": 0.01, "weight_decay": 0.0}


def with_defaults(cfg: RunConfig, own: dict[str, Any] | None = None) -> RunConfig:
    """``cfg`` with every unset setting of :data:`GENERIC` set: to ``own[name]`` (the algorithm's
    default) if given, else the generic default. What the user set is never changed."""
    changes = {k: (own or {}).get(k, v) for k, v in GENERIC.items() if getattr(cfg, k) is None}
    return cfg.replace(**changes) if changes else cfg


def value(cfg: RunConfig, name: str) -> Any:
    """A setting of :data:`GENERIC`, its generic default if unset (a config built in code)."""
    given = getattr(cfg, name)
    return GENERIC[name] if given is None else given


def validate(cfg: RunConfig) -> RunConfig:
    """Reject impossible settings with one clear line each. The algorithm's own settings are its
    ``check``'s to judge; this knows no algorithm."""

    def need(ok: bool, message: str) -> None:
        if not ok:
            raise ConfigError(message)

    need(cfg.workers >= 1, f"--workers must be at least 1, got {cfg.workers}")
    need(cfg.batch_size >= 1, f"--batch-size must be at least 1, got {cfg.batch_size}")
    need(cfg.epochs >= 1, f"--epochs must be at least 1, got {cfg.epochs}")
    cfg = with_defaults(cfg)
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
    need(cfg.target_loss is None or cfg.target_loss >= 0, f"--target-loss must be >= 0, got {cfg.target_loss}")
    need(not cfg.stop_at_target or cfg.target_accuracy is not None or cfg.target_loss is not None,
         "--stop-at-target needs --target-accuracy or --target-loss")
    need(cfg.loss in LOSSES or cfg.loss.startswith("python:"),
         f"unknown loss '{cfg.loss}' (choose from {', '.join(LOSSES)}, or pass a function as loss= in Python)")
    need(cfg.accumulate >= 1, f"--accumulate must be at least 1 micro-batch, got {cfg.accumulate}")
    need(cfg.loader_workers >= 0, f"--loader-workers must be >= 0, got {cfg.loader_workers}")
    need(cfg.restart_workers >= 0, f"--restart-workers must be >= 0, got {cfg.restart_workers}")
    need(
        cfg.threads_per_worker is None or cfg.threads_per_worker >= 1,
        f"--threads-per-worker must be at least 1, got {cfg.threads_per_worker}",
    )
    need(cfg.log_every >= 1, f"--log-every must be at least 1 step, got {cfg.log_every}")
    need(cfg.backend in BACKENDS, f"unknown backend '{cfg.backend}' (choose from {', '.join(BACKENDS)})")
    need(cfg.timeout_s > 0, f"--timeout must be positive, got {cfg.timeout_s}")
    if cfg.checkpoint_period is not None:
        need(cfg.out is not None, "--checkpoint-every needs a run directory (--out)")
    if cfg.straggler_spec is not None:
        rank = cfg.straggler_spec.rank
        need(rank < cfg.workers, f"--straggler names worker {rank}, but there are only {cfg.workers} workers")
    return cfg


def parse_period(text: str, flag: str, unit: str) -> Period:
    """'epoch' -> each epoch, else a positive whole number of ``unit``."""
    if text == "epoch":
        return Period(None)
    try:
        count = int(text)
    except ValueError:
        count = 0
    if count < 1:
        raise ConfigError(f"{flag} must be a positive number of {unit} or 'epoch', got '{text}'")
    return Period(count)


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


def parse_straggler(text: str) -> Straggler:
    """'1:3' -> worker 1, 3x slower."""
    rank_text, sep, factor_text = text.partition(":")
    try:
        rank, factor = int(rank_text), float(factor_text)
    except ValueError:
        rank, factor = -1, 0.0
    if not sep or rank < 0 or not math.isfinite(factor) or factor < 1:
        raise ConfigError(f"--straggler must be RANK:FACTOR with RANK >= 0 and FACTOR >= 1, got '{text}'")
    return Straggler(rank, factor)
