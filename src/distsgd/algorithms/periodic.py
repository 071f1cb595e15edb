"""When a periodic synchronisation is due, kept apart from how it is made, as torch's
``model_averaging`` keeps ``PeriodicModelAverager`` apart from ``average_parameters``: local-sgd's
averaging, diloco's outer step, easgd's elastic exchange and streaming diloco's fragments use it.

The loop owns the step count (``Step.number``); a :class:`Periodic` says whether that count is a
synchronisation point, and keeps the one piece of state a period has: whether steps were taken
since the last synchronisation (``pending``: the last, partial period the algorithm still owes at
the end of the run).
"""

from __future__ import annotations

from typing import Any

from distsgd.config import Period, parse_period
from distsgd.errors import ConfigError
from distsgd.options import option


def period_option(default: int | None, help: str) -> Period:
    """An option ``--sync-every H|epoch``: a :class:`~distsgd.config.Period` of steps."""
    return option(
        Period(default),
        help,
        parse=lambda v: parse_period(str(v), "--sync-every", "steps"),
        show=lambda p: "epoch" if p.count is None else p.count,
    )


class Periodic:
    """Synchronise at counts ``first``, ``first + every``, ``first + 2 every``, ... (``every``
    None: at each epoch's end instead). ``first`` defaults to ``every``: after steps H, 2H, ..."""

    def __init__(self, every: int | None, first: int | None = None) -> None:
        if every is not None and every < 1:
            raise ConfigError(f"a synchronisation period must be at least 1 step, got {every}")
        self.every = every
        self.first = every if first is None else first
        self.pending = False

    @classmethod
    def of(cls, period: Period, first: int | None = None) -> "Periodic":
        return cls(period.count, first)

    @property
    def each_epoch(self) -> bool:
        return self.every is None

    def due(self, count: int) -> bool:
        """Whether ``count`` (the loop's step number, or whatever count the algorithm times its
        synchronisations by) is a synchronisation point."""
        if self.every is None or self.first is None or count < self.first:
            return False
        return (count - self.first) % self.every == 0

    def stepped(self) -> None:
        """A step was taken: a synchronisation is owed, at the next point or at the end."""
        self.pending = True

    def synced(self) -> None:
        self.pending = False

    def state_dict(self) -> dict[str, Any]:
        return {"pending": self.pending}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.pending = bool(state["pending"])


__all__ = ["Periodic", "period_option"]
