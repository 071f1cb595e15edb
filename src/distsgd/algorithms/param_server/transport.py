"""How workers reach the server: one TCP connection per worker, carrying fixed-size frames.

The server (rank 0) listens on an address (``127.0.0.1`` and a free port for a local run; under
torchrun, its own address, published through torchrun's store) and serves each worker's
connection in a thread of its own, one request at a time. A request is one message, a
:class:`Frame`: an int64 header ``[op, version, samples, flag]`` and the op's payload (a push's
flat gradient and buffers); the answer is one message too (``[version, all workers' samples,
stop, nbytes]`` and the new flat weights). Everything on the wire is raw tensor bytes: nothing
is unpickled. A push that must wait (a sync-ps
round, an ssp bound) blocks only its own worker's thread. A worker whose connection closes (it
died) is dropped and the server carries on; a replacement may connect later under the same rank
(``--restart-workers``), which a process group's fixed membership would not allow.

The transport was chosen by measurement on the 2-core VM on 2026-11-22 (docs/BENCHMARKS.md).
``torch.distributed.rpc``, what distsgd used first: with TensorPipe's default transports its
shared-memory reactor thread busy-polls about a fifth of a core in each of the three processes
of a 2-worker run, and asgd reached 0.56x Hogwild!'s samples/s; with its uv transport 11.2k
samples/s. gloo point-to-point messages, two each way: 11.1k; one each way: 13.1k (limits.py
A/B, 3 alternating repeats). These sockets against that gloo transport: 1.017x (5 alternating
repeats, benchmarks/results/transport_ab.txt), as fast within noise, and a worker may join a
running server, which a process group's fixed membership does not allow. TensorPipe, RPC's only
backend, has also been in maintenance mode since December 2025.
"""

from __future__ import annotations

import logging
import socket
import struct
import threading
import time
from typing import Any, Callable

import torch

log = logging.getLogger(__name__)

HELLO, PULL, PUSH, EXCHANGE, DONE, BARRIER, CHECKPOINTED, PING = range(8)
_HEAD = 4 * 8  # bytes of a header: four int64 (a PING is a header alone, and gets no answer)


class Channel:
    """One TCP connection: whole frames and byte strings, sent and received in full.

    TCP keepalive probes an idle connection after 60 s, every 10 s, 6 times: a peer whose machine
    vanished (no FIN, no RST) counts as gone after about 2 minutes instead of never. ``silence_s``
    (the server's end: ``--timeout``): a peer that sends nothing for that long, or does not
    take what is sent, counts as gone too (the kernel's SO_RCVTIMEO/SO_SNDTIMEO: no cost per call).
    A worker's :class:`Client` sends a PING when it has been quiet for a quarter of that, so only
    a process that is frozen or whose machine vanished is silent that long, not one that computes
    a long step, writes a checkpoint or waits ``--tau`` steps between EASGD exchanges.
    """

    def __init__(self, sock: socket.socket, silence_s: float | None = None) -> None:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        for name, value in (("TCP_KEEPIDLE", 60), ("TCP_KEEPINTVL", 10), ("TCP_KEEPCNT", 6)):
            if hasattr(socket, name):  # Linux; elsewhere the system's defaults
                sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, name), value)
        if silence_s is not None:
            whole = int(silence_s)
            timeval = struct.pack("ll", whole, int((silence_s - whole) * 1e6))
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, timeval)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, timeval)
        self.sock = sock

    def send(self, data: memoryview | bytes) -> int:
        self.sock.sendall(data)
        return len(data)

    def recv_into(self, view: memoryview) -> None:
        got = 0
        while got < len(view):
            n = self.sock.recv_into(view[got:], len(view) - got)
            if n == 0:
                raise ConnectionError("the connection closed")
            got += n

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass


