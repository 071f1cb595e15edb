"""Callbacks (issue 48): on_eval may stop a run (EarlyStopping is one), on_checkpoint and on_end
see the run's checkpoints and summary. EarlyStopping's rule is Keras' and Lightning's: stop once
the monitored figure has not improved by more than min_delta for `patience` evaluations in a row."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

import distsgd
from distsgd import EarlyStopping

pytest.importorskip("sklearn")  # the digits dataset


def test_early_stopping_counts_evaluations_without_improvement() -> None:
    stopper = EarlyStopping(patience=3)
    losses = [1.0, 0.9, 0.95, 0.93, 0.91, 0.5]
    said = [stopper.on_eval({"test_loss": v, "samples": i}) for i, v in enumerate(losses)]
    assert said == [False, False, False, False, True, False]  # three after 0.9, none better than it
    acc = EarlyStopping(monitor="test_accuracy", patience=2, min_delta=0.01)
    said = [acc.on_eval({"test_accuracy": v}) for v in (0.5, 0.505, 0.508, 0.7)]
    assert said == [False, False, True, False]  # +0.005 and +0.008 are within min_delta of 0.5
    with pytest.raises(distsgd.ConfigError, match="test_loss or test_accuracy"):
        EarlyStopping(monitor="loss")


class StopAtSecond(distsgd.Callback):
    """Stops the run at its second evaluation (wherever evaluations are made)."""

    def __init__(self) -> None:
        self.seen = 0

    def on_eval(self, event: dict[str, Any]) -> bool:
        self.seen += 1
        return self.seen == 2


class Recorder:
    """Not a Callback subclass: any object with the hooks will do."""

    def __init__(self) -> None:
        self.checkpoints: list[int] = []
        self.summary: dict[str, Any] | None = None

    def on_checkpoint(self, event: dict[str, Any]) -> None:
        self.checkpoints.append(event["seq"])

    def on_end(self, summary: dict[str, Any]) -> None:
        self.summary = summary


@pytest.mark.slow  # (4-7 s each: out of the fast tier, which ran 190 s on the VM of 2026-11-30)
@pytest.mark.parametrize("algo, workers", [("single", 1), ("allreduce", 2), ("hogwild", 2), ("asgd", 2)])
def test_on_eval_stops_the_run_at_that_evaluation(tmp_path: Path, algo: str, workers: int) -> None:
    """A process group (every worker stops at that step), Hogwild! and the parameter server (the
    copy measured is the model returned): two evaluations, then the end, well inside the budget;
    the summary's final figures are the second evaluation's."""
    recorder, stopper = Recorder(), StopAtSecond()
    result = distsgd.train(
        model="mlp",
        data="digits",
        algo=algo,
        workers=workers,
        epochs=20,
        eval_every=200,
        lr=0.05,
        out=str(tmp_path / "run"),
        callbacks=[stopper, recorder],
        quiet=True,
    )
    s = result.summary
    assert len(s["evals"]) == 2, s["evals"]
    # the object given holds what the one that ran (in a worker, under allreduce and asgd) ended with:
    # until 2026-12-01 it stayed as given there (an audit's: EarlyStopping's stopped_at None)
    assert stopper.seen == 2, stopper.seen
    assert s["samples"] < 20 * 1437 // 4
    assert s["final_test_accuracy"] == s["evals"][-1]["test_accuracy"]
    assert recorder.summary is not None and recorder.summary["samples"] == s["samples"]
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["evals"] == s["evals"]


def test_early_stopping_and_checkpoints_under_allreduce(tmp_path: Path) -> None:
    """EarlyStopping(patience=2) at a high lr (0.5): the run ends at the second evaluation in a row
    no better than the best before them, long before its 30 epochs; on_checkpoint saw every
    checkpoint committed, in order."""
    recorder = Recorder()
    result = distsgd.train(
        model="mlp",
        data="digits",
        algo="allreduce",
        workers=2,
        epochs=30,
        eval_every=300,
        checkpoint_every=200,
        lr=0.5,
        out=str(tmp_path / "run"),
        callbacks=[stopping := EarlyStopping(patience=2), recorder],
        quiet=True,
    )
    losses = [e["test_loss"] for e in result.summary["evals"]]
    assert stopping.stopped_at == result.summary["evals"][-1]["samples"] and stopping.best == min(losses)
    assert len(losses) >= 3 and min(losses[-2:]) >= min(losses[:-2])
    assert all(min(losses[j - 1 : j + 1]) < min(losses[: j - 1]) for j in range(2, len(losses) - 1))  # no earlier stop
    assert result.summary["samples"] < 30 * 1437
    assert recorder.checkpoints and recorder.checkpoints == sorted(recorder.checkpoints)


class LogsAccuracy:
    def __init__(self) -> None:
        self.n = 0

    def on_eval(self, event: dict[str, Any]) -> bool:
        self.n += 1
        return self.n == 3


def own_loop(run: distsgd.Run) -> None:
    import torch.nn.functional as F

    from distsgd.data import load_dataset

    digits = load_dataset("digits")
    train_set, _ = digits.torch_datasets()
    model, opt = run.setup()
    batches = run.loader(train_set, batch_size=16)
    for _ in range(50):
        for x, y in batches:
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            opt.step()
            if run.steps % 10 == 0:
                run.log(test_accuracy=0.5)
        if run.should_stop():
            break


def test_a_callback_stops_a_loop_of_your_own() -> None:
    """run.log's test figures go to on_eval; True makes run.loader stop and run.should_stop() True."""
    from distsgd.models import build_model

    result = distsgd.spawn(
        own_loop,
        model=build_model("mlp", (64,), 10),
        algo="allreduce",
        workers=2,
        callbacks=[LogsAccuracy()],
        quiet=True,
    )
    assert len(result.summary["evals"]) == 3 and result.summary["samples"] <= 31 * 2 * 16


