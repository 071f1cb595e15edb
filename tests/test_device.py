"""Devices, precision and compilation (--device, --precision, --compile).

On CPU (CI): cpu, bf16 and torch.compile train, record where they ran, and a CUDA request on a
machine without CUDA is one error line. The tests marked ``gpu`` run on a machine with a GPU
(``python -m pytest -m gpu``) and are skipped elsewhere: every algorithm on CUDA workers,
reported = saved, Hogwild! through CUDA IPC, NCCL when each worker has a GPU, fp16 with loss
scaling, workers that start though the caller used CUDA, model.pt loading without a GPU.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import distsgd
from distsgd.errors import ConfigError
from distsgd.train import device as train_device
from helpers import run_cli

pytest.importorskip("sklearn")


@pytest.mark.slow
def test_cpu_and_bf16_train_and_say_where(tmp_path: Path) -> None:
    base = dict(model="mlp", data="digits", epochs=3, lr=0.05, quiet=True)
    fp32 = distsgd.train(device="cpu", **base).summary
    bf16 = distsgd.train(device="cpu", precision="bf16", out=str(tmp_path / "bf16"), **base).summary
    for s in (fp32, bf16):
        assert s["device"] == "cpu" and s["final_test_accuracy"] > 0.8, s
    assert fp32["precision"] == "fp32" and bf16["precision"] == "bf16"
    assert (
        bf16["final_test_accuracy"] != fp32["final_test_accuracy"] or bf16["final_test_loss"] != fp32["final_test_loss"]
    )
    # the saved model is float32 and scores what was reported (evaluations run in float32: they
    # had run under bf16 autocast, and distsgd eval of model.pt gave another number)
    state = torch.load(tmp_path / "bf16" / "model.pt", weights_only=True)["state_dict"]
    assert all(v.dtype in (torch.float32, torch.int64) for v in state.values())
    from distsgd.api import evaluate_checkpoint

    saved = evaluate_checkpoint(tmp_path / "bf16" / "model.pt")
    assert bf16["final_test_accuracy"] == pytest.approx(saved["test_accuracy"], abs=1e-6)
    assert bf16["final_test_loss"] == pytest.approx(saved["test_loss"], rel=1e-6)


@pytest.mark.parametrize("algo, workers", [("allreduce", 2), ("hogwild", 2), ("asgd", 2), ("diloco", 2)])
def test_bf16_under_every_topology(algo: str, workers: int) -> None:
    s = distsgd.train(
        model="mlp",
        data="digits",
        algo=algo,
        workers=workers,
        epochs=2,
        lr=0.05 if algo != "diloco" else 0.003,
        precision="bf16",
        quiet=True,
    ).summary
    assert s["precision"] == "bf16" and s["final_test_accuracy"] > 0.5, s


@pytest.mark.parametrize("algo", ["hogwild", "hogwild++"])
def test_shared_memory_results_say_where_their_workers_trained(monkeypatch: pytest.MonkeyPatch, algo: str) -> None:
    """summary.json's device, precision and gpu come from the workers' own record of where they
    trained: the shared-memory launcher only holds the models (on a GPU it would otherwise say cpu)."""
    from distsgd import results

    seen: list[list] = []
    where = results._where
    monkeypatch.setattr(
        results, "_where", lambda results, cfg: seen.append([r.where for r in results]) or where(results, cfg)
    )
    s = distsgd.train(model="mlp", data="digits", algo=algo, workers=2, epochs=1, precision="bf16", quiet=True).summary
    assert seen[0] == [{"device": "cpu", "precision": "bf16"}] * 2, seen
    assert s["device"] == "cpu" and s["precision"] == "bf16"


class SeesFloat32(torch.nn.Module):
    """Logistic regression that fails unless it computes in IEEE float32: cuDNN's convolutions run
    in TF32 unless told otherwise, which on a GPU would make --precision fp32 something else."""

    def __init__(self, num_classes: int) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(64, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        precision = (torch.backends.cudnn.conv.fp32_precision, torch.backends.cuda.matmul.fp32_precision)
        assert precision == ("ieee", "ieee") or not x.any(), precision  # zeros: the launcher's shape probe
        return self.fc(x.flatten(1))


@pytest.mark.parametrize("algo, workers", [("single", 1), ("allreduce", 2), ("hogwild", 2)])
def test_fp32_is_ieee_float32_in_training_and_evaluation(algo: str, workers: int) -> None:
    before = torch.backends.cudnn.conv.fp32_precision
    s = distsgd.train(
        model=SeesFloat32, data="digits", algo=algo, workers=workers, epochs=1, lr=0.1, quiet=True
    ).summary
    assert s["final_test_accuracy"] > 0.5, s
    assert torch.backends.cudnn.conv.fp32_precision == before  # the caller's own setting (single ran here)


def test_a_copy_of_a_compiled_model_computes_with_its_own_weights() -> None:
    """An average or theta is a deep copy of the worker's model; compiled in place, the copy must
    call itself (torch's Module.compile bound the original's _call_impl, which a copy kept)."""
    import copy

    if not train_device.compiles():
        pytest.skip("torch.compile is disabled in this PyTorch")
    model = torch.nn.Linear(3, 2)
    train_device.compile_in_place(model)
    twin = copy.deepcopy(model)
    with torch.no_grad():
        twin.weight.zero_()
        twin.bias.fill_(1.0)
    x = torch.randn(4, 3)
    assert torch.equal(twin(x), torch.ones(4, 2))
    assert torch.allclose(model(x), x @ model.weight.T + model.bias)


def test_compile_compiles_before_the_clock_and_never_during_training(monkeypatch: pytest.MonkeyPatch) -> None:
    """torch.compile of the model (inductor: a C compiler builds its kernels), every graph the run
    needs made before the training clock starts: the full batch, the epoch's partial last one
    (1437 = 11 x 128 + 29), evaluation's (360 test images) in eval mode; none compiled after (the
    compile time counted in samples/s before: a GPU run's --compile went at 1.8k against 19.3k)."""
    from torch._dynamo.utils import counters

    from distsgd.train.own_loop import Run

    at_start: list[int] = []  # the graphs made when training starts (the start barrier, the clock)
    begin = Run._begin

    def noting(self: Run, earlier_s: float = 0.0) -> None:
        at_start.append(counters["stats"]["unique_graphs"])
        begin(self, earlier_s)

    monkeypatch.setattr(Run, "_begin", noting)
    s = distsgd.train(model="logreg", data="digits", epochs=2, batch_size=128, lr=0.1, compile=True, quiet=True).summary
    assert s["compile"] is True and s["final_test_accuracy"] > 0.5, s
    if not train_device.compiles():
        pytest.skip("torch.compile is disabled in this PyTorch (the run trained eagerly, as it said)")
    assert s["compile_s"] > 0 and at_start and at_start[0] > 0
    assert counters["stats"]["unique_graphs"] == at_start[0]


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
@pytest.mark.parametrize(
    "args, message",
    [
        (["--device", "cuda"], "--device cuda needs a CUDA GPU, and this machine has none"),
        (["--device", "cuda:1"], "--device cuda:1 needs a CUDA GPU"),
        (["--device", "tpu"], "--device must be auto, cpu, cuda or cuda:N"),
        (["--precision", "fp16"], "--precision fp16 needs a GPU"),
        (["--precision", "fp8"], "--precision must be one of fp32, bf16, fp16"),
    ],
)
@pytest.mark.slow
def test_impossible_devices_are_one_error_line(tmp_path: Path, args: list[str], message: str) -> None:
    res = run_cli("train", "--dataset", "digits", "--model", "mlp", "--out", str(tmp_path / "r"), *args)
    assert res.returncode == 2
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: {message}"), res.stderr


