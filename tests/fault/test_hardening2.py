"""Hardening II (issue 38), the parameter server's side: every wait on either end of its socket
has a deadline or a liveness check, and a run whose workers finished is never lost.

Each test failed on main 43f33af (before this work); the docstrings say how. Forged frames carry
the run's secret, as a test harness that built the server knows it.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from distsgd import checkpoint
from distsgd.algorithms.param_server import ParameterServer, transport, wire
from distsgd.config import RunConfig, resolve
from helpers import free_port, progress_seen, wait_for

pytest.importorskip("sklearn")

SECRET = bytes(range(32))
SMALL = ["--dataset", "digits", "--batch-size", "16", "--lr", "0.05"]


def _core(algo: str, workers: int = 2) -> ParameterServer:
    from distsgd.algorithms import registry

    torch.manual_seed(0)
    cfg = resolve(RunConfig(lr=0.1, batch_size=8))
    algo_cls = registry.get(algo)
    rule = algo_cls.topology.rule(cfg, algo_cls.Options.from_mapping({}))
    return ParameterServer(cfg, torch.nn.Linear(3, 2), workers, rule)


class _Role:
    """What the transport tells the role, recorded."""

    def __init__(self) -> None:
        self.said: list[tuple] = []

    def worker_hello(self, rank: int, rejoining: bool) -> None:
        self.said.append(("hello", rank))

    def worker_done(self, rank: int, samples: int) -> None:
        self.said.append(("done", rank))

    def leave(self, rank: int, why: str) -> None:
        self.said.append(("gone", rank))

    def commit_after(self, taken: None) -> None:
        pass


def _serve(ps: ParameterServer, role=None, silence_s: float | None = 5.0) -> transport.Service:
    service = transport.Service(
        ps,
        role or _Role(),
        wire.Layout.of(ps.model, ps.hypers.count),
        "127.0.0.1:0",
        silence_s=silence_s,
        secret=SECRET,
    )
    service.start()
    return service


def _client(
    ps: ParameterServer, service: transport.Service, rank: int, timeout_s: float = 5.0, rejoining: bool = False
) -> transport.Client:
    weights = torch.zeros(sum(p.numel() for p in ps.model.parameters()))
    return transport.Client(
        rank,
        weights,
        wire.Layout.of(ps.model, ps.hypers.count),
        service.address,
        timeout_s=timeout_s,
        rejoining=rejoining,
        secret=SECRET,
        hypers=ps.hypers,
    )


def _connect(address: str) -> socket.socket:
    host, port = address.rsplit(":", 1)
    sock = socket.create_connection((host, int(port)))
    sock.settimeout(10)
    return sock


def _closed_by_server(sock: socket.socket) -> bool:
    """True if the server closed the connection without a word (an answer would be bytes)."""
    sock.settimeout(10)
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True


# --- 1. A thread that cannot start ------------------------------------------------------------


def _no_threads_for_connections(monkeypatch: pytest.MonkeyPatch) -> None:
    """``Thread.start`` fails, as at a cgroup's pids.max, for the server's per-connection threads."""
    start = threading.Thread.start

    def failing(self: threading.Thread) -> None:
        if getattr(getattr(self, "_target", None), "__name__", "") == "_serve":
            raise RuntimeError("can't start new thread")
        start(self)

    monkeypatch.setattr(threading.Thread, "start", failing)


def test_a_connection_whose_thread_cannot_start_is_closed_and_the_server_goes_on(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """On 43f33af the first failure ended the acceptor thread (the flood's connections then waited
    unanswered, and so would a replacement worker), and ``close()`` raised joining the thread that
    never started: the server process failed with the run's result."""
    caplog.set_level(logging.WARNING)  # an earlier in-process --quiet run may have raised the root's level
    ps = _core("asgd")
    service = _serve(ps)
    try:
        first = _client(ps, service, 1)
        _no_threads_for_connections(monkeypatch)
        flood = [_connect(service.address) for _ in range(10)]
        assert all(_closed_by_server(s) for s in flood)
        monkeypatch.undo()
        late = _client(ps, service, 2)  # a worker joining later (a replacement) still gets in
        assert late.pull() == first.pull() == ps.version
        assert service.acceptor.is_alive() and service.refused == 10
        first.done(0)
        late.done(0)
        for s in flood:
            s.close()
    finally:
        service.close()  # does not raise
    warned = [r for r in caplog.records if "could not start a thread" in r.getMessage()]
    assert len(warned) == 1  # ten failures in a second: one line


