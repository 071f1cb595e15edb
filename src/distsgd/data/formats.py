"""Readers for the dataset file formats distsgd understands.

Every reader validates what it reads (magic numbers, sizes, counts, label ranges) and raises a
``DataError`` that names the file when something is wrong. Readers return numpy arrays:
images as uint8 or float32 in (N, C, H, W) layout, labels as int64.
"""

from __future__ import annotations

import gzip
import io
import math
import pickle
import struct
import zipfile
import zlib
from pathlib import Path

import numpy as np

from distsgd.errors import DataError

# IDX: magic = 0x00 0x00 <type code> <number of dimensions>; 0x08 is unsigned byte.
_IDX_TYPES: dict[int, np.dtype] = {
    0x08: np.dtype(np.uint8),
    0x09: np.dtype(np.int8),
    0x0B: np.dtype(">i2"),
    0x0C: np.dtype(">i4"),
    0x0D: np.dtype(">f4"),
    0x0E: np.dtype(">f8"),
}


MAX_BYTES = 1 << 36  # 64 GiB: an array whose header claims more is refused, not allocated
NPZ_KEYS = ("x", "y", "x_test", "y_test")  # the arrays of an npz dataset (nothing else in the file is read)
DEFLATE_MAX_RATIO = 1032  # deflate's largest expansion (RFC 1951: a 258-byte match in about 2 bits)
# Classes counted from labels (the largest + 1) beyond which the labels are refused: a model has
# one output per class, and labels near 2**25 would ask for a last layer of ~17 GB (2**40: 0.5 PB).
MAX_CLASSES = 1 << 20


def _open(path: Path):  # noqa: ANN202 - a binary file object
    return gzip.open(path, "rb") if path.suffix == ".gz" else path.open("rb")


def _corrupt(path: Path, exc: BaseException) -> DataError:
    return DataError(f"cannot read {path}: {exc} (the file is corrupt or truncated; delete it and fetch it again)")


def read_idx(path: str | Path, expect_dims: int | None = None) -> np.ndarray:
    """Read an IDX file (the MNIST family's format), plain or gzipped. The header is read first and
    checked; then exactly the bytes it announces (a gzip bomb, or a header that claims more than
    the file holds, is refused without reading it all into memory)."""
    path = Path(path)
    try:
        with _open(path) as fh:
            magic = fh.read(4)
            if len(magic) < 4:
                raise DataError(f"{path} is not an IDX file: only {len(magic)} bytes")
            zero, type_code, ndim = struct.unpack(">HBB", magic)
            if zero != 0 or type_code not in _IDX_TYPES or ndim == 0:
                raise DataError(f"{path} is not an IDX file: bad magic number 0x{magic.hex()}")
            if expect_dims is not None and ndim != expect_dims:
                raise DataError(f"{path}: expected an IDX file of {expect_dims} dimensions, found {ndim}")
            dims = fh.read(4 * ndim)
            if len(dims) < 4 * ndim:
                raise DataError(f"{path} is truncated: its header is incomplete")
            shape = struct.unpack(f">{ndim}I", dims)
            dtype = _IDX_TYPES[type_code]
            expected = math.prod(shape) * dtype.itemsize  # Python ints: no overflow
            if expected > MAX_BYTES:
                raise DataError(
                    f"{path}: its header claims shape {tuple(shape)}, {expected} bytes; refusing to read "
                    f"more than {MAX_BYTES} bytes"
                )
            size = path.stat().st_size
            most = size * DEFLATE_MAX_RATIO if path.suffix == ".gz" else size - 4 - 4 * ndim
            if expected > most:  # a gzip bomb, or a header claiming more than the file can hold: not read
                raise DataError(
                    f"{path} is truncated: its header claims shape {tuple(shape)}, {expected} bytes, but "
                    f"the file {'can hold at most' if path.suffix == '.gz' else 'holds'} {max(most, 0)}"
                )
            body = fh.read(expected + 1)  # one byte more: a file longer than its header says
    except DataError:
        raise
    except (OSError, EOFError, zlib.error, MemoryError) as exc:
        raise _corrupt(path, exc) from None
    if len(body) != expected:
        kind = "truncated" if len(body) < expected else "longer than its header says"
        raise DataError(
            f"{path} is {kind}: {'at least ' if len(body) > expected else ''}{len(body)} bytes of data "
            f"for shape {tuple(shape)}, expected {expected}"
        )
    return np.frombuffer(body, dtype=dtype).reshape(shape)


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


