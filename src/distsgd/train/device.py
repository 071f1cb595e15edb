"""Where and how precisely a worker computes: ``--device``, ``--precision``, ``--compile``.

Devices are a parameter, never an assumption. The launching process asks how many GPUs there are
through NVML (:func:`cuda_count`: no CUDA context, and not even the CUDA driver, which would keep a
process that forks afterwards from using CUDA in the child). It creates a CUDA context only where it
computes itself: ``single`` trains in it, and the shared-memory launcher holds the models and the
data that its workers map through CUDA IPC, and evaluates them. Workers never inherit that: they
come from a fork server started by exec, which imports torch without touching CUDA, and unpickle
their arguments (CUDA IPC tensors initialise CUDA) only once the launcher's environment, with its
``CUDA_VISIBLE_DEVICES``, is theirs. Each worker picks its device from its index on its machine
(:func:`resolve`: worker i uses ``cuda:(i % visible GPUs)``) and creates everything there.

Precision: ``bf16`` runs the forward pass and the loss under ``torch.autocast`` with bfloat16 (CPU
and GPU; no loss scaling needed, its range is float32's); ``fp16`` under autocast with float16 and a
``GradScaler`` (GPU only: its loss scaling skips a step whose gradients overflowed). Parameters,
gradients, optimiser state and everything the algorithms send stay float32. float32 is IEEE float32
on a GPU too (:func:`float32_exact`: not the TF32 that cuDNN uses by default), so ``fp32`` means
what it says and a GPU's evaluation agrees with the CPU's to float32 rounding; bf16 is the fast path.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
from collections.abc import Iterator
from typing import Any, Callable

import torch

from distsgd.config import RunConfig, cores
from distsgd.errors import ConfigError

PRECISIONS = ("fp32", "bf16", "fp16")
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def cuda_count() -> int:
    """GPUs this process may use (0 without CUDA), as NVML counts them: ``torch.cuda.is_available``
    would ask the CUDA driver, initialising it (torch falls back to that only without NVML)."""
    try:
        return torch.cuda.device_count()
    except Exception:  # a broken driver counts as no GPU
        return 0


def kind(spec: str) -> str:
    """'cuda' or 'cpu': what ``--device spec`` means on this machine (``auto``: cuda if there is one)."""
    if spec == "auto":
        return "cuda" if cuda_count() else "cpu"
    return "cuda" if spec.startswith("cuda") else "cpu"


def check(device: str, precision: str) -> None:
    """One line for a device or precision this machine cannot give, before any process starts."""
    if device not in ("auto", "cpu", "cuda") and not (device.startswith("cuda:") and device[5:].isdigit()):
        raise ConfigError(f"--device must be auto, cpu, cuda or cuda:N, got '{device}'")
    if precision not in PRECISIONS:
        raise ConfigError(f"--precision must be one of {', '.join(PRECISIONS)}, got '{precision}'")
    count = cuda_count()
    if device.startswith("cuda") and count == 0:
        raise ConfigError(
            f"--device {device} needs a CUDA GPU, and this machine has none that torch can use "
            f"(torch {torch.__version__}, CUDA {torch.version.cuda or 'not built in'}); use --device cpu"
        )
    if device.startswith("cuda:") and int(device[5:]) >= count:
        raise ConfigError(f"--device {device}: this machine has {count} GPU(s), cuda:0..cuda:{count - 1}")
    if precision == "fp16" and kind(device) == "cpu":
        raise ConfigError(
            "--precision fp16 needs a GPU (float16 autocast with loss scaling); on the CPU use --precision bf16"
        )


def resolve(spec: str, local_index: int = 0) -> torch.device:
    """The device of the worker with index ``local_index`` on its machine."""
    if kind(spec) == "cpu":
        return torch.device("cpu")
    if spec.startswith("cuda:"):
        return torch.device(spec)
    return torch.device("cuda", local_index % max(1, cuda_count()))


def use(spec: str, local_index: int = 0) -> torch.device:
    """The device of this worker process (see :func:`resolve`), made its current CUDA device (what
    NCCL and ``torch.cuda`` calls then use)."""
    where = resolve(spec, local_index)
    if where.type == "cuda":
        torch.cuda.set_device(where)
    return where


def autocast(device: torch.device, precision: str) -> contextlib.AbstractContextManager:
    """The forward pass's context: nothing for fp32, autocast for bf16 and fp16. Each worker asks
    once, before it trains: a GPU without bfloat16 is one error line (asking a GPU takes a CUDA
    context, which the launching process does not make for this)."""
    if precision == "fp32":
        return contextlib.nullcontext()
    if precision == "bf16" and device.type == "cuda" and not torch.cuda.is_bf16_supported():
        raise ConfigError(
            f"--precision bf16: this GPU ({torch.cuda.get_device_name(device)}) does not support "
            f"bfloat16; use --precision fp16 or fp32"
        )
    return torch.autocast(device_type=device.type, dtype=DTYPES[precision])


@contextlib.contextmanager
def float32_exact() -> Iterator[None]:
    """Inside the block float32 means IEEE float32 on a GPU too: cuDNN convolutions (and RNNs),
    which PyTorch runs in TF32 by default, and CUDA matmuls. Outside it the process's own settings
    hold again (``single`` trains in the caller's process)."""
    backends = torch.backends
    if hasattr(backends.cudnn, "conv"):  # torch >= 2.9: each op's fp32_precision (its legacy flags must not mix)
        ops = [backends.cudnn.conv, backends.cudnn.rnn, backends.cuda.matmul]
        before = [op.fp32_precision for op in ops]
        for op in ops:
            op.fp32_precision = "ieee"
        try:
            yield
        finally:
            for op, value in zip(ops, before):
                op.fp32_precision = value
        return
    flags = (backends.cudnn.allow_tf32, backends.cuda.matmul.allow_tf32)
    backends.cudnn.allow_tf32 = backends.cuda.matmul.allow_tf32 = False
    try:
        yield
    finally:
        backends.cudnn.allow_tf32, backends.cuda.matmul.allow_tf32 = flags


def synchronizer(device: torch.device) -> Callable[[], None] | None:
    """What a clock (or a lock) calls so that it counts the work this worker queued on the device:
    its current stream, done (what a collective or a copy on another stream leaves there is waited
    for on it). Not the whole device: Hogwild!'s threads share one GPU, and a device-wide wait from
    one of them while another captures a CUDA graph would break that capture."""
    if device.type == "cuda":
        return lambda: torch.cuda.current_stream(device).synchronize()
    return None


def _call(module: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
    return module._call_impl(*args, **kwargs)


_compiled_call: Callable[..., Any] | None = None


def compile_in_place(module: torch.nn.Module, around: Callable[..., Any] | None = None) -> None:
    """torch.compile ``module``'s calls, hooks included, keeping the module itself (its class, its
    state_dict keys, the wrappers round it). ``Module.compile()`` compiles the bound ``_call_impl``,
    which torch 2.13's dynamo skips (a frame of torch.nn: it silently trains eagerly), and a deep
    copy of a module compiled that way would call the original's weights. Here one compiled
    function takes the module as its argument, bound by a ``functools.partial``, which a deep copy
    (an average, theta) rebinds to the copy. ``around(call, *args, **kwargs)``: what runs the
    compiled call, outside the compiled code (--precision's autocast: a context entered in one hook
    and left in another cannot be traced)."""
    global _compiled_call
    if _compiled_call is None:
        _compiled_call = torch.compile(_call)
    call = functools.partial(_compiled_call, module)
    module._compiled_call_impl = call if around is None else functools.partial(around, call)
    module.__dict__["_distsgd_around"] = around  # (for eager_call)


def eager_call(module: torch.nn.Module) -> Callable[..., Any]:
    """A module's call as :func:`compile_in_place` made it, but eager (its ``around`` kept): what a
    compiled step is timed against."""
    around = getattr(module, "_distsgd_around", None)
    return module._call_impl if around is None else functools.partial(around, module._call_impl)


def compiles() -> bool:
    """Whether torch.compile compiles here (TORCHDYNAMO_DISABLE=1, or a build without it, make it
    return what it is given: --compile then trains eagerly, and says so once)."""
    probe = lambda x: x  # noqa: E731
    if torch.compile(probe) is probe:
        _warn_once(
            "--compile: torch.compile is disabled in this PyTorch (TORCHDYNAMO_DISABLE or its build); training eagerly"
        )
        return False
    return True


_warned: set[str] = set()


def _warn_once(message: str) -> None:
    if message not in _warned:
        _warned.add(message)
        logging.getLogger(__name__).warning("%s", message)


def capture_step(step: Callable[[], None], stream: Any) -> Any:
    """``step``'s GPU work captured in a CUDA graph on ``stream`` (not run: ``replay()`` runs it).
    "thread_local": other threads' CUDA calls during the capture (Hogwild! threads) are theirs."""
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream, capture_error_mode="thread_local"):
        step()
    return graph


def describe(device: torch.device, precision: str) -> dict[str, Any]:
    """What summary.json records of where a run computed."""
    out: dict[str, Any] = {"device": str(device), "precision": precision}
    if device.type == "cuda":
        out.update(gpu=torch.cuda.get_device_name(device), cuda_version=torch.version.cuda)
    return out


CHOSEN_THREADS = "DISTSGD_CHOSEN_THREADS"  # the launcher's choice for its workers (launch.cores sets it)


def threads_per_worker(cfg: RunConfig) -> int:
    """``--threads-per-worker``; unset, the launcher's choice (``launch.cores``: this machine's
    cores other processes left, shared by the workers on it), or else the cores shared by the
    run's workers (outside a run)."""
    if cfg.threads_per_worker is not None:
        return cfg.threads_per_worker
    chosen = os.environ.get(CHOSEN_THREADS, "")
    if chosen.isdigit() and int(chosen) > 0:
        return int(chosen)
    return max(1, cores() // cfg.workers)


__all__ = [
    "CHOSEN_THREADS",
    "threads_per_worker",
    "PRECISIONS",
    "cuda_count",
    "kind",
    "check",
    "resolve",
    "use",
    "autocast",
    "float32_exact",
    "synchronizer",
    "capture_step",
    "compiles",
    "compile_in_place",
    "describe",
]
