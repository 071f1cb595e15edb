"""Signals from the first instruction of the ``distsgd`` command.

``python -m distsgd`` and the ``distsgd`` script import this package (torch with it: a second or
two) before the command's ``main`` runs. A SIGTERM (a scheduler, ``timeout``, a test harness) or a
Ctrl-C in that time would end the process with no word, or with an import's traceback. So the
package's first lines call :func:`install`, which, in the command alone (never in a program that
imports distsgd), makes either signal print the command's one ``error:`` line and exit with the
shell's status for it (143, 138, 130): nothing has started yet that needs stopping. ``cli.main`` then
takes over with its own handlers (:func:`settled`).
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from types import FrameType


def _the_command() -> bool:
    """Whether this process is the ``distsgd`` command being started: ``python -m distsgd`` (while
    Python imports the package, ``sys.argv[0]`` is ``-m``) or the ``distsgd`` script."""
    argv, orig = sys.argv, getattr(sys, "orig_argv", [])
    if not argv:
        return False
    if argv[0] == "-m":
        return len(orig) > len(argv) and orig[-len(argv)] == "distsgd" and orig[-len(argv) - 1] == "-m"
    return os.path.basename(argv[0]) == "distsgd"


def _keeps_a_worker(argv: list[str]) -> bool:
    """A rank asked to train through lost workers (``--min-workers``) trains in a worker process
    of its own (``launch.keepers``), which it keeps and does not train itself: it logs as the
    launcher's workers do (to errors), and its fork server can be forked from it. (One read from
    ``--config`` or a resumed run's config.toml is not seen here: that rank keeps torch's default,
    and its server is a new interpreter, which its worker's C++ log keeps to errors in.)"""
    return any(a == "--min-workers" or a.startswith("--min-workers=") for a in argv)


def _stop(signum: int, frame: FrameType | None) -> None:
    said = "interrupted" if signum == signal.SIGINT else f"terminated by {signal.Signals(signum).name}"
    os.write(2, f"error: {said}\n".encode())
    os._exit(128 + signum)


def install() -> None:
    """In the ``distsgd`` command, before anything else is imported: SIGTERM, SIGUSR1 (SLURM's
    ``--signal``) and SIGINT end it with one line (see the module); and, in a command that is not
    one rank of a launcher's group that trains (no ``RANK``, or a rank that keeps a worker: the ranks
    that train keep torch's default), torch's C++ log keeps
    to errors unless ``TORCH_CPP_LOG_LEVEL`` says otherwise (torch reads it once, as it is imported:
    a worker forked from this process, ``procs.prefork_server``, logs as this process does, and the
    workers have kept to errors since the first launcher, whose RPC logged every closed pipe at
    shutdown as a warning)."""
    global _COMMAND
    _COMMAND = _the_command()
    if not _COMMAND:
        return
    if "RANK" not in os.environ or _keeps_a_worker(sys.argv):
        os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT):
            signal.signal(sig, _stop)


_COMMAND = False


def the_command() -> bool:
    """Whether this process was started as the ``distsgd`` command (as :func:`install` found it)."""
    return _COMMAND


def settled() -> None:
    """The command's own handling from here on: of the handlers :func:`install` set, SIGINT's back
    to Python's (KeyboardInterrupt), SIGTERM's and SIGUSR1's to the default (``cli.main`` sets its own)."""
    if threading.current_thread() is not threading.main_thread():
        return
    for sig, then in (
        (signal.SIGINT, signal.default_int_handler),
        (signal.SIGTERM, signal.SIG_DFL),
        (signal.SIGUSR1, signal.SIG_DFL),
    ):
        if signal.getsignal(sig) is _stop:
            signal.signal(sig, then)
