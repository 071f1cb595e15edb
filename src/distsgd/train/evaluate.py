"""Test loss and accuracy of a model on in-memory tensors."""

from __future__ import annotations

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
