"""Bare-PyTorch measurements on one GPU that decide how distsgd uses it (no distsgd training code).

    python benchmarks/gpu_probe.py --out results-gpu

Writes ``probe.json`` into ``--out``. Three questions, each answered by medians of alternating
repeats in one run on one GPU:

1. ``tf32``: how much of a float32 step at batch 512 is cuDNN's TF32 (distsgd's ``fp32`` turns it
   off; PyTorch's default leaves cuDNN's on), resnet20 on CIFAR-shaped data on the device.
2. ``graph``: the same step eager and captured whole in one CUDA graph (forward, loss, backward,
   the SGD update), batch 128 and 512, fp32.
3. ``threads``: Hogwild! as threads of one process, each on its own CUDA stream, sharing one
   model's parameters (each thread's gradient from ``torch.autograd.grad``, its update written in
   place, lock-free), 1, 2 and 4 threads, eager and with each thread's step in its own CUDA graph;
   resnet20 (3x32x32) and mnist_net (1x28x28), batch 128: total samples/s.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "src"))

from distsgd.models import build_model  # noqa: E402

N = 20_000
DEV = torch.device("cuda")


def data(shape: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return torch.rand(N, *shape, generator=g).to(DEV), torch.randint(0, 10, (N,), generator=g).to(DEV)


class Worker:
    """One Hogwild! thread's step over parameters it shares with the others (same storage)."""

    def __init__(self, model: torch.nn.Module, shape: tuple[int, ...], batch: int, seed: int, lr: float = 0.01):
        # A replica of the module whose parameters and buffers are the shared model's storage
        # under version counters of this thread's own, so that one thread's in-place update does
        # not fail another's backward (processes get both for free).
        self.model = copy.deepcopy(model)
        for mine, shared in zip(self.model.parameters(), model.parameters()):
            mine.data = shared.data
        for mine, shared in zip(self.model.buffers(), model.buffers()):
            mine.data = shared.data
        self.params = list(self.model.parameters())
        self.mom = [torch.zeros_like(p) for p in self.params]
        self.sx = torch.zeros(batch, *shape, device=DEV)
        self.sy = torch.zeros(batch, dtype=torch.long, device=DEV)
        self.batch, self.lr = batch, lr
        self.gen = torch.Generator(device=DEV).manual_seed(seed)
        self.stream = torch.cuda.Stream()
        self.graph: torch.cuda.CUDAGraph | None = None

    def load(self, x: torch.Tensor, y: torch.Tensor) -> None:
        idx = torch.randint(0, N, (self.batch,), device=DEV, generator=self.gen)
        torch.index_select(x, 0, idx, out=self.sx)
        torch.index_select(y, 0, idx, out=self.sy)

    def step(self) -> None:
        out = self.model(self.sx)
        loss = F.cross_entropy(out, self.sy)
        grads = torch.autograd.grad(loss, self.params)
        with torch.no_grad():
            torch._foreach_mul_(self.mom, 0.5)
            torch._foreach_add_(self.mom, grads)
            torch._foreach_add_(self.params, self.mom, alpha=-self.lr)

    def capture(self, x: torch.Tensor, y: torch.Tensor) -> None:
        with torch.cuda.stream(self.stream):
            for _ in range(3):
                self.load(x, y)
                self.step()
        torch.cuda.synchronize()
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, stream=self.stream):
            self.step()
        torch.cuda.synchronize()

    def run(self, x: torch.Tensor, y: torch.Tensor, steps: int) -> None:
        with torch.cuda.stream(self.stream):
            for _ in range(steps):
                self.load(x, y)
                if self.graph is not None:
                    self.graph.replay()
                else:
                    self.step()


def threads(name: str, shape: tuple[int, ...], n: int, graphs: bool, steps: int, batch: int = 128) -> float:
    x, y = data(shape)
    model = build_model(name, shape, 10, seed=0).to(DEV)
    workers = [Worker(model, shape, batch, seed=k) for k in range(n)]
    for w in workers:
        if graphs:
            w.capture(x, y)
        else:
            with torch.cuda.stream(w.stream):
                w.load(x, y)
                w.step()
    torch.cuda.synchronize()
    go = threading.Barrier(n + 1)

    def body(w: Worker) -> None:
        go.wait()
        w.run(x, y, steps)
        w.stream.synchronize()

    ts = [threading.Thread(target=body, args=(w,)) for w in workers]
    for t in ts:
        t.start()
    go.wait()
    start = time.perf_counter()
    for t in ts:
        t.join()
    torch.cuda.synchronize()
    return n * steps * batch / (time.perf_counter() - start)


def bare(batch: int, steps: int, graph: bool = False, cudnn_tf32: bool = False) -> float:
    torch.backends.cudnn.allow_tf32 = cudnn_tf32
    try:
        return threads("resnet20", (3, 32, 32), 1, graph, steps, batch)
    finally:
        torch.backends.cudnn.allow_tf32 = True


def alternate(fns: dict[str, Callable[[], float]], repeats: int) -> dict[str, Any]:
    got: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(repeats):
        for k, f in fns.items():
            got[k].append(f())
    row = {k: statistics.median(v) for k, v in got.items()}
    row["all"] = got
    print(row, flush=True)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(
        allow_abbrev=False, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--out", required=True)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--steps", type=int, default=200, help="steps per thread per measurement")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    torch.backends.cuda.matmul.allow_tf32 = False
    s, r = args.steps, args.repeats
    result: dict[str, Any] = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__}
    result["tf32_b512"] = alternate(
        {"off": lambda: bare(512, s // 2), "on": lambda: bare(512, s // 2, cudnn_tf32=True)}, r
    )
    result["graph"] = {
        str(b): alternate({"eager": lambda b=b: bare(b, s), "graph": lambda b=b: bare(b, s, graph=True)}, r)
        for b in (128, 512)
    }
    result["threads"] = {}
    for name, shape in (("resnet20", (3, 32, 32)), ("mnist_net", (1, 28, 28))):
        fns: dict[str, Callable[[], float]] = {}
        for graphs in (False, True):
            for n in (1, 2, 4):
                fns[f"{'graph' if graphs else 'eager'}x{n}"] = lambda n=n, g=graphs: threads(name, shape, n, g, s)
        result["threads"][name] = alternate(fns, r)
        (out / "probe.json").write_text(json.dumps(result, indent=1))
    (out / "probe.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
