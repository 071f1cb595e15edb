"""Datasets: read once, validated, normalised, held in memory as tensors.

``load_dataset("fashion-mnist")`` returns a :class:`Dataset` whose tensors the training loop
indexes directly (no per-sample Python transforms). ``Dataset.share_memory_()`` moves the tensors
into shared memory so that worker processes started with ``spawn`` read one copy instead of
copying it each.

Names: ``mnist``, ``fashion-mnist``, ``kmnist``, ``cifar10``, ``digits``, ``npz:PATH`` and
``folder:PATH``. See :mod:`distsgd.data.sources` for where files are looked for.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from distsgd.data import formats, sources
from distsgd.errors import DataError

log = logging.getLogger(__name__)

BUILTIN = ("mnist", "fashion-mnist", "kmnist", "cifar10", "digits")
HOLDOUT_FRACTION = 0.1  # test share carved from the training arrays when no test set is given


@dataclass
class Dataset:
    """Normalised tensors of one dataset. ``x`` is float32 (N, C, H, W) or (N, D); ``y`` is int64."""

    name: str
    x_train: torch.Tensor
    y_train: torch.Tensor
    x_test: torch.Tensor
    y_test: torch.Tensor
    num_classes: int
    where: str = ""

    @property
    def input_shape(self) -> tuple[int, ...]:
        return tuple(self.x_train.shape[1:])

    def batches(self, order: torch.Tensor, start: int, batch_size: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """The training batches of ``order`` (sample indices) from position ``start``: tensor indexing."""
        for first in range(start, len(order), batch_size):
            idx = order[first:first + batch_size]
            yield self.x_train[idx], self.y_train[idx]

    def share_memory_(self) -> "Dataset":
        for t in (self.x_train, self.y_train, self.x_test, self.y_test):
            t.share_memory_()
        return self

    def __repr__(self) -> str:
        return (f"Dataset({self.name!r}, train={len(self.y_train)}, test={len(self.y_test)}, "
                f"input={self.input_shape}, classes={self.num_classes})")


def load_dataset(spec: str, data_dir: str | None = None, download: bool | None = None) -> Dataset:
    """Load a built-in dataset by name, or user data given as ``npz:PATH`` or ``folder:PATH``."""
    if spec.startswith("npz:"):
        return _load_npz(Path(spec[4:]))
    if spec.startswith("folder:"):
        return _load_folder(Path(spec[7:]))
    if spec == "digits":
        return _load_digits()
    if spec in ("mnist", "fashion-mnist", "kmnist"):
        folder = sources.locate(spec, data_dir, download)
        files = [sources.resolve_file(folder, n) for n in sources.SOURCES[spec].needed]
        x_train, y_train = formats.read_idx_pair(files[0], files[1])
        x_test, y_test = formats.read_idx_pair(files[2], files[3])
        return from_arrays(spec, x_train, y_train, x_test, y_test, num_classes=10, where=str(folder))
    if spec == "cifar10":
        folder = sources.locate(spec, data_dir, download)
        parts = [formats.read_cifar_batch(folder / n) for n in sources.CIFAR_BATCHES]
        x_train = np.concatenate([p[0] for p in parts[:5]])
        y_train = np.concatenate([p[1] for p in parts[:5]])
        return from_arrays(spec, x_train, y_train, parts[5][0], parts[5][1], num_classes=10, where=str(folder))
    raise DataError(f"unknown dataset '{spec}' (choose from {', '.join(BUILTIN)}, npz:PATH, folder:PATH)")


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

    Images are normalised per channel, flat feature vectors per feature. Without a test set,
    a deterministic 10% of the training rows is held out for evaluation.
    """
    x_train = _as_float(x_train, name, "x")
    y_train = _as_labels(y_train, name, "y")
    if len(x_train) != len(y_train):
        raise DataError(f"{name}: {len(x_train)} training inputs but {len(y_train)} labels")
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
        y_test = _as_labels(y_test, name, "y_test")
        if len(x_test) != len(y_test):
            raise DataError(f"{name}: {len(x_test)} test inputs but {len(y_test)} labels")
        if x_test.shape[1:] != x_train.shape[1:]:
            raise DataError(f"{name}: test inputs have shape {tuple(x_test.shape[1:])}, "
                            f"training inputs {tuple(x_train.shape[1:])}")
    if len(x_train) == 0:
        raise DataError(f"{name}: the training set is empty")
    inferred = int(max(int(y_train.max()), int(y_test.max()) if len(y_test) else 0)) + 1
    if num_classes is None:
        num_classes = inferred
    elif inferred > num_classes:
        raise DataError(f"{name}: labels must lie in 0..{num_classes - 1}, found {inferred - 1}")
    dims = [0] + ([2, 3] if x_train.dim() == 4 else [])
    mean = x_train.mean(dim=dims, keepdim=True, dtype=torch.float64).float()
    std = x_train.double().std(dim=dims, keepdim=True).float().clamp_min(1e-6) if len(x_train) > 1 \
        else torch.ones_like(mean)
    x_train = (x_train - mean) / std
    x_test = (x_test - mean) / std
    return Dataset(name, x_train.contiguous(), y_train, x_test.contiguous(), y_test, num_classes, where)


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
        raise DataError(f"{name}: '{key}' must have 2 (N, D), 3 (N, H, W) or 4 (N, C, H, W) dimensions, "
                        f"found shape {tuple(t.shape)}")
    t = t.float()
    if not torch.isfinite(t).all():
        raise DataError(f"{name}: '{key}' contains NaN or infinite values")
    return t


