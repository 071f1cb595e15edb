"""How workers reach the server: ``torch.distributed`` point-to-point messages (gloo).

The server (rank 0) runs one thread per worker, each serving its worker's requests in order:
a request is an int64 header ``[op, version, samples, flag]`` and the tensors of that op; the
answer is a header ``[version, all workers' samples, stop, nbytes]`` and, for most ops, a flat
tensor. Everything on the wire is a tensor: nothing is unpickled (the one structured message, the
server's state for a sync-ps checkpoint, travels as ``torch.save`` bytes loaded with
``weights_only=True``). A push that must wait (a sync-ps round, an ssp bound) blocks only its own
worker's thread. A worker whose connection breaks (it died) is dropped; the server carries on.

Measured against ``torch.distributed.rpc`` on the 2-core VM (docs/BENCHMARKS.md): TensorPipe's
shared-memory reactor thread busy-polls, about a fifth of a core in each of the three processes,
and a call cost about 300-380 us of CPU on each side against 170 us here; asgd went from 0.56x to
see BENCHMARKS of hogwild's throughput. TensorPipe has also been in maintenance mode since
December 2025.
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
_REQUEST, _PAYLOAD, _ANSWER, _DATA = 11, 12, 13, 14  # message tags


def _send(t: torch.Tensor, peer: int, tag: int) -> int:
    dist.send(t, peer, tag=tag)
    return t.numel() * t.element_size()


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

    def _answer(self, rank: int, version: int, total: int, stop: bool, data: torch.Tensor | None = None,
                nbytes: int = 0) -> None:
        self.server.count(sent=_send(torch.tensor([version, total, int(stop), nbytes]), rank, _ANSWER))
        if data is not None:
            dist.send(data, rank, tag=_DATA)  # counted by the core (weights, differences) or the caller (state)

    def _serve(self, rank: int) -> None:
        head = torch.zeros(4, dtype=torch.int64)
        n_params, n_floats, n_ints = self.sizes
        server = self.server
        try:
            while True:
                dist.recv(head, rank, tag=_REQUEST)
                server.count(received=head.numel() * head.element_size())
                op, version, samples, flag = head.tolist()
                if op == PULL:
                    flat, v = server.pull(rank)
                    self._answer(rank, v, server.total_samples(), server.stop, flat)
                elif op == PUSH:
                    grad = torch.empty(n_params)
                    dist.recv(grad, rank, tag=_PAYLOAD)
                    buffers = None
                    if flag:
                        floats, ints = torch.empty(n_floats), torch.empty(n_ints, dtype=torch.int64)
                        dist.recv(floats, rank, tag=_PAYLOAD)
                        dist.recv(ints, rank, tag=_PAYLOAD)
                        buffers = (floats, ints)
                    flat, v, total, stop = server.push(rank, grad, version, samples, buffers).wait()
                    self._answer(rank, v, total, stop, flat)
                elif op == EXCHANGE:
                    x, ints = torch.empty(n_params + n_floats), torch.empty(n_ints, dtype=torch.int64)
                    dist.recv(x, rank, tag=_PAYLOAD)
                    dist.recv(ints, rank, tag=_PAYLOAD)
                    diff, v, total, stop = server.exchange(rank, x, ints, samples)
                    self._answer(rank, v, total, stop, diff)
                elif op == BARRIER:
                    server.barrier().wait()
                    self._answer(rank, server.version, server.total_samples(), server.stop)
                elif op == STATE:
                    buffer = io.BytesIO()
                    torch.save(self.role.state_dict(), buffer)
                    data = torch.frombuffer(bytearray(buffer.getvalue()), dtype=torch.uint8)
                    self._answer(rank, server.version, server.total_samples(), server.stop, data, data.numel())
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

    def __init__(self, me: int, weights: torch.Tensor) -> None:
        self.me, self.weights = me, weights
        self.head = torch.zeros(4, dtype=torch.int64)
        self.bytes_sent = 0

    def _request(self, op: int, version: int = 0, samples: int = 0, flag: int = 0, *payload: torch.Tensor) -> None:
        self.bytes_sent += _send(torch.tensor([op, version, samples, flag]), 0, _REQUEST)
        for t in payload:
            self.bytes_sent += _send(t, 0, _PAYLOAD)

    def _answer(self, into: torch.Tensor | None) -> tuple[int, int, bool, int]:
        dist.recv(self.head, 0, tag=_ANSWER)
        version, total, stop, nbytes = self.head.tolist()
        if into is not None:
            dist.recv(into, 0, tag=_DATA)
        return version, total, bool(stop), nbytes

    def pull(self) -> int:
        """The server's weights into ``weights``; returns their version."""
        self._request(PULL)
        return self._answer(self.weights)[0]

    def push(self, grad: torch.Tensor, version: int, samples: int,
             buffers: tuple[torch.Tensor, torch.Tensor] | None) -> tuple[int, int, bool]:
        """A gradient computed on ``version``; the new weights land in ``weights``."""
        self._request(PUSH, version, samples, int(buffers is not None), grad, *(buffers or ()))
        return self._answer(self.weights)[:3]

    def exchange(self, x: torch.Tensor, ints: torch.Tensor, samples: int) -> tuple[torch.Tensor, int, int, bool]:
        """Async EASGD: send x (parameters and floating-point buffers) and the integer buffers; get d."""
        self._request(EXCHANGE, 0, samples, 0, x, ints)
        diff = torch.empty_like(x)
        version, total, stop, _ = self._answer(diff)
        return diff, version, total, stop

    def barrier(self) -> None:
        self._request(BARRIER)
        self._answer(None)

    def done(self, samples: int) -> None:
        self._request(DONE, 0, samples)

    def checkpoint_state(self) -> dict[str, Any]:
        self._request(STATE)
        dist.recv(self.head, 0, tag=_ANSWER)
        data = torch.empty(int(self.head[3]), dtype=torch.uint8)
        dist.recv(data, 0, tag=_DATA)
        return torch.load(io.BytesIO(data.numpy().tobytes()), weights_only=True)