NO_THREADS_MODEL = """
import os, threading
import torch.nn as nn

_start = threading.Thread.start

def start(self):  # the server's per-connection threads cannot start once the flag file exists
    if getattr(getattr(self, "_target", None), "__name__", "") == "_serve" and os.path.exists(os.environ["NO_THREADS"]):
        raise RuntimeError("can't start new thread")
    return _start(self)

threading.Thread.start = start

class Net(nn.Module):
    def __init__(self, num_classes, input_shape):
        super().__init__()
        self.net = nn.Sequential(nn.Flatten(), nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, num_classes))

    def forward(self, x):
        return self.net(x)
"""


@pytest.mark.slow
def test_a_finished_run_is_not_lost_to_threads_that_cannot_start(tmp_path: Path) -> None:
    """An asgd run whose server can start no more threads (injected through the model file, which
    every process imports) meets a flood of 20 connections. On 43f33af: exit 2, `the parameter
    server failed: RuntimeError: cannot join thread before it is started`, no model.pt, no
    summary.json, though both workers had trained every sample."""
    model, flag, out, port = tmp_path / "nothreads.py", tmp_path / "no-threads", tmp_path / "run", free_port()
    model.write_text(NO_THREADS_MODEL)
    cmd = [
        sys.executable,
        *"-m distsgd train --algo asgd --workers 2".split(),
        *SMALL,
        "--model",
        f"{model}:Net",
        "--epochs",
        "30",
        "--log-every",
        "20",
        "--init-method",
        f"tcp://127.0.0.1:{port}",
        "--out",
        str(out),
    ]
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env={**os.environ, "NO_THREADS": str(flag)}
    )
    held: list[socket.socket] = []
    try:
        wait_for(lambda: progress_seen(out), 120, proc)
        flag.touch()
        for _ in range(20):
            try:
                held.append(socket.create_connection(("127.0.0.1", port), timeout=5))
            except OSError:
                break
        _, err = proc.communicate(timeout=300)
    finally:
        for s in held:
            s.close()
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, err[-3000:]
    assert (out / "model.pt").exists()
    summary = json.loads((out / "summary.json").read_text())
    assert summary["failed_workers"] == [] and summary["samples_per_worker"] == [30 * 718, 30 * 718]
    assert summary["refused_connections"] >= 1
    assert err.count("could not start a thread") == 1, err[-3000:]  # one warning, not one per connection


# --- 9 (the server's part). The acceptor's errors are rate-limited ---------------------------------


class _FlakyListener:
    """A listening socket whose next ``failures`` accept() calls fail with EMFILE."""

    def __init__(self, sock: socket.socket, failures: int) -> None:
        self.sock, self.failures = sock, failures

    def accept(self):
        import errno

        if self.failures:
            self.failures -= 1
            raise OSError(errno.EMFILE, "Too many open files")
        return self.sock.accept()

    def __getattr__(self, name: str):
        return getattr(self.sock, name)


def test_accept_errors_are_one_warning_then_a_count(caplog: pytest.LogCaptureFixture) -> None:
    """On 43f33af every failed accept() was a warning: 10 lines a second for as long as it lasted."""
    caplog.set_level(logging.WARNING)
    ps = _core("asgd")
    service = transport.Service(ps, _Role(), wire.Layout.of(ps.model, ps.hypers.count), "127.0.0.1:0", secret=SECRET)
    service.listener = _FlakyListener(service.listener, failures=20)
    service.start()
    try:
        client = _client(ps, service, 1)  # served once the errors stop
        assert client.pull() == 0
        client.done(0)
    finally:
        service.close()
    said = [r.getMessage() for r in caplog.records if "could not accept" in r.getMessage()]
    assert len(said) == 1 and "Too many open files" in said[0], said
    service.warn_at = 0.0  # as if the quiet interval had passed: the next warning counts the ones not shown
    service._trouble("could not accept a connection", OSError("Too many open files"))
    assert "19 more since the last warning" in caplog.records[-1].getMessage()


