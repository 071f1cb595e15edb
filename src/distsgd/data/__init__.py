"""Datasets: the tensor fast path, and any torch Dataset.

Two kinds of training data, with one declared interface, :class:`TrainingData`:

- :class:`Dataset`, the fast path: arrays read once, validated, normalised and held in memory as
  tensors that the loop indexes directly (no per-sample Python). The built-in datasets, ``npz:``
  files and arrays given to ``distsgd.train`` are this; ``--augment`` crops and flips whole
  batches at once.
- :class:`~distsgd.data.torchdata.TorchData`: any map-style ``torch.utils.data.Dataset`` pair,
  read through a ``DataLoader`` (``--loader-workers``); ``folder:PATH`` streams images this way,
  and so does ``--dataset path/file.py:function``.

Targets: integer class labels (classification), floats (regression: an npz whose ``y`` is
float, trained with ``--loss mse``), or token ids ``(N, T)`` beside input tokens ``(N, T)``: a
language model's next tokens (:mod:`distsgd.data.text`: ``text:PATH``, ``python-stdlib``,
``hf:PATH``). ``share_memory_()`` moves tensors into shared memory so that
worker processes read one copy. See :mod:`distsgd.data.sources` for where files are looked for.
"""

from __future__ import annotations

import dataclasses
import logging
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Protocol, runtime_checkable

import numpy as np
import torch
from torch.utils.data import TensorDataset

from distsgd import user
from distsgd.data import formats, sources, text
from distsgd.data.augment import crop_flip
from distsgd.data.torchdata import TorchData, is_map_dataset, is_stream
from distsgd.errors import DataError

log = logging.getLogger(__name__)

HOLDOUT_FRACTION = 0.1  # test share carved from the training arrays when no test set is given

Batch = tuple[torch.Tensor, torch.Tensor]


@runtime_checkable
class TrainingData(Protocol):
    """What the loop, the launchers and evaluation ask of training data. :class:`Dataset` (tensors
    in memory, indexed by the loop) and :class:`~distsgd.data.torchdata.TorchData` (any map-style
    torch Dataset pair, read through a DataLoader) are the two kinds; a new format returns one."""

    name: str
    num_classes: int  # classes, or outputs for regression

    @property
    def input_shape(self) -> tuple[int, ...]: ...

    @property
    def task(self) -> str: ...  # "classification", "regression" or "lm" (next-token prediction)

    @property
    def n_train(self) -> int: ...

    @property
    def n_test(self) -> int: ...

    def options(self, augment: bool = False, loader_workers: int = 0) -> "TrainingData":
        """A view with ``--augment`` and ``--loader-workers`` applied (or refused in one line)."""

    def batches(self, order: torch.Tensor, start: int, batch_size: int) -> Iterator[Batch]:
        """The training batches of ``order`` (sample indices), from position ``start``."""

    def test_batches(self, batch_size: int) -> Iterator[Batch]: ...

    def to(self, device: torch.device) -> "TrainingData":
        """The same data for a worker on ``device``: tensors moved there once (the fast path), or
        batches moved there as they come (a DataLoader, pinned memory on a GPU)."""

    def share_memory_(self) -> "TrainingData":
        """Move what can be shared into shared memory, so worker processes read one copy."""

    def is_shared(self) -> bool: ...


