"""A real multi-host run: two network namespaces joined by a veth pair, torchrun --nnodes 2 across them
for asgd (a process group's and hogwild++'s: test_network_bench).

Each namespace is a host with its own network stack and address (10.99.0.1 and 10.99.0.2 on a
private link that exists only inside this test); traffic between them crosses the veth pair, with
5 ms of netem delay each way where `tc` is available. Skips, saying why, where namespaces cannot
be created (not root, no iproute2, no permission).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
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