# --- 2. A HELLO that says "rejoining" cannot take a live worker's place -----------------------------


def test_only_a_dead_workers_place_can_be_taken() -> None:
    """A HELLO for a connected rank that says it replaces a dead worker: on 43f33af it took that
    rank's place (under sync-ps the real worker's answer went to the impostor, and it waited until
    --timeout). Now it is refused. A real replacement still gets in, also while its predecessor's
    server thread waits for a round and has not yet noticed the death."""
    ps = _core("sync-ps")
    role = _Role()
    service = _serve(ps, role)
    try:
        one, two = _client(ps, service, 1), _client(ps, service, 2)
        impostor = _connect(service.address)
        impostor.sendall(wire.hello_message(1, SECRET, rejoining=True, groups=ps.hypers.describe()))
        assert _closed_by_server(impostor)
        impostor.close()
        assert role.said == [("hello", 1), ("hello", 2)]
        grads = [torch.ones_like(p) for p in ps.model.parameters()]
        pushed = threading.Thread(target=lambda: two.push(grads, 0, 8, None, ps.hypers.read(ps.optimizer)), daemon=True)
        pushed.start()
        one.push(
            grads, 0, 8, None, ps.hypers.read(ps.optimizer)
        )  # the round: both answered, the impostor had no part in it
        pushed.join(10)
        assert not pushed.is_alive() and ps.version == 1

        def dies() -> None:  # worker 0 pushes, then dies while its push waits for worker 1's
            try:
                one.push(grads, 1, 16, None, ps.hypers.read(ps.optimizer))
            except OSError:
                pass

        waiting = threading.Thread(target=dies, daemon=True)
        waiting.start()
        wait_for(lambda: ps.clocks[1] == 2, 10)
        one.channel.close()
        waiting.join(10)
        replacement = _client(ps, service, 1, rejoining=True)
        assert role.said[-1] == ("hello", 1)
        assert replacement.pull() == ps.version
        assert (
            two.push(grads, 1, 16, None, ps.hypers.read(ps.optimizer))[0] == 2
        )  # the round the dead worker had joined completes
        replacement.close()
        two.close()
    finally:
        service.close()


# --- 3. A checkpoint number the worker did not save ------------------------------------------------


def _role(cfg: RunConfig, own: bool = False):
    """A real server role (asgd, two workers) for an mlp on a tiny dataset; ``own``: a user's loop."""
    from distsgd.algorithms import registry
    from distsgd.algorithms.param_server.role import ServerRole
    from distsgd.data import Dataset
    from distsgd.metrics import NullSink
    from distsgd.train.context import Job

    g = torch.Generator().manual_seed(0)
    data = Dataset(
        "tiny",
        torch.randn(32, 4, generator=g),
        torch.randint(0, 2, (32,), generator=g),
        torch.randn(8, 4, generator=g),
        torch.randint(0, 2, (8,), generator=g),
        2,
    )
    job = Job(cfg, "mlp", data, main=(lambda run: None) if own else None)
    algo = registry.get("asgd")
    return ServerRole(job, algo.topology.rule(cfg, algo.Options.from_mapping({})), 2, NullSink())


