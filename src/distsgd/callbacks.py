"""Callbacks: your code at a run's evaluations, checkpoints and end, without owning the loop.

``distsgd.train(..., callbacks=[...])`` and ``distsgd.spawn(..., callbacks=[...])`` take objects
with any of these methods (subclass :class:`Callback` or not):

- ``on_eval(event) -> bool | None``: each evaluation (``event`` as in metrics.jsonl: ``samples``,
  ``epoch``, ``train_wall_s``, ``test_accuracy``, ``test_loss``, ...). Returning True stops the
  run there, as ``--stop-at-target`` does at its target: the model returned and saved is the one
  that evaluation measured (Hogwild! and the parameter server: the copy measured; a process
  group: the model at that step). It runs where the model is evaluated, which may be a worker
  process (so a callback travels there: define its class at module level; the attributes it
  changes there come back to your object when the run ends); every callback sees every evaluation.
- ``on_checkpoint(event)``: a checkpoint committed (``seq``, ``samples``, ``epoch``), in the
  process that called ``train`` or ``spawn``.
- ``on_end(summary)``: the run ended, with summary.json's dict, in that process.
- ``on_start(evals)``: the run begins, in the process that called ``train`` or ``spawn`` (before the
  callback travels to a worker): ``evals`` are the evaluations of the run it resumes up to its
  checkpoint (metrics.jsonl's, in order; the last of each at one count of samples), none in a fresh
  run. :class:`EarlyStopping` counts them again, so its patience goes on where the checkpoint was,
  and starts afresh in a fresh run (an object given to a second run, as Keras' ``on_train_begin``).

:class:`EarlyStopping` is one: it stops a run whose test loss (or accuracy) has not improved for
``patience`` evaluations.
"""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import TYPE_CHECKING, Any

from distsgd.errors import ConfigError

if TYPE_CHECKING:
    from distsgd.config import RunConfig


class Callback:
    """A base for callbacks: each hook does nothing unless overridden."""

    def on_eval(self, event: dict[str, Any]) -> bool | None:
        return None

    def on_checkpoint(self, event: dict[str, Any]) -> None:
        return None

    def on_end(self, summary: dict[str, Any]) -> None:
        return None

    def on_start(self, evals: list[dict[str, Any]]) -> None:
        return None


class EarlyStopping(Callback):
    """Stop once ``monitor`` (``test_loss``, lower is better, or ``test_accuracy``, higher is
    better) has not improved on its best by more than ``min_delta`` for ``patience`` evaluations
    in a row (Keras' and Lightning's rule)."""

    def __init__(self, monitor: str = "test_loss", patience: int = 3, min_delta: float = 0.0) -> None:
        if monitor not in ("test_loss", "test_accuracy"):
            raise ConfigError(f"EarlyStopping(monitor=...) is test_loss or test_accuracy, got {monitor!r}")
        if not isinstance(patience, int) or patience < 1:
            raise ConfigError(
                f"EarlyStopping(patience=...) is a whole number of evaluations, 1 or more; got {patience!r}"
            )
        if not min_delta >= 0:
            raise ConfigError(f"EarlyStopping(min_delta=...) must be >= 0, got {min_delta!r}")
        self.monitor, self.patience, self.min_delta = monitor, patience, float(min_delta)
        self.best: float | None = None
        self.waited = 0  # evaluations since the best
        self.stopped_at: int | None = None  # the samples of the evaluation that stopped the run

    def on_eval(self, event: dict[str, Any]) -> bool:
        value = event.get(self.monitor)
        if value is None:
            return False
        lower = self.monitor == "test_loss"
        better = self.best is None or (
            value < self.best - self.min_delta if lower else value > self.best + self.min_delta
        )
        if better:
            self.best, self.waited = float(value), 0
            return False
        self.waited += 1
        if self.waited >= self.patience:
            self.stopped_at = event.get("samples")
            return True
        return False

    def on_start(self, evals: list[dict[str, Any]]) -> None:
        """The evaluations before the run's start (a resumed run's up to its checkpoint), counted as a
        run never stopped counted them (on 30aa15c a resumed run began with none: it waited
        ``patience`` more from its first, 21 evaluations where one never stopped took 14). A run it
        stopped, resumed, stops at its first evaluation that does not improve (a larger
        ``patience`` given now trains on)."""
        self.best, self.waited, self.stopped_at = None, 0, None
        for event in evals:
            self.on_eval(event)
        self.stopped_at = None


def stops(event: dict[str, Any], cfg: RunConfig, callbacks: tuple) -> bool:
    """Whether the run stops at this evaluation: ``--stop-at-target``'s target reached, or a
    callback's ``on_eval`` said so (every callback sees the evaluation)."""
    from distsgd.metrics import reached

    hit = cfg.stop_at_target and reached(event, cfg.target_accuracy, cfg.target_loss)
    asked = [cb.on_eval(event) is True for cb in callbacks if callable(getattr(cb, "on_eval", None))]
    return hit or any(asked)


