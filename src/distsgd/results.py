"""What a run reports: the :class:`TrainResult` it returns, its summary (``summary.json``), the
final figures of a user's own loop, and a saved model measured again (``distsgd eval``).

:mod:`distsgd.api` runs; this module summarises what the workers sent back.
"""

from __future__ import annotations

import logging
import platform
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import torch
from torch import nn

from distsgd import config as config_mod
from distsgd import user
from distsgd.config import RunConfig, validate
from distsgd.data import Dataset, TrainingData, load_dataset, text
from distsgd.data.partition import samples_per_epoch
from distsgd.errors import CheckpointError, ConfigError, DataError, ModelError
from distsgd.metrics import Sink, first_reaching, lm_figures
from distsgd.models import ModelSpec, build_model, describe
from distsgd.train import device
from distsgd.train.context import Job, WorkerResult
from distsgd.train.evaluate import eval_event
from distsgd.train.objective import loss_function

if TYPE_CHECKING:
    from distsgd.algorithms.base import Algorithm

log = logging.getLogger(__name__)


@dataclass
class TrainResult:
    """What a run returns: ``summary`` (the summary.json dict), the trained ``model``, ``out``.
    Under torchrun or Ray Train the run's model is rank 0's; the other ranks get None."""

    summary: dict[str, Any]
    model: nn.Module | None
    out: Path | None = None

    def __iter__(self) -> Iterator[Any]:  # summary, model = distsgd.train(...)
        return iter((self.summary, self.model))


def checkpoints_whole(results: list[WorkerResult]) -> None:
    """A user's loop's checkpoints: one warning where a worker saved its part of none while another
    saved some, so that none of those was whole, nor committed. Where the workers share a model or a
    server, ``if run.rank == 0: run.checkpoint(...)`` (DDP's habit) left no checkpoint at all, exit 0,
    unsaid (an audit's); a process group refuses it at the call (``Run.checkpoint``). A warning,
    not an error: the run trained, and its model and summary are saved. (A worker with none only:
    an asynchronous worker stopped inside its last epoch may save one fewer, and lose only that.)"""
    counts = {r.rank: r.checkpoints for r in results if r.checkpoints is not None}
    if counts and min(counts.values()) == 0 < max(counts.values()):
        said = ", ".join(f"worker {rank} {n}" for rank, n in sorted(counts.items()))
        log.warning(
            "the workers saved their parts of unequal numbers of checkpoints (%s), and a checkpoint is whole, "
            "and committed, once every worker saved its part: none of those was; call run.checkpoint() in every "
            "worker at the same point (not `if run.rank == 0`)",
            said,
        )


def own_final_figures(
    job: Job, algo_cls: type[Algorithm], results: list[WorkerResult], sink: Sink, evaluate: Callable | None
) -> None:
    """The final figures of a run whose loop is the user's: ``evaluate(model)`` of the model the
    run returns, here, when given (an eval event at the run's end). Without it, what the user's
    first worker logged last, where that was of the returned model (a process group's); under
    Hogwild! and the parameter server a worker's model is not the one returned, so none."""
    chief = results[0]
    if evaluate is not None and chief.model is not None:
        got = evaluate(chief.model)
        if not isinstance(got, dict) or not {"test_accuracy", "test_loss"} & set(got):
            raise ConfigError(
                f"evaluate(model) must return a dict with test_accuracy and/or test_loss, got {type(got).__name__}"
            )
        values = {k: float(v) if isinstance(v, (int, float, torch.Tensor)) else v for k, v in got.items()}
        event = eval_event(
            job.data,
            chief.global_samples,
            epochs_trained(job.cfg, job.data, results),
            chief.train_wall_s,
            values.get("test_accuracy"),
            values.get("test_loss"),
        )
        event.update({k: v for k, v in values.items() if k not in event})
        last = chief.evals[-1] if chief.evals else {}
        figures = ("samples", "test_accuracy", "test_loss")
        if [last.get(k) for k in figures] != [event.get(k) for k in figures]:  # the loop's own last, again: once
            chief.evals.append(event)
            sink.emit(event)
        chief.final_test_accuracy, chief.final_test_loss = values.get("test_accuracy"), values.get("test_loss")
    elif algo_cls.topology.shared_model:
        chief.final_test_accuracy = chief.final_test_loss = None
    elif chief.stale is not None:
        log.warning(
            "%s, so that evaluation's figures are not the model returned's: the summary has no final figures; "
            "evaluate the model as it is returned (run.evaluation_model() after the last step and any change, "
            "then run.log(test_...)), or give spawn(evaluate=...)",
            chief.stale,
        )


