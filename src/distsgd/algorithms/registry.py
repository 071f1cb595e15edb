"""Name -> algorithm class. Importing this module registers every built-in algorithm."""

from __future__ import annotations

from distsgd.algorithms import single  # noqa: F401  (registers)
from distsgd.algorithms.base import Algorithm, get, names

__all__ = ["Algorithm", "get", "names"]
