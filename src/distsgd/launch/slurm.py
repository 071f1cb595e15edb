"""SLURM: the tasks of an ``srun`` step form the run's group as torchrun's processes do.

srun starts every task itself and tells each, in its environment, who it is (``SLURM_PROCID`` of
``SLURM_NTASKS``, ``SLURM_LOCALID`` of its node's tasks) and where the step runs
(``SLURM_STEP_NODELIST``). :func:`adopt` writes that down as torchrun's contract (``RANK``,
``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``: the step's first node, where
task 0 runs; ``MASTER_PORT``: yours, else one made from the job and step ids), so every topology's
torchrun path runs unchanged, with no torchrun in between.

Only the tasks of a step of several tasks are adopted: a batch script, an ``salloc`` shell and a
one-task step (``srun --pty bash``, ``srun -n1 distsgd train --workers 4``) are a machine like any
other, where distsgd starts its own workers. Processes that torchrun started (``srun torchrun
...``) are torchrun's, and a process already in a group (Ray Train's, on nodes srun started) keeps it.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, MutableMapping

import torch.distributed as dist

from distsgd.errors import ConfigError

FIRST_SPECIAL_STEP = 0xFFFFFFF0  # step ids from here up are SLURM's own (batch, extern, interactive), not srun's
PORTS = (15000, 32000)  # MASTER_PORT's range: unprivileged, below Linux's ephemeral ports (32768 and up)
CONTRACT = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")


def hosts(nodelist: str) -> list[str]:
    """SLURM's compressed host list, expanded: ``node[01-03,7],gpu-a[1-2]`` is node01, node02,
    node03, node7, gpu-a1, gpu-a2 (a range keeps its lower bound's zero padding)."""
    return [name for item in _split(nodelist) for name in _expand(item, nodelist)]


def _split(text: str) -> list[str]:
    """``text``'s comma-separated items, leaving commas inside brackets alone."""
    items, depth, start = [], 0, 0
    for i, c in enumerate(text):
        depth += {"[": 1, "]": -1}.get(c, 0)
        if depth not in (0, 1):
            break
        if c == "," and depth == 0:
            items.append(text[start:i])
            start = i + 1
    if depth:
        raise ConfigError(f"'{text}' is not a SLURM host list: its brackets do not pair")
    return [*items, text[start:]]


def _expand(item: str, nodelist: str) -> list[str]:
    bad = ConfigError(f"'{nodelist}' is not a SLURM host list (at '{item}')")
    match = re.fullmatch(r"([^\[\]]*)(?:\[([^\[\]]*)\](.*))?", item.strip())
    if match is None or not (match.group(1) or match.group(2)):
        raise bad
    prefix, ranges, rest = match.groups()
    if ranges is None:
        return [prefix]
    numbers = []
    for part in ranges.split(","):
        low, _, high = part.partition("-")
        if not (low.isdigit() and (high or low).isdigit()) or int(high or low) < int(low):
            raise bad
        numbers += [str(n).zfill(len(low)) for n in range(int(low), int(high or low) + 1)]
    tails = _expand(rest, nodelist) if rest else [""]  # a second bracket: rack[1-2]-node[1-4]
    return [f"{prefix}{n}{tail}" for n in numbers for tail in tails]


def tasks_per_node(text: str) -> list[int]:
    """``SLURM_STEP_TASKS_PER_NODE`` expanded: ``2(x3),1`` is 2, 2, 2, 1."""
    counts = []
    for item in text.split(","):
        match = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", item.strip())
        if match is None:
            raise ConfigError(f"SLURM's tasks per node '{text}' is not a count list like 2(x3),1")
        counts += [int(match.group(1))] * int(match.group(2) or 1)
    return counts


def in_step(env: Mapping[str, str]) -> bool:
    """This process is a task srun started: a step's, not the batch script or an allocation's shell."""
    step = env.get("SLURM_STEP_ID", env.get("SLURM_STEPID", ""))
    return "SLURM_PROCID" in env and step.isdigit() and int(step) < FIRST_SPECIAL_STEP


def several_tasks(env: Mapping[str, str]) -> bool:
    """This process is one of an srun step's tasks, and there are others (torchrun's are torchrun's)."""
    world = env.get("SLURM_STEP_NUM_TASKS", env.get("SLURM_NTASKS", ""))
    return "TORCHELASTIC_RUN_ID" not in env and in_step(env) and not (world.isdigit() and int(world) < 2)


def torchrun_contract(env: Mapping[str, str]) -> dict[str, str] | None:
    """torchrun's variables for this srun task, from SLURM's; None for a process that is not one
    task of several. One ConfigError line for SLURM variables that disagree."""
    if not several_tasks(env):
        return None
    rank = _number(env, "SLURM_PROCID")
    world_name = "SLURM_STEP_NUM_TASKS" if "SLURM_STEP_NUM_TASKS" in env else "SLURM_NTASKS"
    world = _number(env, world_name)
    if rank >= world:
        raise ConfigError(f"SLURM_PROCID={rank} is not one of {world_name}={world} tasks (0 to {world - 1})")
    per_node_name = "SLURM_STEP_TASKS_PER_NODE" if "SLURM_STEP_TASKS_PER_NODE" in env else "SLURM_TASKS_PER_NODE"
    per_node = tasks_per_node(_given(env, per_node_name))
    if sum(per_node) != world:
        raise ConfigError(f"{per_node_name}={env[per_node_name]} makes {sum(per_node)} tasks, {world_name}={world}")
    node, local = _number(env, "SLURM_NODEID"), _number(env, "SLURM_LOCALID")
    if node >= len(per_node):
        raise ConfigError(f"SLURM_NODEID={node} is not one of the {len(per_node)} nodes of {per_node_name}")
    if local >= per_node[node]:
        raise ConfigError(
            f"SLURM_LOCALID={local} is not one of the {per_node[node]} tasks that {per_node_name} gives node {node}"
        )
    nodes_name = "SLURM_STEP_NODELIST" if "SLURM_STEP_NODELIST" in env else "SLURM_JOB_NODELIST"
    first = hosts(_given(env, nodes_name))[0]
    if rank == 0 and "MASTER_ADDR" not in env and env.get("SLURMD_NODENAME", first) != first:
        raise ConfigError(
            f"task 0 runs on {env['SLURMD_NODENAME']}, not on the step's first node {first} where the "
            f"others look for it: set MASTER_ADDR to task 0's host"
        )
    job, step = (
        _number(env, "SLURM_JOB_ID"),
        _number(env, "SLURM_STEP_ID" if "SLURM_STEP_ID" in env else "SLURM_STEPID"),
    )
    return {
        "RANK": str(rank),
        "WORLD_SIZE": str(world),
        "LOCAL_RANK": str(local),
        "LOCAL_WORLD_SIZE": str(per_node[node]),
        "MASTER_ADDR": first,
        "MASTER_PORT": str(PORTS[0] + (job * 64 + step) % (PORTS[1] - PORTS[0])),
    }


def adopt(env: MutableMapping[str, str]) -> bool:
    """Under srun, a task of several: write torchrun's variables into ``env`` (the user's
    ``MASTER_ADDR`` and ``MASTER_PORT`` win; a ``RANK`` or ``WORLD_SIZE`` already there must be
    SLURM's). True when it did."""
    if dist.is_available() and dist.is_initialized():  # a group formed before: its launcher's ranks, not
        # SLURM's tasks (Ray's workers inherit srun's variables)
        return False
    contract = torchrun_contract(env)
    if contract is None:
        return False
    for name in CONTRACT:
        if name in env and env[name] != contract[name]:
            source = "SLURM_PROCID" if name == "RANK" else f"SLURM's {name.lower().replace('_', ' ')}"
            raise ConfigError(
                f"{name}={env[name]} disagrees with {source} ({contract[name]}) in this srun task: unset "
                f"{name} (srun gives every task its own), or start the tasks with torchrun"
            )
    for name, value in with_users_address(env, contract).items():
        env.setdefault(name, value)
    return True


def with_users_address(env: Mapping[str, str], contract: dict[str, str]) -> dict[str, str]:
    """``contract`` with the user's ``MASTER_ADDR`` and ``MASTER_PORT``, where given (the port checked)."""
    port = env.get("MASTER_PORT", contract["MASTER_PORT"])
    if not (port.isdigit() and 0 < int(port) < 65536):
        raise ConfigError(f"MASTER_PORT={port} is not a port (1 to 65535)")
    return {**contract, "MASTER_ADDR": env.get("MASTER_ADDR", contract["MASTER_ADDR"]), "MASTER_PORT": port}


def restarted(env: Mapping[str, str]) -> bool:
    """SLURM requeued this job (``SLURM_RESTART_COUNT`` > 0): it runs again from the start."""
    count = env.get("SLURM_RESTART_COUNT", "0")
    return count.isdigit() and int(count) > 0


def run_name(env: Mapping[str, str]) -> str | None:
    """``slurm-JOB.STEP`` for a task of an srun step of several: the same in every task, and again
    when the job is requeued, where a timestamp differs between tasks (and attempts). None elsewhere
    (a one-task step, ``srun --pty bash``, runs one distsgd after another)."""
    if not several_tasks(env) or "SLURM_JOB_ID" not in env:
        return None
    return f"slurm-{env['SLURM_JOB_ID']}.{env.get('SLURM_STEP_ID', env.get('SLURM_STEPID'))}"


def _given(env: Mapping[str, str], name: str) -> str:
    if not env.get(name):
        raise ConfigError(f"{name} is not set in this srun task: is this a SLURM job step?")
    return env[name]


def _number(env: Mapping[str, str], name: str) -> int:
    text = _given(env, name)
    if not text.isdigit():
        raise ConfigError(f"{name}={text} is not a number")
    return int(text)
