"""What training minimises: the loss.

``--loss``: ``cross-entropy`` (class labels; the default for them), ``nll`` (for a model that ends
in log-softmax), ``mse`` (float targets: regression; the default for them), or, in Python, any
``loss_fn(output, target)`` returning the batch's mean loss. Classification reports test
accuracy and loss (:func:`distsgd.train.evaluate.evaluate`); regression the test loss only.

A language model (task ``lm``: targets ``(B, T)`` of next tokens) is trained on the mean
cross-entropy over every token of the batch (nats per token), from its scores ``(B, T, V)`` or its
output's ``.logits`` (a Hugging Face model's): the objective of GPT-2 and of Hugging Face's causal
language models. Its test loss is that same mean; perplexity is exp(loss) and bits per token
loss / ln 2.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

from distsgd.errors import ConfigError
from distsgd.models import logits_of


def mse_loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """The mean squared error of each output and its target: one output a sample (B, 1) against
    scalar targets (B,) (a torch Dataset's float column) as one column; other shapes that differ
    refused in one line. F.mse_loss broadcast (B, 1) against (B,) into every output against every
    target and trained a constant model, with a warning of torch's alone (an audit's: test loss
    4.67, the targets' variance, for 0.026). The batches are left as the dataset gives them: a
    ``loss=`` of the user's written for them (``out.squeeze(-1)``) sees what it saw."""
    if out.dim() == 2 and out.shape[1] == 1 and target.shape == out.shape[:1]:
        target = target[:, None]
    if out.shape != target.shape:
        raise ConfigError(
            f"--loss mse: the model's outputs {tuple(out.shape)} and the targets {tuple(target.shape)} differ in "
            f"shape, which mse would broadcast (every output against every target): give the model one output "
            f"a target value"
        )
    return F.mse_loss(out, target)


LOSSES: dict[str, Callable] = {"cross-entropy": F.cross_entropy, "nll": F.nll_loss, "mse": mse_loss}


def token_cross_entropy(out: object, target: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy over every token: scores (B, T, V) against next tokens (B, T)."""
    logits = logits_of(out)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), target.reshape(-1))


def _scores(loss: Callable) -> Callable:
    """``loss`` on the scores of a model whose output is an object with ``.logits``."""

    def on_scores(out: object, target: torch.Tensor) -> torch.Tensor:
        return loss(logits_of(out), target)

    on_scores.__name__ = getattr(loss, "__name__", "loss")
    return on_scores


def loss_function(name: str, custom: Callable | None, task: str) -> Callable:
    """The loss to train with: ``custom`` if given, else ``--loss`` (``auto`` by the task)."""
    if custom is not None:
        return custom
    if name.startswith("python:"):
        raise ConfigError(f"the run used the Python loss function {name[7:]}; pass it again as loss=")
    if task == "lm":
        if name not in ("auto", "cross-entropy"):
            raise ConfigError(f"--loss {name} does not fit a language model's next tokens: use cross-entropy")
        return token_cross_entropy
    if name == "auto":
        name = "mse" if task == "regression" else "cross-entropy"
    if (name == "mse") != (task == "regression"):
        kind = "float targets (regression)" if task == "regression" else "class labels"
        raise ConfigError(
            f"--loss {name} does not fit a dataset of {kind}: use "
            f"{'mse' if task == 'regression' else 'cross-entropy or nll'}"
        )
    return _scores(LOSSES[name])
