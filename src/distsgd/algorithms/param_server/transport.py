"""How workers reach the server: one TCP connection per worker, carrying the messages of :mod:`.wire`.

The server (rank 0) listens on an address (``127.0.0.1`` and a free port for a local run; under
torchrun, its own address, published through torchrun's store) and serves each worker's
connection in a thread of its own, one request at a time: a request is one message, and so is its
answer. A push that must wait (a sync-ps round, an ssp bound) blocks only its own worker's thread.
A worker whose connection closes (it died) is dropped and the server carries on; a replacement may
connect later under the same rank (``--restart-workers``), which a process group's fixed membership
would not allow. Why sockets rather than ``torch.distributed.rpc`` or gloo point-to-point messages:
docs/BENCHMARKS.md ("The parameter server's transport").
"""

from __future__ import annotations

import hmac
import logging
import select
import socket
import struct
import threading
import time
from typing import TYPE_CHECKING

import torch

from distsgd.algorithms.param_server.hyper import Hyperparameters
from distsgd.algorithms.param_server.wire import (
    BARRIER,
    BEAT,
    BEAT_MESSAGE,
    CHECKPOINTED,
    DONE,
    EXCHANGE,
    GROUP_BYTES,
    HEAD,
    HELLO,
    HELLO_BYTES,
    PING,
    PING_MESSAGE,
    PULL,
    PUSH,
    REFUSED,
    STOP,
    Frame,
    Layout,
    hello_message,
    padded_secret,
    read_hello,
    refusal_message,
    unpack_groups,
)
from distsgd.errors import ConfigError

if TYPE_CHECKING:
    from distsgd.algorithms.param_server.core import ParameterServer
    from distsgd.algorithms.param_server.role import ServerRole

log = logging.getLogger(__name__)


class Channel:
    """One TCP connection: whole frames and byte strings, sent and received in full.

    TCP keepalive probes an idle connection after 60 s, every 10 s, 6 times: a peer whose machine
    vanished (no FIN, no RST) counts as gone after about 2 minutes instead of never. ``silence_s``
    (the server's end: ``--timeout``): a peer that sends nothing for that long, or does not
    take what is sent, counts as gone too (the kernel's SO_RCVTIMEO/SO_SNDTIMEO: no cost per call).
    A worker's :class:`Client` sends a PING when it has been quiet for a quarter of that, so only
    a process that is frozen or whose machine vanished is silent that long, not one that computes
    a long step, writes a checkpoint or waits ``--tau`` steps between EASGD exchanges. The same
    holds the other way (a worker's end: ``--timeout`` too): while a worker waits for its answer
    (a sync-ps round, the start, a checkpoint being written), the server sends a BEAT every
    quarter of it.
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
        self.silence_s = silence_s
        self.closed = False
        self.evicted = False  # closed by the server to make room (too many connections without a HELLO)

    def send(self, data: memoryview | bytes) -> int:
        self.sock.sendall(data)
        return len(data)

    def recv_into(self, view: memoryview, deadline: float | None = None) -> None:
        """Fill ``view``; with ``deadline`` (time.monotonic), all of it by then (a peer that
        trickles a byte at a time does not hold a thread and its buffers for ever)."""
        got = 0
        while got < len(view):
            if deadline is not None:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError("a message did not arrive in time")
                self.sock.settimeout(left if self.silence_s is None else min(left, self.silence_s))
            n = self.sock.recv_into(view[got:], len(view) - got)
            if n == 0:
                raise ConnectionError("the connection closed")
            got += n
        if deadline is not None:
            self.sock.settimeout(None)
            if self.silence_s is not None:  # back to the kernel's per-call limit
                whole = int(self.silence_s)
                timeval = struct.pack("ll", whole, int((self.silence_s - whole) * 1e6))
                self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, timeval)

    def hung_up(self) -> bool:
        """Whether the peer closed the connection or it broke (the peer's process died), even while
        what it sent before is still unread (its server thread may be waiting for a round)."""
        poller = select.poll()
        try:
            poller.register(self.sock, getattr(select, "POLLRDHUP", 0) | select.POLLHUP | select.POLLERR)
            return bool(poller.poll(0))
        except (OSError, ValueError):  # closed meanwhile
            return True

    def hang_up(self) -> None:
        """End the connection from another thread: what its own thread is blocked in, or about to call,
        returns at once. The socket stays open until that thread closes it: closed here, its number
        could go to the next connection accepted while that thread was about to wait on it, and the
        thread would then wait on a stranger's socket (a flood's: up to the HELLO deadline)."""
        self.closed = True
        try:
            self.sock.shutdown(socket.SHUT_RDWR)  # wakes a thread blocked reading it (close alone does not)
        except OSError:
            pass

    def close(self) -> None:
        self.hang_up()
        try:
            self.sock.close()
        except OSError:
            pass


HELLO_DEADLINE_S = 10.0  # a connection says HELLO, with the secret, within this or is dropped
REFUSALS_SHOWN = 3  # refused connections warned of one by one; the rest are counted (a flood is not a log)
ACCEPT_WARNING_EVERY_S = 10.0  # the acceptor's errors (too many files, no thread to spare): warned of at most so often


class Refused(ConnectionError):
    """A connection the server will not serve: a stranger, a wrong secret, nonsense."""


class Mismatched(Refused):
    """One of this run's workers (it knows the secret) whose optimiser's parameter groups are not
    the server's: it is told why, and refused."""

    def __init__(self, rank: int, why: str) -> None:
        super().__init__(why)
        self.rank = rank


