"""What training minimises: the loss.

``--loss``: ``cross-entropy`` (class labels; the default for them), ``nll`` (for a model that ends
in log-softmax), ``mse`` (float targets: regression; the default for them), or, in Python, any
``loss_fn(output, target)`` returning the batch's mean loss. Classification reports test
accuracy and loss (:func:`distsgd.train.evaluate.evaluate`); regression the test loss only.
"""

from __future__ import annotations

from typing import Callable

import torch.nn.functional as F

from distsgd.errors import ConfigError

LOSSES: dict[str, Callable] = {"cross-entropy": F.cross_entropy, "nll": F.nll_loss, "mse": F.mse_loss}


def loss_function(name: str, custom: Callable | None, task: str) -> Callable:
    """The loss to train with: ``custom`` if given, else ``--loss`` (``auto`` by the task)."""
    if custom is not None:
        return custom
    if name.startswith("python:"):
        raise ConfigError(f"the run used the Python loss function {name[7:]}; pass it again as loss=")
    if name == "auto":
        name = "mse" if task == "regression" else "cross-entropy"
    if (name == "mse") != (task == "regression"):
        kind = "float targets (regression)" if task == "regression" else "class labels"
        raise ConfigError(f"--loss {name} does not fit a dataset of {kind}: use "
                          f"{'mse' if task == 'regression' else 'cross-entropy or nll'}")
    return LOSSES[name]