def test_nccl_is_refused_for_workers_that_would_share_a_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """NCCL takes one rank per GPU: on a one-GPU machine two nccl workers fail inside NCCL
    ("duplicate GPU"), so the plan refuses them in one line (``auto`` picks gloo there)."""
    import torch.distributed as dist

    from distsgd.config import RunConfig
    from distsgd.launch import group
    from distsgd.train import device

    monkeypatch.setattr(device, "cuda_count", lambda: 1)  # a machine with one GPU
    monkeypatch.setattr(dist, "is_nccl_available", lambda: True)
    cfg = RunConfig(algo="allreduce", workers=2, device="cuda", backend="nccl")
    with pytest.raises(ConfigError, match="--backend nccl needs a GPU for each worker of a machine: 2 workers, 1 GPU"):
        group.plan(cfg, None, False)
    with pytest.raises(ConfigError, match="--backend nccl needs the workers on GPUs"):
        group.plan(cfg.replace(workers=1, device="cpu"), None, False)
    assert group.plan(cfg.replace(workers=1), None, False).backend == "nccl"
    assert group.plan(cfg.replace(backend="auto"), None, False).backend == "gloo"


def test_a_checkpoint_from_a_machine_with_more_gpus_resumes(monkeypatch: pytest.MonkeyPatch) -> None:
    """A worker's random state holds its own GPU's generator: saved by the worker on GPU 3 of 4, it
    loads on a machine with one GPU (into that GPU's), where one state per GPU of the saving machine
    could not. (torch.cuda stood in for: set_rng_state_all sets GPU i to the i-th state, as torch does.)"""
    from distsgd.checkpoint import RngState

    gpus = {"count": 4, "current": 3}
    generators = [torch.tensor([i], dtype=torch.uint8) for i in range(4)]
    set_on: list[tuple[int, int]] = []

    def set_rng_state(state: torch.Tensor, device: int | str = "cuda") -> None:
        index = gpus["current"] if device == "cuda" else int(device)
        if index >= gpus["count"]:
            raise RuntimeError("CUDA error: invalid device ordinal")
        set_on.append((index, int(state[0])))

    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus["count"])
    monkeypatch.setattr(torch.cuda, "get_rng_state", lambda device="cuda": generators[gpus["current"]])
    monkeypatch.setattr(torch.cuda, "get_rng_state_all", lambda: generators[: gpus["count"]])
    monkeypatch.setattr(torch.cuda, "set_rng_state", set_rng_state)
    monkeypatch.setattr(
        torch.cuda, "set_rng_state_all", lambda states: [set_rng_state(s, i) for i, s in enumerate(states)]
    )
    saved = RngState().state_dict()
    gpus.update(count=1, current=0)
    RngState().load_state_dict(saved)
    assert set_on == [(0, 3)]


