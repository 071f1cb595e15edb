"""Run directories: created for a run (or a bench), and replaced only where distsgd wrote them.

``--overwrite`` must never delete what the user made. A directory distsgd makes carries a ledger
(:data:`MARKER`): every file distsgd writes anywhere inside it is recorded there, by
:func:`record`, before it is written. Replacing the directory deletes the files its ledger lists
(and, in a distsgd directory made inside it, such as a bench's runs, the files that one's ledger
lists), and refuses, before deleting anything, when the directory holds any other file, however
deep and whatever its name. An empty directory is taken as it is; any other is refused.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from distsgd.config import HEADER, written_by_a_run
from distsgd.errors import ConfigError

MARKER = ".distsgd"
LEDGER = "# distsgd: the files it wrote in this directory, one a line (--overwrite deletes these and nothing else)"


def is_ours(folder: Path) -> bool:
    """Whether ``folder`` is a directory distsgd made (its marker, or a run's config.toml from before it)."""
    if (folder / MARKER).is_file():
        return True
    try:  # a config.toml that a run wrote
        with (folder / "config.toml").open("rb") as fh:
            return written_by_a_run(fh.read(len(HEADER)))
    except OSError:
        return False


def record(*paths: Path) -> None:
    """Note ``paths`` (about to be written) in the ledger of the nearest distsgd directory that holds
    them; nothing where none does. One append, so that processes writing at once do not mix lines."""
    lines = []
    for path in paths:
        path = Path(os.path.abspath(path))
        ledger = next((d / MARKER for d in path.parents if (d / MARKER).is_file()), None)
        if ledger is None or "\n" in str(path):  # (a name the ledger cannot hold stays unrecorded: never deleted)
            continue
        lines.append((ledger, str(path.relative_to(ledger.parent))))
    for ledger in {ledger for ledger, _ in lines}:
        fd = os.open(ledger, os.O_WRONLY | os.O_APPEND)
        try:
            os.write(fd, "".join(f"{name}\n" for where, name in lines if where == ledger).encode())
        finally:
            os.close(fd)


def wrote(path: Path) -> bool:
    """Whether the ledger of the nearest distsgd directory holding ``path`` lists it."""
    path = Path(os.path.abspath(path))
    folder = next((d for d in path.parents if (d / MARKER).is_file()), None)
    return folder is not None and str(path.relative_to(folder)) in (_written(folder) or set())


def _written(folder: Path) -> set[str] | None:
    """What ``folder``'s ledger lists (None: no ledger; an older distsgd's marker, which lists nothing)."""
    try:
        lines = (folder / MARKER).read_text(errors="replace").splitlines()
    except OSError:
        return None
    return set(lines[1:]) if lines and lines[0] == LEDGER else None


def remove_ours(out: Path, *paths: Path) -> None:
    """Delete each of ``paths`` (files, or folders whose every file) that ``out``'s ledger says
    distsgd wrote; anything else, and any folder holding a file it did not write, stays."""
    written = _written(out)
    if written is None:
        return
    for path in paths:
        if path.is_dir() and not path.is_symlink():
            ours, theirs = _sort(path, written, path.name + "/")
            if not theirs:
                shutil.rmtree(path)
        elif path.is_file() and path.name in written:
            path.unlink()


def _sort(folder: Path, written: set[str], prefix: str = "") -> tuple[list[Path], list[Path]]:
    """The files under ``folder`` that distsgd wrote (its ledger ``written`` lists them, or the ledger
    of a distsgd directory it lists) and those it did not. Symbolic links are not followed."""
    ours: list[Path] = []
    theirs: list[Path] = []
    for child in sorted(folder.iterdir()):
        name = prefix + child.name
        if child.is_dir() and not child.is_symlink():
            inner = _written(child) if name in written else None  # a distsgd directory made in this one
            o, t = _sort(child, inner) if inner is not None else _sort(child, written, name + "/")
            ours += o
            theirs += t
        elif name in written or name == MARKER:
            ours.append(child)
        else:
            theirs.append(child)
    return ours, theirs


def refusal(out: Path, overwrite: bool, keep: Path | None = None, kind: str = "run") -> list[Path]:
    """What :func:`prepare` refuses, found with nothing written (a ConfigError); else the files
    ``--overwrite`` would delete there."""
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--out {out} exists and is not a directory")
    if keep is not None:
        a, b = out.resolve(), Path(keep).resolve()
        if a == b or a in b.parents or b in a.parents:
            raise ConfigError(
                f"--out {out} would replace the run being resumed ({keep}): resume into it, or give another --out"
            )
    if not (out.is_dir() and any(out.iterdir())):
        return []
    if not overwrite:
        raise ConfigError(f"{kind} directory {out} already exists; choose another --out or pass --overwrite")
    if not is_ours(out):
        raise ConfigError(
            f"--out {out} holds files distsgd did not write; --overwrite replaces only a distsgd "
            f"{kind} directory (or an empty one): choose another --out"
        )
    written = _written(out)
    if written is None:
        raise ConfigError(
            f"--out {out} was written by an older distsgd, which did not record its files, and "
            f"--overwrite deletes only files distsgd recorded: delete it yourself, or choose "
            f"another --out"
        )
    ours, theirs = _sort(out, written)
    if theirs:
        shown = ", ".join(str(p.relative_to(out)) for p in theirs[:3]) + (", ..." if len(theirs) > 3 else "")
        raise ConfigError(
            f"--out {out} also holds {shown}, which distsgd did not write, and --overwrite never "
            f"deletes those: move them, or choose another --out"
        )
    return ours


def prepare(out: Path, overwrite: bool, keep: Path | None = None, kind: str = "run") -> Path:
    """Create ``out`` for a run (or a bench: ``kind``), with its ledger. An existing non-empty
    ``out`` is replaced only with ``overwrite``, only if distsgd made it, only if it holds nothing
    but files distsgd recorded writing, and never if it is, holds or lies inside ``keep`` (the run
    being resumed)."""
    out = Path(out)
    ours = refusal(out, overwrite, keep, kind)
    existed = out.is_dir()
    for path in ours:
        path.unlink()
    for folder in sorted({d for p in ours for d in p.parents if out in d.parents}, key=lambda d: -len(d.parts)):
        try:  # the folders that held them, once empty (an empty folder of the user's stays)
            folder.rmdir()
        except OSError:
            pass
    record(out)  # in the ledger of a distsgd directory that holds this one (a bench's runs)
    try:  # made now, by this run alone: another started with the same name a moment ago is refused
        out.mkdir(parents=True, exist_ok=existed)
    except FileExistsError:
        raise ConfigError(f"{kind} directory {out} already exists; choose another --out or pass --overwrite") from None
    (out / MARKER).write_text(f"{LEDGER}\n")
    return out


__all__ = ["MARKER", "is_ours", "prepare", "record", "refusal", "wrote"]
