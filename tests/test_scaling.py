"""benchmarks/scaling.py's model against costs derived from first principles, by hand: the ring
all-reduce's (Thakur, Rabenseifner, Gropp 2005, section 4; Patarasuk and Yuan 2009), a server link's
capacity and the bounds on a closed queueing network, and PowerSGD's message size (Vogels,
Karimireddy, Jaggi 2019, section 3)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def scaling():
    spec = importlib.util.spec_from_file_location("scaling", ROOT / "benchmarks" / "scaling.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["scaling"] = module  # its dataclasses look their module up
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        del sys.modules["scaling"]


def test_ring_allreduce_costs_what_thakur_et_al_give(scaling) -> None:
    """Ring all-reduce of n bytes on p machines: 2 (p - 1) alpha + 2 (p - 1) / p n beta. Worked here
    for n = 1 MB, beta = 1 / (100 MB/s), alpha = 100 us."""
    link = scaling.Link(bandwidth=100e6, latency=100e-6)
    # p = 2: 2 messages, each half of the data: 2 x 100 us + 1 MB / 100 MB/s
    assert scaling.ring_allreduce(1e6, 2, link) == pytest.approx(0.0002 + 0.01)
    # p = 4: 6 messages of a quarter each: 600 us + 1.5 x 10 ms
    assert scaling.ring_allreduce(1e6, 4, link) == pytest.approx(0.0006 + 0.015)
    # p = 1024: 2046 messages (204.6 ms) and 2 x 1023/1024 of the data (19.98 ms): latency-bound
    assert scaling.ring_allreduce(1e6, 1024, link) == pytest.approx(0.2046 + 0.019980469)
    assert scaling.ring_allreduce(1e6, 1, link) == 0


def test_a_parameter_servers_link_caps_its_pushes(scaling) -> None:
    """A server on a 1 Gbit/s link (125 MB/s each way) takes in at most 125e6 / 4e6 = 31.25 gradients
    of 1M float32 a second, however many workers push: the bottleneck law. With compute that costs
    nothing, a lone asgd worker's round trip is 2 x 32 ms (64 / 0.064 = 1000 samples/s of batch 64),
    and N workers make at most N times that and at most 31.25 x 64 = 2000 samples/s (the asymptotic
    bounds of Lazowska, Zahorjan, Graham, Sevcik, "Quantitative System Performance", 1984, ch. 5),
    tending to the second. sync-ps receives all 8 (0.256 s), then sends all 8 replies (0.256 s):
    8 x 64 / 0.512 = 1000 samples/s."""
    link = scaling.Link(bandwidth=125e6, latency=0.0)
    job = scaling.Job(params=1_000_000, compute=1e-12, batch=64)
    assert scaling.samples_per_s("asgd", job, 1, link) == pytest.approx(1000, rel=1e-6)
    for n in (2, 3, 8, 64):
        assert scaling.samples_per_s("asgd", job, n, link) <= min(1000 * n, 2000) * (1 + 1e-9)
    assert scaling.samples_per_s("asgd", job, 2, link) > 1000  # a second worker uses the idle direction
    assert scaling.samples_per_s("asgd", job, 1000, link) == pytest.approx(2000, rel=2e-3)
    assert scaling.samples_per_s("sync-ps", job, 8, link) == pytest.approx(1000, rel=1e-6)


def test_mean_value_analysis_of_the_machine_repairman(scaling) -> None:
    """One queue of demand D and n customers that think Z between visits (the machine-repairman
    model), by hand with n = 2, D = 1. Z = 0: a lone customer is always at the queue (1 there);
    the second finds it there, so each waits 2 and goes round in 2 (= n D: the queue never idles).
    Z = 1: a lone customer is at the queue half of its round of 2 (1/2 there); the second finds
    half a customer: 1.5 at the queue, a round of 2.5."""
    assert scaling.closed_network(2, [1.0], 0.0) == pytest.approx(2.0)
    assert scaling.closed_network(2, [1.0], 1.0) == pytest.approx(2.5)
    assert scaling.closed_network(1, [1.0, 2.0], 3.0) == pytest.approx(6.0)


def test_powersgd_sends_r_times_n_plus_m_for_a_matrix(scaling) -> None:
    """Rank r of an n x m matrix: P (n x r) and Q (m x r). 1024 x 1024 at rank 4: 8,192 values, not
    1,048,576 (128x fewer), plus a bias of 1,024 sent as it is."""
    job = scaling.Job(params=1024 * 1024 + 1024, compute=1e-3, batch=64, matrices=((1024, 1024),))
    nbytes, calls = scaling.compressed(job, "powersgd", 4)
    assert nbytes == 4 * (4 * 2048 + 1024) and calls == 2  # P and Q: two all-reduces
    assert scaling.compressed(job, "fp16", 0) == (2 * job.params, 1)


def test_the_cores_the_bench_shared(scaling) -> None:
    """Worker processes per core of a hosts.py row (the server's host left out)."""

    def row(config: str, cores: list[list[int]], processes: list[int]) -> dict:
        return {"config": config, "placement": [{"cores": c, "processes": p} for c, p in zip(cores, processes)]}

    assert scaling.sharing(row("allreduce", [[0], [1]], [1, 1])) == 1
    assert scaling.sharing(row("asgd", [[0], [1]], [1, 2])) == 2  # 2 hosts: both workers on host b
    assert scaling.sharing(row("allreduce", [[0], [1], [0], [1]], [1, 1, 1, 1])) == 2
    assert scaling.sharing(row("asgd", [[0], [1], [0], [1], [0]], [1, 1, 1, 1, 1])) == 2
