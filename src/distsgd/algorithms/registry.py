"""Name -> algorithm class. Importing this module imports every module of this package (and of
its sub-packages), which registers every algorithm they define: adding an algorithm is adding a
module, with nothing to list here. `distsgd algorithms` lists them family by family
(``base.KINDS``), the baseline first."""

from __future__ import annotations

import importlib
import pkgutil

import distsgd.algorithms as _package
from distsgd.algorithms.base import Algorithm, baseline, class_for, get, names, option_owners, options_of  # noqa: F401
from distsgd.config import RunConfig


def _import_all() -> None:
    for info in pkgutil.walk_packages(_package.__path__, prefix=_package.__name__ + "."):
        importlib.import_module(info.name)


_import_all()


def option_names() -> set[str]:
    """Every option any algorithm declares (``--sync-every``, ``--tau``, ...)."""
    return set(option_owners())


# The algorithm of a run of several workers that names none: synchronous data parallel, the
# same steps as one process with the global batch (the baseline runs one worker only).
SEVERAL_WORKERS = "allreduce"


def default_for(workers: int) -> str:
    """The algorithm a run takes when it names none: the baseline for one worker, else
    :data:`SEVERAL_WORKERS`."""
    return SEVERAL_WORKERS if workers > 1 else baseline()


def chose(workers: int, cli: bool = True, launcher: str | None = None) -> str:
    """The line that says which algorithm a run of ``workers`` that named none trains with, in the
    words of the command line (``cli``) or of the Python API; ``launcher``: the workers are the
    processes of that launcher's group (torchrun's, ...), not ``--workers``."""
    algo = default_for(workers)
    given, flag = (f"--workers {workers}", "--algo") if cli else (f"workers={workers}", "algo=")
    if launcher is not None:
        given = f"{workers} processes of {launcher}"
    return (
        f"{given} without {flag}: training with {algo} ({get(algo).summary_line}); "
        f"{flag} chooses another (distsgd algorithms lists them)"
    )


def own_options(cfg: RunConfig) -> list[str]:
    """The names of the options of the algorithm ``cfg`` runs (when it names none, the one
    :func:`default_for` its workers gives)."""
    return class_for(cfg.algo or default_for(cfg.workers), cfg).Options.names()


__all__ = [
    "Algorithm",
    "baseline",
    "chose",
    "default_for",
    "get",
    "names",
    "class_for",
    "option_owners",
    "options_of",
    "option_names",
    "own_options",
]
