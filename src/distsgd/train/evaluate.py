"""Test loss and accuracy of a model on in-memory tensors; snapshots of a model others train."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


@torch.no_grad()
def evaluate(model: nn.Module, x: torch.Tensor, y: torch.Tensor, batch_size: int = 1000) -> tuple[float, float]:
    """(accuracy in 0..1, mean cross-entropy loss) over all of ``x``; restores train/eval mode.

    The loss is cross-entropy on the model's outputs. For a model that already ends in
    log-softmax this equals the NLL loss, since log-softmax is idempotent.
    """
    was_training = model.training
    model.eval()
    correct = 0
    loss_sum = 0.0
    try:
        for start in range(0, len(x), batch_size):
            xb, yb = x[start:start + batch_size], y[start:start + batch_size]
            out = model(xb)
            loss_sum += F.cross_entropy(out, yb, reduction="sum").item()
            correct += int((out.argmax(dim=1) == yb).sum())
    finally:
        model.train(was_training)
    n = max(1, len(x))
    return correct / n, loss_sum / n


class Snapshots:
    """Evaluation of a model that other processes keep training (Hogwild!, the parameter server).

    Every ``eval_every`` samples the owner calls :meth:`take` with a copy of the weights at that
    moment; the copies are evaluated after training (:meth:`finish`), so evaluation takes no CPU
    from the workers. With ``stop_at_target`` a copy is evaluated at once instead, to know when to
    stop. Each evaluation is emitted to ``sink`` as an ``eval`` event.
    """

    def __init__(self, cfg: Any, spec: Any, dataset: Any, per_epoch: int, sink: Any) -> None:
        self.cfg, self.spec, self.dataset, self.per_epoch, self.sink = cfg, spec, dataset, per_epoch, sink
        self.every = cfg.eval_every or per_epoch
        self.next = self.every
        self.pending: list[tuple[int, float, dict[str, torch.Tensor]]] = []
        self.evals: list[dict[str, Any]] = []

    def due(self, samples: int) -> bool:
        """Whether ``samples`` crossed the next evaluation point (then the point moves on)."""
        if samples < self.next:
            return False
        while self.next <= samples:
            self.next += self.every
        return True

    def take(self, samples: int, train_s: float, state: dict[str, torch.Tensor]) -> bool:
        """File a copy of the weights; return whether it reached the target (``stop_at_target`` only)."""
        if not (self.cfg.stop_at_target and self.cfg.target_accuracy is not None):
            self.pending.append((samples, train_s, state))
            return False
        event = self.evaluate(samples, train_s, state)
        return event["test_accuracy"] >= self.cfg.target_accuracy

    def evaluate(self, samples: int, train_s: float, state: dict[str, torch.Tensor]) -> dict[str, Any]:
        from distsgd.models import build_model

        probe = build_model(self.spec, self.dataset.input_shape, self.dataset.num_classes, self.cfg.init)
        probe.load_state_dict(state)
        acc, loss = evaluate(probe, self.dataset.x_test, self.dataset.y_test, self.cfg.eval_batch_size)
        event = {"event": "eval", "samples": samples, "epoch": round(samples / self.per_epoch, 4),
                 "train_wall_s": train_s, "test_accuracy": acc, "test_loss": loss}
        self.evals.append(event)
        self.sink.emit(event)
        return event

    def finish(self, samples: int, train_s: float, state: dict[str, torch.Tensor]) -> list[dict[str, Any]]:
        """Evaluate the filed copies, then the final weights (unless the last copy was of them)."""
        for n, t, st in self.pending:
            self.evaluate(n, t, st)
        self.pending = []
        if not self.evals or self.evals[-1]["samples"] != samples:
            self.evaluate(samples, train_s, state)
        return self.evals

    def state_dict(self) -> dict[str, Any]:
        return {"next_eval": self.next, "evals": list(self.evals),
                "snapshots": [{"samples": n, "train_s": t, "state": st} for n, t, st in self.pending]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.next, self.evals = state["next_eval"], list(state["evals"])
        self.pending = [(s["samples"], s["train_s"], s["state"]) for s in state["snapshots"]]
