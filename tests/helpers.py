"""Helpers shared by the tests (importable because pyproject puts tests/ on the path)."""

from __future__ import annotations

import gzip
import os
import socket
import struct
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

FASHION_DIR = Path("/usr/share/datasets/fashion-mnist")
needs_fashion = pytest.mark.skipif(
    not FASHION_DIR.is_dir(), reason="Fashion-MNIST not installed (apt-get install dataset-fashion-mnist)"
)


def write_idx(path: Path, array: np.ndarray, magic: int | None = None, gz: bool = False) -> Path:
    header = struct.pack(">HBB", 0, 0x08, array.ndim) if magic is None else struct.pack(">I", magic)
    header += struct.pack(f">{array.ndim}I", *array.shape)
    data = header + array.astype(np.uint8).tobytes()
    if gz:
        with gzip.open(path, "wb") as fh:
            fh.write(data)
    else:
        path.write_bytes(data)
    return path


def make_idx_dataset(folder: Path, n_train: int = 60, n_test: int = 20, gz: bool = True) -> Path:
    rng = np.random.default_rng(0)
    folder.mkdir(parents=True, exist_ok=True)
    suffix = ".gz" if gz else ""
    for prefix, n in (("train", n_train), ("t10k", n_test)):
        write_idx(folder / f"{prefix}-images-idx3-ubyte{suffix}", rng.integers(0, 256, (n, 28, 28)), gz=gz)
        write_idx(folder / f"{prefix}-labels-idx1-ubyte{suffix}", rng.integers(0, 10, n), gz=gz)
    return folder


def run_cli(
    *args: str,
    timeout: float = 120,
    module: str = "distsgd",
    env: dict[str, str] | None = None,
    cwd: Path | None = None,
) -> subprocess.CompletedProcess:
    """``python -m distsgd ARGS`` (or another module) in a subprocess, with a timeout, in ``cwd``."""
    return subprocess.run(
        [sys.executable, "-m", module, *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **(env or {})},
        cwd=cwd,
    )


def cli_here(*args: str) -> subprocess.CompletedProcess:
    """``distsgd ARGS`` in this process, through the same ``main()`` the command runs, its stdout and
    stderr (the launcher's, not its workers') captured: for a run whose test needs only its exit
    code, output and files. It costs no interpreter's start and import of torch (about 2.5 s of
    CPU a command here), and its workers come from this process's fork server, already started.
    A run whose test reads what every process wrote, or signals it, stays a subprocess
    (:func:`run_cli`)."""
    import contextlib
    import io

    from distsgd import cli

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = cli.main(list(args))
        except SystemExit as exc:  # argparse's own errors
            code = exc.code if isinstance(exc.code, int) else 2
    return subprocess.CompletedProcess(["distsgd", *args], code, out.getvalue(), err.getvalue())


def torchrun(
    *args: str,
    nproc: int = 2,
    timeout: float = 180,
    env: dict[str, str] | None = None,
    cwd: Path | None = None,
    restarts: int | None = None,
) -> subprocess.CompletedProcess:
    """``torchrun --standalone --nproc-per-node NPROC [--max-restarts N] -m distsgd train ARGS``
    (``python -m torch.distributed.run``), one thread a process unless ``env`` says otherwise."""
    again = ["--max-restarts", str(restarts)] if restarts is not None else []
    return run_cli(
        "--standalone", "--nproc-per-node", str(nproc), *again, "-m", "distsgd", "train", *args,
        module="torch.distributed.run", timeout=timeout, env={"OMP_NUM_THREADS": "1", **(env or {})}, cwd=cwd,
    )  # fmt: skip


