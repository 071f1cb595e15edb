"""The run configuration: one dataclass, filled from defaults, a TOML file and CLI flags.

Precedence is the usual one: a flag on the command line beats the TOML file, which beats the
defaults below. Each field carries its help and its check; ``resolve`` settles the settings whose
default is the model's or the algorithm's, and ``validate`` turns every impossible setting into a
one-line ``ConfigError``.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import sys
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Callable

from distsgd.errors import ConfigError
from distsgd.options import (
    at_least,
    check_value,
    close_match,
    coerce,
    flag_of,
    names_of,
    not_negative,
    one_of,
    option,
    shown,
)

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on Python 3.10 only
    import tomli as tomllib

OPTIMIZERS = ("sgd", "adam", "adamw")
LOSSES = ("auto", "cross-entropy", "nll", "mse")
SCHEDULES = ("constant", "step", "cosine")
INITS = ("default", "xavier")
PARTITIONS = ("sharded", "replicated")
BACKENDS = ("auto", "gloo", "nccl", "mpi")


setting = option  # a RunConfig field with its help text beside it (see distsgd.options)
EVALS = 5  # evaluations of a run without --eval-every, at the least: few, as a GPT's evaluation is costly
SEEDS = 2**63  # seeds are 0 .. SEEDS - 1: an int64, as torch's generators and JSON readers hold one
TIMEOUT_MAX_S = 7 * 24 * 3600  # a longer wait is a hang (and far longer ones overflow torch's and sockets' clocks)
LOGGERS = ("csv", "tensorboard", "wandb", "mlflow")  # --logger's names (metrics.jsonl is always written with --out)
SAVE_FORMATS = ("pt", "safetensors", "hf")  # --save-format's
STRAGGLER_MAX = 1000  # --straggler's slow-down factor: beyond it a worker's sleep is a hang
FLOAT32_MAX = 3.4028234663852886e38  # a learning rate or decay above it overflows the float32 step


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
    """Everything that defines a run: the common settings, which know no algorithm, and the
    algorithm's own ``options``. Field names are the CLI flags with ``-`` as ``_``; each field
    carries its help text. Strings with a structure (``checkpoint_every``, ``straggler``) stay as
    the user wrote them, for the TOML file, and are parsed once into the typed properties below."""

    algo: str | None = setting(
        None,
        "training algorithm (see `distsgd algorithms`)",
        default_help="single, the baseline (one process); with --workers N > 1, or in a launcher's group of N > 1 processes (torchrun, srun), allreduce",
    )
    workers: int = setting(1, "number of worker processes", check=at_least(1))
    dataset: str | None = setting(
        None,
        "a built-in dataset or a format (--help lists them from data.BUILTIN and data.FORMATS)",
        unset="fashion-mnist",
        default_help="{default} (python-stdlib for --model gpt)",
    )
    data_dir: str | None = setting(None, "folder holding the dataset's files (searched first)")
    model: str = setting(
        "mnist_net", "a built-in model or path/file.py:ClassName (--help lists them from models.BUILTIN)"
    )
    context: int = setting(
        128, "tokens per training sequence of a token dataset (text:, hf:, python-stdlib)", check=at_least(1, " token")
    )
    epochs: int = setting(1, "passes over the training data", check=at_least(1))
    max_samples: int | None = setting(
        None,
        "stop after this many training samples (all workers together; the last step, whole, may go past it); overrides --epochs",
        check=at_least(1),
    )
    batch_size: int = setting(64, "samples per micro-batch per worker", check=at_least(1))
    accumulate: int = setting(
        1,
        "micro-batches per step (gradient accumulation): a step on K x --batch-size samples",
        check=at_least(1, " micro-batch"),
    )
    loss: str = setting(
        "auto",
        "cross-entropy, nll or mse",
        default_help="{default}: cross-entropy for class labels, mse for float targets",
        check=lambda flag, v: (
            None
            if v in LOSSES or v.startswith("python:")
            else f"unknown loss '{v}' (choose from {', '.join(LOSSES)}, or pass a function as loss= in Python)"
        ),
    )
    augment: bool = setting(
        False, "random crop (with padding) and horizontal flip of training images (built-in and folder: image datasets)"
    )
    loader_workers: int = setting(
        0,
        "DataLoader processes per worker reading a torch Dataset or folder: images",
        default_help="{default} (read on the training thread)",
        check=not_negative,
    )
    lr: float | None = setting(
        None,
        "learning rate",
        unset=0.01,
        default_help="{default}, or the algorithm's own where its paper's differs (see `distsgd algorithms`)",
        check=lambda flag, v: (
            None if 0 < v <= FLOAT32_MAX else f"{flag} must be a positive number (at most {FLOAT32_MAX:.4g}), got {v}"
        ),
    )
    momentum: float = setting(
        0.5, "SGD momentum", check=lambda flag, v: None if 0 <= v < 1 else f"{flag} must be in [0, 1), got {v}"
    )
    nesterov: bool = setting(False, "use Nesterov momentum (sgd)")
    optimizer: str | None = setting(
        None,
        "sgd, adam or adamw",
        unset="sgd",
        default_help="{default}, or the model's or algorithm's own (gpt: adamw)",
        check=one_of(OPTIMIZERS, "optimizer"),
    )
    weight_decay: float | None = setting(
        None,
        "weight decay (L2 for sgd and adam, decoupled for adamw)",
        unset=0.0,
        default_help="{default}, or the algorithm's own where its paper's differs (see `distsgd algorithms`)",
        check=lambda flag, v: (
            None if 0 <= v <= FLOAT32_MAX else f"{flag} must be >= 0 (at most {FLOAT32_MAX:.4g}), got {v}"
        ),
    )
    weight_decay_on: str | None = setting(
        None,
        "all (every parameter, as torch's optimisers) or weights (not biases "
        "nor LayerNorm/BatchNorm scales: 1-D parameters)",
        unset="all",
        default_help="{default} (gpt: weights)",
        check=lambda flag, v: None if v in ("all", "weights") else f"{flag} must be all or weights, got '{v}'",
    )
    schedule: str = setting(
        "constant", "learning-rate schedule: constant, step or cosine", check=one_of(SCHEDULES, "schedule")
    )
    lr_step_epochs: int = setting(1, "step schedule: decay every this many epochs", check=at_least(1))
    lr_gamma: float = setting(
        0.1,
        "step schedule: multiply the rate by this",
        check=lambda flag, v: None if 0 < v <= 1 else f"{flag} must be in (0, 1], got {v}",
    )
    lr_warmup_steps: int | None = setting(
        None,
        "steps of linear learning-rate warm-up from 0, before the schedule",
        unset=0,
        default_help="{default} (gpt: 20)",
        check=not_negative,
    )
    clip_grad_norm: float | None = setting(
        None,
        "clip each step's gradient to this global L2 norm (the one the step applies: after the gradient sync; sync-ps: the round's mean)",
        unset=0.0,
        default_help="{default}: none (gpt: 1.0)",
        check=lambda flag, v: None if v >= 0 else f"{flag} must be a positive number (0: off), got {v}",
    )
    init: str = setting(
        "default",
        "default or xavier initialisation",
        default_help="{default} (PyTorch's own)",
        check=one_of(INITS, "init"),
    )
    seed: int = setting(
        0,
        "seed for weights and data order, 0 to 2**63 - 1",
        check=lambda flag, v: None if 0 <= v < SEEDS else f"{flag} must be a whole number from 0 to 2**63 - 1, got {v}",
    )
    partition: str = setting(
        "sharded",
        "sharded (disjoint shards) or replicated (every worker sees all data)",
        check=one_of(PARTITIONS, "partition"),
    )
    eval_every: int | None = setting(
        None,
        "evaluate on the test set every this many samples (all workers)",
        default_help=f"each epoch, or, for a run shorter than {EVALS} epochs, "
        f"{EVALS} times evenly (every planned samples / {EVALS})",
        check=at_least(1, " sample"),
    )
    eval_batch_size: int = setting(1000, "batch size for evaluation", check=at_least(1))
    target_accuracy: float | None = setting(
        None,
        "test accuracy (0..1) whose time and samples to reach are recorded",
        check=lambda flag, v: None if 0 < v <= 1 else f"{flag} must be in (0, 1], got {v}",
    )
    target_loss: float | None = setting(
        None, "test loss whose time and samples to reach are recorded (regression)", check=not_negative
    )
    stop_at_target: bool = setting(False, "stop once --target-accuracy (or --target-loss) is reached")
    # more threads than cores only slows a worker down; torch's pools fail (even crash) with thousands
    threads_per_worker: int | None = setting(
        None,
        "torch threads per worker, at most the cores",
        default_help="the cores other processes leave, shared by the workers: max(1, cores // workers) on an idle machine",
        check=lambda flag, v: (
            None if 1 <= v <= cores() else f"{flag} must be from 1 to the {cores()} cores this process may use, got {v}"
        ),
    )
    log_every: int = setting(50, "steps between progress events in metrics.jsonl", check=at_least(1, " step"))
    out: str | None = setting(None, "run directory", default_help="runs/<timestamp>-<algo>")
    overwrite: bool = setting(False, "replace an existing run directory")
    quiet: bool = setting(False, "print nothing but errors")
    device: str = setting(
        "auto",
        "auto, cpu, cuda or cuda:N: where workers train (worker i of a machine: cuda:(i mod GPUs))",
        default_help="{default}: CUDA where there is one",
    )
    precision: str = setting(
        "fp32",
        "fp32, bf16 or fp16: the forward pass under autocast (bf16 on CPU and GPU; fp16 on GPU, with loss scaling)",
    )
    compile: bool = setting(False, "torch.compile each worker's model (the first steps compile it)")
    cuda_graphs: bool = setting(
        False,
        "capture each worker's step (forward, loss, backward, update) in one CUDA graph and replay it: "
        "single and hogwild on a GPU, for full batches (the last partial batch and evaluations run "
        "eagerly); what a launch-bound model gains",
    )
    tensorboard: str | None = setting(
        None,
        "write TensorBoard event files into DIR ({out} is the run directory); the flag alone: <out>/tb",
        const="{out}/tb",
        metavar="DIR",
    )
    logger: str | None = setting(
        None,
        "more loggers, comma-separated: csv (<out>/metrics.csv, a row per event), tensorboard (as --tensorboard), "
        "wandb (offline unless WANDB_MODE says otherwise: <out>/wandb), mlflow (MLFLOW_TRACKING_URI, else <out>/mlflow.db)",
        metavar="NAMES",
        check=names_of(LOGGERS),
    )
    save_format: str = setting(
        "pt",
        "how the trained model is saved, comma-separated: pt (model.pt), safetensors (model.safetensors, "
        "for Hugging Face tools; pip install 'distsgd[safetensors]'), hf (a transformers model's "
        "save_pretrained folder, <out>/hf, which from_pretrained reads)",
        metavar="FORMATS",
        check=names_of(SAVE_FORMATS),
    )
    # Process groups (the multi-process algorithms).
    backend: str = setting(
        "auto",
        "torch.distributed backend: gloo, nccl or mpi",
        default_help="{default}: nccl when every worker of a machine has a GPU of its own, else gloo",
        check=one_of(BACKENDS, "backend"),
    )
    init_method: str | None = setting(
        None,
        "process-group rendezvous: env://, tcp://HOST:PORT or file:///PATH",
        default_help="a free port on 127.0.0.1",
        check=lambda flag, v: init_method_error(v),
    )
    timeout_s: float = setting(
        300.0,
        "seconds before a collective or a silent worker counts as failed, at most a week (604800)",
        flag="--timeout",
        check=lambda flag, v: (
            None
            if 0 < v <= TIMEOUT_MAX_S
            else f"{flag} must be positive and at most {TIMEOUT_MAX_S} seconds (a week), got {v}"
        ),
    )
    # Checkpoints.
    checkpoint_every: str | None = setting(
        None, "save a checkpoint every N samples (all workers) or 'epoch' into <out>/checkpoint", parse=str
    )
    resume: str | None = setting(
        None, "continue the run saved in DIR (up to the --epochs or --max-samples given now), into DIR or --out"
    )
    restart_workers: int = setting(
        0,
        "local runs: start a dead worker again, up to this many times in all "
        "(asynchronous algorithms: it rejoins; lockstep ones: the group restarts "
        "from the last checkpoint); under torchrun with --min-workers, replacements that join the others",
        check=not_negative,
    )
    min_workers: int | None = setting(
        None,
        "allreduce, ddp, local-sgd, diloco, streaming-diloco, sync easgd (gloo; local runs and under torchrun): train on without a worker that dies while at least this many remain "
        "(no restart: the others regroup, take the most advanced one's state and keep their shards)",
        default_help="--workers: a worker's death stops the run",
        check=at_least(1),
    )
    # Benchmarks.
    straggler: str | None = setting(
        None, "RANK:FACTOR makes worker RANK FACTOR times slower (it sleeps in proportion to its step time)"
    )
    # The algorithm's own options (its Options class in its module), as given; once the run is
    # settled, all of them with their defaults. Not a flag: each option is one (see distsgd.cli).
    options: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def replace(self, **changes: Any) -> "RunConfig":
        return dataclasses.replace(self, **changes)

    @property
    def trains_through(self) -> bool:
        """``--min-workers`` below ``--workers``: the group trains on without a worker it loses."""
        return self.min_workers is not None and self.min_workers < self.workers

    @functools.cached_property
    def checkpoint_period(self) -> Period | None:
        """``--checkpoint-every`` parsed: N samples, each epoch, or None (no checkpoints)."""
        if self.checkpoint_every is None:
            return None
        return parse_period(self.checkpoint_every, "--checkpoint-every", "samples")

    @property
    def tensorboard_dir(self) -> Path | None:
        """``--tensorboard`` resolved (or ``--logger tensorboard``: ``<out>/tb``): ``{out}`` stands
        for the run directory; None: no TensorBoard."""
        if self.tensorboard is None and "tensorboard" in self.loggers:
            return self.replace(tensorboard="{out}/tb").tensorboard_dir
        if self.tensorboard is None:
            return None
        if "{out}" in self.tensorboard:
            if self.out is None:
                raise ConfigError(
                    "--tensorboard without a directory writes into the run directory: "
                    "give --out (out= in Python) or --tensorboard DIR"
                )
            return Path(self.tensorboard.replace("{out}", self.out))
        return Path(self.tensorboard)

    @property
    def loggers(self) -> tuple[str, ...]:
        """``--logger``'s names (none: only metrics.jsonl, and --tensorboard if given)."""
        return tuple(self.logger.split(",")) if self.logger else ()

    @property
    def resumes_in_place(self) -> bool:
        """``--resume DIR`` into ``DIR`` itself (``--out`` the same folder, or not given)."""
        return bool(self.resume and self.out and Path(self.out).resolve() == Path(self.resume).resolve())

    @property
    def save_formats(self) -> tuple[str, ...]:
        return tuple(self.save_format.split(","))

    @functools.cached_property
    def straggler_spec(self) -> Straggler | None:
        return None if self.straggler is None else parse_straggler(self.straggler)


