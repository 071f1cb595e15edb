"""A real multi-host run: two network namespaces joined by a veth pair, torchrun --nnodes 2 across them
for asgd (a process group's and hogwild++'s: test_network_bench), and a group that trains through
the loss of a host (--min-workers).

Each namespace is a host with its own network stack and address (10.99.0.1 and 10.99.0.2 on a
private link that exists only inside this test); traffic between them crosses the veth pair, with
5 ms of netem delay each way where `tc` is available. Skips, saying why, where namespaces cannot
be created (not root, no iproute2, no permission).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

pytest.importorskip("sklearn")

HOSTS = {"a": "10.99.0.1", "b": "10.99.0.2"}


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check, timeout=30)


@pytest.fixture
def two_hosts():
    if shutil.which("ip") is None:
        pytest.skip("iproute2 ('ip') is not installed")
    if os.geteuid() != 0:
        pytest.skip("creating network namespaces needs root")
    tag = uuid.uuid4().hex[:6]
    names = {h: f"dsgd-{h}-{tag}" for h in HOSTS}
    veth = {h: f"v{h}{tag}" for h in HOSTS}
    made: list[str] = []
    try:
        for h in HOSTS:
            res = _ip("netns", "add", names[h], check=False)
            if res.returncode != 0:
                pytest.skip(f"cannot create a network namespace here: {res.stderr.strip()}")
            made.append(names[h])
        _ip("link", "add", veth["a"], "type", "veth", "peer", "name", veth["b"])
        for h in HOSTS:
            _ip("link", "set", veth[h], "netns", names[h])
            _ip("-n", names[h], "addr", "add", f"{HOSTS[h]}/24", "dev", veth[h])
            _ip("-n", names[h], "link", "set", veth[h], "up")
            _ip("-n", names[h], "link", "set", "lo", "up")
            if shutil.which("tc"):
                subprocess.run(
                    [
                        "ip",
                        "netns",
                        "exec",
                        names[h],
                        "tc",
                        "qdisc",
                        "add",
                        "dev",
                        veth[h],
                        "root",
                        "netem",
                        "delay",
                        "5ms",
                    ],
                    capture_output=True,
                    timeout=30,
                )
        yield names, veth
    finally:
        for name in made:
            _ip("netns", "del", name, check=False)


def _run_on_both(names, veth, algo: str, out: Path, port: int) -> list[subprocess.CompletedProcess]:
    procs = []
    for node, h in enumerate(HOSTS):
        env = {**os.environ, "GLOO_SOCKET_IFNAME": veth[h], "TP_SOCKET_IFNAME": veth[h], "OMP_NUM_THREADS": "1"}
        cmd = [
            "ip",
            "netns",
            "exec",
            names[h],
            sys.executable,
            *"-m torch.distributed.run --nnodes 2 --nproc-per-node 1 --node-rank".split(),
            str(node),
            "--master-addr",
            HOSTS["a"],
            "--master-port",
            str(port),
            "-m",
            "distsgd",
            "train",
            "--algo",
            algo,
            *"--dataset digits --model mlp --epochs 2 --lr 0.05 --out".split(),
            str(out),
            "--timeout",
            "60",
        ]
        procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env))
    results = []
    for p in procs:
        try:
            stdout, stderr = p.communicate(timeout=240)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
        results.append(subprocess.CompletedProcess(p.args, p.returncode, stdout, stderr))
    return results


@pytest.mark.slow
def test_torchrun_across_two_hosts(two_hosts, tmp_path: Path) -> None:
    """asgd: the server (rank 0) on host a, its one worker on host b, as a user's two torchrun
    commands start them. (allreduce and hogwild++, each host one cluster of the ring, ran here too
    until 2026-11-28, 26 s of the suite: the same `torchrun --nnodes 2` across two namespaces is
    test_network_bench's test_bench_across_a_shaped_network, whose bench starts each host's
    torchrun as this test does, and checks both runs' figures: workers, bytes, the ring's clusters
    and token passes.)"""
    names, veth = two_hosts
    out = tmp_path / "run"
    results = _run_on_both(names, veth, "asgd", out, 29512)
    for r in results:
        assert r.returncode == 0, r.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["workers"] == 1 and summary["algo"] == "asgd"
    assert summary["final_test_accuracy"] > 0.6 and summary["bytes_sent"] > 0
    # distsgd says that it listens on a non-loopback address without authentication
    assert "no authentication or encryption" in results[0].stderr
    # the workers' sends are in other processes: the server counts what it received
    assert summary["bytes_sent"] == summary["server_bytes_sent"] + summary["server_bytes_received"]
    assert summary["server_bytes_received"] > summary["server_bytes_sent"] > 0


@pytest.mark.slow
def test_min_workers_trains_through_a_host_killed(two_hosts, tmp_path: Path) -> None:
    """allreduce with --min-workers 2 on two hosts of two workers each (torchrun --nnodes 2
    --nproc-per-node 2): host b's every process is killed mid-run (its torchrun agent, the keepers
    and their workers: SIGKILL to each process in its namespace). Host a's keeper 0 hears nothing
    more from b's keepers and, SILENT_S later, announces the next generation without them: host
    a's two workers train on to the full budget with identical replicas, and the run says why.
    (Host a's torchrun agent then waits out torchrun's own exit barrier for b's, 300 s: the test
    ends once host a's distsgd processes have, all but that agent.)"""
    names, veth = two_hosts
    out = tmp_path / "run"
    procs, logs = [], []
    for node, h in enumerate(HOSTS):
        env = {**os.environ, "GLOO_SOCKET_IFNAME": veth[h], "TP_SOCKET_IFNAME": veth[h], "OMP_NUM_THREADS": "1"}
        cmd = [
            "ip", "netns", "exec", names[h], sys.executable,
            *"-m torch.distributed.run --nnodes 2 --nproc-per-node 2 --node-rank".split(), str(node),
            "--master-addr", HOSTS["a"], "--master-port", "29513", "-m", "distsgd", "train",
            *"--algo allreduce --dataset digits --model mlp --batch-size 16 --lr 0.05 --max-samples 24000".split(),
            "--min-workers", "2", "--timeout", "60", "--out", str(out),
        ]  # fmt: skip
        logs.append((tmp_path / f"{h}.out", tmp_path / f"{h}.err"))
        with open(logs[-1][0], "w") as stdout, open(logs[-1][1], "w") as stderr:
            procs.append(subprocess.Popen(cmd, stdout=stdout, stderr=stderr, env=env))

    def waited(done, seconds: float, what: str) -> None:
        deadline = time.monotonic() + seconds
        while not done():
            assert time.monotonic() < deadline, f"{what}: {logs[0][1].read_text()[-3000:]}"
            time.sleep(0.1)

    try:
        metrics = out / "metrics.jsonl"
        waited(lambda: metrics.exists() and '"progress"' in metrics.read_text(), 120, "the run did not start training")
        time.sleep(1.0)
        pids = _ip("netns", "pids", names["b"]).stdout.split()
        assert pids, "host b runs nothing"
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(pid), signal.SIGKILL)
        waited(lambda: "run saved in" in logs[0][0].read_text(), 180, "the run did not end")
        # its keepers and their workers end; torchrun's agent waits at its exit barrier
        waited(lambda: len(_ip("netns", "pids", names["a"]).stdout.split()) == 1, 60, "host a's processes did not end")
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
    err = logs[0][1].read_text()
    assert "Traceback" not in err and "error:" not in err, err[-3000:]
    s = json.loads((out / "summary.json").read_text())
    assert s["workers"] == 4 and sorted(s["failed_workers"]) == [2, 3]
    assert sorted(rec["worker"] for rec in s["recoveries"]) == [2, 3]
    assert all("went silent" in rec["reason"] for rec in s["recoveries"])
    assert s["samples"] >= 24000 and s["replica_max_abs_diff"] == 0.0 and s["final_test_accuracy"] > 0.8
