"""What only a GPU can show of the GPU path: algorithm state resumed on CUDA, locks that wait for
the device, loss scaling with a float16 wire, NCCL's own checks, float32 that is float32, copies
between host and device, and torch.compile on CUDA workers. Every test here is marked ``gpu``:
skipped without CUDA, run with ``python -m pytest -m gpu`` (tests/test_device.py has the others).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import distsgd
from distsgd.checkpoint import load_worker_state
from helpers import run_cli

pytest.importorskip("sklearn")

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize(
    "algo, extra",
    [
        ("allreduce", {"compress": "powersgd"}),
        ("local-sgd", {"compress": "powersgd", "sync_every": "4"}),
        ("streaming-diloco", {"sync_every": "8", "fragments": 2, "overlap": 2, "lr": 0.003}),
    ],
)
def test_algorithm_state_resumes_on_a_gpu(tmp_path: Path, algo: str, extra: dict) -> None:
    """A checkpoint loads on the CPU; PowerSGD's error feedback and Q, local SGD's anchor and a
    Streaming DiLoCo fragment in flight must go back to the GPU. The checkpoint resumed from holds
    them (checkpoints every 3 steps of 2 x 16: the one at step 18 has fragment 0 in flight)."""
    common = dict(
        model="mlp",
        data="digits",
        algo=algo,
        workers=2,
        batch_size=16,
        lr=0.05,
        device="cuda",
        checkpoint_every="96",
        quiet=True,
    )
    common.update(extra)
    full = distsgd.train(max_samples=1440, out=str(tmp_path / "full"), **common)
    distsgd.train(max_samples=600, out=str(tmp_path / "part"), **common)
    state = load_worker_state(tmp_path / "part", 0)["algo"]
    assert state["flight"] is not None if algo == "streaming-diloco" else state["compressor"]["error"] is not None
    resumed = distsgd.train(resume=str(tmp_path / "part"), max_samples=1440)
    assert resumed.summary["device"].startswith("cuda")
    assert resumed.summary["final_test_loss"] == pytest.approx(full.summary["final_test_loss"], rel=1e-5)


def _idle() -> bool:
    """Whether every kernel this process queued on its GPU has run."""
    return torch.cuda.current_stream().query()


class _Probe:
    """A lock that notes, each time it is released, whether the holder's GPU work was done."""

    def __init__(self) -> None:
        self.idle: list[bool] = []

    def acquire(self, block: bool = True) -> bool:
        return True

    def release(self) -> None:
        self.idle.append(_idle())

    def __enter__(self) -> "_Probe":
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def _big_model(where: torch.device) -> torch.nn.Module:
    """64M parameters: a step of Adam on them takes the GPU a while after step() has returned."""
    return torch.nn.Sequential(*[torch.nn.Linear(4096, 4096) for _ in range(4)]).to(where)


def _shared_seat(models: list[torch.nn.Module], lock: object, extras: object = None) -> object:
    from distsgd.algorithms.base import SharedSeat

    return SharedSeat(
        states=[m.state_dict() for m in models],
        counts=torch.zeros(len(models), dtype=torch.int64),
        stop=torch.zeros(1, dtype=torch.int8),
        lock=lock,
        extras=extras,
        device=str(next(models[0].parameters()).device),
    )


def test_the_hogwild_lock_is_held_until_the_gpu_has_stepped() -> None:
    """--hogwild-lock excludes the other workers' updates only if this one's is done on the device
    when the lock is released (optimizer.step() queues the kernels and returns)."""
    from types import SimpleNamespace

    from distsgd.algorithms.hogwild import Hogwild
    from distsgd.config import RunConfig
    from distsgd.train.context import Start, Step

    where = torch.device("cuda", torch.cuda.current_device())
    model, probe = _big_model(where), _Probe()
    algo = Hogwild(RunConfig(algo="hogwild", workers=1, options={"hogwild_lock": True}), _shared_seat([model], probe))
    ctx = SimpleNamespace(device=where, rank=0, dataset=SimpleNamespace(is_shared=lambda: True))
    model = algo.setup(ctx, model, Start.FRESH)
    optimizer = torch.optim.Adam(model.parameters())
    for number in range(1, 6):
        for p in model.parameters():
            p.grad = torch.randn_like(p)
        algo.apply_step(ctx, optimizer, Step(number=number, samples=number))
    assert probe.idle == [True] * 5


