"""Starting, joining and supervising the processes of a run: one module per topology.

- :mod:`.procs`: process plumbing (fork server, pipes, supervision, blame); knows no algorithm;
- :mod:`.group`: a ``torch.distributed`` process group (the ``Group`` topology);
- :mod:`.shared`: models in shared memory on one machine (``SharedMemory``);
- :mod:`.server`: a parameter server and its workers (``Server``);
- :mod:`.keepers`: a process group that trains through a lost worker under torchrun.

Each topology module has a ``plan`` (its rules about settings: how many workers torchrun's group
means, which backend) and a ``run``. Locally (``--workers N``) the launcher starts the processes;
under torchrun (or in a Ray Train worker, whose group exists already) this process is one of them
and there is no launcher. The algorithm declares its
topology (``algo_cls.topology``, an object from :mod:`distsgd.algorithms.base`); what the launcher
asks of it (the server's rule, the shared models, hogwild++'s ring) is reached through that
object, never by importing an algorithm.
"""

from __future__ import annotations

from types import ModuleType
from typing import TYPE_CHECKING

from torch.distributed import DistError

from distsgd.config import RunConfig
from distsgd.errors import ConfigError, DistsgdError, PeerFailed, WorkerError, error_text, failure_text
from distsgd.launch import environment, procs
from distsgd.launch.rendezvous import place
from distsgd.metrics import Sink
from distsgd.train.context import Job, WorkerContext, WorkerResult

if TYPE_CHECKING:
    from distsgd.algorithms.base import Algorithm


def _topology(algo_cls: type[Algorithm]) -> ModuleType:
    from distsgd.launch import group, server, shared

    return {"group": group, "shared": shared, "server": server}[algo_cls.topology.kind]


def plan(cfg: RunConfig, algo_cls: type[Algorithm], torchrun: bool) -> RunConfig:
    """The settings this algorithm's topology runs with (raises ConfigError for impossible ones).
    Under torchrun (or srun) the group's processes say how many workers there are; a ``--workers``
    other than 1 that says otherwise is a mistake (asgd's server takes one process)."""
    if algo_cls.topology.in_process:
        if cfg.min_workers is not None and cfg.min_workers > 1:
            raise ConfigError(f"--min-workers {cfg.min_workers}: {cfg.algo} trains in one process")
        if torchrun and place()[1] > 1:  # each rank would train a run of its own, into the same files
            raise ConfigError(
                f"{cfg.algo} trains in one process, and this is one of {place()[1]} processes of "
                f"{environment.current().name}: each would train a run of its own; leave --algo "
                f"out (allreduce) or name an algorithm of several workers (distsgd algorithms lists them)"
            )
        return cfg
    planned = _topology(algo_cls).plan(cfg, algo_cls, torchrun)
    if torchrun and cfg.workers not in (1, planned.workers):
        raise ConfigError(
            f"--workers {cfg.workers}, but the group's {place()[1]} processes make "
            f"{planned.workers} {cfg.algo} workers: give --workers {planned.workers}, or leave it out"
        )
    if cfg.min_workers is not None and cfg.min_workers > planned.workers:
        raise ConfigError(f"--min-workers {cfg.min_workers} is more than the run's {planned.workers} workers")
    return planned


def run(job: Job, algo_cls: type[Algorithm], sink: Sink, torchrun: bool) -> list[WorkerResult]:
    """Results of every worker, rank 0 first (under torchrun, rank > 0 gets only its own)."""
    if algo_cls.topology.in_process:
        from distsgd.train import device
        from distsgd.train.loop import run_worker

        where = device.use(job.cfg.device, 0)  # in this process: a single worker trains here
        try:
            result = run_worker(WorkerContext(job, rank=0, world=1, sink=sink, device=where), algo_cls(job.cfg))
        except (DistsgdError, OSError):  # distsgd's own lines (a file it cannot write: the command names it)
            raise
        except Exception as exc:  # the user's model or data raised: one line, as a worker process says it
            raise WorkerError(f"worker 0 failed: {failure_text(exc)}") from exc
        if result.model is not None:  # on the CPU, as every other topology returns it
            result.model.cpu()
        return [result]
    try:
        if torchrun and job.cfg.trains_through and job.main is None:  # (a user's loop: the group's one line)
            from distsgd.launch import keepers  # each process keeps one worker, and lives on when it dies

            return keepers.run(job, algo_cls, sink)
        return _topology(algo_cls).run(job, algo_cls, sink, torchrun)
    except (DistsgdError, OSError):  # distsgd's own lines
        raise
    except Exception as exc:  # under torchrun or srun this process is its worker: say what it met as a worker does
        if not torchrun:
            raise
        # torch.distributed's own errors (a store gone, a closed connection) and gloo's and NCCL's words
        # are a peer's failure (no launcher blames the process that died)
        if isinstance(exc, DistError) or (isinstance(exc, RuntimeError) and procs.peer_symptom(str(exc))):
            raise PeerFailed(
                f"process {place()[0]} stopped: another process of the group failed or cannot be "
                f"reached ({error_text(exc)})"
            ) from None
        raise WorkerError(f"process {place()[0]} failed: {failure_text(exc)}") from exc


__all__ = ["plan", "run"]
