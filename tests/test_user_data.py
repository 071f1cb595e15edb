"""Bring your own data, loss and optimiser: torch Datasets, shards, regression, gradient
accumulation, per-group learning rates, corrupt images, and the bundled default dataset."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

import distsgd
from distsgd.data import load_dataset
from helpers import cli_here

pytest.importorskip("sklearn")

# A user's own Dataset, in a file of theirs (named on the command line as FILE.py:make): digits as
# tensors, each training sample augmented at random in __getitem__; with DISTSGD_TEST_LOG set,
# every training index read is appended to a file named after the reading process.
USER_DATA = """
import os
import numpy as np
import torch
from sklearn.datasets import load_digits


class Digits(torch.utils.data.Dataset):
    def __init__(self, x, y, augment):
        self.x, self.y, self.augment = x, y, augment
        self.classes = list(range(10))

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        x = self.x[i]
        if self.augment:
            x = torch.roll(x, shifts=int(torch.randint(-1, 2, ())), dims=2) + 0.1 * torch.randn_like(x)
            log = os.environ.get("DISTSGD_TEST_LOG")
            if log:
                with open(os.path.join(log, f"{os.getpid()}.txt"), "a") as fh:
                    fh.write(f"{i}\\n")
        return x, int(self.y[i])


def make():
    d = load_digits()
    x = (torch.tensor(d.images, dtype=torch.float32)[:, None] / 16.0 - 0.3) / 0.38  # about mean 0, std 1
    y = torch.tensor(d.target)
    return Digits(x[:1500], y[:1500], True), Digits(x[1500:], y[1500:], False)
