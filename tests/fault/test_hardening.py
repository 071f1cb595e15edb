"""Hardening (issue 27): nothing the user made is deleted, SIGTERM is a clean stop, a stranger on
the parameter server's port cannot stop a run, a worker that dies holding a lock does not hang
the others, checkpoints survive a full disk and a damaged file, and bad input is one line.

Each test failed on main 767cbe8 (before this work); the docstrings say how.
"""

from __future__ import annotations

import gzip
import json
import os
import pickle
import signal
import socket
import struct
import subprocess
import sys
import time
import tracemalloc
from pathlib import Path

import numpy as np
import pytest

from distsgd import checkpoint
from distsgd.errors import DataError
from distsgd.launch.procs import MAIN_GUARD
from helpers import cli_here, free_port, run_cli, wait_for

pytest.importorskip("sklearn")

SMALL = ["--dataset", "digits", "--model", "mlp", "--batch-size", "16", "--lr", "0.05"]


def one_error_line(err: str) -> str:
    """The only line on stderr, an ``error:`` line (no traceback, no warning)."""
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), err[-3000:]
    return lines[0]


def train_here(capsys: pytest.CaptureFixture, *args: str) -> subprocess.CompletedProcess:
    """``distsgd train`` in this process (a single-process run: no subprocess start-up to pay)."""
    from distsgd import cli

    capsys.readouterr()
    code = cli.main(["train", *SMALL, "--quiet", *args])
    out, err = capsys.readouterr()
    return subprocess.CompletedProcess(["distsgd", "train", *args], code, out, err)


# --- 1. --overwrite deletes only what distsgd wrote -------------------------------------------


