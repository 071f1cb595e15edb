"""Readers for the dataset file formats distsgd understands.

Every reader validates what it reads (magic numbers, sizes, counts, label ranges) and raises a
``DataError`` that names the file when something is wrong. Readers return numpy arrays:
images as uint8 or float32 in (N, C, H, W) layout, labels as int64.
"""

from __future__ import annotations

import gzip
import io
import pickle
import struct
import zipfile
import zlib
from pathlib import Path

import numpy as np

from distsgd.errors import DataError

# IDX: magic = 0x00 0x00 <type code> <number of dimensions>; 0x08 is unsigned byte.
_IDX_TYPES = {0x08: np.uint8, 0x09: np.int8, 0x0B: np.dtype(">i2"), 0x0C: np.dtype(">i4"),
              0x0D: np.dtype(">f4"), 0x0E: np.dtype(">f8")}


def _read_bytes(path: Path) -> bytes:
    try:
        if path.suffix == ".gz":
            with gzip.open(path, "rb") as fh:
                return fh.read()
        return path.read_bytes()
    except (OSError, EOFError, zlib.error) as exc:
        raise DataError(f"cannot read {path}: {exc} (the file is corrupt or truncated; delete it and fetch it again)") from None


def read_idx(path: str | Path, expect_dims: int | None = None) -> np.ndarray:
    """Read an IDX file (the MNIST family's format), plain or gzipped."""
    path = Path(path)
    raw = _read_bytes(path)
    if len(raw) < 4:
        raise DataError(f"{path} is not an IDX file: only {len(raw)} bytes")
    zero, type_code, ndim = struct.unpack(">HBB", raw[:4])
    if zero != 0 or type_code not in _IDX_TYPES or ndim == 0:
        raise DataError(f"{path} is not an IDX file: bad magic number 0x{raw[:4].hex()}")
    if expect_dims is not None and ndim != expect_dims:
        raise DataError(f"{path}: expected an IDX file of {expect_dims} dimensions, found {ndim}")
    header = 4 + 4 * ndim
    if len(raw) < header:
        raise DataError(f"{path} is truncated: its header is incomplete")
    shape = struct.unpack(f">{ndim}I", raw[4:header])
    dtype = np.dtype(_IDX_TYPES[type_code])
    expected = int(np.prod(shape)) * dtype.itemsize
    body = len(raw) - header
    if body != expected:
        kind = "truncated" if body < expected else "longer than its header says"
        raise DataError(f"{path} is {kind}: {body} bytes of data for shape {tuple(shape)}, expected {expected}")
    return np.frombuffer(raw, dtype=dtype, offset=header).reshape(shape)


def read_idx_pair(images: Path, labels: Path, num_classes: int = 10) -> tuple[np.ndarray, np.ndarray]:
    """Images (N, 1, H, W) uint8 and labels (N,) int64 from two IDX files, cross-checked."""
    x = read_idx(images, expect_dims=3)
    y = read_idx(labels, expect_dims=1)
    if x.dtype != np.uint8 or y.dtype != np.uint8:
        raise DataError(f"{images} / {labels}: expected unsigned-byte IDX files")
    if len(x) != len(y):
        raise DataError(f"{images} has {len(x)} images but {labels} has {len(y)} labels")
    y = y.astype(np.int64)
    check_labels(y, num_classes, labels)
    return x[:, None, :, :], y


def check_labels(y: np.ndarray, num_classes: int, where: object) -> None:
    if len(y) and (y.min() < 0 or y.max() >= num_classes):
        raise DataError(f"{where}: labels must lie in 0..{num_classes - 1}, found {int(y.min())}..{int(y.max())}")