_FIELDS = {f.name: f for f in fields(RunConfig) if f.name != "options"}
# a setting whose flag is not its name (--timeout is timeout_s) is taken by its flag's name too: the
# README's rule, a flag is a key (timeout = 60, train(timeout=60))
_BY_FLAG = {f.metadata["flag"][2:].replace("-", "_"): f.name for f in _FIELDS.values() if f.metadata.get("flag")}


def from_mapping(
    values: dict[str, Any], base: RunConfig | None = None, source: str = "settings", option_names: Any = ()
) -> RunConfig:
    """Build a config from ``values`` (keys may use ``-`` or ``_``) over ``base``. Keys in
    ``option_names`` (every algorithm's options: the caller knows them) go to ``options``, to be
    judged by the run's algorithm; any other key that is no setting is an error."""
    cfg = base or RunConfig()
    changes: dict[str, Any] = {}
    options = dict(cfg.options)
    given: dict[str, str] = {}  # each setting's name: the key that gave it
    for key, value in values.items():
        name = key.replace("-", "_")
        name = name if name in _FIELDS else _BY_FLAG.get(name, name)
        if name in given:  # (timeout and timeout_s, batch-size and batch_size)
            raise ConfigError(f"'{given[name]}' and '{key}' in {source} are one setting: give one")
        given[name] = key
        if name in _FIELDS:
            changes[name] = coerce(_FIELDS[name], value)
        elif name in option_names:
            options[name] = value
        else:
            close = close_match(name, [*_FIELDS, *option_names])
            hint = f" (did you mean '{close}'?)" if close else ""
            raise ConfigError(f"unknown setting '{key}' in {source}{hint}")
    return dataclasses.replace(cfg, **changes, options=options)