def test_overwrite_refuses_a_directory_distsgd_did_not_make(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """On 767cbe8 ``--overwrite`` deleted notes.txt and sub/thesis.tex and wrote a run there."""
    d = tmp_path / "D"
    (d / "sub").mkdir(parents=True)
    (d / "notes.txt").write_text("mine")
    (d / "sub" / "thesis.tex").write_text("years of work")
    r = train_here(capsys, "--max-samples", "64", "--out", str(d), "--overwrite")
    assert r.returncode == 2
    assert "distsgd did not write" in one_error_line(r.stderr)
    assert (d / "notes.txt").read_text() == "mine" and (d / "sub" / "thesis.tex").read_text() == "years of work"
    assert sorted(p.name for p in d.iterdir()) == ["notes.txt", "sub"]


def test_overwrite_replaces_a_run_directory_but_not_a_file_the_user_put_in_it(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """A run directory with a user's file in it is refused whole (on 767cbe8 the file was deleted);
    without it, the run is replaced. An empty directory is taken as it is."""
    run = tmp_path / "run"
    assert train_here(capsys, "--max-samples", "64", "--out", str(run)).returncode == 0
    (run / "analysis.ipynb").write_text("{}")
    r = train_here(capsys, "--max-samples", "64", "--out", str(run), "--overwrite")
    assert r.returncode == 2 and "analysis.ipynb" in one_error_line(r.stderr)
    assert (run / "analysis.ipynb").exists() and (run / "model.pt").exists()
    (run / "analysis.ipynb").unlink()
    before = (run / "summary.json").stat().st_mtime_ns
    r = train_here(capsys, "--max-samples", "128", "--out", str(run), "--overwrite")
    assert r.returncode == 0, r.stderr
    assert (run / "summary.json").stat().st_mtime_ns != before
    assert json.loads((run / "summary.json").read_text())["samples"] >= 128
    empty = tmp_path / "empty"
    empty.mkdir()
    assert train_here(capsys, "--max-samples", "64", "--out", str(empty)).returncode == 0


def test_overwrite_never_replaces_the_run_being_resumed(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """``--resume runs/a --out runs --overwrite`` deleted runs/a on 767cbe8."""
    runs = tmp_path / "runs"
    a = runs / "a"
    assert train_here(capsys, "--max-samples", "256", "--checkpoint-every", "128", "--out", str(a)).returncode == 0
    files = sorted(p.relative_to(a) for p in a.rglob("*"))
    for out in (runs, a / "inside"):
        r = train_here(capsys, "--resume", str(a), "--max-samples", "512", "--out", str(out), "--overwrite")
        assert r.returncode == 2 and "resumed" in one_error_line(r.stderr)
        assert sorted(p.relative_to(a) for p in a.rglob("*")) == files


# --- 2. SIGTERM is a clean stop -----------------------------------------------------------------


def _dead(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


@pytest.mark.slow
@pytest.mark.parametrize("whole_group", [False, True], ids=["kill-launcher", "kill-process-group"])
def test_sigterm_stops_a_run_cleanly(tmp_path: Path, whole_group: bool) -> None:
    """``kill PID`` (the launcher alone) or a scheduler's SIGTERM to the whole process group.
    On 767cbe8: status 143 with no error line, workers.json left listing dead pids, and
    semaphores reported leaked."""
    out = tmp_path / "run"
    cmd = [
        sys.executable,
        *"-m distsgd train --algo hogwild --workers 2".split(),
        *SMALL,
        *"--epochs 200 --checkpoint-every 2000 --log-every 20 --quiet --out".split(),
        str(out),
    ]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        wait_for(lambda: (out / "workers.json").exists() and checkpoint.read_manifest(out) is not None, 120, proc)
        pids = [e["pid"] for e in json.loads((out / "workers.json").read_text())]
        if whole_group:
            os.killpg(proc.pid, signal.SIGTERM)
        else:
            proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 143
    line = one_error_line(err)  # no "leaked semaphore" warning either
    assert "terminated by SIGTERM" in line and f"--resume {out}" in line
    assert not (out / "workers.json").exists()
    wait_for(lambda: all(_dead(p) for p in pids), 10)
    manifest = checkpoint.usable_checkpoint(out)  # the last whole checkpoint, every file loads
    assert manifest["samples"] >= 2000


@pytest.mark.slow
@pytest.mark.parametrize("algo", ["allreduce", "local-sgd"])
def test_a_finished_run_says_nothing_on_stderr(tmp_path: Path, algo: str) -> None:
    """The launcher stops a worker still leaving its process group once every result is in. Since
    SIGTERM became Ctrl-C for workers, that stop printed a worker's traceback after most runs (4 of 4
    allreduce runs here)."""
    res = run_cli(
        "train",
        "--algo",
        algo,
        "--workers",
        "2",
        *SMALL,
        "--max-samples",
        "320",
        "--quiet",
        "--out",
        str(tmp_path / "run"),
    )
    assert res.returncode == 0 and res.stderr == "", res.stderr[-2000:]


# --- 3. A stranger on the parameter server's port -------------------------------------------------


@pytest.mark.slow
def test_a_stranger_on_the_server_port_cannot_stop_the_run(tmp_path: Path) -> None:
    """During an asgd run, a stranger connects and says HELLO for worker 0, then PUSHes a gradient
    claiming 2**62 samples; another holds 100 connections open; another trickles a byte a second.
    On 767cbe8 the real worker 0 was dropped and the run never finished. Now every one is refused
    and the run ends as it would have."""
    out, port = tmp_path / "run", free_port()
    cmd = [
        sys.executable,
        *"-m distsgd train --algo asgd --workers 2".split(),
        *SMALL,
        "--epochs",
        "40",
        "--log-every",
        "20",
        "--init-method",
        f"tcp://127.0.0.1:{port}",
        "--timeout",
        "20",
        "--out",
        str(out),
    ]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    held: list[socket.socket] = []
    try:
        wait_for(
            lambda: (out / "metrics.jsonl").exists() and '"progress"' in (out / "metrics.jsonl").read_text(), 120, proc
        )
        header = struct.pack("4q", 0, 1, 0, 1)  # HELLO for rank 1 (worker 0), "replacing a dead one", as on 767cbe8
        stranger = socket.create_connection(("127.0.0.1", port))
        stranger.sendall(header + bytes(4096))
        stranger.sendall(struct.pack("4q", 2, 0, 2**62, 0) + bytes(4096))  # PUSH, version 0, 2**62 samples
        for _ in range(100):  # a flood
            try:
                held.append(socket.create_connection(("127.0.0.1", port), timeout=5))
            except OSError:
                break
        trickle = socket.create_connection(("127.0.0.1", port))
        held += [stranger, trickle]
        for _ in range(3):
            trickle.send(b"\0")
            time.sleep(0.3)
        _, err = proc.communicate(timeout=150)
    finally:
        for s in held:
            s.close()
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, err[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["failed_workers"] == []
    assert summary["samples_per_worker"] == [40 * 718, 40 * 718]  # both trained to the end (1437 // 2 each)
    # the flood met the server while it ran: most of its connections were evicted (8 may wait)
    assert summary["refused_connections"] >= 50, summary["refused_connections"]  # 84 seen
    assert err.count("refused a connection") == 3  # three warnings, then only a count: a flood is not a log


# --- 4. No hang: a worker that dies holding a lock ------------------------------------------------

KILLER_MODEL = '''
import os, signal
import torch.nn as nn
from torch.optim.optimizer import register_optimizer_step_pre_hook

def _die_once():
    """SIGKILL this process, in the first worker to get here (a file made with O_EXCL says who)."""
    try:
        os.close(os.open(os.environ["KILL_MARK"], os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return
    os.kill(os.getpid(), signal.SIGKILL)

_steps = [0]

def _in_optimizer_step(optimizer, args, kwargs):  # runs inside optimizer.step(), inside --hogwild-lock
    _steps[0] += 1
    if os.environ.get("KILL_IN") == "step" and _steps[0] == 30:
        _die_once()

register_optimizer_step_pre_hook(_in_optimizer_step)

if os.environ.get("KILL_IN") == "ring":  # inside the token ring's exchange, holding the ring's lock
    from distsgd.algorithms import hogwildpp
    _token_pass = hogwildpp.token_pass

    def token_pass(*args, **kwargs):
        _die_once()
        return _token_pass(*args, **kwargs)

    hogwildpp.token_pass = token_pass

class Net(nn.Module):
    def __init__(self, num_classes, input_shape):
        super().__init__()
        self.net = nn.Sequential(nn.Flatten(), nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, num_classes))

    def forward(self, x):
        return self.net(x)
'''


@pytest.mark.slow
@pytest.mark.parametrize("where", ["hogwild-lock", "hogwild++-ring"])
def test_a_worker_killed_holding_a_lock_does_not_stop_the_others(tmp_path: Path, where: str) -> None:
    """A worker SIGKILLed inside ``--hogwild-lock`` (on 767cbe8 the others blocked for ever), or
    inside hogwild++'s token exchange (on 767cbe8 the token never moved again, silently)."""
    model = tmp_path / "killer.py"
    model.write_text(KILLER_MODEL)
    algo = (
        ["--algo", "hogwild", "--workers", "2", "--hogwild-lock"]
        if where == "hogwild-lock"
        else ["--algo", "hogwild++", "--workers", "4", "--cluster-size", "2", "--update-delay", "4"]
    )
    cmd = [
        sys.executable,
        "-m",
        "distsgd",
        "train",
        *algo,
        "--dataset",
        "digits",
        "--model",
        f"{model}:Net",
        *"--batch-size 16 --lr 0.05 --epochs 6 --out".split(),
        str(tmp_path / "run"),
    ]  # not --quiet: it
    env = {
        **os.environ,
        "KILL_MARK": str(tmp_path / "victim"),
        "KILL_IN": "step" if where == "hogwild-lock" else "ring",
    }
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    assert (tmp_path / "victim").exists()  # a worker died there
    assert "died holding a lock" in r.stderr  # a warning (--quiet would hide it)
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert len(summary["failed_workers"]) == 1
    if where == "hogwild++-ring":
        assert summary["token_passes"] >= 4  # the token went on round the ring


# --- The launcher blames a replacement for nothing its predecessor said --------------------------


def _says_then_dies(rank: int, out, replacement: bool) -> None:
    from distsgd.launch import procs

    box = procs.Outbox(out)
    if not replacement:
        box.put(("error", rank, "RuntimeError: the first process's own failure"))
        os._exit(3)
    box.put(("result", rank, {"ok": True}))


@pytest.mark.slow
def test_a_replacement_is_not_blamed_for_its_predecessors_last_words(tmp_path: Path) -> None:
    """The dead process's error was still in its pipe when the launcher replaced it; on 767cbe8 it
    was filed under the replacement, which then counted as failed too."""
    from distsgd.config import RunConfig
    from distsgd.launch import procs

    cfg = RunConfig(restart_workers=1)
    with procs.spawned(cfg, _says_then_dies, [("worker", 0)], lambda i, out, repl: (i, out, repl)) as team:
        sup = procs.Supervisor(team.procs, team.inbox, lambda event: None)
        team.procs[0].join(30)
        sup.ended.add(0)  # the launcher saw the exit before it read the pipe
        events: list[dict] = []
        sink = type("Sink", (), {"emit": staticmethod(events.append)})()
        assert procs.replace(team, sup, 0, "worker 0", sink, restarts := [])
        assert "the first process's own failure" in restarts[0]["reason"]
        assert [e["event"] for e in events] == ["restart"]
        sup.drain_until(lambda: 0 in sup.results, 30)
        assert sup.results == {0: {"ok": True}} and sup.failed() == set()


# --- 5. No data lost: checkpoints, a full disk, the order of the files ----------------------------


@pytest.mark.slow
def test_a_damaged_latest_checkpoint_falls_back_to_the_one_before(tmp_path: Path) -> None:
    """On 767cbe8 only one generation was kept: a damaged newest checkpoint was a clean error and
    the run could not go on. A killed writer's temporary files stayed for ever."""
    out = tmp_path / "run"
    assert (
        cli_here(
            "train", *SMALL, "--quiet", "--max-samples", "600", "--checkpoint-every", "200", "--out", str(out)
        ).returncode
        == 0
    )
    ckpt = out / "checkpoint"
    newest = checkpoint.read_manifest(out)
    previous = json.loads((ckpt / checkpoint.PREVIOUS).read_text())
    assert previous["seq"] < newest["seq"]
    torn = checkpoint.worker_file(ckpt, newest["seq"], 0)
    torn.write_bytes(torn.read_bytes()[:100])
    stale = ckpt / f".{checkpoint.worker_file(ckpt, newest['seq'] + 1, 0).name}.0123456789ab.tmp"  # a killed writer's
    stale.write_bytes(b"half a checkpoint")
    r = run_cli("train", "--resume", str(out), "--max-samples", "800", "--out", str(tmp_path / "more"))  # warns
    assert r.returncode == 0, r.stderr
    assert (
        "damaged" in r.stderr
        and f"resuming from the one before it ({previous['seq']}, at {previous['samples']} samples)" in r.stderr
    )
    assert json.loads((tmp_path / "more" / "summary.json").read_text())["samples"] == 800
    assert stale.exists()  # the run read from, resumed into another directory, is not tidied
    assert cli_here("train", "--resume", str(out), "--max-samples", "800", "--quiet").returncode == 0  # in place: it is
    assert not stale.exists()


@pytest.mark.slow
def test_checkpoints_of_random_bytes_are_one_error_line_without_torchs_advice(tmp_path: Path) -> None:
    """Both generations overwritten with random bytes: one error line. On 7bc0941 torch's warning of
    another pickle protocol came first, and the line quoted torch's advice to load with
    weights_only=False ("it can result in arbitrary code execution"), an audit's."""
    out = tmp_path / "run"
    flags = ("--max-samples", "600", "--checkpoint-every", "200", "--out", str(out))
    assert cli_here("train", *SMALL, "--quiet", *flags).returncode == 0
    ckpt = out / "checkpoint"
    newest = checkpoint.read_manifest(out)
    previous = json.loads((ckpt / checkpoint.PREVIOUS).read_text())
    for seq in (newest["seq"], previous["seq"]):
        checkpoint.worker_file(ckpt, seq, 0).write_bytes(np.random.default_rng(seq).bytes(1000))
    r = run_cli("train", "--resume", str(out), "--max-samples", "800")
    assert r.returncode == 2 and len(r.stderr.splitlines()) == 1, r.stderr
    assert "cannot be read as tensors and plain data" in r.stderr and "weights_only" not in r.stderr


def _tmpfs(path: Path, size: str) -> Path:
    path.mkdir()
    if (
        os.geteuid() != 0
        or subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True
        ).returncode
        != 0
    ):
        pytest.skip("needs root to mount a small tmpfs (a full disk)")
    return path


@pytest.mark.slow
def test_a_full_disk_is_one_line_and_loses_no_checkpoint(tmp_path: Path) -> None:
    """A run whose disk fills during a checkpoint stops with one line naming the path; its last
    whole checkpoint still resumes. A run whose model.pt cannot be written leaves no summary.json
    (on 767cbe8: a traceback, and summary.json written before model.pt)."""
    disk = _tmpfs(tmp_path / "disk", "4m")
    try:
        out = disk / "run"
        assert (
            cli_here(
                "train", *SMALL, "--quiet", "--max-samples", "400", "--checkpoint-every", "200", "--out", str(out)
            ).returncode
            == 0
        )
        whole = checkpoint.read_manifest(out)
        filler = disk / "filler"
        with open(filler, "wb") as fh:  # fill the disk to its last byte
            try:
                while True:
                    fh.write(bytes(65536))
                    fh.flush()
            except OSError:
                pass
        for f in (out / "summary.json", out / "model.pt"):
            f.unlink()
        r = run_cli("train", "--resume", str(out), "--max-samples", "1200", "--out", str(out), "--quiet")
        assert r.returncode == 2
        line = one_error_line(r.stderr)
        assert str(out) in line and "No space left on device" in line
        assert not (out / "summary.json").exists()
        filler.unlink()
        assert checkpoint.usable_checkpoint(out)["seq"] >= whole["seq"]  # a whole checkpoint, still
        r = cli_here("train", "--resume", str(out), "--max-samples", "1200", "--out", str(out), "--quiet")
        assert r.returncode == 0, r.stderr
        assert json.loads((out / "summary.json").read_text())["samples"] == 1200
    finally:
        subprocess.run(["umount", "-l", str(disk)], capture_output=True)


# --- 6. Bad input: one line, never a traceback ------------------------------------------------


def test_an_idx_header_whose_dimensions_overflow(tmp_path: Path) -> None:
    """Dimensions whose product overflows int64 (a traceback from numpy on 767cbe8)."""
    folder = tmp_path / "data"
    folder.mkdir()
    (folder / "x.idx").write_bytes(
        struct.pack(">HBB", 0, 0x08, 3) + struct.pack(">3I", 2**32 - 1, 2**32 - 1, 2**31) + bytes(64)
    )
    from distsgd.data import formats

    with pytest.raises(DataError, match="claims shape"):
        formats.read_idx(folder / "x.idx")


def test_a_gzip_bomb_is_refused_without_reading_it(tmp_path: Path) -> None:
    """A 100 kB gzip file whose header claims 4 GB of images (on 767cbe8 it was decompressed into
    memory, 100 MB of it, before the error)."""
    path = tmp_path / "train-images-idx3-ubyte.gz"
    header = struct.pack(">HBB", 0, 0x08, 3) + struct.pack(">3I", 4000, 1000, 1000)
    with gzip.open(path, "wb", compresslevel=9) as fh:
        fh.write(header)
        for _ in range(100):
            fh.write(bytes(1 << 20))
    assert path.stat().st_size < 1 << 20
    from distsgd.data import formats

    tracemalloc.start()
    try:
        with pytest.raises(DataError, match="claims shape"):
            formats.read_idx(path)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 4 << 20


@pytest.mark.slow
def test_an_npz_claiming_ten_trillion_elements(tmp_path: Path) -> None:
    """An npy header claiming 10**13 elements (numpy tried to allocate it on 767cbe8)."""
    import zipfile

    header = {"descr": "<f4", "fortran_order": False, "shape": (10**13,)}
    buf = bytearray()
    np.lib.format.write_array_header_1_0(_Writer(buf), header)
    with zipfile.ZipFile(tmp_path / "big.npz", "w") as zf:
        zf.writestr("x.npy", bytes(buf) + bytes(64))  # the header (magic included), 64 bytes of data
        zf.writestr("y.npy", bytes(buf) + bytes(64))
    r = run_cli("train", "--dataset", f"npz:{tmp_path / 'big.npz'}", "--model", "mlp", "--quiet")
    assert r.returncode == 2 and "claims shape" in one_error_line(r.stderr)


class _Writer:
    def __init__(self, buf: bytearray) -> None:
        self.buf = buf

    def write(self, data: bytes) -> None:
        self.buf += data


@pytest.mark.parametrize(
    "labels",
    [["a", "b"], [[1, 2], [3]], {"x": 1}, 3.5, [1.5, 2.5]],
    ids=["strings", "ragged", "dict", "float", "floats"],
)
def test_cifar_labels_that_are_not_a_list_of_ints(tmp_path: Path, labels) -> None:
    """A traceback (TypeError/ValueError) on 767cbe8 for several of these."""
    from distsgd.data import formats

    path = tmp_path / "data_batch_1"
    with open(path, "wb") as fh:
        pickle.dump({b"data": np.zeros((2, 3072), np.uint8), b"labels": labels}, fh, protocol=2)
    with pytest.raises(DataError):
        formats.read_cifar_batch(path)


@pytest.mark.slow
@pytest.mark.parametrize("case", ["toml-not-utf8", "config-is-a-directory", "out-under-a-file"])
def test_bad_paths_and_files_are_one_line(tmp_path: Path, case: str) -> None:
    """Tracebacks on 767cbe8 (UnicodeDecodeError, IsADirectoryError, NotADirectoryError)."""
    if case == "toml-not-utf8":
        (tmp_path / "c.toml").write_bytes(b'lr = 0.1\nalgo = "\xff\xfe"\n')
        args = ["--config", str(tmp_path / "c.toml")]
    elif case == "config-is-a-directory":
        args = ["--config", str(tmp_path)]
    else:
        args = ["--out", "/dev/null/r", "--max-samples", "64"]
    r = run_cli("train", *SMALL, "--quiet", *args)  # (a subprocess: its stderr holds the warnings too)
    assert r.returncode == 2, r.stderr
    one_error_line(r.stderr)


MODULE_LEVEL_SCRIPT = """
import distsgd
import numpy as np

rng = np.random.default_rng(0)
x, y = rng.normal(size=(64, 8)).astype("float32"), rng.integers(0, 2, 64)
print("training", flush=True)
distsgd.train("mlp", (x, y), algo="allreduce", workers=2, max_samples=64, quiet=True)
print("trained", flush=True)
"""


@pytest.mark.slow
def test_a_script_that_trains_at_module_level_is_told_what_to_do(tmp_path: Path) -> None:
    """Without ``if __name__ == "__main__":`` every worker imports the script again; on 767cbe8 that
    was a BrokenPipeError traceback from the fork server."""
    script = tmp_path / "first.py"
    script.write_text(MODULE_LEVEL_SCRIPT)
    r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert r.returncode == 2, r.stderr[-3000:]
    assert "trained" not in r.stdout  # (a worker runs the script's lines before the call: "training")
    assert r.stderr.splitlines() == [f"error: {MAIN_GUARD}"]  # one line, no traceback (before: 34 lines)
    assert 'if __name__ == "__main__":' in MAIN_GUARD


MODULE_LEVEL_LOOP = """
import multiprocessing

import torch
from torch import nn

import distsgd
from distsgd.launch import procs

if START == "spawn":  # workers started as on macOS: each imports the script, and the launcher hears it
    procs.mp_context = lambda: multiprocessing.get_context("spawn")


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.layer = nn.Linear(8, 2)

    def forward(self, x):
        return self.layer(x)


def main(run):
    model, opt = run.setup(lambda m: torch.optim.SGD(m.parameters(), lr=0.1))
    data = torch.utils.data.TensorDataset(torch.randn(64, 8), torch.randint(0, 2, (64,)))
    for x, y in run.loader(data, batch_size=16):
        opt.zero_grad()
        run.backward(nn.functional.cross_entropy(model(x), y))
        opt.step()
    return run.final_model()


distsgd.spawn(main, model=Net, algo=ALGO, workers=2)
print("trained", flush=True)
"""


@pytest.mark.slow
@pytest.mark.parametrize(
    "algo, start", [("allreduce", "forkserver"), ("allreduce", "spawn"), ("hogwild", "spawn"), ("asgd", "spawn")]
)
def test_a_script_that_spawns_its_loop_at_module_level_is_one_error_line(tmp_path: Path, algo: str, start: str) -> None:
    """Your own loop through distsgd.spawn, called at module level without the main guard: one
    ``error:`` line and exit 2, under each topology (on 8b8418d a traceback of 34 lines with the
    line at its end; where workers start by spawn, hogwild's was a WorkerError traceback). With the
    fork server the warm-up process meets the call; started by spawn, each worker exits and the
    launcher says the same line."""
    script = tmp_path / "loop.py"
    script.write_text(MODULE_LEVEL_LOOP.replace("ALGO", repr(algo)).replace("START", repr(start)))
    r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert r.returncode == 2, r.stderr[-3000:]
    assert "trained" not in r.stdout
    assert r.stderr.splitlines() == [f"error: {MAIN_GUARD}"]
