"""Launch environments (launch/environment.py), Kubeflow's PyTorchJob among them: a pod is told
RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT, and nothing of local ranks. Before, distsgd took two
such pods for torchrun's two ranks on one machine: half the cores each, and gloo where NCCL was due."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from distsgd.config import cores
from distsgd.errors import ConfigError
from distsgd.launch import environment
from distsgd.launch.rendezvous import free_port
from helpers import kill_at_step_model

pytest.importorskip("sklearn")

LAUNCHERS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "GROUP_RANK")


def pod(rank: int, world: int = 2, master: str = "127.0.0.1", port: int = 23456) -> dict[str, str]:
    """A PyTorchJob replica's variables (the training operator's, as `kubectl describe pod` shows them)."""
    return {
        "RANK": str(rank),
        "WORLD_SIZE": str(world),
        "MASTER_ADDR": master,
        "MASTER_PORT": str(port),
        "PYTHONUNBUFFERED": "1",
    }


def test_each_launcher_is_told_from_its_variables() -> None:
    kubeflow = environment.detect(pod(1, master="mnist-master-0"))
    assert isinstance(kubeflow, environment.Kubeflow)
    assert (kubeflow.rank, kubeflow.world_size, kubeflow.local_rank, kubeflow.local_world_size) == (1, 2, 0, 1)
    assert kubeflow.run_name == "kubeflow-mnist" and kubeflow.launched
    torchrun = environment.detect({**pod(1), "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2", "TORCHELASTIC_RUN_ID": "x"})
    assert isinstance(torchrun, environment.Torchrun) and torchrun.local_world_size == 2
    assert torchrun.restarted is None
    assert environment.detect({**pod(0), "LOCAL_RANK": "0", "TORCHELASTIC_RESTART_COUNT": "1"}).restarted
    local = environment.detect({})
    assert isinstance(local, environment.Local) and not local.launched
    with pytest.raises(ConfigError, match="RANK=2 is not one of WORLD_SIZE=2 ranks"):
        environment.detect(pod(2)).contract()
    with pytest.raises(ConfigError, match="RANK=one is not a number"):
        environment.detect({**pod(0), "RANK": "one"}).contract()


def test_torchruns_ranks_share_the_name_of_their_run() -> None:
    """torchrun's rendezvous id names the run's directory (a uuid with --standalone: its first 8
    characters; --rdzv-id as given, made a file name); with its default id ``none``, on one
    machine, torchrun's agent (every rank's parent) does; across machines nothing does."""
    ranks = {**pod(1), "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"}
    standalone = environment.detect({**ranks, "TORCHELASTIC_RUN_ID": "f2d06232-9a1b-4c2d-8e3f-0123456789ab"})
    assert standalone.run_name == "torchrun-f2d06232" and standalone.launch_named
    given = environment.detect({**ranks, "TORCHELASTIC_RUN_ID": "job 42/a"})
    assert given.run_name == "torchrun-job_42_a" and not given.launch_named  # a user's id may come again
    one_machine = environment.detect({**ranks, "TORCHELASTIC_RUN_ID": "none"})
    assert re.fullmatch(r"torchrun-[0-9a-f]{8}", one_machine.run_name or "") and one_machine.launch_named
    across = {**pod(1), "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1", "TORCHELASTIC_RUN_ID": "none"}
    assert environment.detect(across).run_name is None  # the agents differ: --out or --rdzv-id names it
    assert environment.detect(ranks).run_name is None  # no torchrun's id: processes started some other way


def test_a_launchers_processes_are_the_workers_an_algorithm_is_chosen_for(monkeypatch) -> None:
    """In a group of torchrun's 2 processes with no algorithm named, allreduce, said in the
    launcher's words; ``single`` there is one line (each process would train a run of its own,
    into the same files: what no --algo did until 2026-11-27)."""
    from distsgd.api import settle
    from distsgd.config import RunConfig

    cfg = RunConfig(dataset="digits", model="mlp", quiet=False)
    group = environment.detect({**pod(0), "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2"})
    with environment.using(group):
        assert settle(cfg, torchrun=True, where=group)[0].algo == "allreduce"
        with pytest.raises(
            ConfigError, match="single trains in one process, and this is one of 2 processes of torchrun"
        ):
            settle(cfg.replace(algo="single"), torchrun=True, where=group)
    alone = environment.detect({**pod(0, world=1), "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1"})
    with environment.using(alone):
        assert settle(cfg, torchrun=True, where=alone)[0].algo == "single"  # a group of one: the baseline


def test_a_restarted_group_without_a_checkpoint_trains_again_in_its_runs_place(tmp_path: Path) -> None:
    """torchrun restarted the group (or SLURM requeued it) into its run's directory, named by this
    launch alone (torchrun's uuid, SLURM's job id), with no checkpoint there: from the start, in its
    place, said so (before: "already exists", exit 2). Not a first start's, a finished run's, one
    named by a user's --rdzv-id or a Kubeflow job's name (another job's may have it), nor one the
    launcher did not name: those stay "already exists"."""
    from distsgd import rundir
    from distsgd.api import settle
    from distsgd.config import RunConfig

    out = tmp_path / "runs" / "torchrun-f2d06232-allreduce"
    rundir.prepare(out, overwrite=False)
    (out / "metrics.jsonl").write_text("")
    cfg = RunConfig(dataset="digits", model="mlp", algo="allreduce", out=str(out))
    uuid = "f2d06232-9a1b-4c2d-8e3f-0123456789ab"
    ranks = {**pod(0), "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2", "TORCHELASTIC_RUN_ID": uuid}
    again = environment.detect({**ranks, "TORCHELASTIC_RESTART_COUNT": "1"})

    def overwrites(where: environment.Environment, settings: RunConfig = cfg) -> bool:
        with environment.using(where):
            return settle(settings, torchrun=True, where=where)[0].overwrite

    assert overwrites(again)
    assert not overwrites(environment.detect(ranks))  # a first start
    mine = cfg.replace(out=str(tmp_path / "runs" / "torchrun-job-allreduce"))
    rundir.prepare(Path(mine.out), overwrite=False)
    given = environment.detect({**ranks, "TORCHELASTIC_RUN_ID": "job", "TORCHELASTIC_RESTART_COUNT": "1"})
    assert not overwrites(given, mine)
    kubeflow = environment.detect(pod(0, master="mnist-master-0"))
    named = cfg.replace(out=str(tmp_path / "runs" / "kubeflow-mnist-allreduce"))
    rundir.prepare(Path(named.out), overwrite=False)
    assert kubeflow.restarted and not overwrites(kubeflow, named)
    elsewhere = cfg.replace(out=str(tmp_path / "elsewhere"))
    rundir.prepare(Path(elsewhere.out), overwrite=False)
    assert not overwrites(again, elsewhere)
    (out / "summary.json").write_text("{}")
    assert not overwrites(again)  # a finished run


def test_runs_started_here_in_the_same_second_get_directories_of_their_own(tmp_path: Path, monkeypatch) -> None:
    from distsgd import api

    monkeypatch.chdir(tmp_path)
    for name in LAUNCHERS:
        monkeypatch.delenv(name, raising=False)
    first = api.default_out("single")
    first.mkdir(parents=True)
    second = api.default_out("single")
    if second.name.startswith(first.name):  # the same second (else the next one's: another name)
        assert second == first.parent / f"{first.name}-2"
    second.mkdir()
    assert api.default_out("single") not in (first, second)


def test_the_launch_code_asks_the_runs_environment_not_the_process_variables(monkeypatch) -> None:
    """While a run lasts, ``environment.current()`` is the one ``api.run`` detected, whatever
    ``os.environ`` holds; rank, size, host, port and torchrun's attempt come from it."""
    from distsgd.launch import rendezvous

    monkeypatch.setenv("MASTER_ADDR", "elsewhere")  # not what this run was told
    restarted = environment.detect(
        {**pod(1, master="10.1.2.3", port=29400), "LOCAL_RANK": "0", "TORCHELASTIC_RESTART_COUNT": "2",
         "TORCHELASTIC_USE_AGENT_STORE": "True"}
    )  # fmt: skip
    assert isinstance(restarted, environment.Torchrun) and (restarted.attempt, restarted.agent_store) == (2, True)
    with environment.using(restarted):
        assert environment.current() is restarted and environment.launched()
        assert rendezvous.place() == (1, 2) and rendezvous.group_host() == "10.1.2.3"
        assert (restarted.address, restarted.port) == ("10.1.2.3", 29400)
    assert isinstance(environment.current(), environment.Local)  # detected now: no RANK here
    spawned = environment.Spawned(2, 3)  # a worker distsgd's own launcher started: every rank on this machine
    assert (spawned.rank, spawned.world_size, spawned.local_rank, spawned.local_world_size) == (2, 3, 2, 3)
    assert not spawned.launched and spawned.attempt == 0 and not environment.Spawned.detect({})


def test_a_pods_local_ranks_are_written_where_it_left_them_out() -> None:
    env = pod(1)
    environment.detect(env).adopt(env)
    assert env["LOCAL_RANK"] == "0" and env["LOCAL_WORLD_SIZE"] == "1"


def _pods(tmp_path: Path, args: list[str], extra: dict[str, str] | None = None) -> list[subprocess.CompletedProcess]:
    """Two pods of a PyTorchJob, each `python -m distsgd ARGS` with its replica's variables (and
    none of a launcher's it might inherit), run to their end."""
    port = free_port()
    base = {k: v for k, v in os.environ.items() if k not in LAUNCHERS and not k.startswith(("TORCHELASTIC", "SLURM"))}
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "distsgd", *args],
            env={**base, **pod(r, port=port), **(extra or {})},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=tmp_path,
        )
        for r in range(2)
    ]
    done = []
    for p in procs:
        out, err = p.communicate(timeout=240)
        done.append(subprocess.CompletedProcess(p.args, p.returncode, out, err))
    return done