def test_a_hogwildpp_exchange_is_done_on_the_gpu_before_the_ring_lock_is_released() -> None:
    """The token holder's exchange adds to its model and the next cluster's; the next cluster's own
    exchange must not read them before those kernels have run."""
    from types import SimpleNamespace

    from distsgd.algorithms.hogwildpp import HogwildPP, Ring
    from distsgd.config import RunConfig
    from distsgd.train.context import Start

    where = torch.device("cuda", torch.cuda.current_device())
    cfg = RunConfig(algo="hogwild++", workers=2, options={"cluster_size": 1})
    models = [_big_model(where) for _ in range(2)]
    ring = Ring().extras(cfg, None, models)
    algo = HogwildPP(cfg, _shared_seat(models, None, ring))
    ctx = SimpleNamespace(device=where, rank=0, dataset=SimpleNamespace(is_shared=lambda: True))
    model = algo.setup(ctx, _big_model(where), Start.FRESH)
    for _ in range(3):
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p))  # a local update since the last exchange
        algo._exchange()
        assert _idle()


def test_nccl_runs_say_nothing_on_stderr(tmp_path: Path) -> None:
    """Its group is bound to each worker's GPU (init_process_group's device_id), so NCCL neither
    guesses the barrier's device nor warns that it does; without --quiet, stderr holds the progress
    lines alone."""
    workers = min(2, torch.cuda.device_count())
    res = run_cli(
        *"train --dataset digits --model mlp --algo allreduce --workers".split(),
        str(workers),
        *"--device cuda --backend nccl --epochs 1 --out".split(),
        str(tmp_path / "r"),
        timeout=300,
    )
    assert res.returncode == 0, res.stderr[-2000:]
    others = [line for line in res.stderr.splitlines() if not line.startswith(("train ", "eval "))]
    assert others == [], res.stderr[-2000:]


@pytest.mark.parametrize("algo", ["hogwild", "asgd", "allreduce"])
def test_a_gpu_run_ends_with_nothing_on_stderr_but_its_progress(tmp_path: Path, algo: str) -> None:
    """No worker traceback at the end (the launcher's SIGTERM landing as a worker left), and under
    Hogwild! no "Producer process has been terminated before all shared CUDA tensors released"
    (workers gave back the models and data lent through CUDA IPC before ending)."""
    res = run_cli(
        *("train", "--dataset", "digits", "--model", "mlp", "--algo", algo, "--workers", "2"),
        *("--device", "cuda", "--epochs", "2", "--out", str(tmp_path / "r")),
        timeout=300,
    )
    assert res.returncode == 0, res.stderr[-2000:]
    others = [line for line in res.stderr.splitlines() if not line.startswith(("train ", "eval "))]
    assert others == [], res.stderr[-2000:]


def test_nccl_with_two_workers_on_one_gpu_is_one_error_line(tmp_path: Path) -> None:
    workers = torch.cuda.device_count() + 1
    res = run_cli(
        *"train --dataset digits --model mlp --algo allreduce --workers".split(),
        str(workers),
        "--device",
        "cuda",
        "--backend",
        "nccl",
        "--out",
        str(tmp_path / "r"),
    )
    assert res.returncode == 2
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: --backend nccl needs a GPU for each worker"), res.stderr


def test_fp32_on_a_gpu_scores_what_the_cpu_scores(tmp_path: Path) -> None:
    """--precision fp32 is IEEE float32 on the GPU (cuDNN would run resnet20's convolutions in
    TF32, 10 bits of mantissa): the reported loss is the CPU's evaluation of model.pt to float32
    rounding, not to TF32's 1e-3."""
    from distsgd.api import evaluate_checkpoint

    run = tmp_path / "run"
    s = distsgd.train(
        model="resnet20", data="digits", epochs=1, batch_size=64, lr=0.05, device="cuda", out=str(run), quiet=True
    ).summary
    saved = evaluate_checkpoint(run / "model.pt")  # on the CPU
    assert s["final_test_loss"] == pytest.approx(saved["test_loss"], rel=1e-4)
    assert s["final_test_accuracy"] == pytest.approx(saved["test_accuracy"], abs=1.01 / saved["test_samples"])


def test_a_cpu_model_evaluated_on_gpu_data_reads_each_batch_once_it_has_arrived() -> None:
    """A batch copied from the GPU to the host with non_blocking=True may be read before it has
    landed (PyTorch's pinned-memory tutorial); evaluate() must give what it gives with the data on
    the host. Batches of 60 MB: a copy the CPU would overtake."""
    from distsgd.data import from_arrays
    from distsgd.train.evaluate import evaluate

    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(20_000, 3, 32, 32, generator=g), torch.randint(0, 10, (20_000,), generator=g)
    data = from_arrays("arrays", x[:100], y[:100], x, y)
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(3 * 32 * 32, 10))
    assert evaluate(model, data.to(torch.device("cuda")), 5000) == evaluate(model, data, 5000)