def free_port() -> int:
    """A TCP port on 127.0.0.1 that no one listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(predicate, seconds: float, proc: subprocess.Popen | None = None) -> None:
    """Until ``predicate()``: failing after ``seconds``, or as soon as ``proc`` (if given) has ended."""
    deadline = time.monotonic() + seconds
    while not predicate():
        assert proc is None or proc.poll() is None, proc.communicate()[1][-3000:] if proc else ""
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def signal_when(proc: subprocess.Popen, ready, sig: int, within: float = 120, timeout: float = 120) -> str:
    """Send ``sig`` to ``proc`` once ``ready()`` (within ``within`` seconds, while it runs), wait up to
    ``timeout`` for its end, and return its stderr; a process still running then is killed (a failed
    test leaves none behind)."""
    try:
        wait_for(ready, within, proc)
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return err


def progress_seen(out: Path) -> bool:
    """Whether the run writing into ``out`` logged a progress event yet (it is training)."""
    metrics = out / "metrics.jsonl"
    return metrics.exists() and '"progress"' in metrics.read_text()


def _group_member(rank: int, world: int, init: str, fn, args: tuple, out: str) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        torch.save(fn(rank, world, *args), f"{out}.{rank}")
    finally:
        dist.destroy_process_group()


def _fresh_group_member(*args) -> None:
    """``_group_member`` in a spawned interpreter, left with ``os._exit`` as a forked one is: should
    ``fn`` keep a reference to the group (torch.distributed.nn's defaults, imported after the group
    formed, do; see launch/rendezvous.py), a gloo thread alive at interpreter exit could abort the
    finished process ("terminate called without an active exception")."""
    _group_member(*args)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def in_group(fn, world: int, tmp_path: Path, *args, timeout: float = 120, init: str | None = None, start: str = "fork"):
    """``fn(rank, world, *args)`` in each of ``world`` processes joined in a gloo process group (so
    its collectives are real), over ``init`` (default: a file of its own); returns each rank's result
    (saved with torch.save). ``start="spawn"``: each a fresh interpreter, for ``fn`` that starts
    processes or threads of its own (a fork of a pytest process that has run torch may hang in
    them); ``fn`` must then be importable, a module's top-level function."""
    import multiprocessing as mp
    import tempfile

    ctx = mp.get_context(start)
    # a folder of its own per call: a second group in one test must not meet the first one's
    # rendezvous file (its stale addresses: "connection refused", then a hang)
    here = Path(tempfile.mkdtemp(prefix="group-", dir=tmp_path))
    init, out = init or f"file://{here / 'group'}", str(here / "result")
    target = _group_member if start == "fork" else _fresh_group_member
    procs = [ctx.Process(target=target, args=(r, world, init, fn, args, out)) for r in range(world)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout  # for them all: a hung group fails after ``timeout``, not world times it
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join()
    assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]
    import torch

    return [torch.load(f"{out}.{r}", weights_only=False) for r in range(world)]


def flat_params(model):
    """A model's parameters as one flat tensor (detached), to compare two models."""
    import torch

    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def toy_dataset(n: int = 256):
    """Twelve Gaussian features and three classes read off them (a fixed draw): the small task the
    exact-reference tests of a user's loop train on."""
    import torch
    from torch.utils.data import TensorDataset

    g = torch.Generator().manual_seed(1)
    x = torch.randn(n, 12, generator=g)
    return TensorDataset(x, (x[:, :3].argmax(1) + (x[:, 3] > 0.5).long()) % 3)


def weights_of(model) -> dict:
    """A model's state (a wrapper's, such as DDP's, unwrapped) in float64 on the CPU, to compare."""
    model = getattr(model, "module", model)
    return {k: v.detach().double().cpu().clone() for k, v in model.state_dict().items()}


def initial_weights(cls, seed: int = 0) -> dict:
    """The weights a run starts from: what ``spawn(model=cls)`` builds for toy_dataset with ``seed``."""
    from distsgd.models import build_model

    return weights_of(build_model(cls, (12,), 3, seed=seed))


KILL_AT_STEP = '''
import glob, os, signal, time
import torch.nn as nn


class Net(nn.Module):
    """mlp-like; a worker whose rank (RANK) is in KILL_RANK (comma-separated) SIGKILLs itself at
    its KILL_STEP-th training forward (0: as it builds the model, before the group's first step);
    with KILL_MARKER, once (the file KILL_MARKER.RANK marks it done: a replacement lives), and with
    SLOW_UNTIL_WHOLE (a number of workers) every worker's forward sleeps 0.02 s once the kill was
    made while its process group has fewer members (so that the others are still training when a
    replacement has started and joins; from the moment the group is whole, at full speed)."""

    def __init__(self, num_classes, input_shape):
        super().__init__()
        self.net = nn.Sequential(nn.Flatten(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, num_classes))
        self.calls = 0
        self.maybe_die()

    def maybe_die(self):
        marker = os.environ.get("KILL_MARKER")
        rank = os.environ.get("RANK")
        if (
            rank in os.environ.get("KILL_RANK", "").split(",")
            and os.environ.get("DISTSGD_ROLE") != "server"
            and self.calls == int(os.environ["KILL_STEP"])
            and not (marker and os.path.exists(f"{marker}.{rank}"))
        ):
            if marker:
                open(f"{marker}.{rank}", "w").close()
            os.kill(os.getpid(), signal.SIGKILL)
        whole = int(os.environ.get("SLOW_UNTIL_WHOLE", "0"))
        if marker and whole and self.calls and glob.glob(f"{marker}.*"):
            import torch.distributed as dist

            if dist.is_initialized() and dist.get_world_size() < whole:
                time.sleep(0.02)

    def forward(self, x):
        if self.training:
            self.calls += 1
            self.maybe_die()
        return self.net(x)
'''


def kill_at_step_model(folder: Path) -> str:
    """``--model`` for :data:`KILL_AT_STEP`, written into ``folder``."""
    path = folder / "killatstep.py"
    path.write_text(KILL_AT_STEP)
    return f"{path}:Net"
