"""distsgd: train PyTorch models with parallel and distributed SGD.

The Python API in one call::

    import distsgd
    result = distsgd.train(model="mnist_net", data="fashion-mnist", algo="single", epochs=1)
    accuracy = result.summary["final_test_accuracy"]  # 0..1; result.model is the trained model
"""

from __future__ import annotations

from distsgd import _early

_early.install()  # the command: a SIGTERM while torch imports is one line too

__version__ = "0.1.0"

from distsgd.api import spawn, train  # noqa: E402
from distsgd.callbacks import Callback, EarlyStopping  # noqa: E402
from distsgd.errors import ConfigError, DataError, DistsgdError, ModelError  # noqa: E402
from distsgd.results import TrainResult  # noqa: E402
from distsgd.train.own_loop import Run  # noqa: E402

__all__ = [
    "train",
    "spawn",
    "Run",
    "TrainResult",
    "Callback",
    "EarlyStopping",
    "DistsgdError",
    "ConfigError",
    "DataError",
    "ModelError",
    "__version__",
]