class Frame:
    """One message: an int64 header ``[a, b, c, d]`` and a payload, in one byte buffer, so that a
    request or an answer is one send. Every request (and every answer) has the same size: the
    largest any op needs (a push's gradient and buffers, an exchange's x); the few control
    messages (pull, barrier, done) carry an unused payload."""

    def __init__(self, nbytes: int) -> None:
        self.buffer = torch.zeros(_HEAD + nbytes, dtype=torch.uint8)
        self.head = self.buffer[:_HEAD].view(torch.int64)
        self.view = memoryview(self.buffer.numpy())  # what the socket reads into and writes from

    def floats(self, start: int, n: int) -> torch.Tensor:
        """float32 view of the payload: ``n`` values from value ``start``."""
        return self.buffer[_HEAD + 4 * start:_HEAD + 4 * (start + n)].view(torch.float32)

    def ints(self, start_byte: int, n: int) -> torch.Tensor:
        """int64 view of the payload: ``n`` values from payload byte ``start_byte``."""
        return self.buffer[_HEAD + start_byte:_HEAD + start_byte + 8 * n].view(torch.int64)

    def send(self, channel: Channel, *head: int) -> int:
        self.head.copy_(torch.tensor(head, dtype=torch.int64))
        return channel.send(self.view)

    def recv(self, channel: Channel) -> list[int]:
        channel.recv_into(self.view)
        return self.head.tolist()

    def recv_head(self, channel: Channel) -> list[int]:
        """The header alone (the server: a PING has nothing more); then :meth:`recv_payload`."""
        channel.recv_into(self.view[:_HEAD])
        return self.head.tolist()

    def recv_payload(self, channel: Channel) -> None:
        channel.recv_into(self.view[_HEAD:])


def frame_sizes(n_params: int, n_floats: int, n_ints: int) -> tuple[int, int]:
    """Payload bytes of (a request, an answer)."""
    request = max(4 * n_params + 4 * n_floats + 8 * n_ints, 4 * (n_params + n_floats) + 8 * n_ints)
    answer = 4 * (n_params + n_floats)  # weights (n_params), or an exchange's difference
    return request, answer


