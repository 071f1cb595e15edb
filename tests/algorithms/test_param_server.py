"""The parameter server's update rules and accounting, driven directly (no RPC) in a chosen order."""

from __future__ import annotations

import time
from collections import Counter

import pytest
import torch
from torch import nn

from distsgd.algorithms.averaging import flatten
from distsgd.algorithms.param_server import ParameterServer, staleness_stats
from distsgd.config import RunConfig, resolve


def make_server(mode: str, workers: int = 2, **settings) -> ParameterServer:
    """The core of algorithm ``mode``'s server, with its rule; ``settings``: common ones and its options."""
    from distsgd.algorithms import registry

    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    algo_cls = registry.get(mode)
    names = algo_cls.Options.names()
    options = {k: v for k, v in settings.items() if k in names}
    cfg = resolve(
        RunConfig(
            **{"lr": 0.1, "momentum": 0.0, **{k: v for k, v in settings.items() if k not in names}}, options=options
        )
    )
    rule = algo_cls.topology.rule(cfg, algo_cls.Options.from_mapping(options))
    return ParameterServer(cfg, model, workers, rule)


def grad(seed: int, n: int = 8) -> torch.Tensor:
    return torch.randn(n, generator=torch.Generator().manual_seed(seed))


def result(fut):
    assert fut.done()
    return fut.wait()


def test_asgd_staleness_under_a_controlled_interleaving() -> None:
    ps = make_server("asgd")
    _, v1 = ps.pull(1)
    _, v2 = ps.pull(2)
    _, v1, *_ = result(ps.push(1, grad(1), v1, 10))  # read v0, server at v0: staleness 0
    _, v2, *_ = result(ps.push(2, grad(2), v2, 10))  # read v0, server at v1: staleness 1
    _, v1, *_ = result(ps.push(1, grad(3), v1, 20))  # read v1, server at v2: staleness 1
    _, _, total, _ = result(ps.push(1, grad(4), v1, 30))  # read v3, server at v3: staleness 0
    _, _, _, _ = result(ps.push(2, grad(5), v2, 20))  # read v2, server at v4: staleness 2
    assert ps.staleness == Counter({0: 2, 1: 2, 2: 1})
    assert ps.version == 5 and total == 40 and ps.total_samples() == 50
    stats = ps.staleness_summary()
    assert stats == {"mean": 0.8, "p50": 1, "p99": 2, "max": 2, "histogram": {"0": 2, "1": 2, "2": 1}}


def test_asgd_applies_sgd_and_staleness_aware_lr() -> None:
    for aware in (False, True):
        ps = make_server("asgd", staleness_lr=aware)
        w0, _ = ps.pull(1)
        ps.push(2, grad(9), 0, 1)  # version 1
        ps.push(2, grad(8), 1, 2)  # version 2
        before = flatten(list(ps.model.parameters())).clone()
        after, *_ = result(ps.push(1, grad(1), 0, 1))  # staleness 2
        lr = 0.1 / 2 if aware else 0.1
        torch.testing.assert_close(after, before - lr * grad(1))


def test_staleness_aware_rule_divides_the_gradient_not_momentum_or_weight_decay() -> None:
    """Zhang et al. (IJCAI 2016) scale the stale gradient by 1/tau. With momentum mu and weight
    decay wd, SGD then takes buf <- mu buf + (g / tau + wd w), w <- w - lr buf (float64 here);
    dividing the lr instead would also divide the momentum history and the decay."""
    mu, wd, lr = 0.9, 0.01, 0.1
    ps = make_server("asgd", staleness_lr=True, momentum=mu, weight_decay=wd)
    w = flatten(list(ps.model.parameters())).double()
    result(ps.push(2, grad(9), 0, 1))  # staleness 0: buf = g9 + wd w
    buf = grad(9).double() + wd * w
    w = w - lr * buf
    result(ps.push(2, grad(8), 1, 2))  # staleness 0
    buf = mu * buf + grad(8).double() + wd * w
    w = w - lr * buf
    after, *_ = result(ps.push(1, grad(1), 0, 1))  # read version 0, server at 2: tau = 2
    buf = mu * buf + grad(1).double() / 2 + wd * w
    w = w - lr * buf
    torch.testing.assert_close(after.double(), w, rtol=1e-5, atol=1e-6)


