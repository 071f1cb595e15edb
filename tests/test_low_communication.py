"""Low-communication training: gradient compression with error feedback, our
PowerSGD against torch's own hook, and the bench across a shaped network."""

from __future__ import annotations

import contextlib

import json
import os
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import distsgd
from distsgd.algorithms import compress
from distsgd.data import load_dataset

from helpers import run_cli

pytest.importorskip("sklearn")


@pytest.fixture
def group_of_one(tmp_path: Path):
    """A real process group of one process (gloo): every collective is the identity."""
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_powersgd_error_feedback_sends_later_what_it_did_not_send(group_of_one) -> None:
    """Vogels et al. 2019: with error feedback e, what a step leaves out is added to the next, so
    what K steps transmit sums to K G - e_K, and e stays bounded (it grows until the left-out
    directions dominate, and then they are sent): the relative shortfall shrinks as 1/K. A rank-1
    step alone misses most of a full-rank G."""
    torch.manual_seed(1)
    g = torch.randn(20, 30)
    c = compress.PowerSGD(rank=1)
    sent = torch.zeros_like(g)
    errors = []
    for step in range(compress.START_ITER + 400):
        grad = [g.clone()]
        c.allreduce_mean_(grad, 1)
        if step >= compress.START_ITER:  # the first steps are not compressed
            sent += grad[0]
            k = step - compress.START_ITER + 1
            torch.testing.assert_close(sent, k * g - c.error.view_as(g), rtol=1e-4, atol=1e-3)
            errors.append(float(c.error.norm() / g.norm()))
    assert max(errors[200:]) < 1.2 * max(errors[100:200])  # bounded, not growing with K
    assert float((400 * g - sent).norm() / (400 * g).norm()) < 0.05
    svd = torch.linalg.svd(g)
    best = svd.S[0] * torch.outer(svd.U[:, 0], svd.Vh[0])
    assert float((g - best).norm() / g.norm()) > 0.5  # without feedback, each step would miss that much


@pytest.mark.parametrize("rank", [1, 2, 4])
def test_powersgd_sends_zero_for_a_zero_gradient(group_of_one, rank: int) -> None:
    """An all-zero gradient matrix (a layer that got no gradient) is sent as zero, not NaN. With P
    = M Q = 0, Gram-Schmidt divided P's columns by their zero norms (Vogels et al. 2019, Alg. 1,
    orthogonalise P) and the NaN reached every worker's weights."""
    torch.manual_seed(2)
    c = compress.PowerSGD(rank=rank)
    for _ in range(compress.START_ITER + 3):
        grads = [torch.zeros(20, 30), torch.randn(20, 30)]
        c.allreduce_mean_(grads, 1)
        assert torch.equal(grads[0], torch.zeros(20, 30))
        assert bool(torch.isfinite(grads[1]).all())


STEPS = 20


@pytest.mark.parametrize("kind", ["powersgd:2", "powersgd:1", "fp16"])
def test_our_compression_takes_the_steps_of_torchs_ddp_hook(kind: str) -> None:
    """``allreduce --compress`` (ours) and ``ddp --compress`` (torch's fp16_compress_hook and
    powerSGD_hook, error feedback, warm start) on the same data end with the same weights."""
    digits = load_dataset("digits")
    # (20 steps: the two agree to rounding, 1e-7; PowerSGD's power iteration and momentum amplify
    # rounding differences, to 5e-5 after 40 steps.)
    common = dict(model="mlp", data=digits, workers=2, batch_size=16, max_samples=STEPS * 32, lr=0.1, momentum=0.9,
                  seed=3, compress=kind, quiet=True)
    ours = distsgd.train(algo="allreduce", **common)
    torchs = distsgd.train(algo="ddp", **common)
    a = torch.cat([p.detach().reshape(-1) for p in ours.model.parameters()])
    b = torch.cat([p.detach().reshape(-1) for p in torchs.model.parameters()])
    start = torch.cat([p.detach().reshape(-1) for p in distsgd.models.build_model("mlp", (1, 8, 8), 10, seed=3)
                       .parameters()])
    assert float((a - start).norm()) > 0.1  # it trained
    assert float((a - b).norm() / a.norm()) < 1e-5
    assert ours.summary["bytes_sent"] == torchs.summary["bytes_sent"]
    plain = distsgd.train(algo="allreduce", **{**common, "compress": "none"}).summary["bytes_sent"]
    steps_compressed = STEPS - compress.START_ITER
    if kind == "fp16":
        assert ours.summary["bytes_sent"] == plain / 2
    else:  # all but the first steps send P and Q instead of the matrices
        assert ours.summary["bytes_sent"] < plain * (compress.START_ITER + steps_compressed / 5) / STEPS


def test_ddp_powersgd_with_several_buckets_trains_and_resumes(tmp_path: Path) -> None:
    """torch 2.13's powerSGD_hook aborts on gloo with two or more DDP buckets (gloo::EnforceNotMet):
    on gloo, ddp --compress powersgd uses one bucket whatever --bucket-mb says. A resumed run
    starts with start_powerSGD_iter (2) uncompressed steps, as torch requires of a new DDP (its
    buckets are rebuilt after the first step): so it sends more than the uninterrupted run."""
    common = dict(model="mlp", data="digits", algo="ddp", workers=2, lr=0.05, checkpoint_every="300", quiet=True,
                  compress="powersgd:1", bucket_mb=0.001, timeout_s=60)
    full = distsgd.train(max_samples=1436, out=str(tmp_path / "full"), **common).summary
    distsgd.train(max_samples=718, out=str(tmp_path / "part"), **common)
    resumed = distsgd.train(resume=str(tmp_path / "part"), max_samples=1436).summary
    assert resumed["samples"] == full["samples"] == 1436
    assert resumed["final_test_accuracy"] > 0.2 and full["final_test_accuracy"] > 0.2  # it learnt (chance: 0.1)
    assert resumed["bytes_sent"] > full["bytes_sent"]


