"""Token streams for language models: text files, Python's own sources, Hugging Face datasets.

This module reads and cuts token streams; :func:`distsgd.data.token_dataset` makes them a
language-model dataset: a :class:`~distsgd.data.Dataset` (the tensor fast path: every
algorithm, Hogwild!'s shared memory and the parameter server included, trains it unchanged) whose
inputs and targets are token ids of shape ``(N, T)``: sample i is a sequence of ``T = --context``
tokens, and its target the same sequence shifted by one (the next token at every position). The
stream of tokens is cut into non-overlapping pieces of ``T + 1`` tokens; the last
:data:`TEST_FRACTION` of the stream is the test set (held out as a whole: no sequence of it was
trained on, and none overlaps a training sequence).

Sources:

- ``text:PATH``: a text file or a folder of them (every file under it, in sorted order, the
  hidden ones left out), as bytes: byte-level tokens, a vocabulary of 256, no tokeniser to
  download or to disagree about.
- ``python-stdlib``: the default corpus of ``--model gpt``, the source files of the Python
  standard library that runs distsgd (``<stdlib>/*.py`` in sorted order, the first
  :data:`STDLIB_BYTES` bytes): every machine with Python has it, it needs no network, and its
  licence is the PSF License Agreement (``<stdlib>/LICENSE.txt``). It differs a little between
  Python versions, so the summary records the version.
- ``hf:PATH`` or a ``datasets.Dataset`` given to ``distsgd.train``: a Hugging Face dataset saved
  with ``save_to_disk``, or a folder of parquet / arrow / jsonl files. Its ``input_ids`` column
  (already tokenised; the vocabulary is the largest id + 1 unless the dataset says otherwise) or,
  failing that, its ``text`` column as bytes. Needs ``pip install 'distsgd[hf]'``.

:func:`unigram_entropy` gives the baseline every language model must beat: the loss of predicting
each token by its frequency alone.
"""

from __future__ import annotations

import sysconfig
from pathlib import Path
from typing import Any

import numpy as np
import torch

from distsgd.errors import DataError

TEST_FRACTION = 0.1
STDLIB_BYTES = 1 << 21  # 2 MiB of the standard library's sources
BYTE_VOCAB = 256
DEFAULT_CONTEXT = 128


def byte_tokens(data: bytes) -> torch.Tensor:
    """Byte-level tokens (0..255) of ``data``, as int64."""
    return torch.from_numpy(np.frombuffer(data, dtype=np.uint8).astype(np.int64))


def _files(path: Path) -> list[Path]:
    if path.is_file():
        return [path]
    if not path.is_dir():
        raise DataError(f"text dataset {path}: no such file or folder")
    files = sorted(
        p
        for p in path.rglob("*")
        if p.is_file() and not any(part.startswith(".") for part in p.relative_to(path).parts)
    )
    if not files:
        raise DataError(f"text dataset {path}: the folder holds no files")
    return files


def read_text(path: str | Path, limit: int | None = None) -> bytes:
    """The bytes of a text file, or of every file under a folder (sorted, each followed by a
    newline), up to ``limit`` bytes."""
    out = bytearray()
    for f in _files(Path(path)):
        try:
            out += f.read_bytes()
        except OSError as exc:
            raise DataError(f"cannot read {f}: {exc.strerror or exc}") from None
        out += b"\n"
        if limit is not None and len(out) >= limit:
            return bytes(out[:limit])
    return bytes(out)


def stdlib_folder() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_text(limit: int = STDLIB_BYTES) -> bytes:
    """The first ``limit`` bytes of the standard library's ``*.py`` files, in sorted order."""
    root = stdlib_folder()
    files = sorted(root.glob("*.py"))
    if not files:
        raise DataError(
            f"python-stdlib: no Python source files in {root} (a Python installed without its "
            f"sources?); use --dataset text:PATH"
        )
    out = bytearray()
    for f in files:
        try:
            out += f.read_bytes() + b"\n"
        except OSError:
            continue
        if len(out) >= limit:
            break
    return bytes(out[:limit])


