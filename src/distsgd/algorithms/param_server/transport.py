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
from dataclasses import dataclass
from typing import Any

import torch

from distsgd.errors import ConfigError

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


ALIGN = 16  # every section of a payload starts at a multiple of this: a view of any dtype is aligned


def _align(offset: int) -> int:
    return -(-offset // ALIGN) * ALIGN


@dataclass(frozen=True)
class Section:
    """``numel`` values of ``dtype`` at byte ``offset`` of a payload: the tensors ``members``
    (indices into the list the section was made for), flat, one after another."""

    dtype: torch.dtype
    offset: int
    numel: int
    members: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return self.numel * torch.empty(0, dtype=self.dtype).element_size()


class Packing:
    """Where a list of tensors lies in a payload from byte ``start``: one section per dtype (in the
    order the dtypes first appear), each tensor's values in its dtype's section, in list order.
    Every section starts at a multiple of :data:`ALIGN` bytes, whatever the sizes before it (an
    odd number of float32 values before an int64 section used to make its view impossible)."""

    def __init__(self, tensors: list[tuple[torch.dtype, int]], start: int) -> None:
        groups: dict[torch.dtype, list[int]] = {}
        for i, (dtype, _) in enumerate(tensors):
            groups.setdefault(dtype, []).append(i)
        self.numels = [n for _, n in tensors]
        self.sections: list[Section] = []
        offset = _align(start)
        for dtype, members in groups.items():
            section = Section(dtype, offset, sum(self.numels[i] for i in members), tuple(members))
            self.sections.append(section)
            offset = _align(offset + section.nbytes)
        self.end = offset

    def pack(self, frame: "Frame", tensors: list[torch.Tensor]) -> None:
        """Write ``tensors`` (of the sizes and dtypes this packing was made for) into ``frame``."""
        for s in self.sections:
            if s.numel:
                torch.cat([tensors[i].detach().reshape(-1) for i in s.members], out=frame.section(s))

    def unpack(self, frame: "Frame", clone: bool = False) -> list[torch.Tensor]:
        """The tensors in ``frame``, flat, in list order: views of the frame, or (``clone``) of one
        copy of each section."""
        out: list[torch.Tensor] = [torch.empty(0)] * len(self.numels)
        for s in self.sections:
            flat = frame.section(s).clone() if clone else frame.section(s)
            offset = 0
            for i in s.members:
                out[i] = flat[offset:offset + self.numels[i]]
                offset += self.numels[i]
        return out

    def whole(self, frame: "Frame") -> torch.Tensor:
        """A view of the one section of a packing of one dtype (the parameters: flat weights)."""
        assert len(self.sections) <= 1
        return frame.section(self.sections[0]) if self.sections else torch.empty(0)


class Layout:
    """What a message of a model holds, and where: its parameters (one dtype: the flat weights, a
    gradient or an exchange's x), its floating-point buffers and its other buffers (integer, bool),
    each part in aligned sections. A request holds all three; an answer the first two (weights, or
    an exchange's difference). The server and each worker build it from the same architecture."""

    def __init__(self, params: list[tuple[torch.dtype, int]], floats: list[tuple[torch.dtype, int]],
                 ints: list[tuple[torch.dtype, int]]) -> None:
        if len({dtype for dtype, _ in params}) > 1:
            raise ConfigError(f"the parameter server keeps the weights as one flat tensor; this model's parameters "
                              f"have several dtypes ({', '.join(sorted({str(d) for d, _ in params}))}): give them one")
        self.params = Packing(params, 0)
        self.floats = Packing(floats, self.params.end)
        self.ints = Packing(ints, self.floats.end)
        self.request_bytes = self.ints.end
        self.answer_bytes = self.floats.end

    @classmethod
    def of(cls, model: torch.nn.Module) -> "Layout":
        buffers = list(model.buffers())
        return cls([(p.dtype, p.numel()) for p in model.parameters()],
                   [(b.dtype, b.numel()) for b in buffers if b.dtype.is_floating_point],
                   [(b.dtype, b.numel()) for b in buffers if not b.dtype.is_floating_point])


class Frame:
    """One message: an int64 header ``[a, b, c, d]`` and a payload, in one byte buffer, so that a
    request or an answer is one send. Every request (and every answer) has the same size: the
    largest any op needs (a push's gradient and buffers, an exchange's x); the few control
    messages (pull, barrier, done) carry an unused payload. The payload's parts are the sections
    of a :class:`Layout`."""

    def __init__(self, nbytes: int) -> None:
        self.buffer = torch.zeros(_HEAD + nbytes, dtype=torch.uint8)
        self.head = self.buffer[:_HEAD].view(torch.int64)
        self.view = memoryview(self.buffer.numpy())  # what the socket reads into and writes from

    def section(self, s: Section) -> torch.Tensor:
        """A view of section ``s`` of the payload, in its dtype."""
        return self.buffer[_HEAD + s.offset:_HEAD + s.offset + s.nbytes].view(s.dtype)

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


class Service:
    """The server's end: it listens on ``address`` (``host:port``; port 0: any free one) and serves
    each worker that connects, in a thread of its own, on ``server`` (the core) and ``role`` (for
    checkpoint state). ``layout``: where the model's parts lie in a message."""

    def __init__(self, server: Any, role: Any, layout: Layout, address: str,
                 silence_s: float | None = None) -> None:
        self.server, self.role, self.layout, self.silence_s = server, role, layout, silence_s
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
        layout = self.layout
        request, answer = Frame(layout.request_bytes), Frame(layout.answer_bytes)
        server, rank = self.server, -1

        def reply(version: int, total: int, stop: bool, data: torch.Tensor | None = None, nbytes: int = 0,
                  floats: list[torch.Tensor] | None = None) -> None:
            if data is not None:
                layout.params.whole(answer).copy_(data)
            if floats is not None:
                layout.floats.pack(answer, floats)
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
                    grad = layout.params.whole(request).clone()
                    buffers = (layout.floats.unpack(request, clone=True),
                               layout.ints.unpack(request, clone=True)) if flag else None
                    flat, v, total, stop = server.push(rank, grad, version, samples, buffers).wait()
                    reply(v, total, stop, flat)
                elif op == EXCHANGE:
                    x = layout.params.whole(request).clone()
                    floats, ints = layout.floats.unpack(request, clone=True), layout.ints.unpack(request, clone=True)
                    (diff, diff_floats), v, total, stop = server.exchange(rank, x, floats, ints, samples)
                    reply(v, total, stop, diff, floats=diff_floats)
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
    ``weights`` the flat buffer its model's parameters are views of (answers land in it); ``layout``
    where the model's parts lie in a message.
    ``rejoining``: it replaces a worker of that rank that died; ``samples`` then says how many
    samples that rank had trained.

    A thread sends a PING (a header, 32 bytes) whenever no request has gone out for
    ``timeout_s / 4``: the server drops a worker silent for ``timeout_s``, and a busy one is not
    silent. Requests and PINGs share the connection under one lock."""

    def __init__(self, me: int, weights: torch.Tensor, layout: Layout, address: str,
                 timeout_s: float, rejoining: bool = False) -> None:
        self.me, self.weights, self.layout = me, weights, layout
        self.request, self.answer = Frame(layout.request_bytes), Frame(layout.answer_bytes)
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
        self.weights.copy_(self.layout.params.whole(self.answer))
        return version

    def push(self, grad: list[torch.Tensor], version: int, samples: int,
             buffers: tuple[list[torch.Tensor], list[torch.Tensor]] | None) -> tuple[int, int, bool]:
        """A gradient (the parameters' gradients, in order) computed on ``version``, and the
        (floating-point, other) buffers; the new weights land in ``weights``."""
        layout = self.layout
        layout.params.pack(self.request, grad)
        if buffers is not None:
            layout.floats.pack(self.request, buffers[0])
            layout.ints.pack(self.request, buffers[1])
        version, total, stop, _ = self._call(PUSH, version, samples, int(buffers is not None))
        self.weights.copy_(layout.params.whole(self.answer))
        return version, total, stop

    def exchange(self, x: torch.Tensor, floats: list[torch.Tensor], ints: list[torch.Tensor],
                 samples: int) -> tuple[tuple[torch.Tensor, list[torch.Tensor]], int, int, bool]:
        """Async EASGD: send x (the flat parameters and the floating-point buffers) and the other
        buffers; get the difference d of both from the centre."""
        layout = self.layout
        layout.params.whole(self.request).copy_(x)
        layout.floats.pack(self.request, floats)
        layout.ints.pack(self.request, ints)
        version, total, stop, _ = self._call(EXCHANGE, 0, samples)
        diff = (layout.params.whole(self.answer).clone(), layout.floats.unpack(self.answer, clone=True))
        return diff, version, total, stop

    def barrier(self) -> None:
        self._call(BARRIER)

    def done(self, samples: int) -> None:
        self._call(DONE, 0, samples)
        self.channel.close()

    def checkpointed(self, seq: int, samples: int) -> None:
        """This worker saved its part of checkpoint ``seq``: the server commits once all live have."""
        self._call(CHECKPOINTED, seq, samples)
