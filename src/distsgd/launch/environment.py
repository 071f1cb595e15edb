"""Where a run's processes come from: one :class:`Environment`, detected once per run
(:func:`detect`, by ``api.run``), answers who this process is and where its group meets.

- :class:`Local`: nothing launched this process: distsgd starts its own workers here.
- :class:`RayTrain`: a process group exists already (Ray Train's ``TorchTrainer`` formed it).
- :class:`Torchrun`: torchrun (or another launcher that sets its variables) started this process.
- :class:`Slurm`: one task of an ``srun`` step of several (``launch/slurm.py`` reads SLURM's variables).
- :class:`Kubeflow`: a Kubeflow PyTorchJob pod, or any platform that starts one process per
  machine with ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT`` and no local counts.
  Before, such a pod was taken for torchrun's ranks on one machine: ``WORLD_SIZE`` local workers
  (gloo instead of NCCL on GPUs, the cores shared among them, the server's local rank ``rank - 1``).

A launched environment's :meth:`~Environment.contract` is torchrun's variables for this rank
(what torch's ``env://`` rendezvous and distsgd's torchrun path read); :meth:`~Environment.adopt`
writes those the launcher left out. Adding a launcher is one class here, and its place in
:data:`ENVIRONMENTS` (docs/ARCHITECTURE.md, "Adding a launcher").
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
import warnings
from abc import ABC, abstractmethod
from collections.abc import Iterator, Mapping, MutableMapping
from typing import ClassVar

import torch.distributed as dist

from distsgd.errors import ConfigError
from distsgd.launch import slurm

TORCHRUN = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")  # what every launched rank is told
LOCAL = ("LOCAL_RANK", "LOCAL_WORLD_SIZE")


def formed_group() -> bool:
    """True when this process is a rank of a default process group formed before distsgd ran (Ray
    Train's ``TorchTrainer`` forms one in each worker before ``train_loop_per_worker``)."""
    return dist.is_available() and dist.is_initialized()


def ray_train_workers() -> int:
    """The workers of the Ray Train run whose training function this process is in; 0 outside one.
    (A process Ray Train runs a function in has imported ray.train: distsgd never imports it.)"""
    train = sys.modules.get("ray.train")
    if train is None:
        return 0
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # Ray Train V1 answers 1 outside a training function, with a warning
            return int(train.get_context().get_world_size())
    except Exception:  # V2 raises outside a training function (and in a Tune trial)
        return 0


class Environment(ABC):
    """Who this process is in its run, as its launcher said."""

    name: ClassVar[str]
    launched: ClassVar[bool] = True  # a launcher made this process one rank of a group

    def __init__(self, env: Mapping[str, str]) -> None:
        self.env = env

    @classmethod
    @abstractmethod
    def detect(cls, env: Mapping[str, str]) -> bool:
        """Whether this launcher started the process ``env`` describes."""

    @abstractmethod
    def contract(self) -> dict[str, str]:
        """torchrun's variables for this rank (empty: nothing to write, a group exists)."""

    rank = property(lambda self: int(self.contract()["RANK"]))
    world_size = property(lambda self: int(self.contract()["WORLD_SIZE"]))
    local_rank = property(lambda self: int(self.contract()["LOCAL_RANK"]))
    # this machine's ranks: the processes that share its cores (and its GPUs)
    local_world_size = property(lambda self: int(self.contract()["LOCAL_WORLD_SIZE"]))

    @property
    def address(self) -> str | None:
        """Where the group meets (rank 0's host)."""
        return self.contract().get("MASTER_ADDR")

    @property
    def port(self) -> int | None:
        """The port of the group's store on :attr:`address`."""
        port = self.contract().get("MASTER_PORT")
        return None if port is None else int(port)

    @property
    def attempt(self) -> int:
        """How many times the launcher started this group again (torchrun's restarts): each
        attempt forms its group under store keys of its own."""
        return 0

    @property
    def agent_store(self) -> bool:
        """The launcher's agent serves the store at :attr:`address` (torchrun's, where it says so):
        rank 0 must not start one."""
        return False

    @property
    def restarted(self) -> str | None:
        """What restarted this run (said in the line of its resume), or None: a first start."""
        return None

    @property
    def agent_ends_ranks(self) -> bool:
        """An agent of the launcher ends every rank on this machine once one fails, and names the
        first to fail as the failure's root cause: torchrun's elastic agent (not a launcher that
        only sets its variables), whoever formed the group (a script that formed its own)."""
        return "TORCHELASTIC_RUN_ID" in self.env

    @property
    def run_name(self) -> str | None:
        """A name every rank of the run shares (its default run directory's), or None."""
        return None

    @property
    def launch_id(self) -> str | None:
        """What tells this launch from any other, its restarts' first processes included (None:
        nothing does): a restart may replace a run directory its first attempt made."""
        return None

    @property
    def launch_named(self) -> bool:
        """:attr:`run_name` names this launch alone (no earlier job's run has it): a directory of that
        name that distsgd made is an earlier attempt's of this run."""
        return False

    def adopt(self, environ: MutableMapping[str, str]) -> None:
        """Write the contract's variables the launcher left out into ``environ``; one the launcher
        set otherwise is one error line."""
        for name, value in self.contract().items():
            if name in environ and environ[name] != value:
                raise ConfigError(
                    f"{name}={environ[name]} disagrees with {self.name}'s {value} for this process: unset {name}"
                )
            environ.setdefault(name, value)

    def _given(self, names: tuple[str, ...]) -> dict[str, str]:
        found = {k: self.env[k] for k in names}
        for k in ("RANK", "WORLD_SIZE", "MASTER_PORT", *LOCAL):
            if k in found and not found[k].isdigit():
                raise ConfigError(f"{k}={found[k]} is not a number ({self.name} sets it)")
        return found


class Local(Environment):
    """Nothing launched this process: its run's workers are its own."""

    name, launched = "local", False

    @classmethod
    def detect(cls, env: Mapping[str, str]) -> bool:
        return True

    def contract(self) -> dict[str, str]:
        return {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1"}


class RayTrain(Environment):
    """A default process group formed before distsgd ran (Ray Train's, in each of its workers)."""

    name = "a formed process group"

    @classmethod
    def detect(cls, env: Mapping[str, str]) -> bool:
        return formed_group()

    def contract(self) -> dict[str, str]:
        return {}  # the group exists: nothing to rendezvous

    @property
    def rank(self) -> int:
        return dist.get_rank()

    @property
    def world_size(self) -> int:
        return dist.get_world_size()

    @property
    def local_rank(self) -> int:
        return int(self.env.get("LOCAL_RANK", 0))

    @property
    def local_world_size(self) -> int:
        return int(self.env.get("LOCAL_WORLD_SIZE", 1))

    @property
    def address(self) -> str | None:
        return self.env.get("MASTER_ADDR")


class Torchrun(Environment):
    """torchrun's ranks (or any launcher that sets its variables, the local ones included)."""

    name = "torchrun"

    @classmethod
    def detect(cls, env: Mapping[str, str]) -> bool:
        return all(k in env for k in TORCHRUN)

    def contract(self) -> dict[str, str]:
        given = self._given(TORCHRUN + tuple(k for k in LOCAL if k in self.env))
        given.setdefault("LOCAL_RANK", given["RANK"])
        given.setdefault("LOCAL_WORLD_SIZE", given["WORLD_SIZE"])
        return given

    @property
    def attempt(self) -> int:
        count = self.env.get("TORCHELASTIC_RESTART_COUNT", "0")
        return int(count) if count.isdigit() else 0

    @property
    def agent_store(self) -> bool:
        return self.env.get("TORCHELASTIC_USE_AGENT_STORE") == "True"

    @property
    def restarted(self) -> str | None:
        return "torchrun restarted the group" if self.attempt > 0 else None

    @property
    def run_name(self) -> str | None:
        """``torchrun-<id>``: its rendezvous id (``--rdzv-id``; a new uuid with ``--standalone`` or on
        one node, of which the first 8 characters), every rank's and again when torchrun restarts the
        group (each rank's own clock's would differ where their starts straddle a second: their
        checkpoint files in two directories). Its default id, ``none`` (older torch on one node, a
        static rendezvous): on one machine, 8 hex digits of the agent's pid and start time (every
        rank's parent); across machines, None."""
        run_id = self.env.get("TORCHELASTIC_RUN_ID", "")
        if run_id not in ("", "none"):
            return "torchrun-" + (run_id[:8] if _UUID.fullmatch(run_id) else re.sub(r"[^A-Za-z0-9_.-]", "_", run_id))
        # its agent is every local rank's parent (not so for processes a user started with these variables)
        agent = _agent_id() if run_id == "none" and self.local_world_size == self.world_size else None
        return None if agent is None else f"torchrun-{agent}"

    @property
    def launch_id(self) -> str | None:
        """What tells this launch from another of the same name (a ``--rdzv-id`` given again):
        its rendezvous id and its agent's pid and start time (a restart's rank 0 under the same
        agent has the same); None where /proc does not say."""
        agent = _agent_id()
        return None if agent is None or self.run_name is None else f"{self.run_name} {agent}"

    @property
    def launch_named(self) -> bool:
        run_id = self.env.get("TORCHELASTIC_RUN_ID", "")
        return self.run_name is not None and (_UUID.fullmatch(run_id) is not None or run_id == "none")


_UUID = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")


def _agent_id() -> str | None:
    """8 hex digits of this process's parent's pid and start time (torchrun's agent: every local
    rank's), or None where /proc does not say."""
    import hashlib

    parent = os.getppid()
    try:
        started = open(f"/proc/{parent}/stat").read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None
    return hashlib.sha1(f"{parent}:{started}".encode()).hexdigest()[:8]


class Slurm(Environment):
    """A task of an ``srun`` step of several: SLURM's variables, as torchrun's."""

    name = "SLURM"

    @classmethod
    def detect(cls, env: Mapping[str, str]) -> bool:
        return slurm.several_tasks(env)

    def contract(self) -> dict[str, str]:
        contract = slurm.torchrun_contract(self.env)
        assert contract is not None, "detected"
        return slurm.with_users_address(self.env, contract)  # the user's address and port win

    def adopt(self, environ: MutableMapping[str, str]) -> None:
        slurm.adopt(environ)  # its own lines for SLURM's variables that disagree

    @property
    def restarted(self) -> str | None:
        return "SLURM requeued the job" if slurm.restarted(self.env) else None

    @property
    def run_name(self) -> str | None:
        return slurm.run_name(self.env)

    @property
    def launch_named(self) -> bool:
        return self.run_name is not None  # its job's id


class Kubeflow(Environment):
    """A Kubeflow PyTorchJob pod: ``RANK`` of ``WORLD_SIZE`` pods, one process each, meeting at
    ``MASTER_ADDR`` (the master pod's service, ``<job>-master-0``) and ``MASTER_PORT``; no local
    counts and no torchrun. Each pod is a machine of its own: local rank 0 of 1."""

    name = "Kubeflow"

    @classmethod
    def detect(cls, env: Mapping[str, str]) -> bool:
        return all(k in env for k in TORCHRUN) and not any(k in env for k in (*LOCAL, "TORCHELASTIC_RUN_ID"))

    def contract(self) -> dict[str, str]:
        given = self._given(TORCHRUN)
        if int(given["RANK"]) >= int(given["WORLD_SIZE"]):
            raise ConfigError(f"RANK={given['RANK']} is not one of WORLD_SIZE={given['WORLD_SIZE']} ranks")
        return {**given, "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1"}

    @property
    def restarted(self) -> str | None:
        """A pod that failed starts its command again (``restartPolicy: OnFailure``), and its peers,
        whose group it broke, with it; no variable says so. A checkpoint already in the run's
        directory does: the run resumes from it, saying so."""
        return "a Kubeflow pod started again"

    @property
    def run_name(self) -> str | None:
        """The job's name, from its master's service (``<job>-master-0``): every pod's, and again
        when a pod restarts."""
        match = re.fullmatch(r"(.+)-master-0(\..*)?", self.env.get("MASTER_ADDR", ""))
        return f"kubeflow-{match.group(1)}" if match else None


class Spawned(Environment):
    """A worker process distsgd's own launcher started on this machine (``procs.begin_worker``):
    rank ``rank`` of ``world``, every one of them here. Never detected: the process says so
    (:func:`become`)."""

    name, launched = "distsgd's own launcher", False

    def __init__(self, rank: int, world: int) -> None:
        super().__init__({})
        self.given = {
            "RANK": str(rank),
            "WORLD_SIZE": str(world),
            "LOCAL_RANK": str(rank),
            "LOCAL_WORLD_SIZE": str(world),
        }

    @classmethod
    def detect(cls, env: Mapping[str, str]) -> bool:
        return False

    def contract(self) -> dict[str, str]:
        return dict(self.given)


# the first that detects: a formed group before any variables; SLURM's tasks before the variables
# an adopted one wrote; a pod's four variables alone before torchrun's (which has them too)
ENVIRONMENTS: tuple[type[Environment], ...] = (RayTrain, Slurm, Kubeflow, Torchrun, Local)


def detect(env: Mapping[str, str] | None = None) -> Environment:
    """This process's environment: the first of :data:`ENVIRONMENTS` that detects it."""
    env = os.environ if env is None else env
    return next(kind(env) for kind in ENVIRONMENTS if kind.detect(env))


_current: Environment | None = None  # the run's, while api.run runs it (using)


@contextlib.contextmanager
def using(where: Environment) -> Iterator[Environment]:
    """While a run lasts, :func:`current` is ``where`` (``api.run`` detects it once)."""
    global _current
    was, _current = _current, where
    try:
        yield where
    finally:
        _current = was


def become(where: Environment) -> None:
    """This process is ``where`` from now on (a worker process distsgd started: :class:`Spawned`)."""
    global _current
    _current = where


def current() -> Environment:
    """The environment of the run in progress (:func:`using`); outside one, detected now (a
    worker process distsgd started here: its launcher's variables are in its environment)."""
    return _current if _current is not None else detect()


def launched() -> bool:
    """True when a launcher made this process one rank of a run: torchrun's variables (SLURM's,
    Kubeflow's), or a process group that exists already. One of several Ray Train workers in no
    torch process group is one ConfigError line: each would otherwise train a run of its own."""
    if current().launched:
        return True
    workers = ray_train_workers()
    if workers > 1:
        raise ConfigError(
            f"this Ray Train worker is one of {workers} in no torch process group, each of which would train a run "
            f"of its own: run distsgd in the train_loop_per_worker of a ray.train.torch.TorchTrainer, which forms "
            f"the group distsgd joins"
        )
    return False


__all__ = [
    "Environment",
    "Local",
    "RayTrain",
    "Torchrun",
    "Slurm",
    "Kubeflow",
    "Spawned",
    "ENVIRONMENTS",
    "detect",
    "using",
    "become",
    "current",
    "launched",
    "formed_group",
    "ray_train_workers",
]
