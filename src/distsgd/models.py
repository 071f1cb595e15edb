"""Built-in models, user models from ``file.py:ClassName``, and the fit check.

Built-ins are built by ``factory(input_shape, num_classes)``. ``mnist_net`` and ``cifar_net`` are
small CNNs (conv-pool-relu twice, dropout, two linear layers); ``mlp`` and ``logreg`` have no dropout, which makes them the models of choice
for exact-equivalence checks between algorithms. ``gpt`` is a decoder-only transformer language
model; its size is part of its name: ``gpt[layers=4,heads=4,width=128,dropout=0]`` (any subset).

A model's output is a tensor, or an object with ``.logits`` (a Hugging Face model's output, or a
dict with a ``logits`` key): :func:`logits_of` takes the scores out of either. A language model
takes token ids ``(B, T)`` and gives scores ``(B, T, vocabulary)``.

A user model is a class (or function) in a Python file, named ``path/to/file.py:Name``. It is
called with ``num_classes=`` and ``input_shape=`` when its signature takes them, else with no
arguments. Loading it runs that file's code, like any import.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable, Mapping
from typing import Union

import torch
import torch.nn.functional as F
from torch import nn

from distsgd import user
from distsgd.errors import ModelError

ModelSpec = Union[str, Callable[..., nn.Module]]


class MnistNet(nn.Module):
    """pytorch/examples' mnist_hogwild CNN: 21,840 parameters."""

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
    """A small CIFAR-10 CNN: conv 3->10 k5, conv 10->20 k5 + Dropout2d, fc 500->10, fc 10->10."""

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
        shortcut = x[:, :, :: self.stride, :: self.stride] if self.stride > 1 else x
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


class CausalSelfAttention(nn.Module):
    """Multi-head self-attention in which position t attends to positions 0..t only."""

    def __init__(self, width: int, heads: int, dropout: float) -> None:
        super().__init__()
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.heads, self.dropout = heads, dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in self.qkv(x).split(c, dim=2))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0)
        return self.proj(y.transpose(1, 2).reshape(b, t, c))


class _Block(nn.Module):
    """x + attention(LayerNorm(x)), then x + MLP(LayerNorm(x)): the MLP 4x wide with GELU."""

    def __init__(self, width: int, heads: int, dropout: float) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(width)
        self.attn = CausalSelfAttention(width, heads, dropout)
        self.ln2 = nn.LayerNorm(width)
        self.fc = nn.Linear(width, 4 * width)
        self.out = nn.Linear(4 * width, width)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.drop(self.attn(self.ln1(x)))
        return x + self.drop(self.out(F.gelu(self.fc(self.ln2(x)))))


class GPT(nn.Module):
    """A decoder-only transformer language model as GPT-2 describes it (Radford, Wu, Child, Luan,
    Amodei, Sutskever, "Language Models are Unsupervised Multitask Learners", 2019, section 2.3, on
    the decoder of Vaswani et al., "Attention Is All You Need", 2017): token and learned position
    embeddings; ``layers`` blocks of masked multi-head self-attention and a 4x-wide GELU MLP, each
    with its LayerNorm at its input (pre-norm) and a residual connection; a final LayerNorm; output
    scores from the token embedding's transpose (tied weights, as GPT-2). Weights N(0, 0.02), the
    residual projections' scaled by 1/sqrt(2 x layers) (GPT-2's "1/sqrt(N), N the number of residual
    layers"), biases 0. Input: token ids (B, T) with T <= ``context``; output: scores (B, T, vocab)."""

    def __init__(
        self, vocab: int, context: int, layers: int = 4, heads: int = 4, width: int = 128, dropout: float = 0.0
    ) -> None:
        super().__init__()
        if width % heads:
            raise ModelError(f"gpt: width {width} must be a multiple of heads {heads}")
        self.context = context
        self.tok = nn.Embedding(vocab, width)
        self.pos = nn.Embedding(context, width)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(_Block(width, heads, dropout) for _ in range(layers))
        self.ln = nn.LayerNorm(width)
        for name, p in self.named_parameters():
            if name.endswith("bias"):
                nn.init.zeros_(p)
            elif p.dim() >= 2:
                std = 0.02 / math.sqrt(2 * layers) if name.endswith(("attn.proj.weight", "out.weight")) else 0.02
                nn.init.normal_(p, 0.0, std)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        if t > self.context:
            raise ValueError(f"a sequence of {t} tokens is longer than the model's context of {self.context}")
        x = self.drop(self.tok(idx) + self.pos(torch.arange(t, device=idx.device)))
        for block in self.blocks:
            x = block(x)
        return self.ln(x) @ self.tok.weight.t()


