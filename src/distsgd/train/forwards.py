"""Which models a user's loop ran a forward of before it logged test figures.

``run.log(test_accuracy=..., test_loss=...)`` makes the run's evaluations, and the last one the
summary's final figures of the model the run returns and saves. A loop may evaluate another model
there: its EMA (``AveragedModel(model)``, timm's ``ModelEmaV2``: a copy of the model with other
weights), a teacher, the worker's own replica where the run returns an average. :class:`Forwards`
notes, from a point of the loop (a step's end, ``run.evaluation_model()``, ``run.final_model()``)
to its test figures, which of them ran, so that figures of another model are not taken for the
returned one's (the audit of 2026-12-01: an EMA's figures were summary.json's final figures under
every process-group algorithm, 0.152 for a model of 0.153 under allreduce, 0.162 for 0.145 under
DiLoCo, exit 0).
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch import nn

# what Forwards.verdict() says of the figures logged now
THE_MODELS = None  # the model's (or nothing is known: no forward seen)
OWN = "own"  # only the worker's own replica ran, where the run returns another model (an average)
ANOTHER = "another"  # only copies of the model with other weights ran (an EMA's, an old copy's): not its
BOTH = "both"  # the model and a copy of it with other weights (an EMA's?) both ran: the loop's to say


class Forwards:
    """A forward pre-hook of every module in this process (torch's global one: nothing is stored on
    the model, which a loop may pickle whole) that sorts each forward: of ``mine`` (the model the
    run returns, or what run.evaluation_model() made, and ``also``: a wrapper of it), of ``own``
    (the worker's replica, where that is not ``mine``), of a copy of ``mine`` (another module with
    its parameters' shapes: its weights are compared when figures are logged); another model's
    (a teacher's, a probe's, a fused or quantised copy's) says nothing. Once figures are logged
    (:meth:`reset`) the hook ends at the next forward that records gradients in training mode (the
    next step's), so that no step runs it; until then a loop may measure the model as it is."""

    def __init__(self, mine: nn.Module, own: nn.Module | None = None, also: nn.Module | None = None) -> None:
        self.mine = mine
        self.labels: dict[int, str] = {id(m): "own" for m in own.modules()} if own is not None else {}
        for model in (also, mine):
            if model is not None:
                self.labels.update({id(m): "mine" for m in model.modules()})
        self.shapes = [p.shape for p in mine.parameters()]
        self.until_training = False
        self.seen: set[str] = set()
        self.copies: list[weakref.ref] = []  # copies of mine that ran since the last reset
        self.handle: Any = torch.nn.modules.module.register_module_forward_pre_hook(self._ran)

    def _ran(self, module: nn.Module, args: Any) -> None:
        if torch.compiler.is_compiling():
            return
        if self.until_training and torch.is_grad_enabled() and getattr(module, "_orig_mod", module).training:
            self.end()  # a training step's forward: the watch is over
            return
        label = self.labels.get(id(module))
        if label == "none":
            return
        if label is None:
            if self.shapes and [p.shape for p in module.parameters()] == self.shapes:
                label = "copy"  # (its modules are part of it)
                self.labels.update({id(m): "none" for m in module.modules()})
                self.labels[id(module)] = label
            else:  # another model (a teacher's, a probe's, a fused or quantised copy's): nothing known
                self.labels[id(module)] = "none"
                return
        if label == "copy" and all(c() is not module for c in self.copies):
            self.copies.append(weakref.ref(module))
        self.seen.add(label)

    def verdict(self) -> str | None:
        """Whose figures the loop can have measured since the watch began (or the last reset)."""
        copies = [c for c in (ref() for ref in self.copies) if c is not None]
        differing = [c for c in copies if not _same_weights(c, self.mine)]
        model_ran = "mine" in self.seen or len(differing) < len(copies)  # (a copy of it, moved or cast, is it)
        if not model_ran:
            if "own" in self.seen:
                return OWN
            return ANOTHER if differing else THE_MODELS
        return BOTH if differing else THE_MODELS

    def reset(self) -> None:
        """Figures were logged: what ran before them is theirs. The watch goes on (a loop may
        evaluate and log an EMA next) until the next training forward."""
        self.seen.clear()
        self.copies.clear()
        self.until_training = True

    def end(self) -> None:
        if self.handle is not None:
            self.handle.remove()
            self.handle = None


def _same_weights(copy: nn.Module, model: nn.Module) -> bool:
    """Whether ``copy``'s parameters are ``model``'s, in ``copy``'s dtype and device."""
    with torch.no_grad():
        return all(
            torch.equal(a, b.to(device=a.device, dtype=a.dtype)) for a, b in zip(copy.parameters(), model.parameters())
        )