def load_toml(path: str | Path, base: RunConfig | None = None, option_names: Any = ()) -> RunConfig:
    """Read a TOML config. Keys are top-level, or under a ``[train]`` table; algorithm options are
    keys like the others (``sync_every = 8``). A run's own ``config.toml`` never chooses where a
    run goes: the :data:`NOT_RECORDED` keys that older versions wrote into it are ignored."""
    path = Path(path)
    try:
        raw = path.read_bytes()
        data = tomllib.loads(raw.decode())
    except FileNotFoundError:
        raise ConfigError(f"config file not found: {path}") from None
    except IsADirectoryError:
        raise ConfigError(f"config file {path} is a directory") from None
    except OSError as exc:
        raise ConfigError(f"cannot read config file {path}: {exc.strerror or exc}") from None
    except UnicodeDecodeError as exc:
        raise ConfigError(f"config file {path} is not UTF-8 text (byte {exc.start}): is it a TOML file?") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config file {path} is not valid TOML: {str(exc).splitlines()[0]}") from None
    if set(data) == {"train"} and isinstance(data["train"], dict):
        data = data["train"]
    if written_by_a_run(raw):
        data = {k: v for k, v in data.items() if k.replace("-", "_") not in NOT_RECORDED}
    return from_mapping(data, base, source=str(path), option_names=option_names)


