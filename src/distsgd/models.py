"""Built-in models, user models from ``file.py:ClassName``, and the fit check.

Built-ins are built by ``factory(input_shape, num_classes)``. ``mnist_net`` and ``cifar_net`` are
the seeds' networks; ``mlp`` and ``logreg`` have no dropout, which makes them the models of choice
for exact-equivalence checks between algorithms.

A user model is a class (or function) in a Python file, named ``path/to/file.py:Name``. It is
called with ``num_classes=`` and ``input_shape=`` when its signature takes them, else with no
arguments. Loading it runs that file's code, like any import.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable
from typing import Union

import torch
import torch.nn.functional as F
from torch import nn

from distsgd import user
from distsgd.errors import ModelError

ModelSpec = Union[str, Callable[..., nn.Module]]


class MnistNet(nn.Module):
    """The seeds' MNIST CNN (pytorch/examples' mnist_hogwild net): 21,840 parameters."""

    def __init__(self, num_classes: int = 10, in_channels: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, 10, kernel_size=5)
        self.conv2 = nn.Conv2d(10, 20, kernel_size=5)
        self.conv2_drop = nn.Dropout2d()
        self.fc1 = nn.Linear(320, 50)
        self.fc2 = nn.Linear(50, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(F.max_pool2d(self.conv1(x), 2))
        x = F.relu(F.max_pool2d(self.conv2_drop(self.conv2(x)), 2))
        x = x.flatten(1)
        x = F.relu(self.fc1(x))
        x = F.dropout(x, training=self.training)
        return F.log_softmax(self.fc2(x), dim=1)


class CifarNet(nn.Module):
    """The seeds' CIFAR-10 CNN: conv 3->10 k5, conv 10->20 k5 + Dropout2d, fc 500->10, fc 10->10."""

    def __init__(self, num_classes: int = 10, in_channels: int = 3) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, 10, kernel_size=5)
        self.conv2 = nn.Conv2d(10, 20, kernel_size=5)
        self.conv2_drop = nn.Dropout2d()
        self.fc1 = nn.Linear(500, 10)
        self.fc2 = nn.Linear(10, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(F.max_pool2d(self.conv1(x), 2))
        x = F.relu(F.max_pool2d(self.conv2_drop(self.conv2(x)), 2))
        x = x.flatten(1)
        x = F.relu(self.fc1(x))
        return F.log_softmax(self.fc2(x), dim=1)


def _features(input_shape: tuple[int, ...]) -> int:
    return int(math.prod(input_shape))


def mnist_net(input_shape: tuple[int, ...], num_classes: int) -> nn.Module:
    return MnistNet(num_classes, in_channels=input_shape[0] if len(input_shape) == 3 else 1)


def cifar_net(input_shape: tuple[int, ...], num_classes: int) -> nn.Module:
    return CifarNet(num_classes, in_channels=input_shape[0] if len(input_shape) == 3 else 3)


def mlp(input_shape: tuple[int, ...], num_classes: int, hidden: tuple[int, ...] = (256, 128)) -> nn.Module:
    """A multi-layer perceptron with ReLU and no dropout."""
    layers: list[nn.Module] = [nn.Flatten()]
    width = _features(input_shape)
    for h in hidden:
        layers += [nn.Linear(width, h), nn.ReLU()]
        width = h
    layers.append(nn.Linear(width, num_classes))
    return nn.Sequential(*layers)


def logreg(input_shape: tuple[int, ...], num_classes: int) -> nn.Module:
    """Multinomial logistic regression: one linear layer on the flattened input."""
    return nn.Sequential(nn.Flatten(), nn.Linear(_features(input_shape), num_classes))


class _BasicBlock(nn.Module):
    """Two 3x3 conv-BN layers and an identity shortcut; when the block halves the size and doubles
    the channels, the shortcut subsamples and pads the new channels with zeros (option A)."""

    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, stride=1, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.stride, self.extra = stride, cout - cin

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        shortcut = x[:, :, ::self.stride, ::self.stride] if self.stride > 1 else x
        if self.extra:
            shortcut = F.pad(shortcut, (0, 0, 0, 0, self.extra // 2, self.extra - self.extra // 2))
        return F.relu(out + shortcut)


class ResNet20(nn.Module):
    """He, Zhang, Ren, Sun, "Deep Residual Learning for Image Recognition" (CVPR 2016), section 4.2:
    the CIFAR ResNet with n = 3: a 3x3 conv of 16 filters, three stages of n basic blocks with 16,
    32 and 64 filters (the last two start with stride 2), global average pooling and a linear
    layer; 6n + 2 = 20 layers, 0.27M parameters, BatchNorm after every conv, option-A shortcuts,
    He initialisation. Any input channel count and size (the pooling is global)."""

    def __init__(self, num_classes: int = 10, in_channels: int = 3, n: int = 3) -> None:
        super().__init__()
        self.conv = nn.Conv2d(in_channels, 16, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(16)
        blocks: list[nn.Module] = []
        cin = 16
        for stage, cout in enumerate((16, 32, 64)):
            for i in range(n):
                blocks.append(_BasicBlock(cin, cout, 2 if stage > 0 and i == 0 else 1))
                cin = cout
        self.blocks = nn.Sequential(*blocks)
        self.fc = nn.Linear(64, num_classes)
        for m in self.modules():
            if isinstance(m, (nn.Conv2d, nn.Linear)):
                nn.init.kaiming_normal_(m.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.blocks(F.relu(self.bn(self.conv(x))))
        return self.fc(F.adaptive_avg_pool2d(x, 1).flatten(1))


def resnet20(input_shape: tuple[int, ...], num_classes: int) -> nn.Module:
    if len(input_shape) != 3:
        raise ModelError(f"resnet20 takes images (C, H, W), not inputs of shape {tuple(input_shape)}")
    return ResNet20(num_classes, in_channels=input_shape[0])


BUILTIN: dict[str, Callable[[tuple[int, ...], int], nn.Module]] = {
    "mnist_net": mnist_net,
    "cifar_net": cifar_net,
    "mlp": mlp,
    "logreg": logreg,
    "resnet20": resnet20,
}


def describe(spec: ModelSpec) -> str:
    """A name for the summary: the built-in name, the file spec, or the callable's name."""
    if isinstance(spec, str):
        return spec
    return getattr(spec, "__qualname__", None) or type(spec).__name__


def _load_user(spec: str) -> Callable[..., nn.Module]:
    if not spec.rpartition(":")[0].endswith(".py"):
        raise ModelError(f"unknown model '{spec}' (choose from {', '.join(BUILTIN)}, or give path/file.py:ClassName)")
    return user.load(spec, ModelError, "model")


def _call_factory(factory: Callable[..., nn.Module], input_shape: tuple[int, ...], num_classes: int) -> nn.Module:
    if factory in BUILTIN.values():
        return factory(input_shape, num_classes)
    try:
        params = inspect.signature(factory).parameters
    except (TypeError, ValueError):
        params = {}
    kwargs = {}
    if "num_classes" in params:
        kwargs["num_classes"] = num_classes
    if "input_shape" in params:
        kwargs["input_shape"] = tuple(input_shape)
    model = factory(**kwargs)
    if not isinstance(model, nn.Module):
        raise ModelError(f"{describe(factory)} returned {type(model).__name__}, not a torch.nn.Module")
    return model


def build_model(spec: ModelSpec, input_shape: tuple[int, ...], num_classes: int, init: str = "default",
                seed: int | None = None) -> nn.Module:
    """Build the model; with ``seed`` its initial weights are the same in every process."""
    if isinstance(spec, str):
        factory = BUILTIN.get(spec) or _load_user(spec)
    elif callable(spec):
        factory = spec
    else:
        raise ModelError(f"a model must be a name, a path/file.py:Class, or a callable; got {type(spec).__name__}")
    if seed is not None:
        torch.manual_seed(seed)
    try:
        model = _call_factory(factory, input_shape, num_classes)
    except ModelError:
        raise
    except Exception as exc:
        raise ModelError(f"building model {describe(spec)} failed: {type(exc).__name__}: {exc}") from None
    if init == "xavier":
        xavier_init(model)
    return model


def xavier_init(model: nn.Module) -> None:
    """Xavier-uniform weights and zero biases for every linear and convolutional layer."""
    for module in model.modules():
        if isinstance(module, (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d)):
            nn.init.xavier_uniform_(module.weight)
            if module.bias is not None:
                nn.init.zeros_(module.bias)


def check_fits(model: nn.Module, input_shape: tuple[int, ...], num_classes: int, name: str, dataset: str) -> None:
    """Run a forward pass on zeros: a model that cannot take the data fails here, before training."""
    shape_text = "x".join(str(s) for s in input_shape)
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            out = model(torch.zeros(2, *input_shape))
    except Exception as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ModelError(f"model {name} cannot take {dataset}'s input of shape {shape_text}: {first}") from None
    finally:
        model.train(was_training)
    if not isinstance(out, torch.Tensor) or tuple(out.shape) != (2, num_classes):
        got = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
        raise ModelError(f"model {name} gives output {got} for a batch of 2, but {dataset} needs (2, {num_classes}): "
                         f"one score per class")