class Service:
    """The server's end: it listens on ``address`` (``host:port``; port 0: any free one) and serves
    each worker that connects, in a thread of its own, on ``server`` (the core) and ``role`` (for
    checkpoint state). ``layout``: where the model's parts lie in a message.

    It admits only its own run's workers: a connection must send, within :data:`HELLO_DEADLINE_S`,
    a HELLO with a worker rank and the run's ``secret`` (compared in constant time), before the
    server allocates anything for it, and its optimiser's parameter groups, which must be the
    server's (:meth:`.hyper.Hyperparameters.mismatch`; a worker whose are not is answered with
    the server's, and refused); a HELLO for a rank whose connection is open is refused, even
    one that says it replaces a dead worker (a replacement's predecessor died: its connection has
    closed, or hung up while its thread still waits for a round). At most ``max_pending``
    connections may be waiting to say HELLO at once: a new one past that closes the oldest waiting
    one, so a flood of strangers cannot keep a real worker (which says HELLO as soon as it
    connects) out for long. Then every request is checked: a known op, sample counts that only
    grow, by at most what the worker can have trained since its last message, a version the
    server has made, a push's presence bytes 0 or 1, a checkpoint whose file the worker wrote (in
    the role), and (in the core) finite gradients and hyperparameters the optimiser can step with; a frame must arrive within
    ``--timeout``. An ``accept()`` error
    (too many open files), or a connection's thread that cannot start (the process's thread limit:
    that connection is closed and counted refused), is logged at most every
    :data:`ACCEPT_WARNING_EVERY_S` and the server keeps listening."""

    def __init__(
        self,
        server: ParameterServer,
        role: ServerRole,
        layout: Layout,
        address: str,
        silence_s: float | None = None,
        secret: bytes = b"",
        max_pending: int | None = None,
    ) -> None:
        self.server, self.role, self.layout, self.silence_s = server, role, layout, silence_s
        assert sum(layout.hypers.numels) == server.hypers.count, "a layout with the server optimiser's hyperparameters"
        self.secret = padded_secret(secret)
        host, _, port = address.rpartition(":")
        self.listener = socket.create_server((host, int(port)), backlog=64)
        self.address = f"{host}:{self.listener.getsockname()[1]}"
        self.threads: list[threading.Thread] = []
        self.channels: list[Channel] = []
        self.current: dict[int, Channel] = {}  # each rank's newest connection (a replacement's, after a death)
        self.membership = threading.Lock()  # a rank's HELLO and an old connection's death, one at a time
        self.max_pending = max_pending or 2 * server.workers + 4
        self.pending: list[Channel] = []  # connected, HELLO not yet said (oldest first)
        self.open = 0
        self.refused = 0  # connections refused or dropped before they said who they were
        self.troubles, self.warn_at = 0, 0.0  # the acceptor's errors not yet warned of, and when it may warn next
        self.serving: set[_Connection] = set()  # admitted workers: the heartbeat's
        self.closing, self.stopped = False, threading.Event()
        self.acceptor = threading.Thread(target=self._accept, name="distsgd-ps-accept", daemon=True)
        self.heart = threading.Thread(target=self._beat, name="distsgd-ps-heartbeat", daemon=True)

    def start(self) -> None:
        self.acceptor.start()
        if self.silence_s is not None:
            self.heart.start()

    def close(self, wait_s: float = 5.0) -> None:
        self.closing = True
        self.stopped.set()
        try:  # wakes the acceptor blocked in accept() (close alone does not, and its number would be
            self.listener.shutdown(socket.SHUT_RDWR)  # reused by the next socket the process opens)
        except OSError:
            pass
        self.listener.close()
        for t in (self.acceptor, self.heart):
            if t.is_alive():
                t.join(wait_s)
        channels = list(self.channels)
        for c in channels:
            c.hang_up()  # each connection's thread closes its own
        for t in list(self.threads):
            t.join(wait_s)
        for c in channels:
            c.close()

    def _accept(self) -> None:
        while not self.closing:
            try:
                sock, _ = self.listener.accept()
            except OSError as exc:
                if self.closing:
                    return
                self._trouble("could not accept a connection", exc)
                continue
            try:
                channel = Channel(sock, self.silence_s)
            except OSError:  # reset before it could be set up
                sock.close()
                continue
            with self.membership:
                evicted = self.pending.pop(0) if len(self.pending) >= self.max_pending else None
                self.pending.append(channel)
                self.channels.append(channel)
                self.open += 1
            if evicted is not None:
                evicted.evicted = True
                evicted.hang_up()  # its thread finds it closed, and counts it refused
            thread = threading.Thread(target=self._serve, args=(channel,), name="distsgd-ps-connection", daemon=True)
            try:
                thread.start()
            except RuntimeError as exc:  # the process's thread limit: drop this one, and keep serving the others
                self._forget(channel)
                with self.membership:
                    self.refused += 1
                self._trouble("could not start a thread for a connection, and closed it", exc)
                continue
            self.threads = [t for t in self.threads if t.is_alive()] + [thread]

    def _beat(self) -> None:
        """A worker's deadline for hearing from the server is ``--timeout``, as the server's for it;
        a worker that waits for its answer is sent a BEAT every quarter of that."""
        assert self.silence_s is not None  # start runs the heart only with a --timeout
        quiet = self.silence_s / 4
        while not self.stopped.wait(quiet / 2):
            with self.membership:
                serving = list(self.serving)
            for connection in serving:
                connection.beat(quiet)

    def _trouble(self, what: str, exc: Exception) -> None:
        """Warn that the acceptor ``what`` (at most every :data:`ACCEPT_WARNING_EVERY_S`, with a count
        of the times not shown: a flood is not a log), then pause: the cause is not gone at once."""
        self.troubles += 1
        now = time.monotonic()
        if now >= self.warn_at:
            more = f"; {self.troubles - 1} more since the last warning" if self.troubles > 1 else ""
            log.warning("the parameter server %s (%s)%s; it keeps listening", what, exc, more)
            self.troubles, self.warn_at = 0, now + ACCEPT_WARNING_EVERY_S
        time.sleep(0.1)

    def _handshake(self, channel: Channel) -> int:
        """The rank of a connection that said a valid HELLO with the run's secret and the server's
        parameter groups, in time."""
        hello = bytearray(HELLO_BYTES)
        deadline = time.monotonic() + HELLO_DEADLINE_S
        channel.recv_into(memoryview(hello), deadline=deadline)
        op, rank, groups, rejoining, secret = read_hello(hello)
        if op != HELLO:
            raise Refused(f"request {op} before HELLO")
        if not hmac.compare_digest(secret, self.secret):
            raise Refused("a HELLO without the run's secret")
        if not 1 <= rank <= self.server.workers:
            raise Refused(f"a HELLO for rank {rank} (this server has ranks 1..{self.server.workers})")
        ours = self.server.hypers
        if groups == len(ours.groups):  # read no more than the server's own groups take
            described = bytearray(groups * GROUP_BYTES)
            channel.recv_into(memoryview(described), deadline=deadline)
            why = ours.mismatch(Hyperparameters.described(unpack_groups(described)))
        else:
            why = f"it has {groups} parameter groups, the server's optimiser {len(ours.groups)}"
        if why is not None:
            try:
                channel.send(refusal_message(ours.describe()))
            except OSError:
                pass
            raise Mismatched(rank, why)
        with self.membership:
            if channel.closed or channel not in self.pending:  # evicted meanwhile, or the service is closing
                raise Refused("closed before its HELLO was read")
            live = self.current.get(rank)
            if live is not None and not live.closed and not live.hung_up():  # whatever the HELLO says
                raise Refused(f"a second HELLO for worker {rank - 1}, which is connected")
            self.pending.remove(channel)
            self.current[rank] = channel
            self.role.worker_hello(rank, rejoining)
        return rank

    def _serve(self, channel: Channel) -> None:
        rank, connection = -1, None
        try:
            rank = self._handshake(channel)
            connection = _Connection(self, channel, rank)
            with self.membership:
                self.serving.add(connection)
            connection.run()
        except Exception as exc:  # its connection broke: it died, fell silent, lied, or the run is ending
            if self.closing:
                return
            why = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            if isinstance(exc, (socket.timeout, BlockingIOError, TimeoutError)):
                why = f"silent for {self.silence_s:.0f} s (--timeout)" if rank >= 0 else "no HELLO in time"
            if rank >= 0:
                taken, gone = None, False
                with self.membership:  # a replacement's HELLO cannot slip in between the test and the drop
                    if self.current.get(rank) is channel:  # not a replaced one
                        log.warning("worker %d is gone (%s); the server carries on without it", rank - 1, why)
                        taken, gone = self.role.leave(rank, why), True
                if gone:
                    self.role.commit_after(taken)  # a checkpoint this completed: written outside the lock
            elif isinstance(exc, Mismatched):
                with self.membership:
                    self.refused += 1
                log.warning("refused worker %d: its optimiser does not match the server's (%s)", exc.rank - 1, why)
            else:
                if channel.evicted:
                    why = f"closed to make room: more than {self.max_pending} connections waited for their HELLO"
                with self.membership:
                    self.refused += 1
                    n = self.refused
                if n <= REFUSALS_SHOWN:
                    log.warning(
                        "refused a connection that did not say which of this run's workers it is (%s)%s",
                        why,
                        "; further refusals are only counted (refused_connections in the summary)"
                        if n == REFUSALS_SHOWN
                        else "",
                    )
        finally:
            with self.membership:
                self.serving.discard(connection)
            self._forget(channel)

    def _forget(self, channel: Channel) -> None:
        channel.close()
        with self.membership:
            self.open -= 1
            if channel in self.pending:
                self.pending.remove(channel)
            self.channels = [c for c in self.channels if not c.closed]