HEADER = "# distsgd run configuration"  # the first line of every config.toml a run writes
# What a run's config.toml leaves out: where the run went, whether it replaced one, what it resumed,
# whether it printed. They belong to the command that made the run, not to the run: a file that kept
# them re-ran into (or over) its own run, and a resumed run inherited a --quiet it was not given.
NOT_RECORDED = ("out", "overwrite", "resume", "quiet")


def written_by_a_run(head: bytes) -> bool:
    """Whether a config file that begins with ``head`` is one a run wrote (its first line is :data:`HEADER`)."""
    return head.startswith(HEADER.encode())


def to_toml(cfg: RunConfig, rerun: str | None = None, from_python: list[str] | tuple[str, ...] = ()) -> str:
    """The resolved configuration as TOML (settings that are unset, and :data:`NOT_RECORDED`, are
    left out). The header says how to run it again: ``distsgd train --config RERUN`` (``rerun``:
    the file's path as the run was given it; None: no path to name), or, for a run whose pieces
    came from Python (``from_python``: "the data (arrays)", ...), that the file alone cannot."""
    if from_python:
        pieces = ", ".join(from_python[:-1]) + (" and " if len(from_python) > 1 else "") + from_python[-1]
        lines = [
            f"{HEADER} (resolved), of a run made with distsgd.train(): {pieces} came from Python, and this",
            "# file records only their names, so it cannot re-run that run by itself: pass them to",
            "# distsgd.train() again with these settings.",
        ]
    else:
        where = rerun or "config.toml"
        lines = [
            f"{HEADER} (resolved). Re-run with: distsgd train --config {where}",
            "# (the new run goes into a new directory beside this run's, or where --out says)",
        ]
    for name, value in cfg.to_dict().items():
        if name != "options" and name not in NOT_RECORDED and value is not None:
            lines.append(f"{name} = {_toml_value(shown(_FIELDS[name], value))}")
    if cfg.options:
        lines.append(f"# {cfg.algo}'s own options")
        lines += [f"{k} = {_toml_value(v)}" for k, v in cfg.options.items() if v is not None]
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


