"""Saving and loading models safely.

Files are written atomically: to a temporary file in the same folder, flushed and fsynced, then
renamed over the target, so a crash leaves either the old file or the new one, never a torn one.
Loading uses ``torch.load(weights_only=True)``: a checkpoint can hold tensors and plain values
only, never code.
"""

from __future__ import annotations

import io
import json
import os
import tempfile
from pathlib import Path
from typing import Any

import torch

from distsgd.errors import CheckpointError

MODEL_FORMAT = "distsgd-model-1"


def atomic_write_bytes(path: Path, data: bytes) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    try:  # make the rename itself durable
        dir_fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
    except OSError:
        pass


def atomic_save(obj: Any, path: Path) -> None:
    """``torch.save`` to ``path`` atomically."""
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    atomic_write_bytes(path, buffer.getvalue())


def atomic_write_json(obj: Any, path: Path) -> None:
    atomic_write_bytes(path, (json.dumps(obj, indent=2, sort_keys=False) + "\n").encode())


def save_model(path: Path, model: torch.nn.Module, *, model_spec: str, dataset: str,
               input_shape: tuple[int, ...], num_classes: int, config: dict[str, Any]) -> None:
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    atomic_save({
        "format": MODEL_FORMAT,
        "state_dict": state,
        "model": model_spec,
        "dataset": dataset,
        "input_shape": list(input_shape),
        "num_classes": int(num_classes),
        "config": {k: v for k, v in config.items() if v is not None},
    }, path)


def load_checkpoint(path: Path) -> dict[str, Any]:
    path = Path(path)
    if path.is_dir():
        path = path / "model.pt"
    if not path.is_file():
        raise CheckpointError(f"checkpoint not found: {path}")
    try:
        data = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # torch raises many types for a bad file
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise CheckpointError(f"cannot load checkpoint {path}: {first}") from None
    if not isinstance(data, dict) or data.get("format") != MODEL_FORMAT:
        raise CheckpointError(f"{path} is not a distsgd model checkpoint")
    return data