"""


@pytest.fixture(scope="module")
def user_data(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = tmp_path_factory.mktemp("user") / "digits_data.py"
    path.write_text(USER_DATA)
    return f"{path}:make"


# One algorithm per way its workers meet the data: alone; in a process group (allreduce; local-sgd
# and sync easgd read their batches as it does and differ only in how they average parameters); ddp
# with DataLoader processes; Hogwild!'s shared memory and hogwild++'s clusters; a parameter server's
# worker (asgd; ssp and dcasgd run the very same worker, their rules being the server's), sync-ps's
# rounds and async easgd's elastic exchange.
@pytest.mark.parametrize(
    "algo, extra",
    [
        ("single", {}),
        ("allreduce", {}),
        ("ddp", {"loader_workers": 1}),
        ("hogwild", {}),
        ("asgd", {}),
        ("sync-ps", {}),
        ("easgd", {"easgd_mode": "async"}),
        ("hogwild++", {"update_delay": 4}),
    ],
)
@pytest.mark.slow
def test_a_user_dataset_with_random_augmentation_trains_under_every_topology(
    user_data: str, algo: str, extra: dict
) -> None:
    workers = 1 if algo == "single" else 2
    s = distsgd.train(
        model="mlp", data=user_data, algo=algo, workers=workers, epochs=3, lr=0.1, batch_size=32, quiet=True, **extra
    ).summary
    assert s["dataset"] == user_data and s["samples"] >= 3 * 1472
    assert s["final_test_accuracy"] > 0.5, s["final_test_accuracy"]  # 297 held-out digits; chance is 0.1
    if algo in ("hogwild", "hogwild++"):
        assert s["dataset_shared"]  # the Datasets' tensors were moved to shared memory, one copy for all


@pytest.mark.slow
def test_workers_read_disjoint_shards_that_cover_the_data(user_data: str, tmp_path: Path, monkeypatch) -> None:
    log = tmp_path / "log"
    log.mkdir()
    monkeypatch.setenv("DISTSGD_TEST_LOG", str(log))
    distsgd.train(model="mlp", data=user_data, algo="allreduce", workers=2, epochs=1, batch_size=50, quiet=True)
    import os

    # (This process reads item 0 once, to learn the input shape: not a worker's read.)
    shards = [[int(v) for v in f.read_text().split()] for f in sorted(log.glob("*.txt")) if f.stem != str(os.getpid())]
    assert len(shards) == 2 and [len(s) for s in shards] == [750, 750]
    assert set(shards[0]).isdisjoint(shards[1]) and set(shards[0]) | set(shards[1]) == set(range(1500))


@pytest.mark.slow
def test_an_npz_of_float_targets_is_a_regression_trained_with_mse(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(600, 5)).astype(np.float32)
    y = (x @ np.array([1.0, -2.0, 0.5, 0.0, 3.0]) + 0.05 * rng.normal(size=600)).astype(np.float32)
    np.savez(tmp_path / "reg.npz", x=x, y=y)
    res = cli_here(
        "train",
        "--dataset",
        f"npz:{tmp_path / 'reg.npz'}",
        *"--model logreg --epochs 20 --lr 0.05 --target-loss 0.1 --out".split(),
        str(tmp_path / "run"),
        "--quiet",
    )
    assert res.returncode == 0, res.stderr
    s = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert s["final_test_accuracy"] is None and s["final_test_loss"] < 0.05  # noise variance is 0.0025
    assert s["evals"][0]["test_loss"] > s["final_test_loss"]
    assert s["samples_to_target"] is not None and s["target_loss"] == 0.1
    with pytest.raises(distsgd.ConfigError, match="--loss cross-entropy does not fit"):
        distsgd.train(model="logreg", data=f"npz:{tmp_path / 'reg.npz'}", loss="cross-entropy", quiet=True)


@pytest.mark.parametrize("algo", ["allreduce", "hogwild"])
def test_a_torch_dataset_of_scalar_float_targets_is_a_regression_of_one_output(algo: str) -> None:
    """The same targets as the npz test's, as a torch Dataset of scalar targets (shape (N,), as
    pandas gives a column): trained as a regression of one output, the noise's variance reached.
    Until 2026-12-01 each batch's targets stayed (B,) against the model's (B, 1) outputs, which
    F.mse_loss broadcast into every pair: a constant model (an audit's: test loss 4.67, the
    targets' variance, for 0.026 with (N, 1)), exit 0. Outputs and targets of other shapes under
    mse are refused in one line."""
    rng = np.random.default_rng(0)
    x = torch.from_numpy(rng.normal(size=(600, 5)).astype(np.float32))
    y = x @ torch.tensor([1.0, -2.0, 0.5, 0.0, 3.0]) + 0.05 * torch.from_numpy(rng.normal(size=600).astype(np.float32))
    data = (torch.utils.data.TensorDataset(x[:500], y[:500]), torch.utils.data.TensorDataset(x[500:], y[500:]))
    result = distsgd.train(model="logreg", data=data, algo=algo, workers=2, epochs=10, lr=0.05, quiet=True)
    assert result.summary["final_test_loss"] < 0.05, result.summary["final_test_loss"]  # (y's variance: about 14)
    # a loss= of the user's written for the dataset's (B,) targets sees them as they are
    result = distsgd.train(
        model="logreg", data=data, algo=algo, workers=2, epochs=10, lr=0.05, loss=squeezed_mse, quiet=True
    )
    assert result.summary["final_test_loss"] < 0.05, result.summary["final_test_loss"]
    from distsgd.train.objective import loss_function

    mse = loss_function("mse", None, "regression")
    assert float(mse(torch.ones(4, 1), torch.ones(4))) == 0.0
    with pytest.raises(distsgd.ConfigError, match=r"outputs \(4, 2\) and the targets \(4,\) differ in shape"):
        mse(torch.ones(4, 2), torch.ones(4))


def squeezed_mse(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.mse_loss(out.squeeze(-1), y)


def _params(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


@pytest.mark.parametrize("algo, workers", [("single", 1), ("allreduce", 2), ("ddp", 2)])
def test_accumulating_k_micro_batches_is_one_step_on_a_k_times_larger_batch(algo: str, workers: int) -> None:
    digits = load_dataset("digits")
    common = dict(model="mlp", data=digits, lr=0.1, momentum=0.9, seed=4, max_samples=640, quiet=True)
    big = distsgd.train(algo="single", batch_size=64, **common)
    acc = distsgd.train(algo=algo, workers=workers, batch_size=32 // workers, accumulate=2, **common)
    assert acc.summary["samples"] == 640
    a, b = _params(big.model), _params(acc.model)
    assert not torch.equal(a, _params(distsgd.models.build_model("mlp", (1, 8, 8), 10, seed=4)))
    assert float((a - b).norm() / a.norm()) < 1e-5


def frozen_head(model: torch.nn.Module) -> list[dict]:
    """Per-group options: the last layer learns nothing (lr 0), the rest at the run's lr."""
    head = list(model.parameters())[-2:]
    rest = list(model.parameters())[:-2]
    return [{"params": rest}, {"params": head, "lr": 0.0}]


def adam_on_the_head(model: torch.nn.Module) -> torch.optim.Optimizer:
    """An optimiser of the user's: Adam, and the first layer frozen by lr 0."""
    ps = list(model.parameters())
    return torch.optim.Adam([{"params": ps[:2], "lr": 0.0}, {"params": ps[2:], "lr": 0.01}])


@pytest.mark.slow
@pytest.mark.parametrize("algo", ["single", "allreduce", "asgd"])
def test_per_group_learning_rates_are_honoured(algo: str) -> None:
    digits = load_dataset("digits")
    start = list(distsgd.models.build_model("mlp", (1, 8, 8), 10, seed=0).parameters())
    workers = 1 if algo == "single" else 2
    common = dict(model="mlp", data=digits, algo=algo, workers=workers, epochs=1, seed=0, quiet=True)
    model = distsgd.train(param_groups=frozen_head, schedule="step", **common).model
    now = list(model.parameters())
    assert all(torch.equal(a, b) for a, b in zip(now[-2:], start[-2:]))  # lr 0: untouched, schedule or not
    assert not torch.equal(now[0], start[0])
    model = distsgd.train(optimizer=adam_on_the_head, **common).model
    now = list(model.parameters())
    assert torch.equal(now[0], start[0]) and not torch.equal(now[-1], start[-1])


def test_a_corrupt_image_is_one_error_line(tmp_path: Path) -> None:
    Image = pytest.importorskip("PIL.Image")
    for cls in ("a", "b"):
        (tmp_path / "train" / cls).mkdir(parents=True)
        for i in range(3):
            Image.fromarray(np.full((8, 8), 40 * i, dtype=np.uint8)).save(tmp_path / "train" / cls / f"{i}.png")
    (tmp_path / "train" / "b" / "2.png").write_bytes(b"\x89PNG\r\n this is not an image")
    res = cli_here("train", "--dataset", f"folder:{tmp_path}", "--model", "mlp", "--out", str(tmp_path / "run"))
    assert res.returncode == 2
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: cannot read image {tmp_path / 'train' / 'b' / '2.png'}: ")


BAD_ITEM = """
import torch
from distsgd.errors import DataError


class Flaky(torch.utils.data.Dataset):
    num_classes = 2

    def __len__(self):
        return 64

    def __getitem__(self, i):
        if i == 7:
            raise DataError("cannot read image /data/seven.png: broken")
        return torch.zeros(4), i % 2


def make():
    return Flaky(), Flaky()
"""


@pytest.mark.slow
@pytest.mark.parametrize("args", [["--loader-workers", "1"], ["--algo", "allreduce", "--workers", "2"]])
def test_a_bad_sample_found_while_training_is_one_error_line(tmp_path: Path, args: list[str]) -> None:
    path = tmp_path / "flaky.py"
    path.write_text(BAD_ITEM)
    res = cli_here(
        "train",
        "--dataset",
        f"{path}:make",
        "--model",
        "logreg",
        "--batch-size",
        "8",
        "--out",
        str(tmp_path / "run"),
        *args,
    )
    assert res.returncode == 2, res.stderr
    last = res.stderr.strip().splitlines()
    assert len(last) == 1 and "cannot read image /data/seven.png: broken" in last[0] and last[0].startswith("error: ")


@pytest.mark.slow
def test_the_default_job_trains_with_no_network_and_no_system_dataset(tmp_path: Path, monkeypatch) -> None:
    """The README's first command on a fresh machine: Fashion-MNIST comes from the copy distsgd
    ships, its contents checked against the published checksums. (In this process, through the
    command's own main(): distsgd reads these variables as it looks for the data, and keeps no
    dataset between runs.)"""
    monkeypatch.setenv("DISTSGD_OFFLINE", "1")
    monkeypatch.setenv("DISTSGD_SYSTEM_DATASETS", "")
    monkeypatch.setenv("DISTSGD_DATA", "")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    res = cli_here("train", "--max-samples", "6400", "--out", str(tmp_path / "run"), "--quiet")
    assert res.returncode == 0, res.stderr
    s = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert s["dataset"] == "fashion-mnist" and s["samples"] == 6400 and s["final_test_accuracy"] > 0.3
    monkeypatch.delenv("DISTSGD_DATA")
    listed = cli_here("datasets")
    assert "bundled" in next(line for line in listed.stdout.splitlines() if line.startswith("fashion-mnist"))


def test_augmentation_crops_and_flips_whole_batches() -> None:
    """Every augmented image is a window of the padded image at some offset, mirrored or not:
    checked against all (2p + 1)^2 offsets and both flips (torchvision's RandomCrop(padding=p) and
    RandomHorizontalFlip, applied to each image)."""
    from distsgd.data.augment import crop_flip, padding

    x = torch.randn(16, 3, 8, 8)
    fill = torch.tensor([-1.0, 0.0, 2.0]).view(1, 3, 1, 1)
    out = crop_flip(x, fill, torch.Generator().manual_seed(1))
    p = padding(8)
    padded = fill.expand(16, 3, 8 + 2 * p, 8 + 2 * p).clone()
    padded[:, :, p : p + 8, p : p + 8] = x
    flips = 0
    for i in range(16):
        windows = [
            (padded[i, :, dy : dy + 8, dx : dx + 8], f)
            for dy in range(2 * p + 1)
            for dx in range(2 * p + 1)
            for f in (False, True)
        ]
        match = [f for w, f in windows if torch.equal(out[i], w.flip(-1) if f else w)]
        assert match, f"image {i} is no crop of its padded original"
        flips += match[0]
    assert 0 < flips < 16  # both mirrored and unmirrored images (p = 1/2 each)


class _Overstated(torch.utils.data.Dataset):
    """A Dataset whose ``__len__`` claims 10 items more than its ``__getitem__`` has."""

    def __len__(self) -> int:
        return 40

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        return torch.ones(3) * [1.0, 2.0, 3.0][i % 3], [0, 1, 2][i // 10]  # IndexError from i = 30 on


class _StrLabels(_Overstated):
    def __len__(self) -> int:
        return 30

    def __getitem__(self, i: int) -> tuple[torch.Tensor, str]:  # type: ignore[override]
        return torch.ones(3), "cat"


def test_a_dict_of_arrays_without_x_or_y_is_one_error() -> None:
    """8f65d93: ``data={"x": x}`` was a KeyError from inside distsgd."""
    x = np.zeros((8, 3), np.float32)
    for given in ({"x": x}, {"y": np.zeros(8, int)}):
        with pytest.raises(distsgd.DataError, match="a dict of arrays needs 'x' and 'y'"):
            distsgd.train(model="mlp", data=given, max_samples=8, quiet=True)


@pytest.mark.parametrize(
    "data, message",
    [
        (_Overstated(), r"item 30 of the Dataset \(of 40\) cannot be read: IndexError: list index out of range"),
        (_StrLabels(), r"item 0 of the Dataset: its target \(str\) is not a tensor, array or number"),
    ],
)
def test_a_dataset_that_cannot_be_read_before_training_is_one_error(data, message: str) -> None:
    """8f65d93: distsgd's look at a user's Dataset before training (counting its classes, its first
    item) let the Dataset's own exception through: a 40-line traceback, exit 1, from the command."""
    with pytest.raises(distsgd.DataError, match=message):
        distsgd.train(model="mlp", data=(data, data), max_samples=60, quiet=True)
