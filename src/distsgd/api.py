"""The Python API and the one place a run is put together.

``train()`` and ``spawn()`` are what Python users call; the CLI builds a :class:`RunConfig` and
calls ``run()``. All: settle the settings, load the data once, check that the model fits it (before
any process starts), launch the algorithm's workers, then write ``model.pt`` and ``summary.json``
(what the run reports, :class:`TrainResult` and the summary, is :mod:`distsgd.results`).
"""

from __future__ import annotations

import contextlib
import copy
import datetime as _dt
import fcntl
import functools
import itertools
import json
import logging
import os
import sys
import time
import types
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any, Callable, ParamSpec, TypeVar

import torch
from torch import nn

from distsgd import config as config_mod
from distsgd import launch, rundir
from distsgd.algorithms import registry
from distsgd.algorithms.base import Algorithm
from distsgd.callbacks import CallbackSink
from distsgd.callbacks import adopt as adopt_callbacks
from distsgd.callbacks import checked as checked_callbacks
from distsgd.callbacks import sent as sent_callbacks
from distsgd.callbacks import started as callbacks_started
from distsgd.checkpoint import (
    atomic_write_bytes,
    read_manifest,
    remove_uncommitted,
    require_safetensors,
    save_run,
    usable_checkpoint,
)
from distsgd.config import RunConfig, settled
from distsgd.data import Dataset, TrainingData, from_arrays, from_hf, from_hf_stream, load_dataset, text
from distsgd.data.partition import samples_per_epoch
from distsgd.data.torchdata import STREAM_REPLICATED, TorchData, is_map_dataset, is_stream
from distsgd.errors import (
    STOP,
    CheckpointError,
    ConfigError,
    DataError,
    DistsgdError,
    LoopError,
    MainGuardError,
    OutputError,
    PeerFailed,
    ended_by_sigterm_within,
    on_sigterm,
    one_line,
)
from distsgd.launch import cores, environment, procs
from distsgd.launch.environment import launched
from distsgd.launch.rendezvous import group_host, place
from distsgd.metrics import (
    Fanout,
    Sink,
    close_sinks,
    logged_evals,
    make_progress,
    open_sinks,
    require_extras,
)
from distsgd.models import ModelSpec, build_model, check_fits, describe, recommended_settings
from distsgd.results import (
    OWN_LOOP_DATA,
    TrainResult,
    build_summary,
    checkpoints_whole,
    evaluate_checkpoint,
    own_final_figures,
)
from distsgd.train import device
from distsgd.train.context import ENDED_HERE, Job
from distsgd.train.graphs import graphs_refusal
from distsgd.train.loop import check_saved
from distsgd.train.objective import loss_function
from distsgd.train.optim import schedule_needs_epochs

LOCAL_NAMES = ("127.0.0.1", "localhost", "::1")
# How long a rank that stopped because a peer failed waits for torchrun's agent to end it, so that
# the agent names the rank that failed as the root cause (it names the first to exit: the peer's
# closed connection often ended this rank first, and torchrun blamed rank 0 for rank 1's error)
PEER_WAIT_S = 5.0

log = logging.getLogger(__name__)