class CallbackSink:
    """The run's events to the callbacks' ``on_checkpoint``, its summary to their ``on_end``, in
    the launching process."""

    def __init__(self, callbacks: tuple) -> None:
        self.callbacks = callbacks

    def emit(self, event: dict[str, Any]) -> None:
        if event.get("event") == "checkpoint":
            for cb in self.callbacks:
                if callable(getattr(cb, "on_checkpoint", None)):
                    cb.on_checkpoint(event)

    def write_summary(self, summary: dict[str, Any]) -> None:
        for cb in self.callbacks:
            if callable(getattr(cb, "on_end", None)):
                cb.on_end(summary)


__all__ = ["Callback", "EarlyStopping", "CallbackSink", "adopt", "sent", "states", "stops"]


HOOKS = ("on_eval", "on_checkpoint", "on_end", "on_start")


def started(callbacks: tuple, run_dir: Path | None = None, samples: int | None = None) -> None:
    """The callbacks' ``on_start``: with the evaluations ``run_dir``'s metrics.jsonl holds up to
    ``samples`` (a resumed run's checkpoint's), by samples, the last logged of each (a run resumed
    before logged its killed part's again); none in a fresh run (``run_dir`` None), or where the
    file is missing or unreadable."""
    takers = [cb for cb in callbacks if callable(getattr(cb, "on_start", None))]
    if not takers:
        return
    from distsgd.metrics import eval_events

    found: dict[Any, dict[str, Any]] = {}  # by samples: the last logged of each
    for event in eval_events(run_dir / "metrics.jsonl") if run_dir is not None and samples is not None else []:
        at = event.get("samples")
        if isinstance(at, (int, float)) and samples is not None and at <= samples:
            found.pop(at, None)
            found[at] = event
    evals = sorted(found.values(), key=lambda e: e["samples"])
    for cb in takers:
        cb.on_start(evals)


def checked(callbacks: Any) -> tuple:
    """``callbacks=`` of ``distsgd.train`` or ``spawn``, as a tuple: one callback alone is taken
    (as Lightning takes it); a class where its instance was meant, or an object with none of the
    hooks (``print``), is refused, since it would never be called."""
    if any(callable(getattr(callbacks, hook, None)) for hook in HOOKS) and not isinstance(callbacks, type):
        return (callbacks,)
    try:
        given = tuple(callbacks)
    except TypeError:
        raise ConfigError(
            f"callbacks must be a list of callbacks, got {type(callbacks).__name__} {callbacks!r:.60}"
        ) from None
    for i, cb in enumerate(given):
        if isinstance(cb, type):
            raise ConfigError(f"callbacks[{i}] is the class {cb.__name__}: give an instance, {cb.__name__}(...)")
        if not any(callable(getattr(cb, hook, None)) for hook in HOOKS):
            raise ConfigError(
                f"callbacks[{i}] ({type(cb).__name__} {cb!r:.60}) has none of {', '.join(HOOKS)}, so it would "
                f"never be called: a callback is an object with those methods (distsgd.callbacks)"
            )
    return given


def states(callbacks: tuple) -> list[dict[str, Any] | None] | None:
    """What the callbacks' attributes are now, in a worker that ran them (their copies), to travel
    back to the process that called train or spawn (:func:`adopt`); None where they cannot travel."""
    if not callbacks:
        return None
    now: list[dict[str, Any] | None] = []
    for cb in callbacks:
        try:  # a state that cannot travel (a file handle it opened): that callback's left where it is
            state = dict(vars(cb))
            pickle.dumps(state)
        except Exception:  # noqa: BLE001
            state = None
        now.append(state)
    return now


def sent(callbacks: tuple) -> list[dict[str, bytes] | None]:
    """The callbacks' attributes as they leave for the workers (pickled), for :func:`adopt`."""
    out: list[dict[str, bytes] | None] = []
    for cb in callbacks:
        try:
            out.append({k: pickle.dumps(v) for k, v in vars(cb).items()})
        except Exception:  # noqa: BLE001 - no attributes, or one that cannot be pickled: not adopted
            out.append(None)
    return out


def adopt(callbacks: tuple, returned: list[Any], before: list[dict[str, bytes] | None] | None) -> None:
    """The callbacks given to train or spawn take the attributes their copies in a worker changed
    (``returned``: the workers' :func:`states`, against ``before``, :func:`sent`; None: nothing to
    take): ``EarlyStopping.stopped_at`` and ``best`` say where the run stopped, while what
    ``on_checkpoint`` or ``on_end`` set here stays. Until 2026-12-01 they
    did so only where the callbacks ran in this process (single, Hogwild!): under a process group or
    the parameter server they stayed as given (an audit's: stopped_at None)."""
    now = next((states for states in returned if states), None)  # (the worker's that ran them)
    if now is None or before is None or len(now) != len(callbacks) or len(before) != len(callbacks):
        return
    for cb, state, was in zip(callbacks, now, before):
        if state is None or was is None:
            continue
        for name, value in state.items():
            try:
                changed = pickle.dumps(value) != was.get(name)
            except Exception:  # noqa: BLE001 - (states() pickled them all)
                continue
            if changed:
                setattr(cb, name, value)
