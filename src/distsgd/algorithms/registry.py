"""Name -> algorithm class. Importing this module registers every built-in algorithm,
in the order `distsgd algorithms` lists them: the baseline first."""

from __future__ import annotations

# isort: off
from distsgd.algorithms import single  # noqa: F401  (registers)
from distsgd.algorithms import allreduce, ddp, hogwild, param_server  # noqa: F401
from distsgd.algorithms import local_sgd, easgd, hogwildpp, diloco  # noqa: F401
# isort: on
from distsgd.algorithms.base import Algorithm, get, names, resolve

__all__ = ["Algorithm", "get", "names", "resolve"]
