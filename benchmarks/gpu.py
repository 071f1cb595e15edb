"""distsgd on one GPU, measured: a few minutes on any machine with a CUDA GPU, nothing to download.

    python benchmarks/gpu.py --out results-gpu          # then: python -m pytest -m gpu

Writes ``gpu.json`` and ``gpu.md`` into ``--out``. Every ratio comes from one run of this script,
its two sides measured in alternating repeats (medians), on the same GPU:

1. distsgd ``single`` against a bare PyTorch loop: resnet20 on CIFAR-shaped data already on the
   device (50,000 random 3x32x32 images, 10 labels), batch 128 and 512, fp32 and bf16. Both index
   the same device tensors with a random permutation, take the same optimiser steps in the same
   arithmetic (IEEE float32: cuDNN's default TF32 off for the bare loop too) and wait for the GPU
   before reading the clock (distsgd's clock synchronises with the device itself; its
   evaluation, off the clock, is left out). Goal: single / bare >= 0.97.
2. Hogwild! with 1, 2 and 4 processes sharing one model in GPU memory (CUDA IPC), asgd with 2
   GPU workers (the server steps on the CPU), allreduce with 2 ranks on the one GPU (gloo),
   against ``single``: samples/s, resnet20 fp32 batch 128.
3. bf16 against fp32: samples/s and the test accuracy after the same 3 epochs of Fashion-MNIST
   (bundled) with resnet20, one process.
4. The GradScaler's scale over fp16 runs (resnet20, Fashion-MNIST, 1 epoch, batch 128), as the
   progress events report it: single, allreduce x2, and allreduce x2 with ``--compress fp16``,
   whose float16 wire carries the gradients still loss-scaled (the scale must stay near the others').
5. TF32 on and off for float32 (cuDNN convolutions and CUDA matmuls; distsgd's ``fp32`` is IEEE
   float32): the bare loop's samples/s each way in alternating repeats, and one trained model's test
   loss and accuracy on the CPU, on the GPU in float32 and on the GPU in TF32 (how far a TF32
   evaluation moves the numbers that the GPU tests compare with the CPU's).
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
from distsgd.api import evaluate_checkpoint  # noqa: E402
from distsgd.data import load_dataset  # noqa: E402
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
        idx = perm[i : i + batch]
        i = (i + batch) % (len(yd) - batch)
        with ctx:
            loss = torch.nn.functional.cross_entropy(model(xd[idx]), yd[idx])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        done += len(idx)
    torch.cuda.synchronize()
    return done / (time.perf_counter() - start)


def ours(
    data: Any, batch: int, precision: str, samples: int, algo: str = "single", workers: int = 1, **extra: Any
) -> dict[str, Any]:
    return distsgd.train(
        model="resnet20",
        data=data,
        algo=algo,
        workers=workers,
        batch_size=batch,
        max_samples=samples,
        lr=0.01,
        momentum=0.5,
        device="cuda",
        precision=precision,
        quiet=True,
        **extra,
    ).summary


def median(xs: list[float]) -> float:
    return statistics.median(xs)


def part_single_vs_bare(repeats: int, samples: int) -> list[dict[str, Any]]:
    # both sides in IEEE float32 (distsgd's fp32): PyTorch's default runs cuDNN's convolutions in
    # TF32, which made the bare loop 1.15x faster at batch 512 and the ratio 0.85 (2026-11-26)
    fp32_precision("ieee")
    x, y, xt, yt = cifar_shaped()
    rows = []
    for batch in (128, 512):
        for precision in ("fp32", "bf16"):
            b, d = [], []
            bare(x, y, batch, precision, 5 * batch)  # warm-up: cuDNN picks its kernels
            for _ in range(repeats):
                b.append(bare(x, y, batch, precision, samples))
                d.append(ours((x, y, xt, yt), batch, precision, samples)["samples_per_s"])
            rows.append(
                {
                    "batch": batch,
                    "precision": precision,
                    "bare": median(b),
                    "single": median(d),
                    "ratio": median(d) / median(b),
                    "bare_all": b,
                    "single_all": d,
                }
            )
            print(rows[-1], flush=True)
    return rows


def part_topologies(samples: int) -> list[dict[str, Any]]:
    x, y, xt, yt = cifar_shaped()
    data = (x, y, xt, yt)
    runs = [
        ("single", 1, {}),
        ("hogwild", 1, {}),
        ("hogwild", 2, {}),
        ("hogwild", 4, {}),
        ("asgd", 2, {}),
        ("allreduce", 2, {}),
    ]
    rows = []
    for algo, workers, extra in runs:
        s = ours(data, 128, "fp32", samples, algo, workers, **extra)
        rows.append(
            {
                "algo": algo,
                "workers": workers,
                "samples_per_s": s["samples_per_s"],
                "backend": s.get("backend"),
                "device": s["device"],
            }
        )
        print(rows[-1], flush=True)
    base = rows[0]["samples_per_s"]
    for r in rows:
        r["vs_single"] = r["samples_per_s"] / base
    return rows


def part_graphs(repeats: int, samples: int) -> list[dict[str, Any]]:
    """--cuda-graphs and Hogwild! as threads on one GPU (issue 45), fp32 batch 128, medians of
    alternating repeats: single eager and captured; hogwild 2 and 4 workers as threads (each step
    a CUDA graph on its own stream: the default on one GPU) and 4 as processes; resnet20 on
    CIFAR-shaped data and mnist_net on Fashion-MNIST-shaped data. Each worker takes ``samples``
    (a run, ``samples`` times its workers): every worker's warm-up steps and capture, taken one
    thread at a time under the capture lock, are then the same share of its run as of single's
    (with ``samples`` a run, 4 threads took 25 steps each, 4 of them warming up and capturing)."""
    g = torch.Generator().manual_seed(0)
    small = torch.rand(N, 1, 28, 28, generator=g), torch.randint(0, 10, (N,), generator=g)
    shapes = {"resnet20": cifar_shaped(), "mnist_net": (small[0], small[1], small[0][:2000], small[1][:2000])}
    runs = [
        ("single", 1, {}),
        ("single", 1, {"cuda_graphs": True}),
        ("hogwild", 2, {}),
        ("hogwild", 4, {}),
        ("hogwild", 4, {"hogwild_threads": "off"}),
    ]
    rows = []
    for model, data in shapes.items():
        got: dict[int, list[float]] = {i: [] for i in range(len(runs))}
        notes: dict[int, dict[str, Any]] = {}
        for _ in range(repeats):
            for i, (algo, workers, extra) in enumerate(runs):
                try:
                    s = distsgd.train(
                        model=model,
                        data=data,
                        algo=algo,
                        workers=workers,
                        batch_size=128,
                        max_samples=samples * workers,
                        lr=0.01,
                        momentum=0.5,
                        device="cuda",
                        quiet=True,
                        **extra,
                    ).summary
                except Exception as exc:  # noqa: BLE001 - a row that failed says why
                    notes[i] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
                    continue
                got[i].append(s["samples_per_s"])
                notes[i] = {
                    k: s.get(k)
                    for k in ("cuda_graphs", "graph_replays", "capture_s", "cuda_graphs_failed", "hogwild_threads")
                }
        base = median(got[0]) if got[0] else float("nan")
        for i, (algo, workers, extra) in enumerate(runs):
            rate = median(got[i]) if got[i] else float("nan")
            rows.append(
                {
                    "model": model,
                    "algo": algo,
                    "workers": workers,
                    **extra,
                    "samples_per_s": rate,
                    "vs_single": rate / base,
                    "all": got[i],
                    **notes.get(i, {}),
                }
            )
            print(rows[-1], flush=True)
    return rows


def part_compile(samples: int) -> list[dict[str, Any]]:
    """--compile against eager (single, resnet20, batch 128): samples/s, its compile time off the clock."""
    rows = []
    for compile_ in (False, True):
        s = distsgd.train(
            model="resnet20",
            data=cifar_shaped(),
            algo="single",
            batch_size=128,
            max_samples=2 * samples,
            lr=0.01,
            momentum=0.5,
            device="cuda",
            quiet=True,
            compile=compile_,
        ).summary
        rows.append(
            {
                "model": "resnet20",
                "algo": "single",
                "compile": compile_,
                "samples_per_s": s["samples_per_s"],
                "compile_s": s.get("compile_s"),
            }
        )
        print(rows[-1], flush=True)
    return rows


def part_precision() -> list[dict[str, Any]]:
    rows = []
    for precision in ("fp32", "bf16"):
        s = distsgd.train(
            model="resnet20",
            data="fashion-mnist",
            epochs=3,
            batch_size=128,
            lr=0.05,
            momentum=0.9,
            device="cuda",
            precision=precision,
            quiet=True,
        ).summary
        rows.append(
            {
                "precision": precision,
                "samples_per_s": s["samples_per_s"],
                "samples": s["samples"],
                "final_test_accuracy": s["final_test_accuracy"],
                "final_test_loss": s["final_test_loss"],
            }
        )
        print(rows[-1], flush=True)
    return rows


def fp32_precision(setting: str) -> None:
    """'tf32' or 'ieee' for float32 convolutions and matmuls in this process."""
    torch.backends.cudnn.conv.fp32_precision = setting
    torch.backends.cuda.matmul.fp32_precision = setting


def part_scale(folder: Path) -> list[dict[str, Any]]:
    rows = []
    for algo, workers, compress in (("single", 1, None), ("allreduce", 2, None), ("allreduce", 2, "fp16")):
        out = folder / f"scale-{algo}-{compress or 'none'}"
        s = distsgd.train(
            model="resnet20",
            data="fashion-mnist",
            algo=algo,
            workers=workers,
            epochs=1,
            batch_size=128,
            lr=0.05,
            momentum=0.9,
            device="cuda",
            precision="fp16",
            log_every=10,
            out=str(out),
            overwrite=True,
            quiet=True,
            **({"compress": compress} if compress else {}),
        ).summary
        events = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        scales = [(e["samples"], e["loss_scale"]) for e in events if e["event"] == "progress"]
        values = [v for _, v in scales]
        rows.append(
            {
                "algo": algo,
                "workers": workers,
                "compress": compress or "none",
                "scales": scales,
                "first": values[0],
                "min": min(values),
                "final": values[-1],
                "backoffs": sum(b < a for a, b in zip(values, values[1:])),
                "final_test_accuracy": s["final_test_accuracy"],
                "samples_per_s": s["samples_per_s"],
            }
        )
        print({k: v for k, v in rows[-1].items() if k != "scales"}, flush=True)
    return rows


def plain_evaluation(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> tuple[float, float]:
    """(accuracy, mean loss) under this process's float32 settings (distsgd's evaluate uses IEEE)."""
    model.eval()
    correct, loss = 0, 0.0
    with torch.no_grad():
        for i in range(0, len(y), 1000):
            out = model(x[i : i + 1000])
            loss += float(torch.nn.functional.cross_entropy(out, y[i : i + 1000], reduction="sum"))
            correct += int((out.argmax(1) == y[i : i + 1000]).sum())
    return correct / len(y), loss / len(y)


def part_tf32(repeats: int, samples: int, folder: Path) -> dict[str, Any]:
    x, y, _, _ = cifar_shaped()
    speed: dict[str, list[float]] = {"ieee": [], "tf32": []}
    try:
        for setting in ("ieee", "tf32"):  # warm-up: cuDNN picks its kernels for each
            fp32_precision(setting)
            bare(x, y, 128, "fp32", 5 * 128)
        for _ in range(repeats):
            for setting in ("ieee", "tf32"):
                fp32_precision(setting)
                speed[setting].append(bare(x, y, 128, "fp32", samples))
        out = folder / "tf32-model"
        distsgd.train(
            model="resnet20",
            data="fashion-mnist",
            epochs=1,
            batch_size=128,
            lr=0.05,
            momentum=0.9,
            device="cuda",
            out=str(out),
            overwrite=True,
            quiet=True,
        )
        cpu = evaluate_checkpoint(out / "model.pt")
        data = load_dataset("fashion-mnist")
        model = build_model("resnet20", data.input_shape, data.num_classes)
        model.load_state_dict(torch.load(out / "model.pt", weights_only=True)["state_dict"])
        model.cuda()
        xt, yt = data.x_test.cuda(), data.y_test.cuda()
        scores = {}
        for setting in ("ieee", "tf32"):
            fp32_precision(setting)
            scores[setting] = plain_evaluation(model, xt, yt)
    finally:
        fp32_precision("ieee")
    result = {
        "bare_ieee": median(speed["ieee"]),
        "bare_tf32": median(speed["tf32"]),
        "speed": speed,
        "cpu": [cpu["test_accuracy"], cpu["test_loss"]],
        "gpu_ieee": list(scores["ieee"]),
        "gpu_tf32": list(scores["tf32"]),
    }
    print(result, flush=True)
    return result


def markdown(result: dict[str, Any]) -> str:
    m = result["machine"]
    lines = [
        f"# distsgd on one GPU, {result['date']}",
        "",
        f"{m['gpu']}, CUDA {m['cuda']}, torch {m['torch']}, Python {m['python']}, {m['host']}.",
        "",
        "## single against a bare PyTorch loop (resnet20, CIFAR-shaped data on the device)",
        "",
        f"Medians of {result['repeats']} alternating repeats of {result['samples']} samples.",
        "",
        "| batch | precision | bare (samples/s) | distsgd single | single / bare |",
        "|---|---|---|---|---|",
    ]
    lines += [
        f"| {r['batch']} | {r['precision']} | {r['bare']:.0f} | {r['single']:.0f} | {r['ratio']:.3f} |"
        for r in result["single_vs_bare"]
    ]
    lines += [
        "",
        "## Topologies on the one GPU (resnet20, fp32, batch 128 per worker)",
        "",
        "| algorithm | workers | samples/s | / single | backend |",
        "|---|---|---|---|---|",
    ]
    lines += [
        f"| {r['algo']} | {r['workers']} | {r['samples_per_s']:.0f} | {r['vs_single']:.2f} | {r['backend'] or '-'} |"
        for r in result["topologies"]
    ]
    lines += [
        "",
        f"## --cuda-graphs and Hogwild! threads (fp32, batch 128 per worker, each worker {result['samples']} samples)",
        "",
        "| model | algorithm | workers | settings | samples/s | / single eager | replays | capture_s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    lines += [
        f"| {r['model']} | {r['algo']} | {r['workers']} | "
        f"{'graphs' if r.get('cuda_graphs') else 'eager'}"
        f"{', threads' if r.get('hogwild_threads') else ', processes' if r.get('hogwild_threads') is False else ''} | "
        f"{r['samples_per_s']:.0f} | {r['vs_single']:.2f} | {r.get('graph_replays') or '-'} | {r.get('capture_s') or '-'} |"
        for r in result["graphs"]
    ]
    lines += [
        "",
        "## --compile against eager (resnet20, single)",
        "",
        "| run | samples/s | compile_s |",
        "|---|---|---|",
    ]
    lines += [
        f"| {'compiled' if r['compile'] else 'eager'} | {r['samples_per_s']:.0f} | {r['compile_s'] or '-'} |"
        for r in result["compile"]
    ]
    lines += [
        "",
        "## bf16 against fp32 (resnet20, Fashion-MNIST, 3 epochs, one process)",
        "",
        "| precision | samples/s | test accuracy | test loss |",
        "|---|---|---|---|",
    ]
    lines += [
        f"| {r['precision']} | {r['samples_per_s']:.0f} | {r['final_test_accuracy']:.4f} | {r['final_test_loss']:.4f} |"
        for r in result["precision"]
    ]
    lines += [
        "",
        "## The GradScaler's scale over fp16 runs (resnet20, Fashion-MNIST, 1 epoch, batch 128)",
        "",
        "| algorithm | workers | --compress | first scale | lowest | final | back-offs | test accuracy |",
        "|---|---|---|---|---|---|---|---|",
    ]
    lines += [
        f"| {r['algo']} | {r['workers']} | {r['compress']} | {r['first']:g} | {r['min']:g} | {r['final']:g} | "
        f"{r['backoffs']} | {r['final_test_accuracy']:.4f} |"
        for r in result["scale"]
    ]
    t = result["tf32"]
    if t:
        lines += [
            "",
            "## TF32 on and off for float32 (resnet20)",
            "",
            f"Bare loop, CIFAR-shaped, batch 128, medians of {result['repeats']} alternating repeats: "
            f"{t['bare_ieee']:.0f} samples/s in IEEE float32, {t['bare_tf32']:.0f} in TF32 "
            f"({t['bare_tf32'] / t['bare_ieee']:.2f}x).",
            "",
            "| one model (Fashion-MNIST, 1 epoch) evaluated | test accuracy | test loss |",
            "|---|---|---|",
            f"| CPU | {t['cpu'][0]:.4f} | {t['cpu'][1]:.6f} |",
            f"| GPU, IEEE float32 (distsgd's fp32) | {t['gpu_ieee'][0]:.4f} | {t['gpu_ieee'][1]:.6f} |",
            f"| GPU, TF32 | {t['gpu_tf32'][0]:.4f} | {t['gpu_tf32'][1]:.6f} |",
        ]
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="folder for gpu.json and gpu.md")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--samples", type=int, default=25_600, help="samples per throughput measurement")
    ap.add_argument("--parts", default="bare,topologies,graphs,compile,precision,scale,tf32")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("error: no CUDA GPU here (torch.cuda.is_available() is False)")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    import datetime

    result: dict[str, Any] = {
        "date": datetime.date.today().isoformat(),
        "repeats": args.repeats,
        "samples": args.samples,
        "machine": {
            "gpu": torch.cuda.get_device_name(0),
            "cuda": torch.version.cuda,
            "torch": torch.__version__,
            "python": platform.python_version(),
            "host": platform.node(),
            "gpus": torch.cuda.device_count(),
        },
    }
    parts = args.parts.split(",")
    result["single_vs_bare"] = part_single_vs_bare(args.repeats, args.samples) if "bare" in parts else []
    result["topologies"] = part_topologies(args.samples) if "topologies" in parts else []
    result["graphs"] = part_graphs(args.repeats, args.samples) if "graphs" in parts else []
    result["compile"] = part_compile(args.samples) if "compile" in parts else []
    result["precision"] = part_precision() if "precision" in parts else []
    result["scale"] = part_scale(out) if "scale" in parts else []
    result["tf32"] = part_tf32(args.repeats, args.samples, out) if "tf32" in parts else {}
    (out / "gpu.json").write_text(json.dumps(result, indent=1))
    (out / "gpu.md").write_text(markdown(result))
    print((out / "gpu.md").read_text())


if __name__ == "__main__":
    main()
