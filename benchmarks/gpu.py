"""distsgd on one GPU, measured: a few minutes on any machine with a CUDA GPU, nothing to download.

    python benchmarks/gpu.py --out results-gpu          # then: python -m pytest -m gpu

Writes ``gpu.json`` and ``gpu.md`` into ``--out``. Every ratio comes from one run of this script,
its two sides measured in alternating repeats (medians), on the same GPU:

1. distsgd ``single`` against a bare PyTorch loop: resnet20 on CIFAR-shaped data already on the
   device (50,000 random 3x32x32 images, 10 labels), batch 128 and 512, fp32 and bf16. Both index
   the same device tensors with a random permutation, take the same optimiser steps and wait for
   the GPU before reading the clock (distsgd's clock synchronises with the device itself; its
   evaluation, off the clock, is left out). Goal: single / bare >= 0.97.
2. Hogwild! with 1, 2 and 4 processes sharing one model in GPU memory (CUDA IPC), asgd with 2
   GPU workers (the server steps on the CPU), allreduce with 2 ranks on the one GPU (gloo),
   against ``single``: samples/s, resnet20 fp32 batch 128.
3. bf16 against fp32: samples/s and the test accuracy after the same 3 epochs of Fashion-MNIST
   (bundled) with resnet20, one process.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "src"))

import distsgd  # noqa: E402
from distsgd.models import build_model  # noqa: E402

N = 50_000


def cifar_shaped(seed: int = 0) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    x = torch.rand(N, 3, 32, 32, generator=g)
    y = torch.randint(0, 10, (N,), generator=g)
    return x, y, x[:2000].clone(), y[:2000].clone()


def bare(x: torch.Tensor, y: torch.Tensor, batch: int, precision: str, samples: int) -> float:
    """samples/s of a plain loop: the model, SGD, device tensors indexed by a permutation."""
    dev = torch.device("cuda")
    model = build_model("resnet20", (3, 32, 32), 10, seed=0).to(dev)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.5)
    xd, yd = x.to(dev), y.to(dev)
    perm = torch.randperm(len(yd), device=dev)
    ctx = torch.autocast("cuda", dtype=torch.bfloat16) if precision == "bf16" else torch.autocast("cuda", enabled=False)
    torch.cuda.synchronize()
    start, done, i = time.perf_counter(), 0, 0
    while done < samples:
        idx = perm[i:i + batch]
        i = (i + batch) % (len(yd) - batch)
        with ctx:
            loss = torch.nn.functional.cross_entropy(model(xd[idx]), yd[idx])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        done += len(idx)
    torch.cuda.synchronize()
    return done / (time.perf_counter() - start)


def ours(data: Any, batch: int, precision: str, samples: int, algo: str = "single", workers: int = 1,
         **extra: Any) -> dict[str, Any]:
    return distsgd.train(model="resnet20", data=data, algo=algo, workers=workers, batch_size=batch,
                         max_samples=samples, lr=0.01, momentum=0.5, device="cuda", precision=precision,
                         quiet=True, **extra).summary


def median(xs: list[float]) -> float:
    return statistics.median(xs)


def part_single_vs_bare(repeats: int, samples: int) -> list[dict[str, Any]]:
    x, y, xt, yt = cifar_shaped()
    rows = []
    for batch in (128, 512):
        for precision in ("fp32", "bf16"):
            b, d = [], []
            bare(x, y, batch, precision, 5 * batch)  # warm-up: cuDNN picks its kernels
            for _ in range(repeats):
                b.append(bare(x, y, batch, precision, samples))
                d.append(ours((x, y, xt, yt), batch, precision, samples)["samples_per_s"])
            rows.append({"batch": batch, "precision": precision, "bare": median(b), "single": median(d),
                         "ratio": median(d) / median(b), "bare_all": b, "single_all": d})
            print(rows[-1], flush=True)
    return rows


def part_topologies(samples: int) -> list[dict[str, Any]]:
    x, y, xt, yt = cifar_shaped()
    data = (x, y, xt, yt)
    runs = [("single", 1, {}), ("hogwild", 1, {}), ("hogwild", 2, {}), ("hogwild", 4, {}), ("asgd", 2, {}),
            ("allreduce", 2, {})]
    rows = []
    for algo, workers, extra in runs:
        s = ours(data, 128, "fp32", samples, algo, workers, **extra)
        rows.append({"algo": algo, "workers": workers, "samples_per_s": s["samples_per_s"],
                     "backend": s.get("backend"), "device": s["device"]})
        print(rows[-1], flush=True)
    base = rows[0]["samples_per_s"]
    for r in rows:
        r["vs_single"] = r["samples_per_s"] / base
    return rows


def part_precision() -> list[dict[str, Any]]:
    rows = []
    for precision in ("fp32", "bf16"):
        s = distsgd.train(model="resnet20", data="fashion-mnist", epochs=3, batch_size=128, lr=0.05, momentum=0.9,
                          device="cuda", precision=precision, quiet=True).summary
        rows.append({"precision": precision, "samples_per_s": s["samples_per_s"], "samples": s["samples"],
                     "final_test_accuracy": s["final_test_accuracy"], "final_test_loss": s["final_test_loss"]})
        print(rows[-1], flush=True)
    return rows


def markdown(result: dict[str, Any]) -> str:
    m = result["machine"]
    lines = [f"# distsgd on one GPU, {result['date']}", "",
             f"{m['gpu']}, CUDA {m['cuda']}, torch {m['torch']}, Python {m['python']}, {m['host']}.", "",
             "## single against a bare PyTorch loop (resnet20, CIFAR-shaped data on the device)", "",
             f"Medians of {result['repeats']} alternating repeats of {result['samples']} samples.", "",
             "| batch | precision | bare (samples/s) | distsgd single | single / bare |", "|---|---|---|---|---|"]
    lines += [f"| {r['batch']} | {r['precision']} | {r['bare']:.0f} | {r['single']:.0f} | {r['ratio']:.3f} |"
              for r in result["single_vs_bare"]]
    lines += ["", "## Topologies on the one GPU (resnet20, fp32, batch 128 per worker)", "",
              "| algorithm | workers | samples/s | / single | backend |", "|---|---|---|---|---|"]
    lines += [f"| {r['algo']} | {r['workers']} | {r['samples_per_s']:.0f} | {r['vs_single']:.2f} | {r['backend'] or '-'} |"
              for r in result["topologies"]]
    lines += ["", "## bf16 against fp32 (resnet20, Fashion-MNIST, 3 epochs, one process)", "",
              "| precision | samples/s | test accuracy | test loss |", "|---|---|---|---|"]
    lines += [f"| {r['precision']} | {r['samples_per_s']:.0f} | {r['final_test_accuracy']:.4f} | "
              f"{r['final_test_loss']:.4f} |" for r in result["precision"]]
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="folder for gpu.json and gpu.md")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--samples", type=int, default=25_600, help="samples per throughput measurement")
    ap.add_argument("--parts", default="bare,topologies,precision")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("error: no CUDA GPU here (torch.cuda.is_available() is False)")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    import datetime

    result: dict[str, Any] = {
        "date": datetime.date.today().isoformat(), "repeats": args.repeats, "samples": args.samples,
        "machine": {"gpu": torch.cuda.get_device_name(0), "cuda": torch.version.cuda, "torch": torch.__version__,
                    "python": platform.python_version(), "host": platform.node(), "gpus": torch.cuda.device_count()}}
    parts = args.parts.split(",")
    result["single_vs_bare"] = part_single_vs_bare(args.repeats, args.samples) if "bare" in parts else []
    result["topologies"] = part_topologies(args.samples) if "topologies" in parts else []
    result["precision"] = part_precision() if "precision" in parts else []
    (out / "gpu.json").write_text(json.dumps(result, indent=1))
    (out / "gpu.md").write_text(markdown(result))
    print((out / "gpu.md").read_text())


if __name__ == "__main__":
    main()