SETTLED = tuple(f.name for f in fields(RunConfig) if f.metadata.get("unset") is not None)


def resolve(cfg: RunConfig, own: dict[str, Any] | None = None) -> RunConfig:
    """``cfg`` with every setting of :data:`SETTLED` that was left unset (None) set: to ``own[name]``
    (the model's own, tuned for it, or the algorithm's, its paper's) if given, else the field's
    ``unset`` value. What the user set is never changed. ``api.settle`` calls it once per run."""
    changes = {k: (own or {}).get(k, _FIELDS[k].metadata["unset"]) for k in SETTLED if getattr(cfg, k) is None}
    return cfg.replace(**changes) if changes else cfg


def settled(
    cfg: RunConfig, own: dict[str, Any] | None = None, resumed_as: tuple[Any, ...] | None = None, **given: Any
) -> RunConfig:
    """``cfg`` with ``given`` (what the run settled: its algorithm, its complete options, a restart's
    resume) and every unset setting resolved (:func:`resolve`), validated (:func:`validate`) and,
    where it resumes a run, held against the settings that run recorded
    (:func:`check_resume_settings`; ``resumed_as``: the algorithm's Options class, every
    algorithm's option names, to read its config.toml, and its checkpoint's manifest): what a run uses."""
    cfg = resolve(cfg.replace(**given), own)
    if cfg.resume and resumed_as is not None:
        check_resume_settings(cfg.resume, cfg, *resumed_as)
    validate(cfg)
    return cfg