class _CopyOf:
    """A picklable factory that returns a copy of a model instance the user passed."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module
        self.__qualname__ = type(module).__name__

    def __call__(self) -> nn.Module:
        return copy.deepcopy(self.module)


_P = ParamSpec("_P")
_R = TypeVar("_R")


def _user_facing(entry: Callable[_P, _R]) -> Callable[_P, _R]:
    """``entry`` (train, spawn), as a script meets its errors:

    - ending the script in one ``error:`` line, exit status 2, when the script calls it at module
      level without ``if __name__ == "__main__":``. Only such a call raises :class:`MainGuardError`
      (a worker importing the script again reached it), so the script cannot run as written;
      raised out of its module-level code the error would be a traceback of thirty lines through
      distsgd's launcher, for a one-line fix.
    - a :class:`LoopError` (the script's own ``main`` failed in a worker) raised from here, with
      the traceback of the script's own code as its cause where this process ran it (a rank of
      torchrun's group): not through the launcher's frames, 25 lines that said nothing of the
      error, whose line the message names."""

    @functools.wraps(entry)
    def entered(*args: _P.args, **kwargs: _P.kwargs) -> _R:
        try:
            return entry(*args, **kwargs)
        except MainGuardError as exc:
            sys.stderr.write(f"error: {one_line(exc)}\n")
            sys.stderr.flush()
            raise SystemExit(exc.exit_code) from None
        except LoopError as exc:
            raise exc.with_traceback(None) from exc.__cause__
        except DistsgdError as exc:  # distsgd's refusal, whole in its message: the script's frames only
            raise exc.with_traceback(_without_ours(exc.__traceback__)) from exc.__cause__

    return entered


_OURS = (str(Path(__file__).resolve().parent) + os.sep, str(Path(contextlib.__file__).resolve().parent) + os.sep)


def _without_ours(tb: types.TracebackType | None) -> types.TracebackType | None:
    """The traceback ``tb`` without distsgd's frames and the Python library's between them: what is
    left is the script's (its ``main``'s lines where the refusal came from inside it). Under
    torchrun each rank printed 40 lines through the launcher for one refusal (an audit's,
    2026-12-01)."""
    kept = []
    while tb is not None:
        name = tb.tb_frame.f_code.co_filename
        if not name.startswith(_OURS) or "-packages" + os.sep in name[len(_OURS[1]) :]:  # (an install's packages: kept)
            kept.append(tb)
        tb = tb.tb_next
    rebuilt = None
    for t in reversed(kept):
        rebuilt = types.TracebackType(rebuilt, t.tb_frame, t.tb_lasti, t.tb_lineno)
    return rebuilt


@_user_facing
def train(
    model: ModelSpec | nn.Module | None = None,
    data: Any = None,
    algo: str | None = None,
    workers: int | None = None,
    *,
    loss: str | Callable | None = None,
    optimizer: Callable | None = None,
    param_groups: Callable | None = None,
    callbacks: Iterable[Any] = (),
    **settings: Any,
) -> TrainResult:
    """Train ``model`` on ``data`` with ``algo`` and ``workers``; return the summary and the model.

    ``model``: a built-in name (see :data:`distsgd.models.BUILTIN`: ``mnist_net``, ``gpt``, ...), a
    ``path/file.py:Class`` string, an ``nn.Module`` class or factory, or a module instance (copied).
    ``data``: a dataset name (see ``distsgd datasets``), ``(train, test)`` torch Datasets, a
    :class:`~distsgd.data.Dataset`, or arrays ``(x, y)`` / ``(x, y, x_test, y_test)`` / a dict.
    ``loss``: ``"cross-entropy"``, ``"nll"``, ``"mse"`` or a function ``loss(output, target)``.
    ``optimizer``: ``"sgd"``, ``"adam"``, ``"adamw"`` or a function ``optimizer(model) -> torch.optim.Optimizer``; ``param_groups``: a
    function ``param_groups(model) -> [{"params": [...], "lr": ...}, ...]`` for ``--optimizer``.
    Functions must be defined at module level (they travel to worker processes). ``callbacks``:
    objects with ``on_eval(event)`` (True stops the run there), ``on_checkpoint(event)``,
    ``on_end(summary)``, e.g. :class:`distsgd.EarlyStopping` (see :mod:`distsgd.callbacks`).
    ``settings``: any :class:`~distsgd.config.RunConfig` field, e.g. ``epochs=2, lr=0.05``.
    Files are written only when ``out=`` is given. Progress is shown unless ``quiet=True``.
    ``resume="runs/x"`` continues the run saved there (with e.g. a new ``epochs=``); defaults are
    then the saved run's settings.
    """
    procs.refuse_if_importing_main()  # a worker importing a script that trains at module level
    given = {k: v for k, v in (("algo", algo), ("workers", workers)) if v is not None}
    if isinstance(optimizer, str):  # the --optimizer setting, not a factory
        given["optimizer"], optimizer = optimizer, None
    if isinstance(loss, str):
        given["loss"] = loss
    elif loss is not None:
        given["loss"] = f"python:{describe(loss)}"
    options = registry.option_names()
    if settings.get("resume"):
        cfg = config_mod.for_resume(
            settings["resume"], {**given, **settings}, option_names=options, options_of=registry.own_options
        )
    else:
        cfg = config_mod.from_mapping({**given, **settings}, RunConfig(), source="train()", option_names=options)
    model = model if model is not None else cfg.model
    data = data if data is not None else cfg.dataset
    dataset = None
    if data is None or isinstance(data, str):  # None: the model's default dataset, once the settings are settled
        cfg = cfg.replace(dataset=data)
    else:
        dataset = _dataset_from(data, cfg.context)
        cfg = cfg.replace(dataset=dataset.name)
    if isinstance(model, nn.Module):
        model = _CopyOf(model)
    cfg = cfg.replace(model=model if isinstance(model, str) else describe(model))
    return run(
        cfg,
        model_spec=model,
        dataset=dataset,
        code={
            "loss": None if isinstance(loss, str) else loss,
            "optimizer": optimizer,
            "param_groups": param_groups,
            "callbacks": checked_callbacks(callbacks),
        },
    )


def _dataset_from(data: Any, context: int) -> TrainingData:
    if isinstance(data, (Dataset, TorchData)):
        return data
    if text.is_hf_stream(data) or (
        isinstance(data, (tuple, list)) and len(data) == 2 and all(text.is_hf_stream(d) for d in data)
    ):  # load_dataset(..., streaming=True): its splits, or (train, test) streams, of token ids or text
        return from_hf_stream(data, context)
    if text.is_hf_dataset(data):  # a Hugging Face datasets.Dataset (or DatasetDict) of token ids or text
        return from_hf(data, context)
    if isinstance(data, (tuple, list)) and len(data) == 2 and all(text.is_hf_dataset(d) for d in data):
        return from_hf({"train": data[0], "test": data[1]}, context)  # (train, test) Datasets: its two splits
    if isinstance(data, (tuple, list)) and len(data) == 2 and all(is_map_dataset(d) or is_stream(d) for d in data):
        return TorchData(data[0], data[1], name="dataset")  # a stream (IterableDataset) is split as it is read
    if isinstance(data, dict):
        keys = ("x", "y", "x_test", "y_test")
        unknown = set(data) - set(keys)
        if unknown:
            raise DataError(f"unknown data keys {sorted(unknown)} (use x, y, x_test, y_test)")
        if "x" not in data or "y" not in data:
            raise DataError(f"a dict of arrays needs 'x' and 'y' (and may have x_test, y_test); got {sorted(data)}")
        return from_arrays("arrays", data["x"], data["y"], data.get("x_test"), data.get("y_test"))
    if isinstance(data, (tuple, list)) and len(data) in (2, 4):
        return from_arrays("arrays", *data)
    raise DataError(
        "data must be a dataset name, (train, test) torch Datasets, a distsgd Dataset, a Hugging Face "
        "datasets.Dataset, (x, y), (x, y, x_test, y_test) or a dict of arrays"
    )


def default_out(algo: str, beside: Path | None = None) -> Path:
    """``runs/<timestamp>-<algo>`` (``-2``, ``-3``, ... after it where that exists); where the
    launcher names the run, its name: in an srun step ``runs/slurm-<job>.<step>-<algo>``, in a
    Kubeflow PyTorchJob ``runs/kubeflow-<job>-<algo>``, under torchrun ``runs/torchrun-<rdzv id>-<algo>``,
    the same in every rank and when it is started again; with ``beside`` (a run directory), in the
    folder that holds it."""
    where = environment.detect()
    stamp = where.run_name or _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    folder = Path("runs") if beside is None else Path(os.path.relpath(beside.resolve().parent))
    out, again = folder / f"{stamp}-{algo}", 2
    # a second run started here in the same second: <timestamp>-<algo>-2 (a launcher's ranks each
    # name the run themselves: they keep the one name)
    while not where.launched and out.exists():
        out, again = folder / f"{stamp}-{algo}-{again}", again + 1
    return out


def run(
    cfg: RunConfig,
    model_spec: ModelSpec | None = None,
    dataset: TrainingData | None = None,
    progress: Sink | None = None,
    code: dict[str, Any] | None = None,
    evaluate: Callable | None = None,
    fresh: bool = False,
) -> TrainResult:
    """Run one training job as configured. ``code``: the user's ``loss``, ``optimizer`` and
    ``param_groups`` functions, if any. ``fresh``: this process has done nothing yet but import
    and read its settings (the command), so its workers' fork server is forked from it
    (:func:`~distsgd.launch.procs.prefork_server`). Raises DistsgdError subclasses for user
    mistakes, and :class:`~distsgd.errors.Terminated` (a KeyboardInterrupt) when SIGTERM or SIGUSR1
    stopped it."""
    restore = _stop_on_signals()
    try:
        # who this process is, detected once: its own launcher, or a rank of a launcher's group
        with environment.using(environment.detect()) as where:
            try:
                with _resume_lock(cfg):
                    return _run(cfg, model_spec, dataset, progress, code, evaluate, fresh)
            except PeerFailed:
                if where.agent_ends_ranks:  # let it name the rank that failed: it ends this one first
                    ended_by_sigterm_within(PEER_WAIT_S, asked=STOP.requested is not None)
                raise
    finally:
        restore()


def _stop_on_signals() -> Callable[[], None]:
    """A run started from Python (``distsgd.train``, ``distsgd.spawn``) stops on SIGTERM (SIGUSR1)
    as the command's does: a lockstep run's workers at their next step with a final checkpoint,
    an asynchronous run's coordinator with its own, every clean-up done; then the caller gets
    :class:`~distsgd.errors.Terminated`. Only where this process left both signals at their
    default, which ends it at once (the command installs its own handler; a script's is kept),
    and in its main thread. Returns what puts the default back."""
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread() or any(
        signal.getsignal(s) is not signal.SIG_DFL for s in (signal.SIGTERM, signal.SIGUSR1)
    ):
        return lambda: None
    return on_sigterm()


def _check_writable_dir(path: Path | None, flag: str) -> None:
    """``path`` (a directory to be made) lies under no file: one line now, before anything is made."""
    if path is not None:
        on = next((p for p in (path, *path.parents) if p.exists()), None)
        if on is not None and not on.is_dir():
            raise ConfigError(f"{flag} {path}: {on} is a file, not a directory")


@contextlib.contextmanager
def _resume_lock(cfg: RunConfig) -> Iterator[None]:
    """A run resumed in place holds its run directory's lock (an exclusive ``flock`` of its marker)
    from before it picks the checkpoint to its end: a second resume of it meanwhile is refused in
    one line. Until 2026-12-01 two at once each rotated the other's checkpoints, and the one that
    failed left its config.toml beside the other's model (an audit's). Not under torchrun, whose
    ranks resume one run together."""
    run_dir = Path(cfg.resume) if cfg.resume else None
    in_place = run_dir is not None and (cfg.out is None or Path(cfg.out).resolve() == run_dir.resolve())
    if run_dir is None or not in_place or launched() or not (run_dir / rundir.MARKER).is_file():
        yield
        return
    fd = os.open(run_dir / rundir.MARKER, os.O_RDONLY)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise ConfigError(
                f"--resume {cfg.resume}: another distsgd run is training in it now (it holds the run directory's "
                f"lock): wait for it to end"
            ) from None
        except OSError:  # a file system without locks (some network mounts): resumed unguarded, as before
            pass
        yield
    finally:
        os.close(fd)  # (the lock goes with it)


def _run(
    cfg: RunConfig,
    model_spec: ModelSpec | None,
    dataset: TrainingData | None,
    progress: Sink | None,
    code: dict[str, Any] | None,
    evaluate: Callable | None,
    fresh: bool,
) -> TrainResult:
    where = environment.current()
    if where.launched:
        where.adopt(os.environ)  # torchrun's variables (an srun task's, a Kubeflow pod's local ones)
    torchrun = launched()  # one rank of a group torchrun, SLURM, Kubeflow or Ray Train formed
    cfg, algo_cls = settle(cfg, torchrun, where)
    chief = not torchrun or place()[0] == 0
    tb_dir = cfg.tensorboard_dir if chief else None  # the reporting process alone writes events
    require_extras(cfg.loggers, tb_dir is not None)  # before any data is read or any process starts
    _check_writable_dir(tb_dir, "--tensorboard")  # (found once the run directory was made, a rerun then met it)
    if "safetensors" in cfg.save_formats:
        require_safetensors()
    keeps = torchrun and cfg.trains_through and not algo_cls.topology.spawns(torchrun)  # (launch.keepers)
    # a rank that keeps a worker forks its server only where it logs as its worker must, to errors
    # (distsgd._early: a rank that trains keeps torch's C++ warnings, a server forked would pass them on)
    if fresh and (algo_cls.topology.spawns(torchrun) or (keeps and os.environ.get("TORCH_CPP_LOG_LEVEL") == "ERROR")):
        procs.prefork_server()  # before any data is read: it imports the rest meanwhile
    spec: ModelSpec = model_spec if model_spec is not None else cfg.model
    started = time.time()
    started_at = _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")
    dataset_given = dataset is not None
    first_look = None if torchrun else cores.look(procs.forked_server())  # how busy the cores are, while the data loads
    if dataset is None:
        assert cfg.dataset is not None  # settle resolved it
        _data_given_again(cfg)
        dataset = load_dataset(cfg.dataset, cfg.data_dir, context=cfg.context)
    dataset = dataset.options(augment=cfg.augment, loader_workers=cfg.loader_workers)
    job = Job(cfg, spec, dataset, **(code or {}))
    probe = _check_own(job, algo_cls, torchrun) if job.main is not None else _check_job(job, algo_cls, torchrun)
    if "hf" in cfg.save_formats and not callable(getattr(probe, "save_pretrained", None)):
        raise ConfigError(
            f"--save-format hf is a Hugging Face transformers model's save_pretrained folder, and "
            f"{describe(spec)} has no save_pretrained: save it as pt or safetensors"
        )
    job = _resumed(job, probe, dataset.n_train, torchrun)
    rerun = str(Path(cfg.out) / "config.toml") if cfg.out else None
    settings_text = config_mod.to_toml(cfg, rerun, _from_python(spec, dataset if dataset_given else None, code))
    out = _prepare_out(cfg, settings_text, where) if cfg.out and chief else None
    if progress is None:
        planned = (
            cfg.max_samples or cfg.epochs * samples_per_epoch(dataset.n_train, cfg.workers, cfg.partition)
            if dataset.n_train
            else cfg.max_samples
        )
        progress = make_progress(cfg.quiet or not chief, planned, f"{cfg.algo} x{cfg.workers}")
    logged = logged_evals(out / "metrics.jsonl") if out is not None and cfg.resumes_in_place else frozenset()
    sinks = _sinks(job, out, tb_dir, started, settings_text, chief) + [progress]
    try:
        # the threads the other processes leave to this machine's workers
        with cores.chosen(cfg, first_look, where.local_world_size if torchrun else cfg.workers):
            given = None if torchrun else sent_callbacks(job.callbacks)  # (under torchrun rank 0 runs these objects)
            results = launch.run(job, algo_cls, Fanout(*sinks, logged=logged), torchrun)
            adopt_callbacks(job.callbacks, [r.callbacks for r in results], given)
            if job.main is not None and chief:
                checkpoints_whole(results)
                own_final_figures(job, algo_cls, results, Fanout(*sinks, logged=logged), evaluate)
            summary = build_summary(cfg, dataset, spec, results, started, started_at)
        for sink in sinks:
            if hasattr(sink, "write_summary"):
                sink.write_summary(summary)
    finally:
        unclosed = close_sinks(sinks)  # raised once the model is saved (when nothing else is on its way)
        if out is not None and not torchrun:  # every worker has stopped: what no manifest names is of no use
            remove_uncommitted(out)
    if out is not None:
        model = results[0].model
        assert model is not None  # the chief's result (out is the chief's) holds the model it returns
        python = [what for what, given in (("data", dataset_given), ("model", not isinstance(spec, str))) if given]
        save_run(out, model, cfg, dataset, summary, python)
    if unclosed is not None:
        raise unclosed
    return TrainResult(summary, results[0].model if chief else None, out)  # in a launcher's group: rank 0's


def _resumed(job: Job, probe: nn.Module, n_train: int | None, torchrun: bool) -> Job:
    """A resumed run's job: its checkpoint picked (locally); the callbacks' ``on_start`` called with
    the evaluations up to it (none in a fresh run), before they travel to the workers."""
    cfg = job.cfg
    if not cfg.resume:
        callbacks_started(job.callbacks)
        return job
    own = job.main is not None
    if not torchrun:
        job = job.replace(resume_from=_pick_checkpoint(cfg, probe, n_train, own))
    else:  # each rank, on the manifest as it is, which each reads (until 2026-12-01 none of these checks ran)
        manifest = read_manifest(Path(cfg.resume))
        if manifest is not None:
            _resumable(cfg, manifest, n_train, own)
    at = job.resume_from if job.resume_from is not None else read_manifest(Path(cfg.resume))
    callbacks_started(job.callbacks, Path(cfg.resume), (at or {}).get("samples"))
    return job


def _pick_checkpoint(cfg: RunConfig, probe: nn.Module, n_train: int | None, own: bool) -> dict[str, Any]:
    """Locally the launcher picks the checkpoint before any worker reads it (falling back to the one
    before a damaged newest one) and checks its files, before the run writes anything: its manifest,
    which the workers then read from (Job.resume_from). Under torchrun every rank reads the manifest
    as it is, and checks its own file as it loads it."""
    assert cfg.resume is not None
    in_place = cfg.resumes_in_place
    if cfg.out is not None and not in_place:  # refused before the run read from is touched (a fallback)
        rundir.refusal(Path(cfg.out), cfg.overwrite, Path(cfg.resume))
    chosen = usable_checkpoint(Path(cfg.resume), check=lambda saved: check_saved(saved, probe), tidy=in_place)
    ended = _resumable(cfg, chosen, n_train, own)
    return {**chosen, ENDED_HERE: ended["final"] if ended else None}


def _resumable(cfg: RunConfig, chosen: dict[str, Any], n_train: int | None, own: bool) -> dict[str, Any] | None:
    """Refuse, in one line, a resume from the checkpoint whose manifest is ``chosen`` that would
    train on other data, nothing, or past a finished run in its place, or a user's loop's with
    optimiser settings that would not take effect; return what the run finished with at that
    checkpoint (:func:`_finished_at`)."""
    assert cfg.resume is not None
    was = chosen.get("n_train")
    if isinstance(was, int) and n_train and was != n_train:  # (until 2026-12-01 trained on, its epochs another's)
        raise ConfigError(
            f"--resume {cfg.resume}: its checkpoint was written on {was} training samples of {cfg.dataset}, and "
            f"the data now has {n_train}: the data changed; resume with the data the run trained on"
        )
    ended = _finished_at(Path(cfg.resume), chosen.get("samples"))
    _within_budget(cfg, chosen, n_train, own, ended)
    if cfg.resumes_in_place:
        _not_finished(cfg, n_train, own)
    if own:
        _own_optimiser_settings_kept(cfg)
    return ended


def _own_optimiser_settings_kept(cfg: RunConfig) -> None:
    """A user's loop resumed restores its optimisers whole, as torch's load_state_dict does (its
    LR scheduler may have moved the lr): an lr, momentum or weight decay given otherwise than the
    run's (its config.toml, not yet rewritten) would not take effect, so it is refused."""
    try:
        before = config_mod.load_toml(Path(str(cfg.resume)) / "config.toml", option_names=registry.option_names())
    except ConfigError:
        return  # (its checkpoint's own checks speak for it)
    for name in ("lr", "momentum", "weight_decay"):
        if getattr(before, name) != getattr(cfg, name):
            raise ConfigError(
                f"resume={cfg.resume}: your loop's optimisers come back from the checkpoint whole (as torch's "
                f"load_state_dict does), so {name}={getattr(cfg, name)} would not take effect (the run's was "
                f"{getattr(before, name)}): resume with the run's, or set each param_group['{name}'] after run.setup()"
            )


