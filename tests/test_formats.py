"""The file readers: real formats written here, and every way they can be broken."""

from __future__ import annotations

import pickle
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from distsgd.data import formats, from_arrays, load_dataset
from distsgd.data.images import read_image
from distsgd.errors import DataError
from helpers import make_idx_dataset, write_idx


@pytest.mark.parametrize("gz", [False, True])
def test_idx_round_trip(tmp_path: Path, gz: bool) -> None:
    arr = np.arange(2 * 3 * 4, dtype=np.uint8).reshape(2, 3, 4)
    path = write_idx(tmp_path / ("a.gz" if gz else "a"), arr, gz=gz)
    np.testing.assert_array_equal(formats.read_idx(path), arr)


def test_idx_bad_magic_names_file(tmp_path: Path) -> None:
    path = write_idx(tmp_path / "bad", np.zeros((2, 2, 2)), magic=0x12345678)
    with pytest.raises(DataError, match=r"bad.*bad magic number 0x12345678"):
        formats.read_idx(path)


def test_idx_truncated(tmp_path: Path) -> None:
    path = write_idx(tmp_path / "t", np.zeros((4, 5, 5)))
    path.write_bytes(path.read_bytes()[:-7])
    with pytest.raises(
        DataError, match=r"t is truncated: its header claims shape \(4, 5, 5\), 100 bytes, but the file holds 93"
    ):
        formats.read_idx(path)


def test_idx_truncated_gzip(tmp_path: Path) -> None:
    path = write_idx(tmp_path / "t.gz", np.random.default_rng(0).integers(0, 255, (50, 28, 28)), gz=True)
    path.write_bytes(path.read_bytes()[:2000])
    with pytest.raises(DataError, match="t.gz.*corrupt or truncated"):
        formats.read_idx(path)


def test_idx_pair_checks_counts_and_labels(tmp_path: Path) -> None:
    images = write_idx(tmp_path / "i", np.zeros((3, 28, 28)))
    labels = write_idx(tmp_path / "l", np.array([0, 1]))
    with pytest.raises(DataError, match="3 images but .* 2 labels"):
        formats.read_idx_pair(images, labels)
    labels = write_idx(tmp_path / "l", np.array([0, 1, 12]))
    with pytest.raises(DataError, match=r"labels must lie in 0..9, found 0..12"):
        formats.read_idx_pair(images, labels)
    with pytest.raises(DataError, match="expected an IDX file of 3 dimensions"):
        formats.read_idx_pair(labels, labels)


def test_idx_dataset_loads_from_data_dir_normalised(tmp_path: Path) -> None:
    make_idx_dataset(tmp_path / "fm")
    ds = load_dataset("fashion-mnist", data_dir=str(tmp_path / "fm"))
    assert ds.x_train.shape == (60, 1, 28, 28) and ds.x_test.shape == (20, 1, 28, 28)
    assert ds.num_classes == 10 and ds.y_train.dtype.is_floating_point is False
    assert abs(float(ds.x_train.mean())) < 1e-4 and abs(float(ds.x_train.std()) - 1) < 1e-2


def _cifar_batch(path: Path, n: int, label_max: int = 9) -> None:
    rng = np.random.default_rng(1)
    batch = {
        b"data": rng.integers(0, 256, (n, 3072), dtype=np.uint8),
        b"labels": list(rng.integers(0, label_max + 1, n).tolist()),
        b"batch_label": b"x",
    }
    path.write_bytes(pickle.dumps(batch, protocol=2))


def test_cifar_batches(tmp_path: Path) -> None:
    folder = tmp_path / "cifar-10-batches-py"
    folder.mkdir()
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        _cifar_batch(folder / name, 10)
    ds = load_dataset("cifar10", data_dir=str(tmp_path))
    assert ds.x_train.shape == (50, 3, 32, 32) and ds.x_test.shape == (10, 3, 32, 32)


def test_cifar_refuses_code_in_pickles(tmp_path: Path) -> None:
    class Evil:
        def __reduce__(self):
            import os

            return (os.system, ("echo pwned",))

    path = tmp_path / "data_batch_1"
    path.write_bytes(pickle.dumps({b"data": Evil(), b"labels": []}))
    with pytest.raises(DataError, match="refusing to load"):
        formats.read_cifar_batch(path)


def test_cifar_bad_shape_and_labels(tmp_path: Path) -> None:
    path = tmp_path / "b"
    path.write_bytes(pickle.dumps({b"data": np.zeros((2, 100), np.uint8), b"labels": [0, 1]}))
    with pytest.raises(DataError, match=r"shape \(N, 3072\)"):
        formats.read_cifar_batch(path)
    _cifar_batch(path, 5, label_max=20)
    with pytest.raises(DataError, match="labels must lie"):
        formats.read_cifar_batch(path)


