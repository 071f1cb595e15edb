"""benchmarks/gpu_memory.py's reading of PyTorch's allocator history, on the CPU: a history in the
format ``torch.cuda.memory._snapshot()`` documents (its ``TraceEntry``: ``action`` alloc,
free_requested, free_completed, segment_alloc, ...; ``addr``, ``size``, ``stream``, ``frames``
innermost first, each ``filename``, ``line``, ``name``), made up here with a known peak. What
counts as allocated is the caching allocator's own rule: ``free()`` lowers ``allocated_bytes`` and
records ``free_requested`` together; ``free_completed`` comes when another stream's use of the block
is over (PyTorch's CUDACachingAllocator.cpp, ``DeviceCachingAllocator::free``)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
spec = importlib.util.spec_from_file_location("gpu_memory", ROOT / "benchmarks" / "gpu_memory.py")
assert spec is not None and spec.loader is not None
gpu_memory = importlib.util.module_from_spec(spec)
spec.loader.exec_module(gpu_memory)


def frame(filename: str, line: int, name: str) -> dict:
    return {"filename": filename, "line": line, "name": name}


TORCH = frame("/usr/lib/python3/site-packages/torch/nn/modules/linear.py", 125, "forward")
LOOP = frame("/repo/src/distsgd/train/loop.py", 470, "eager_step")
WATCH = frame("/repo/src/distsgd/train/evaluate.py", 140, "evaluate")


def entry(action: str, addr: int, size: int, *frames: dict) -> dict:
    return {"action": action, "addr": addr, "size": size, "stream": 0, "frames": list(frames)}


def test_the_peak_and_what_is_alive_then() -> None:
    trace = [
        entry("segment_alloc", 0x1000, 1 << 21),  # the cache's own, not an allocation
        entry("alloc", 0x1000, 512, TORCH, LOOP),
        entry("alloc", 0x2000, 1024, TORCH, WATCH),
        entry("free_requested", 0x9000, 4096),  # allocated before the history began: not counted
        entry("alloc", 0x3000, 2048, TORCH, WATCH),  # peak: 512 + 1024 + 2048 = 3584
        entry("free_requested", 0x2000, 1024),
        entry("free_completed", 0x2000, 1024),
        entry("alloc", 0x4000, 1536, TORCH, LOOP),  # 512 + 2048 + 1536 = 4096: the new peak
        entry("free_requested", 0x3000, 2048),  # still on another stream: no longer allocated
        entry("alloc", 0x5000, 100, TORCH, LOOP),
    ]
    peak, live = gpu_memory.live_at_peak(trace)
    assert peak == 4096
    assert sorted(e["addr"] for e in live) == [0x1000, 0x3000, 0x4000]
    rows = gpu_memory.grouped(live)
    assert [(r["blocks"], r["bytes"]) for r in rows] == [(2, 2048), (1, 2048)]
    assert rows[0]["where"] == "loop.py:470 eager_step"  # named by distsgd's frame, not torch's
    assert gpu_memory.live_at_peak([]) == (0, [])


def test_a_stack_without_distsgd_is_named_by_its_innermost_frames() -> None:
    assert gpu_memory.where(entry("alloc", 1, 1, TORCH)) == "linear.py:125 forward"
    assert gpu_memory.where(entry("alloc", 1, 1)) == "?"


def test_growth_between_two_runs() -> None:
    few = [{"where": "a", "blocks": 1, "bytes": 100}, {"where": "b", "blocks": 2, "bytes": 50}]
    many = [
        {"where": "a", "blocks": 29, "bytes": 2900},
        {"where": "b", "blocks": 2, "bytes": 50},
        {"where": "c", "blocks": 1, "bytes": 7},
    ]
    assert gpu_memory.growth(few, many) == [
        {"where": "a", "bytes": 2800, "blocks": 28},
        {"where": "c", "bytes": 7, "blocks": 1},
    ]
