"""How workers reach the server: ``torch.distributed.rpc`` (TensorPipe).

The server process registers its :class:`~.core.ParameterServer` and role with :func:`serve`;
workers call the module-level ``_rpc_*`` functions on it through a :class:`Client`. Handlers that
may wait (a push in a sync round or held by ssp, a barrier) return futures, so no RPC thread is
held while a worker waits. Local runs keep TensorPipe's listener on 127.0.0.1.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from typing import Any, Callable

import torch
from torch.futures import Future

from distsgd.config import RunConfig

SERVER_NAME = "ps"

_SERVER: Any = None  # the ParameterServer of this process (the server's only)
_ROLE: Any = None  # the server role, for checkpoint state

try:  # the handler returns a Future; the RPC thread is free while a worker waits
    from torch.distributed.rpc.functions import async_execution as _async_execution
except ImportError:  # pragma: no cover - a torch build without RPC
    def _async_execution(fn: Callable) -> Callable:
        return fn


@contextlib.contextmanager
def connect(cfg: RunConfig, rank: int, world: int, init_method: str) -> Iterator[None]:
    """Join the RPC group as the server (rank 0) or worker ``rank``; leave it on the way out."""
    from torch.distributed import rpc

    warnings.filterwarnings("ignore", message="You are using a Backend")  # torch's own rpc init
    options = rpc.TensorPipeRpcBackendOptions(init_method=init_method, rpc_timeout=cfg.timeout_s,
                                              num_worker_threads=max(16, 2 * world + 4))
    rpc.init_rpc(SERVER_NAME if rank == 0 else f"worker{rank}", rank=rank, world_size=world,
                 rpc_backend_options=options)
    try:
        yield
    finally:
        rpc.shutdown(graceful=False)


def serve(server: Any, role: Any) -> None:
    """Make ``server`` (and ``role``) what the workers' calls reach in this process; None: stop."""
    global _SERVER, _ROLE
    _SERVER, _ROLE = server, role


class Client:
    """A worker's calls on the server. ``me`` is its RPC rank (its data rank + 1)."""

    def __init__(self, me: int) -> None:
        from torch.distributed import rpc

        self.me, self.rpc = me, rpc

    def _call(self, fn: Callable, *args: Any) -> Any:
        return self.rpc.rpc_sync(SERVER_NAME, fn, args=args)

    def pull(self) -> tuple[torch.Tensor, int]:
        return self._call(_rpc_pull, self.me)

    def push(self, grad: torch.Tensor, version: int, local_samples: int, buffers: Any) -> Any:
        return self._call(_rpc_push, self.me, grad, version, local_samples, buffers)

    def exchange(self, x: torch.Tensor, ints: torch.Tensor, local_samples: int) -> Any:
        return self._call(_rpc_exchange, self.me, x, ints, local_samples)

    def done(self, local_samples: int) -> None:
        self._call(_rpc_done, self.me, local_samples)

    def barrier(self) -> None:
        self._call(_rpc_barrier)

    def checkpoint_state(self) -> dict[str, Any]:
        return self._call(_rpc_checkpoint_state)


def _rpc_pull(rank: int) -> tuple[torch.Tensor, int]:
    return _SERVER.pull(rank)


@_async_execution
def _rpc_push(rank: int, grad: torch.Tensor, version_read: int, local_samples: int, buffers: Any) -> Future:
    return _SERVER.push(rank, grad, version_read, local_samples, buffers)


def _rpc_exchange(rank: int, x: torch.Tensor, ints: torch.Tensor, local_samples: int) -> Any:
    return _SERVER.exchange(rank, x, ints, local_samples)


def _rpc_done(rank: int, local_samples: int) -> None:
    _SERVER.finished(rank, local_samples)


@_async_execution
def _rpc_barrier() -> Future:
    return _SERVER.barrier()


def _rpc_checkpoint_state() -> dict[str, Any]:
    return _ROLE.state_dict()