def test_npz_user_data(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    path = tmp_path / "d.npz"
    np.savez(
        path,
        x=rng.normal(size=(100, 5)).astype(np.float32),
        y=rng.integers(0, 3, 100),
        x_test=rng.normal(size=(20, 5)),
        y_test=rng.integers(0, 3, 20),
    )
    ds = load_dataset(f"npz:{path}")
    assert ds.input_shape == (5,) and len(ds.y_train) == 100 and len(ds.y_test) == 20 and ds.num_classes == 3


def test_npz_without_test_holds_out_ten_percent(tmp_path: Path) -> None:
    path = tmp_path / "d.npz"
    np.savez(path, x=np.arange(200, dtype=np.float32).reshape(100, 2), y=np.arange(100) % 4)
    ds = load_dataset(f"npz:{path}")
    assert len(ds.y_train) == 90 and len(ds.y_test) == 10
    # a rare class whose one sample the held-out tenth took (rows 11 and 20 of 21): its classes, not
    # a refusal of test labels the file never gave
    y = np.arange(21) % 2
    y[11] = 2
    np.savez(path, x=np.arange(42, dtype=np.float32).reshape(21, 2), y=y)
    ds = load_dataset(f"npz:{path}")
    assert int(ds.y_test.max()) == 2 and ds.num_classes == 3


@pytest.mark.parametrize(
    "arrays, message",
    [
        ({"x": np.zeros((3, 2))}, "no array 'y'"),
        ({"x": np.array([[np.nan, 1.0]]), "y": np.array([0])}, "NaN"),
        ({"x": np.zeros((3, 2)), "y": np.zeros(2, dtype=int)}, "3 rows but 'y' has 2"),
        ({"x": np.zeros((3, 2)), "y": np.array(["a", "b", "c"])}, "integer labels or float targets"),
        ({"x": np.zeros((3, 2)), "y": np.array([0.5, np.inf, 1.0])}, "regression targets"),
        ({"x": np.zeros((3, 2)), "y": np.array([0, -1, 1])}, "negative labels"),
        # one past int64's range: it was called negative (it wraps to -1 in int64)
        ({"x": np.zeros((3, 2)), "y": np.array([0, 2**64 - 1, 1], dtype=np.uint64)}, "largest label is 18446744"),
        ({"x": np.zeros((3, 2)), "y": np.array([0, 2**32 - 1, 1], dtype=np.uint32)}, "largest label is 4294967295"),
        (
            {"x": np.zeros((3, 2)), "y": np.zeros(3, dtype=int), "x_test": np.zeros((1, 2))},
            "both 'x_test' and 'y_test'",
        ),
        # finite, but not in float32 (8f65d93: "contains NaN or infinite values", or trained to a NaN
        # loss, exit 0, with a warning that blamed the lr)
        ({"x": np.full((3, 2), 1e300), "y": np.array([0, 1, 1])}, "beyond float32's range"),
        ({"x": np.zeros((3, 2)), "y": np.array([0.5, 1e300, 1.0])}, r"regression targets\) holds values beyond"),
        ({"x": np.array([[3.3e38], [3.3e38], [-3.3e38]], np.float32), "y": np.array([0, 1, 1])}, "too far apart"),
        # one class: 8f65d93 trained to "test accuracy 1.0000, test loss 0.0000", exit 0
        ({"x": np.zeros((3, 2)), "y": np.full(3, 2)}, "every training label is 2: a classifier needs two"),
        # test labels encoded otherwise: the model had 7 outputs and scored 0.0, exit 0 (an audit's, 2026-12-01)
        (
            {
                "x": np.zeros((4, 2)),
                "y": np.array([0, 1, 0, 1]),
                "x_test": np.zeros((2, 2)),
                "y_test": np.array([5, 6]),
            },
            r"'y_test' has label 6, past the training labels \(0..1\)",
        ),
    ],
)
def test_npz_bad_arrays(tmp_path: Path, arrays: dict, message: str) -> None:
    path = tmp_path / "bad.npz"
    np.savez(path, **arrays)
    with pytest.raises(DataError, match=message):
        load_dataset(f"npz:{path}")


def test_npz_corrupt_and_missing(tmp_path: Path) -> None:
    path = tmp_path / "c.npz"
    path.write_bytes(b"PK\x03\x04 not really a zip")
    with pytest.raises(DataError, match="cannot read"):
        load_dataset(f"npz:{path}")
    with pytest.raises(DataError, match="npz file not found"):
        load_dataset(f"npz:{tmp_path / 'nope.npz'}")


def test_image_folder_streams_images(tmp_path: Path) -> None:
    Image = pytest.importorskip("PIL.Image")
    rng = np.random.default_rng(0)
    for split, n in (("train", 4), ("test", 2)):
        for cls in ("cat", "dog"):
            (tmp_path / split / cls).mkdir(parents=True)
            for i in range(n):
                Image.fromarray(rng.integers(0, 256, (6, 5, 3), dtype=np.uint8)).save(
                    tmp_path / split / cls / f"{i}.png"
                )
    ds = load_dataset(f"folder:{tmp_path}")
    assert ds.input_shape == (3, 6, 5) and ds.num_classes == 2 and (ds.n_train, ds.n_test) == (8, 4)
    assert ds.train.labels == [0] * 4 + [1] * 4
    x, y = ds.train[5]
    assert x.shape == (3, 6, 5) and y == 1
    mean = torch.stack([ds.train[i][0] for i in range(8)]).mean(dim=(0, 2, 3))
    assert mean.abs().max() < 1e-4  # normalised with the training images' statistics
    # Images are read as training goes: a bad one is found when it is read, and named.
    # (The statistics are taken from up to 512 images, here all: a bad one is found at once.)
    Image.fromarray(np.zeros((7, 7, 3), dtype=np.uint8)).save(tmp_path / "train" / "dog" / "odd.png")
    with pytest.raises(DataError, match="odd.png is 7x7, but the first image is 6x5"):
        ds.train.files.append(str(tmp_path / "train" / "dog" / "odd.png"))
        ds.train[len(ds.train) - 1]
    with pytest.raises(DataError, match="odd.png is 7x7"):
        load_dataset(f"folder:{tmp_path}")
    (tmp_path / "train" / "dog" / "odd.png").write_bytes(b"\x89PNG broken")
    with pytest.raises(DataError, match="cannot read image .*odd.png"):
        load_dataset(f"folder:{tmp_path}")


def test_image_folders_as_torchvision_reads_them_or_refused(tmp_path: Path) -> None:
    """8f65d93: a class of .webp images was an empty class, silently (trained on the other alone,
    test accuracy 1.0); Jupyter's train/.ipynb_checkpoints was a class; 16-bit PNGs were clipped
    at 255 (two classes apart by brightness trained to chance); one class trained to accuracy 1.0."""
    Image = pytest.importorskip("PIL.Image")
    rng = np.random.default_rng(0)

    def save(path: Path, arr: np.ndarray) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        Image.fromarray(arr).save(path)

    for i in range(3):
        save(tmp_path / "a" / "train" / "cat" / f"{i}.webp", rng.integers(0, 256, (4, 4), dtype=np.uint8))
        save(tmp_path / "a" / "train" / "dog" / f"{i}.png", rng.integers(0, 256, (4, 4), dtype=np.uint8))
        save(tmp_path / "b" / "train" / "dark" / f"{i}.png", np.full((4, 4), 1000 * i, np.uint16))
        save(tmp_path / "b" / "train" / "bright" / f"{i}.png", np.full((4, 4), 60000 + 1000 * i, np.uint16))
    (tmp_path / "a" / "train" / ".ipynb_checkpoints").mkdir()
    ds = load_dataset(f"folder:{tmp_path / 'a'}")
    assert ds.train.classes == ["cat", "dog"] and ds.n_train + ds.n_test == 6
    ds = load_dataset(f"folder:{tmp_path / 'b'}")
    pixels = {ds.train.labels[i]: float(ds.train[i][0].mean()) for i in range(ds.n_train)}
    assert pixels[0] > pixels[1] + 1  # bright (class 0) above dark, normalised: not both clipped to 255
    assert read_image(str(tmp_path / "b" / "train" / "dark" / "2.png")).max() == 2000 // 257
    for f in (tmp_path / "a" / "train" / "cat").iterdir():
        f.rename(f.with_suffix(".heic"))
    with pytest.raises(DataError, match=r"train/cat holds no image \(\.png"):
        load_dataset(f"folder:{tmp_path / 'a'}")
    shutil.rmtree(tmp_path / "a" / "train" / "cat")
    with pytest.raises(DataError, match=r"one class sub-folder \(dog\): a classifier needs two"):
        load_dataset(f"folder:{tmp_path / 'a'}")


def test_digits() -> None:
    pytest.importorskip("sklearn")
    ds = load_dataset("digits")
    assert ds.input_shape == (1, 8, 8) and len(ds.y_train) == 1437 and len(ds.y_test) == 360


def test_digits_are_scikit_learns_without_importing_it(tmp_path: Path) -> None:
    """distsgd reads scikit-learn's bundled file itself (importing scikit-learn cost a run 1.6 s of
    CPU): the images and labels are load_digits()'s, every one, in a fresh process that never
    imported sklearn."""
    from sklearn.datasets import load_digits

    code = (
        "import sys, numpy as np; from distsgd.data import load_dataset; ds = load_dataset('digits'); "
        "np.savez(sys.argv[1], x=np.concatenate([ds.x_train.numpy(), ds.x_test.numpy()]), "
        "y=np.concatenate([ds.y_train.numpy(), ds.y_test.numpy()])); print('sklearn' in sys.modules)"
    )
    out = tmp_path / "digits.npz"
    r = subprocess.run([sys.executable, "-c", code, str(out)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "False", r.stderr[-2000:]
    got, ref = np.load(out), load_digits()
    order = np.random.default_rng(0).permutation(len(ref.target))  # the split distsgd documents: 360 test
    x, y = ref.images.astype(np.float32)[:, None], ref.target
    want = from_arrays("digits", x[order[360:]], y[order[360:]], x[order[:360]], y[order[:360]], num_classes=10)
    assert np.array_equal(got["x"], np.concatenate([want.x_train.numpy(), want.x_test.numpy()]))
    assert np.array_equal(got["y"], np.concatenate([want.y_train.numpy(), want.y_test.numpy()]))


def test_unknown_dataset() -> None:
    with pytest.raises(DataError, match="unknown dataset 'imagenet'"):
        load_dataset("imagenet")