class MXNetDCASGD:
    """MXNet's DCASGD optimizer as published (apache/incubator-mxnet,
    python/mxnet/optimizer/dcasgd.py, ``DCASGD.update``), in float64, for one weight:

        mom[:] *= momentum
        mom[:] += -lr * (grad + wd * weight + lamda * grad * grad * (weight - previous_weight))
        previous_weight[:] = weight
        weight[:] += mom

    ``previous_weight`` is MXNet's per-key state: the weight before the last update, whoever made
    it. Zheng et al. (ICML 2017, Algorithm 2) keep a backup w_bak(m) per worker m instead, set
    when m reads; the two agree when two workers strictly alternate, each reading the weights
    its previous push returned (then w_bak(m) is the weight before the other's update)."""

    def __init__(self, weight: torch.Tensor, lr: float, momentum: float, wd: float, lamda: float) -> None:
        self.weight, self.previous = weight.double().clone(), weight.double().clone()
        self.mom = torch.zeros_like(self.weight)
        self.lr, self.momentum, self.wd, self.lamda = lr, momentum, wd, lamda

    def update(self, grad: torch.Tensor) -> torch.Tensor:
        g = grad.double()
        self.mom = self.momentum * self.mom - self.lr * (
            g + self.wd * self.weight + self.lamda * g * g * (self.weight - self.previous)
        )
        self.previous = self.weight.clone()
        self.weight = self.weight + self.mom
        return self.weight


@pytest.mark.parametrize("lamda", [0.04, 2.0])
def test_dcasgd_matches_mxnets_rule_with_two_alternating_workers(lamda: float) -> None:
    """Two workers push in turn, each on the weights its last push returned (staleness 1), with
    momentum and weight decay. A plausible wrong rule fails: compensating with the other worker's
    read (w - w_read of the wrong rank), the sign flipped (w_read - w), or g instead of g * g: each
    is checked to land far from the reference, so agreement is not an accident."""
    lr, mu, wd = 0.1, 0.5, 0.01
    ps = make_server("dcasgd", lr=lr, momentum=mu, weight_decay=wd, dc_lambda=lamda)
    start = flatten(list(ps.model.parameters()))
    ref = MXNetDCASGD(start, lr, mu, wd, lamda)
    reads = {1: ps.pull(1), 2: ps.pull(2)}  # both read version 0
    got = None
    for k in range(12):
        rank = 1 + k % 2
        g = grad(100 + k) * (1 + k / 4)  # growing gradients: the correction matters
        weights, version, *_ = result(ps.push(rank, g, reads[rank][1], k + 1))
        reads[rank] = (weights, version)
        got = weights.double()
        torch.testing.assert_close(got, ref.update(g), rtol=1e-5, atol=1e-6)
    assert ps.staleness[1] == 11  # every push but the first was one version behind

    def mutant(kind: str) -> torch.Tensor:
        w, mom = start.double().clone(), torch.zeros_like(start, dtype=torch.float64)
        read = {1: w.clone(), 2: w.clone()}
        for k in range(12):
            rank, other = 1 + k % 2, 2 - k % 2
            g = (grad(100 + k) * (1 + k / 4)).double()
            w_read = read[other] if kind == "other's read" else read[rank]
            diff = w_read - w if kind == "sign" else w - w_read
            gg = g if kind == "g" else g * g
            mom = mu * mom - lr * (g + wd * w + lamda * gg * diff)
            w = w + mom
            read[rank] = w.clone()
        return w

    for kind in ("other's read", "sign", "g"):
        assert float((mutant(kind) - got).abs().max()) > 1e-3, kind


def test_dcasgd_adaptive_follows_the_paper() -> None:
    """DC-ASGD-a (Zheng et al. 2017, section 4.2): lambda_t = lambda0 / sqrt(MeanSquare(t) + eps),
    MeanSquare(t) = m MeanSquare(t-1) + (1 - m) g_t^2 with m = 0.95 and MeanSquare(0) = 0, for
    every pushed gradient, element by element; here with the paper's lambda0 = 2 and a worker that
    read before the other's update (staleness 1). A constant lambda0 instead of the adaptive one
    would land elsewhere (checked)."""
    ps = make_server("dcasgd", dc_adaptive=True)
    w_read, v = ps.pull(1)
    ps.pull(2)
    result(ps.push(2, grad(2), 0, 1))  # worker 2 moves the weights on
    w = flatten(list(ps.model.parameters())).double()
    g2, g = grad(2).double(), grad(1).double()
    meansq = 0.95 * (0.05 * g2**2) + 0.05 * g**2
    lam = 2.0 / torch.sqrt(meansq + 1e-7)
    expected = w - 0.1 * (g + lam * g * g * (w - w_read.double()))
    after, *_ = result(ps.push(1, grad(1), v, 1))
    torch.testing.assert_close(after.double(), expected, rtol=1e-6, atol=1e-7)
    constant = w - 0.1 * (g + 2.0 * g * g * (w - w_read.double()))
    assert float((constant - after.double()).abs().max()) > 1e-3