class Wide(torch.nn.Module):
    """1.2 M parameters (4.7 MB) on 8x8 digits: a copy per evaluation point shows in GPU memory."""

    def __init__(self, num_classes: int) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(
            torch.nn.Flatten(), torch.nn.Linear(64, 16384), torch.nn.ReLU(), torch.nn.Linear(16384, num_classes)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


@pytest.mark.parametrize(
    "threads",
    [
        "off",
        pytest.param(
            "on",
            marks=pytest.mark.xfail(
                strict=True,
                reason="open: under threads, 278,021,120 bytes more at 29 points than at 1, the same to the "
                "byte in both runs of 2026-11-28 (H100): about one model per worker per point; cause not found "
                "(not on the CPU, where both ways grow alike: the launcher's copies, in host memory; "
                "benchmarks/gpu_memory.py, in gpu_check.sh, reads where on a GPU)",
            ),
        ),
    ],
)
def test_hogwild_keeps_no_gpu_copy_per_evaluation_point(threads: str) -> None:
    """The launcher copies the shared model at every --eval-every point and evaluates the copies
    after training: kept on the GPU, its memory would grow with the number of points. ``off``:
    the workers are processes, and this process's memory is the launcher's alone (the GPU run of
    2026-11-28 measured the default, threads on one GPU, whose workers' memory is this process's
    too: 808 MB with 1 point, 1,086 MB with about 29); ``on``: the same bound with the workers'
    memory in it."""
    model_bytes = sum(p.numel() * 4 for p in Wide(10).parameters())

    def peak(eval_every: int) -> int:
        torch.cuda.reset_peak_memory_stats()
        s = distsgd.train(
            model=Wide,
            data="digits",
            algo="hogwild",
            workers=2,
            epochs=1,
            lr=0.01,
            eval_every=eval_every,
            device="cuda",
            hogwild_threads=threads,
            quiet=True,
        ).summary
        assert s["device"].startswith("cuda") and s["hogwild_threads"] is (threads == "on"), s
        return torch.cuda.max_memory_allocated()

    few, many = peak(2000), peak(50)  # 1 evaluation against about 29
    assert many - few < 3 * model_bytes, (few, many, model_bytes)


def test_bf16_on_a_gpu_without_it_is_one_error_line(monkeypatch: pytest.MonkeyPatch) -> None:
    """A GPU without bfloat16 (autocast refuses it with a RuntimeError): each worker says so in one
    line before it trains (here `single`, in this process, on a GPU made to say it has none)."""
    from distsgd.errors import ConfigError

    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: False)
    with pytest.raises(ConfigError, match="does not support bfloat16; use --precision fp16 or fp32") as caught:
        distsgd.train(model="mlp", data="digits", epochs=1, device="cuda", precision="bf16", quiet=True)
    assert len(str(caught.value).splitlines()) == 1


@pytest.mark.parametrize("algo, workers", [("single", 1), ("allreduce", 2), ("hogwild", 2), ("asgd", 2)])
def test_the_model_returned_is_on_the_cpu_whatever_the_topology(algo: str, workers: int) -> None:
    result = distsgd.train(
        model="mlp", data="digits", algo=algo, workers=workers, epochs=1, lr=0.05, device="cuda", quiet=True
    )
    assert result.summary["device"].startswith("cuda")
    assert {t.device.type for t in result.model.state_dict().values()} == {"cpu"}


def test_a_parameter_server_worker_sends_its_gradient_off_the_gpu_in_one_copy() -> None:
    from torch.profiler import ProfilerActivity, profile

    from distsgd.algorithms.param_server.wire import Frame, Layout

    model = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(8)]).cuda()  # 16 tensors
    layout = Layout.of(model)
    frame = Frame(layout.request_bytes, pinned=True)
    grads = [torch.randn_like(p) for p in model.parameters()]
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        layout.params.pack(frame, grads)
    copies = [e.name for e in prof.events() if e.name.lower().startswith("memcpy dtoh")]
    assert len(copies) == 1, copies
    assert torch.equal(layout.params.whole(frame), torch.cat([g.reshape(-1) for g in grads]).cpu())


def test_augmentation_on_a_gpu_never_waits_for_it() -> None:
    """--augment on the tensor fast path: crops and flips on the device, with no synchronisation
    (a boolean mask's indexing asks the GPU how many it selected, and waits)."""
    from distsgd.data.augment import crop_flip

    x, fill = torch.randn(256, 3, 32, 32, device="cuda"), torch.zeros(1, 3, 1, 1, device="cuda")
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = crop_flip(x, fill)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert out.shape == x.shape