class Service:
    """The server's end: it listens on ``address`` (``host:port``; port 0: any free one) and serves
    each worker that connects, in a thread of its own, on ``server`` (the core) and ``role`` (for
    checkpoint state). ``sizes``: (parameters, floating-point buffers, integer buffers).
    ``rejoin(rank)``: a worker connects again under a rank that died (a replacement)."""

    def __init__(self, server: Any, role: Any, sizes: tuple[int, int, int], address: str,
                 silence_s: float | None = None) -> None:
        self.server, self.role, self.sizes, self.silence_s = server, role, sizes, silence_s
        host, _, port = address.rpartition(":")
        self.listener = socket.create_server((host, int(port)), backlog=64)
        self.address = f"{host}:{self.listener.getsockname()[1]}"
        self.threads: list[threading.Thread] = []
        self.channels: list[Channel] = []
        self.current: dict[int, Channel] = {}  # each rank's newest connection (a replacement's, after a death)
        self.membership = threading.Lock()  # a rank's HELLO and an old connection's death, one at a time
        self.closing = False
        self.acceptor = threading.Thread(target=self._accept, name="distsgd-ps-accept", daemon=True)

    def start(self) -> None:
        self.acceptor.start()

    def close(self, wait_s: float = 5.0) -> None:
        self.closing = True
        self.listener.close()
        for c in self.channels:
            c.close()
        for t in self.threads:
            t.join(wait_s)

    def _accept(self) -> None:
        while not self.closing:
            try:
                sock, _ = self.listener.accept()
            except OSError:  # closed
                return
            channel = Channel(sock, self.silence_s)
            self.channels.append(channel)
            thread = threading.Thread(target=self._serve, args=(channel,), daemon=True)
            self.threads.append(thread)
            thread.start()

    def _serve(self, channel: Channel) -> None:
        n_params, n_floats, n_ints = self.sizes
        req_bytes, ans_bytes = frame_sizes(*self.sizes)
        request, answer = Frame(req_bytes), Frame(ans_bytes)
        server, rank = self.server, -1

        def reply(version: int, total: int, stop: bool, data: torch.Tensor | None = None, nbytes: int = 0) -> None:
            if data is not None:
                answer.floats(0, data.numel()).copy_(data)
            server.count(sent=answer.send(channel, version, total, int(stop), nbytes))

        try:
            while True:
                op, version, samples, flag = request.recv_head(channel)
                if op != PING:
                    request.recv_payload(channel)
                server.count(received=_HEAD if op == PING else request.buffer.numel())
                if op == HELLO:  # [HELLO, rank, 0, rejoining]: answered with that rank's samples so far
                    if rank >= 0 or not 1 <= version <= server.workers:
                        raise ConnectionError(f"a HELLO for rank {version} (this server has ranks 1..{server.workers})")
                    rank = version
                    with self.membership:
                        self.current[rank] = channel
                        self.role.worker_hello(rank, bool(flag))
                    reply(server.version, server.total_samples(), server.stop, nbytes=server.counts[rank])
                elif rank < 0:
                    raise ConnectionError(f"request {op} before HELLO")
                elif op == PING:  # [PING, 0, 0, 0]: the worker is alive, busy between requests
                    continue
                elif op == PULL:
                    flat, v = server.pull(rank)
                    reply(v, server.total_samples(), server.stop, flat)
                elif op == PUSH:
                    grad = request.floats(0, n_params).clone()
                    buffers = (request.floats(n_params, n_floats).clone(),
                               request.ints(4 * (n_params + n_floats), n_ints).clone()) if flag else None
                    flat, v, total, stop = server.push(rank, grad, version, samples, buffers).wait()
                    reply(v, total, stop, flat)
                elif op == EXCHANGE:
                    x = request.floats(0, n_params + n_floats).clone()
                    ints = request.ints(4 * (n_params + n_floats), n_ints).clone()
                    diff, v, total, stop = server.exchange(rank, x, ints, samples)
                    reply(v, total, stop, diff)
                elif op == BARRIER:
                    server.barrier().wait()
                    reply(server.version, server.total_samples(), server.stop)
                elif op == CHECKPOINTED:  # [CHECKPOINTED, seq, samples, 0]: this worker saved its part
                    self.role.checkpointed(rank, version, samples)
                    reply(server.version, server.total_samples(), server.stop)
                elif op == DONE:
                    self.role.worker_done(rank, samples)
                    return
                else:
                    raise ConnectionError(f"unknown request {op}")
        except Exception as exc:  # its connection broke: it died, fell silent, or the run is being torn down
            if self.closing:
                return
            why = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            if isinstance(exc, (socket.timeout, BlockingIOError)):
                why = f"silent for {self.silence_s:.0f} s (--timeout)"
            if rank >= 0:
                with self.membership:  # a replacement's HELLO cannot slip in between the test and the drop
                    if self.current.get(rank) is channel:  # not a replaced one
                        log.warning("worker %d is gone (%s); the server carries on without it", rank - 1, why)
                        self.role.worker_gone(rank)
            else:
                log.warning("dropped a connection that never said which worker it is (%s)", why)
        finally:
            channel.close()


def connect(address: str, timeout_s: float) -> Channel:
    """A connection to the server at ``host:port``, retried until it listens (or ``timeout_s``)."""
    host, _, port = address.rpartition(":")
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return Channel(socket.create_connection((host, int(port)), timeout=timeout_s))
        except OSError:
            if time.monotonic() > deadline:
                raise ConnectionError(f"no parameter server answered at {address} within {timeout_s:.0f} s") from None
            time.sleep(0.05)