def validate(cfg: RunConfig) -> None:
    """Reject impossible settings with one clear line each: each field's own check (beside it in
    :class:`RunConfig`), then those between settings. The algorithm's own settings are its
    ``check``'s to judge; this knows no algorithm."""
    for name, f in _FIELDS.items():  # inf and nan mean nothing for any setting (and TOML cannot record them)
        given = getattr(cfg, name)
        if isinstance(given, float) and not math.isfinite(given):
            raise ConfigError(f"{flag_of(f)} must be a finite number, got {given}")
    for name, f in _FIELDS.items():
        check_value(f, getattr(cfg, name))
    if cfg.nesterov and cfg.momentum <= 0:
        raise ConfigError("--nesterov needs a --momentum above 0")
    if cfg.target_accuracy is not None and cfg.target_loss is not None:  # (before, the loss's went unheeded)
        raise ConfigError(
            f"--target-accuracy {cfg.target_accuracy:g} and --target-loss {cfg.target_loss:g}: a run times one "
            "target; give one of them"
        )
    if cfg.stop_at_target and cfg.target_accuracy is None and cfg.target_loss is None:
        raise ConfigError("--stop-at-target needs --target-accuracy or --target-loss")
    for flag, path in (("--out", cfg.out), ("--resume", cfg.resume)):
        if path is not None and not str(path).strip():  # (an empty --out saved nothing, and said nothing)
            raise ConfigError(f"{flag} '{path}' names no directory: give a path, or leave {flag} out")
    if cfg.checkpoint_period is not None and cfg.out is None:
        raise ConfigError("--checkpoint-every needs a run directory (--out)")
    for name, where in (
        ("csv", "<out>/metrics.csv"),
        ("wandb", "its run folder in <out>/wandb"),
        ("mlflow", "<out>/mlflow.db"),
    ):
        if name in cfg.loggers and cfg.out is None:
            raise ConfigError(f"--logger {name} writes {where}: give a run directory (--out; out= in Python)")
    if cfg.min_workers is not None and cfg.min_workers > cfg.workers > 1:  # (--workers 1: torchrun's may say more)
        raise ConfigError(f"--min-workers {cfg.min_workers} is more than --workers {cfg.workers}")
    if cfg.straggler_spec is not None and cfg.straggler_spec.rank >= cfg.workers:
        raise ConfigError(
            f"--straggler names worker {cfg.straggler_spec.rank}, but there are only {cfg.workers} workers"
        )


def init_method_error(init_method: str) -> str | None:
    """What is wrong with an ``--init-method`` (env://, file:///PATH, or tcp://HOST:PORT with a port
    a worker can dial, or a file store's path that torch's FileStore can use), or None."""
    if init_method.startswith("env://"):
        return None
    if init_method.startswith("file://"):
        return _file_store_error(init_method)
    host, _, port = init_method[len("tcp://") :].rpartition(":")
    if not init_method.startswith("tcp://") or not host:
        return f"--init-method must be env://, tcp://HOST:PORT or file:///PATH, got '{init_method}'"
    if not port.isdigit() or not 1 <= int(port) <= 65535:
        return f"--init-method {init_method}: the port must be a number from 1 to 65535, got '{port}'"
    return None


