"""Rendezvous: joining a process group, free ports, torchrun's environment, loopback only.

A launcher makes this process one rank of a run in one of two ways: torchrun sets its variables
and distsgd forms the group; Ray Train's ``TorchTrainer`` (or any code that calls
``init_process_group`` first) forms the default group before distsgd runs, and distsgd joins it
as it is and leaves it so (:func:`launcher_group`).

Servers bind to 127.0.0.1 unless the user names another address; torch.distributed has no
authentication or encryption, so distsgd warns when it is asked to listen elsewhere.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import os
import socket
import sys
import tempfile
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d

# Imported before any group forms, on purpose: this module's functions take ``group=group.WORLD``
# as a default argument, evaluated at import. torch imports it lazily (the first optimizer built
# loads torch._dynamo, which loads it through FSDP), and once a group exists each of those defaults
# keeps a reference to that group: destroy_process_group then cannot free it, its gloo threads
# live on into interpreter exit, and one that drops its last finished work there aborts the
# process ("terminate called without an active exception", SIGABRT) after a run that succeeded.
import torch.distributed.nn.functional  # noqa: F401  # isort: skip

from distsgd.config import RunConfig
from distsgd.errors import ConfigError
from distsgd.launch import environment
from distsgd.launch.environment import formed_group
from distsgd.train import device

log = logging.getLogger(__name__)

LOOPBACK = "127.0.0.1"


def free_port(host: str = LOOPBACK) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def place() -> tuple[int, int]:
    """This process's rank and the size of its launcher's group (the group's own once it exists)."""
    if formed_group():
        return dist.get_rank(), dist.get_world_size()
    where = environment.current()
    return where.rank, where.world_size


def group_host() -> str | None:
    """Rank 0's host, where the launcher's group keeps its store: ``MASTER_ADDR`` (torchrun's, Ray
    Train's), else the TCP store of a group formed with ``tcp://``; None where neither says."""
    address = environment.current().address
    if address is not None:
        return address
    if formed_group():
        store = distributed_c10d._get_default_store()
        while isinstance(store, dist.PrefixStore):
            store = store.underlying_store
        if isinstance(store, dist.TCPStore):
            return store.host
    return None


@contextlib.contextmanager
def launcher_group(cfg: RunConfig) -> Iterator[tuple[int, int]]:
    """This process's rank and the group's size, inside the group its launcher formed: one that
    exists already is used as it is and left for the caller's code after the run (its backend and
    timeout are its own); torchrun's is joined here and left on the way out."""
    if formed_group():
        yield place()
        return
    rank, world = place()
    init_torchrun_group(cfg, rank, world)
    try:
        yield rank, world
    except BaseException as exc:
        _said_on_the_store(exc, rank)
        raise
    finally:
        leave_group()


FAILED = "distsgd/failed"  # on a launcher's group's store: the rank whose run failed (its error its own)


def _said_on_the_store(exc: BaseException, rank: int) -> None:
    """This rank's run ends on ``exc``. Its own failure (a refusal, an error of the loop or the
    model) is written on the group's store before it is raised, so that a peer the launcher's agent
    then ends with SIGTERM (torchrun's, which ends every rank once one fails) ends as that signal
    ends a process, silently: the failure is this rank's, said here. Until 2026-12-01 such a peer,
    stopped at a wait that makes no collective (run.final_model()'s on the store), printed a
    ``Terminated: SIGTERM`` traceback of its own under the error (an audit's). A SIGTERM with no
    failure written (a stop of the whole job: scancel, a preemption) stops the run as ever, with
    its resume hint."""
    from distsgd.errors import STOP, PeerFailed, Terminated, ended_by_sigterm_within

    if not dist.is_initialized():
        return
    try:
        store = distributed_c10d._get_default_store()
        if isinstance(exc, Terminated):
            if environment.current().agent_ends_ranks and store.check([FAILED]):
                ended_by_sigterm_within(0.0, asked=True)
        elif not isinstance(exc, (PeerFailed, KeyboardInterrupt, GeneratorExit)) and STOP.requested is None:
            # (not a failure a stop of the whole job caused here, a DataLoader's process the same
            # SIGTERM ended: the others keep their resume hint)
            store.set(FAILED, str(rank))
    except Exception:  # (a store gone with its host: nothing known, nothing said)
        pass


def formed_backend(cfg: RunConfig) -> RunConfig:
    """The backend of a run in a group formed before it: the group's (``--backend auto``), or one
    ConfigError line for another."""
    have = str(dist.get_backend())
    if cfg.backend not in ("auto", have):
        raise ConfigError(
            f"the process group this process is in uses {have}, not --backend {cfg.backend}: leave --backend "
            f"auto, or form the group with {cfg.backend} (Ray Train: TorchConfig(backend=...))"
        )
    return cfg.replace(backend=have)


def resolve_backend(cfg: RunConfig, local_workers: int) -> RunConfig:
    """``--backend auto``: nccl when the workers train on GPUs and every one of this machine's
    ``local_workers`` has a GPU of its own (and torch has NCCL), else gloo (which takes CUDA tensors
    too, for the collectives the algorithms use). In a group formed before the run: its own."""
    if formed_group():
        return formed_backend(cfg)
    if cfg.backend != "auto":
        return cfg
    own_gpus = device.kind(cfg.device) == "cuda" and local_workers <= _gpus(cfg)
    return cfg.replace(backend="nccl" if own_gpus and dist.is_nccl_available() else "gloo")


def _gpus(cfg: RunConfig) -> int:
    """The GPUs a machine's workers spread over (cuda:N: every worker on that one)."""
    return 1 if cfg.device.startswith("cuda:") else device.cuda_count()


def check_backend(cfg: RunConfig, local_workers: int = 1) -> None:
    """Reject a backend this torch build or machine cannot run, before any process starts. NCCL
    takes GPU tensors only, and one rank per GPU (two ranks on one GPU fail inside NCCL)."""
    if cfg.backend == "nccl":
        if not (device.cuda_count() and dist.is_nccl_available()):
            raise ConfigError("--backend nccl needs CUDA GPUs and a torch build with NCCL; use --backend gloo on CPU")
        if device.kind(cfg.device) == "cpu":
            raise ConfigError("--backend nccl needs the workers on GPUs: use --device cuda, or --backend gloo")
        if local_workers > _gpus(cfg):
            raise ConfigError(
                f"--backend nccl needs a GPU for each worker of a machine: {local_workers} workers, "
                f"{_gpus(cfg)} GPU(s) for --device {cfg.device}; use --backend gloo (or auto)"
            )
    if cfg.backend == "mpi" and not dist.is_mpi_available():
        raise ConfigError("--backend mpi is not available in this torch build; use --backend gloo")
    if cfg.backend == "gloo" and not dist.is_gloo_available():
        raise ConfigError("--backend gloo is not available in this torch build")


def check_init_method(init_method: str | None) -> None:
    """Warn when the rendezvous (checked by ``config.validate``) listens beyond this machine."""
    if init_method is not None and init_method.startswith("tcp://"):
        host = init_method[len("tcp://") :].rsplit(":", 1)[0]
        if host not in ("127.0.0.1", "localhost", "::1", "[::1]"):
            log.warning(
                "the rendezvous listens on %s: torch.distributed has no authentication or encryption; "
                "use it only on a trusted network",
                host,
            )


def init_group(cfg: RunConfig, rank: int, world: int, init_method: str) -> None:
    """Join the default process group with the run's backend and collective timeout."""
    dist.init_process_group(
        backend=cfg.backend,
        init_method=init_method,
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=cfg.timeout_s),
        device_id=_bound(cfg),
    )


