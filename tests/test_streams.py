"""Streams (a torch IterableDataset: no len(), read in its own order) as training data, in
distsgd's loop and in a user's: each worker reads the whole stream and keeps its part, every item
trained by exactly one worker in a pass, every worker taking as many steps; resumed where it
stopped; what a stream cannot do refused in one line."""

from __future__ import annotations

import functools
import os
from collections import Counter
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import IterableDataset, TensorDataset

import distsgd
from helpers import cli_here

D = 12  # features; the label is the largest of the first three


class Stream(IterableDataset):
    """``n`` items ``(id, x)`` -> the largest of x's first three: the id rides in the first
    feature, so the model can say which items it trained on."""

    num_classes = 3

    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self):
        g = torch.Generator().manual_seed(0)
        for i in range(self.n):
            x = torch.randn(D, generator=g)
            yield torch.cat([torch.tensor([float(i)]), x]), torch.tensor(int(x[:3].argmax()))


def held_out() -> TensorDataset:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(300, D, generator=g)
    return TensorDataset(torch.cat([torch.full((300, 1), -1.0), x], 1), x[:, :3].argmax(1))


class Recorder(nn.Module):
    """An MLP on the features that, while training, appends the ids of each batch's items to a
    file of its process (``SEEN``: the folder), one line a batch."""

    def __init__(self, input_shape=(D + 1,), num_classes=3) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(D, 32), nn.ReLU(), nn.Linear(32, 3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        folder = os.environ.get("SEEN")
        if self.training and folder:
            with open(os.path.join(folder, f"seen-{os.getpid()}"), "a") as f:
                f.write(" ".join(str(int(v)) for v in x[:, 0].tolist()) + "\n")
        return self.net(x[:, 1:])


def seen(folder: Path) -> dict[str, list[list[int]]]:
    """Each process's batches of ids."""
    return {
        p.name: [list(map(int, line.split())) for line in p.read_text().splitlines()] for p in folder.glob("seen-*")
    }


@pytest.mark.parametrize("algo", ["allreduce", "asgd", "hogwild"])
def test_a_stream_trains_in_distsgd_train_each_item_by_one_worker(tmp_path, monkeypatch, algo: str) -> None:
    """201 items, 2 workers, 2 passes: items 0-199 trained twice each (once a pass), by the worker
    whose column they are in (ids of one parity per process); item 200, a row of one, by none,
    so that both workers take as many steps (under allreduce one more would meet the other's
    final average). Each worker's 2 loader processes read it all and keep their halves of its part."""
    monkeypatch.setenv("SEEN", str(tmp_path))
    r = distsgd.train(
        model=Recorder,
        data=(Stream(201), held_out()),
        algo=algo,
        workers=2,
        epochs=2,
        batch_size=16,
        lr=0.1,
        loader_workers=2,  # each worker's part split again between its 2 loader processes
    )
    by_process = seen(tmp_path)
    ids = [i for batches in by_process.values() for b in batches for i in b]
    assert Counter(ids) == {i: 2 for i in range(200)}, sorted(set(range(201)) - set(ids))
    assert sorted(sorted({i % 2 for b in batches for i in b}) for batches in by_process.values()) == [[0], [1]]
    assert r.summary["samples"] == 400 and r.summary["final_test_accuracy"] > 0.6, r.summary
    if algo == "allreduce":  # lockstep: as many steps each; a pass's 100 items, 50 a loader process (3 x 16 + 2)
        assert sorted(len(b) for batches in by_process.values() for b in batches) == [2] * 8 + [16] * 24


def test_a_resumed_stream_goes_on_where_it_stopped(tmp_path) -> None:
    """A checkpoint in the middle of a pass, resumed: the same weights as the run never stopped
    (each worker skips the items of the pass it had trained)."""
    kw = dict(model=Recorder, algo="allreduce", workers=2, batch_size=16, lr=0.1, quiet=True)
    straight = distsgd.train(data=(Stream(1001), held_out()), max_samples=1600, **kw)
    out = str(tmp_path / "run")
    distsgd.train(data=(Stream(1001), held_out()), max_samples=800, out=out, checkpoint_every="800", **kw)
    resumed = distsgd.train(data=(Stream(1001), held_out()), max_samples=1600, out=out, resume=out, **kw)
    assert resumed.summary["samples"] == straight.summary["samples"] >= 1600
    for a, b in zip(straight.model.state_dict().values(), resumed.model.state_dict().values()):
        assert torch.equal(a, b)


def test_a_stream_evaluates_over_its_budget(tmp_path) -> None:
    """A stream's epochs have no known length: with --max-samples the run still draws a curve
    (evaluations every budget / 5 samples), each of them without an epoch."""
    r = distsgd.train(
        model=Recorder, data=(Stream(400), held_out()), algo="single", max_samples=1000, batch_size=20, quiet=True
    )
    evals = r.summary["evals"]
    assert [e["samples"] for e in evals] == [200, 400, 600, 800, 1000], evals
    assert {e.get("epoch") for e in evals} == {None}


STREAM_FILE = """
import torch
from torch.utils.data import IterableDataset


class Stream(IterableDataset):
    def __iter__(self):
        g = torch.Generator().manual_seed(0)
        for _ in range(300):
            x = torch.randn(8, generator=g)
            yield x, int(x[:2].argmax())


def make():
    return Stream(), Stream(), 2
"""


def test_a_dataset_function_may_return_a_stream(tmp_path) -> None:
    """``--dataset FILE.py:make`` returning (stream, stream, classes): trained, the test stream
    read whole at each evaluation."""
    (tmp_path / "streamed.py").write_text(STREAM_FILE)
    out = tmp_path / "run"
    done = cli_here(
        "train", "--dataset", f"{tmp_path / 'streamed.py'}:make", "--model", "mlp", "--algo", "allreduce",
        "--workers", "2", "--epochs", "2", "--batch-size", "10", "--out", str(out), "--quiet",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    summary = __import__("json").loads((out / "summary.json").read_text())
    assert summary["samples"] == 600 and len(summary["evals"]) == 2, summary  # at each pass's end


@pytest.mark.parametrize(
    ("settings", "says"),
    [
        ({"partition": "replicated"}, "--partition replicated (every worker all of it) is for map-style"),
        ({"schedule": "cosine"}, "--schedule cosine moves with the epochs"),
    ],
)
def test_what_a_stream_cannot_do_is_one_line(settings: dict, says: str) -> None:
    with pytest.raises(distsgd.DistsgdError) as info:
        distsgd.train(model=Recorder, data=(Stream(100), held_out()), quiet=True, **settings)
    assert says in str(info.value) and "\n" not in str(info.value)


class Broken(IterableDataset):
    """A stream whose ``__iter__`` raises at item ``at``."""

    num_classes = 3

    def __init__(self, at: int) -> None:
        self.at = at

    def __iter__(self):
        for i, item in enumerate(Stream(100)):
            if i == self.at:
                raise RuntimeError(f"the stream broke at item {i}")
            yield item


@pytest.mark.parametrize(
    ("data", "says"),
    [
        ((Broken(0), held_out()), "the train stream's first item cannot be read: RuntimeError: the stream broke"),
        ((Stream(100), Broken(50)), "the test stream cannot be read: RuntimeError: the stream broke at item 50"),
    ],
)
def test_a_stream_that_raises_as_distsgd_first_reads_it_is_one_line(data: tuple, says: str) -> None:
    """On 98b67c4 the stream's exception came out of distsgd's look at its first item (or its count
    of a test stream) as it was: a 40-line traceback, exit 1."""
    with pytest.raises(distsgd.DataError) as info:
        distsgd.train(model=Recorder, data=data, quiet=True)
    assert says in str(info.value) and "\n" not in str(info.value)


@pytest.mark.slow
def test_a_stream_too_short_for_its_workers_is_one_line() -> None:
    """One item between two workers: each reads one in two and the last row of fewer is left out,
    so neither trains. On 98b67c4 the run ended with exit 0, 0 samples and the untrained model
    saved with its figures, where a map-style set too small to share is refused."""
    with pytest.raises(distsgd.DistsgdError, match=r"the training stream gave worker \d no sample: .*at least 2 items"):
        distsgd.train(model=Recorder, data=(Stream(1), held_out()), algo="allreduce", workers=2, quiet=True)


class Unlabelled(IterableDataset):
    def __iter__(self):
        for i in range(20):
            yield torch.randn(4), i % 2


def test_a_stream_of_unknown_classes_is_one_line() -> None:
    """A map-style set's classes are read from its labels; a stream's cannot be, before it is read."""
    with pytest.raises(distsgd.DataError) as info:
        distsgd.train(model="mlp", data=(Unlabelled(), Unlabelled()), quiet=True)
    assert "give num_classes" in str(info.value) and "\n" not in str(info.value)


# -- a user's loop ---------------------------------------------------------------------------------
class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(D, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x)


def uneven_loop(run: distsgd.Run, folder: str) -> nn.Module:
    model, opt = run.setup(lambda m: torch.optim.SGD(m.parameters(), lr=0.01))
    steps = 0
    for x, y in run.loader(Stream(41), batch_size=4):
        opt.zero_grad()
        run.backward(F.cross_entropy(model(x[:, 1:]), y))
        opt.step()
        steps += 1
    Path(folder, f"steps-{run.rank}").write_text(str(steps))
    return run.final_model()


def test_a_stream_of_uneven_parts_takes_as_many_steps_on_every_worker(tmp_path) -> None:
    """41 items between 2 workers, 4 a batch: 21 and 20 items would be 6 steps and 5, and the
    worker with one more all-reduced its gradient against the other's final average (a gloo
    abort; a silently wrong model where the sizes match). Rows of 2: 20 items and 5 steps each."""
    r = distsgd.spawn(
        functools.partial(uneven_loop, folder=str(tmp_path)), model=Net, algo="allreduce", workers=2, quiet=True
    )
    assert [(tmp_path / f"steps-{rank}").read_text() for rank in range(2)] == ["5", "5"]
    assert r.summary["samples"] == 40


def cosine_loop(run: distsgd.Run) -> nn.Module:
    model, opt = run.setup()
    for x, y in run.loader(Stream(40), batch_size=4):
        opt.zero_grad()
        run.backward(F.cross_entropy(model(x[:, 1:]), y))
        opt.step()
    return run.final_model()


def test_a_schedule_over_a_stream_of_unknown_length_is_one_line_in_a_user_loop() -> None:
    """It stayed at its start (the learning rate never moved); train_size= says the epoch's length."""
    with pytest.raises(distsgd.DistsgdError) as info:
        distsgd.spawn(cosine_loop, model=Net, algo="single", schedule="cosine", quiet=True)
    assert "give spawn(train_size=N)" in str(info.value) and "\n" not in str(info.value)
    r = distsgd.spawn(cosine_loop, model=Net, algo="single", schedule="cosine", train_size=40, epochs=1, quiet=True)
    assert r.summary["samples"] == 40


# -- a streaming Hugging Face dataset ----------------------------------------------------------------
def hf_rows(n: int, seed: int) -> dict[str, list[str]]:
    import random

    r = random.Random(seed)
    return {"text": ["".join(r.choice("abcab ") for _ in range(r.randint(20, 60))) for _ in range(n)]}


@pytest.mark.slow  # (4-7 s each: out of the fast tier, which ran 190 s on the VM of 2026-11-30)
@pytest.mark.parametrize("algo", ["single", "allreduce"])
def test_a_streaming_hugging_face_dataset_trains_a_language_model(algo: str) -> None:
    """``load_dataset(..., streaming=True)``'s splits (here made by ``to_iterable_dataset``): the
    training split's text read as it streams, cut into the sequences the same rows make as a
    map-style dataset (``from_hf``), each trained once a pass; the test split's sequences are the
    map-style dataset's; the model learns (below the loss of guessing among the 4 characters)."""
    datasets = pytest.importorskip("datasets")
    from distsgd.data import from_hf

    train, test = hf_rows(300, 0), hf_rows(30, 1)
    streams = datasets.IterableDatasetDict(
        {
            "train": datasets.Dataset.from_dict(train).to_iterable_dataset(num_shards=3),
            "test": datasets.Dataset.from_dict(test).to_iterable_dataset(),
        }
    )
    mapped = from_hf({"train": datasets.Dataset.from_dict(train), "test": datasets.Dataset.from_dict(test)}, 16)
    workers = 1 if algo == "single" else 2
    r = distsgd.train(
        model="gpt", data=streams, algo=algo, workers=workers, context=16, epochs=1, batch_size=8,
        optimizer="adam", lr=0.002, quiet=True,
    )  # fmt: skip
    assert r.summary["samples"] == mapped.n_train - mapped.n_train % workers, (r.summary["samples"], mapped.n_train)
    assert r.summary["final_test_loss"] < 1.609  # ln 5: guessing among the text's 5 symbols
    from distsgd.data import from_hf_stream

    assert torch.equal(from_hf_stream(streams, 16).test.tensors[0], mapped.x_test)


def hf_items(n: int, shards: int):
    """A streaming Hugging Face dataset of ``n`` dict items ``{"x": [id] * D, "y": id % 3}``."""
    datasets = pytest.importorskip("datasets")
    rows = {"x": [[float(i)] * D for i in range(n)], "y": [i % 3 for i in range(n)]}
    return datasets.Dataset.from_dict(rows).to_iterable_dataset(num_shards=shards).with_format("torch")


def hf_loop(run: distsgd.Run, folder: str) -> nn.Module:
    model, opt = run.setup(lambda m: torch.optim.SGD(m.parameters(), lr=0.0))
    seen = []
    for batch in run.loader(hf_items(40, 4), batch_size=4, num_workers=2):
        seen += batch["x"][:, 0].int().tolist()
        opt.zero_grad()
        run.backward(F.cross_entropy(model(batch["x"].float()), batch["y"]))
        opt.step()
    Path(folder, f"seen-{run.rank}").write_text(" ".join(map(str, seen)))
    return run.final_model()


@pytest.mark.slow
def test_a_hugging_face_stream_read_by_loader_processes_is_read_whole(tmp_path) -> None:
    """A streaming Hugging Face dataset gives each DataLoader process only its shards; split
    again by process, as a torch stream is, half of it was never read (20 of 40 items, 2 loader
    processes). Each item is read by exactly one worker."""
    hf_items(1, 1)  # skips without the datasets package
    distsgd.spawn(functools.partial(hf_loop, folder=str(tmp_path)), model=Net, algo="allreduce", workers=2, quiet=True)
    seen = [list(map(int, (tmp_path / f"seen-{r}").read_text().split())) for r in range(2)]
    assert sorted(seen[0] + seen[1]) == list(range(40)) and len(seen[0]) == len(seen[1])


def test_a_test_stream_read_by_loader_processes_is_read_once() -> None:
    """Each of 2 loader processes read the whole test stream: every test item evaluated twice."""
    from distsgd.data.torchdata import TorchData

    data = TorchData(Stream(50), Stream(30), num_classes=3).options(loader_workers=2)
    ids = sorted(int(i) for x, _ in data.test_batches(8) for i in x[:, 0])
    assert ids == list(range(30)) and data.n_test == 30


def test_a_sigterm_while_the_loader_processes_end_is_raised_not_their_error(monkeypatch) -> None:
    """SIGTERM to a run's process group ends the loader processes too; torch's SIGCHLD handler then
    raised 'DataLoader worker ... is killed by signal: Terminated' inside the loader's shutdown, and
    that traceback took the place of the command's `error: terminated by SIGTERM` (the hogwild
    launcher's evaluation, seen by an audit). Here the shutdown raises as torch's handler did."""
    from torch.utils.data import dataloader

    from distsgd.data.torchdata import TorchData
    from distsgd.errors import Terminated

    real = dataloader._MultiProcessingDataLoaderIter._shutdown_workers
    calls = []

    def dying(self) -> None:
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("DataLoader worker (pid 1) is killed by signal: Terminated. ")
        real(self)

    data = TorchData(Stream(50), Stream(30), num_classes=3).options(loader_workers=2)
    batches = data.test_batches(8)
    next(batches)
    monkeypatch.setattr(dataloader._MultiProcessingDataLoaderIter, "_shutdown_workers", dying)
    with pytest.raises(Terminated):
        batches.throw(Terminated())
    assert len(calls) >= 2  # tried again: the loader processes shut down after all