@pytest.mark.parametrize(
    "algo, workers, precision",
    [("single", 1, "fp32"), ("ddp", 2, "fp32"), ("hogwild", 2, "fp32"), ("asgd", 2, "fp32"), ("single", 1, "bf16")],
)
def test_compile_on_cuda_workers_saves_the_plain_model(tmp_path: Path, algo: str, workers: int, precision: str) -> None:
    """--compile compiles each worker's module in place: model.pt's keys are the model's own (no
    _orig_mod. or module. prefix), and it scores on the CPU what the run reported; with bf16 too
    (its autocast round the compiled call: 8f65d93 failed at the first step, on the CPU)."""
    from distsgd.api import evaluate_checkpoint

    run = tmp_path / "run"
    s = distsgd.train(
        model="mlp",
        data="digits",
        algo=algo,
        workers=workers,
        epochs=2,
        lr=0.05,
        device="cuda",
        compile=True,
        precision=precision,
        out=str(run),
        quiet=True,
    ).summary
    assert s["compile"] is True and s["device"].startswith("cuda") and s["final_test_accuracy"] > 0.5, s
    state = torch.load(run / "model.pt", weights_only=True)["state_dict"]
    assert set(state) == set(distsgd.models.build_model("mlp", (1, 8, 8), 10).state_dict()), sorted(state)
    saved = evaluate_checkpoint(run / "model.pt")
    assert s["final_test_accuracy"] == pytest.approx(saved["test_accuracy"], abs=1.01 / saved["test_samples"])
    # single, and Hogwild!'s threads on one GPU, compiled in this process: inductor's compile workers
    # are then this process's, kept warm by torch for its next compile and ended at its exit, not the
    # run's to end (ddp's and asgd's workers end their own before they do: the fixture checks that)
    from torch._inductor.async_compile import shutdown_compile_workers

    shutdown_compile_workers()


def test_fp16_with_a_float16_wire_keeps_a_sane_loss_scale(tmp_path: Path) -> None:
    """allreduce --compress fp16 casts the gradients to float16 while they are still loss-scaled,
    as torch's DDP with fp16_compress_hook and a GradScaler does: values past float16's 65504
    overflow to inf on every worker alike, every worker skips that step and the scaler halves its
    scale, so the scale settles where the scaled gradients fit the wire. It must stay near the
    scale without the wire and the run learn as well."""
    import json

    def run(compress: str) -> tuple[dict, list[float]]:
        out = tmp_path / compress
        s = distsgd.train(
            model="resnet20",
            data="digits",
            algo="allreduce",
            workers=2,
            epochs=3,
            batch_size=32,
            lr=0.05,
            device="cuda",
            precision="fp16",
            compress=compress,
            log_every=5,
            out=str(out),
            quiet=True,
        ).summary
        events = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        return s, [e["loss_scale"] for e in events if e["event"] == "progress"]

    plain, plain_scales = run("none")
    wired, wired_scales = run("fp16")
    assert wired_scales and min(wired_scales) >= 2.0**10, wired_scales
    assert min(wired_scales[len(wired_scales) // 2 :]) >= min(plain_scales) / 4, (wired_scales, plain_scales)
    assert wired["final_test_accuracy"] > plain["final_test_accuracy"] - 0.1, (wired, plain)


class Dropped(torch.nn.Module):
    """An MLP with dropout: a resumed run repeats an uninterrupted one only if its GPU's random
    state was saved and restored."""

    def __init__(self, num_classes: int) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(
            torch.nn.Flatten(),
            torch.nn.Linear(64, 64),
            torch.nn.ReLU(),
            torch.nn.Dropout(0.3),
            torch.nn.Linear(64, num_classes),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def test_a_gpu_workers_random_state_resumes_exactly(tmp_path: Path) -> None:
    """Each worker's checkpoint holds its own GPU's random state (dropout draws there), restored
    into the GPU it resumes on."""
    common = dict(
        model=Dropped,
        data="digits",
        algo="allreduce",
        workers=2,
        lr=0.05,
        device="cuda",
        checkpoint_every="epoch",
        quiet=True,
    )
    full = distsgd.train(epochs=2, out=str(tmp_path / "full"), **common)
    distsgd.train(epochs=1, out=str(tmp_path / "part"), **common)
    state = load_worker_state(tmp_path / "part", 1)["rng"]
    assert isinstance(state["cuda"], torch.Tensor)  # one generator's state: this worker's GPU
    resumed = distsgd.train(model=Dropped, resume=str(tmp_path / "part"), epochs=2)
    assert all(torch.equal(a, b) for a, b in zip(full.model.state_dict().values(), resumed.model.state_dict().values()))
