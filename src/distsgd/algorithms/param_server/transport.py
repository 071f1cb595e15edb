"""How workers reach the server: ``torch.distributed`` point-to-point messages (gloo).

The server (rank 0) runs one thread per worker, each serving its worker's requests in order. A
request is one message, a :class:`Frame`: an int64 header ``[op, version, samples, flag]`` and
the op's payload (a push's flat gradient and buffers); the answer is one message too (``[version,
all workers' samples, stop, nbytes]`` and the new flat weights). Everything on the wire is a
tensor: nothing is unpickled (the one structured message, the server's state for a sync-ps
checkpoint, travels as ``torch.save`` bytes loaded with ``weights_only=True``). A push that must
wait (a sync-ps round, an ssp bound) blocks only its own worker's thread. A worker whose
connection breaks (it died) is dropped; the server carries on.

Why not ``torch.distributed.rpc`` (what distsgd used before), measured on the 2-core VM on
2026-11-22 (docs/BENCHMARKS.md): with TensorPipe's default transports its shared-memory reactor
thread busy-polls about a fifth of a core in each of the three processes of a 2-worker run, and
asgd reached 0.56x Hogwild!'s samples/s; with its uv transport, 11.2k samples/s against 13.1k
here (limits.py A/B, 3 alternating repeats). With one message each way, asgd reaches 0.86x
Hogwild!. And TensorPipe, RPC's only backend, has been in maintenance mode since December 2025.
"""

from __future__ import annotations

import io
import logging
import threading
from typing import Any

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)

PULL, PUSH, EXCHANGE, DONE, BARRIER, STATE = range(6)
_REQUEST, _ANSWER, _STATE = 11, 13, 14  # message tags
_HEAD = 4 * 8  # bytes of a header: four int64


class Frame:
    """One message: an int64 header ``[a, b, c, d]`` and a payload, in one byte buffer, so that a
    request or an answer is one send. Every request (and every answer) has the same size: the
    largest any op needs (a push's gradient and buffers, an exchange's x); the few control
    messages (pull, barrier, done) carry an unused payload."""

    def __init__(self, nbytes: int) -> None:
        self.buffer = torch.zeros(_HEAD + nbytes, dtype=torch.uint8)
        self.head = self.buffer[:_HEAD].view(torch.int64)

    def floats(self, start: int, n: int) -> torch.Tensor:
        """float32 view of the payload: ``n`` values from value ``start``."""
        return self.buffer[_HEAD + 4 * start:_HEAD + 4 * (start + n)].view(torch.float32)

    def ints(self, start_byte: int, n: int) -> torch.Tensor:
        """int64 view of the payload: ``n`` values from payload byte ``start_byte``."""
        return self.buffer[_HEAD + start_byte:_HEAD + start_byte + 8 * n].view(torch.int64)

    def send(self, peer: int, tag: int, *head: int) -> int:
        self.head.copy_(torch.tensor(head, dtype=torch.int64))
        dist.send(self.buffer, peer, tag=tag)
        return self.buffer.numel()

    def recv(self, peer: int, tag: int) -> list[int]:
        dist.recv(self.buffer, peer, tag=tag)
        return self.head.tolist()


def frame_sizes(n_params: int, n_floats: int, n_ints: int) -> tuple[int, int]:
    """Payload bytes of (a request, an answer)."""
    request = max(4 * n_params + 4 * n_floats + 8 * n_ints, 4 * (n_params + n_floats) + 8 * n_ints)
    answer = 4 * (n_params + n_floats)  # weights (n_params), or an exchange's difference
    return request, answer


class Service:
    """The server's end: a thread per worker rank 1..N, serving ``server`` (the core) and ``role``
    (for checkpoint state). ``sizes``: (parameters, floating-point buffers, integer buffers)."""

    def __init__(self, server: Any, role: Any, world: int, sizes: tuple[int, int, int]) -> None:
        self.server, self.role, self.sizes = server, role, sizes
        self.threads = [threading.Thread(target=self._serve, args=(r,), name=f"distsgd-ps-{r}", daemon=True)
                        for r in range(1, world)]
        self.closing = False

    def start(self) -> None:
        for t in self.threads:
            t.start()

    def close(self, wait_s: float = 5.0) -> None:
        self.closing = True
        for t in self.threads:
            t.join(wait_s)

    def _serve(self, rank: int) -> None:
        n_params, n_floats, n_ints = self.sizes
        req_bytes, ans_bytes = frame_sizes(*self.sizes)
        request, answer = Frame(req_bytes), Frame(ans_bytes)
        server = self.server

        def reply(version: int, total: int, stop: bool, data: torch.Tensor | None = None, nbytes: int = 0) -> None:
            if data is not None:
                answer.floats(0, data.numel()).copy_(data)
            server.count(sent=answer.send(rank, _ANSWER, version, total, int(stop), nbytes))

        try:
            while True:
                op, version, samples, flag = request.recv(rank, _REQUEST)
                server.count(received=request.buffer.numel())
                if op == PULL:
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
                elif op == STATE:
                    buffer = io.BytesIO()
                    torch.save(self.role.state_dict(), buffer)
                    data = torch.frombuffer(bytearray(buffer.getvalue()), dtype=torch.uint8)
                    reply(server.version, server.total_samples(), server.stop, nbytes=data.numel())
                    dist.send(data, rank, tag=_STATE)
                    server.count(sent=data.numel())
                elif op == DONE:
                    server.finished(rank, samples)
                    return
        except Exception as exc:  # its connection broke: it died, or the run is being torn down
            if not self.closing:
                log.warning("worker %d is gone (%s); the server carries on without it", rank - 1,
                            str(exc).splitlines()[0] if str(exc) else type(exc).__name__)
                server.finished(rank)


class Client:
    """A worker's calls on the server. ``me`` is its rank in the group (its data rank + 1);
    ``weights`` the flat buffer its model's parameters are views of (answers land in it)."""

    def __init__(self, me: int, weights: torch.Tensor, sizes: tuple[int, int, int]) -> None:
        self.me, self.weights, self.sizes = me, weights, sizes
        req_bytes, ans_bytes = frame_sizes(*sizes)
        self.request, self.answer = Frame(req_bytes), Frame(ans_bytes)
        self.bytes_sent = 0

    def _call(self, op: int, version: int = 0, samples: int = 0, flag: int = 0) -> tuple[int, int, bool, int]:
        self.bytes_sent += self.request.send(0, _REQUEST, op, version, samples, flag)
        if op == DONE:
            return 0, 0, False, 0
        version, total, stop, nbytes = self.answer.recv(0, _ANSWER)
        return version, total, bool(stop), nbytes

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

    def checkpoint_state(self) -> dict[str, Any]:
        nbytes = self._call(STATE)[3]
        data = torch.empty(nbytes, dtype=torch.uint8)
        dist.recv(data, 0, tag=_STATE)
        return torch.load(io.BytesIO(data.numpy().tobytes()), weights_only=True)