def test_dcasgd_adaptive_keeps_the_mean_square_of_a_parameter_absent_from_a_push() -> None:
    """A push without the bias (no gradient of it on the worker: frozen, or unused): the bias's
    MeanSquare is left as it was, as a torch optimiser leaves the state of a parameter whose
    gradient is None (RMSprop's square_avg, Adam's exp_avg_sq), and the bias does not move; the
    weight's follows the paper's rule. Before, the absent bias's MeanSquare decayed by m = 0.95."""
    ps = make_server("dcasgd", dc_adaptive=True)
    ps.pull(1)
    ps.pull(2)
    _, v, *_ = result(ps.push(2, grad(2), 0, 1))
    bias_before = ps.model.bias.detach().clone()
    result(ps.push(1, grad(1), v, 1, present=[True, False]))  # nn.Linear(3, 2): weight (6), bias (2)
    g2, g = grad(2), grad(1)
    assert ps.rule.meansq is not None
    torch.testing.assert_close(ps.rule.meansq[:6], 0.95 * (0.05 * g2[:6] ** 2) + 0.05 * g[:6] ** 2)
    torch.testing.assert_close(ps.rule.meansq[6:], 0.05 * g2[6:] ** 2)
    assert torch.equal(ps.model.bias.detach(), bias_before)


def test_sync_ps_waits_for_everyone_then_steps_with_the_mean() -> None:
    ps = make_server("sync-ps")
    w0, _ = ps.pull(1)
    first = ps.push(1, grad(1), 0, 5)
    assert not first.done() and ps.version == 0
    second = ps.push(2, grad(2), 0, 5)
    w1, version, total, _ = result(first)
    assert result(second)[1] == version == 1 and total == 10
    torch.testing.assert_close(w1, w0 - 0.1 * (grad(1) + grad(2)) / 2)
    assert ps.staleness == Counter({0: 2})


def test_sync_ps_carries_on_without_a_dead_worker() -> None:
    ps = make_server("sync-ps")
    waiting = ps.push(1, grad(1), 0, 5)
    assert not waiting.done()
    ps.finished(2)  # worker 2 died
    assert result(waiting)[1] == 1


def test_ssp_holds_a_worker_that_runs_too_far_ahead() -> None:
    ps = make_server("ssp", staleness=1)
    result(ps.push(1, grad(1), 0, 1))  # clocks 1 : 0 -> within the bound
    held = ps.push(1, grad(2), 1, 2)  # clocks 2 : 0 -> 2 ahead of the slowest
    assert not held.done() and ps.version == 2  # applied, but the worker waits
    result(ps.push(2, grad(3), 0, 1))  # clocks 2 : 1 -> released
    weights, version, *_ = result(held)
    assert version == 3  # it goes on with the newest weights
    torch.testing.assert_close(weights, flatten(list(ps.model.parameters())))
    ps.finished(2)
    result(ps.push(1, grad(4), version, 3))  # alone now: never held


def test_staleness_stats_empty_and_quantiles() -> None:
    assert staleness_stats(Counter())["mean"] is None
    stats = staleness_stats(Counter({0: 98, 7: 2}))
    assert (stats["p50"], stats["p99"], stats["max"]) == (0, 7, 7)


def test_dcasgd_lambda_defaults_are_the_papers() -> None:
    from distsgd.algorithms.param_server import dc_lambda
    from distsgd.algorithms.param_server.worker import DCASGDOptions

    assert dc_lambda(DCASGDOptions()) == 0.04  # DC-ASGD-c
    assert dc_lambda(DCASGDOptions(dc_adaptive=True)) == 2.0  # DC-ASGD-a's lambda0
    assert dc_lambda(DCASGDOptions(dc_adaptive=True, dc_lambda=0.5)) == 0.5


def test_replies_are_completed_outside_the_lock() -> None:
    """A reply's Future is completed (and so serialised by RPC) only once the server's lock is free."""
    ps = make_server("sync-ps")
    seen = []
    first = ps.push(1, grad(1), 0, 5)
    first.then(lambda f: seen.append(ps.lock.locked()))
    ps.push(2, grad(2), 0, 5)  # completes the round, and both futures
    assert first.done() and seen == [False]