@pytest.mark.parametrize(
    "given, message",
    [
        ([EarlyStopping], r"callbacks\[0\] is the class EarlyStopping: give an instance"),
        ([print], r"callbacks\[0\] \(builtin_function_or_method .*\) has none of on_eval, on_checkpoint, on_end"),
        ([object()], r"has none of on_eval"),
        (5, "callbacks must be a list of callbacks, got int 5"),
    ],
)
def test_a_callback_that_would_never_be_called_is_refused(given: Any, message: str) -> None:
    """8f65d93: ``callbacks=[print]`` or ``[object()]`` trained with the callback never called;
    ``[EarlyStopping]`` (the class) and ``5`` were TypeErrors from inside distsgd."""
    with pytest.raises(distsgd.ConfigError, match=message):
        distsgd.train(model="logreg", data="digits", max_samples=64, callbacks=given, quiet=True)


def test_one_callback_alone_is_taken_as_lightning_takes_it() -> None:
    """``callbacks=StopAtSecond()``, not in a list (8f65d93: a TypeError, not iterable)."""
    s = distsgd.train(
        model="logreg", data="digits", epochs=20, eval_every=200, callbacks=StopAtSecond(), quiet=True
    ).summary
    assert len(s["evals"]) == 2 and s["samples"] < 20 * 1437 // 4, s["evals"]


def test_a_resumed_early_stopping_counts_the_evaluations_up_to_the_checkpoint(tmp_path: Path) -> None:
    """on_start gets metrics.jsonl's evaluations up to the checkpoint's samples, the last logged at
    each (a run resumed before logged its killed part's again), a torn line skipped."""
    events = [(100, 1.0), (200, 0.9), (300, 0.95), (300, 0.97), (400, 0.5)]  # 400: after the checkpoint
    lines = [json.dumps({"event": "eval", "samples": s, "test_loss": v}) for s, v in events]
    (tmp_path / "metrics.jsonl").write_text("\n".join([*lines[:3], '{"event": "ev', *lines[3:]]) + "\n")
    stopper = EarlyStopping(patience=2)
    from distsgd.callbacks import started

    started((stopper,), tmp_path, 300)
    assert (stopper.best, stopper.waited, stopper.stopped_at) == (0.9, 1, None)
    assert stopper.on_eval({"test_loss": 0.99, "samples": 400}) is True  # two past the best, as never stopped
    started((stopper,), tmp_path / "nowhere", 300)  # no metrics.jsonl: none to count, as a fresh run's
    assert (stopper.best, stopper.waited) == (None, 0)
