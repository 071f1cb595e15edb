"""distsgd inside Ray Train: a ``TorchTrainer`` forms the torch process group in each of its workers
before ``train_loop_per_worker`` runs, and distsgd joins that group (``distsgd.train`` trains this
rank; ``distsgd.spawn`` runs the user's loop here) and leaves it as it found it. The tests share
one local Ray cluster (it takes seconds to start on 2 cores); what each rank saw comes back in files.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import distsgd
from distsgd import cli
from distsgd.launch.environment import launched

# Ray is imported by the tests alone: collecting the fast tier does not pay for its import (3 s)
pytestmark = [
    pytest.mark.slow,
    pytest.mark.one_at_a_time("clusters"),  # Ray's workers listen on ports 10002-19999, where SLURM's MASTER_PORT lies
    pytest.mark.skipif(importlib.util.find_spec("ray") is None, reason="no Ray: pip install 'distsgd[ray]'"),
]
HERE = Path(__file__).resolve().parent


@pytest.fixture(scope="module")
def cluster():
    """A local Ray cluster of 2 CPUs (a worker takes half of one), its workers able to import this
    file (Ray sends the training functions by reference) and distsgd."""
    import ray

    from conftest import reap

    path = os.pathsep.join(p for p in (os.environ.get("PYTHONPATH"), str(HERE.parent / "src"), str(HERE)) if p)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("RAY_USAGE_STATS_ENABLED", "0")
        # Each trainer's PreemptionWatcher (a process of its own: it polls for nodes being drained,
        # and this cluster has one) would start beside the workers on this test's core; so would
        # the 2 idle workers Ray starts for the first driver, which no trainer's actor uses (their
        # environment is not the trainer's). The example's driver inherits these variables.
        mp.setenv("RAY_TRAIN_ENABLE_PREEMPTION_WATCHER", "0")
        mp.setenv("RAY_prestart_worker_first_driver", "0")
        mp.setenv("RAY_enable_worker_prestart", "0")
        ray.init(num_cpus=2, include_dashboard=False, runtime_env={"env_vars": {"PYTHONPATH": path}})
        try:
            yield
        finally:
            ray.shutdown()
    left = reap(30)
    assert not left, f"processes left behind by the Ray cluster: {left}"


@pytest.fixture(autouse=True)
def reap_children(cluster):
    """conftest's reaper after each test, less the cluster's processes: they live as long as the
    module, and its fixture reaps them at the end."""
    yield


def _fit(loop, ranks: int, config: dict, tmp_path: Path) -> None:
    """``loop`` in ``ranks`` Ray workers of a TorchTrainer."""
    import ray.train
    from ray.train.torch import TorchTrainer

    TorchTrainer(
        loop,
        train_loop_config=config,
        scaling_config=ray.train.ScalingConfig(num_workers=ranks, resources_per_worker={"CPU": 0.5}),
        run_config=ray.train.RunConfig(storage_path=str(tmp_path / "ray"), name="run"),
    ).fit()


def _record(config: dict, seen: dict) -> None:
    import ray.train

    rank = ray.train.get_context().get_world_rank()
    Path(config["seen"], f"{rank}.json").write_text(json.dumps(seen))


def _seen(tmp_path: Path, ranks: int) -> list[dict]:
    return [json.loads((tmp_path / "seen" / f"{r}.json").read_text()) for r in range(ranks)]


def train_rank(config: dict) -> None:
    """A train_loop_per_worker: distsgd trains this rank in Ray's group, once for each of
    ``config["runs"]`` (algorithm settings, run directory) in turn (the group is still there after
    each); then the user's own loop on a parameter server (test_own_loop's, on distsgd.spawn); then,
    with ``refuse``, what those settings get (see :func:`refusal`); last, with ``no_group``, what
    those get once the torch group is gone and with it TorchTrainer's variables (the state of a
    worker of a Ray Train trainer that forms no group)."""
    import torch.distributed as dist

    from test_own_loop import Net, evaluate_net, tuple_loop

    seen: dict = {}
    for name, (settings, out) in config["runs"].items():
        result = distsgd.train(model="mlp", data="digits", out=out, quiet=True, **settings)
        after = torch.ones(1)
        dist.all_reduce(after)
        seen[name] = {"model": result.model is not None, "after": after.item()}
    own = config["own_loop"]
    result = distsgd.spawn(tuple_loop, model=Net, evaluate=evaluate_net, out=own["out"], quiet=True, **own["settings"])
    seen["own_loop"] = {"model": result.model is not None}
    refused = refusal(config["refuse"]["settings"], config["refuse"]["argv"]) if "refuse" in config else {}
    if "no_group" in config:  # then as a worker of a trainer that forms no group
        dist.destroy_process_group()
        for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT"):
            os.environ.pop(name, None)  # TorchTrainer's, for its group: a DataParallelTrainer sets none
        refused["no_group"] = refusal(config["no_group"]["settings"], config["no_group"]["argv"])
    _record(config, {**seen, **refused})


def refusal(settings: dict, argv: list[str]) -> dict:
    """What distsgd.train raises, and what the CLI says, for the settings, in this Ray worker."""
    try:
        distsgd.train(model="mlp", data="digits", quiet=True, **settings)
        raised = None
    except distsgd.DistsgdError as exc:
        raised = f"{type(exc).__name__}: {exc}"
    stderr = io.StringIO()
    with contextlib.redirect_stderr(stderr):
        code = cli.main(["train", "--model", "mlp", "--dataset", "digits", "--quiet", *argv])
    return {"raised": raised, "code": code, "stderr": stderr.getvalue()}


DIGITS_TRAIN = 1437


# One algorithm per way of joining Ray's group: a lockstep process group (allreduce; any other of
# the Group topology, diloco or local-sgd, is launched alike: the launcher names no algorithm), the
# hogwild++ ring (one cluster a rank), and the parameter server (rank 0 serves; the user's loop).
RANKS = 3
RUNS = {
    "allreduce": {"algo": "allreduce", "epochs": 4, "batch_size": 32, "lr": 0.05},
    "hogwild++": {"algo": "hogwild++", "epochs": 4, "batch_size": 32, "lr": 0.05, "cluster_size": 1},
}
SERVER = {"algo": "asgd", "epochs": 3, "batch_size": 32, "lr": 0.05}


def test_ray_workers_train_in_the_group_ray_formed(cluster, tmp_path: Path) -> None:
    """Three Ray workers of one TorchTrainer, one rank each (hogwild++: one cluster of the ring);
    allreduce, hogwild++ and a parameter server (asgd: rank 0 serves, ranks 1 and 2 run the user's
    loop on distsgd.spawn), one after the other in the same Ray workers (a TorchTrainer's start is
    20-30 s here, mostly waiting: one for all three, for the suite). Rank 0 writes each run and gets
    the model; Ray's group still works after the runs.

    And in the same Ray workers, after the runs: Hogwild!'s workers share one model in memory, and
    Ray's are separate processes with none between them: the API raises, the CLI says one error
    line and exits 2. Then each destroys Ray's group and drops TorchTrainer's variables: a worker of
    a Ray Train trainer that forms no torch group (a DataParallelTrainer's), where each worker would
    train a run of its own, so distsgd refuses it in one line. (A DataParallelTrainer of its own ran
    that until 2026-11-27: a trainer's start, 20 s of the suite.)"""
    (tmp_path / "seen").mkdir()
    runs = {algo: (settings, str(tmp_path / algo)) for algo, settings in RUNS.items()}
    config = {"runs": runs, "seen": str(tmp_path / "seen")}
    config["own_loop"] = {"out": str(tmp_path / "server"), "settings": SERVER}
    config["refuse"] = {"settings": {"algo": "hogwild"}, "argv": ["--algo", "hogwild"]}
    config["no_group"] = {
        "settings": {"algo": "allreduce", "workers": 2},
        "argv": ["--algo", "allreduce", "--workers", "2"],
    }
    _fit(train_rank, RANKS, config, tmp_path)
    seen = _seen(tmp_path, RANKS)
    for algo, settings in RUNS.items():
        s = json.loads((tmp_path / algo / "summary.json").read_text())
        assert s["algo"] == algo and s["workers"] == RANKS and s["backend"] == "gloo"
        assert s["final_test_accuracy"] > 0.85, (algo, s["final_test_accuracy"])
        assert s["samples"] == pytest.approx(settings["epochs"] * DIGITS_TRAIN, rel=0.01)
        assert s["bytes_sent"] > 0
        if algo == "hogwild++":
            assert s["clusters"] == RANKS and s["token_passes"] > 0
        else:
            assert len(s["bytes_sent_per_worker"]) == RANKS and min(s["bytes_sent_per_worker"]) > 0
        assert [r[algo]["model"] for r in seen] == [True, False, False]
        assert [r[algo]["after"] for r in seen] == [float(RANKS)] * RANKS
    s = json.loads((tmp_path / "server" / "summary.json").read_text())
    assert s["algo"] == "asgd" and s["workers"] == RANKS - 1  # rank 0 serves
    assert s["final_test_accuracy"] > 0.85, s["final_test_accuracy"]
    assert s["samples"] == pytest.approx(SERVER["epochs"] * DIGITS_TRAIN, rel=0.02)
    assert s["server_bytes_received"] > s["server_bytes_sent"] > 0 and s["failed_workers"] == []
    assert [r["own_loop"]["model"] for r in seen] == [True, False, False]
    for r in seen:  # hogwild refused
        assert r["raised"].startswith("ConfigError: hogwild shares memory") and "Ray Train" in r["raised"]
        assert r["code"] == 2 and r["stderr"].startswith("error: hogwild shares memory")
        assert r["stderr"].count("\n") == 1, r["stderr"]
        no = r["no_group"]  # no group
        assert no["raised"].startswith(
            f"ConfigError: this Ray Train worker is one of {RANKS} in no torch process group"
        )
        assert no["code"] == 2 and no["stderr"].count("\n") == 1
        assert no["stderr"].startswith(f"error: this Ray Train worker is one of {RANKS} in no torch"), no["stderr"]
    assert not launched()  # this driver has imported ray.train but is no Ray Train worker: it runs locally


def test_the_ray_example_on_a_running_cluster(cluster, tmp_path: Path) -> None:
    """examples/ray_train.py as a user runs it against a cluster (``RAY_ADDRESS``: this module's;
    without it the script's ``ray.init()`` starts a local one): rank 0's run directory, kept by Ray,
    holds the run. (In test_examples until 2026-11-27, where the script's own local cluster took 38
    of its seconds to start and to end.)"""
    import ray

    script = [sys.executable, str(HERE.parent / "examples" / "ray_train.py"), "--cpus-per-worker", "0.5"]
    script += ["--dataset", "digits"]  # Fashion-MNIST's 70,000 images took each worker 5 s to read here
    env = {**os.environ, "RAY_ADDRESS": ray.get_runtime_context().gcs_address, "PYTHONUNBUFFERED": "1"}
    res = subprocess.run(
        [*script, "--storage", str(tmp_path)], cwd=HERE.parent, env=env, capture_output=True, text=True, timeout=240
    )
    assert res.returncode == 0, res.stderr[-3000:]
    accuracy = float(re.search(r"test accuracy ([0-9.]+)", res.stdout).group(1))
    assert accuracy > 0.85, res.stdout
    run = Path(re.search(r"the run directory: (\S+)", res.stdout).group(1))
    assert json.loads((run / "summary.json").read_text())["workers"] == 2 and (run / "model.pt").is_file()