def _as_labels(y: np.ndarray | torch.Tensor, name: str, key: str) -> torch.Tensor:
    t = _tensor(y)
    if t.dim() != 1 or t.dtype.is_floating_point or t.dtype == torch.bool:
        raise DataError(f"{name}: '{key}' must be a 1-D tensor of integer class labels, found {t.dtype} {tuple(t.shape)}")
    t = t.long()
    if len(t) and int(t.min()) < 0:
        raise DataError(f"{name}: '{key}' has negative labels")
    return t


def _load_npz(path: Path) -> Dataset:
    arrays = formats.read_npz(path)
    return from_arrays(f"npz:{path}", arrays["x"], arrays["y"], arrays.get("x_test"), arrays.get("y_test"),
                       where=str(path))


def _load_folder(path: Path) -> Dataset:
    if not (path / "train").is_dir():
        raise DataError(f"folder dataset {path} needs a 'train' sub-folder (and 'test'), one folder per class")
    x_train, y_train, classes = formats.read_image_folder(path / "train")
    x_test = y_test = None
    if (path / "test").is_dir():
        x_test, y_test, _ = formats.read_image_folder(path / "test", classes)
    return from_arrays(f"folder:{path}", x_train, y_train, x_test, y_test, num_classes=len(classes), where=str(path))


def _load_digits() -> Dataset:
    try:
        from sklearn.datasets import load_digits
    except ImportError:
        raise DataError("the 'digits' dataset needs scikit-learn: pip install 'distsgd[digits]'") from None
    bunch = load_digits()
    x = bunch.images.astype(np.float32)[:, None, :, :]  # (1797, 1, 8, 8), values 0..16
    y = bunch.target.astype(np.int64)
    order = np.random.default_rng(0).permutation(len(y))
    n_test = 360
    test, train = order[:n_test], order[n_test:]
    return from_arrays("digits", x[train], y[train], x[test], y[test], num_classes=10, where="scikit-learn")


def available(data_dir: str | None = None) -> list[tuple[str, str, str]]:
    """(name, status, where) for every built-in dataset; never downloads."""
    rows = []
    for name in BUILTIN:
        if name == "digits":
            try:
                import sklearn  # noqa: F401

                rows.append((name, "available", "bundled with scikit-learn"))
            except ImportError:
                rows.append((name, "missing", "pip install 'distsgd[digits]'"))
            continue
        status, where = sources.describe(name, data_dir)
        rows.append((name, status, where))
    return rows


__all__ = ["Dataset", "load_dataset", "from_arrays", "available", "BUILTIN"]
