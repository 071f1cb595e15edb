"""Errors that are the user's to fix.

Every mistake a user can make (a missing file, an impossible setting, a model that does not fit the
data) raises a :class:`DistsgdError`. The CLI prints it as one ``error: ...`` line on stderr and
exits with status 2; Python users catch it like any exception.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator


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
    """SIGTERM (a scheduler, ``kill``, a container runtime) arrived, or SIGUSR1 (SLURM's
    ``--signal``, a preemption notice): stop as Ctrl-C stops a run."""

    signal_name = "SIGTERM"
    signal_number = 15

    def __init__(self, signal_name: str = "SIGTERM", signal_number: int = 15) -> None:
        super().__init__(signal_name)
        self.signal_name, self.signal_number = signal_name, signal_number


class StopRequest:
    """A stop asked for by a signal, for a loop that can end at its next step with a final
    checkpoint (distsgd's loop, for an algorithm whose workers step in lockstep). While a loop
    listens (:meth:`listen`), SIGTERM and SIGUSR1 set :attr:`requested` (the signal's name)
    instead of raising :class:`Terminated`, however often they come: the loop stops at its next
    step, writes a checkpoint and raises it then; a launcher or scheduler that will not wait sends
    SIGKILL. Outside, they raise at once, as before."""

    def __init__(self) -> None:
        self.listening = False
        self.requested: tuple[str, int] | None = None  # (the signal's name, its number) once one came

    @contextlib.contextmanager
    def listen(self) -> Iterator["StopRequest"]:
        was, self.listening = self.listening, True
        try:
            yield self
        finally:
            self.listening = was


STOP = StopRequest()  # this process's; the handler on_sigterm installs reads it


def on_sigterm() -> Callable[[], None]:
    """From now on, SIGTERM (and SIGUSR1) raises :class:`Terminated` in this process's main thread
    (as SIGINT raises KeyboardInterrupt), so every clean-up on the way out runs; later ones are
    ignored while it does. While a loop listens to :data:`STOP`, they only ask it to stop. Returns
    what puts the previous handlers back. No-op off the main thread."""
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():
        return lambda: None

    def handler(signum: int, frame: object) -> None:
        name = signal.Signals(signum).name
        if STOP.listening:  # the loop stops at its next step, with a final checkpoint
            STOP.requested = STOP.requested or (name, signum)
            return
        # once: a second SIGTERM (a process group's and then the launcher's, say) must not break the
        # clean-up the first one started; the launcher still ends a worker that will not stop
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.signal(signal.SIGUSR1, signal.SIG_IGN)
        raise Terminated(name, signum)

    previous = {sig: signal.signal(sig, handler) for sig in (signal.SIGTERM, signal.SIGUSR1)}

    def restore() -> None:
        for sig, was in previous.items():
            signal.signal(sig, was)

    return restore


class WorkerInputError(WorkerError):
    """A worker stopped on a user's mistake it found (an unreadable image, a bad sample): no
    restart (``--restart-workers``) can mend it."""
