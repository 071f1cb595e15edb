"""Errors that are the user's to fix.

Every mistake a user can make (a missing file, an impossible setting, a model that does not fit the
data) raises a :class:`DistsgdError`. The CLI prints it as one ``error: ...`` line on stderr and
exits with status 2; Python users catch it like any exception.
"""

from __future__ import annotations


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


class WorkerError(DistsgdError):
    """A worker process failed (it raised, or died); the message names it and its error. Exit 2
    like every other failure the CLI reports in one line."""


class WorkerInputError(WorkerError):
    """A worker stopped on a user's mistake it found (an unreadable image, a bad sample): no
    restart (``--restart-workers``) can mend it."""
