"""Every algorithm, 2 workers, a model with BatchNorm and dropout, on real data (digits).

What a user who brings a ResNet-like model needs to trust: the run finishes; the accuracy it
reports is the accuracy of the model.pt it saved, evaluated afresh; the saved model's BatchNorm
statistics were really learnt (not left at their initial values); and the replicas of the
synchronous algorithms end with equal parameters and buffers.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import distsgd
from distsgd.data import load_dataset

pytest.importorskip("sklearn")

MODEL = '''
import torch.nn as nn
import torch.nn.functional as F


class BNNet(nn.Module):
    """conv-BN-relu-pool, linear-BN-relu-dropout, linear: float and integer buffers both."""

    def __init__(self, num_classes=10):
        super().__init__()
        self.conv = nn.Conv2d(1, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.fc1 = nn.Linear(8 * 4 * 4, 32)
        self.bn1 = nn.BatchNorm1d(32)
        self.drop = nn.Dropout(0.25)
        self.fc2 = nn.Linear(32, num_classes)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.bn(self.conv(x))), 2).flatten(1)
        return self.fc2(self.drop(F.relu(self.bn1(self.fc1(x)))))
'''

CASES = [
    ("single", 1, {}),
    ("allreduce", 2, {}),
    ("ddp", 2, {}),
    ("hogwild", 2, {}),
    ("asgd", 2, {}),
    ("sync-ps", 2, {}),
    ("ssp", 2, {"staleness": 1}),
    ("dcasgd", 2, {"dc_adaptive": True}),
    ("local-sgd", 2, {"sync_every": "5"}),  # 22 steps an epoch: 5 does not divide it
    ("easgd", 2, {"tau": 4}),
    ("easgd", 2, {"tau": 4, "easgd_mode": "async"}),
    ("hogwild++", 2, {"update_delay": 4}),
]
SYNCHRONOUS = {"allreduce", "ddp", "local-sgd", "easgd"}  # replicas (easgd: of the centre) must agree


@pytest.fixture(scope="module")
def model_file(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = tmp_path_factory.mktemp("model") / "bnnet.py"
    path.write_text(MODEL)
    return f"{path}:BNNet"


@pytest.fixture(scope="module")
def digits():
    return load_dataset("digits")


def _accuracy_of_saved(run: Path, digits) -> tuple[float, float]:
    """model.pt loaded into a fresh model and evaluated with a plain loop (not distsgd's evaluate)."""
    saved = torch.load(run / "model.pt", weights_only=True)
    model = distsgd.models.build_model(saved["model"], tuple(saved["input_shape"]), saved["num_classes"])
    model.load_state_dict(saved["state_dict"])
    model.eval()
    with torch.no_grad():
        out = model(digits.x_test)
        correct = int((out.argmax(1) == digits.y_test).sum())
        loss = float(torch.nn.functional.cross_entropy(out, digits.y_test))
    return correct / len(digits.y_test), loss


@pytest.mark.parametrize("algo, workers, extra", CASES, ids=[f"{a}-{e.get('easgd_mode', '')}".rstrip("-")
                                                             for a, _, e in CASES])
def test_reported_accuracy_is_the_saved_models(tmp_path: Path, model_file: str, digits, algo: str, workers: int,
                                               extra: dict) -> None:
    run = tmp_path / "run"
    s = distsgd.train(model=model_file, data="digits", algo=algo, workers=workers, epochs=2, batch_size=32,
                      lr=0.05, out=str(run), quiet=True, **extra).summary
    assert s["samples"] >= 2 * 1408, s["samples"]
    acc, loss = _accuracy_of_saved(run, digits)
    assert s["final_test_accuracy"] == acc
    assert s["final_test_loss"] == pytest.approx(loss, rel=1e-4, abs=1e-6)
    assert s["evals"][-1]["test_accuracy"] == acc
    assert json.loads((run / "summary.json").read_text())["final_test_accuracy"] == acc
    state = torch.load(run / "model.pt", weights_only=True)["state_dict"]
    # BatchNorm statistics were learnt from the data, in the model that is saved and evaluated.
    for name in ("bn.running_mean", "bn1.running_mean"):
        assert state[name].abs().max() > 1e-3, f"{name} was never updated: {state[name]}"
    for name in ("bn.running_var", "bn1.running_var"):
        assert (state[name] - 1).abs().max() > 1e-3, f"{name} was never updated"
    assert state["bn.num_batches_tracked"].dtype == torch.int64 and int(state["bn.num_batches_tracked"]) > 0
    assert s["final_test_accuracy"] > 0.5, s["final_test_accuracy"]  # chance is 0.1
    if algo in SYNCHRONOUS and extra.get("easgd_mode") != "async":
        assert s["replica_max_abs_diff"] == 0.0