def test_a_forged_checkpoint_number_is_refused_and_leaves_no_file(tmp_path: Path) -> None:
    """Once a run's workers have finished, a connection with the run's secret says HELLO for rank 2
    and CHECKPOINTED 2**40. On 43f33af the server wrote its state as checkpoint 2**40 (a file no
    clean-up ever removes: every later one has a lower number), then failed to commit it and
    dropped the connection. Now the claim is refused: no worker file, nothing written."""
    role = _role(resolve(RunConfig(algo="asgd", lr=0.1, batch_size=8, out=str(tmp_path), checkpoint_every="16")))
    layout = wire.Layout.of(role.model, role.server.hypers.count)
    service = _serve(role.server, role)
    ckpt = tmp_path / checkpoint.CHECKPOINT_DIR
    try:
        clients = [_client(role.server, service, rank) for rank in (1, 2)]
        for rank, client in zip((1, 2), clients):  # an honest checkpoint: each worker writes its part, then says so
            checkpoint.save_worker_state(ckpt, 1, rank - 1, {"w": torch.zeros(1)})
            client.checkpointed(1, 0)
        assert checkpoint.read_manifest(tmp_path)["seq"] == 1
        for client in clients:
            client.done(0)
        for _ in range(50):  # rank 2's worker has left; until the server has seen its connection close, a
            forger = _connect(service.address)  # HELLO for rank 2 is a second one, refused: say it again
            forger.sendall(wire.hello_message(2, SECRET, rejoining=True, groups=role.server.hypers.describe()))
            try:
                wire.Frame(layout.answer_bytes).recv(transport.Channel(forger))
                break
            except ConnectionError:
                forger.close()
                time.sleep(0.1)
        else:
            raise AssertionError("the server never took the HELLO of rank 2, whose worker had left")
        wire.Frame(layout.request_bytes).send(transport.Channel(forger), wire.CHECKPOINTED, 2**40, 0, 0)
        assert _closed_by_server(forger)
        forger.close()
    finally:
        service.close()
    assert sorted(p.name for p in ckpt.glob(f"*{2**40}*")) == []
    assert checkpoint.usable_checkpoint(tmp_path)["seq"] == 1


# --- 7. A worker dropped for silence; a frozen server ------------------------------------------------