def test_the_start_barrier_waits_for_every_live_worker_then_lets_a_late_one_through() -> None:
    """A replacement (--restart-workers) joins a server that started long ago: it must not wait for
    workers that passed the start long ago (under ssp they would soon wait for it in turn)."""
    ps = make_server("ssp", staleness=1)
    first = ps.barrier()
    assert not first.done()
    second = ps.barrier()
    assert first.done() and second.done()
    ps.finished(2)  # worker 2 dies; its replacement joins and calls the start barrier
    ps.rejoin(2)
    assert ps.barrier().done()


class _Role:
    """What the transport tells the role, recorded."""

    def __init__(self) -> None:
        self.said: list[tuple] = []

    def worker_hello(self, rank: int, rejoining: bool) -> None:
        self.said.append(("hello", rank))

    def worker_done(self, rank: int, samples: int) -> None:
        self.said.append(("done", rank))

    def worker_gone(self, rank: int, why: str) -> None:
        self.said.append(("gone", rank))

    def leave(self, rank: int, why: str) -> None:  # the transport's half of worker_gone
        self.said.append(("gone", rank))

    def commit_after(self, taken: None) -> None:
        pass


def _closed_by_server(sock) -> bool:
    sock.settimeout(10)
    return sock.recv(1) == b""  # an orderly close, no answer


SECRET = bytes(range(32))


@pytest.mark.parametrize(
    "head",
    [[0, 3, 0, 0], [0, 0, 0, 0], [0, -1, 0, 0], [1, 0, 0, 0], [99, 0, 0, 0]],
    ids=["hello-rank-3-of-2", "hello-rank-0", "hello-rank-minus-1", "pull-before-hello", "unknown-op"],
)
def test_the_server_drops_a_connection_that_says_nonsense(head: list[int]) -> None:
    """A HELLO must name a worker rank 1..N, and come first; an unknown request ends the connection.
    (A wrong HELLO used to be taken as rank -1 or an index past the counters.)"""
    import socket
    import struct

    from distsgd.algorithms.param_server import transport, wire

    ps, role = make_server("asgd"), _Role()
    layout = wire.Layout.of(ps.model, ps.hypers.count)
    service = transport.Service(ps, role, layout, "127.0.0.1:0", secret=SECRET)
    service.start()
    try:
        host, port = service.address.rsplit(":", 1)
        with socket.create_connection((host, int(port))) as sock:
            if head[0] == 99:  # a proper HELLO first
                sock.sendall(wire.hello_message(1, SECRET, groups=ps.hypers.describe()))
                wire.Frame(layout.answer_bytes).recv(transport.Channel(sock))
                wire.Frame(layout.request_bytes).send(transport.Channel(sock), *head)
            else:
                sock.sendall(struct.pack("4q", *head) + SECRET)
            assert _closed_by_server(sock)
        if head[0] == 99:
            assert role.said == [("hello", 1), ("gone", 1)]  # a worker that said nonsense is gone
        else:
            assert role.said == [] and ps.counts == [0, 0, 0] and service.refused == 1
    finally:
        service.close()


def test_a_silent_worker_counts_as_gone_after_the_timeout() -> None:
    import socket
    import time

    from distsgd.algorithms.param_server import transport, wire

    ps, role = make_server("asgd"), _Role()
    layout = wire.Layout.of(ps.model, ps.hypers.count)
    service = transport.Service(ps, role, layout, "127.0.0.1:0", silence_s=0.5, secret=SECRET)
    service.start()
    try:
        host, port = service.address.rsplit(":", 1)
        with socket.create_connection((host, int(port))) as sock:
            channel = transport.Channel(sock)
            start = time.monotonic()  # before the server can start counting
            channel.send(wire.hello_message(2, SECRET, groups=ps.hypers.describe()))
            wire.Frame(layout.answer_bytes).recv(channel)
            assert _closed_by_server(sock)  # then nothing more is said
            assert time.monotonic() - start >= 0.45
        assert role.said == [("hello", 2), ("gone", 2)]
    finally:
        service.close()