def _file_store_error(init_method: str) -> str | None:
    """torch's FileStore retries its open for ever where the folder is missing, and waits on a file
    that holds an earlier store's data (a run that was killed leaves it): neither ever fails."""
    path = Path(init_method[len("file://") :])
    if not path.is_absolute():
        return f"--init-method {init_method}: give an absolute path, file:///PATH"
    if not path.parent.is_dir():
        return f"--init-method {init_method}: the folder {path.parent} does not exist"
    if path.is_dir():
        return f"--init-method {init_method}: {path} is a folder; name a file in it"
    if path.is_file() and path.stat().st_size > 0:
        return (
            f"--init-method {init_method}: {path} holds {path.stat().st_size} bytes already (an earlier "
            f"run's file store, left by a run that was stopped, or another file): name a new file, or remove it"
        )
    return None


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


def for_resume(
    run_dir: str | Path, overrides: dict[str, Any], option_names: Any = (), options_of: Any = None
) -> RunConfig:
    """The configuration of the run saved in ``run_dir``, with ``overrides`` (e.g. a new --epochs) on top.

    It writes back into ``run_dir`` unless ``overrides`` names another ``out``.
    """
    if isinstance(run_dir, bool) or not isinstance(run_dir, (str, os.PathLike)):
        raise ConfigError(f"setting 'resume' must be a run directory's path, got {run_dir!r}")
    run_dir = Path(run_dir)
    if not (run_dir / "config.toml").is_file():
        raise ConfigError(f"--resume {run_dir}: not a distsgd run directory (no config.toml)")
    base = load_toml(run_dir / "config.toml", option_names=option_names)
    changes = {k: v for k, v in overrides.items() if k != "resume"}
    if changes.get("epochs") is not None and changes.get("max_samples") is None:
        # a new --epochs is the budget asked for now: the saved --max-samples (which overrides
        # --epochs) would ignore it, silently
        base = base.replace(max_samples=None)
    cfg = from_mapping(changes, base, source="the resumed run's settings", option_names=option_names)
    if options_of is not None:  # the saved options the run's algorithm takes (older versions recorded every
        taken = set(options_of(cfg))  # algorithm's); those given now are all kept, to be judged
        given = {k.replace("-", "_") for k in changes}
        cfg = cfg.replace(options={k: v for k, v in cfg.options.items() if k in taken or k in given})
    return cfg.replace(resume=str(run_dir), out=cfg.out if "out" in changes else str(run_dir))


# The settings a checkpoint's state depends on, besides the algorithm and the workers (which its
# manifest records), each with what of it matters: the model's shapes (model, dataset, context),
# the optimiser's state and its parameter groups (optimizer, weight_decay_on), fp16's loss scaler
# (bf16 and fp32 keep no state), what the loop's counters mean (partition: an epoch's length). A
# resume that changes one would load a state that does not fit, or fits and means something else;
# so would one that changes the algorithm's own options.
def _itself(value: Any) -> object:
    return value


RESUME_FIXED: dict[str, Callable[[Any], object]] = {
    "model": _itself,
    "dataset": _itself,
    "context": _itself,
    "optimizer": _itself,
    "weight_decay_on": _itself,
    "precision": lambda p: p == "fp16",
    "partition": _itself,
    "seed": _itself,  # each epoch's order of the data: the rest of the epoch would be another order's
}


def checkpoint_record(cfg: RunConfig, data: Any = None) -> dict[str, Any]:
    """What a checkpoint's manifest records of the settings its state depends on (the algorithm,
    the settings of :data:`RESUME_FIXED` and the algorithm's options), so that a resume is held
    against the checkpoint itself, not the run's config.toml, which a hand may have edited since;
    and ``data``'s training samples, where known (its positions in an epoch index them)."""
    fixed = {name: getattr(cfg, name) for name in RESUME_FIXED}
    n_train = getattr(data, "n_train", None)
    sized = {"n_train": n_train} if isinstance(n_train, int) and n_train > 0 else {}
    return {"algo": cfg.algo, "settings": fixed, "options": dict(cfg.options), **sized}