class _Connection:
    """One admitted worker's requests, each checked, each answered with one message."""

    def __init__(self, service: Service, channel: Channel, rank: int) -> None:
        self.service, self.channel, self.rank = service, channel, rank
        self.server, self.role, self.layout = service.server, service.role, service.layout
        self.request, self.answer = Frame(self.layout.request_bytes), Frame(self.layout.answer_bytes)
        self.hypers = self.layout.hypers.whole(self.request).numpy()  # a push's hyperparameters (a view)
        self.present = self.layout.present.whole(self.request).numpy()  # which parameters it has a gradient of
        self.sending = threading.Lock()  # answers and BEATs, one message at a time
        self.waiting: float | None = None  # since when the worker has heard nothing while it waits for an answer
        self.reply(
            self.server.version, self.server.total_samples(), self.server.stop, nbytes=self.server.counts[rank]
        )  # HELLO: answered with that rank's samples so far
        self.server.count(received=HELLO_BYTES + GROUP_BYTES * len(self.server.hypers.groups), rank=rank)

    def reply(
        self,
        version: int,
        total: int,
        stop: bool,
        data: torch.Tensor | None = None,
        nbytes: int = 0,
        floats: list[torch.Tensor] | None = None,
    ) -> None:
        if data is not None:
            self.layout.params.whole(self.answer).copy_(data)
        if floats is not None:
            self.layout.floats.pack(self.answer, floats)
        with self.sending:
            self.server.count(sent=self.answer.send(self.channel, version, total, int(stop), nbytes))
            self.waiting = None

    def beat(self, quiet_s: float) -> None:
        """A BEAT if the worker has waited ``quiet_s`` for its answer since it last heard from the
        server (never in the middle of an answer being sent)."""
        if self.waiting is None or time.monotonic() - self.waiting < quiet_s or not self.sending.acquire(False):
            return
        try:
            if self.waiting is not None:
                self.server.count(sent=self.channel.send(BEAT_MESSAGE))
                self.waiting = time.monotonic()
        except OSError:
            pass  # the connection broke: its own thread finds out
        finally:
            self.sending.release()

    def run(self) -> None:
        server, layout, request, rank = self.server, self.layout, self.request, self.rank
        silence = self.service.silence_s
        while True:
            op, version, samples, flag = request.recv_head(self.channel)
            if op not in (PING, PULL, PUSH, EXCHANGE, BARRIER, CHECKPOINTED, STOP, DONE):
                raise Refused(f"unknown request {op}")
            if op != PING:
                request.recv_payload(self.channel, None if silence is None else time.monotonic() + silence)
            server.count(received=HEAD if op == PING else request.buffer.numel(), rank=rank)
            if op not in (PING, DONE):
                self.waiting = time.monotonic()
            if op in (PUSH, EXCHANGE, DONE, CHECKPOINTED):
                server.check_samples(rank, samples, done=op in (DONE, CHECKPOINTED))
            if op == PING:  # [PING, 0, 0, 0]: the worker is alive, busy between requests
                continue
            if op == PULL:
                flat, v = server.pull(rank)
                self.reply(v, server.total_samples(), server.stop, flat)
            elif op == PUSH:
                if not 0 <= version <= server.version:
                    raise Refused(f"a gradient computed on version {version}, which the server has not made")
                grad = layout.params.whole(request).clone()
                buffers = (
                    (layout.floats.unpack(request, clone=True), layout.ints.unpack(request, clone=True))
                    if flag
                    else None
                )
                hypers = self.hypers.tolist() if server.hypers.count else None
                if (self.present > 1).any():
                    raise Refused(
                        f"a push whose parameter {int((self.present > 1).argmax())} has a gradient "
                        f"{int(self.present.max())} times (0: none, 1: one)"
                    )
                present = None if self.present.all() else [bool(v) for v in self.present]
                flat, v, total, stop = server.push(rank, grad, version, samples, buffers, hypers, present).wait()
                self.reply(v, total, stop, flat)
            elif op == EXCHANGE:
                x = layout.params.whole(request).clone()
                floats, ints = layout.floats.unpack(request, clone=True), layout.ints.unpack(request, clone=True)
                (diff, diff_floats), v, total, stop = server.exchange(rank, x, floats, ints, samples)
                self.reply(v, total, stop, diff, floats=diff_floats)
            elif op == BARRIER:
                server.barrier().wait()
                self.reply(server.version, server.total_samples(), server.stop)
            elif op == CHECKPOINTED:  # [CHECKPOINTED, seq, samples, 0]: this worker saved its part
                self.role.checkpointed(rank, version, samples)
                self.reply(server.version, server.total_samples(), server.stop)
            elif op == STOP:  # [STOP, 0, 0, 0]: a user's loop measured the target (--stop-at-target)
                self.role.reached(rank)
                self.reply(server.version, server.total_samples(), server.stop)
            else:  # DONE, with the worker's buffers as it ends where flag
                ends = (
                    (layout.floats.unpack(request, clone=True), layout.ints.unpack(request, clone=True))
                    if flag
                    else None
                )
                self.role.worker_done(rank, samples, ends)
                return


