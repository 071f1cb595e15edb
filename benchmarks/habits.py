"""Ordinary habits of a training script, each under the algorithms it touches: taken, refused in
one line, or silently different (issue 44: the last must never happen).

    python benchmarks/habits.py                  # every row, ~3 minutes on 2 cores
    python benchmarks/habits.py --habits clip,bf16 --algos allreduce,asgd

Each case is a user's loop (``distsgd.spawn``, 2 workers, a small MLP on 512 synthetic samples)
with one habit, run in a child process under a wall-clock limit, judged by a property that
holds only if the habit took effect, from the definition of what the script asks for:

- ``clip``: ``clip_grad_norm_(model.parameters(), 1e-9)`` between ``run.backward`` and
  ``opt.step()`` (SGD, lr 0.1): the weights must not move (an update is at most lr x 1e-9);
- ``accumulate``: 4 micro-batches a step without ``run.no_sync()``: the same weights as the
  same loop with ``no_sync`` (a second run), to 1e-6;
- ``scheduler``: ``LambdaLR(opt, lambda s: 0.0)`` on the optimiser ``run.setup`` returned: the
  weights must not move;
- ``second-optimizer``: Adam (lr 0.01) on the head, built in the loop, the run's optimiser at
  lr 1e-12 on the rest: the head must move (by > 1e-3), the body must not;
- ``load``: ``model.load_state_dict(W0)`` right after ``run.setup()`` (lr 1e-12): the returned
  model must be W0;
- ``bf16``: ``spawn(precision="bf16")``: the training forward must compute in bfloat16;
- ``setup-sgd``: ``run.setup("sgd")``: the optimiser must be SGD;
- ``plain-backward``: ``loss.backward()`` instead of ``run.backward(loss)``: refused, or the
  gradients synchronised as with ``run.backward`` (weights equal to the ``run.backward`` loop's,
  where the algorithm is deterministic; under hogwild and asgd, the weights must move);
- ``own-optimizer``: ``run.setup(net, SGD(net.parameters(), lr=0))``, a model and an optimiser
  built in the loop, with the run's lr 0.1: the weights must not move;
- ``script-model``: the script's model, ``share_memory()``'d as pytorch/examples' mnist_hogwild
  does, sent through ``spawn(args=(net,))`` and given to ``run.setup(net, SGD(lr=0.1))``: the same
  weights as the loop on spawn's model (deterministic algorithms), and ``net`` trained in place;
- ``loader-passes``: one ``run.loader`` made before ``run.setup()`` and passed over each epoch:
  each pass must be a shard of 256 distinct samples, the second not the first again (the next
  epoch's: with ``--partition sharded`` every epoch deals the shuffled set anew);
- ``raise``: a ``ValueError`` in worker 1 after 3 steps: the run must fail, naming worker 1 and
  this file's line;
- ``hang``: worker 1 sleeps for ever after 3 steps (``--timeout 10``): the run must fail within
  the limit, naming worker 1;
- ``eval-alone``: rank 0 alone calls ``run.evaluation_model()`` (``--timeout 10``): one line, no
  abort.

A refusal counts only as one ``error:``-style line: a distsgd error whose message is one line.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "src"))

import distsgd  # noqa: E402
from distsgd.errors import DistsgdError  # noqa: E402

DIFFERENT = "HABIT-DIFFERENT"  # what a worker raises when a habit's property failed there

ALGOS = ["allreduce", "ddp", "local-sgd", "easgd", "diloco", "streaming-diloco", "hogwild", "asgd", "sync-ps"]
HABITS: dict[str, list[str]] = {
    "clip": ["allreduce", "ddp", "local-sgd", "diloco", "hogwild", "asgd"],
    "accumulate": ["allreduce", "ddp", "local-sgd"],
    "scheduler": ["allreduce", "local-sgd", "diloco", "hogwild", "asgd", "sync-ps"],
    "second-optimizer": ["allreduce", "diloco", "hogwild", "asgd"],
    "load": ["allreduce", "local-sgd", "easgd", "diloco", "streaming-diloco", "hogwild", "asgd"],
    "bf16": ["allreduce", "ddp", "diloco", "hogwild", "asgd"],
    "setup-sgd": ["diloco", "streaming-diloco", "allreduce"],
    "plain-backward": ["allreduce", "ddp", "local-sgd", "diloco", "hogwild", "asgd", "sync-ps"],
    "own-optimizer": ["allreduce", "ddp", "local-sgd", "easgd", "diloco", "hogwild", "asgd", "sync-ps"],
    "script-model": ["allreduce", "ddp", "local-sgd", "sync-ps", "hogwild"],
    "loader-passes": ["allreduce", "local-sgd", "diloco", "hogwild", "asgd"],
    "raise": ["allreduce", "hogwild", "asgd"],
    "hang": ["allreduce", "hogwild", "asgd"],
    "eval-alone": ["diloco", "local-sgd"],
}


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(20, 16), nn.ReLU())
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))


def data() -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(512, 20, generator=g)
    return TensorDataset(x, (x[:, :4].argmax(1) + (x[:, 4] > 1).long()) % 4)


def w0() -> dict[str, torch.Tensor]:
    torch.manual_seed(123)
    return Net().state_dict()


def flat(model: nn.Module) -> torch.Tensor:
    return torch.cat([t.detach().reshape(-1).float().cpu() for t in model.state_dict().values()])


DETERMINISTIC = {"allreduce", "ddp", "local-sgd", "diloco", "streaming-diloco", "sync-ps", "easgd"}


def w0_net() -> Net:
    net = Net()
    net.load_state_dict(w0())
    return net


def main(run: distsgd.Run, net: nn.Module | None = None, habit: str = "", variant: str = "") -> nn.Module:
    """One user's loop; ``habit`` picks what it does differently from docs/OWN_LOOP.md's loop."""
    train_set = data()
    head_opt = None
    loader = run.loader(train_set) if habit == "loader-passes" else None
    passes: list[list[float]] = []
    if habit == "own-optimizer":
        net = w0_net()
        model, opt = run.setup(net, torch.optim.SGD(net.parameters(), lr=0.0))
    elif habit == "script-model" and variant != "reference":
        assert net is not None
        model, opt = run.setup(net, torch.optim.SGD(net.parameters(), lr=0.1))
    elif habit == "setup-sgd":
        model, opt = run.setup("sgd")
        if not isinstance(opt, torch.optim.SGD):
            raise RuntimeError(f"{DIFFERENT}: run.setup('sgd') gave {type(opt).__name__}")
    else:
        model, opt = run.setup()
    module = model.module if hasattr(model, "module") else model
    if habit == "load":
        module.load_state_dict(w0())
    if habit == "scheduler":
        torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.0)
    if habit == "second-optimizer":
        head_opt = torch.optim.Adam(module.head.parameters(), lr=0.01)
    start = flat(module).clone()
    seen: list[torch.dtype] = []
    if habit == "bf16":
        module.body.register_forward_hook(lambda m, i, out: seen.append(out.dtype) if torch.is_grad_enabled() else None)
    micro = 4 if habit == "accumulate" else 1
    steps = 0
    for epoch in range(100):
        batches = iter(loader if loader is not None else run.loader(train_set, epoch=epoch))
        if loader is not None:
            passes.append([])
        while True:
            group = [b for _, b in zip(range(micro), batches)]
            if len(group) < micro:
                break
            opt.zero_grad()
            if head_opt is not None:
                head_opt.zero_grad()
            for i, (x, y) in enumerate(group):
                if loader is not None:
                    passes[-1] += x[:, 0].tolist()
                loss = F.cross_entropy(model(x), y) / micro
                if habit == "plain-backward" and variant != "reference":
                    loss.backward()
                elif habit == "accumulate" and variant == "reference" and i < micro - 1:
                    with run.no_sync():
                        run.backward(loss)
                else:
                    run.backward(loss)
            if habit == "clip":
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-9)
            opt.step()
            if head_opt is not None:
                head_opt.step()
            steps += 1
            if habit in ("raise", "hang") and run.rank == 1 and steps == 3:
                if habit == "raise":
                    raise ValueError("a bad batch")  # the line the error must name
                time.sleep(10_000)
            if habit == "eval-alone" and run.rank == 0 and steps == 3:
                run.evaluation_model()
        if run.should_stop():
            break
    final = run.final_model()
    if run.rank == 0:
        moved = (flat(final) - start).abs().max().item()
        if habit in ("clip", "scheduler", "own-optimizer") and moved > 1e-5:
            raise RuntimeError(f"{DIFFERENT}: the weights moved {moved:.3g}")
        if habit == "load":
            off = (flat(final) - flat_state(w0())).abs().max().item()
            if off > 1e-5:
                raise RuntimeError(f"{DIFFERENT}: the returned model is {off:.3g} from the weights loaded")
        if habit == "second-optimizer":
            head = (flat(final.head) - flat(_head_of(start))).abs().max().item()
            if head < 1e-3:
                raise RuntimeError(f"{DIFFERENT}: the head moved {head:.3g}")
        if habit == "plain-backward" and run.cfg.algo not in DETERMINISTIC and moved < 1e-3:
            raise RuntimeError(f"{DIFFERENT}: the weights moved {moved:.3g}")
        whole = [p for p in passes if p]
        if habit == "loader-passes" and (len(whole) < 2 or whole[0] == whole[1] or len(set(whole[1])) != 256):
            raise RuntimeError(
                f"{DIFFERENT}: the first two passes were not two epochs' shards: {[len(p) for p in whole]}"
            )
        if habit == "bf16" and (not seen or any(d != torch.bfloat16 for d in seen)):
            raise RuntimeError(f"{DIFFERENT}: the training forward computed in {sorted(set(map(str, seen)))}")
    return final


def flat_state(state: dict[str, torch.Tensor]) -> torch.Tensor:
    return torch.cat([t.reshape(-1).float() for t in state.values()])


def _head_of(start: torch.Tensor) -> nn.Module:
    """The head's part of a flat state (the body's 20 x 16 + 16 first)."""
    head = nn.Linear(16, 4)
    n = 20 * 16 + 16
    with torch.no_grad():
        head.weight.copy_(start[n : n + 64].view(4, 16))
        head.bias.copy_(start[n + 64 : n + 68])
    return head


def settings(habit: str, algo: str) -> dict[str, Any]:
    s: dict[str, Any] = {"batch_size": 16, "max_samples": 512, "lr": 0.1, "momentum": 0.0, "quiet": True}
    if algo in ("diloco", "streaming-diloco"):
        s.update(inner_optimizer="sgd", weight_decay=0.0, sync_every="4")
    if algo == "local-sgd":
        s.update(sync_every="4")
    if habit == "accumulate" and algo == "local-sgd":
        s["warmup_steps"] = 1000  # post-local SGD's synchronous start: gradients all-reduced every step
    if habit in ("second-optimizer", "load"):
        s["lr"] = 1e-12
    if habit == "bf16":
        s["precision"] = "bf16"
    if habit in ("hang", "eval-alone"):
        s["timeout_s"] = 10
    if habit == "loader-passes":
        s["max_samples"] = 2048  # two passes of each worker's shard at least
    return s


def one(habit: str, algo: str, variant: str = "") -> dict[str, Any]:
    """Run one case here; what happened (a refusal's line, a worker's verdict, the model)."""
    net = None
    if habit == "script-model":  # the model as pytorch/examples' mnist_hogwild makes it
        net = w0_net().share_memory()
    try:
        result = distsgd.spawn(
            functools.partial(main, habit=habit, variant=variant),
            model=net if net is not None else w0_net() if habit in ("own-optimizer",) else Net,
            algo=algo,
            workers=2,
            args=(net,) if habit == "script-model" and variant != "reference" else (),
            **settings(habit, algo),
        )
    except DistsgdError as exc:
        msg = str(exc)
        if DIFFERENT in msg:
            return {"status": "silently different", "detail": msg[msg.index(DIFFERENT) + len(DIFFERENT) + 2 :]}
        return {"status": "refused" if "\n" not in msg.strip() else "refused (several lines)", "detail": msg}
    errors = result.summary.get("worker_errors")
    if errors:
        joined = "; ".join(f"{k}: {v}" for k, v in errors.items())
        return {"status": "silently different", "detail": f"exit 0, only summary.json knows: {joined}"}
    out: dict[str, Any] = {"status": "taken", "detail": ""}
    if result.model is not None:
        out["model"] = flat(result.model).tolist()
        if net is not None and variant != "reference" and not torch.equal(flat(net), flat(result.model)):
            return {"status": "silently different", "detail": "the script's model was not trained in place"}
    return out


def judge(habit: str, algo: str, got: dict[str, Any], limit_s: float) -> dict[str, Any]:
    """Each habit's verdict from what the case (and, for some, a reference run) gave."""
    status, detail = got["status"], got["detail"]
    if habit in ("raise", "hang"):
        if status == "taken":
            return {"status": "silently different", "detail": "the run succeeded"}
        if status.startswith("refused"):
            named = "worker 1" in detail and (habit == "hang" or "habits.py:" in detail)
            return {"status": "taken" if named else "silently different", "detail": detail}
    compared = habit == "accumulate" or habit in ("plain-backward", "script-model") and algo in DETERMINISTIC
    if compared and status == "taken":
        ref = run_case(habit, algo, limit_s, variant="reference")
        if ref["status"] != "taken":
            return {"status": "error", "detail": f"the reference run: {ref['detail']}"}
        off = (torch.tensor(got["model"]) - torch.tensor(ref["model"])).abs().max().item()
        if off > 1e-6:
            return {"status": "silently different", "detail": f"{off:.3g} from the reference loop's weights"}
    return {"status": status, "detail": detail}