@dataclass
class Dataset:
    """Normalised tensors of one dataset. ``x`` is float32 (N, C, H, W) or (N, D); ``y`` is int64
    class labels (N,) or, for regression, float32 targets (N, D). A language model's: ``x`` int64
    token ids (N, T), ``y`` the next tokens (N, T); ``num_classes`` is the vocabulary."""

    name: str
    x_train: torch.Tensor
    y_train: torch.Tensor
    x_test: torch.Tensor
    y_test: torch.Tensor
    num_classes: int  # classes, or outputs for regression
    where: str = ""
    fill: torch.Tensor | None = None  # a black pixel, normalised, per channel (images): --augment pads with it
    augment: bool = False

    @property
    def input_shape(self) -> tuple[int, ...]:
        return tuple(self.x_train.shape[1:])

    @property
    def task(self) -> str:
        if self.y_train.dtype.is_floating_point:
            return "regression"
        return "lm" if self.y_train.dim() == 2 else "classification"

    @property
    def n_train(self) -> int:
        return len(self.y_train)

    def torch_datasets(self) -> tuple[TensorDataset, TensorDataset]:
        """The training and test sets as torch Datasets of ``(x, y)`` pairs (for a loop of your own)."""
        return TensorDataset(self.x_train, self.y_train), TensorDataset(self.x_test, self.y_test)

    @property
    def n_test(self) -> int:
        return len(self.y_test)

    def options(self, augment: bool = False, loader_workers: int = 0) -> "Dataset":
        """A view with ``--augment`` on or off (``--loader-workers`` does not apply: no per-sample work)."""
        if augment and (self.x_train.dim() != 4 or self.fill is None):
            raise DataError(f"--augment crops and flips images; {self.name} has inputs of shape {self.input_shape}")
        return dataclasses.replace(self, augment=augment)

    def to(self, device: torch.device) -> "Dataset":
        """The tensors on ``device``, moved once (this Dataset itself when they are there)."""
        if self.x_train.device == torch.device(device):
            return self
        moved = {k: getattr(self, k).to(device) for k in ("x_train", "y_train", "x_test", "y_test")}
        fill = self.fill.to(device) if self.fill is not None else None
        return dataclasses.replace(self, **moved, fill=fill)

    def batches(self, order: torch.Tensor, start: int, batch_size: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """The training batches of ``order`` (sample indices) from position ``start``: tensor indexing."""
        order = order.to(self.x_train.device)
        for first in range(start, len(order), batch_size):
            idx = order[first : first + batch_size]
            x = self.x_train[idx]
            if self.augment:
                assert self.fill is not None  # options turns augment on only for images, which have a fill
                x = crop_flip(x, self.fill)
            yield x, self.y_train[idx]

    def test_batches(self, batch_size: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        for first in range(0, len(self.y_test), batch_size):
            yield self.x_test[first : first + batch_size], self.y_test[first : first + batch_size]

    def share_memory_(self) -> "Dataset":
        for t in (self.x_train, self.y_train, self.x_test, self.y_test):
            if t.device.type == "cpu":  # a GPU's tensors travel to workers by CUDA IPC
                t.share_memory_()
        return self

    def is_shared(self) -> bool:
        return all(t.is_shared() for t in (self.x_train, self.y_train, self.x_test, self.y_test))

    def __repr__(self) -> str:
        return (
            f"Dataset({self.name!r}, train={len(self.y_train)}, test={len(self.y_test)}, "
            f"input={self.input_shape}, classes={self.num_classes})"
        )


@dataclass(frozen=True)
class Format:
    """A kind of dataset spec that is not a built-in name: what it looks like (``usage``), how to
    recognise it, its help, and how to load it (``load(spec, data_dir)``)."""

    usage: str
    help: str
    matches: Callable[[str], bool]
    load: Callable[[str, str | None, int], TrainingData]  # (spec, data_dir, context)


def _prefixed(prefix: str) -> Callable[[str], bool]:
    return lambda spec: spec.startswith(prefix)


# Every format a --dataset may name besides the built-ins, in the order they are tried: help texts,
# `distsgd datasets` and the error for an unknown dataset are made from this table.
FORMATS = (
    Format(
        "npz:PATH",
        "arrays x, y (optional x_test, y_test) in a NumPy .npz file",
        _prefixed("npz:"),
        lambda spec, _, __: _load_npz(Path(spec[4:])),
    ),
    Format(
        "folder:PATH",
        "PATH/train/<class>/*.png|jpg and PATH/test/<class>/..., streamed",
        _prefixed("folder:"),
        lambda spec, _, __: _load_folder(Path(spec[7:])),
    ),
    Format(
        "text:PATH",
        "a text file or a folder of them, byte-level tokens, cut into --context sequences (language models)",
        _prefixed("text:"),
        lambda spec, _, context: _load_text(Path(spec[5:]), context),
    ),
    Format(
        "hf:PATH",
        "a Hugging Face dataset (save_to_disk folder, or parquet/arrow/jsonl files) with input_ids or "
        "text (language models; pip install 'distsgd[hf]')",
        _prefixed("hf:"),
        lambda spec, _, context: from_hf(text.read_hf(spec[3:]), context, spec, spec[3:]),
    ),
    Format(
        "FILE.py:FUNC",
        "a function returning (train, test) torch Datasets (runs that file)",
        user.names_file,
        lambda spec, _, __: _load_user(spec),
    ),
)


def dataset_help() -> str:
    """``--dataset``'s help: the built-ins and every format."""
    return f"{', '.join(BUILTIN)}, or {', '.join(f.usage for f in FORMATS)}"


def load_dataset(
    spec: str, data_dir: str | None = None, download: bool | None = None, context: int | None = None
) -> TrainingData:
    """A built-in dataset by name, or any of :data:`FORMATS` (``npz:PATH``, ``folder:PATH``,
    ``text:PATH``, ``hf:PATH``, ``path/file.py:function``). ``context``: the sequence length of
    token data (``--context``)."""
    context = context or text.DEFAULT_CONTEXT
    if data_dir is not None and not Path(data_dir).is_dir() and (Path(data_dir).exists() or not download):
        # (until 2026-12-01 a mistyped --data-dir was passed over: the bundled copy trained, without a word)
        raise DataError(f"--data-dir {data_dir} is not a directory")
    for fmt in FORMATS:
        if fmt.matches(spec):
            prefix = fmt.usage.removesuffix("PATH")
            if prefix != fmt.usage and not spec[len(prefix) :].strip():
                # Path("") is the working directory: text: would read every file under it.
                raise DataError(f"dataset '{spec}' names no path (give {fmt.usage})")
            return fmt.load(spec, data_dir, context)
    if spec in BUILTIN:
        return BUILTIN[spec].load(spec, data_dir, download, context)
    raise DataError(
        f"unknown dataset '{spec}' (choose from {', '.join(BUILTIN)}, {', '.join(f.usage for f in FORMATS)})"
    )


def check_name(spec: str) -> None:
    """A dataset named as ``--dataset`` takes it (a built-in, or one of :data:`FORMATS`), without
    reading it: one line where it is not (a bench checks each before it runs any)."""
    if spec not in BUILTIN and not any(fmt.matches(spec) for fmt in FORMATS):
        raise DataError(
            f"unknown dataset '{spec}' (choose from {', '.join(BUILTIN)}, {', '.join(f.usage for f in FORMATS)})"
        )


def from_torch(result: Any, name: str, where: str = "") -> TrainingData:
    """What a user's dataset function returned: a :class:`Dataset`, or (train, test) torch Datasets
    (optionally a third item, or a ``num_classes`` key: the number of classes); the training set may
    be a stream (an IterableDataset), and so may the test set."""
    if isinstance(result, (Dataset, TorchData)):
        return result
    if isinstance(result, dict):
        unknown = set(result) - {"train", "test", "num_classes"}
        if unknown or not {"train", "test"} <= set(result):
            raise DataError(
                f"{name} must return (train, test) Datasets or a dict with 'train', 'test' "
                f"(and 'num_classes'); got keys {sorted(result)}"
            )
        return TorchData(result["train"], result["test"], name, where, result.get("num_classes"))
    if (
        isinstance(result, (tuple, list))
        and len(result) in (2, 3)
        and all(is_map_dataset(r) or is_stream(r) for r in result[:2])
    ):
        return TorchData(result[0], result[1], name, where, result[2] if len(result) == 3 else None)
    raise DataError(f"{name} must return (train, test) torch Datasets, got {type(result).__name__}")


def from_arrays(
    name: str,
    x_train: np.ndarray | torch.Tensor,
    y_train: np.ndarray | torch.Tensor,
    x_test: np.ndarray | torch.Tensor | None = None,
    y_test: np.ndarray | torch.Tensor | None = None,
    num_classes: int | None = None,
    where: str = "",
) -> Dataset:
    """Build a :class:`Dataset` from arrays; normalise with the training set's mean and std.

    Images are normalised per channel, flat feature vectors per feature. Integer ``y`` are class
    labels; float ``y`` are regression targets (kept as they are, shape (N, D)). Without a test
    set, a deterministic 10% of the training rows is held out for evaluation.
    """
    # integers (images' bytes) are finite in float32, centred and scaled too: no pass to look (0.2 s a
    # look at Fashion-MNIST's 70,000 images, four of them in each of a run's loads)
    whole = _integral(x_train) and (x_test is None or _integral(x_test))
    x_train = _as_float(x_train, name, "x")
    y_train = _as_targets(y_train, name, "y")
    if len(x_train) != len(y_train):
        raise DataError(f"{name}: {len(x_train)} training inputs but {len(y_train)} labels")
    if len(x_train) and x_train[0].numel() == 0:
        raise DataError(f"{name}: each sample has no values (inputs of shape {tuple(x_train.shape)})")
    test_given = x_test is not None and y_test is not None
    if x_test is None or y_test is None:
        if len(x_train) < 2:
            raise DataError(f"{name}: need at least 2 samples to hold out a test set")
        order = torch.randperm(len(x_train), generator=torch.Generator().manual_seed(0))
        n_test = max(1, int(round(len(x_train) * HOLDOUT_FRACTION)))
        test_idx, train_idx = order[:n_test], order[n_test:]
        x_test, y_test = x_train[test_idx], y_train[test_idx]
        x_train, y_train = x_train[train_idx], y_train[train_idx]
        log.info("%s: no test set given; holding out %d of the training samples", name, n_test)
    else:
        x_test = _as_float(x_test, name, "x_test")
        y_test = _as_targets(y_test, name, "y_test")
        if len(x_test) == 0:  # (it trained, and reported a test accuracy and loss of 0 measured on nothing)
            raise DataError(
                f"{name}: the test set is empty: give test samples, or none (a tenth of the training "
                f"samples is then held out)"
            )
        if y_test.dtype != y_train.dtype or y_test.shape[1:] != y_train.shape[1:]:
            raise DataError(
                f"{name}: test targets are {y_test.dtype} {tuple(y_test.shape[1:])}, training targets "
                f"{y_train.dtype} {tuple(y_train.shape[1:])}"
            )
        if len(x_test) != len(y_test):
            raise DataError(f"{name}: {len(x_test)} test inputs but {len(y_test)} labels")
        if x_test.shape[1:] != x_train.shape[1:]:
            raise DataError(
                f"{name}: test inputs have shape {tuple(x_test.shape[1:])}, training inputs {tuple(x_train.shape[1:])}"
            )
    if len(x_train) == 0:
        raise DataError(f"{name}: the training set is empty")
    num_classes = _outputs(name, y_train, y_test, num_classes, test_given)
    dims = [0] + ([2, 3] if x_train.dim() == 4 else [])
    mean = x_train.mean(dim=dims, keepdim=True, dtype=torch.float64).float()
    std = (
        x_train.double().std(dim=dims, keepdim=True).float().clamp_min(1e-6)
        if len(x_train) > 1
        else torch.ones_like(mean)
    )
    x_train = (x_train - mean) / std
    x_test = (x_test - mean) / std
    for key, x in (("x", x_train), ("x_test", x_test)):
        if not whole and not torch.isfinite(x).all():  # finite values whose spread float32 cannot hold once centred
            raise DataError(
                f"{name}: '{key}' holds values too far apart for float32 (about +-3.4e38), which training "
                f"computes in, once centred: scale them"
            )
    fill = (-mean / std) if x_train.dim() == 4 else None  # a black pixel, normalised
    return Dataset(name, x_train.contiguous(), y_train, x_test.contiguous(), y_test, num_classes, where, fill)


def _outputs(
    name: str, y_train: torch.Tensor, y_test: torch.Tensor, num_classes: int | None, test_given: bool = True
) -> int:
    """The model's outputs: a regression's targets' width, or the classes (``num_classes``, else
    one past the largest label), checked: labels within them, and two classes or more to tell apart."""
    if y_train.dtype.is_floating_point:
        return int(y_train.shape[1])
    largest, key = max((int(y_train.max()), "y"), (int(y_test.max()) if len(y_test) else 0, "y_test"))
    if num_classes is None:
        # the classes are the training labels': a test label past them (test labels encoded otherwise,
        # 1-based) widened the model to it and scored 0 (an audit's: 7 outputs, accuracy 0.0, exit 0)
        top = int(y_train.max())
        if key == "y_test" and largest > top and test_given:  # (a held-out tenth may hold a rare class's all)
            raise DataError(
                f"{name}: 'y_test' has label {largest}, past the training labels (0..{top}): are the test "
                f"labels encoded as the training ones? (a class the training set lacks: from_arrays(num_classes=) "
                f"in Python)"
            )
        num_classes = formats.classes_from_labels(largest, f"{name}: '{key}'")
    elif largest + 1 > num_classes:
        raise DataError(f"{name}: labels must lie in 0..{num_classes - 1}, found {largest}")
    if len(y_train) > 1 and bool((y_train == y_train[0]).all()):
        raise DataError(f"{name}: every training label is {int(y_train[0])}: a classifier needs two classes or more")
    return num_classes


def _tensor(x: np.ndarray | torch.Tensor) -> torch.Tensor:
    if isinstance(x, torch.Tensor):
        return x
    x = np.asarray(x)
    return torch.from_numpy(x if x.flags.writeable else x.copy())


def _as_float(x: np.ndarray | torch.Tensor, name: str, key: str) -> torch.Tensor:
    t = _tensor(x)
    if t.dim() == 3:  # (N, H, W): one channel
        t = t.unsqueeze(1)
    elif t.dim() == 4 and t.shape[-1] in (1, 3) and t.shape[1] not in (1, 3):  # (N, H, W, C)
        t = t.permute(0, 3, 1, 2)
    elif t.dim() not in (2, 4):
        raise DataError(
            f"{name}: '{key}' must have 2 (N, D), 3 (N, H, W) or 4 (N, C, H, W) dimensions, "
            f"found shape {tuple(t.shape)}"
        )
    given, t = t, t.float()
    if not _integral(given) and not torch.isfinite(t).all():
        raise DataError(f"{name}: '{key}' {_not_finite(given)}")
    return t


def _integral(x: np.ndarray | torch.Tensor) -> bool:
    """Whether ``x`` holds integers (or booleans): finite once float32, whatever their values."""
    if isinstance(x, torch.Tensor):
        return not (x.dtype.is_floating_point or x.dtype.is_complex)
    return np.asarray(x).dtype.kind in "iub"


def _not_finite(given: torch.Tensor) -> str:
    """Why values that are not finite as float32 are not: the user's own NaN or infinity, or finite
    values beyond float32's range (about 3.4e38), which the cast made infinite."""
    if given.dtype.is_floating_point and torch.isfinite(given).all():
        return "holds values beyond float32's range (about +-3.4e38), which training computes in: scale them"
    return "contains NaN or infinite values"


def _as_targets(y: np.ndarray | torch.Tensor, name: str, key: str) -> torch.Tensor:
    """Integer class labels (N,), or float regression targets as (N, D) float32."""
    t = _tensor(y)
    if t.dtype.is_floating_point:
        if t.dim() not in (1, 2) or not torch.isfinite(t).all():
            raise DataError(
                f"{name}: '{key}' (float: regression targets) must be finite, of shape (N,) or (N, D), "
                f"found {tuple(t.shape)}"
            )
        if not torch.isfinite(t.float()).all():
            raise DataError(f"{name}: '{key}' (float: regression targets) {_not_finite(t)}")
        return (t[:, None] if t.dim() == 1 else t).float()
    if t.dim() != 1 or t.dtype == torch.bool:
        raise DataError(
            f"{name}: '{key}' must be a 1-D tensor of integer class labels, found {t.dtype} {tuple(t.shape)}"
        )
    if len(t) and t.dtype in (torch.uint16, torch.uint32, torch.uint64):  # (torch has no max of these)
        # one past int64's range would read as negative: a label that large is refused as such
        formats.classes_from_labels(int(t.cpu().numpy().max()), f"{name}: '{key}'")
    t = t.long()
    if len(t) and int(t.min()) < 0:
        raise DataError(f"{name}: '{key}' has negative labels")
    return t


def token_dataset(
    name: str, tokens: torch.Tensor, context: int, vocab: int, where: str = "", test_tokens: torch.Tensor | None = None
) -> Dataset:
    """A language model's Dataset: sequences of ``context`` tokens and their next tokens, from a
    stream (:func:`distsgd.data.text.token_arrays`: its end is the test set unless ``test_tokens``)."""
    return Dataset(name, *text.token_arrays(name, tokens, context, vocab, test_tokens), vocab, where)


def from_hf(obj: Any, context: int, name: str = "hf-dataset", where: str = "") -> Dataset:
    """A language model's Dataset from a Hugging Face ``datasets.Dataset`` or ``DatasetDict``
    (:func:`distsgd.data.text.hf_tokens`)."""
    train, test, vocab = text.hf_tokens(obj, name)
    return token_dataset(name, train, context, vocab, where, test)


def from_hf_stream(obj: Any, context: int, name: str = "hf-stream", where: str = "") -> TorchData:
    """A language model's data from a streaming Hugging Face dataset (``load_dataset(...,
    streaming=True)``): the training split read as it streams, its windows split between the
    workers as any stream is; the test split's sequences read once, into memory
    (:func:`distsgd.data.text.hf_stream_tokens`)."""
    train, test_tokens, vocab = text.hf_stream_tokens(obj, context, name)
    x_test, y_test = text.sequences(test_tokens, context)
    return TorchData(train, TensorDataset(x_test, y_test), name, where, num_classes=vocab)


def _load_text(path: Path, context: int) -> Dataset:
    return token_dataset(f"text:{path}", text.byte_tokens(text.read_text(path)), context, text.BYTE_VOCAB, str(path))


def _load_npz(path: Path) -> Dataset:
    arrays = formats.read_npz(path)
    return from_arrays(
        f"npz:{path}", arrays["x"], arrays["y"], arrays.get("x_test"), arrays.get("y_test"), where=str(path)
    )


def _load_folder(path: Path) -> TorchData:
    from distsgd.data.images import ImageFolder

    if not (path / "train").is_dir():
        raise DataError(f"folder dataset {path} needs a 'train' sub-folder (and 'test'), one folder per class")
    train = ImageFolder(path / "train")
    if (path / "test").is_dir():
        test = ImageFolder(path / "test", train.classes, (train.mean, train.std))
    else:
        train, test = train.split(HOLDOUT_FRACTION)
        log.info("folder:%s: no test/ folder; holding out %d of the training images", path, len(test))
    return TorchData(train, test, f"folder:{path}", str(path), num_classes=len(train.classes))


def _load_user(spec: str) -> TrainingData:
    function = user.load(spec, DataError, "dataset")
    try:
        result = function()
    except DataError:
        raise
    except (Exception, SystemExit) as exc:  # the user's code (sys.exit too): one line
        first = (str(exc).strip().splitlines() or [""])[0]
        raise DataError(f"{spec} failed: {type(exc).__name__}: {first}") from None
    return from_torch(result, spec, spec.rpartition(":")[0])


def _digits_file() -> Path | None:
    """scikit-learn's bundled copy of the UCI digits (``sklearn/datasets/data/digits.csv.gz``), found
    without importing scikit-learn (1.6 s of CPU, as much as torch's own import, for a 90 kB file);
    None where scikit-learn is not installed."""
    import importlib.util

    spec = importlib.util.find_spec("sklearn")
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations))) / "datasets" / "data" / "digits.csv.gz"


