"""config.Periodic, the one schedule of a Period: the algorithms' sync points and the loop's
evaluations and checkpoints, against the rules as the papers and the docs state them."""

from hypothesis import given
from hypothesis import strategies as st

from distsgd.config import Period
from distsgd.schedule import Periodic


def fired(schedule: Periodic, counts: list[int]) -> list[int]:
    return [c for c in counts if schedule.due(c)]


@given(st.integers(1, 20), st.integers(0, 30), st.integers(0, 200))
def test_steps_sync_after_steps_first_then_every_h(every: int, warmup: int, steps: int) -> None:
    """Local SGD (Lin et al., post-local SGD) averages after steps K + H, K + 2H, ... of steps 1, 2, ..."""
    schedule = Periodic(every, warmup + every)
    assert fired(schedule, list(range(1, steps + 1))) == list(range(warmup + every, steps + 1, every))


@given(st.integers(1, 20), st.integers(1, 200))
def test_easgd_exchanges_at_every_t_tau_divides(tau: int, steps: int) -> None:
    """EASGD (Zhang et al., Algorithm 1) exchanges at the clock t = 0, 1, ... where tau divides t."""
    schedule = Periodic(tau, first=0)
    assert fired(schedule, list(range(steps))) == [t for t in range(steps) if t % tau == 0]


@given(st.integers(1, 50), st.lists(st.integers(1, 120), max_size=60))
def test_samples_fire_once_at_the_first_count_past_each_multiple(every: int, increments: list[int]) -> None:
    """Evaluations and checkpoints every N samples: once at the first count at or past a multiple of
    N, however many multiples a step passed (no evaluation repeated to catch up)."""
    counts = [sum(increments[: i + 1]) for i in range(len(increments))]
    expected = [c for prev, c in zip([0] + counts, counts) if c // every > prev // every]
    assert fired(Periodic(every), counts) == expected


@given(st.integers(1, 20), st.integers(0, 30), st.lists(st.integers(1, 40), max_size=40), st.data())
def test_a_restored_schedule_fires_where_the_first_would(every: int, first: int, increments: list[int], data) -> None:
    counts = [sum(increments[: i + 1]) for i in range(len(increments))]
    cut = data.draw(st.integers(0, len(counts)))
    one, two = Periodic(every, first), Periodic(every, first)
    before = fired(one, counts[:cut])
    one.stepped()
    two.load_state_dict(one.state_dict())
    assert two.pending and fired(two, counts[cut:]) == fired(Periodic(every, first), counts)[len(before) :]


def test_each_epoch_never_fires_and_of_takes_the_period() -> None:
    assert fired(Periodic.of(Period(None)), list(range(100))) == []
    assert Periodic.of(Period(None)).each_epoch and not Periodic.of(Period(3)).each_epoch
    assert fired(Periodic.of(Period(3)), list(range(1, 10))) == [3, 6, 9]