def check_resume_settings(
    run_dir: str | Path,
    cfg: RunConfig,
    options_cls: Any,
    option_names: Any = (),
    manifest: dict[str, Any] | None = None,
) -> None:
    """Raise a ConfigError naming the first setting of :data:`RESUME_FIXED`, or option of
    ``options_cls`` (the run's algorithm's Options; where the run was another algorithm's, its
    manifest's check says so instead), that the settled ``cfg`` gives otherwise than the
    checkpoint was written with: as its ``manifest`` records (:func:`checkpoint_record`), else
    (older checkpoints) as the run in ``run_dir`` recorded in its config.toml (a resume rewrites
    that file only once it passed this check). Nothing recorded: nothing to compare (the
    checkpoint's own checks still hold)."""
    path = Path(run_dir) / "config.toml"
    toml = load_toml(path, option_names=option_names) if path.is_file() else None
    kept = (manifest or {}).get("settings")
    if isinstance(kept, dict):
        fixed, kept_options = kept, (manifest or {}).get("options") or {}
    elif toml is not None:
        fixed, kept_options = {name: getattr(toml, name) for name in RESUME_FIXED}, toml.options
    else:
        return
    own = set(options_cls.names())
    recorded = options_cls.from_mapping({k: v for k, v in kept_options.items() if k in own}).to_mapping()
    said = {name: getattr(toml, name) for name in RESUME_FIXED} if toml is not None else {}
    said_options = toml.options if toml is not None else {}
    pairs = [
        (flag_of(_FIELDS[name]), fixed.get(name), getattr(cfg, name), key, said.get(name), False)
        for name, key in RESUME_FIXED.items()
    ]
    algo = (manifest or {}).get("algo", toml.algo if toml is not None else None)
    if algo in (None, cfg.algo):  # (another algorithm's run: the manifest's check names the algorithm)
        # an option is compared also where one side is its default (None: "auto", as --alpha's 0.9 / N):
        # a value given now for one left to its default then is a change too
        pairs += [
            ("--" + k.replace("_", "-"), recorded[k], v, _same, said_options.get(k), True)
            for k, v in cfg.options.items()
            if k in recorded
        ]
    for flag, before, now, key, in_toml, strict in pairs:
        if (strict or before is not None and now is not None) and key(before) != key(now):
            leave_out = f" (or leave {flag} out)" if in_toml is not None and key(in_toml) == key(before) else ""
            edited = (
                f" (its config.toml says {_shown(in_toml)}: edited since)"
                if in_toml is not None and key(in_toml) != key(before)
                else ""
            )
            written = f"with {flag} {_shown(before)}" if before is not None else f"with {flag} at its default"
            again = f"with {flag} {_shown(before)}{leave_out}" if before is not None else f"without {flag}"
            raise ConfigError(
                f"--resume {run_dir}: its checkpoint was written {written}, not {_shown(now)}{edited}, and "
                f"its state depends on it: resume {again}, or train afresh into another --out"
            )


def _same(value: Any) -> object:
    """An option's value as a comparison sees it: a list and a tuple of the same items alike (a
    manifest records in JSON)."""
    return list(value) if isinstance(value, (list, tuple)) else value


def _shown(value: Any) -> str:
    """A setting's value as a flag takes it (``true``, ``0.5``, ``mlp``)."""
    return "true" if value is True else "false" if value is False else "its default" if value is None else str(value)


def parse_straggler(text: str) -> Straggler:
    """'1:3' -> worker 1, 3x slower."""
    rank_text, sep, factor_text = text.partition(":")
    try:
        rank, factor = int(rank_text), float(factor_text)
    except ValueError:
        rank, factor = -1, 0.0
    if not sep or rank < 0 or not 1 <= factor <= STRAGGLER_MAX:  # a nan factor fails the comparison too
        raise ConfigError(
            f"--straggler must be RANK:FACTOR with RANK >= 0 and FACTOR from 1 to {STRAGGLER_MAX}, got '{text}'"
        )
    return Straggler(rank, factor)