def test_a_busy_worker_is_not_silent() -> None:
    """A worker that computes for longer than the timeout between two requests (a long step, a
    checkpoint, --tau EASGD steps) keeps its connection: its client PINGs while it is quiet. (The
    server used to drop it.)"""
    import time

    from distsgd.algorithms.param_server import transport, wire

    ps, role = make_server("asgd"), _Role()
    layout = wire.Layout.of(ps.model, ps.hypers.count)
    service = transport.Service(ps, role, layout, "127.0.0.1:0", silence_s=0.4, secret=SECRET)
    service.start()
    try:
        weights = torch.zeros(sum(p.numel() for p in ps.model.parameters()))
        client = transport.Client(1, weights, layout, service.address, timeout_s=0.4, secret=SECRET, hypers=ps.hypers)
        time.sleep(1.5)  # busy, silent in its own thread
        assert client.pull() == ps.version and torch.equal(weights, flatten(list(ps.model.parameters())))
        assert role.said == [("hello", 1)]
        hello, pull = len(wire.hello_message(1, SECRET, groups=ps.hypers.describe())), 32 + layout.request_bytes
        assert client.bytes_sent >= hello + pull + 32  # a HELLO, a pull, and at least one 32-byte PING
        client.done(0)
    finally:
        service.close()


# --- A server admits only its own run's workers (issue 27). On 767cbe8 a HELLO carried no secret,
# a second HELLO for a live rank took its place, sample counts and versions were trusted, NaN was
# applied, connections were not capped and an accept() error ended the acceptor for good.


def _serving(**kwargs):
    from distsgd.algorithms.param_server import transport, wire

    ps, role = make_server("asgd", batch_size=8), _Role()
    layout = wire.Layout.of(ps.model, ps.hypers.count)
    service = transport.Service(ps, role, layout, "127.0.0.1:0", secret=SECRET, **kwargs)
    return ps, role, layout, service


def _client(ps, layout, service, rank: int = 1, secret: bytes = SECRET):
    from distsgd.algorithms.param_server import transport

    weights = torch.zeros(sum(p.numel() for p in ps.model.parameters()))
    client = transport.Client(rank, weights, layout, service.address, timeout_s=5, secret=secret, hypers=ps.hypers)
    return client, weights


def _connect(service):
    import socket

    host, port = service.address.rsplit(":", 1)
    return socket.create_connection((host, int(port)))


def test_a_hello_without_the_run_secret_is_refused() -> None:
    from distsgd.algorithms.param_server import wire

    ps, role, layout, service = _serving()
    service.start()
    try:
        with _connect(service) as sock:
            sock.sendall(wire.hello_message(1, b"not the secret"))
            assert _closed_by_server(sock)
        assert role.said == [] and service.refused == 1
        client, _ = _client(ps, layout, service)  # the real worker still gets in
        assert client.pull() == 0
        client.done(0)
    finally:
        service.close()


def test_a_worker_whose_optimiser_is_not_the_servers_is_refused_in_one_line() -> None:
    """Its HELLO describes its optimiser's parameter groups; the server answers one whose groups are
    not its own with its own (the worker says how they differ) and admits nothing of it."""
    from distsgd.algorithms.param_server import transport, wire
    from distsgd.algorithms.param_server.hyper import Hyperparameters
    from distsgd.errors import ConfigError

    ps, role, layout, service = _serving()
    service.start()
    try:
        model = ps.model
        split = torch.optim.SGD([{"params": [model.weight]}, {"params": [model.bias]}], lr=0.1)
        theirs = Hyperparameters.of(split, model)
        weights = torch.zeros(sum(p.numel() for p in model.parameters()))
        with pytest.raises(ConfigError) as refused:
            transport.Client(
                1, weights, wire.Layout.of(model, theirs.count), service.address, 5, secret=SECRET, hypers=theirs
            )
        assert str(refused.value).startswith(
            "the parameter server refused worker 0: its optimiser does not match the server's "
            "(it has 2 parameter groups, the server's optimiser 1); "
        )
        assert "\n" not in str(refused.value)
        deadline = time.monotonic() + 5  # the server counts it after its answer, which the worker may read first
        while service.refused < 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert role.said == [] and service.refused == 1
        client, _ = _client(ps, layout, service)  # the real worker still gets in
        assert client.pull() == 0 and role.said == [("hello", 1)]
        client.done(0)
    finally:
        service.close()


