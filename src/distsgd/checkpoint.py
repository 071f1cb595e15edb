"""Saving and loading models safely.

Files are written atomically: to a temporary file in the same folder, flushed and fsynced, then
renamed over the target, so a crash leaves either the old file or the new one, never a torn one.
Loading uses ``torch.load(weights_only=True)``: a checkpoint can hold tensors and plain values
only, never code.
"""

from __future__ import annotations

import functools
import io
import json
import logging
import math
import os
import random
import re
import secrets
import warnings
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Protocol, cast

import numpy as np
import torch
from torch import nn

from distsgd.config import SAVE_FORMATS
from distsgd.errors import BadField, CheckpointError, ConfigError, OutputError
from distsgd.rundir import record, remove_ours

if TYPE_CHECKING:
    from distsgd.config import RunConfig
    from distsgd.data import TrainingData

log = logging.getLogger(__name__)

MODEL_FORMAT = "distsgd-model-1"


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` whole or not at all (a temporary file, fsync, rename)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.parent / f".{path.name}.{secrets.token_hex(6)}.tmp"
    try:
        record(tmp, path)  # both in the run directory's ledger first: what --overwrite may delete
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except OSError as exc:  # a full disk, say: the error names the file (a write's own error does not)
        Path(tmp).unlink(missing_ok=True)
        if exc.filename:
            raise
        raise OSError(exc.errno, exc.strerror, str(path)) from exc
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


def atomic_save(obj: object, path: Path) -> None:
    """``torch.save`` to ``path`` atomically."""
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    atomic_write_bytes(path, buffer.getvalue())


def atomic_write_json(obj: object, path: Path) -> None:
    atomic_write_bytes(path, (json.dumps(obj, indent=2, sort_keys=False) + "\n").encode())


def save_model(
    path: Path,
    model: torch.nn.Module,
    *,
    model_spec: str,
    dataset: str,
    input_shape: tuple[int, ...],
    num_classes: int,
    config: dict[str, Any],
    from_python: list[str] | None = None,
) -> None:
    """The trained model with what ``distsgd eval`` needs to measure it, as ``model.pt`` (torch's
    format, loaded with ``weights_only=True``) or, for a ``path`` ending ``.safetensors``, as
    safetensors (the tensors, and the rest as JSON in its metadata, under ``distsgd``).
    ``from_python``: which of "data" and "model" were Python objects (their names alone are
    recorded: eval cannot rebuild them)."""
    state = {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}  # loads without a GPU
    data = {
        "format": MODEL_FORMAT,
        "state_dict": state,
        "model": model_spec,
        "dataset": dataset,
        "input_shape": list(input_shape),
        "num_classes": int(num_classes),
        "config": {k: v for k, v in config.items() if v is not None},
        **({"from_python": list(from_python)} if from_python else {}),
    }
    if path.suffix == ".safetensors":
        from safetensors.torch import save

        # each tensor its own contiguous copy: safetensors refuses tensors that share memory (tied weights)
        tensors = {k: v.contiguous().clone() for k, v in state.items()}
        described = json.dumps({k: v for k, v in data.items() if k != "state_dict"})
        atomic_write_bytes(path, save(tensors, metadata={"distsgd": described}))
    else:
        atomic_save(data, path)


def save_run(
    out: Path,
    model: nn.Module,
    cfg: "RunConfig",
    dataset: "TrainingData",
    summary: dict[str, Any],
    from_python: list[str] | None = None,
) -> None:
    """A finished run's model in each --save-format, then summary.json, into its run directory
    ``out``: a run whose summary.json exists has its model (``from_python``: :func:`save_model`'s).
    Another format's model that distsgd wrote there (a run resumed in place with another
    --save-format) goes: ``distsgd eval DIR`` read the earlier part's model.pt beside the run's
    model.safetensors."""
    try:
        others = [form for form in SAVE_FORMATS if form not in cfg.save_formats]
        remove_ours(out, *(out / ("hf" if form == "hf" else f"model.{form}") for form in others))
        for form in cfg.save_formats:
            if form == "hf":
                _save_pretrained(model, out / "hf")
                continue
            save_model(
                out / f"model.{form}",
                model,
                model_spec=cfg.model,
                dataset=dataset.name,
                input_shape=dataset.input_shape,
                num_classes=dataset.num_classes,
                config=cfg.to_dict(),
                from_python=from_python,
            )
        atomic_write_json(summary, out / "summary.json")
    except OSError as exc:
        raise OutputError.of(exc) from None


def _save_pretrained(model: nn.Module, folder: Path) -> None:
    """A transformers model's own folder (its config and weights, as safetensors), which
    ``from_pretrained`` reads; each file it wrote recorded in the run directory's ledger."""
    folder.mkdir(parents=True, exist_ok=True)
    before = set(folder.iterdir())
    cast(Any, model).save_pretrained(str(folder))
    record(*(set(folder.iterdir()) - before))


def require_safetensors() -> None:
    """Fail early, with the command that fixes it, when the safetensors package is missing."""
    try:
        import safetensors.torch  # noqa: F401
    except ImportError:
        raise ConfigError(
            "--save-format safetensors needs the safetensors package: pip install 'distsgd[safetensors]'"
        ) from None


def _load_safetensors(path: Path) -> Any:
    """A model.safetensors distsgd wrote, as ``torch.load`` gives a model.pt's dict (no pickle)."""
    try:
        from safetensors import safe_open
    except ImportError:
        raise CheckpointError(
            f"{path} is safetensors, which needs the safetensors package: pip install 'distsgd[safetensors]'"
        ) from None
    with safe_open(str(path), framework="pt", device="cpu") as f:
        described = (f.metadata() or {}).get("distsgd")
        state = {k: f.get_tensor(k) for k in f.keys()}
    data = json.loads(described) if described is not None else None
    if isinstance(data, dict):
        data["state_dict"] = state
    return data


def load_checkpoint(path: Path) -> dict[str, Any]:
    path = Path(path)
    if path.is_dir():
        path = (
            path / "model.pt"
            if (path / "model.pt").is_file() or not (path / "model.safetensors").is_file()
            else path / "model.safetensors"
        )
    if not path.is_file():
        raise CheckpointError(f"checkpoint not found: {path}")
    try:
        if path.suffix == ".safetensors":
            data = _load_safetensors(path)
        else:
            with warnings.catch_warnings():  # torch's advice on a file of another pickle protocol: our line says it
                warnings.simplefilter("ignore")
                data = torch.load(path, map_location="cpu", weights_only=True)
    except CheckpointError:
        raise
    except OSError as exc:
        raise CheckpointError(f"cannot load checkpoint {path}: {exc.strerror or exc}") from None
    except Exception:  # torch raises many types for a bad file, and may advise weights_only=False: never here
        raise CheckpointError(
            f"cannot load checkpoint {path}: it is not a model{'.safetensors' if path.suffix == '.safetensors' else '.pt'} "
            f"distsgd wrote (it cannot be read as tensors and plain data: damaged, or another kind of file)"
        ) from None
    if not isinstance(data, dict) or data.get("format") != MODEL_FORMAT:
        raise CheckpointError(f"{path} is not a distsgd model checkpoint")
    kinds: dict[str, type | tuple[type, ...]] = {
        "state_dict": dict,
        "model": str,
        "dataset": str,
        "input_shape": (list, tuple),
        "num_classes": int,
        "config": dict,
    }
    wrong = [k for k, kind in kinds.items() if not isinstance(data.get(k), kind)]
    if not wrong and not all(  # the state_dict is a dict once nothing is wrong
        isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in data["state_dict"].items()
    ):
        wrong.append("state_dict")
    if not wrong and not all(isinstance(d, int) and d > 0 for d in data["input_shape"]):
        wrong.append("input_shape")
    if wrong:
        raise CheckpointError(
            f"{path} is damaged: its {', '.join(wrong)} {'is' if len(wrong) == 1 else 'are'} not what distsgd writes"
        )
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
PREVIOUS = "manifest.prev.json"  # the generation before: what a resume falls back to if the newest is damaged
COORDINATOR = "coordinator"


def worker_file(ckpt_dir: Path, seq: int, rank: int | str) -> Path:
    return ckpt_dir / f"ckpt-{seq:06d}-rank{rank}.pt"


_WORKER_FILE = re.compile(rf"ckpt-(\d{{6,}})-rank(?:\d+|{COORDINATOR})\.pt")  # worker_file's names, whole
_TEMPORARY = re.compile(r"\.(.+)\.[0-9a-f]{12}\.tmp")  # atomic_write's (of the name in it)
_MANIFESTS = re.compile(r"manifest(?:\.prev|\.damaged-\d+)?\.json")


def _seq_of(name: str) -> int | None:
    """The checkpoint a file named ``name`` is part of, if distsgd wrote it (:func:`worker_file`'s
    names only: a file of the user's that merely looks like one, ``ckpt-000008-rank0 (copy).pt``,
    is none, and never deleted)."""
    match = _WORKER_FILE.fullmatch(name)
    return int(match.group(1)) if match else None


# The layout of a worker's file, saved in it under "format": what a missing piece means depends on
# it. Files of distsgd before this marker carry none (their layout was this one, or older).
CHECKPOINT_FORMAT = 2


def save_worker_state(ckpt_dir: Path, seq: int, rank: int | str, state: dict[str, Any]) -> None:
    """Write one worker's (or the coordinator's) state of checkpoint ``seq`` (atomically; the
    manifest comes later), marked with :data:`CHECKPOINT_FORMAT`."""
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    atomic_save({**state, "format": CHECKPOINT_FORMAT}, worker_file(ckpt_dir, seq, rank))


def commit_checkpoint(
    ckpt_dir: Path,
    seq: int,
    world: int,
    meta: dict[str, Any],
    ranks: list[int] | None = None,
    coordinator: bool = False,
) -> None:
    """Point the manifest at checkpoint ``seq`` once the files of ``ranks`` (default: all of
    ``world``), and the coordinator's if ``coordinator``, are written; then drop older ones.

    Until the manifest is replaced, it names the previous whole checkpoint, so a crash while
    writing never leaves a run without one. Two generations are kept: the new one and the one
    before it (``manifest.prev.json``), which a resume falls back to when the new one is damaged.
    Temporary files of writers that were killed are removed.
    """
    ranks = list(range(world)) if ranks is None else sorted(ranks)
    missing: list[int | str] = [r for r in ranks if not worker_file(ckpt_dir, seq, r).is_file()]
    if coordinator and not worker_file(ckpt_dir, seq, COORDINATOR).is_file():
        missing.append(COORDINATOR)
    if missing:
        raise CheckpointError(f"checkpoint {seq} is missing the files of workers {missing}")
    keep = seq
    current = ckpt_dir / MANIFEST
    if current.is_file():
        try:
            before = json.loads(current.read_text())
        except (OSError, ValueError):
            before = None
        if before is not None and before.get("seq", seq) != seq:
            atomic_write_json(before, ckpt_dir / PREVIOUS)
            keep = min(seq, int(before["seq"]))
        elif before is None:  # damaged (a resume fell back from it): the generation before is not kept
            (ckpt_dir / PREVIOUS).unlink(missing_ok=True)
    atomic_write_json({"seq": seq, "world": world, "ranks": ranks, "coordinator": coordinator, **meta}, current)
    for old in ckpt_dir.glob("ckpt-*-rank*.pt"):  # older than the two kept (not newer: an asynchronous
        old_seq = _seq_of(old.name)  # worker may already have written its part of the next)
        if old_seq is not None and old_seq < keep:
            old.unlink(missing_ok=True)
    remove_stale_temporaries(ckpt_dir, up_to=seq)


def commit_coordinator_only(
    run_dir: Path, state: dict[str, Any], world: int, meta: dict[str, Any], above: Iterable[int] = ()
) -> int | None:
    """A checkpoint of the coordinator's ``state`` alone (a signal's final one: the server's, or
    Hogwild!'s launcher's), numbered past the manifest's and ``above`` (numbers workers may have
    saved parts of), committed with no worker's part: a resume starts every worker as a
    replacement. Returns its number; None, said in one logged line, where it could not be
    written (a full disk, an unreadable manifest): the run keeps its last checkpoint."""
    try:
        before = read_manifest(run_dir)
        seq = max([*above, before["seq"] if before is not None else -1]) + 1
        save_worker_state(run_dir / CHECKPOINT_DIR, seq, COORDINATOR, state)
        commit_checkpoint(run_dir / CHECKPOINT_DIR, seq, world, meta, ranks=[], coordinator=True)
    except OSError as exc:
        log.error("%s; the run keeps its last checkpoint", OutputError.of(exc))
        return None
    except CheckpointError as exc:
        log.error("no final checkpoint: %s", exc)
        return None
    return seq


def remove_stale_temporaries(ckpt_dir: Path, up_to: int | None = None) -> None:
    """Temporary files of checkpoint writers that were killed before their rename (those of
    checkpoints up to ``up_to``, which are whole or abandoned; all of them with None; a
    manifest's always). Only distsgd's own: a hidden ``.notes.tmp`` of the user's stays."""
    for tmp in ckpt_dir.glob(".*.tmp"):
        match = _TEMPORARY.fullmatch(tmp.name)
        if match is None:
            continue
        name = match.group(1)
        seq = _seq_of(name)
        if seq is None and not _MANIFESTS.fullmatch(name):
            continue
        if up_to is None or seq is None or seq <= up_to:
            tmp.unlink(missing_ok=True)


def usable_checkpoint(
    run_dir: Path, check: Callable[[Loaded], None] | None = None, tidy: bool = True
) -> dict[str, Any]:
    """The manifest of the newest whole checkpoint in ``run_dir`` whose files all load; the one
    before it, with a warning, when the newest is damaged (a disk error, a torn copy). Run once,
    by the launching process, before the workers read their parts. ``check``: called on every
    worker's file of the checkpoint chosen (not the coordinator's), as loaded; what it raises
    (a value distsgd never writes) stops the resume, with no fallback. ``tidy``: the run resumes
    in ``run_dir`` itself, whose killed writers' temporaries are removed, and whose manifest a
    fallback points at the checkpoint it chose (the damaged one's kept as ``manifest.damaged-N.json``);
    a run resumed into another directory only reads ``run_dir``, and its workers read the
    manifest returned (Job.resume_from)."""
    ckpt_dir = Path(run_dir) / CHECKPOINT_DIR
    manifest = read_manifest(run_dir)
    if manifest is None:
        raise CheckpointError(
            f"no checkpoint in {run_dir} (train with --checkpoint-every, or run.checkpoint() in your loop, to make one)"
        )
    if tidy:
        remove_stale_temporaries(ckpt_dir)
    damage = _damage(ckpt_dir, manifest, check)
    if damage is None:
        return manifest
    previous = ckpt_dir / PREVIOUS
    try:
        older = json.loads(previous.read_text()) if previous.is_file() else None
    except (OSError, ValueError):
        older = None
    if older is None or manifest_problem(older) or _damage(ckpt_dir, older, check) is not None:
        raise CheckpointError(f"the checkpoint in {run_dir} is damaged ({damage}) and there is no whole one before it")
    log.warning(
        "checkpoint %s in %s is damaged (%s); resuming from the one before it (%s, at %s samples)",
        manifest["seq"],
        run_dir,
        damage,
        older["seq"],
        older.get("samples", "?"),
    )
    if tidy:
        atomic_write_json(manifest, ckpt_dir / f"manifest.damaged-{manifest['seq']}.json")  # kept, for the record
        atomic_write_json(older, ckpt_dir / MANIFEST)  # one rename: at every moment the manifest names a checkpoint
    return older


def _damage(ckpt_dir: Path, manifest: dict[str, Any], check: Callable[[Loaded], None] | None = None) -> str | None:
    """What is wrong with the checkpoint ``manifest`` names (None: every file loads, and passes
    ``check``, if given, which raises for a worker's file it refuses)."""
    names: list[int | str] = list(manifest.get("ranks", range(manifest["world"])))
    if manifest.get("coordinator"):
        names.append(COORDINATOR)
    for name in names:
        path = worker_file(ckpt_dir, manifest["seq"], name)
        try:
            with warnings.catch_warnings():  # torch's advice on a file of another pickle protocol: our line says it
                warnings.simplefilter("ignore")
                data = torch.load(path, map_location="cpu", weights_only=True)
        except FileNotFoundError:
            return f"{path.name} is missing"
        except (OSError, MemoryError) as exc:  # the disk or this machine, not the file: no fallback
            raise CheckpointError(f"cannot read {path}: {exc}") from None
        except Exception as exc:  # torch's many errors for a torn or overwritten file (one advised weights_only=False)
            return (
                f"{path.name} cannot be read as tensors and plain data (torn, overwritten, or not distsgd's: "
                f"{type(exc).__name__})"
            )
        if check is not None and name != COORDINATOR:
            check(loaded(data, path))
    return None


def read_manifest(run_dir: Path, fallback: bool = True) -> dict[str, Any] | None:
    """The manifest of ``run_dir``'s newest checkpoint (None: it has none). One that is damaged (it
    is written by one rename: a disk's error or a hand's edit) gives way, with a warning, to the
    generation before it (``manifest.prev.json``), whose files a commit keeps (not with
    ``fallback=False``); with none, one ``CheckpointError``."""
    ckpt_dir = Path(run_dir) / CHECKPOINT_DIR
    manifest, damage = _manifest_in(ckpt_dir / MANIFEST)
    if (
        manifest is None and damage is None and (ckpt_dir / PREVIOUS).is_file()
    ):  # (said "no checkpoint" until 2026-12-01)
        damage = f"{ckpt_dir / MANIFEST} is missing"
    if damage is None:
        return manifest
    older, _ = _manifest_in(ckpt_dir / PREVIOUS) if fallback else (None, None)
    if older is None:
        raise CheckpointError(damage)
    if (str(ckpt_dir), damage) not in _FELL_BACK:  # once a process: every reader of the run meets it
        _FELL_BACK.add((str(ckpt_dir), damage))
        log.warning(
            "%s; resuming from the checkpoint before it (%s, at %s samples)",
            damage,
            older["seq"],
            older.get("samples", "?"),
        )
    return older


_FELL_BACK: set[tuple[str, str]] = set()


def _manifest_in(path: Path) -> tuple[dict[str, Any] | None, str | None]:
    """The manifest in ``path`` (None, None: there is no file), or what makes it unusable."""
    if not path.is_file():
        return None, None
    try:
        manifest = json.loads(path.read_text())
    except ValueError as exc:  # torn, or not text
        return None, f"cannot read {path}: {exc}"
    except OSError as exc:  # the disk, not the file: no fallback
        raise CheckpointError(f"cannot read {path}: {exc}") from None
    problem = manifest_problem(manifest)
    if problem:
        return None, f"{path} is not a distsgd checkpoint manifest: {problem}"
    return manifest, None


def resume_hint(out: str | Path | None) -> str:
    """For a run that stopped: how to go on from its last whole checkpoint, if ``out`` has one
    ("; continue from ..."); else nothing (a run stopped before its first commit has none to offer)."""
    try:
        manifest = read_manifest(Path(out)) if out else None
    except CheckpointError:
        return ""
    if manifest is None:
        return ""
    return f"; continue from the last checkpoint with --resume {out}"


def remove_uncommitted(run_dir: Path) -> None:
    """The files of checkpoints that were never committed (newer than the manifest's, or all when
    there is none: a run that stopped, or whose disk filled, before it committed them), and the
    temporaries of killed writers: a resume would never read them. Run by the launching process
    once no worker writes any more."""
    ckpt_dir = Path(run_dir) / CHECKPOINT_DIR
    if not ckpt_dir.is_dir():
        return
    try:
        manifest = read_manifest(run_dir, fallback=False)
    except CheckpointError:
        return  # nothing is sure: leave every file (the newest a damaged manifest names among them)
    newest = -1 if manifest is None else manifest["seq"]
    for kept in ckpt_dir.glob("manifest.damaged-*.json"):  # a damaged checkpoint a resume fell back from: kept
        seq = kept.name[len("manifest.damaged-") : -len(".json")]
        newest = max(newest, int(seq)) if seq.isdigit() else newest
    for path in ckpt_dir.glob("ckpt-*-rank*.pt"):
        part_of = _seq_of(path.name)
        if part_of is not None and part_of > newest:
            path.unlink(missing_ok=True)
    remove_stale_temporaries(ckpt_dir)


def manifest_problem(manifest: object) -> str | None:
    """What makes ``manifest`` unusable (None: its fields have the types and ranges a resume reads)."""

    def whole(v: object) -> bool:
        return isinstance(v, int) and not isinstance(v, bool)

    if not isinstance(manifest, dict):
        return f"a JSON {type(manifest).__name__}, not an object"
    if not whole(manifest.get("seq")) or manifest["seq"] < 0:
        return f"seq {manifest.get('seq')!r}"
    if not whole(manifest.get("world")) or not 1 <= manifest["world"] <= 1 << 20:
        return f"world {manifest.get('world')!r}"
    ranks = manifest.get("ranks", list(range(manifest["world"])))
    if not isinstance(ranks, list) or not all(whole(r) and 0 <= r < manifest["world"] for r in ranks):
        return f"ranks {ranks!r}"
    if len(set(ranks)) < len(ranks):
        return f"ranks {ranks!r}: a worker listed twice"
    if not isinstance(manifest.get("coordinator", False), bool):
        return f"coordinator {manifest.get('coordinator')!r}"
    if not ranks and not manifest.get("coordinator", False):  # (a coordinator's checkpoint may hold its part alone)
        return "ranks []: no worker's part and no coordinator's"
    if not isinstance(manifest.get("algo", ""), str):
        return f"algo {manifest['algo']!r}"
    for key in ("samples", "epoch", "step"):
        if key in manifest and (not whole(manifest[key]) or manifest[key] < 0):
            return f"{key} {manifest[key]!r}"
    for key in ("settings", "options"):  # the settings its state depends on (config.checkpoint_record)
        if not isinstance(manifest.get(key, {}), dict):
            return f"{key} {manifest[key]!r}"
    return None


def load_worker_state(run_dir: Path, rank: int | str, manifest: dict[str, Any] | None = None) -> dict[str, Any] | None:
    """This worker's (or, with rank ``COORDINATOR``, the coordinator's) state from the newest whole
    checkpoint in ``run_dir`` (weights only); None when that checkpoint has none for it (an
    asynchronous run's worker that had died)."""
    return _worker_state(run_dir, manifest if manifest is not None else read_manifest(run_dir), rank)


def _worker_state(run_dir: Path, manifest: dict[str, Any] | None, rank: int | str) -> dict[str, Any] | None:
    """:func:`load_worker_state` of the checkpoint ``manifest`` (``run_dir``'s, already read) names."""
    if manifest is None:
        raise CheckpointError(
            f"no checkpoint in {run_dir} (train with --checkpoint-every, or run.checkpoint() in your loop, to make one)"
        )
    if rank == COORDINATOR and not manifest.get("coordinator"):
        return None
    if rank != COORDINATOR and rank not in manifest.get("ranks", range(manifest["world"])):
        return None
    path = worker_file(Path(run_dir) / CHECKPOINT_DIR, manifest["seq"], rank)
    try:
        data = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise CheckpointError(f"cannot load checkpoint {path}: {first}") from None
    return loaded(data, path)


class Loaded(dict):
    """A worker's file as loaded, or one of its pieces: a dict that knows the file it came from
    (what :func:`scatter`'s errors name)."""

    def __init__(self, data: dict[str, Any], path: Path) -> None:
        super().__init__(data)
        self.path = path
        if hasattr(data, "_metadata"):  # a module's state_dict: its modules' versions, which loading reads
            self._metadata = data._metadata


def loaded(data: object, path: Path) -> Loaded:
    """``data`` (a worker's file, as torch loaded it) as a :class:`Loaded`, each piece too; a
    CheckpointError if it is not the dict of pieces distsgd writes."""
    if not isinstance(data, dict) or not all(isinstance(k, str) for k in data):
        raise CheckpointError(f"cannot resume from {path}: it holds a {type(data).__name__}, not a distsgd checkpoint")
    return Loaded({k: Loaded(v, path) if isinstance(v, dict) else v for k, v in data.items()}, path)


# --- the stateful pieces of a run, saved and restored together ------------------------------------
class Stateful(Protocol):
    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


# Each piece checks every field it reads (type, shape, range) with these, as it loads: a checkpoint's
# file is read back whole, and a value distsgd never writes there (a hand edit, a file from
# elsewhere) is one CheckpointError naming the file and the field, not a traceback now or later.
def _whole(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def count(state: dict[str, Any], key: str) -> int:
    """``state[key]``, a whole number >= 0 (samples, steps, bytes)."""
    value = state[key]
    if not _whole(value) or value < 0:
        raise BadField(key, value, "a whole number >= 0")
    return value


def seconds(state: dict[str, Any], key: str) -> float:
    """``state[key]``, a finite number of seconds >= 0."""
    value = state[key]
    if _whole(value) or isinstance(value, float):
        if math.isfinite(value) and value >= 0:
            return float(value)
    raise BadField(key, value, "a number of seconds >= 0")


def flag(state: dict[str, Any], key: str) -> bool:
    value = state[key]
    if not isinstance(value, bool):
        raise BadField(key, value, "true or false")
    return value


def of_type(state: dict[str, Any], key: str, kind: type | tuple[type, ...], what: str) -> Any:
    """``state[key]``, an instance of ``kind`` (``what``: how the message words it)."""
    value = state[key]
    if not isinstance(value, kind) or isinstance(value, bool) and kind is not bool:
        raise BadField(key, value, what)
    return value


def evaluations(state: dict[str, Any], key: str) -> list[dict[str, Any]]:
    """``state[key]``, a list of evaluation events, each with its samples and time (which a summary
    reports; its figures may be nan: measured so)."""
    events = of_type(state, key, list, "a list of evaluations")
    for event in events:
        if not isinstance(event, dict):
            raise BadField(key, events, "a list of evaluations")
        count(event, "samples")
        seconds(event, "train_wall_s")
    return events


def tensor(
    state: dict[str, Any], key: str, dtype: torch.dtype | None = None, shape: tuple[int, ...] | None = None
) -> torch.Tensor:
    """``state[key]``, a tensor (of ``dtype`` and ``shape``, when given)."""
    value = state[key]
    if (
        not isinstance(value, torch.Tensor)
        or dtype is not None
        and value.dtype != dtype
        or shape is not None
        and tuple(value.shape) != shape
    ):
        kind = "" if dtype is None else f"{str(dtype).removeprefix('torch.')} "
        raise BadField(key, value, f"a {kind}tensor" + ("" if shape is None else f" of shape {list(shape)}"))
    return value


def state_mismatch(expected: dict[str, torch.Tensor], saved: dict[str, Any]) -> str | None:
    """How the state dict ``saved`` does not fit a module whose own is ``expected`` (None: it
    fits): its missing and unexpected keys and its tensors of another shape, a few of each, in one line."""

    def some(keys: list[str]) -> str:
        return ", ".join(repr(k) for k in keys[:3]) + (f" ({len(keys)} in all)" if len(keys) > 3 else "")

    missing = [k for k in expected if k not in saved]
    unexpected = [k for k in saved if k not in expected]
    shaped = [k for k in expected if k in saved and not isinstance(saved[k], torch.Tensor)]
    reshaped = [
        f"{k} is {list(saved[k].shape)} there and {list(v.shape)} in the model"
        for k, v in expected.items()
        if isinstance(saved.get(k), torch.Tensor) and saved[k].shape != v.shape
    ]
    parts = [
        *([f"missing {some(missing)}"] if missing else []),
        *([f"unexpected {some(unexpected)}"] if unexpected else []),
        *([f"not tensors: {some(shaped)}"] if shaped else []),
        *reshaped[:3],
        *([f"{len(reshaped) - 3} more of another shape"] if len(reshaped) > 3 else []),
    ]
    return "; ".join(parts) or None


def optimizer_layout(state: dict[str, Any]) -> list[dict[str, Any]]:
    """The parameter groups of a torch optimiser's ``state_dict`` ``state``, checked: at least one
    group, each with its parameters' indices and a learning rate; a per-parameter ``state`` dict."""
    of_type(state, "state", dict, "a dict of the parameters' state")
    groups = of_type(state, "param_groups", list, "a list of parameter groups")
    if not groups or not all(isinstance(g, dict) for g in groups):
        raise BadField("param_groups", groups, "a list of one or more parameter groups")
    for group in groups:
        params = group.get("params")
        if not isinstance(params, list) or not all(_whole(i) and i >= 0 for i in params):
            raise BadField("param_groups' params", params, "a list of parameter indices")
        lr = group.get("lr")
        if not isinstance(lr, (int, float, torch.Tensor)) or isinstance(lr, bool) or not math.isfinite(float(lr)):
            raise BadField("param_groups' lr", lr, "a finite learning rate")
    return groups


def _restore_optimizer(optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
    groups = optimizer_layout(state)
    if [len(g["params"]) for g in groups] != [len(g["params"]) for g in optimizer.param_groups]:
        sizes = [len(g["params"]) for g in optimizer.param_groups]
        raise BadField("param_groups", [len(g["params"]) for g in groups], f"groups of {sizes} parameters, this run's")
    optimizer.load_state_dict(state)
    for group in optimizer.param_groups:  # what the optimiser keeps per parameter has the parameter's shape
        for p in group["params"]:
            for key, value in optimizer.state.get(p, {}).items():
                if isinstance(value, torch.Tensor) and value.dim() and value.shape != p.shape:
                    raise BadField(f"state's {key}", value, f"a tensor of its parameter's shape {list(p.shape)}")


def _restore_module(module: nn.Module, state: dict[str, Any]) -> None:
    problem = state_mismatch(module.state_dict(), state)
    if problem is not None:
        raise CheckpointError(f"does not fit the model: {problem}")
    module.load_state_dict(state)


def restore(piece: Stateful | nn.Module | torch.optim.Optimizer, state: dict[str, Any]) -> None:
    """``piece.load_state_dict(state)``, with the checks a module and an optimiser need beyond
    their own (a piece of distsgd's checks its fields itself)."""
    if isinstance(piece, nn.Module):
        _restore_module(piece, state)
    elif isinstance(piece, torch.optim.Optimizer):
        _restore_optimizer(piece, state)
    else:
        piece.load_state_dict(state)


class RngState:
    """The global random states a worker's loop draws from, as a stateful piece: torch's (dropout)
    on the CPU and, when the process uses CUDA, on its current GPU, the one a worker trains on (a
    checkpoint written on a GPU resumes there exactly; not every GPU of the machine, which a
    machine with fewer could not take); Python's ``random`` and numpy's global one (a loop's or a
    Dataset's augmentations). A checkpoint from before the last two were saved restores torch's.
    ``apply=False``: one that only checks a saved state (the launcher's look before a resume)."""

    def __init__(self, apply: bool = True) -> None:
        self.apply = apply

    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {"torch": torch.get_rng_state()}
        if torch.cuda.is_initialized():
            state["cuda"] = torch.cuda.get_rng_state()
        version, words, gauss = random.getstate()
        state["python"] = {"version": version, "words": torch.tensor(words, dtype=torch.int64), "gauss": gauss}
        _, keys, pos, has_gauss, cached = cast(tuple[str, np.ndarray, int, int, float], np.random.get_state())
        state["numpy"] = {
            "keys": torch.from_numpy(keys.astype(np.int64)),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached": float(cached),
        }
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        cpu = tensor(state, "torch", torch.uint8, tuple(torch.get_rng_state().shape))
        cuda = tensor(state, "cuda", torch.uint8) if "cuda" in state else None
        python = _python_random(state["python"]) if "python" in state else None
        numpy = _numpy_random(state["numpy"]) if "numpy" in state else None
        if not self.apply:
            return
        torch.set_rng_state(cpu)
        if cuda is not None and torch.cuda.is_initialized():
            torch.cuda.set_rng_state(cuda)
        if python is not None:
            random.setstate(python)
        if numpy is not None:
            np.random.set_state(numpy)


def _python_random(saved: Any) -> tuple[Any, ...]:
    """Python's ``random`` state from :class:`RngState`'s record of it, checked."""
    if not isinstance(saved, dict):
        raise BadField("python", saved, "a dict of Python's random state")
    version = count(saved, "version")
    words = tensor(saved, "words", torch.int64, (625,))
    gauss = saved.get("gauss")
    if gauss is not None and not isinstance(gauss, float):
        raise BadField("gauss", gauss, "a float or None")
    return version, tuple(int(w) for w in words.tolist()), gauss


def _numpy_random(saved: Any) -> tuple[Any, ...]:
    """numpy's global random state from :class:`RngState`'s record of it, checked."""
    if not isinstance(saved, dict):
        raise BadField("numpy", saved, "a dict of numpy's random state")
    keys = tensor(saved, "keys", torch.int64, (624,))
    cached = of_type(saved, "cached", float, "a float")
    return "MT19937", keys.numpy().astype(np.uint32), count(saved, "pos"), count(saved, "has_gauss"), cached


def restore_shared(saved: dict[str, Any], models: list[nn.Module], counts: torch.Tensor) -> None:
    """The shared-memory launcher's models and sample counts from its file of a checkpoint (as
    loaded), each checked: errors as :func:`scatter`'s."""
    where = f"cannot resume from {getattr(saved, 'path', 'the checkpoint')}: "
    try:
        states = of_type(saved, "models", list, f"a list of {len(models)} models' states")
        if len(states) != len(models) or not all(isinstance(st, dict) for st in states):
            raise BadField("models", states, f"a list of {len(models)} models' states")
        for model, state in zip(models, states):
            _restore_module(model, state)
        counts.copy_(tensor(saved, "counts", counts.dtype, tuple(counts.shape)))
        if bool((counts < 0).any()):
            raise BadField("counts", saved["counts"].tolist(), "samples counts >= 0")
    except KeyError as exc:
        raise CheckpointError(f"{where}the checkpoint has no {exc}{_why_missing(saved)}") from None
    except BadField as exc:
        raise CheckpointError(f"{where}its {exc}") from None
    except CheckpointError as exc:
        raise CheckpointError(f"{where}its shared model {exc}") from None


def load_model_state(model: nn.Module, saved: dict[str, Any]) -> None:
    """A worker's model from its file's ``model`` piece (as loaded): errors as :func:`scatter`'s."""
    holder = Loaded({"model": saved}, saved.path) if isinstance(saved, Loaded) else {"model": saved}
    scatter({"model": model}, holder)


def gather(pieces: dict[str, Stateful]) -> dict[str, Any]:
    """Every piece's state, under the piece's name."""
    return {name: piece.state_dict() for name, piece in pieces.items()}


def scatter(pieces: dict[str, Any], state: dict[str, Any]) -> None:
    """Give every piece its saved state back (``state``: a worker's file as loaded, which names
    it in errors). Each piece reads the keys its ``state_dict`` writes, with no fallback for the
    layouts of older versions, and checks them: a key it lacks, a value of another type, shape or
    range, anything it cannot take, is one CheckpointError naming the file, the piece and the field."""
    path = getattr(state, "path", None)
    where = f"cannot resume from {path}: " if path is not None else ""
    for name, piece in pieces.items():
        if name not in state:
            raise CheckpointError(f"{where}the checkpoint has no '{name}' part{_why_missing(state)}")
        part = state[name]
        if not isinstance(part, dict):
            raise CheckpointError(f"{where}its {BadField(name, part, 'a dict of its fields')}")
        try:
            restore(piece, part)
        except KeyError as exc:
            raise CheckpointError(
                f"{where}the checkpoint has no {exc} in its '{name}' part{_why_missing(state)}"
            ) from None
        except BadField as exc:
            raise CheckpointError(f"{where}its '{name}' part's {exc}") from None
        except CheckpointError as exc:
            raise CheckpointError(f"{where}its '{name}' part {exc}") from None
        except Exception as exc:  # what a piece's own load_state_dict (torch's) raises for a value it cannot take
            first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
            raise CheckpointError(
                f"{where}its '{name}' part cannot be restored ({type(exc).__name__}: {first})"
            ) from None


def _why_missing(state: dict[str, Any]) -> str:
    """Why a file lacks a piece or a field, as its format says: an older distsgd's layout only
    where the file is one (it predates the marker, or names an older format)."""
    fmt = state.get("format")
    if fmt is None or _whole(fmt) and fmt < CHECKPOINT_FORMAT:
        return (
            ": it was written by an older distsgd, whose checkpoints this version does not resume "
            "(train afresh, or resume with the version that wrote it)"
        )
    if _whole(fmt) and fmt > CHECKPOINT_FORMAT:
        return f": it was written by a newer distsgd (its format {fmt}; this version reads {CHECKPOINT_FORMAT})"
    return ": the file is damaged, or distsgd did not write it"


class Checkpointer:
    """Saves and restores one worker's stateful pieces (model, optimiser, algorithm, loop, random
    state): one file per worker per checkpoint, then rank 0 points the manifest at the new set."""

    def __init__(
        self, out: str | None, resume: str | None, rank: int, world: int, chosen: dict[str, Any] | None = None
    ) -> None:
        self.dir = Path(out) / CHECKPOINT_DIR if out else None
        self.resume, self.rank, self.world, self.chosen = resume, rank, world, chosen

    @functools.cached_property
    def manifest(self) -> dict[str, Any] | None:
        """The manifest of the checkpoint to resume from: ``chosen`` (the launcher's choice, see
        :attr:`~distsgd.train.context.Job.resume_from`), else that of the run given to ``--resume``,
        read once (None: a fresh run, or no checkpoint there)."""
        if not self.resume:
            return None
        return self.chosen if self.chosen is not None else read_manifest(Path(self.resume))

    def load(self) -> dict[str, Any] | None:
        """This worker's saved pieces from the run given to ``--resume`` (None: a fresh run). The
        caller scatters them, the model before the algorithm wraps it, the rest after."""
        return _worker_state(Path(self.resume), self.manifest, self.rank) if self.resume else None

    def load_peers(self) -> dict[str, Any] | None:
        """For a worker of a lockstep group with no part in the checkpoint given to ``--resume``
        (the group had lost it, and trained through, before that checkpoint: ``--min-workers``):
        the part of the lowest worker that has one, less its random state, as a replacement that
        joins such a group takes a live peer's state (model, optimiser, algorithm, counters).
        None where the checkpoint has no worker's part (a coordinator's alone)."""
        manifest = self.manifest
        ranks = manifest.get("ranks", []) if manifest is not None and not manifest.get("coordinator") else []
        if not ranks:
            return None
        peer = _worker_state(Path(cast(str, self.resume)), manifest, min(ranks))
        if peer is not None:
            peer.pop("rng", None)
        return peer

    def save(self, seq: int, pieces: dict[str, Stateful]) -> None:
        """This worker's part of checkpoint ``seq``; a file that cannot be written (a full disk) is
        an OutputError naming it."""
        assert self.dir is not None, "checkpoints need a run directory"
        try:
            save_worker_state(self.dir, seq, self.rank, gather(pieces))
        except OSError as exc:
            raise OutputError.of(exc) from None

    def commit(self, seq: int, meta: dict[str, Any], ranks: list[int] | None = None, coordinator: bool = False) -> None:
        """Once every worker has saved: the manifest now names checkpoint ``seq``."""
        assert self.dir is not None
        try:
            commit_checkpoint(self.dir, seq, self.world, meta, ranks, coordinator)
        except OSError as exc:
            raise OutputError.of(exc) from None
