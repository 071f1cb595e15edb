"""hogwild: Hogwild! (Niu, Recht, Re, Wright, NIPS 2011): lock-free SGD on one shared model.

Update rule, in each of N worker processes independently and with no lock:
w <- w - lr * grad L(w_read; batch), where w_read is whatever the shared weights held when this
worker read them, possibly half-overwritten by another worker's update. For sparse problems the
paper proves near-linear speed-up; for dense models like ours it works well in practice because
the collisions are small and rare relative to a step.

How it runs here: the model's parameters live in shared memory (``Tensor.share_memory_``) and
every worker process steps them in place with its own optimiser. Gradients are per process.
**Optimiser state is per worker**: each keeps its own momentum buffer (or Adam moments), built from
its own gradients only, applied to the shared weights; there is no shared momentum. The dataset
tensors are shared too, so N workers hold one copy. Threads per worker default to cores // N so
the workers do not oversubscribe the machine (pytorch/examples' mnist_hogwild lets every process
take every core). ``--hogwild-lock`` takes one lock around every update, for comparison.

Checkpoints (``--checkpoint-every``): each worker saves its optimiser, position and random state
at every checkpoint point, and the launcher, once every live worker has, saves the shared model
and commits. Such a checkpoint is whole but not one instant (the workers never stop together):
a resumed run continues from it, not bit for bit as an uninterrupted one would.

The launching process evaluates the shared model every ``--eval-every`` samples without pausing
the workers: it copies the weights at that moment (a Hogwild-consistent read) and evaluates the
copies once training ends, so evaluation takes no CPU from the workers and time-to-accuracy is
measured on the real shared model. With ``--stop-at-target`` it evaluates at once, to know when to
stop. A worker that dies does not stop the others; summary.json lists it in ``failed_workers``
and ``samples`` counts only the samples really processed.
"""

from __future__ import annotations

import fcntl
import logging
import os
import tempfile
import time
import weakref
from contextlib import AbstractContextManager
from dataclasses import dataclass
from multiprocessing.context import BaseContext
from typing import Any, Callable, ClassVar, TypeVar

import numpy as np
import torch
from torch import nn

from distsgd.algorithms.base import Algorithm, SharedMemory, SharedSeat, Topology, register
from distsgd.config import RunConfig
from distsgd.errors import ConfigError
from distsgd.options import Options, option
from distsgd.train import device
from distsgd.train.context import Figures, Start, Step, WorkerContext

log = logging.getLogger(__name__)


def bind_to_shared(model: nn.Module, shared_state: dict[str, torch.Tensor]) -> nn.Module:
    """Make ``model``'s parameters and buffers *be* the shared tensors (no copy), in place; or one
    line where ``model`` has another structure than the shared model's (a module of its own given
    to run.setup(): a ``KeyError`` before). A non-persistent buffer (a rotary cache's), absent from
    a state dict, stays each worker's own."""
    own = model.state_dict(keep_vars=True)
    odd = [f"missing {k!r}" for k in shared_state if k not in own][:1]
    odd += [f"unexpected {k!r}" for k in own if k not in shared_state][:1]
    odd += [
        f"{k!r} of shape {list(v.shape)}, the shared one's {list(shared_state[k].shape)}"
        for k, v in own.items()
        if isinstance(v, torch.Tensor) and k in shared_state and v.shape != shared_state[k].shape
    ][:1]
    if odd:
        raise ConfigError(
            f"the model given to run.setup() does not fit the shared one, spawn(model=...)'s ({'; '.join(odd)}): "
            f"give run.setup() a model of that structure, or pass yours as spawn(model=...)"
        )
    for name, param in model.named_parameters():
        param.data = shared_state[name]
    for module_name, module in model.named_modules():
        for buffer_name, buffer in list(module._buffers.items()):
            if buffer is not None and buffer_name not in module._non_persistent_buffers_set:
                key = f"{module_name}.{buffer_name}" if module_name else buffer_name
                module._buffers[buffer_name] = shared_state[key]
    return model