def init_on_store(cfg: RunConfig, rank: int, world: int, port: int) -> None:
    """Join the default process group through the launcher's store on 127.0.0.1:``port``, as
    :func:`init_group` does otherwise. The launcher listens there from before any worker starts: a
    port chosen free, closed and handed to worker 0 to bind could be taken meanwhile by another
    process's connection (EADDRINUSE: seen once in a whole test run beside another run)."""
    timeout = datetime.timedelta(seconds=cfg.timeout_s)
    store = dist.TCPStore(LOOPBACK, port, world, is_master=False, timeout=timeout)
    dist.init_process_group(
        backend=cfg.backend,
        store=dist.PrefixStore("distsgd/group", store),
        rank=rank,
        world_size=world,
        timeout=timeout,
        device_id=_bound(cfg),
    )


def _bound(cfg: RunConfig) -> torch.device | None:
    """NCCL's group is bound to this worker's GPU (the current device, which ``device.use`` set):
    its barrier and communicators use that one rather than guess (and warn). None: unbound."""
    return torch.device("cuda", torch.cuda.current_device()) if cfg.backend == "nccl" else None


def init_torchrun_group(cfg: RunConfig, rank: int, world: int) -> None:
    """Join the group torchrun (or srun) formed, within ``--timeout``: a first host that cannot be
    reached, a peer that never comes or a port already taken is one ConfigError line."""
    with rendezvous_errors(cfg, "the process group", "form"):
        _join_torchrun_group(cfg, rank, world)