def connect(address: str, timeout_s: float) -> Channel:
    """A connection to the server at ``host:port``, retried until it listens (or ``timeout_s``),
    on which a send or a receive that makes no progress for ``timeout_s`` fails."""
    host, _, port = address.rpartition(":")
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            sock = socket.create_connection((host, int(port)), timeout=timeout_s)
            sock.settimeout(None)  # blocking, with the kernel's limits (Channel's silence_s): no cost per call
            return Channel(sock, timeout_s)
        except OSError:
            if time.monotonic() > deadline:
                raise ConnectionError(f"no parameter server answered at {address} within {timeout_s:.0f} s") from None
            time.sleep(0.05)


class Client:
    """A worker's calls on the server at ``address``. ``me`` is its rank (its data rank + 1);
    ``weights`` the flat buffer its model's parameters are views of (answers land in it); ``layout``
    where the model's parts lie in a message; ``hypers`` its optimiser's parameter groups, which its
    HELLO describes (a server whose own differ refuses it: a ConfigError saying how).
    ``rejoining``: it replaces a worker of that rank that died; ``samples`` then says how many
    samples that rank had trained.

    A thread sends a PING (a header, 32 bytes) whenever no request has gone out for
    ``timeout_s / 4``: the server drops a worker silent for ``timeout_s``, and a busy one is not
    silent. Requests and PINGs share the connection under one lock. Likewise a server that says
    nothing for ``timeout_s`` while an answer is due (it sends BEATs while one waits: a round, the
    start) is frozen or gone: the call fails with one line, instead of waiting for ever."""

    def __init__(
        self,
        me: int,
        weights: torch.Tensor,
        layout: Layout,
        address: str,
        timeout_s: float,
        rejoining: bool = False,
        secret: bytes = b"",
        hypers: Hyperparameters | None = None,
    ) -> None:
        self.me, self.weights, self.layout = me, weights, layout
        self.hypers = hypers if hypers is not None else Hyperparameters.none()
        assert sum(layout.hypers.numels) == self.hypers.count, "a layout with this optimiser's hyperparameters"
        pinned = weights.device.type == "cuda"
        self.request, self.answer = Frame(layout.request_bytes, pinned), Frame(layout.answer_bytes, pinned)
        self.hyper_view = layout.hypers.whole(self.request).numpy()  # where a push's hyperparameters go
        self.present_view = layout.present.whole(self.request).numpy()  # and which parameters have a gradient
        self.bytes_sent = 0
        self.replied_weights = False  # the last answer's payload holds the weights (a pull's, a push's)
        self.total = 0  # every worker's samples, as the answer to the HELLO or the last pull said
        self.address, self.timeout_s = address, timeout_s
        self.channel = connect(address, timeout_s)
        self.lock, self.quiet_s, self.last = threading.Lock(), timeout_s / 4, time.monotonic()
        self.closed = threading.Event()
        try:
            with self.lock:  # the HELLO: its header, the run's secret, its groups; the answer, a whole message
                self.bytes_sent += self.channel.send(hello_message(me, secret, rejoining, self.hypers.describe()))
                _, self.total, _, self.samples = self._answer(hello=True)
        except (OSError, ConfigError):
            self.channel.close()
            raise
        self.beat = threading.Thread(target=self._beat, name="distsgd-ps-heartbeat", daemon=True)
        self.beat.start()

    def close(self) -> None:
        """Stop the heartbeat and close the connection (after :meth:`done`, or to give up)."""
        self.closed.set()
        self.channel.close()
        if self.beat is not threading.current_thread():
            self.beat.join(5.0)

    def _call(self, op: int, version: int = 0, samples: int = 0, flag: int = 0) -> tuple[int, int, bool, int]:
        with self.lock:
            try:
                self.bytes_sent += self.request.send(self.channel, op, version, samples, flag)
            except (socket.timeout, BlockingIOError, TimeoutError):
                raise self._frozen() from None
            self.last = time.monotonic()
            self.replied_weights = op in (PULL, PUSH)  # (another answer's payload is not the weights)
            if op == DONE:
                self.closed.set()
                return 0, 0, False, 0
            version, total, stop, nbytes = self._answer()
        return version, total, bool(stop), nbytes

    def _answer(self, hello: bool = False) -> list[int]:
        """The header of the server's answer, its payload in ``answer``; the BEATs before it skipped.
        ``hello``: the answer to the HELLO, which may be a refusal."""
        try:
            while (head := self.answer.recv_head(self.channel))[0] == BEAT:
                pass
            if hello and head[0] == REFUSED:
                raise self._refused(head[1])
            self.answer.recv_payload(self.channel)
        except (socket.timeout, BlockingIOError, TimeoutError):
            raise self._frozen() from None
        return head

    def _refused(self, groups: int) -> ConfigError:
        """The server's parameter groups (``groups`` of them follow), and how this worker's differ."""
        ours = self.hypers
        if 0 <= groups <= max(len(ours.groups), 4096):  # a sane count: read the server's groups
            described = bytearray(groups * GROUP_BYTES)
            self.channel.recv_into(memoryview(described))
            theirs = Hyperparameters.described(unpack_groups(described))
            why = theirs.mismatch(ours)
            if sum(g.tensors for g in ours.groups) != sum(g.tensors for g in theirs.groups):
                why = (  # (where its model has another structure than spawn(model=...)'s, the likelier)
                    f"{why}: was run.setup() given a model of another structure than spawn(model=...)'s? "
                    f"the server's is built from that"
                )
        else:
            why = None
        return ConfigError(
            f"the parameter server refused worker {self.me - 1}: its optimiser does not match the server's "
            f"({why or 'the server said so'}); the server builds its optimiser with the same factory on the "
            f"same model (distsgd.spawn(optimizer=...), --optimizer), so every worker's must be that one"
        )

    def _frozen(self) -> ConnectionError:
        return ConnectionError(
            f"the parameter server at {self.address} sent nothing for {self.timeout_s:g} s "
            f"(--timeout): it is frozen, or its machine is gone"
        )

    def _beat(self) -> None:
        while not self.closed.wait(self.quiet_s / 2):
            with self.lock:
                if self.closed.is_set() or time.monotonic() - self.last < self.quiet_s:
                    continue
                try:
                    self.bytes_sent += self.channel.send(PING_MESSAGE)
                except OSError:  # the server is gone: the next request says so
                    return
                self.last = time.monotonic()

    def pull(self) -> int:
        """The server's weights into ``weights``; returns their version (and sets ``total``)."""
        version, self.total, _, _ = self._call(PULL)
        self.weights.copy_(self.layout.params.whole(self.answer))
        return version

    def changed_since_answer(self) -> bool:
        """Whether ``weights`` differ from the server's last answer, which landed in them (a worker
        that takes no step of its own holds them unchanged until its next push); False when the
        last answer was to another request (a barrier's, a checkpoint's: not the weights)."""
        if not self.replied_weights:
            return False
        answer = self.layout.params.whole(self.answer)
        return not torch.equal(self.weights.to(answer.device), answer)

    def push(
        self,
        grad: list[torch.Tensor],
        version: int,
        samples: int,
        buffers: tuple[list[torch.Tensor], list[torch.Tensor]] | None,
        hypers: list[float] | None = None,
        present: list[bool] | None = None,
    ) -> tuple[int, int, bool]:
        """A gradient (the parameters' gradients, in order) computed on ``version``, the
        (floating-point, other) buffers, the optimiser's hyperparameters at that step (as
        :meth:`.hyper.Hyperparameters.read` lists them) and which parameters have a gradient
        (``present``, one bool a parameter, as the worker knows it without a look at the values;
        None: all; an absent one's gradient in ``grad`` is zeros); the new weights land in
        ``weights``."""
        layout = self.layout
        layout.params.pack(self.request, grad)
        if buffers is not None:
            layout.floats.pack(self.request, buffers[0])
            layout.ints.pack(self.request, buffers[1])
        if self.hypers.count:
            assert hypers is not None and len(hypers) == self.hypers.count, "the optimiser's hyperparameters"
            self.hyper_view[:] = hypers
        self.present_view[:] = 1 if present is None else present
        version, total, stop, _ = self._call(PUSH, version, samples, int(buffers is not None))
        self.weights.copy_(layout.params.whole(self.answer))
        return version, total, stop

    def exchange(
        self, x: torch.Tensor, floats: list[torch.Tensor], ints: list[torch.Tensor], samples: int
    ) -> tuple[tuple[torch.Tensor, list[torch.Tensor]], int, int, bool]:
        """Async EASGD: send x (the flat parameters and the floating-point buffers) and the other
        buffers; get the difference d of both from the centre (on x's device)."""
        layout = self.layout
        layout.params.whole(self.request).copy_(x)
        layout.floats.pack(self.request, floats)
        layout.ints.pack(self.request, ints)
        version, total, stop, _ = self._call(EXCHANGE, 0, samples)
        where = x.device
        diff = (
            layout.params.whole(self.answer).to(where, copy=True),
            [d.to(where) for d in layout.floats.unpack(self.answer, clone=True)],
        )
        return diff, version, total, stop

    def barrier(self) -> None:
        self._call(BARRIER)

    def done(self, samples: int, buffers: tuple[list[torch.Tensor], list[torch.Tensor]] | None = None) -> None:
        """This worker finished, with its (floating-point, other) buffers as they are now (the
        frame has their room: a recalibration after the last push, ``update_bn``, reaches the server)."""
        if buffers is not None:
            self.layout.floats.pack(self.request, buffers[0])
            self.layout.ints.pack(self.request, buffers[1])
        self._call(DONE, 0, samples, int(buffers is not None))
        self.close()

    def checkpointed(self, seq: int, samples: int) -> None:
        """This worker saved its part of checkpoint ``seq``: the server commits once all live have."""
        self._call(CHECKPOINTED, seq, samples)

    def reached(self) -> None:
        """This worker's own evaluation reached --stop-at-target's target: every worker stops."""
        self._call(STOP)