def test_diloco_learns_and_sends_a_fraction_of_allreduce() -> None:
    digits = load_dataset("digits")
    common = dict(model="mlp", data=digits, workers=2, epochs=6, batch_size=16, quiet=True)
    ar = distsgd.train(algo="allreduce", lr=0.05, **common).summary
    di = distsgd.train(algo="diloco", lr=0.003, sync_every="16", **common).summary
    assert di["final_test_accuracy"] > 0.85, di["final_test_accuracy"]
    steps = 6 * -(-718 // 16)
    assert di["outer_steps"] == -(-steps // 16)  # every 16 steps, and the last partial round
    assert di["bytes_sent_per_sample"] <= ar["bytes_sent_per_sample"] / 16 * (1 + 16 / steps)
    assert di["replica_max_abs_diff"] == 0.0


def test_compression_is_refused_where_it_does_not_apply() -> None:
    with pytest.raises(distsgd.ConfigError, match="--compress is for allreduce, ddp, local-sgd and diloco"):
        distsgd.train(model="mlp", data="digits", algo="hogwild", workers=2, compress="fp16", quiet=True)
    with pytest.raises(distsgd.ConfigError, match="--compress must be none, fp16 or powersgd"):
        distsgd.train(model="mlp", data="digits", algo="allreduce", workers=2, compress="zip", quiet=True)


def test_network_needs_namespaces(monkeypatch) -> None:
    from distsgd.bench.network import Network, parse

    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    with pytest.raises(distsgd.ConfigError, match="cannot be made here: creating network namespaces needs root"):
        with Network("10mbit,delay=20ms"):
            pass
    with pytest.raises(distsgd.ConfigError, match="--network must be RATE"):
        Network("fast")
    assert parse("10mbit,delay=20ms") == ("10mbit", "20ms") and parse("unshaped") == (None, None)


def test_bench_across_a_shaped_network(tmp_path: Path) -> None:
    from distsgd.bench.network import _cannot

    why = _cannot()
    if why:
        pytest.skip(f"network namespaces cannot be made here: {why}")
    args = ("bench", "--algos", "allreduce,asgd,hogwild++,diloco[sync_every=4;lr=0.003],single", "--network",
            "50mbit", "--dataset", "digits", "--model", "logreg", "--max-samples", "3000",
            "--out", str(tmp_path / "b"), "--quiet", "--overwrite")
    res = run_cli(*args, timeout=600)
    if res.returncode != 0 and "on host" in res.stderr:
        # Until __main__ left torchrun workers with os._exit, about one bench in ten failed here: a
        # finished worker aborted in C++ destructors at exit (0 in 30 since). Should it come back,
        # say so, and ask a second attempt to pass.
        warnings.warn(f"bench --network failed once, trying again: {res.stderr.strip().splitlines()[-1]}")
        res = run_cli(*args, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    bench = json.loads((tmp_path / "b" / "bench.json").read_text())
    assert bench["network"] == "50mbit"
    ran = {e["algo"]: e["summary"] for e in bench["runs"]}
    assert set(ran) == {"allreduce", "asgd", "hogwild++", "diloco[sync_every=4,lr=0.003]"}  # single: one machine
    for s in ran.values():
        assert s["network"] == "50mbit" and s["samples"] >= 3000 and s["bytes_sent"] > 0
        assert s["workers"] == 2 and s["final_test_accuracy"] > 0.2  # it learnt (chance: 0.1)


def test_an_interrupted_network_bench_leaves_nothing_behind(tmp_path: Path) -> None:
    """SIGTERM to ``bench --network`` mid-run: one line, exit 130, and neither a host's torchrun, nor
    its workers (in sessions of their own), nor a namespace is left. (Before, SIGTERM left all five
    processes and both namespaces; Ctrl-C, the namespaces. SIGTERM is turned into Ctrl-C's
    KeyboardInterrupt, so one signal tests both ways out: a Ctrl-C test took 10 s more, and passed.)"""
    import signal
    import subprocess
    import sys
    import time

    from distsgd.bench.network import _cannot

    why = _cannot()
    if why:
        pytest.skip(f"network namespaces cannot be made here: {why}")
    before = set(subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split())
    out = tmp_path / "b"
    proc = subprocess.Popen([sys.executable, "-m", "distsgd", "bench", "--network", "unshaped", "--algos", "asgd",
                             "--dataset", "digits", "--model", "mlp", "--epochs", "2000", "--out", str(out)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while not list(out.glob("runs/*/metrics.jsonl")) and time.monotonic() < deadline:  # training
            time.sleep(0.2)
        hosts = set(subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split()) - before
        pids = [int(p) for name in hosts if name.startswith("dsgd-")
                for p in subprocess.run(["ip", "netns", "pids", name], capture_output=True, text=True).stdout.split()]
        assert len(pids) == 5  # each host's torchrun; the server and 2 workers
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        after = set(subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split())
        left = {n for n in after - before if n.startswith("dsgd-")}
        for name in left:  # a failed test leaves nothing behind either
            for p in subprocess.run(["ip", "netns", "pids", name], capture_output=True, text=True).stdout.split():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(int(p), signal.SIGKILL)
            subprocess.run(["ip", "netns", "del", name], capture_output=True)
    assert proc.returncode == 130 and err.decode().strip().splitlines()[-1] == "error: interrupted"
    assert not [pid for pid in pids if _running(pid)]
    assert not left


def _running(pid: int) -> bool:
    """The process exists and is not a zombie (a zombie's parent may be a PID 1 that does not reap)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False