def test_the_launcher_counts_gpus_without_initialising_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    """The launching process counts GPUs through NVML: asking the CUDA runtime
    (torch.cuda.is_available) initialises the CUDA driver, after which a process that forks cannot
    use CUDA in the child. (torch's NVML count and its CUDA one stood in for, on this CPU build.)"""
    from distsgd.train import device

    def cuda_runtime() -> int:
        raise AssertionError("the CUDA runtime was asked: cuInit ran in the launching process")

    monkeypatch.setattr(torch.cuda, "_is_compiled", lambda: True)
    monkeypatch.setattr(torch.cuda, "_device_count_nvml", lambda: 2)
    monkeypatch.setattr(torch._C, "_cuda_getDeviceCount", cuda_runtime, raising=False)
    assert device.cuda_count() == 2


def _mark() -> str | None:
    return os.environ.get("DISTSGD_TEST_MARK")


class _EnvironmentWhenUnpickled:
    """Unpickles as what DISTSGD_TEST_MARK is in the unpickling process, then (as a CUDA IPC tensor
    initialises CUDA with the CUDA_VISIBLE_DEVICES of that moment)."""

    def __reduce__(self) -> tuple:
        return _mark, ()


def _say(value: object, out: object) -> None:
    from distsgd.launch import procs

    procs.Outbox(out).put(("result", 0, value))


def test_workers_unpickle_their_arguments_in_the_launchers_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """The fork server keeps the environment it started with; a worker takes the launcher's before
    its arguments are unpickled, so CUDA tensors among them meet the launcher's CUDA_VISIBLE_DEVICES."""
    from distsgd.config import RunConfig
    from distsgd.launch import procs

    procs.mp_context()  # the fork server runs, with the environment of now
    monkeypatch.setenv("DISTSGD_TEST_MARK", "set after the fork server started")
    with procs.spawned(
        RunConfig(), _say, [("worker", 0)], lambda i, out, again: (_EnvironmentWhenUnpickled(), out)
    ) as team:
        sup = procs.Supervisor(team.procs, team.inbox, lambda event: None)
        sup.drain_until(lambda: bool(sup.results or sup.failed()), 60)
    assert sup.results == {0: "set after the fork server started"}, sup.said