def _load_digits() -> Dataset:
    path = _digits_file()
    if path is None:
        raise DataError("the 'digits' dataset needs scikit-learn: pip install 'distsgd[digits]'")
    if path.is_file():  # as load_digits reads it: 64 pixels (0..16) and the class, a row an image
        rows = np.loadtxt(path, delimiter=",")
        images, labels = rows[:, :-1].reshape(-1, 8, 8), rows[:, -1]
    else:  # a scikit-learn that keeps it elsewhere
        from sklearn.datasets import load_digits

        bunch = load_digits()
        images, labels = bunch.images, bunch.target
    x = images.astype(np.float32)[:, None, :, :]  # (1797, 1, 8, 8), values 0..16
    y = labels.astype(np.int64)
    order = np.random.default_rng(0).permutation(len(y))
    n_test = 360
    test, train = order[:n_test], order[n_test:]
    return from_arrays("digits", x[train], y[train], x[test], y[test], num_classes=10, where="scikit-learn")


def available(data_dir: str | None = None) -> list[tuple[str, str, str]]:
    """(name, status, where) for every built-in dataset; never downloads."""
    return [(name, *builtin.status(name, data_dir)) for name, builtin in BUILTIN.items()]


@dataclass(frozen=True)
class Builtin:
    """A built-in dataset: how to load it (``load(name, data_dir, download, context)``) and what
    ``distsgd datasets`` says of it (``status(name, data_dir) -> (status, where)``, never
    downloading). The downloadable ones' files and mirrors are in :data:`sources.SOURCES`."""

    load: Callable[[str, str | None, bool | None, int], TrainingData]
    status: Callable[[str, str | None], tuple[str, str]]