def classes_from_labels(largest: int, where: object) -> int:
    """The number of classes that labels whose largest is ``largest`` make (largest + 1), or one
    DataError naming the labels when it is more than a model can have outputs (:data:`MAX_CLASSES`)."""
    if largest >= MAX_CLASSES:
        raise DataError(
            f"{where}: the largest label is {largest}, so a model would need {largest + 1} outputs (one per "
            f"class; at most {MAX_CLASSES}): labels are class indices 0..C-1, so number your classes from 0"
        )
    return largest + 1


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
    except Exception as exc:  # a restricted unpickler on a damaged file raises many kinds
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise DataError(f"cannot read CIFAR batch {path}: {first}") from None
    if not isinstance(batch, dict) or b"data" not in batch or b"labels" not in batch:
        raise DataError(f"{path} is not a CIFAR-10 batch: no 'data' and 'labels'")
    try:
        data = np.asarray(batch[b"data"])
        labels = np.asarray(batch[b"labels"])
    except (ValueError, TypeError, MemoryError) as exc:
        raise DataError(f"{path}: its data or labels are not arrays ({exc})") from None
    if labels.ndim != 1 or labels.dtype.kind not in "iu":
        raise DataError(f"{path}: CIFAR labels must be a list of integers, found {labels.dtype} {labels.shape}")
    labels = labels.astype(np.int64)
    if data.dtype != np.uint8 or data.ndim != 2 or data.shape[1] != 3 * 32 * 32:
        raise DataError(f"{path}: CIFAR data must be uint8 of shape (N, 3072), found {data.dtype} {data.shape}")
    if len(data) != len(labels):
        raise DataError(f"{path} has {len(data)} images but {len(labels)} labels")
    check_labels(labels, 10, path)
    return data.reshape(-1, 3, 32, 32), labels


def _check_npz_headers(path: Path) -> set[str]:
    """The dataset's arrays (of :data:`NPZ_KEYS`) that ``path`` holds as .npy members; each one's
    header read before its data: a shape that claims more bytes than the member holds (or than
    MAX_BYTES) is refused before numpy would allocate it."""
    found: set[str] = set()
    try:
        with zipfile.ZipFile(path) as zf:
            for info in zf.infolist():
                if info.filename not in {f"{k}.npy" for k in NPZ_KEYS}:  # only these are read
                    continue
                found.add(info.filename[:-4])
                with zf.open(info) as fh:
                    version = np.lib.format.read_magic(fh)
                    read = (
                        np.lib.format.read_array_header_1_0
                        if version == (1, 0)
                        else np.lib.format.read_array_header_2_0
                    )
                    shape, _, dtype = read(fh)
                    claimed = math.prod(shape) * dtype.itemsize
                    if claimed > MAX_BYTES or claimed > info.file_size:
                        raise DataError(
                            f"{path}: array '{info.filename[:-4]}' claims shape {shape} ({claimed} "
                            f"bytes) but holds {info.file_size} bytes"
                        )
    except DataError:
        raise
    except (OSError, ValueError, zlib.error, EOFError, zipfile.BadZipFile, MemoryError, KeyError) as exc:
        raise DataError(f"cannot read {path}: {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}") from None
    return found


def read_npz(path: str | Path) -> dict[str, np.ndarray]:
    """User arrays: ``x``, ``y`` and optionally ``x_test``, ``y_test`` (no pickled objects)."""
    path = Path(path)
    if not path.exists():
        raise DataError(f"npz file not found: {path}")
    if path.is_dir():
        raise DataError(f"npz:{path} is a directory: give an .npz file (numpy.savez)")
    if not path.is_file():
        raise DataError(f"npz:{path} is not a regular file (a device, a pipe or a socket): give an .npz file")
    wanted = _check_npz_headers(path)
    try:
        with np.load(path, allow_pickle=False) as npz:
            names = list(npz.files)
            arrays = {k: npz[k] for k in wanted}  # other members are never read
    except (OSError, ValueError, zlib.error, EOFError, zipfile.BadZipFile, MemoryError, KeyError) as exc:
        raise DataError(f"cannot read {path}: {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}") from None
    for key in ("x", "y"):
        if key not in arrays:
            raise DataError(f"{path} has no array '{key}' (it has: {', '.join(sorted(names)) or 'none'})")
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
                raise DataError(
                    f"{path}: '{y_key}' (float: regression targets) must be finite, of shape (N,) or "
                    f"(N, D), found {y.shape}"
                )
        else:
            raise DataError(f"{path}: '{y_key}' must hold integer labels or float targets, found dtype {y.dtype}")
        if len(x) != len(y):
            raise DataError(f"{path}: '{x_key}' has {len(x)} rows but '{y_key}' has {len(y)}")
    return arrays