def test_auto_is_the_cpu_without_cuda() -> None:
    from distsgd.train import device

    if torch.cuda.is_available():
        assert device.resolve("auto", 3).type == "cuda"
    else:
        assert device.resolve("auto", 3) == torch.device("cpu") and device.kind("auto") == "cpu"
    with pytest.raises(ConfigError):
        device.check("auto", "fp4")


# -- on a GPU ------------------------------------------------------------------------------------

EVERY = [
    *"single allreduce ddp hogwild hogwild++ asgd sync-ps ssp dcasgd local-sgd easgd diloco streaming-diloco".split(),
]


@pytest.mark.gpu
@pytest.mark.parametrize("algo", EVERY)
def test_every_algorithm_trains_on_cuda_workers(tmp_path: Path, algo: str) -> None:
    from distsgd.api import evaluate_checkpoint

    workers = 1 if algo == "single" else 2
    extra = {"sync_every": "5"} if algo in ("local-sgd", "diloco", "streaming-diloco") else {}
    if algo == "streaming-diloco":
        extra.update(fragments=2, overlap=1)
    run = tmp_path / "run"
    s = distsgd.train(
        model="resnet20",
        data="digits",
        algo=algo,
        workers=workers,
        epochs=2,
        batch_size=32,
        lr=0.003 if "diloco" in algo else 0.05,
        device="cuda",
        out=str(run),
        quiet=True,
        **extra,
    ).summary
    assert s["device"].startswith("cuda") and s["gpu"], s
    assert s["final_test_accuracy"] > 0.3, s
    saved = evaluate_checkpoint(run / "model.pt")  # loads on the CPU
    assert s["final_test_accuracy"] == pytest.approx(saved["test_accuracy"], abs=2e-3)  # CPU vs GPU kernels


@pytest.mark.gpu
@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_mixed_precision_on_a_gpu(precision: str) -> None:
    s = distsgd.train(
        model="resnet20",
        data="digits",
        algo="allreduce",
        workers=2,
        epochs=2,
        batch_size=64,
        lr=0.05,
        device="cuda",
        precision=precision,
        quiet=True,
    ).summary
    assert s["precision"] == precision and s["final_test_accuracy"] > 0.5, s


@pytest.mark.gpu
@pytest.mark.parametrize("algo", ["allreduce", "hogwild", "diloco"])
def test_a_language_model_on_a_gpu_in_bf16(tmp_path: Path, algo: str) -> None:
    """The GPT on byte tokens, CUDA workers under bf16 autocast: the per-token loss in float32."""
    import math

    from distsgd.data import text

    corpus = tmp_path / "c.txt"
    corpus.write_bytes(text.stdlib_text(1 << 16))
    s = distsgd.train(
        model="gpt[layers=2,heads=2,width=64]",
        data=f"text:{corpus}",
        algo=algo,
        workers=2,
        context=64,
        batch_size=16,
        max_samples=1024,
        lr=0.003,
        lr_warmup_steps=4,
        device="cuda",
        precision="bf16",
        quiet=True,
        **({"sync_every": "8"} if algo == "diloco" else {}),
    ).summary
    assert s["device"].startswith("cuda") and s["task"] == "lm", s
    assert s["final_test_loss"] < math.log(256) - 1.0, s


@pytest.mark.gpu
def test_fp16_is_refused_for_a_parameter_server() -> None:
    with pytest.raises(ConfigError, match="use --precision bf16"):
        distsgd.train(model="mlp", data="digits", algo="asgd", workers=2, device="cuda", precision="fp16", quiet=True)


@pytest.mark.gpu
def test_nccl_when_every_worker_has_its_gpu() -> None:
    gpus = torch.cuda.device_count()
    s = distsgd.train(
        model="mlp", data="digits", algo="allreduce", workers=2, epochs=1, device="cuda", quiet=True
    ).summary
    assert s["backend"] == ("nccl" if gpus >= 2 else "gloo"), (gpus, s["backend"])