GPT_SIZES = {"layers": int, "heads": int, "width": int, "dropout": float}


def gpt(input_shape: tuple[int, ...], num_classes: int, **size: float) -> nn.Module:
    """``gpt[...]``: the context is the data's sequence length, the vocabulary its classes."""
    if len(input_shape) != 1:
        raise ModelError(
            f"gpt takes token sequences (T,), not inputs of shape {tuple(input_shape)}: use a token "
            f"dataset (python-stdlib, text:PATH, hf:PATH)"
        )
    return GPT(num_classes, input_shape[0], **size)  # type: ignore[arg-type]  # gpt[...]'s sizes, parsed as numbers


def parse_spec(spec: str) -> tuple[str, dict[str, float]]:
    """``name[key=value,...]`` -> (name, {key: value}); a built-in's size options are checked."""
    name, bracket, rest = spec.partition("[")
    if not bracket:
        return spec, {}
    if not rest.endswith("]") or name not in SIZED:
        raise ModelError(f"model '{spec}': only {', '.join(SIZED)} take [key=value,...] size options")
    kinds, size = SIZED[name], {}
    for item in filter(None, (i.strip() for i in rest[:-1].replace(";", ",").split(","))):
        key, eq, text = item.partition("=")
        if not eq or key not in kinds:
            raise ModelError(f"model '{spec}': unknown size option '{item}' (choose from {', '.join(kinds)})")
        try:
            size[key] = kinds[key](text)
        except ValueError:
            raise ModelError(f"model '{spec}': {key} must be a {kinds[key].__name__}, got '{text}'") from None
        if size[key] < 0 or (kinds[key] is int and size[key] < 1) or (key == "dropout" and size[key] >= 1):
            raise ModelError(f"model '{spec}': {key}={text} is out of range")
    return name, size


def logits_of(out: object) -> torch.Tensor:
    """A model's scores: its output itself (a tensor), or the ``logits`` of an output object or
    dict (a Hugging Face model's)."""
    if isinstance(out, torch.Tensor):
        return out
    logits = getattr(out, "logits", None)
    if logits is None and isinstance(out, dict):
        logits = out.get("logits")
    if not isinstance(logits, torch.Tensor):
        raise ModelError(
            f"the model returned {type(out).__name__}: expected a tensor of scores, or an object with .logits"
        )
    return logits


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
    "gpt": gpt,
}
SIZED = {"gpt": GPT_SIZES}  # built-ins whose name may carry size options


def model_help() -> str:
    """``--model``'s help: every built-in (the sized ones with their size options), or a file's class."""
    names = [f"{name}[{','.join(f'{k}=...' for k in SIZED[name])}]" if name in SIZED else name for name in BUILTIN]
    return f"{', '.join(names)}, or path/file.py:ClassName (runs that file)"


# Settings a model's users should start from, where they differ from the generic ones: what training
# a transformer language model from scratch takes (its text, AdamW with weight decay, a warm-up, clipping).
RECOMMENDED: dict[str, dict[str, object]] = {
    "gpt": {
        "dataset": "python-stdlib",
        "optimizer": "adamw",
        "lr": 1e-3,
        "weight_decay": 0.1,
        "weight_decay_on": "weights",
        "clip_grad_norm": 1.0,
        "lr_warmup_steps": 20,
    },
}


def recommended_settings(spec: object) -> dict[str, object]:
    """The built-in model's own defaults for settings the user left unset (none for other models)."""
    return dict(RECOMMENDED.get(parse_spec(spec)[0], {})) if isinstance(spec, str) else {}


