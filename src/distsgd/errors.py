"""Errors that are the user's to fix.

Every mistake a user can make (a missing file, an impossible setting, a model that does not fit the
data) raises a :class:`DistsgdError`. The CLI prints it as one ``error: ...`` line on stderr and
exits with status 2; Python users catch it like any exception.
"""

from __future__ import annotations

from collections.abc import Callable


class DistsgdError(Exception):
    """Base class: a problem the user can fix. The message is one line."""

    exit_code = 2


class ConfigError(DistsgdError):
    """An unknown, mistyped or impossible setting."""


class DataError(DistsgdError):
    """A dataset that cannot be found, read or trusted."""


class ModelError(DistsgdError):
    """A model that cannot be built or does not fit the data."""


class CheckpointError(DistsgdError):
    """A checkpoint that cannot be read."""


class BadField(CheckpointError):
    """A field of a checkpoint's piece whose value distsgd never writes there (``what``: what it
    writes, in words); the loader names the file and the piece."""

    def __init__(self, key: str, value: object, what: str) -> None:
        text = repr(value)
        shown = text if len(text) <= 40 else f"a {type(value).__name__} ({text[:30]}...)"
        if hasattr(value, "shape") and hasattr(value, "dtype"):  # a tensor (errors knows no torch)
            shown = f"a {str(value.dtype).removeprefix('torch.')} tensor of shape {list(value.shape)}"
        super().__init__(f"'{key}' is {shown}, not {what}")


class OutputError(DistsgdError):
    """A file distsgd must write cannot be: a full disk, an unwritable or impossible path."""

    @classmethod
    def of(cls, exc: OSError, what: str = "write") -> "OutputError":
        path = exc.filename or "the run directory"
        return cls(f"cannot {what} {path}: {exc.strerror or type(exc).__name__}")


class WorkerError(DistsgdError):
    """A worker process failed (it raised, or died); the message names it and its error. Exit 2
    like every other failure the CLI reports in one line."""


class Terminated(KeyboardInterrupt):
    """SIGTERM (a scheduler, ``kill``, a container runtime) arrived: stop as Ctrl-C stops a run."""

    signal_name = "SIGTERM"


def on_sigterm() -> Callable[[], None]:
    """From now on, SIGTERM raises :class:`Terminated` in this process's main thread (as SIGINT
    raises KeyboardInterrupt), so every clean-up on the way out runs; later SIGTERMs are ignored
    while it does. Returns what puts the previous handler back. No-op off the main thread."""
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():
        return lambda: None

    def handler(signum: int, frame: object) -> None:
        # once: a second SIGTERM (a process group's and then the launcher's, say) must not break the
        # clean-up the first one started; the launcher still ends a worker that will not stop
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        raise Terminated()

    previous = signal.signal(signal.SIGTERM, handler)

    def restore() -> None:
        signal.signal(signal.SIGTERM, previous)

    return restore


class WorkerInputError(WorkerError):
    """A worker stopped on a user's mistake it found (an unreadable image, a bad sample): no
    restart (``--restart-workers``) can mend it."""