def _budget(cfg: RunConfig, n_train: int | None, own: bool) -> tuple[int | None, str]:
    """The run's budget in samples (``--max-samples``, or the samples of ``--epochs`` passes in
    distsgd's loop; None: not known, a loop of the user's own without max_samples) and its flag."""
    if cfg.max_samples is not None or own or not n_train:
        return cfg.max_samples, f"--max-samples {cfg.max_samples}"
    budget = cfg.epochs * samples_per_epoch(n_train, cfg.workers, cfg.partition)
    return budget, f"--epochs {cfg.epochs} ({budget} samples)"


def _not_finished(cfg: RunConfig, n_train: int | None, own: bool) -> None:
    """A run resumed in place that already finished within the budget asked for is refused: nothing
    more is to train, and its checkpoint, which may be older than its end (the last one before it,
    or an asynchronous run's taken before its final model), would have replaced the finished model,
    summary and figures (an audit's: a plain --resume of a finished Hogwild! run changed model.pt by
    0.015 and its accuracy from 0.7694 to 0.7944; one of an allreduce run with --lr 2.0 trained its
    last 156 samples again, 0.525 to 0.369, exit 0)."""
    try:
        summary = json.loads((Path(str(cfg.resume)) / "summary.json").read_text())
    except (OSError, ValueError):
        return  # (a run that never finished: a killed one resumes)
    done = summary.get("samples") if isinstance(summary, dict) else None
    budget, flag = _budget(cfg, n_train, own)
    if isinstance(done, int) and budget is not None and done >= budget:
        raise ConfigError(
            f"--resume {cfg.resume}: the run finished at {done} samples, within {flag}: nothing more would train, "
            f"and its model would become its last checkpoint's; resume with a larger budget, or into another --out"
        )