def sequences(tokens: torch.Tensor, context: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and next-token targets ``(N, context)`` from a stream: pieces of ``context + 1``."""
    n = (len(tokens) - 1) // context
    if n < 1:
        raise DataError(
            f"{len(tokens)} tokens make no sequence of --context {context} (+1 for its last "
            f"target): give more text or a shorter --context"
        )
    x = tokens[: n * context].view(n, context)
    y = tokens[1 : n * context + 1].view(n, context)
    return x.contiguous(), y.contiguous()


def token_arrays(
    name: str, tokens: torch.Tensor, context: int, vocab: int, test_tokens: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(x, y, x_test, y_test)``, each ``(N, context)``, from a token stream (its last
    :data:`TEST_FRACTION` the test set, unless ``test_tokens`` are given); ids checked against ``vocab``."""
    if context < 1:
        raise DataError(f"--context must be at least 1 token, got {context}")
    tokens = tokens.long()
    if len(tokens) and (int(tokens.min()) < 0 or int(tokens.max()) >= vocab):
        raise DataError(f"{name}: token ids must lie in 0..{vocab - 1}, found {int(tokens.min())}..{int(tokens.max())}")
    if test_tokens is None:
        cut = len(tokens) - max(context + 1, int(len(tokens) * TEST_FRACTION))
        if cut < context + 1:
            raise DataError(
                f"{name}: {len(tokens)} tokens are too few for a training and a test sequence of --context {context}"
            )
        tokens, test_tokens = tokens[:cut], tokens[cut:]
    return (*sequences(tokens, context), *sequences(test_tokens.long(), context))


def unigram_entropy(tokens: torch.Tensor, vocab: int) -> float:
    """The entropy (nats per token) of the tokens' frequencies: the test loss of a model that
    knows how often each token occurs and nothing else (what a language model must beat)."""
    counts = torch.bincount(tokens.flatten().long(), minlength=vocab).double()
    p = counts[counts > 0] / counts.sum()
    return float(-(p * p.log()).sum())


# Hugging Face datasets -------------------------------------------------------------------------


def _require_datasets() -> Any:
    try:
        import datasets
    except ImportError:
        raise DataError("Hugging Face datasets need the 'datasets' package: pip install 'distsgd[hf]'") from None
    return datasets


def is_hf_dataset(obj: Any) -> bool:
    """A ``datasets.Dataset`` or ``DatasetDict`` (told by its class, without importing datasets)."""
    return any(
        c.__module__.split(".")[0] == "datasets" and c.__name__ in ("Dataset", "DatasetDict") for c in type(obj).__mro__
    )


def _stream(split: Any, name: str) -> tuple[torch.Tensor, int | None]:
    """One split's tokens, concatenated in row order (``input_ids``), or its ``text`` as bytes."""
    columns = list(getattr(split, "column_names", []) or [])
    if "input_ids" in columns:
        rows = split["input_ids"]
        try:
            flat = (
                np.concatenate([np.asarray(r, dtype=np.int64).reshape(-1) for r in rows])
                if len(rows)
                else np.zeros(0, dtype=np.int64)
            )
        except (TypeError, ValueError) as exc:
            raise DataError(f"{name}: 'input_ids' must hold lists of integer token ids ({exc})") from None
        return torch.from_numpy(flat), None
    if "text" in columns:
        return byte_tokens("\n".join(str(t) for t in split["text"]).encode()), BYTE_VOCAB
    raise DataError(
        f"{name}: a language-model dataset needs an 'input_ids' (token ids) or a 'text' column; it has "
        f"{', '.join(columns) or 'none'}"
    )


def _splits(obj: Any) -> dict[str, Any] | None:
    """A ``DatasetDict``'s (or a plain dict's) splits; None for one ``Dataset``."""
    if isinstance(obj, dict) or any(c.__name__ == "DatasetDict" for c in type(obj).__mro__):
        return dict(obj)
    return None


def is_hf_stream(obj: Any) -> bool:
    """A streaming ``datasets.IterableDataset`` or ``IterableDatasetDict`` (``load_dataset(...,
    streaming=True)``), told by its class."""
    return any(
        c.__module__.split(".")[0] == "datasets" and c.__name__ in ("IterableDataset", "IterableDatasetDict")
        for c in type(obj).__mro__
    )


def _column(split: Any, name: str) -> str:
    """The column a streaming split's tokens are in: ``input_ids``, else ``text`` (as bytes)."""
    columns = list(getattr(split, "column_names", None) or [])
    if not columns:  # a stream's columns are not always declared: its first row says
        columns = list(next(iter(split), {}))
    for column in ("input_ids", "text"):
        if column in columns:
            return column
    raise DataError(
        f"{name}: a language-model stream needs an 'input_ids' (token ids) or a 'text' column; it has "
        f"{', '.join(map(str, columns)) or 'none'}"
    )


class TokenWindows(torch.utils.data.IterableDataset):
    """A streaming Hugging Face split as a language model's items, read as it streams: its rows'
    tokens (``input_ids``; or ``text`` as bytes, the rows joined by newlines) in row order, cut as
    :func:`sequences` cuts a stream: ``context`` tokens and their next tokens, one after another.
    A token id outside ``0..vocab - 1`` is one error line where it is met."""

    def __init__(self, rows: Any, column: str, context: int, vocab: int, name: str) -> None:
        self.rows, self.column, self.context, self.vocab, self.name = rows, column, context, vocab, name

    @property
    def splits_itself(self) -> bool:
        """Read in a DataLoader process, its rows are that process's shards (Hugging Face's)."""
        return is_hf_stream(self.rows)

    def tokens(self) -> Any:
        for i, row in enumerate(self.rows):
            value = row[self.column]
            if self.column == "text":
                yield from (b"\n" if i else b"") + str(value).encode()
                continue
            ids = np.asarray(value).reshape(-1)
            if len(ids) and (ids.min() < 0 or ids.max() >= self.vocab):
                raise DataError(
                    f"{self.name}: row {i} has token ids {int(ids.min())}..{int(ids.max())}, outside the "
                    f"vocabulary 0..{self.vocab - 1} (the test split's largest id + 1)"
                )
            yield from ids.tolist()

    def __iter__(self) -> Any:
        piece: list[int] = []
        for token in self.tokens():
            piece.append(token)
            if len(piece) == self.context + 1:
                t = torch.tensor(piece)
                yield t[:-1], t[1:]
                piece = piece[-1:]  # the last target is the next input's first token


def hf_stream_tokens(obj: Any, context: int, name: str) -> tuple[TokenWindows, torch.Tensor, int]:
    """(the training windows, read as they stream; the test split's tokens, read once; the
    vocabulary) of a streaming ``IterableDatasetDict`` with ``train`` and ``test`` (or
    ``validation``) splits, or a pair of streaming splits. The vocabulary: 256 for text as bytes,
    else the test split's largest id + 1 (a stream's training ids are not known before it is read)."""
    splits = _splits(obj) if not isinstance(obj, (tuple, list)) else {"train": obj[0], "test": obj[1]}
    if splits is None:
        raise DataError(
            f"{name}: a stream has no end to hold out a test set from: give a dict of streaming splits "
            f"with 'train' and 'test' (or 'validation'), or (train, test)"
        )
    if "train" not in splits:
        raise DataError(f"{name}: a dataset with splits needs a 'train' split; it has {', '.join(splits)}")
    test = splits.get("test", splits.get("validation"))
    if test is None:
        raise DataError(f"{name}: a stream needs a 'test' (or 'validation') split; it has {', '.join(splits)}")
    if context < 1:
        raise DataError(f"--context must be at least 1 token, got {context}")
    column = _column(splits["train"], name)
    if column != _column(test, name):
        raise DataError(f"{name}: the train split's tokens are in '{column}', the test split's are not")
    if column == "text":
        vocab = BYTE_VOCAB
        test_tokens = torch.tensor(list(TokenWindows(test, column, context, vocab, name).tokens()), dtype=torch.int64)
    else:
        rows = [np.asarray(row[column], dtype=np.int64).reshape(-1) for row in test]
        test_tokens = torch.from_numpy(np.concatenate(rows)) if rows else torch.zeros(0, dtype=torch.int64)
        vocab = 1 + int(test_tokens.max()) if len(test_tokens) else 1
    return TokenWindows(splits["train"], column, context, vocab, name), test_tokens, vocab


def hf_tokens(obj: Any, name: str = "hf-dataset") -> tuple[torch.Tensor, torch.Tensor | None, int]:
    """(training tokens, test tokens or None, vocabulary) of a ``datasets.Dataset`` (its test set is
    then carved from its end) or a ``DatasetDict`` with ``train`` and ``test`` (or ``validation``)
    splits. The vocabulary: 256 for text as bytes, else the largest id + 1."""
    splits = _splits(obj)
    if splits is None:
        train_tokens, vocab = _stream(obj, name)
        test_tokens = None
    else:
        if "train" not in splits:
            raise DataError(f"{name}: a dataset with splits needs a 'train' split; it has {', '.join(splits)}")
        test = splits.get("test", splits.get("validation"))
        train_tokens, vocab = _stream(splits["train"], name)
        test_tokens = _stream(test, name)[0] if test is not None else None
    if vocab is None:
        vocab = (
            1 + max(int(t.max()) for t in (train_tokens, test_tokens) if t is not None and len(t))
            if len(train_tokens)
            else 1
        )
    return train_tokens, test_tokens, vocab


def read_hf(path: str | Path) -> Any:
    """``hf:PATH``'s dataset: one saved with ``save_to_disk``, or a folder (or file) of parquet, arrow
    or jsonl files."""
    datasets = _require_datasets()
    try:
        datasets.disable_progress_bars()  # distsgd reports its own progress
    except AttributeError:
        pass
    path = Path(path)
    name = f"hf:{path}"
    if not path.exists():
        raise DataError(f"{name}: no such file or folder")
    try:
        if path.is_dir() and ((path / "dataset_info.json").exists() or (path / "dataset_dict.json").exists()):
            obj = datasets.load_from_disk(str(path))
        else:
            files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
            kinds = {".parquet": "parquet", ".arrow": "arrow", ".jsonl": "json", ".json": "json"}
            found = {kinds[p.suffix] for p in files if p.suffix in kinds}
            if len(found) != 1:
                raise DataError(
                    f"{name}: expected a save_to_disk folder or parquet, arrow or jsonl files "
                    f"(of one kind), found {', '.join(sorted(found)) or 'none'}"
                )
            kind = found.pop()
            obj = datasets.load_dataset(
                kind, data_files=[str(p) for p in files if kinds.get(p.suffix) == kind], split="train"
            )
    except DataError:
        raise
    except Exception as exc:  # the datasets library's own errors: one line
        first = (str(exc).strip().splitlines() or [""])[0]
        raise DataError(f"{name}: cannot read it: {type(exc).__name__}: {first}") from None
    return obj


__all__ = [
    "byte_tokens",
    "read_text",
    "stdlib_folder",
    "stdlib_text",
    "sequences",
    "token_arrays",
    "unigram_entropy",
    "is_hf_dataset",
    "is_hf_stream",
    "hf_tokens",
    "hf_stream_tokens",
    "TokenWindows",
    "read_hf",
    "TEST_FRACTION",
    "BYTE_VOCAB",
    "DEFAULT_CONTEXT",
]