@pytest.mark.slow
def test_a_worker_dropped_for_silence_is_in_failed_workers(tmp_path: Path) -> None:
    """Worker 1 SIGSTOPped for the rest of an asgd run with --timeout 5: the server drops it and
    the run ends, but on 43f33af summary.json said `failed_workers: []` (its process never
    exited, so the launcher saw no failure)."""
    out = tmp_path / "run"
    cmd = [
        sys.executable,
        *"-m distsgd train --algo asgd --workers 2".split(),
        *SMALL,
        *"--model mlp --epochs 5 --log-every 20 --timeout 5 --quiet --out".split(),
        str(out),
    ]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_for(lambda: (out / "workers.json").exists() and progress_seen(out), 120, proc)
        entries = json.loads((out / "workers.json").read_text())
        victim = next(e for e in entries if e["role"] == "worker" and e["rank"] == 1)
        os.kill(victim["pid"], signal.SIGSTOP)
        _, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, err[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["failed_workers"] == [1]
    assert "silent for 5 s (--timeout)" in summary["worker_errors"]["1"]
    assert summary["samples_per_worker"][0] == 5 * 718 and summary["samples_per_worker"][1] < 5 * 718
    assert (out / "model.pt").exists()


def _marks_its_sigterm(mark: str) -> None:
    """A process whose SIGTERM handler leaves a file (a SIGKILL leaves none)."""
    signal.signal(signal.SIGTERM, lambda *_: (Path(mark).touch(), os._exit(0)))
    Path(mark + ".ready").touch()
    while True:
        time.sleep(0.01)


def test_a_stopped_process_is_terminated_not_killed(tmp_path: Path) -> None:
    """The launcher's stop_all continues a SIGSTOPped process (a worker the server dropped for
    silence), which then acts on its SIGTERM; before, it sat out the grace period stopped and was
    SIGKILLed."""
    import multiprocessing

    from distsgd.launch import procs

    mark = str(tmp_path / "terminated")
    p = multiprocessing.get_context("fork").Process(target=_marks_its_sigterm, args=(mark,))
    p.start()
    wait_for(lambda: os.path.exists(mark + ".ready"), 30)
    os.kill(p.pid, signal.SIGSTOP)
    procs.stop_all([p], grace_s=2.0)
    assert p.exitcode == 0 and os.path.exists(mark)


@pytest.mark.parametrize("frozen_at", ["hello", "pull"])
def test_a_worker_gives_up_on_a_frozen_server(frozen_at: str) -> None:
    """A server that takes the connection and then says nothing (SIGSTOPped: its kernel still
    accepts and buffers). On 43f33af the worker waited for ever, for the answer to its HELLO or to
    any later request; now it fails after --timeout with one line."""
    layout = wire.Layout.of(torch.nn.Linear(3, 2))
    frozen = socket.create_server(("127.0.0.1", 0))
    address = f"127.0.0.1:{frozen.getsockname()[1]}"
    outcome: dict[str, object] = {}

    def worker() -> None:
        try:
            client = transport.Client(1, torch.zeros(8), layout, address, timeout_s=0.5, secret=SECRET)
            client.pull()
        except ConnectionError as exc:
            outcome["error"] = str(exc)

    thread = threading.Thread(target=worker, daemon=True)
    thread.start()
    peer, _ = frozen.accept()
    try:
        if frozen_at == "pull":  # the HELLO is answered; then nothing
            peer.recv(len(wire.hello_message(1, SECRET)), socket.MSG_WAITALL)
            wire.Frame(layout.answer_bytes).send(transport.Channel(peer), 0, 0, 0, 0)
        thread.join(10)
        gave_up = not thread.is_alive()
    finally:
        peer.close()  # lets a worker that waits for ever go
        frozen.close()
        thread.join(10)
    assert gave_up, "the worker still waits for a frozen server"
    assert "sent nothing for 0.5 s (--timeout)" in str(outcome.get("error")), outcome


def test_a_worker_waiting_for_a_round_hears_the_server_live() -> None:
    """The other side of that deadline: a sync-ps worker whose push waits for a slow peer (1.5 s,
    three times --timeout) is sent BEATs and keeps waiting; the round then completes. (43f33af sent
    none: a worker could not tell a round that waits from a frozen server.)"""
    ps = _core("sync-ps")
    service = _serve(ps, silence_s=0.5)
    try:
        one, two = _client(ps, service, 1, timeout_s=0.5), _client(ps, service, 2, timeout_s=0.5)
        grads = [torch.ones_like(p) for p in ps.model.parameters()]
        answered: list[int] = []
        waiting = threading.Thread(
            target=lambda: answered.append(one.push(grads, 0, 8, None, ps.hypers.read(ps.optimizer))[0]), daemon=True
        )
        waiting.start()
        wait_for(lambda: ps.clocks[1] == 1, 10)
        sent = ps.bytes_sent
        time.sleep(1.5)  # worker 2 computes a long step (its client PINGs meanwhile)
        beats = (ps.bytes_sent - sent) // 32
        assert two.push(grads, 0, 8, None, ps.hypers.read(ps.optimizer))[0] == 1
        waiting.join(10)
        assert answered == [1]
        assert beats >= 3, beats  # every 0.125 s of waiting after the first 0.125 s: about 10
        one.done(8)
        two.done(8)
    finally:
        service.close()


# --- A worker's STOP (a user's loop reached --stop-at-target) ---------------------------------------


@pytest.mark.parametrize("own, stop_at_target", [(True, True), (True, False), (False, True)])
def test_a_workers_stop_is_heard_only_where_its_loop_decides(tmp_path: Path, own: bool, stop_at_target: bool) -> None:
    """A user's loop evaluates in its workers: with --stop-at-target a worker that measured the
    target stops every worker through the server. Elsewhere (distsgd's loop: the server evaluates;
    no target) a STOP is refused and the connection dropped: the run goes on."""
    role = _role(
        resolve(RunConfig(algo="asgd", lr=0.1, batch_size=8, stop_at_target=stop_at_target, target_accuracy=0.5)), own
    )
    service = _serve(role.server, role)
    try:
        stopper, other = _client(role.server, service, 1), _client(role.server, service, 2)
        if own and stop_at_target:
            stopper.reached()
            assert other.pull() >= 0 and role.server.stop
        else:
            with pytest.raises((ConnectionError, OSError)):
                stopper.reached()
            assert other.pull() >= 0 and not role.server.stop
        other.done(0)
    finally:
        service.close()
