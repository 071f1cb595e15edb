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
from typing import Any, Protocol

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


# --- training checkpoints: one file per worker rank, and a manifest naming the newest whole set ---
#
# Lockstep algorithms write every worker's file at the same step, then rank 0 commits. Algorithms
# whose workers never stand still together (Hogwild!, an asynchronous parameter server) commit
# from their coordinator (the shared-memory launcher, the server), which writes the model it
# holds into a file of its own once every live worker has written its part: such a checkpoint is
# a consistent set of pieces, each taken within one checkpoint's worth of samples of the others.
CHECKPOINT_DIR = "checkpoint"
MANIFEST = "manifest.json"
COORDINATOR = "coordinator"


def worker_file(ckpt_dir: Path, seq: int, rank: int | str) -> Path:
    return ckpt_dir / f"ckpt-{seq:06d}-rank{rank}.pt"


def save_worker_state(ckpt_dir: Path, seq: int, rank: int | str, state: dict[str, Any]) -> None:
    """Write one worker's (or the coordinator's) state of checkpoint ``seq`` (atomically; the
    manifest comes later)."""
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    atomic_save(state, worker_file(ckpt_dir, seq, rank))


def commit_checkpoint(ckpt_dir: Path, seq: int, world: int, meta: dict[str, Any],
                      ranks: list[int] | None = None, coordinator: bool = False) -> None:
    """Point the manifest at checkpoint ``seq`` once the files of ``ranks`` (default: all of
    ``world``), and the coordinator's if ``coordinator``, are written; then drop older ones.

    Until the manifest is replaced, it names the previous whole checkpoint, so a crash while
    writing never leaves a run without one.
    """
    ranks = list(range(world)) if ranks is None else sorted(ranks)
    missing = [r for r in ranks if not worker_file(ckpt_dir, seq, r).is_file()]
    if coordinator and not worker_file(ckpt_dir, seq, COORDINATOR).is_file():
        missing.append(COORDINATOR)  # type: ignore[arg-type]
    if missing:
        raise CheckpointError(f"checkpoint {seq} is missing the files of workers {missing}")
    atomic_write_json({"seq": seq, "world": world, "ranks": ranks, "coordinator": coordinator, **meta},
                      ckpt_dir / MANIFEST)
    for old in ckpt_dir.glob("ckpt-*-rank*.pt"):  # older ones (not newer: an asynchronous worker
        if int(old.name.split("-")[1]) < seq:     # may already have written its part of the next)
            old.unlink(missing_ok=True)


def read_manifest(run_dir: Path) -> dict[str, Any] | None:
    path = Path(run_dir) / CHECKPOINT_DIR / MANIFEST
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"cannot read {path}: {exc}") from None


def load_worker_state(run_dir: Path, rank: int | str) -> dict[str, Any] | None:
    """This worker's (or, with rank ``COORDINATOR``, the coordinator's) state from the newest whole
    checkpoint in ``run_dir`` (weights only); None when that checkpoint has none for it (an
    asynchronous run's worker that had died)."""
    manifest = read_manifest(run_dir)
    if manifest is None:
        raise CheckpointError(f"no checkpoint in {run_dir} (train with --checkpoint-every to make one)")
    if rank == COORDINATOR and not manifest.get("coordinator"):
        return None
    if rank != COORDINATOR and rank not in manifest.get("ranks", range(manifest["world"])):
        return None
    path = worker_file(Path(run_dir) / CHECKPOINT_DIR, manifest["seq"], rank)
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise CheckpointError(f"cannot load checkpoint {path}: {first}") from None


# --- the stateful pieces of a run, saved and restored together ------------------------------------
class Stateful(Protocol):
    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class RngState:
    """torch's global random state (dropout) as a stateful piece."""

    def state_dict(self) -> dict[str, Any]:
        return {"torch": torch.get_rng_state()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        torch.set_rng_state(state["torch"])


def gather(pieces: dict[str, Stateful]) -> dict[str, Any]:
    """Every piece's state, under the piece's name."""
    return {name: piece.state_dict() for name, piece in pieces.items()}


def scatter(pieces: dict[str, Stateful], state: dict[str, Any]) -> None:
    """Give every piece its saved state back."""
    for name, piece in pieces.items():
        piece.load_state_dict(state[name])


class Checkpointer:
    """Saves and restores one worker's stateful pieces (model, optimiser, algorithm, loop, random
    state): one file per worker per checkpoint, then rank 0 points the manifest at the new set."""

    def __init__(self, out: str | None, resume: str | None, rank: int, world: int) -> None:
        self.dir = Path(out) / CHECKPOINT_DIR if out else None
        self.resume, self.rank, self.world = resume, rank, world

    def load(self) -> dict[str, Any] | None:
        """This worker's saved pieces from the run given to ``--resume`` (None: a fresh run). The
        caller scatters them, the model before the algorithm wraps it, the rest after."""
        return load_worker_state(Path(self.resume), self.rank) if self.resume else None

    def save(self, seq: int, pieces: dict[str, Stateful]) -> None:
        assert self.dir is not None, "checkpoints need a run directory"
        save_worker_state(self.dir, seq, self.rank, gather(pieces))

    def commit(self, seq: int, meta: dict[str, Any], ranks: list[int] | None = None,
               coordinator: bool = False) -> None:
        """Once every worker has saved: the manifest now names checkpoint ``seq``."""
        assert self.dir is not None
        commit_checkpoint(self.dir, seq, self.world, meta, ranks, coordinator)