def _finished_at(run_dir: Path, samples: Any) -> dict[str, Any] | None:
    """What the run in ``run_dir`` finished with, where it finished (its summary.json) at
    ``samples``, its checkpoint's: its ``max_samples``, and its ``final`` evaluation where that was
    made there (after that checkpoint, which could not hold it; else None). None where the run did
    not finish there (a killed run, a stopped one, a checkpoint before the end)."""
    try:
        summary = json.loads((run_dir / "summary.json").read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(summary, dict) or not isinstance(samples, int) or summary.get("samples") != samples:
        return None
    evals = summary.get("evals")
    last = evals[-1] if isinstance(evals, list) and evals and isinstance(evals[-1], dict) else None
    kept = last is not None and isinstance(last.get("train_wall_s"), (int, float)) and last.get("samples") == samples
    return {"max_samples": summary.get("max_samples"), "final": dict(last) if kept and last else None}


def _within_budget(
    cfg: RunConfig, manifest: dict[str, Any], n_train: int | None, own: bool, ended: dict[str, Any] | None
) -> None:
    """A resume whose checkpoint is already past the run's budget (``--max-samples``, or the
    samples of ``--epochs`` passes in distsgd's loop) is refused: nothing would train, and the run's
    model would become the checkpoint's, older one. Not where the run finished at that checkpoint
    with this ``--max-samples`` (``ended``, :func:`_finished_at`): its last step went past it, as
    a run's last step may, and a resume of it with the same budget trains nothing more, as one of
    a finished ``--epochs`` run does."""
    at = manifest.get("samples")
    if not isinstance(at, int):
        return
    budget, flag = _budget(cfg, n_train, own)
    finished = ended is not None and cfg.max_samples is not None and ended["max_samples"] == cfg.max_samples
    if budget is not None and at > budget and not finished:
        raise ConfigError(
            f"--resume {cfg.resume}: its checkpoint is at {at} samples, past {flag}: nothing "
            f"would train, and the run's model would become the checkpoint's; resume with a larger budget"
        )


def _sinks(
    job: Job, out: Path | None, tb_dir: Path | None, started: float, settings_text: str, chief: bool
) -> list[Sink]:
    """Where the run's events go besides the progress display: metrics.jsonl, the loggers and
    TensorBoard (:func:`~distsgd.metrics.open_sinks`), the callbacks' on_checkpoint and on_end (the chief's)."""
    cfg = job.cfg
    stale = out is not None and cfg.resumes_in_place
    hooks: list[Sink] = [_StaleSummary(out)] if out is not None and stale else []  # (before a callback looks)
    hooks += [CallbackSink(job.callbacks)] if job.callbacks and chief else []
    return open_sinks(cfg, out, tb_dir, started, settings_text) + hooks


class _StaleSummary:
    """A run resumed in place, once it commits a checkpoint of its own: the summary.json of the run
    it went on from describes no state the directory still holds (a kill then left it looking
    finished to ``distsgd compare``), so it goes; the run's end writes its own. A resume that
    fails before (a file it cannot load) leaves it."""

    def __init__(self, out: Path) -> None:
        self.path = out / "summary.json"

    def emit(self, event: dict[str, Any]) -> None:
        if event.get("event") == "checkpoint":
            self.path.unlink(missing_ok=True)


LAUNCH = "launch"  # in a run directory made under a launcher that tells its launch apart: what does


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except (OSError, UnicodeDecodeError):
        return None


def _prepare_out(cfg: RunConfig, settings_text: str, where: environment.Environment) -> Path:
    """The run directory, made (or, resumed in place, kept), with the run's config.toml: a resumed
    run's too, written once the resume has passed its checks. Made by the first attempt of a
    launch that can be told apart (torchrun's: its rendezvous id and its agent), it says which
    (:data:`LAUNCH`): a restart of the same launch that finds no checkpoint in it may train again
    in its place."""
    assert cfg.out is not None
    resuming_in_place = cfg.resumes_in_place
    try:
        out = (
            Path(cfg.out)
            if resuming_in_place
            else rundir.prepare(Path(cfg.out), cfg.overwrite, Path(cfg.resume) if cfg.resume else None)
        )
        atomic_write_bytes(out / "config.toml", settings_text.encode())
        if where.launched and where.launch_id is not None and where.restarted is None:
            atomic_write_bytes(out / LAUNCH, f"{where.launch_id}\n".encode())
    except OSError as exc:
        raise OutputError.of(exc) from None
    return out


def _data_given_again(cfg: RunConfig) -> None:
    """A resume of a run whose data came from Python, without the data: one line that says to pass
    it again (until 2026-12-01: "unknown dataset 'arrays'", an audit's). Its config.toml's header
    says what came from Python (:func:`config.to_toml`)."""
    if not cfg.resume:
        return
    try:
        with (Path(cfg.resume) / "config.toml").open() as fh:
            header = fh.readline()
    except OSError:
        return
    if f"the data ({cfg.dataset})" in header and "came from Python" in header:
        raise ConfigError(
            f"--resume {cfg.resume}: its data ({cfg.dataset}) came from Python, and the run directory holds only "
            f"its name: pass it again, distsgd.train(data=..., resume={str(cfg.resume)!r})"
        )


def _from_python(spec: ModelSpec, dataset: TrainingData | None, code: dict[str, Any] | None) -> list[str]:
    """What of a run came from Python objects, which config.toml can name but not hold: the data
    (``dataset``: what was passed in), the model, the user's loss, optimizer and param_groups."""
    pieces = [] if dataset is None else [f"the data ({dataset.name})"]
    if not isinstance(spec, str):
        pieces.append(f"the model ({describe(spec)})")
    for what, fn in (code or {}).items():
        if what == "callbacks":
            if fn:
                pieces.append(f"the callbacks ({', '.join(type(c).__name__ for c in fn)})")
        elif fn is not None:
            pieces.append(f"the {what} function ({describe(fn)})")
    return pieces


def _only(settings: dict[str, Any], *names: str) -> dict[str, Any]:
    return {k: v for k, v in settings.items() if k in names}


def default_algo(cfg: RunConfig, where: environment.Environment, cli: bool = True) -> tuple[str, str | None]:
    """The algorithm a run that names none trains with, and the line that says so (None: the
    baseline, said by nobody, or a rank other than 0): chosen for ``--workers``, or under a
    launcher (torchrun, srun, ...) for its processes, which are the run's workers. A ``--workers``
    that disagrees with them gets no line: :func:`~distsgd.launch.plan` refuses it in one."""
    workers = cfg.workers
    if where.launched:
        workers = max(where.world_size, cfg.workers)
    algo = registry.default_for(workers)
    quiet = algo == registry.baseline() or (where.launched and (where.rank != 0 or workers != where.world_size))
    launcher = where.name if where.launched else None
    return algo, None if quiet else registry.chose(workers, cli=cli, launcher=launcher)


def _after_restart(cfg: RunConfig, where: environment.Environment | None) -> tuple[str | None, bool]:
    """The run's ``resume`` and ``overwrite`` when its launcher started it again (torchrun's restart,
    SLURM's requeue, a Kubeflow pod) into its run directory: it resumes from the checkpoint there;
    with none, an earlier attempt's unfinished run (its directory named by this launch alone, or
    one ``--out`` named that this launch's first attempt made: :data:`LAUNCH`) is replaced: from
    the start, in its place."""
    again = where.restarted if where is not None else None
    if not (again and cfg.out and not cfg.resume):
        return cfg.resume, cfg.overwrite
    assert where is not None
    out = Path(cfg.out)
    if read_manifest(out) is not None:
        log.warning("%s: resuming from the checkpoint in %s", again, cfg.out)
        return cfg.out, cfg.overwrite
    made_here = where.launch_id is not None and _read(out / LAUNCH) == where.launch_id
    if (
        ((where.launch_named and out.name.startswith(f"{where.run_name}-")) or made_here)
        and out.is_dir()
        and not (out / "summary.json").exists()
        and rundir.is_ours(out)
    ):
        if where.rank == 0:
            log.warning("%s: no checkpoint in %s: training again from the start", again, cfg.out)
        return cfg.resume, True
    return cfg.resume, cfg.overwrite


def settle(
    cfg: RunConfig, torchrun: bool, where: environment.Environment | None = None
) -> tuple[RunConfig, type[Algorithm]]:
    """The settings a run will use, and its algorithm class: its options (none of another
    algorithm's), the general checks with the model's and the algorithm's own defaults, the topology's plan, the
    algorithm's own checks, then what resuming needs. The options come out complete (every one
    with its value), so config.toml records them all."""
    algo = cfg.algo
    if algo is None:
        algo, said = default_algo(cfg, where if where is not None else environment.current(), cli=False)
        if said and not cfg.quiet:
            log.warning("%s", said)
    algo_cls = registry.class_for(algo, cfg)
    opts = registry.options_of(cfg, algo_cls)
    # unset settings: the model's own (gpt's, tuned for it), else the algorithm's (its paper's), else the field's;
    # an algorithm that names its workers' optimiser (DiLoCo's inner one) has the last word on it
    algo_own = algo_cls.default_settings(cfg)
    own = {**algo_own, **recommended_settings(cfg.model), **_only(algo_own, "optimizer")}
    resume, overwrite = _after_restart(cfg, where)
    manifest = read_manifest(Path(resume)) if resume else None
    # the options complete (every one with its value), so that config.toml records them all
    # (and a resumed run's held against what its checkpoint recorded, before anything else of it is read)
    cfg = settled(
        cfg,
        own,
        (algo_cls.Options, registry.option_names(), manifest),
        algo=algo,
        options=opts.to_mapping(),
        resume=resume,
        overwrite=overwrite,
    )
    device.check(cfg.device, cfg.precision)
    cfg = launch.plan(cfg, algo_cls, torchrun)
    algo_cls.check(cfg)
    if cfg.cuda_graphs:
        computes_on = device.kind(cfg.device)
        if not algo_cls.graphable:
            raise ConfigError(
                f"--cuda-graphs captures a worker's whole step, and {cfg.algo}'s step also talks to other "
                f"processes (gradients, weights, a server) or takes a host lock, which a graph cannot hold: "
                f"use it with single or hogwild"
            )
        if (why := graphs_refusal(cfg, computes_on)) is not None:
            raise ConfigError(f"--cuda-graphs: {why}")
    if (cfg.checkpoint_every or cfg.resume) and not algo_cls.checkpoints:
        raise ConfigError(f"checkpoints and --resume are not supported for {cfg.algo}")
    if cfg.resume:
        # Every check before anything is written (a fallback below rewrites the manifest; the run, its
        # config.toml): the settings the state depends on (settled), then the manifest's algorithm and workers.
        if manifest is None:
            raise CheckpointError(f"no checkpoint in {cfg.resume} (train with --checkpoint-every to make one)")
        if manifest["world"] != cfg.workers:
            raise ConfigError(
                f"the checkpoint in {cfg.resume} has {manifest['world']} workers; resume it with "
                f"--workers {manifest['world']}"
            )
        if manifest.get("algo", cfg.algo) != cfg.algo:  # another algorithm's state would be misread, or hang
            raise ConfigError(
                f"the checkpoint in {cfg.resume} was written by {manifest['algo']}, not {cfg.algo}; "
                f"resume it with --algo {manifest['algo']}"
            )
    host = group_host() if torchrun and place()[0] == 0 else None
    if host is not None and host not in LOCAL_NAMES:
        log.warning(
            "the process group listens on %s: torch.distributed has no authentication or encryption; "
            "use it only on a trusted network",
            host,
        )
    return cfg, algo_cls


@_user_facing
def spawn(
    main: Callable[..., Any],
    model: ModelSpec | nn.Module,
    algo: str | None = None,
    workers: int | None = None,
    *,
    args: tuple = (),
    optimizer: Callable | None = None,
    evaluate: Callable | None = None,
    callbacks: Iterable[Any] = (),
    train_size: int | None = None,
    **settings: Any,
) -> TrainResult:
    """Run ``main(run, *args)``, your own training loop, in each of ``algo``'s ``workers`` processes (or,
    under torchrun or in a Ray Train worker, in this one); return the summary and the model ``main``
    returned.

    ``model``: as for :func:`train` (a built-in name, a class or factory, or a module instance);
    ``run.setup()`` builds it in each worker, seeded alike. A module instance is copied to the
    workers, trains on its own device unless ``device=`` says otherwise, and ends with the weights
    of the model the run returns (as a model shared with ``torch.multiprocessing`` workers ends
    trained). ``args``: more arguments for ``main``, after ``run`` (as ``mp.Process(args=...)``'s:
    they travel to the workers). ``main`` must be defined at
    module level and the call made under ``if __name__ == "__main__":`` (workers import your
    script). ``optimizer``: a module-level ``optimizer(model) -> torch.optim.Optimizer`` for every
    worker (the one way to give the parameter server, which steps, your optimiser; elsewhere
    ``run.setup(optimizer)`` may give it too). ``evaluate``: ``evaluate(model) -> {"test_accuracy":
    ..., "test_loss": ...}``, called here on the model the run returns and saves: the summary's
    final figures (needed for them under Hogwild! and the parameter server, whose workers' models
    are not the one returned). ``train_size``: your training set's length, if you want ``--schedule`` to know an
    epoch. ``settings``: any ``distsgd train`` setting (``epochs=``, ``lr=``, ``out=``,
    ``max_samples=``, the algorithm's options, ...). See :class:`distsgd.Run` for what ``main``
    may call, and docs/OWN_LOOP.md's "Bring your own loop".
    """
    from distsgd.train.own_loop import OwnData

    procs.refuse_if_importing_main()
    if not callable(main):
        raise ConfigError(f"distsgd.spawn needs main, a function main(run); got {type(main).__name__}")
    if not isinstance(args, (tuple, list)):
        raise ConfigError(
            f"distsgd.spawn(args=...) is a tuple of main's arguments after run; got {type(args).__name__}"
        )
    if train_size is not None and (isinstance(train_size, bool) or not isinstance(train_size, int) or train_size < 1):
        raise ConfigError(
            f"distsgd.spawn(train_size=...) is your training set's length, a whole number >= 1; got {train_size!r}"
        )
    given = {k: v for k, v in (("algo", algo), ("workers", workers)) if v is not None}
    module = model if isinstance(model, nn.Module) else None
    if module is not None and "device" not in settings:
        where = next(itertools.chain(module.parameters(), module.buffers()), None)
        given["device"] = where.device.type if where is not None else "cpu"
    cfg = config_mod.from_mapping(
        {**given, **settings}, RunConfig(), source="spawn()", option_names=registry.option_names()
    )
    if isinstance(optimizer, str):
        cfg, optimizer = cfg.replace(optimizer=optimizer), None
    spec = _CopyOf(module) if module is not None else model
    cfg = cfg.replace(model=spec if isinstance(spec, str) else describe(spec), dataset=OWN_LOOP_DATA)
    data = OwnData(n_train=train_size or 0)
    entry = _WithArgs(main, tuple(args)) if args else main
    given_optimiser = tuple(k for k in ("lr", "momentum", "weight_decay") if settings.get(k) is not None)
    code = {
        "main": entry,
        "optimizer": optimizer,
        "callbacks": checked_callbacks(callbacks),
        "settings_given": given_optimiser,
    }
    result = run(cfg, model_spec=spec, dataset=data, code=code, evaluate=evaluate)
    if module is not None and result.model is not None:
        with torch.no_grad():  # the module given ends trained, on its own device
            module.load_state_dict(result.model.state_dict())
    return result


class _WithArgs:
    """``main(run, *args)``, sent to the workers as one picklable function (``spawn(args=...)``)."""

    def __init__(self, main: Callable[..., Any], args: tuple) -> None:
        self.main, self.args = main, args
        self.__qualname__ = getattr(main, "__qualname__", type(main).__name__)
        self.__module__ = getattr(main, "__module__", __name__)

    def __call__(self, run: Any) -> Any:
        return self.main(run, *self.args)


def _spawns(algo_cls: type[Algorithm], torchrun: bool, cfg: RunConfig) -> bool:
    """Whether the run starts worker processes, which the user's code must travel to: not in a
    launcher's group, whose ranks are the workers (or the server), but for its Hogwild! clusters,
    and for a group that trains through losses (each process keeps one worker: launch.keepers).
    (Ray Train sends the functions of the driver's script by value: pickled again by reference
    here, they would not be found.)"""
    return algo_cls.topology.spawns(torchrun) or (torchrun and cfg.trains_through)


def _check_own(job: Job, algo_cls: type[Algorithm], torchrun: bool) -> nn.Module:
    """Before any process starts, for a run whose loop is the user's: an algorithm that can run it,
    and code that can travel to worker processes. Returns the model as the workers build it."""
    cfg = job.cfg
    if cfg.checkpoint_every:
        raise ConfigError(
            "checkpoint_every is distsgd's loop's: in your own loop call run.checkpoint(**state) where "
            "your loop can save (every worker at the same point)"
        )
    algo_cls.check_own_loop(cfg)
    if cfg.cuda_graphs:
        raise ConfigError(
            "--cuda-graphs captures the steps of distsgd's own loop; in your loop, capture your step "
            "with torch.cuda.graph (run.backward and opt.step inside it are the algorithm's)"
        )
    probe = build_model(job.model, (), 0, job.cfg.init, seed=job.cfg.seed)  # a model the workers can build
    if _spawns(algo_cls, torchrun, cfg):
        _check_travels(
            (("main", job.main), ("model", job.model), ("optimizer", job.optimizer), ("callbacks", job.callbacks))
        )
    return probe


def _check_travels(pieces: Iterable[tuple[str, object]]) -> None:
    """Each (what, obj) of the user's code can be sent to worker processes (pickled), or one line."""
    import pickle

    for what, obj in pieces:
        if obj is None or isinstance(obj, str):
            continue
        try:
            pickle.dumps(obj)
        except Exception as exc:
            # a model instance whose class is at module level may hold what pickle refuses (torch's
            # parametrizations: weight_norm, spectral_norm, orthogonal); its class travels (an audit's:
            # such a model was told to be defined at module level, which it was, torch's reason dropped)
            instance = isinstance(obj, (_CopyOf, nn.Module))
            fix = (
                "pass its class or a function that builds it (model=MyNet), not an instance"
                if instance
                else "define it at module level, not inside a function or as a lambda"
            )
            why = one_line(str(exc))[:200]
            raise ConfigError(
                f"the {what} ({describe(obj)}) cannot be sent to worker processes "
                f"({type(exc).__name__}{': ' + why if why else ''}): {fix}"
            ) from None


def _check_job(job: Job, algo_cls: type[Algorithm], torchrun: bool) -> nn.Module:
    """Before any process starts: the model takes the data, the loss fits the targets, and the
    user's code can travel to worker processes. Returns the model as the workers build it."""
    cfg, spec, data = job.cfg, job.model, job.data
    probe = build_model(spec, data.input_shape, data.num_classes, cfg.init, seed=cfg.seed)
    check_fits(probe, data.input_shape, data.num_classes, describe(spec), data.name, data.task)
    loss_function(cfg.loss, job.loss, data.task)
    if _spawns(algo_cls, torchrun, cfg):
        datasets = [type(data.train), type(data.test)] if isinstance(data, TorchData) else []
        _check_travels(
            (
                ("model", spec),
                ("loss", job.loss),
                ("optimizer", job.optimizer),
                ("param_groups", job.param_groups),
                ("callbacks", job.callbacks),
                *(("dataset", d) for d in datasets),
            )
        )
    if getattr(data, "stream", False):  # a stream, split as it is read, in passes of unknown length
        if cfg.partition != "sharded":
            raise ConfigError(STREAM_REPLICATED)
        if cfg.schedule != "constant":
            raise ConfigError(schedule_needs_epochs(cfg.schedule, own_loop=False))
    elif data.n_train < cfg.workers:
        raise ConfigError(f"{data.n_train} training samples cannot be shared among {cfg.workers} workers")
    return probe


__all__ = ["train", "run", "TrainResult", "evaluate_checkpoint"]