def run_case(habit: str, algo: str, limit_s: float, variant: str = "") -> dict[str, Any]:
    """One case in a child process under ``limit_s`` (a hang or an abort is an outcome too)."""
    cmd = [sys.executable, __file__, "--one", habit, algo, variant or "-"]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=limit_s, env=os.environ)
    except subprocess.TimeoutExpired:
        return {"status": "silently different", "detail": f"still running after {limit_s:g} s"}
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        tail = (proc.stderr.strip().splitlines() or ["(nothing on stderr)"])[-1]
        return {"status": "error", "detail": f"exit {proc.returncode}: {tail}"}
    return json.loads(lines[-1])


def main_cli() -> None:
    ap = argparse.ArgumentParser(
        allow_abbrev=False, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--habits", default=",".join(HABITS))
    ap.add_argument("--algos", default=",".join(ALGOS))
    ap.add_argument("--limit-s", type=float, default=120.0, help="wall-clock limit of one case")
    ap.add_argument("--json", help="write the table here as JSON too")
    ap.add_argument("--one", nargs=3, metavar=("HABIT", "ALGO", "VARIANT"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        habit, algo, variant = args.one
        print(json.dumps(one(habit, algo, "" if variant == "-" else variant)), flush=True)
        return
    algos = set(args.algos.split(","))
    rows = []
    for habit in args.habits.split(","):
        for algo in HABITS[habit]:
            if algo not in algos:
                continue
            t0 = time.perf_counter()
            got = judge(habit, algo, run_case(habit, algo, args.limit_s), args.limit_s)
            rows.append({"habit": habit, "algo": algo, **got, "s": round(time.perf_counter() - t0, 1)})
            print(f"{habit:17} {algo:17} {got['status']:19} {got['detail'][:150]}", flush=True)
    counts = {s: sum(r["status"] == s for r in rows) for s in sorted({r["status"] for r in rows})}
    print("\n" + ", ".join(f"{n} {s}" for s, n in counts.items()))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main_cli()