@pytest.mark.parametrize("groups", [2**40, -1, 1], ids=["2**40 groups", "-1 groups", "one forged group"])
def test_a_hello_that_lies_about_its_groups_is_answered_and_closed(groups: int) -> None:
    """The server reads no more groups than its own optimiser has (a count of 2**40 is not waited
    for, nor allocated); it answers with its own groups, then closes."""
    import struct

    from distsgd.algorithms.param_server import wire

    ps, role, layout, service = _serving()
    service.start()
    try:
        with _connect(service) as sock:
            forged = struct.pack("4q", wire.HELLO, 1, groups, 0) + SECRET
            sock.sendall(forged + (struct.pack("3q", 0b1011, 2, 12345) if groups == 1 else b""))
            sock.settimeout(10)
            answer = sock.recv(4096)
            assert answer == wire.refusal_message(ps.hypers.describe())
            assert _closed_by_server(sock)
        assert role.said == [] and service.refused == 1 and ps.counts == [0, 0, 0]
    finally:
        service.close()


def test_a_second_hello_for_a_connected_worker_does_not_take_its_place() -> None:
    from distsgd.algorithms.param_server import wire

    ps, role, layout, service = _serving()
    service.start()
    try:
        client, weights = _client(ps, layout, service)
        with _connect(service) as sock:
            sock.sendall(wire.hello_message(1, SECRET, groups=ps.hypers.describe()))
            assert _closed_by_server(sock)
        assert client.pull() == 0 and torch.equal(weights, flatten(list(ps.model.parameters())))
        assert role.said == [("hello", 1)]
        client.done(0)
    finally:
        service.close()


LIES = {  # version, samples, the optimiser's [lr, momentum, weight_decay]
    "2**62 samples": (1, 2**62, [0.1, 0.0, 0.0]),
    "fewer samples": (1, 4, [0.1, 0.0, 0.0]),
    "a future version": (99, 16, [0.1, 0.0, 0.0]),
    "a nan lr": (1, 16, [float("nan"), 0.0, 0.0]),
    "a negative lr": (1, 16, [-1e30, 0.0, 0.0]),
    "an infinite weight decay": (1, 16, [0.1, 0.0, float("inf")]),
}


@pytest.mark.parametrize("lie", list(LIES))
def test_a_push_that_lies_ends_that_connection_and_changes_nothing(lie: str) -> None:
    """At most batch_size x accumulate more samples a message; never fewer; a version the server
    made; hyperparameters the optimiser can step with (finite, lr >= 0, ...)."""
    ps, role, layout, service = _serving()
    service.start()
    try:
        client, _ = _client(ps, layout, service)
        grads = [torch.ones_like(p) for p in ps.model.parameters()]
        client.push(grads, 0, 8, None, [0.1, 0.0, 0.0])  # honest: one batch of 8
        before = flatten(list(ps.model.parameters())).clone()
        version, samples, hypers = LIES[lie]
        with pytest.raises(ConnectionError):
            client.push(grads, version, samples, None, hypers)
        deadline = time.monotonic() + 5
        while ("gone", 1) not in role.said and time.monotonic() < deadline:
            time.sleep(0.01)
        assert role.said == [("hello", 1), ("gone", 1)]
        assert ps.version == 1 and ps.counts[1] == 8 and torch.equal(flatten(list(ps.model.parameters())), before)
        assert ps.optimizer.param_groups[0]["lr"] == 0.1
        client.close()
    finally:
        service.close()


def test_a_push_whose_presence_is_not_0_or_1_is_refused_and_changes_nothing() -> None:
    """A push says, one byte a parameter, which have a gradient (1) and which have none (0: frozen or
    unused in the forward). A forged byte of 2 ends that connection, as any other malformed request;
    the same frame with a 1 there is applied."""
    import socket

    from distsgd.algorithms.param_server import transport, wire

    ps, role, layout, service = _serving()
    service.start()
    try:
        host, port = service.address.rsplit(":", 1)
        with socket.create_connection((host, int(port))) as sock:
            channel = transport.Channel(sock)
            sock.sendall(wire.hello_message(1, SECRET, groups=ps.hypers.describe()))
            answer = wire.Frame(layout.answer_bytes)
            answer.recv(channel)
            push = wire.Frame(layout.request_bytes)
            layout.params.whole(push).fill_(1.0)
            layout.hypers.whole(push).copy_(torch.tensor([0.1, 0.0, 0.0], dtype=torch.float64))
            layout.present.whole(push).copy_(torch.tensor([1, 1], dtype=torch.uint8))
            push.send(channel, wire.PUSH, 0, 8, 0)
            assert answer.recv(channel)[0] == 1  # honest: applied, version 1
            before = flatten(list(ps.model.parameters())).clone()
            layout.present.whole(push).copy_(torch.tensor([1, 2], dtype=torch.uint8))
            push.send(channel, wire.PUSH, 1, 16, 0)
            assert _closed_by_server(sock)
        deadline = time.monotonic() + 5
        while ("gone", 1) not in role.said and time.monotonic() < deadline:
            time.sleep(0.01)
        assert role.said == [("hello", 1), ("gone", 1)]
        assert ps.version == 1 and ps.counts[1] == 8 and torch.equal(flatten(list(ps.model.parameters())), before)
    finally:
        service.close()


