"""A parameter server steps with the worker's optimiser settings: each push carries the lr (and
momentum, betas, weight decay) the worker's optimiser holds at that step, as a user's LR scheduler
set them, and the server's optimiser takes them before it steps on that push's gradient.

The loops build their schedulers on ``run.optimizer`` (the torch optimiser inside the one
``run.setup()`` returns), which LR schedulers accept as it is."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

import distsgd
from distsgd.data import load_dataset

K = 5  # steps at the base lr before a schedule drives it to 0
BASE_LR = 0.1


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Flatten(), nn.Linear(64, 16), nn.ReLU(), nn.Linear(16, 10))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


def _flat(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).clone()


def _wait_for(path: Path, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} never appeared")
        time.sleep(0.01)


def lr_to_zero_loop(run: distsgd.Run) -> nn.Module:
    """K steps at the base lr, then LambdaLR's 0. After its K-th step a worker waits until the
    other has taken its K-th too (a marker file each): the answer to its next push (at lr 0) then
    holds every gradient pushed at a positive lr, and it saves those weights."""
    out = Path(os.environ["HYPER_OUT"])
    data = load_dataset("digits")
    model, opt = run.setup()
    scheduler = torch.optim.lr_scheduler.LambdaLR(run.optimizer, lambda s: 1.0 if s < K else 0.0)
    torch.save(_flat(model), out / f"start{run.rank}.pt")
    steps = 0
    for x, y in run.loader(TensorDataset(data.x_train, data.y_train)):
        opt.zero_grad()
        run.backward(F.cross_entropy(model(x), y))
        opt.step()
        scheduler.step()
        steps += 1
        if steps == K:
            (out / f"stepped{run.rank}").touch()
            _wait_for(out / f"stepped{1 - run.rank}")
        elif steps == K + 1:
            torch.save(_flat(model), out / f"after{run.rank}.pt")
    return run.final_model()


@pytest.mark.slow
@pytest.mark.parametrize("algo", ["asgd", "sync-ps"])
def test_a_schedule_that_drives_the_lr_to_zero_stops_the_weights(tmp_path, monkeypatch, algo: str) -> None:
    """SGD at lr 0 is w <- w - 0 * (momentum buffer): every push after a worker's K-th leaves the
    server's weights as they were once both workers' first K gradients were applied. (The server
    used to step at the base lr: the weights went on moving.)"""
    monkeypatch.setenv("HYPER_OUT", str(tmp_path))
    result = distsgd.spawn(
        lr_to_zero_loop, model=Net, algo=algo, workers=2, epochs=1, batch_size=32, lr=BASE_LR, quiet=True
    )
    final = _flat(result.model)
    start = torch.load(tmp_path / "start0.pt")
    for rank in (0, 1):
        after = torch.load(tmp_path / f"after{rank}.pt")
        assert not torch.equal(after, start)  # the first K steps moved them
        moved = float((final - after).abs().max())
        assert moved == 0.0, f"worker {rank}: the weights moved {moved} at lr 0"
    assert result.summary["samples"] == pytest.approx(1437, abs=64)  # the whole epoch went on at lr 0