@contextlib.contextmanager
def rendezvous_errors(cfg: RunConfig, what: str, failed: str) -> Iterator[None]:
    """Reaching the launcher's store at MASTER_ADDR:MASTER_PORT (the group's, or with
    --min-workers the keepers' own connection): a DistError (the rendezvous, not a collective)
    is one ConfigError line, and torch's native log of each failed try is held meanwhile."""
    try:
        with _native_stderr_held():
            yield
    except dist.DistError as exc:  # DistNetworkError, DistStoreError
        here = environment.current()
        where = f"{here.address}:{here.port}"
        cause = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ConfigError(
            f"{what} at {where} (MASTER_ADDR:MASTER_PORT) did not {failed} within --timeout {cfg.timeout_s:g} s: {cause}"
        ) from None


@contextlib.contextmanager
def _native_stderr_held() -> Iterator[None]:
    """While the group forms, what torch's C++ side writes to stderr itself (each failed try to
    reach the store, with a stack of native frames) is held: written out once the group formed,
    dropped when it did not (the one error line says why)."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as held:
        os.dup2(held.fileno(), 2)
        try:
            yield
            sys.stderr.flush()
            held.seek(0)
            os.write(saved, held.read())
        finally:
            os.dup2(saved, 2)
            os.close(saved)


def _join_torchrun_group(cfg: RunConfig, rank: int, world: int) -> None:
    """After a torchrun restart, the store may still hold the previous attempt's addresses under
    the default keys, so each attempt uses keys of its own."""
    here = environment.current()
    restart = here.attempt
    if restart == 0:
        init_group(cfg, rank, world, "env://")  # torch reads the variables adopt wrote
        return
    store = launcher_store(cfg, rank, world)
    dist.init_process_group(
        backend=cfg.backend,
        store=dist.PrefixStore(f"distsgd/attempt-{restart}", store),
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=cfg.timeout_s),
        device_id=_bound(cfg),
    )


def launcher_store(cfg: RunConfig, rank: int, world: int, wait_for_workers: bool = True) -> dist.TCPStore:
    """A connection to the store the launcher runs at MASTER_ADDR:MASTER_PORT (torchrun's agent's);
    where no agent holds one (srun's tasks, a pod given torchrun's variables), rank 0 hosts it.
    ``wait_for_workers``: rank 0's host waits, up to --timeout, for the other ``world - 1`` to
    connect before it returns."""
    here = environment.current()
    assert here.address is not None and here.port is not None  # a launched environment's contract
    return dist.TCPStore(
        here.address,
        here.port,
        world,
        is_master=not here.agent_store and rank == 0,
        timeout=datetime.timedelta(seconds=cfg.timeout_s),
        wait_for_workers=wait_for_workers,
    )


def leave_group() -> None:
    if dist.is_available() and dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception:  # pragma: no cover - tearing down a broken group
            pass


def loopback_only() -> None:
    """Keep gloo's listeners of a local run on the loopback interface."""
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    os.environ.setdefault("TP_SOCKET_IFNAME", "lo")
