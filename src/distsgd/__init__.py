"""distsgd: train PyTorch models with parallel and distributed SGD.

The Python API in one call::

    import distsgd
    result = distsgd.train(model="mnist_net", data="fashion-mnist", algo="single", epochs=1)
    accuracy = result.summary["final_test_accuracy"]  # 0..1; result.model is the trained model
"""

from __future__ import annotations

__version__ = "0.1.0"

from distsgd.api import spawn, train
from distsgd.errors import ConfigError, DataError, DistsgdError, ModelError
from distsgd.results import TrainResult
from distsgd.train.own_loop import Run

__all__ = [
    "train",
    "spawn",
    "Run",
    "TrainResult",
    "DistsgdError",
    "ConfigError",
    "DataError",
    "ModelError",
    "__version__",
]