def _load_idx(name: str, data_dir: str | None, download: bool | None, _context: int) -> Dataset:
    folder = sources.locate(name, data_dir, download)
    files = [sources.found_file(folder, n) for n in sources.SOURCES[name].needed]
    x_train, y_train = formats.read_idx_pair(files[0], files[1])
    x_test, y_test = formats.read_idx_pair(files[2], files[3])
    return from_arrays(name, x_train, y_train, x_test, y_test, num_classes=10, where=str(folder))


def _load_cifar10(name: str, data_dir: str | None, download: bool | None, _context: int) -> Dataset:
    folder = sources.locate(name, data_dir, download)
    parts = [formats.read_cifar_batch(folder / n) for n in sources.CIFAR_BATCHES]
    x_train = np.concatenate([p[0] for p in parts[:5]])
    y_train = np.concatenate([p[1] for p in parts[:5]])
    return from_arrays(name, x_train, y_train, parts[5][0], parts[5][1], num_classes=10, where=str(folder))


def _load_stdlib(name: str, _data_dir: str | None, _download: bool | None, context: int) -> Dataset:
    where = f"{text.stdlib_folder()} (Python {sys.version.split()[0]}, PSF License)"
    return token_dataset(name, text.byte_tokens(text.stdlib_text()), context, text.BYTE_VOCAB, where)


def _stdlib_status(_name: str, _data_dir: str | None) -> tuple[str, str]:
    return "available", f"{text.stdlib_folder()} (a language model's text, byte tokens)"


def _digits_status(_name: str, _data_dir: str | None) -> tuple[str, str]:
    if _digits_file() is None:
        return "missing", "pip install 'distsgd[digits]'"
    return "available", "bundled with scikit-learn"


# Every built-in --dataset name, in the order `distsgd datasets` and the help list them.
BUILTIN: dict[str, Builtin] = {
    "mnist": Builtin(_load_idx, sources.describe),
    "fashion-mnist": Builtin(_load_idx, sources.describe),
    "kmnist": Builtin(_load_idx, sources.describe),
    "cifar10": Builtin(_load_cifar10, sources.describe),
    "digits": Builtin(lambda *_: _load_digits(), _digits_status),
    "python-stdlib": Builtin(_load_stdlib, _stdlib_status),
}


__all__ = [
    "Dataset",
    "TrainingData",
    "Format",
    "FORMATS",
    "load_dataset",
    "from_arrays",
    "token_dataset",
    "from_hf",
    "from_hf_stream",
    "available",
    "BUILTIN",
    "Builtin",
    "dataset_help",
]
