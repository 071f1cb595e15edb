"""Built-in models' shapes, user models, and the fit check."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from distsgd.errors import ModelError
from distsgd.models import build_model, check_fits


@pytest.mark.parametrize(
    "name, shape, params",
    [
        ("mnist_net", (1, 28, 28), 21840),
        ("cifar_net", (3, 32, 32), 760 + 5020 + 5010 + 110),  # conv1, conv2, fc1, fc2 (weights + biases)
        ("mlp", (1, 8, 8), 64 * 256 + 256 + 256 * 128 + 128 + 128 * 10 + 10),
        ("logreg", (5,), 5 * 10 + 10),
    ],
)
def test_builtin_shapes_and_sizes(name: str, shape: tuple, params: int) -> None:
    model = build_model(name, shape, 10)
    assert model(torch.zeros(3, *shape)).shape == (3, 10)
    assert sum(p.numel() for p in model.parameters()) == params
    check_fits(model, shape, 10, name, "test")


def test_same_seed_same_weights() -> None:
    a = build_model("mnist_net", (1, 28, 28), 10, seed=4)
    b = build_model("mnist_net", (1, 28, 28), 10, seed=4)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))


def test_misfit_is_a_clear_error() -> None:
    model = build_model("mnist_net", (1, 8, 8), 10)
    with pytest.raises(ModelError, match=r"model mnist_net cannot take digits's input of shape 1x8x8"):
        check_fits(model, (1, 8, 8), 10, "mnist_net", "digits")
    wrong_classes = build_model("logreg", (4,), 3)
    with pytest.raises(ModelError, match=r"gives output \(2, 3\).*needs \(2, 10\)"):
        check_fits(wrong_classes, (4,), 10, "logreg", "x")


def test_user_model_from_file(tmp_path: Path) -> None:
    path = tmp_path / "mymodel.py"
    path.write_text(
        "import torch.nn as nn\n"
        "class Tiny(nn.Module):\n"
        "    def __init__(self, num_classes, input_shape):\n"
        "        super().__init__()\n"
        "        self.fc = nn.Linear(input_shape[-1] * input_shape[-2], num_classes)\n"
        "    def forward(self, x):\n"
        "        return self.fc(x.flatten(1))\n"
        "def no_args():\n"
        "    return nn.Sequential(nn.Flatten(), nn.Linear(64, 10))\n"
    )
    model = build_model(f"{path}:Tiny", (1, 8, 8), 7)
    assert model(torch.zeros(2, 1, 8, 8)).shape == (2, 7)
    assert isinstance(build_model(f"{path}:no_args", (1, 8, 8), 10), nn.Sequential)
    with pytest.raises(ModelError, match="has no class or function named 'Nope'"):
        build_model(f"{path}:Nope", (1, 8, 8), 10)
    with pytest.raises(ModelError, match="model file not found"):
        build_model(f"{tmp_path / 'other.py'}:Tiny", (1, 8, 8), 10)


def test_user_model_import_error_is_one_line(tmp_path: Path) -> None:
    path = tmp_path / "broken.py"
    path.write_text("raise RuntimeError('boom')\n")
    with pytest.raises(ModelError, match=r"importing .*broken.py failed: RuntimeError: boom"):
        build_model(f"{path}:X", (1,), 2)


def test_unknown_model() -> None:
    with pytest.raises(ModelError, match="unknown model 'resnet'"):
        build_model("resnet", (1, 28, 28), 10)


def test_xavier_init_zeroes_biases() -> None:
    model = build_model("mlp", (4,), 3, init="xavier", seed=0)
    for module in model.modules():
        if isinstance(module, nn.Linear):
            assert torch.count_nonzero(module.bias) == 0
            bound = (6 / (module.in_features + module.out_features)) ** 0.5
            assert float(module.weight.detach().abs().max()) <= bound