def epochs_trained(cfg: RunConfig, dataset: TrainingData, results: list[WorkerResult]) -> float | None:
    """Epochs the run trained, all workers' samples over the training set's: a fraction where it
    stopped inside one (--max-samples, --stop-at-target). A user's loop's training set is the one
    ``spawn(train_size=)`` names, or else the one its workers gave ``run.loader``; None where
    neither is known (a loop that reads a stream)."""
    n = dataset.n_train or next((r.data_len for r in results if r.data_len), 0)
    return round(results[0].global_samples / samples_per_epoch(n, cfg.workers, cfg.partition), 4) if n else None


def _batch(cfg: RunConfig, results: list[WorkerResult]) -> dict[str, Any]:
    """``batch_size`` and ``accumulate``: the settings', where distsgd's loop takes its batches; a
    user's loop's own (its run.loader's batch_size, its micro-batches a step) as measured, a
    worker's samples a step (``accumulate`` null: the step's samples are the batch)."""
    stepped = [r for r in results if r.steps]
    if not any(r.steps is not None for r in results):
        return {"batch_size": cfg.batch_size, "accumulate": cfg.accumulate}
    taken = sum(r.samples if r.step_samples is None else r.step_samples for r in stepped)
    per_step = taken / sum(r.steps or 0 for r in stepped) if stepped else 0.0
    return {"batch_size": int(per_step) if per_step.is_integer() else round(per_step, 2), "accumulate": None}


def build_summary(
    cfg: RunConfig, dataset: TrainingData, spec: ModelSpec, results: list[WorkerResult], started: float, started_at: str
) -> dict[str, Any]:
    """summary.json: the keys later tools and the benchmarks read (see docs/RUNS.md, "What a run writes")."""
    chief = results[0]
    samples = chief.global_samples
    epochs = epochs_trained(cfg, dataset, results)
    hit = first_reaching(chief.evals, cfg.target_accuracy, cfg.target_loss)
    final = chief.final_test_accuracy is not None or chief.final_test_loss is not None
    summary: dict[str, Any] = {
        "algo": cfg.algo,
        "workers": cfg.workers,
        "dataset": dataset.name,
        "model": describe(spec) if not isinstance(spec, str) else spec,
        # what was trained (a user's loop that reads a stream: unknown, and not said)
        **({"epochs": epochs} if epochs is not None else {}),
        "configured_epochs": cfg.epochs,
        "max_samples": cfg.max_samples,
        **_batch(cfg, results),
        "samples": samples,
        "wall_s": time.time() - started,
        "train_wall_s": chief.train_wall_s,
        "samples_per_s": samples / chief.train_wall_s if chief.train_wall_s > 0 else 0.0,
        "final_test_accuracy": chief.final_test_accuracy,
        "final_test_loss": chief.final_test_loss,
        # the samples of the evaluation the final figures are (the model returned, as it was then): fewer
        # than samples where the last steps never reached it (an asynchronous worker's after its last push)
        "final_eval_samples": chief.evals[-1]["samples"] if chief.evals and final else None,
        "target_accuracy": cfg.target_accuracy,
        "target_loss": cfg.target_loss,
        "time_to_target_s": hit["train_wall_s"] if hit else None,
        "samples_to_target": hit["samples"] if hit else None,
        "evals": [
            {k: e[k] for k in ("samples", "train_wall_s", "test_accuracy", "test_loss", "test_perplexity") if k in e}
            for e in chief.evals
        ],  # a language model's evaluations carry their perplexity
        "threads_per_worker": device.threads_per_worker(cfg),
        **_where(results, cfg),
        "compile": cfg.compile,
        "torch_version": torch.__version__,
        "python_version": platform.python_version(),  # python-stdlib's text is this Python's own
        "started_at": started_at,
        "host": platform.node(),
    }
    summary.update(chief.figures.summary())
    if chief.attendance is not None:
        summary.update(chief.attendance.summary())
    if len(results) > 1 or cfg.workers > 1:  # samples a step, all workers
        summary["global_batch_size"] = summary["batch_size"] * (summary["accumulate"] or 1) * cfg.workers
    sent = chief.figures.run_bytes(results)  # every process's sends, as the algorithm counts them
    if sent is not None:
        summary["bytes_sent"], summary["bytes_sent_per_worker"] = sent
        # per sample trained: under --stop-at-target the workers' steps after the copy that reached the
        # target (its samples are the run's) sent bytes too
        trained = max(samples, sum(summary.get("samples_per_worker") or [0]))
        summary["bytes_sent_per_sample"] = summary["bytes_sent"] / trained if trained else None
    if dataset.task == "lm":
        summary.update(_lm_summary(dataset, summary))
    return summary


