"""The examples and docs/OWN_LOOP.md's "Bring your own loop" diff run as a user would run them: each
script in a fresh process, offline, to its end (exit status 0, its figures printed)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"


def _run(args: list[str], cwd: Path, timeout: int = 240) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def own_loop_diff() -> tuple[str, str]:
    """docs/OWN_LOOP.md's diff block as (the plain script, the script on distsgd)."""
    text = (ROOT / "docs" / "OWN_LOOP.md").read_text()
    block = re.search(r"## Bring your own loop.*?```diff\n(.*?)```", text, re.S)
    assert block, "docs/OWN_LOOP.md has no diff block under 'Bring your own loop'"
    old, new = [], []
    for line in block.group(1).splitlines():
        mark, rest = (line[:1], line[1:]) if line else (" ", "")
        if mark in " -":
            old.append(rest)
        if mark in " +":
            new.append(rest)
        assert mark in " -+", line
    return "\n".join(old) + "\n", "\n".join(new) + "\n"


@pytest.mark.slow
def test_the_own_loop_diff_is_a_plain_loop_and_the_same_loop_on_distsgd(tmp_path: Path) -> None:
    old, new = own_loop_diff()
    (tmp_path / "plain.py").write_text(old)
    (tmp_path / "on_distsgd.py").write_text(new)
    for script in ("plain.py", "on_distsgd.py"):
        res = _run([sys.executable, script], tmp_path)
        assert res.returncode == 0, f"{script}: {res.stderr[-3000:]}"
    assert "spawn" in new and "spawn" not in old


@pytest.mark.slow
def test_plain_loop_example() -> None:
    res = _run([sys.executable, str(EXAMPLES / "plain_loop.py"), "--algo", "local-sgd"], ROOT)
    assert res.returncode == 0, res.stderr[-3000:]
    accuracy = float(re.search(r"test accuracy ([0-9.]+)", res.stdout).group(1))
    assert accuracy > 0.7, res.stdout


@pytest.mark.slow
def test_plain_loop_example_under_torchrun(tmp_path: Path) -> None:
    out = tmp_path / "run"
    res = _run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            "2",
            str(EXAMPLES / "plain_loop.py"),
            "--out",
            str(out),
        ],
        ROOT,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    assert (out / "summary.json").is_file() and (out / "model.pt").is_file()
    assert res.stdout.count("test accuracy") == 1  # rank 0 reports
    # the loop's own last evaluation and evaluate=final_figures's measure the one model: one point
    # (on ad05a87 two alike at the run's last samples)
    evals = [(e["samples"], e["test_accuracy"]) for e in json.loads((out / "summary.json").read_text())["evals"]]
    assert len(evals) == len(set(evals)), evals


@pytest.mark.slow
def test_mnist_hogwild_example() -> None:
    """pytorch/examples' script as converted (examples/mnist_hogwild/), one epoch of its Hogwild!
    run: each process prints its own progress, as the original's did, and the test it ends with
    measures the model it passed to distsgd.spawn, trained in place."""
    res = _run([sys.executable, str(EXAMPLES / "mnist_hogwild" / "main.py"), "--epochs", "1"], ROOT)
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stdout.count("Train Epoch") >= 4
    correct = int(re.search(r"Accuracy: ([0-9]+)/10000", res.stdout).group(1))
    assert correct > 6000, res.stdout  # 10 classes; about 7,800 after one epoch


@pytest.mark.slow
@pytest.mark.parametrize("algo", ["allreduce", "hogwild"])
def test_two_optimizers_example(algo: str) -> None:
    """Two optimisers from functions, a schedule, accumulation and clipping: trained under a process
    group and under Hogwild!'s shared model (about 0.80 and 0.82)."""
    res = _run([sys.executable, str(EXAMPLES / "two_optimizers.py"), "--algo", algo], ROOT)
    assert res.returncode == 0, res.stderr[-3000:]
    accuracy = float(re.search(rf"{algo}: test accuracy ([0-9.]+)", res.stdout).group(1))
    assert accuracy > 0.7, res.stdout  # 10 classes


@pytest.mark.slow
def test_two_optimizers_example_is_refused_by_the_parameter_server_in_words() -> None:
    res = _run([sys.executable, str(EXAMPLES / "two_optimizers.py"), "--algo", "asgd"], ROOT)
    assert res.returncode == 1 and res.stderr.count("\n") == 1, res.stderr[-3000:]  # (on 1073da1, 27 lines)
    assert "put the parameters of the other 1 optimiser(s) in parameter groups" in res.stderr, res.stderr[-3000:]


@pytest.mark.slow
def test_siamese_asgd_example() -> None:
    res = _run([sys.executable, str(EXAMPLES / "siamese_asgd.py")], ROOT)
    assert res.returncode == 0, res.stderr[-3000:]
    server = float(re.search(r"pair accuracy ([0-9.]+) ", res.stdout).group(1))
    assert server > 0.75, res.stdout  # half the pairs are "same": chance is 0.5


@pytest.mark.slow
def test_hf_diloco_example() -> None:
    pytest.importorskip("transformers", reason="examples/hf_diloco.py needs transformers: pip install 'distsgd[hf]'")
    res = _run([sys.executable, str(EXAMPLES / "hf_diloco.py")], ROOT)
    assert res.returncode == 0, res.stderr[-3000:]
    loss = float(re.search(r"diloco: test loss ([0-9.]+) nats", res.stdout).group(1))
    assert loss < 2.9, res.stdout  # below a guess from the bytes' frequencies (about 2.9), far below ln 256


@pytest.mark.gpu
@pytest.mark.parametrize("algo", ["allreduce", "hogwild", "asgd", "diloco"])
def test_plain_loop_example_on_a_gpu(algo: str) -> None:
    """The example as shipped, on a GPU machine (``--device auto`` picks CUDA): its own test
    tensors reach the CUDA model through run.to_device, and the final figures come from
    spawn(evaluate=...) under every algorithm (before: a device mismatch under allreduce, a None
    accuracy under hogwild)."""
    res = _run([sys.executable, str(EXAMPLES / "plain_loop.py"), "--algo", algo], ROOT)
    assert res.returncode == 0, res.stderr[-2000:]
    assert re.search(rf"{algo}: test accuracy 0\.[5-9]", res.stdout), res.stdout
    assert "Traceback" not in res.stderr, res.stderr[-2000:]


@pytest.mark.gpu
@pytest.mark.parametrize("algo", ["hogwild", "allreduce"])
def test_mnist_hogwild_example_with_cuda(algo: str) -> None:
    """The converted script's own --cuda: its model on the GPU, distsgd trains it there (the
    model's device), its CUDA DataLoader options (a loader process, pinned memory) taken by
    run.loader, and its test on the model trained in place."""
    script = [sys.executable, str(EXAMPLES / "mnist_hogwild" / "main.py"), "--cuda", "--epochs", "1", "--algo", algo]
    res = _run(script, ROOT)
    assert res.returncode == 0, res.stderr[-2000:]
    correct = int(re.search(r"Accuracy: ([0-9]+)/10000", res.stdout).group(1))
    assert correct > 6000, res.stdout
    assert "Traceback" not in res.stderr, res.stderr[-2000:]