@pytest.mark.gpu
def test_hogwild_shares_one_model_in_gpu_memory() -> None:
    s = distsgd.train(
        model="mlp", data="digits", algo="hogwild", workers=2, epochs=3, lr=0.05, device="cuda", quiet=True
    ).summary
    assert s["model_shared"] is True  # CUDA tensors travel by CUDA IPC: is_shared() is True for them
    assert s["final_test_accuracy"] > 0.8 and sum(s["samples_per_worker"]) == s["samples"]


@pytest.mark.gpu
def test_workers_start_even_when_the_caller_used_cuda(tmp_path: Path) -> None:
    """A process that forks after CUDA is initialised cannot use CUDA in the child. Workers come
    from the fork server, which never touched CUDA, so a caller's own CUDA use does not matter."""
    script = tmp_path / "caller.py"
    script.write_text("""
import torch, distsgd
if __name__ == "__main__":
    torch.zeros(1, device="cuda")  # the caller's process has a CUDA context
    for algo in ("allreduce", "asgd", "hogwild"):
        s = distsgd.train(model="mlp", data="digits", algo=algo, workers=2, epochs=1, device="cuda", quiet=True).summary
        assert s["device"].startswith("cuda"), s
        print(algo, s["final_test_accuracy"])
""")
    res = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    assert len(res.stdout.splitlines()) == 3


@pytest.mark.gpu
def test_a_gpu_checkpoint_resumes_and_model_pt_loads_on_the_cpu(tmp_path: Path) -> None:
    common = dict(
        model="mlp",
        data="digits",
        algo="allreduce",
        workers=2,
        lr=0.05,
        device="cuda",
        quiet=True,
        checkpoint_every="epoch",
    )
    full = distsgd.train(epochs=2, out=str(tmp_path / "full"), **common)
    distsgd.train(epochs=1, out=str(tmp_path / "part"), **common)
    resumed = distsgd.train(resume=str(tmp_path / "part"), epochs=2)
    assert resumed.summary["final_test_loss"] == pytest.approx(full.summary["final_test_loss"], rel=1e-5)
    state = torch.load(tmp_path / "full" / "model.pt", map_location="cpu", weights_only=True)["state_dict"]
    assert all(v.device.type == "cpu" for v in state.values())
    summary = json.loads((tmp_path / "full" / "summary.json").read_text())
    assert summary["cuda_version"] == torch.version.cuda


@pytest.mark.slow
def test_a_workers_compile_workers_end_before_it_does() -> None:
    """The first GPU run's teardown errors: a ddp or asgd worker with --compile left inductor's
    sidecar (``compile_worker/__main__.py --parent=PID``) behind it. A worker ends with os._exit,
    past inductor's atexit hook; torch 2.11 (the GPU machine's) had no other (pytorch#185070 added a
    multiprocessing finalizer, in this CPU build's torch: cancelled here, as 2.11 has none), and the
    sidecar then waits for the end of its pipe, which a child the worker forked holds too (here for
    2 s). The worker shuts its compile workers down itself: the sidecar is gone when it is."""
    code = """
import multiprocessing as mp, multiprocessing.util as util, os, pickle, time
os.environ["TORCHINDUCTOR_COMPILE_THREADS"] = "2"  # a pool, whatever the cores
from distsgd.launch import procs
ctx = mp.get_context("fork")
said = ctx.Queue()
def compiles():
    from torch._inductor.async_compile import AsyncCompile
    pool = AsyncCompile.process_pool()
    assert pool.submit(int, "7").result(timeout=120) == 7  # the sidecar is up and has worked
    for f in list(util._finalizer_registry.values()):  # torch before pytorch#185070 had none
        if getattr(f, "_callback", None) == pool.shutdown:
            f.cancel()
    if os.fork() == 0:  # a child of the worker's (a loader's), which holds the sidecar's pipe a while
        time.sleep(2)
        os._exit(0)
    said.put(pool.process.pid)
if __name__ == "__main__":
    worker = ctx.Process(target=procs._bootstrap, args=(dict(os.environ), compiles, procs._Later(None, pickle.dumps(()))))
    worker.start()
    sidecar = said.get(timeout=120)
    worker.join(120)
    try:
        os.kill(sidecar, 0)
        print("exit", worker.exitcode, "the sidecar outlived its worker")
    except ProcessLookupError:
        print("exit", worker.exitcode, "the sidecar ended first")
"""
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=240)
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stdout.strip() == "exit 0 the sidecar ended first", res.stdout + res.stderr[-2000:]