def _lm_summary(dataset: TrainingData, summary: dict[str, Any]) -> dict[str, Any]:
    """A language model's figures: tokens (a sample is a sequence of ``context`` tokens), the test
    loss as perplexity and bits per token, and the corpus's unigram entropy: the loss of knowing
    only how often each token occurs, which a model that learnt anything beats."""
    tokens = dataset.input_shape[0]
    loss = summary["final_test_loss"]
    figures = lm_figures(loss) if loss is not None else {"test_perplexity": None, "test_bits_per_token": None}
    out = {
        "task": "lm",
        "context": tokens,
        "vocab": dataset.num_classes,
        "tokens": summary["samples"] * tokens,
        "tokens_per_s": summary["samples_per_s"] * tokens,
        "final_test_perplexity": figures["test_perplexity"],
        "final_test_bits_per_token": figures["test_bits_per_token"],
    }
    if isinstance(dataset, Dataset):
        out["unigram_entropy"] = text.unigram_entropy(dataset.y_train, dataset.num_classes)
    return out


def _where(results: list[WorkerResult], cfg: RunConfig) -> dict[str, Any]:
    """Where the run computed (a GPU worker's device when there is one: a parameter server's chief
    is on the CPU), its precision and its backend."""
    wheres = [r.where for r in results if r.where]
    found = next(
        (w for w in wheres if w["device"] != "cpu"),
        wheres[0] if wheres else {"device": "cpu", "precision": cfg.precision},
    )
    # a process group's backend; None where there is none (one worker, a local server or one machine's Hogwild!)
    return {**found, "backend": cfg.backend if cfg.workers > 1 and cfg.backend != "auto" else None}


OWN_LOOP_DATA = "own loop"  # the dataset a model trained in a user's loop (distsgd.spawn) records