DIGITS = ["train", "--dataset", "digits", "--model", "mlp", "--algo", "allreduce", "--lr", "0.05"]


@pytest.mark.slow
def test_two_kubeflow_pods_train_as_two_machines(tmp_path: Path) -> None:
    """Each pod a machine of its own: all its cores for its one worker (cores / 2 each before)."""
    out = tmp_path / "run"
    pods = _pods(tmp_path, [*DIGITS, "--max-samples", "1280", "--out", str(out), "--quiet"])
    assert [p.returncode for p in pods] == [0, 0], pods[0].stderr[-2000:] + pods[1].stderr[-2000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["workers"] == 2 and summary["samples"] == 1280
    assert summary["threads_per_worker"] == cores()


@pytest.mark.slow
def test_kubeflow_pods_started_again_resume_from_their_checkpoint(tmp_path: Path) -> None:
    """A pod killed mid-run (its peer's group breaks, and it fails too); both start their command
    again, as restartPolicy OnFailure does, and resume from the checkpoint in their run directory."""
    out = tmp_path / "run"
    args = [
        *DIGITS[:3], "--model", kill_at_step_model(tmp_path), *DIGITS[5:],
        "--max-samples", "2560", "--checkpoint-every", "320", "--out", str(out),
    ]  # fmt: skip
    # pod 1 SIGKILLed at its 12th step, the first time only (Kubeflow tells a restarted pod nothing)
    extra = {"KILL_RANK": "1", "KILL_STEP": "12", "KILL_MARKER": str(tmp_path / "first"), "OMP_NUM_THREADS": "1"}
    first = _pods(tmp_path, args, extra)
    assert first[1].returncode != 0 and first[0].returncode != 0, first[0].stderr[-2000:]
    again = _pods(tmp_path, args, extra)
    assert [p.returncode for p in again] == [0, 0], again[0].stderr[-2000:] + again[1].stderr[-2000:]
    assert "a Kubeflow pod started again: resuming from the checkpoint" in again[0].stderr
    assert json.loads((out / "summary.json").read_text())["samples"] >= 2560  # (an epoch's partial batch: 2588)