def test_a_sigterm_landing_as_a_worker_leaves_prints_no_traceback() -> None:
    """The launcher stops a worker whose result is in with SIGTERM; on a GPU its exit is slow
    (CUDA, NCCL), and the signal often landed in ``_bootstrap``'s last line: 'Process
    distsgd-worker-0: Traceback ... raise Terminated()' after a run that had succeeded (8 in the
    first GPU run's tests). Made certain here: the handler's exception is raised where the signal
    lands, the moment the worker sets SIGTERM back to its default."""
    code = """
import os, pickle, signal
from distsgd.errors import Terminated
from distsgd.launch import procs
real = signal.signal
def landing(sig, handler):
    if sig == signal.SIGTERM and handler == signal.SIG_DFL and not landing.done:
        landing.done = True
        real(signal.SIGTERM, signal.SIG_IGN)  # what the handler does before it raises
        raise Terminated()
    return real(sig, handler)
landing.done = False
signal.signal = landing
procs._bootstrap(dict(os.environ), lambda: None, procs._Later(None, pickle.dumps(())))
print("left cleanly", landing.done, real(signal.SIGTERM, signal.SIG_DFL) == signal.SIG_DFL)
"""
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0 and "Traceback" not in res.stderr, res.stderr
    assert res.stdout.strip() == "left cleanly True True"


def test_a_sigterm_landing_as_the_workers_last_call_begins_prints_no_traceback() -> None:
    """The second GPU run's form of it (every allreduce, DiLoCo and hogwild example there):
    the launcher's SIGTERM arrived while the worker's body was being torn down in C++ (CUDA's
    frees), and Python ran its handler at the next call, the one into ``_stop_just_ends_it``:
    ``procs.py line 307, in _bootstrap: _stop_just_ends_it()``, ``line 310 ... def
    _stop_just_ends_it()``, ``raise Terminated``. Made certain here with a real SIGTERM, sent by
    the worker to itself as that call begins."""
    code = """
import os, pickle, signal
from distsgd.launch import procs
procs._exit_with_launcher = lambda: None  # no launcher to watch: this is the process's own main
real = procs._stop_just_ends_it
def landing():
    os.kill(os.getpid(), signal.SIGTERM)  # the handler raises Terminated here, as the call begins
    real()
procs._stop_just_ends_it = landing
procs._bootstrap(dict(os.environ), lambda: None, procs._Later(None, pickle.dumps(())))
print("left cleanly", signal.getsignal(signal.SIGTERM) == signal.SIG_DFL)
"""
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0 and "Traceback" not in res.stderr, res.stderr
    assert res.stdout.strip() == "left cleanly True"


class _Dtypes(torch.nn.Module):
    """A linear layer whose output dtype, in training, is noted in SEEN (a compiled forward's side
    effect, replayed by dynamo)."""

    def __init__(self, num_classes: int, input_shape: tuple) -> None:
        super().__init__()
        self.flat = torch.nn.Flatten()
        self.linear = torch.nn.Linear(math.prod(input_shape), num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.linear(self.flat(x))
        if self.training:
            SEEN.append(out.dtype)
        return out


SEEN: list[torch.dtype] = []


@pytest.mark.slow
def test_bf16_with_compile_computes_in_bf16_and_returns_float32() -> None:
    """On 8f65d93 --precision bf16 with --compile failed at the first step ("'autocast' object has no
    attribute 'prev'": autocast was entered in a forward pre-hook and left in a forward hook, which
    dynamo traced). Now the compiled call runs under autocast from outside: the layer computes in
    bf16, the loss sees float32, as eagerly."""
    if not train_device.compiles():
        pytest.skip("torch.compile is disabled in this PyTorch")
    SEEN.clear()
    s = distsgd.train(
        model=_Dtypes,
        data="digits",
        max_samples=1024,
        batch_size=128,
        lr=0.1,
        precision="bf16",
        compile=True,
        quiet=True,
    ).summary
    assert s["compile"] is True and s["final_test_accuracy"] > 0.3, s
    assert SEEN and set(SEEN) == {torch.bfloat16}, SEEN
