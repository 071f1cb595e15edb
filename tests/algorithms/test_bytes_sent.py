"""What a process group's algorithm counts as sent (``GroupAlgorithm.sent``, one share per
collective: ``base.SHARES``) against the bytes that crossed the wire: gloo's all-reduce,
all-gather and broadcast among 3 processes, alone in a network namespace of their own, its
loopback's transmitted bytes read before and after each collective (TCP/IP headers and gloo's
framing add well under 1% to a 4 MiB tensor on loopback's 64 KiB frames)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

WORLD = 3
SCRIPT = r"""
import json, sys
import torch, torch.distributed as dist, torch.multiprocessing as mp

N = 1 << 20  # floats: 4 MiB


def lo_tx():
    for line in open("/proc/net/dev"):
        if line.strip().startswith("lo:"):
            return int(line.split(":")[1].split()[8])


def work(rank, world, q):
    dist.init_process_group("gloo", init_method="tcp://127.0.0.1:29555", rank=rank, world_size=world)
    wire = {}
    for name in ("all_reduce", "all_gather", "broadcast"):
        t = torch.ones(N)
        dist.barrier()
        before = lo_tx()
        dist.barrier()
        if name == "all_reduce":
            dist.all_reduce(t)
        elif name == "all_gather":
            dist.all_gather([torch.empty(N) for _ in range(world)], t)
        else:
            dist.broadcast(t, src=0)
        dist.barrier()
        wire[name] = lo_tx() - before
        dist.barrier()
    if rank == 0:
        q.put(wire)
    dist.destroy_process_group()


if __name__ == "__main__":
    world = int(sys.argv[1])
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=work, args=(r, world, q)) for r in range(world)]
    for p in procs:
        p.start()
    wire = q.get(timeout=120)
    for p in procs:
        p.join()
    print(json.dumps(wire))
"""


def _wire_bytes(tmp_path: Path) -> dict[str, int]:
    if os.geteuid() != 0 or shutil.which("unshare") is None or shutil.which("ip") is None:
        pytest.skip("a network namespace of its own needs root, unshare and ip")
    script = tmp_path / "wire.py"
    script.write_text(SCRIPT)
    r = subprocess.run(
        ["unshare", "--net", "sh", "-c", f'ip link set lo up && exec "{sys.executable}" "{script}" {WORLD}'],
        capture_output=True,
        text=True,
        timeout=300,
    )
    if r.returncode != 0 and "unshare" in r.stderr:
        pytest.skip(f"network namespaces cannot be made here: {r.stderr.strip()[:200]}")
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_the_bytes_counted_are_the_bytes_on_the_wire(tmp_path: Path) -> None:
    from distsgd.algorithms.allreduce import AllReduce
    from distsgd.config import RunConfig

    wire = _wire_bytes(tmp_path)
    nbytes = 4 << 20
    for collective in ("all_reduce", "all_gather", "broadcast"):
        counted = 0
        for rank in range(WORLD):  # each worker counts its own part; a broadcast's root alone sends
            algo = AllReduce(RunConfig(algo="allreduce", workers=WORLD))
            if collective != "broadcast" or rank == 0:
                algo.sent(nbytes, WORLD, collective)
            counted += algo.bytes_sent
        assert counted == pytest.approx(wire[collective], rel=0.01), (collective, counted, wire)