class OwnedLock:
    """A lock between the processes of one machine that a dead holder cannot keep: an exclusive
    ``flock(2)`` on a small file, which the kernel releases when the holding process dies. (A
    multiprocessing lock held by a worker killed inside it stays held, and every other worker
    blocks for ever.) The holder's pid is kept in shared memory while it holds the lock, so the
    next process to take it knows that its holder died inside it: it warns and counts it
    (``recovered``), and the run carries on. ``acquire(block=False)`` does not wait. The file is
    removed when the creating process is done with the lock."""

    def __init__(self) -> None:
        fd, self.path = tempfile.mkstemp(prefix="distsgd-lock-")
        os.close(fd)
        self.owner = torch.zeros(1, dtype=torch.int64).share_memory_()  # the holder's pid; 0: free
        self.recovered = torch.zeros(1, dtype=torch.int64).share_memory_()  # locks whose holder died in them
        self._fd: int | None = None
        self._pid: int | None = None
        self._cleanup = weakref.finalize(self, _remove, self.path)  # in the creating process only

    def __getstate__(self) -> dict[str, Any]:
        return {"path": self.path, "owner": self.owner, "recovered": self.recovered}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state, _fd=None, _pid=None)

    def _file(self) -> int:
        """This process's own open file (a lock is held per open file, so each process opens it)."""
        if self._pid != os.getpid():
            self._fd, self._pid = os.open(self.path, os.O_RDWR), os.getpid()
        assert self._fd is not None
        return self._fd

    def acquire(self, block: bool = True) -> bool:
        try:
            fcntl.flock(self._file(), fcntl.LOCK_EX | (0 if block else fcntl.LOCK_NB))
        except BlockingIOError:
            return False
        dead = int(self.owner[0])
        if dead:  # a holder releases after clearing its pid: this one died inside the lock
            self.recovered += 1
            log.warning("process %d died holding a lock; the others carry on without it", dead)
        self.owner.fill_(os.getpid())
        return True

    def release(self) -> None:
        self.owner.fill_(0)
        fcntl.flock(self._file(), fcntl.LOCK_UN)

    def __enter__(self) -> "OwnedLock":
        self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def _remove(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


@dataclass(frozen=True)
class HogwildOptions(Options):
    hogwild_lock: bool = option(False, "one lock around every update (to compare with lock-free)")


@dataclass
class HogwildFigures(Figures):
    dataset_shared: bool | None = None  # every worker read one copy of the data, in shared memory
    model_shared: bool | None = None
    hogwild_lock: bool | None = None
    hogwild_threads: bool | None = None  # the workers were threads of one process (on one GPU: CUDA streams)


class HogwildMemory(SharedMemory):
    """Hogwild!'s: one model in shared memory, and with --hogwild-lock one lock round every update."""

    def lock(self, cfg: RunConfig, mpc: BaseContext) -> OwnedLock | None:
        return OwnedLock() if HogwildOptions.pick(cfg.options).hogwild_lock else None

    def figures(self, workers: list[Figures], extras: object) -> Figures:
        """The lowest slot's figures; the data counts as shared only if every worker found it so."""
        first = workers[0] if workers else HogwildFigures(bytes_sent=0)
        shared = all(getattr(f, "dataset_shared", False) for f in workers)
        return type(first)(**{**vars(first), "dataset_shared": shared})


HogwildOptionsT = TypeVar("HogwildOptionsT", bound=HogwildOptions)


class SharedModel(Algorithm[HogwildOptionsT]):
    """Workers that train a model in shared memory with no lock (with --hogwild-lock, one lock round
    every update): Hogwild!, and what hogwild++'s clusters do between their exchanges."""

    kind = "shared memory"
    topology: ClassVar[Topology] = HogwildMemory()
    binds_storage = True  # the shared model's tensors
    keeps_buffers = True  # (in shared memory too)

    seat: SharedSeat
    # numpy views of the shared counters: a read or write is a memory access, not a tensor op
    counts: np.ndarray  # samples done by each worker of this machine
    slot: int  # this worker's slot in counts
    stop: np.ndarray  # one byte: 1 stops every worker (read every step with no lock)
    hold: np.ndarray | None  # --stop-at-target's hold (SharedSeat.hold), read every step with no lock
    lock: AbstractContextManager[object] | None  # --hogwild-lock: taken round every update
    machines: int  # under torchrun, the processes (clusters) of the run
    # built by setup:
    synchronize: Callable[[], None]  # waits until the device has done what was queued
    dataset_shared: bool  # this worker reads the one copy of the data in shared memory
    model_shared: bool

    def __init__(self, cfg: RunConfig, seat: object = None) -> None:
        assert isinstance(seat, SharedSeat), f"{cfg.algo} runs under the shared-memory launcher"
        super().__init__(cfg, seat)
        self.counts, self.slot, self.stop = seat.counts.numpy(), seat.slot, seat.stop.numpy()
        self.hold = seat.hold.numpy() if seat.hold is not None else None
        self.lock, self.machines = seat.lock, seat.machines

    def shared_state(self, ctx: WorkerContext) -> dict[str, torch.Tensor]:
        """The shared model this worker trains."""
        return self.seat.states[0]

    def setup(self, ctx: WorkerContext, model: nn.Module, start: Start) -> nn.Module:
        shared = bind_to_shared(model, self.shared_state(ctx))
        # a CUDA step is queued, not done, when step() returns: a lock is held until the device is done
        self.synchronize = device.synchronizer(ctx.device) or (lambda: None)
        self.dataset_shared = ctx.dataset.is_shared()
        self.model_shared = all(p.is_shared() for p in shared.parameters())
        return shared

    def before_training(self, ctx: WorkerContext) -> None:
        """Tell the launcher this worker is built, then start with the others on its signal."""
        assert self.seat.start_together is not None
        self.seat.start_together()

    def checkpoint_saved(self, ctx: WorkerContext, seq: int, commit: Callable[[], None]) -> None:
        """The launcher commits, with the shared model, once every live worker has saved its part."""
        assert self.seat.checkpointed is not None
        self.seat.checkpointed(seq, int(self.counts[self.slot]))

    def starting_samples(self, ctx: WorkerContext) -> int:
        return int(self.counts[self.slot])

    def apply_step(self, ctx: WorkerContext, optimizer: torch.optim.Optimizer, step: Step) -> None:
        if self.lock is None:
            optimizer.step()
        else:
            with self.lock:
                optimizer.step()
                self.synchronize()

    def after_step(self, ctx: WorkerContext, model: nn.Module, step: Step) -> None:
        self.counts[self.slot] = step.samples  # only this worker writes its slot

    def global_samples(self, ctx: WorkerContext, local_samples: int) -> int:
        """Every worker's slot on this machine, as they are now. Under torchrun (hogwild++: one
        cluster a machine, each with an equal share of the data) that times the machines: each
        cluster's schedule and ``--max-samples`` follow its own progress through its share, which
        is the run's when the clusters go at the same speed, known at once and exactly (the other
        clusters' counts arrive only with the token, which may visit a few times a run)."""
        return int(self.counts.sum()) * self.machines

    def keep_going(self, ctx: WorkerContext) -> bool:
        """Not stopped. With --stop-at-target, once the workers' samples reach the next evaluation
        point, wait here, between two steps, while the launcher measures the model (it may stop
        the run): no worker trains more than one step past the copy that reaches the target."""
        hold = self.hold
        if hold is not None and 0 <= hold[0] <= self.counts.sum():
            hold[1 + self.slot] = 1
            while 0 <= hold[0] <= self.counts.sum() and not self.stop[0]:
                time.sleep(0.0005)
            hold[1 + self.slot] = 0
        return not self.stop[0]

    def agree(self, ctx: WorkerContext, flag: bool) -> bool:
        """A worker that measured the shared model at the target stops every worker (a user's loop
        evaluates in its workers; distsgd's evaluates in the launcher, which raises the flag)."""
        if flag:
            self.stop[0] = 1
        return flag

    def finish(self, ctx: WorkerContext, model: nn.Module) -> nn.Module:
        if self.hold is not None:  # it takes no more steps: a hold need not wait for it
            self.hold[1 + self.slot] = 1
        return super().finish(ctx, model)

    def figures(self) -> Figures:
        return HogwildFigures(
            bytes_sent=0,
            dataset_shared=self.dataset_shared,
            model_shared=self.model_shared,
            hogwild_lock=self.lock is not None,
            hogwild_threads=self.seat.threads,
        )


THREADS = ("auto", "on", "off")


@dataclass(frozen=True)
class HogwildThreadOptions(HogwildOptions):
    hogwild_threads: str = option(
        "auto",
        "the workers as threads of one process sharing the model, each on its own CUDA stream with "
        "its step in a CUDA graph: on, off, or auto (on when the workers share one GPU, whose "
        "kernels from separate processes would take turns)",
        metavar="WHEN",
    )

    def check(self, cfg: RunConfig) -> None:
        if self.hogwild_threads not in THREADS:
            raise ConfigError(f"--hogwild-threads must be one of {', '.join(THREADS)}, got '{self.hogwild_threads}'")
        if self.hogwild_lock and cfg.cuda_graphs:
            raise ConfigError(
                "--cuda-graphs captures a step whole, and --hogwild-lock takes a host lock round its update"
            )


class HogwildTopology(HogwildMemory):
    """Hogwild!'s, and where its workers run: processes, or threads of the launching process."""

    def threads(self, cfg: RunConfig, own_loop: bool = False) -> bool:
        """Whether the workers run as threads of one process: asked (``--hogwild-threads on``), or
        by default where several share one GPU (processes' kernels on one GPU take turns: 1, 2 and
        4 processes ran resnet20 at 16.3k, 15.7k and 15.5k samples/s on an H200; threads, each
        step a CUDA graph on its own stream, 28k, 38k and 46k). A lock round every update is a
        process lock: with --hogwild-lock the workers stay processes. So do a user's loop's: each
        must get its own copy of ``main``'s arguments, as a process does (threads would share the
        caller's model and optimiser objects, and one thread's ``optimizer.step()`` would change
        tensors another's autograd had saved: the GPU run of 2026-11-28's mnist_hogwild example)."""
        opts = HogwildThreadOptions.pick(cfg.options)
        if own_loop:  # a process gets its own copy of main's args, a thread the caller's very objects
            if opts.hogwild_threads == "on":
                raise ConfigError(
                    "--hogwild-threads on runs a loop's workers as threads, which would share your "
                    "model, optimiser and other args instead of each getting its own copy: leave it at auto"
                )
            return False
        if opts.hogwild_threads != "auto":
            return opts.hogwild_threads == "on"
        one_gpu = cfg.device.startswith("cuda:") or device.cuda_count() == 1
        return cfg.workers > 1 and not opts.hogwild_lock and device.kind(cfg.device) == "cuda" and one_gpu


@register
class Hogwild(SharedModel[HogwildThreadOptions]):
    name = "hogwild"
    summary_line = "Hogwild!: lock-free updates to one model in shared memory (--hogwild-lock to compare)"
    topology: ClassVar[Topology] = HogwildTopology()
    graphable = True  # lock-free: its step is this worker's GPU work alone (--hogwild-lock is refused)

    @classmethod
    def check(cls, cfg: RunConfig) -> None:
        super().check(cfg)
        opts = cls.parse_options(cfg)
        if opts.hogwild_threads == "on" and opts.hogwild_lock:
            raise ConfigError("--hogwild-lock is a lock between processes: leave out --hogwild-threads on")