class _CifarUnpickler(pickle.Unpickler):
    """Unpickles CIFAR-10's batches and nothing else: only numpy arrays and builtins."""

    _ALLOWED = {
        ("numpy.core.multiarray", "_reconstruct"),
        ("numpy._core.multiarray", "_reconstruct"),
        ("numpy", "ndarray"),
        ("numpy", "dtype"),
        ("_codecs", "encode"),  # how protocol-2 pickles written by Python 3 store bytes
    }

    def find_class(self, module: str, name: str):  # noqa: ANN201 - pickle's signature
        if (module, name) in self._ALLOWED:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"refusing to load {module}.{name} from a CIFAR batch")


def read_cifar_batch(path: str | Path) -> tuple[np.ndarray, np.ndarray]:
    """One CIFAR-10 python batch: images (N, 3, 32, 32) uint8 and labels (N,) int64."""
    path = Path(path)
    try:
        with path.open("rb") as fh:
            batch = _CifarUnpickler(io.BytesIO(fh.read()), encoding="bytes").load()
    except (OSError, EOFError, pickle.UnpicklingError, ValueError, TypeError, IndexError) as exc:
        raise DataError(f"cannot read CIFAR batch {path}: {exc}") from None
    if not isinstance(batch, dict) or b"data" not in batch or b"labels" not in batch:
        raise DataError(f"{path} is not a CIFAR-10 batch: no 'data' and 'labels'")
    data = np.asarray(batch[b"data"])
    labels = np.asarray(batch[b"labels"], dtype=np.int64)
    if data.dtype != np.uint8 or data.ndim != 2 or data.shape[1] != 3 * 32 * 32:
        raise DataError(f"{path}: CIFAR data must be uint8 of shape (N, 3072), found {data.dtype} {data.shape}")
    if len(data) != len(labels):
        raise DataError(f"{path} has {len(data)} images but {len(labels)} labels")
    check_labels(labels, 10, path)
    return data.reshape(-1, 3, 32, 32), labels


def read_npz(path: str | Path) -> dict[str, np.ndarray]:
    """User arrays: ``x``, ``y`` and optionally ``x_test``, ``y_test`` (no pickled objects)."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"npz file not found: {path}")
    try:
        with np.load(path, allow_pickle=False) as npz:
            arrays = {k: npz[k] for k in npz.files}
    except (OSError, ValueError, zlib.error, EOFError, zipfile.BadZipFile) as exc:
        raise DataError(f"cannot read {path}: {exc}") from None
    for key in ("x", "y"):
        if key not in arrays:
            raise DataError(f"{path} has no array '{key}' (it has: {', '.join(sorted(arrays)) or 'none'})")
    if ("x_test" in arrays) != ("y_test" in arrays):
        raise DataError(f"{path}: give both 'x_test' and 'y_test', or neither")
    for x_key, y_key in (("x", "y"), ("x_test", "y_test")):
        if x_key not in arrays:
            continue
        x, y = arrays[x_key], arrays[y_key]
        if x.dtype.kind not in "fiub":
            raise DataError(f"{path}: '{x_key}' must be numeric, found dtype {x.dtype}")
        if x.ndim == 0:
            raise DataError(f"{path}: '{x_key}' must hold one row per sample, found a single number")
        if x.dtype.kind == "f" and not np.isfinite(x).all():
            raise DataError(f"{path}: '{x_key}' contains NaN or infinite values")
        if y.dtype.kind in "iu":
            if y.ndim != 1:
                raise DataError(f"{path}: '{y_key}' must be a 1-D array of integer labels, found {y.dtype} {y.shape}")
            if len(y) and y.min() < 0:
                raise DataError(f"{path}: '{y_key}' has negative labels")
        elif y.dtype.kind == "f":  # regression targets
            if y.ndim not in (1, 2) or not np.isfinite(y).all():
                raise DataError(f"{path}: '{y_key}' (float: regression targets) must be finite, of shape (N,) or "
                                f"(N, D), found {y.shape}")
        else:
            raise DataError(f"{path}: '{y_key}' must hold integer labels or float targets, found dtype {y.dtype}")
        if len(x) != len(y):
            raise DataError(f"{path}: '{x_key}' has {len(x)} rows but '{y_key}' has {len(y)}")
    return arrays


