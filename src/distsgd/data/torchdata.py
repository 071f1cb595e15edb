"""Any ``torch.utils.data.Dataset`` as training data: the user's own recipe.

A :class:`TorchData` holds a train and a test Dataset. Each worker reads its own shard of a
map-style training set (:mod:`distsgd.data.partition`: disjoint, reshuffled every epoch, the same
for the same seed) through a ``DataLoader`` whose batch sampler walks that shard, with
``--loader-workers N`` processes when per-sample work (opening files, augmenting) should run off
the training thread. ``__getitem__`` may be random (augmentation): DataLoader seeds its worker
processes from the worker's own random state. A training set that is a stream (an
``IterableDataset``: no ``len()``, read in its own order) is split by :class:`StreamPart`: each
worker reads the whole stream and keeps its part; an epoch is one pass over it.
"""

from __future__ import annotations

import copy
import logging
import sys
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from distsgd.data.formats import classes_from_labels
from distsgd.data.text import is_hf_stream
from distsgd.errors import ConfigError, DataError, error_text

log = logging.getLogger(__name__)

_FORK = sys.platform.startswith("linux")  # elsewhere forking after system frameworks load is unsafe


class _Chunks:
    """A batch sampler: consecutive pieces of ``order`` from position ``start``."""

    def __init__(self, order: torch.Tensor, start: int, batch_size: int) -> None:
        self.order, self.start, self.batch_size = order, start, batch_size

    def __iter__(self) -> Iterator[list[int]]:
        for first in range(self.start, len(self.order), self.batch_size):
            yield self.order[first : first + self.batch_size].tolist()

    def __len__(self) -> int:
        return max(0, -(-(len(self.order) - self.start) // self.batch_size))


def is_map_dataset(obj: Any) -> bool:
    """A ``torch.utils.data.Dataset`` (or anything with ``__getitem__`` and ``__len__`` that is not
    an array of samples)."""
    import numpy as np

    if isinstance(obj, (torch.Tensor, np.ndarray, list, tuple, dict, str)):
        return False
    if isinstance(obj, torch.utils.data.IterableDataset):
        return False
    return isinstance(obj, torch.utils.data.Dataset) or (hasattr(obj, "__getitem__") and hasattr(obj, "__len__"))


class StreamPart(IterableDataset):
    """A worker's part of a stream (an IterableDataset): the stream read as rows of ``world``
    consecutive items, of each row the item at the worker's rank; of those, each DataLoader
    process the ones its index picks; the first ``skip`` (a resumed run's samples of this epoch)
    left out. A last row the stream does not fill (fewer than ``world`` items) is left out by
    every worker, so that all of them take as many items, and so as many steps, in every pass:
    a worker with one step more than the others would meet them in the wrong collective.

    A stream that splits itself between DataLoader processes (a streaming Hugging Face dataset:
    each process reads only its shards) is not split again: each process's rows are of its own
    share, the same share on every worker. (Split again, half of it was never read with 2 loader
    processes.)"""

    def __init__(self, stream: Any, rank: int, world: int, skip: int = 0) -> None:
        self.stream, self.rank, self.world, self.skip = stream, rank, world, skip

    def __iter__(self) -> Iterator[Any]:
        info = get_worker_info()
        procs, me = (info.num_workers, info.id) if info is not None else (1, 0)
        if procs > 1 and splits_itself(self.stream):
            if self.skip:
                raise DataError(
                    "a pass over a streaming Hugging Face dataset read by several loader processes cannot "
                    "go on where a resumed run stopped (each process reads its own shards): resume with "
                    "--loader-workers 0 (run.loader(num_workers=0))"
                )
            procs, me = 1, 0  # this process's share is what it reads
        mine = 0  # this worker's items so far (all its loader processes')
        held: Any = None  # this row's item for this worker, until the row is complete
        last = self.world - 1
        for k, item in enumerate(self.stream):
            column = k % self.world
            if column == self.rank:
                held = (item,)
            if column == last and held is not None:  # the row is complete: every worker has its item
                mine += 1
                if mine > self.skip and (mine - 1) % procs == me:
                    yield held[0]
                held = None


STREAM_REPLICATED = (
    "a stream (an IterableDataset) is split between the workers as it is read: --partition "
    "replicated (every worker all of it) is for map-style datasets"
)


def splits_itself(stream: Any) -> bool:
    """Whether ``stream``, read in a DataLoader process, reads only that process's share: a
    streaming Hugging Face dataset (its shards, by the process's index), or a stream of one's
    rows (``splits_itself``: :class:`~distsgd.data.text.TokenWindows`)."""
    own = getattr(stream, "splits_itself", None)
    return bool(own) if own is not None else is_hf_stream(stream)


def is_stream(obj: Any) -> bool:
    """A torch ``IterableDataset`` (a streaming Hugging Face dataset in the torch format is one)."""
    return isinstance(obj, IterableDataset)


class TorchData:
    """A train and a test map-style Dataset, each item ``(input, target)``."""

    def __init__(
        self,
        train: Any,
        test: Any,
        name: str = "dataset",
        where: str = "",
        num_classes: int | None = None,
        loader_workers: int = 0,
    ) -> None:
        for split, ds in (("train", train), ("test", test)):
            if is_stream(ds):
                continue
            if not is_map_dataset(ds):
                raise DataError(
                    f"{name}: the {split} set must be a torch Dataset (map-style: __getitem__ and "
                    f"__len__; or an IterableDataset, a stream), got {type(ds).__name__}"
                )
            if len(ds) == 0:
                raise DataError(f"{name}: the {split} set is empty")
        self.train, self.test, self.name, self.where = train, test, name, where
        self.stream = is_stream(train)  # an epoch is a pass over it; its length is not known
        self.loader_workers = loader_workers
        self.device = torch.device("cpu")  # where batches go (``to``)
        x0, y0 = self._first(train, "train")
        self.input_shape = tuple(x0.shape)
        self._n_test = len(test) if not is_stream(test) else self._count(test)
        # a language model's sample: token ids (T,) and their next tokens (T,)
        lm = not y0.dtype.is_floating_point and y0.dim() == 1 and x0.dim() == 1 and not x0.dtype.is_floating_point
        self.task = "regression" if y0.dtype.is_floating_point else "lm" if lm else "classification"
        if self.task == "lm" and num_classes is None and not isinstance(getattr(train, "num_classes", None), int):
            raise DataError(
                f"{name}: token sequences need the vocabulary size: give num_classes (the Dataset's "
                f"attribute, or a third item / 'num_classes' key)"
            )
        self.num_classes = num_classes or (max(1, y0.numel()) if self.task == "regression" else self._classes())

    def _first(self, ds: Any, split: str) -> tuple[torch.Tensor, torch.Tensor]:
        """The first item of ``ds`` (a stream's first, read to learn its shape)."""
        if not is_stream(ds):
            return self._item(ds, 0)
        try:
            for item in ds:
                return self._pair(item, 0)
        except DataError:
            raise
        except Exception as exc:  # the user's __iter__
            raise DataError(f"{self.name}: the {split} stream's first item cannot be read: {error_text(exc)}") from None
        raise DataError(f"{self.name}: the {split} stream is empty")

    def _count(self, stream: Any) -> int:
        """A test stream's items (it is read whole at each evaluation)."""
        try:
            n = sum(1 for _ in stream)
        except Exception as exc:  # the user's __iter__
            raise DataError(f"{self.name}: the test stream cannot be read: {error_text(exc)}") from None
        if n == 0:
            raise DataError(f"{self.name}: the test stream is empty")
        return n

    @classmethod
    def _item(cls, ds: Any, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        try:
            item = ds[i]
        except Exception as exc:  # the user's __getitem__ (a __len__ that claims more items than it has)
            raise DataError(f"item {i} of the Dataset (of {len(ds)}) cannot be read: {error_text(exc)}") from None
        return cls._pair(item, i)

    @staticmethod
    def _pair(item: Any, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        if isinstance(item, dict):
            raise DataError(
                f"item {i} of the Dataset is a dict (keys {', '.join(map(str, list(item)[:6]))}): distsgd's "
                f"loop takes (input, target) items; a model fed dicts trains in your own loop "
                f"(distsgd.spawn; docs/OWN_LOOP.md: Bring your own loop)"
            )
        if not isinstance(item, (tuple, list)) or len(item) != 2:
            raise DataError(f"a Dataset item must be (input, target); item {i} is {type(item).__name__}")
        pair = []
        for part, value in zip(("input", "target"), item):
            try:
                pair.append(torch.as_tensor(value))
            except Exception as exc:  # a str label, a ragged list, a PIL image without a transform, ...
                raise DataError(
                    f"item {i} of the Dataset: its {part} ({type(value).__name__}) is not a tensor, array or "
                    f"number: {error_text(exc)}"
                ) from None
        return pair[0], pair[1]

    def _classes(self) -> int:
        """From the Dataset's ``num_classes``, ``classes`` or ``targets``; else from every label."""
        ds = self.train
        if isinstance(getattr(ds, "num_classes", None), int):
            return ds.num_classes
        if getattr(ds, "classes", None) is not None:
            return len(ds.classes)
        if self.stream:
            raise DataError(
                f"{self.name}: a stream's classes are not known before it is read: give num_classes "
                f"(the stream's attribute, or a third item / 'num_classes' key)"
            )
        targets = getattr(ds, "targets", None)
        if targets is None:
            log.warning(
                "%s: reading every training label to count the classes (give the Dataset a "
                "num_classes attribute to skip this)",
                self.name,
            )
            targets = [self._item(ds, i)[1] for i in range(len(ds))]
        return classes_from_labels(int(torch.as_tensor(targets).max()), f"{self.name}: its training labels")

    @property
    def n_train(self) -> int:
        """The training samples; 0 for a stream (not known before it is read)."""
        return 0 if self.stream else len(self.train)

    @property
    def n_test(self) -> int:
        return self._n_test

    def options(self, augment: bool = False, loader_workers: int = 0) -> "TorchData":
        """``--augment`` (datasets that offer it: ``folder:``) and ``--loader-workers``."""
        if augment:
            if not hasattr(self.train, "augment"):
                raise ConfigError(
                    f"--augment is for built-in and folder: image datasets; augment inside your own "
                    f"Dataset's __getitem__ for {self.name}"
                )
            self.train.augment = True
        self.loader_workers = loader_workers
        return self

    def to(self, device: torch.device) -> "TorchData":
        """Batches for a worker on ``device``: read by the DataLoader into pinned memory (a GPU) and
        moved there as they come."""
        if torch.device(device) == self.device:
            return self
        moved = copy.copy(self)
        moved.device = torch.device(device)
        return moved

    def _loader(self, ds: Any, **kwargs: Any) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        gpu = self.device.type == "cuda"
        if self.loader_workers and _FORK:
            # Forked, as PyTorch does by default on Linux (a worker's default is the platform's again,
            # procs._bootstrap; here too where it is not, Python 3.14's forkserver): each epoch's
            # loader processes would otherwise start a fork server and import torch (seconds an epoch).
            kwargs["multiprocessing_context"] = "fork"
        batches = iter(DataLoader(ds, num_workers=self.loader_workers, pin_memory=gpu, **kwargs))
        unwinding = False  # something else ended the loop: an error, a signal, the caller's break
        try:
            for x, y in batches:
                x = x.float() if x.dtype == torch.float64 else x
                y = y.float() if y.dtype == torch.float64 else y
                yield (x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)) if gpu else (x, y)
        except Exception as exc:
            unwinding = True
            if "Original Traceback" not in str(exc):
                raise
            raise _loader_error(exc) from None
        except BaseException:  # SIGTERM (errors.Terminated), Ctrl-C, the generator closed
            unwinding = True
            raise
        finally:
            # its loader processes end now: an error's traceback holds the iterator, and a caller of
            # distsgd.train that caught the error kept them until a garbage collection
            for _ in range(2):
                try:
                    stop = getattr(batches, "_shutdown_workers", None)  # (torch's, for loader processes)
                    if stop is not None:
                        stop()
                    break
                except RuntimeError:  # a loader process the same SIGTERM ended: torch's SIGCHLD handler
                    # says so, at any line here, and its traceback took the place of the signal's own line
                    if not unwinding:
                        raise

    def batches(self, order: torch.Tensor, start: int, batch_size: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """This worker's training batches: ``order`` (its shard of the epoch) from ``start``."""
        return self._loader(self.train, batch_sampler=_Chunks(order, start, batch_size))

    def stream_batches(
        self, rank: int, world: int, skip: int, batch_size: int
    ) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """A stream's training batches for worker ``rank`` of ``world``: its part of one pass
        (:class:`StreamPart`), its first ``skip`` items left out."""
        return self._loader(StreamPart(self.train, rank, world, skip), batch_size=batch_size)

    def test_batches(self, batch_size: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """The test set's batches; a test stream read once, shared between the loader processes."""
        test = StreamPart(self.test, 0, 1) if is_stream(self.test) else self.test
        return self._loader(test, batch_size=batch_size)

    def share_memory_(self) -> "TorchData":
        """Move the tensors the Datasets hold into shared memory, so that worker processes read one
        copy of them instead of one each."""
        for ds in (self.train, self.test):
            _share_tensors(ds, depth=3)
        return self

    def is_shared(self) -> bool:
        tensors = [t for ds in (self.train, self.test) for t in _tensors(ds, depth=3)]
        return all(t.is_shared() for t in tensors)

    def __repr__(self) -> str:
        return f"TorchData({self.name!r}, train={self.n_train}, test={self.n_test}, input={self.input_shape})"


def _tensors(obj: Any, depth: int) -> list[torch.Tensor]:
    """Tensors an object holds in its attributes (and those of the Datasets it wraps)."""
    if depth == 0 or not hasattr(obj, "__dict__"):
        return []
    found = []
    for value in vars(obj).values():
        if isinstance(value, torch.Tensor):
            found.append(value)
        elif isinstance(value, (list, tuple)):
            found += [v for v in value if isinstance(v, torch.Tensor)]
            found += [t for v in value if is_map_dataset(v) for t in _tensors(v, depth - 1)]
        elif is_map_dataset(value):
            found += _tensors(value, depth - 1)
    return found


def _share_tensors(obj: Any, depth: int) -> None:
    for t in _tensors(obj, depth):
        t.share_memory_()


def _loader_error(exc: Exception) -> Exception:
    """A DataLoader worker's error in one line: DataLoader re-raises it as 'Caught X in DataLoader
    worker process N' followed by the original traceback, whose last line says what went wrong."""
    text = str(exc)
    if "Original Traceback" in text:
        last = [line for line in text.strip().splitlines() if line.strip()][-1]
        kind, _, message = last.partition(": ")
        if kind.rsplit(".", 1)[-1] == "DataError":
            return DataError(message)
        return RuntimeError(last)
    return exc