class _Plain:
    """Plain PyTorch's SGD (lr 0.1, momentum 0.9, weight decay 0.01) on a copy of ``model``."""

    def __init__(self, model: nn.Linear) -> None:
        self.model = nn.Linear(3, 2)
        self.model.load_state_dict(model.state_dict())
        self.opt = torch.optim.SGD(self.model.parameters(), lr=0.1, momentum=0.9, weight_decay=0.01)

    def step(self, grads: list[torch.Tensor | None]) -> torch.Tensor:
        """One step with these ``.grad``s (None: no gradient, skipped); the weights, flat."""
        for p, g in zip(self.model.parameters(), grads):
            p.grad = None if g is None else g.view_as(p).clone()
        self.opt.step()
        return flatten(list(self.model.parameters())).detach()


@pytest.mark.parametrize("mode", ["asgd", "ssp", "dcasgd"])
def test_a_parameter_absent_from_an_asynchronous_push_is_not_stepped(mode: str) -> None:
    """Absent (no gradient on the worker): ``.grad`` None in that step, so the optimiser skips it, no
    weight decay, no momentum, whatever the frame held there; present ones step as plain PyTorch."""
    ps = make_server(mode, momentum=0.9, weight_decay=0.01)
    plain, hypers = _Plain(ps.model), ps.hypers.read(ps.optimizer)
    ps.pull(1), ps.pull(2)
    g = grad(1)
    expected = plain.step([g[:6], None])
    result(ps.push(1, g.clone(), 0, 5, hypers=hypers, present=[True, False]))
    torch.testing.assert_close(flatten(list(ps.model.parameters())).detach(), expected, rtol=0, atol=1e-7)
    before = flatten(list(ps.model.parameters())).detach().clone()
    result(ps.push(2, grad(2), 0, 5, hypers=hypers, present=[False, False]))  # nothing to step
    assert torch.equal(flatten(list(ps.model.parameters())).detach(), before)
    assert "momentum_buffer" not in ps.optimizer.state[ps.model.bias]


def test_sync_ps_averages_with_zeros_for_the_absent_and_skips_what_no_push_has() -> None:
    """As DDP: the round's mean counts a worker without a parameter's gradient as zero; a parameter
    no worker of the round has gets no ``.grad`` (the optimiser skips it: its momentum too)."""
    ps = make_server("sync-ps", momentum=0.9, weight_decay=0.01)
    plain, hypers = _Plain(ps.model), ps.hypers.read(ps.optimizer)
    g1, g2 = grad(1), grad(2)
    expected = plain.step([(g1[:6] + g2[:6]) / 2, g2[6:] / 2])
    ps.push(1, g1.clone(), 0, 5, hypers=hypers, present=[True, False])
    result(ps.push(2, g2.clone(), 0, 5, hypers=hypers, present=[True, True]))
    torch.testing.assert_close(flatten(list(ps.model.parameters())).detach(), expected, rtol=0, atol=1e-7)
    weight = ps.model.weight.detach().clone()
    expected = plain.step([None, (g1[6:] + g2[6:]) / 2])
    ps.push(1, g1.clone(), 1, 10, hypers=hypers, present=[False, True])
    result(ps.push(2, g2.clone(), 1, 10, hypers=hypers, present=[False, True]))
    assert torch.equal(ps.model.weight.detach(), weight)
    torch.testing.assert_close(flatten(list(ps.model.parameters())).detach(), expected, rtol=0, atol=1e-7)


@pytest.mark.parametrize("accept", [False, True])
def test_a_nan_gradient_is_not_applied_unless_the_user_accepts_it(accept: bool) -> None:
    from distsgd.algorithms.param_server import transport, wire
    from distsgd.algorithms.param_server.core import ParameterServer

    base = make_server("asgd", batch_size=8)
    ps = ParameterServer(base.cfg, base.model, 2, base.rule, accept_nonfinite=accept)
    role, layout = _Role(), wire.Layout.of(ps.model, ps.hypers.count)
    service = transport.Service(ps, role, layout, "127.0.0.1:0", secret=SECRET)
    service.start()
    try:
        client, weights = _client(ps, layout, service)
        grads = [torch.full_like(p, float("nan")) for p in ps.model.parameters()]
        client.push(grads, 0, 8, None, ps.hypers.read(ps.optimizer))
        assert bool(torch.isfinite(weights).all()) is not accept
        assert ps.nonfinite == (0 if accept else 1)
        client.push(
            [torch.ones_like(p) for p in ps.model.parameters()], 1, 16, None, ps.hypers.read(ps.optimizer)
        )  # it goes on
        client.done(16)
    finally:
        service.close()


