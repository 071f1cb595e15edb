"""Name -> algorithm class. Importing this module imports every module of this package (and of
its sub-packages), which registers every algorithm they define: adding an algorithm is adding a
module, with nothing to list here. `distsgd algorithms` lists them family by family
(``base.KINDS``), the baseline first."""

from __future__ import annotations

import importlib
import pkgutil

import distsgd.algorithms as _package
from distsgd.algorithms.base import Algorithm, baseline, get, names, option_owners, options_of, resolve  # noqa: F401
from distsgd.config import RunConfig


def _import_all() -> None:
    for info in pkgutil.walk_packages(_package.__path__, prefix=_package.__name__ + "."):
        importlib.import_module(info.name)


_import_all()


def option_names() -> set[str]:
    """Every option any algorithm declares (``--sync-every``, ``--tau``, ...)."""
    return set(option_owners())


def own_options(cfg: RunConfig) -> list[str]:
    """The names of the options of the algorithm ``cfg`` runs (the baseline's when it names none)."""
    return resolve(cfg.algo or baseline(), cfg).Options.names()


__all__ = [
    "Algorithm",
    "baseline",
    "get",
    "names",
    "resolve",
    "option_owners",
    "options_of",
    "option_names",
    "own_options",
]
