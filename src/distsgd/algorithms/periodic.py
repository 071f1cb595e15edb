"""The option an algorithm synchronises by, ``--sync-every H|epoch``: a :class:`~distsgd.config.Period`
of steps, whose schedule (:class:`~distsgd.schedule.Periodic`) says when a synchronisation is due; the
algorithm keeps how it is made, as torch's ``model_averaging`` keeps ``PeriodicModelAverager`` apart
from ``average_parameters``.
"""

from __future__ import annotations

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


def refuse_epochs_in_own_loop(period: Period, algo: str) -> None:
    """``--sync-every epoch`` synchronises at the end of each of distsgd's loop's epochs
    (``on_epoch_end``), which a user's own loop has not: it would never synchronise before the end."""
    if period.each_epoch:
        raise ConfigError(
            f"--sync-every epoch synchronises at the end of each of distsgd's loop's epochs, which your loop "
            f"does not have: give {algo} a number of steps"
        )


def untrained_by_theta(period: Period, algo: str) -> str:
    """The warning for a run of ``algo`` with ``--partial-round theta`` that ends before its first
    outer step: theta is still the model the run started from, and the round cut short, every step
    trained, is dropped."""
    every = "an epoch" if period.each_epoch else f"{period.count} inner steps"
    return (
        f"{algo}: no round of --sync-every {every} completed, and --partial-round theta drops the round "
        f"cut short: the model returned is the one the run started from, trained on none of its samples "
        f"(--partial-round average keeps the workers' steps, or give a smaller --sync-every)"
    )


def averaged_once(period: Period, algo: str) -> str:
    """The warning for a run of ``algo`` with ``--partial-round average`` (the default) that ends
    before its first outer step: no outer step ran, and the model returned is the workers' models
    averaged once at the end (local SGD with one average, not ``algo``). The default job under
    diloco (469 steps a worker against H = 500) said nothing of it until 2026-12-01 (an audit's)."""
    every = "an epoch" if period.each_epoch else f"{period.count} inner steps"
    return (
        f"{algo}: the run ended before a round of --sync-every {every} completed, so no outer step ran: the "
        f"model returned is the workers' models averaged once at the end (local SGD with one average); give "
        f"a smaller --sync-every (or a longer run) for {algo}'s outer steps"
    )


__all__ = ["averaged_once", "period_option", "refuse_epochs_in_own_loop", "untrained_by_theta"]
