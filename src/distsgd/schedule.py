"""When periodic things are due: a :class:`~distsgd.config.Period` setting (every N samples or
steps, or each epoch) as the schedule the loop, the algorithms and the parameter server keep."""

from __future__ import annotations

from typing import Any

from distsgd.config import Period
from distsgd.errors import BadField, ConfigError


class Periodic:
    """A :class:`Period`'s schedule: due when a count reaches or passes ``first``, ``first + every``,
    ``first + 2 every``, ... (``first`` defaults to ``every``), once however many points it passed.
    Steps advance by one, so an algorithm synchronises exactly after steps H, 2H, ...; samples
    advance by a batch, so an evaluation comes at the first count past each multiple of N.
    ``every`` None (each epoch's end) is never due. It also keeps whether steps were taken since
    the last synchronisation (``pending``: the last, partial period an algorithm owes at the end)."""

    def __init__(self, every: int | None, first: int | None = None) -> None:
        if every is not None and every < 1:
            raise ConfigError(f"a period must be at least 1, got {every}")
        self.every = every
        self.next = None if every is None else every if first is None else first  # the next point
        self.pending = False

    @classmethod
    def of(cls, period: Period, first: int | None = None) -> "Periodic":
        return cls(period.count, first)

    @property
    def each_epoch(self) -> bool:
        return self.every is None

    def due(self, count: int) -> bool:
        """Whether ``count`` (the loop's step number, all workers' samples, ...) reached the next
        point; if it did, the next point is the first one past ``count``."""
        if self.every is None or self.next is None or count < self.next:
            return False
        self.next += ((count - self.next) // self.every + 1) * self.every
        return True

    def stepped(self) -> None:
        """A step was taken: a synchronisation is owed, at the next point or at the end."""
        self.pending = True

    def synced(self) -> None:
        self.pending = False

    def state_dict(self) -> dict[str, Any]:
        return {"next": self.next, "pending": self.pending}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        nxt, pending = state["next"], state["pending"]
        if nxt is not None and (not isinstance(nxt, int) or isinstance(nxt, bool) or nxt < 0):
            raise BadField("next", nxt, "a whole number >= 0, or none")
        if not isinstance(pending, bool):
            raise BadField("pending", pending, "true or false")
        if self.every is not None and nxt is not None:  # (saved each epoch, now every N: from the first N on)
            self.next = nxt
        elif self.every is None:
            self.next = None
        self.pending = pending


__all__ = ["Periodic"]