def describe(spec: object) -> str:
    """A name for the summary: the built-in name, the file spec, or the callable's (a model's, a user's function's)."""
    if isinstance(spec, str):
        return spec
    return getattr(spec, "__qualname__", None) or type(spec).__name__


def check_name(spec: object) -> None:
    """A model named as ``--model`` takes it (a built-in, its size options, or a file's class),
    without building it: one line where it is not (a bench checks each before it runs any)."""
    if isinstance(spec, str) and (user.names_file(spec) or parse_spec(spec)[0] in BUILTIN):
        return
    if isinstance(spec, str):
        _load_user(spec)


def _load_user(spec: str) -> Callable[..., nn.Module]:
    if not user.names_file(spec):
        raise ModelError(f"unknown model '{spec}' (choose from {', '.join(BUILTIN)}, or give path/file.py:ClassName)")
    return user.load(spec, ModelError, "model")


def _call_factory(factory: Callable[..., nn.Module], input_shape: tuple[int, ...], num_classes: int) -> nn.Module:
    if factory in BUILTIN.values():
        return factory(input_shape, num_classes)
    try:
        params: Mapping[str, inspect.Parameter] = inspect.signature(factory).parameters
    except (TypeError, ValueError):
        params = {}
    kwargs: dict[str, int | tuple[int, ...]] = {}
    if "num_classes" in params:
        kwargs["num_classes"] = num_classes
    if "input_shape" in params:
        kwargs["input_shape"] = tuple(input_shape)
    model = factory(**kwargs)
    if not isinstance(model, nn.Module):
        raise ModelError(f"{describe(factory)} returned {type(model).__name__}, not a torch.nn.Module")
    return model


def build_model(
    spec: ModelSpec, input_shape: tuple[int, ...], num_classes: int, init: str = "default", seed: int | None = None
) -> nn.Module:
    """Build the model; with ``seed`` its initial weights are the same in every process."""
    size: dict[str, float] = {}  # a built-in's size options (gpt[layers=2,...])
    if isinstance(spec, str):
        name, size = parse_spec(spec) if spec.partition("[")[0] in SIZED else (spec, {})
        factory = BUILTIN.get(name) or _load_user(spec)
    elif callable(spec):
        factory = spec
    else:
        raise ModelError(f"a model must be a name, a path/file.py:Class, or a callable; got {type(spec).__name__}")
    if seed is not None:
        torch.manual_seed(seed)
    try:
        model = (
            factory(input_shape, num_classes, **size)
            if factory in BUILTIN.values()
            else _call_factory(factory, input_shape, num_classes)
        )
    except ModelError:
        raise
    except (Exception, SystemExit) as exc:  # (a constructor's sys.exit too: it ended distsgd, silently)
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


def check_fits(
    model: nn.Module,
    input_shape: tuple[int, ...],
    num_classes: int,
    name: str,
    dataset: str,
    task: str = "classification",
) -> None:
    """Run a forward pass on zeros: a model that cannot take the data fails here, before training.
    A language model takes token ids (2, T) and must give scores (2, T, V) with V at least the
    data's vocabulary."""
    shape_text = "x".join(str(s) for s in input_shape)
    lm = task == "lm"
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            where = next(iter(model.parameters()), torch.empty(0)).device
            x = torch.zeros(2, *input_shape, dtype=torch.long if lm else torch.float32, device=where)
            out = logits_of(model(x))
    except (Exception, SystemExit) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ModelError(f"model {name} cannot take {dataset}'s input of shape {shape_text}: {first}") from None
    finally:
        model.train(was_training)
    if lm:
        if out.dim() != 3 or tuple(out.shape[:2]) != (2, input_shape[0]) or out.shape[2] < num_classes:
            raise ModelError(
                f"model {name} gives scores {tuple(out.shape)} for 2 sequences of {input_shape[0]} tokens, "
                f"but {dataset} needs (2, {input_shape[0]}, {num_classes}): one score per token of its "
                f"vocabulary at every position"
            )
        return
    if tuple(out.shape) != (2, num_classes):
        raise ModelError(
            f"model {name} gives output {tuple(out.shape)} for a batch of 2, but {dataset} needs "
            f"(2, {num_classes}): one score per class"
        )