def test_a_flood_of_silent_connections_does_not_keep_a_worker_out() -> None:
    """Past ``max_pending`` connections waiting to say HELLO, a new one closes the oldest: the
    strangers cannot hold every place, and a real worker (HELLO at once) gets in while they try."""
    ps, role, layout, service = _serving(max_pending=3)
    service.start()
    try:
        held = [_connect(service) for _ in range(3)]  # silent: no HELLO
        held.append(_connect(service))  # the fourth: the oldest goes
        assert _closed_by_server(held[0])
        client, _ = _client(ps, layout, service)  # evicts another stranger, says HELLO, is in
        assert client.pull() == 0 and role.said == [("hello", 1)]
        assert _closed_by_server(held[1])
        deadline = time.monotonic() + 5
        while service.refused < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert service.refused == 2
        client.done(0)
        for s in held:
            s.close()
    finally:
        service.close()


def test_a_connection_that_trickles_its_hello_is_dropped_at_the_deadline(monkeypatch) -> None:
    """Each byte arrives well within any read timeout; the HELLO as a whole must arrive in time."""
    from distsgd.algorithms.param_server import transport

    monkeypatch.setattr(transport, "HELLO_DEADLINE_S", 0.5)
    ps, role, layout, service = _serving(silence_s=5.0)
    service.start()
    try:
        with _connect(service) as trickler:
            start = time.monotonic()
            closed = False
            while time.monotonic() - start < 5 and not closed:
                try:
                    trickler.send(b"\0")
                except OSError:
                    closed = True
                time.sleep(0.1)
                trickler.setblocking(False)
                try:
                    closed = closed or trickler.recv(1) == b""
                except BlockingIOError:
                    pass
                except OSError:
                    closed = True
                trickler.setblocking(True)
            assert closed and time.monotonic() - start < 2
        assert service.refused == 1 and role.said == []
    finally:
        service.close()


class _FlakyListener:
    """A listening socket whose first accept()s fail as when the process is out of file descriptors."""

    def __init__(self, sock, failures: int) -> None:
        self.sock, self.failures = sock, failures

    def accept(self):
        import errno

        if self.failures:
            self.failures -= 1
            raise OSError(errno.EMFILE, "Too many open files")
        return self.sock.accept()

    def __getattr__(self, name: str):
        return getattr(self.sock, name)


def test_the_acceptor_survives_accept_errors() -> None:
    ps, role, layout, service = _serving()
    service.listener = _FlakyListener(service.listener, failures=3)
    service.start()
    try:
        client, _ = _client(ps, layout, service)
        assert client.pull() == 0
        client.done(0)
    finally:
        service.close()


def test_saved_buffers_that_do_not_fit_the_model_are_a_checkpoint_error() -> None:
    """The server saves each worker's buffers as one flat tensor per buffer. Saved otherwise (one
    flat tensor of them all, as before 192b611), they are refused with a CheckpointError, not cut
    up or indexed as if they fitted."""
    from distsgd.algorithms import registry
    from distsgd.errors import CheckpointError

    cfg = resolve(RunConfig(lr=0.1))
    rule = registry.get("asgd").topology.rule(cfg, registry.get("asgd").Options())

    def server() -> ParameterServer:
        torch.manual_seed(0)
        return ParameterServer(cfg, nn.Sequential(nn.Linear(3, 2), nn.BatchNorm1d(2)), 2, rule)

    ps = server()
    floats = [torch.full((2,), 0.5), torch.full((2,), 2.0)]  # running mean and var
    _, version = ps.pull(1)
    result(ps.push(1, grad(1, n=12), version, 10, (floats, [torch.tensor([3])])))
    state = ps.state_dict()
    server().load_state_dict(state)  # as saved: loads
    state["buffers"]["1"] = torch.cat(state["buffers"]["1"])
    with pytest.raises(CheckpointError, match="saved buffers do not fit its model"):
        server().load_state_dict(state)