class Client:
    """A worker's calls on the server at ``address``. ``me`` is its rank (its data rank + 1);
    ``weights`` the flat buffer its model's parameters are views of (answers land in it).
    ``rejoining``: it replaces a worker of that rank that died; ``samples`` then says how many
    samples that rank had trained.

    A thread sends a PING (a header, 32 bytes) whenever no request has gone out for
    ``timeout_s / 4``: the server drops a worker silent for ``timeout_s``, and a busy one is not
    silent. Requests and PINGs share the connection under one lock."""

    def __init__(self, me: int, weights: torch.Tensor, sizes: tuple[int, int, int], address: str,
                 timeout_s: float, rejoining: bool = False) -> None:
        self.me, self.weights, self.sizes = me, weights, sizes
        req_bytes, ans_bytes = frame_sizes(*sizes)
        self.request, self.answer = Frame(req_bytes), Frame(ans_bytes)
        self.bytes_sent = 0
        self.channel = connect(address, timeout_s)
        self.channel.sock.settimeout(None)  # a push may wait for a round; the server's death closes it
        self.lock, self.quiet_s, self.last = threading.Lock(), timeout_s / 4, time.monotonic()
        self.closed = threading.Event()
        self.samples = self._call(HELLO, me, 0, int(rejoining))[3]
        threading.Thread(target=self._beat, name="distsgd-ps-heartbeat", daemon=True).start()

    def _call(self, op: int, version: int = 0, samples: int = 0, flag: int = 0) -> tuple[int, int, bool, int]:
        with self.lock:
            self.bytes_sent += self.request.send(self.channel, op, version, samples, flag)
            self.last = time.monotonic()
            if op == DONE:
                self.closed.set()
                return 0, 0, False, 0
            version, total, stop, nbytes = self.answer.recv(self.channel)
        return version, total, bool(stop), nbytes

    def _beat(self) -> None:
        ping = struct.pack("4q", PING, 0, 0, 0)  # a header, in the int64s the server reads
        while not self.closed.wait(self.quiet_s / 2):
            with self.lock:
                if self.closed.is_set() or time.monotonic() - self.last < self.quiet_s:
                    continue
                try:
                    self.bytes_sent += self.channel.send(ping)
                except OSError:  # the server is gone: the next request says so
                    return
                self.last = time.monotonic()

    def pull(self) -> int:
        """The server's weights into ``weights``; returns their version."""
        version = self._call(PULL)[0]
        self.weights.copy_(self.answer.floats(0, self.weights.numel()))
        return version

    def push(self, grad: list[torch.Tensor], version: int, samples: int,
             buffers: tuple[list[torch.Tensor], list[torch.Tensor]] | None) -> tuple[int, int, bool]:
        """A gradient (the parameters' gradients, in order) computed on ``version``; the new
        weights land in ``weights``."""
        n_params, n_floats, n_ints = self.sizes
        torch.cat([g.reshape(-1) for g in grad], out=self.request.floats(0, n_params))
        if buffers is not None:
            if n_floats:
                torch.cat([b.reshape(-1) for b in buffers[0]], out=self.request.floats(n_params, n_floats))
            if n_ints:
                torch.cat([b.reshape(-1) for b in buffers[1]], out=self.request.ints(4 * (n_params + n_floats), n_ints))
        version, total, stop, _ = self._call(PUSH, version, samples, int(buffers is not None))
        self.weights.copy_(self.answer.floats(0, n_params))
        return version, total, stop

    def exchange(self, x: torch.Tensor, ints: torch.Tensor, samples: int) -> tuple[torch.Tensor, int, int, bool]:
        """Async EASGD: send x (parameters and floating-point buffers) and the integer buffers; get d."""
        n = x.numel()
        self.request.floats(0, n).copy_(x)
        if ints.numel():
            self.request.ints(4 * n, ints.numel()).copy_(ints)
        version, total, stop, _ = self._call(EXCHANGE, 0, samples)
        return self.answer.floats(0, n).clone(), version, total, stop

    def barrier(self) -> None:
        self._call(BARRIER)

    def done(self, samples: int) -> None:
        self._call(DONE, 0, samples)
        self.channel.close()

    def checkpointed(self, seq: int, samples: int) -> None:
        """This worker saved its part of checkpoint ``seq``: the server commits once all live have."""
        self._call(CHECKPOINTED, seq, samples)