def evaluate_checkpoint(
    path: str | Path,
    dataset: str | None = None,
    data_dir: str | None = None,
    batch_size: int = 1000,
    model: str | None = None,
) -> dict[str, Any]:
    """Load a saved model (weights only) and measure it on its dataset's test set (``dataset``:
    another). A model or dataset that is a file (``path/file.py:Name``) is imported only when the
    caller names it (``model``, ``dataset``): a checkpoint cannot make eval run code."""
    from distsgd.checkpoint import load_checkpoint, state_mismatch
    from distsgd.train.evaluate import evaluate

    path = Path(path)
    file = path / "model.pt" if path.is_dir() else path
    if path.is_dir() and not file.is_file() and (path / "model.safetensors").is_file():
        file = path / "model.safetensors"  # a run saved with --save-format safetensors alone
    ckpt = load_checkpoint(file)
    if ckpt["dataset"] == OWN_LOOP_DATA:
        raise ConfigError(
            f"{file} holds a model trained in your own loop (distsgd.spawn): its model "
            f"({ckpt['model']}) and data came from your Python, which eval cannot rebuild; load its "
            f"weights ({_loader(file)}) into your model and measure them there"
        )
    marked = ckpt.get("from_python")
    python: list[Any] = marked if isinstance(marked, list) else []
    missing = [
        (f"{what} ({ckpt[key]})", flag)
        for what, key, flag, given in (
            ("data", "dataset", "--dataset", dataset),
            ("a model", "model", "--model", model),
        )
        if what.split()[-1] in python and given is None
    ]
    if missing:
        raise ConfigError(
            f"{file} was trained with {' and '.join(w for w, _ in missing)} passed from Python, which eval "
            f"cannot rebuild: give {' and '.join(f for _, f in missing)} (distsgd's own, or a file's), or "
            f"load its weights ({_loader(file)}) into your model and measure them there"
        )
    saved = _recorded_settings(ckpt["config"], file)
    for what, flag, recorded, given in (
        ("model", "--model", ckpt["model"], model),
        ("dataset", "--dataset", ckpt["dataset"], dataset),
    ):
        if given is None and user.names_file(recorded):
            raise ConfigError(
                f"{file} was trained with the {what} in {recorded}, and eval runs no file you did not "
                f"name: if you trust that file, give {flag} {recorded}"
            )
    ds = load_dataset(dataset or ckpt["dataset"], data_dir, context=saved.context)
    if list(ds.input_shape) != list(ckpt["input_shape"]) or ds.num_classes != ckpt["num_classes"]:
        raise DataError(
            f"the checkpoint was trained on input {ckpt['input_shape']} with {ckpt['num_classes']} "
            f"classes; {ds.name} has {list(ds.input_shape)} and {ds.num_classes}"
        )
    spec = model or ckpt["model"]
    net = build_model(spec, ds.input_shape, ds.num_classes, saved.init)
    problem = state_mismatch(net.state_dict(), ckpt["state_dict"])  # what torch would say, in one line
    if problem is not None:
        raise ModelError(f"the checkpoint does not match model {spec}: {problem}")
    net.load_state_dict(ckpt["state_dict"])
    loss_fn = loss_function(saved.loss, None, ds.task)
    acc, loss = evaluate(net, ds, batch_size, loss_fn)
    return {
        "checkpoint": str(path),
        "model": spec,
        "dataset": ds.name,
        "test_samples": ds.n_test,
        "test_accuracy": acc,
        "test_loss": loss,
        **(lm_figures(loss) if ds.task == "lm" else {}),
    }


def _loader(file: Path) -> str:
    """How a user loads the weights of the model file ``file``, in their Python."""
    if file.suffix == ".safetensors":
        return "safetensors.torch.load_file(path)"
    return "torch.load(path, weights_only=True)['state_dict']"


def _recorded_settings(recorded: dict[str, Any], file: Path) -> RunConfig:
    """The settings a checkpoint records that eval reads (context, loss, init), checked as a run's."""
    try:
        cfg = config_mod.from_mapping(
            {k: recorded[k] for k in ("context", "loss", "init") if k in recorded}, source=str(file)
        )
        validate(cfg)
        return cfg
    except ConfigError as exc:
        raise CheckpointError(f"{file} is damaged: the settings it records are not a run's ({exc})") from None


__all__ = ["TrainResult", "build_summary", "evaluate_checkpoint", "own_final_figures"]
