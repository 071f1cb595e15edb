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

import os
import re
from abc import ABC, abstractmethod
from collections.abc import Mapping, MutableMapping
from typing import ClassVar

from distsgd.errors import ConfigError
from distsgd.launch import slurm
from distsgd.launch.rendezvous import formed_group

TORCHRUN = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")  # what every launched rank is told
LOCAL = ("LOCAL_RANK", "LOCAL_WORLD_SIZE")


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
    def restarted(self) -> str | None:
        """What restarted this run (said in the line of its resume), or None: a first start."""
        return None

    @property
    def run_name(self) -> str | None:
        """A name every rank of the run shares (its default run directory's), or None."""
        return None

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
        import torch.distributed as dist

        return dist.get_rank()

    @property
    def world_size(self) -> int:
        import torch.distributed as dist

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
    def restarted(self) -> str | None:
        count = self.env.get("TORCHELASTIC_RESTART_COUNT", "0")
        return "torchrun restarted the group" if count.isdigit() and int(count) > 0 else None


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


# the first that detects: a formed group before any variables; SLURM's tasks before the variables
# an adopted one wrote; a pod's four variables alone before torchrun's (which has them too)
ENVIRONMENTS: tuple[type[Environment], ...] = (RayTrain, Slurm, Kubeflow, Torchrun, Local)


def detect(env: Mapping[str, str] | None = None) -> Environment:
    """This process's environment: the first of :data:`ENVIRONMENTS` that detects it."""
    env = os.environ if env is None else env
    return next(kind(env) for kind in ENVIRONMENTS if kind.detect(env))


__all__ = ["Environment", "Local", "RayTrain", "Torchrun", "Slurm", "Kubeflow", "ENVIRONMENTS", "detect"]
