"""Run directories: created for a run (or a bench), and replaced only when they are distsgd's.

``--overwrite`` must never delete what the user made. A directory distsgd makes carries a marker
file (:data:`MARKER`); replacing one deletes only the entries distsgd writes (:data:`OURS`), and
refuses, before deleting anything, when the directory holds anything else. An empty directory is
taken as it is; any other directory is refused with one line. Directories of runs made before the
marker existed are recognised by their ``config.toml``'s first line.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from distsgd.config import is_run_config
from distsgd.errors import ConfigError

MARKER = ".distsgd"
# What a run, a bench or a compare writes into its directory (bench: runs/ holds run directories).
OURS = {MARKER, "config.toml", "metrics.jsonl", "summary.json", "model.pt", "checkpoint", "tb", "workers.json",
        "host-a.log", "host-b.log", "bench.json", "bench.md", "compare.json", "compare.md", "runs",
        "accuracy_vs_time.png", "accuracy_vs_samples.png", "throughput_vs_workers.png", "throughput_vs_time.png"}


def is_ours(folder: Path) -> bool:
    """Whether ``folder`` is a directory distsgd made (its marker, or a run's config.toml from before it)."""
    if (folder / MARKER).is_file():
        return True
    return is_run_config(folder / "config.toml")


def prepare(out: Path, overwrite: bool, keep: Path | None = None, kind: str = "run") -> Path:
    """Create ``out`` for a run (or a bench: ``kind``), with its marker. An existing non-empty
    ``out`` is replaced only with ``overwrite``, only if distsgd made it, only if it holds nothing
    but what distsgd writes, and never if it is, holds or lies inside ``keep`` (the run being
    resumed)."""
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--out {out} exists and is not a directory")
    if keep is not None:
        a, b = out.resolve(), Path(keep).resolve()
        if a == b or a in b.parents or b in a.parents:
            raise ConfigError(f"--out {out} would replace the run being resumed ({keep}): resume into it, or give "
                              f"another --out")
    if out.is_dir() and any(out.iterdir()):
        if not overwrite:
            raise ConfigError(f"{kind} directory {out} already exists; choose another --out or pass --overwrite")
        if not is_ours(out):
            raise ConfigError(f"--out {out} holds files distsgd did not write; --overwrite replaces only a distsgd "
                              f"{kind} directory (or an empty one): choose another --out")
        theirs = sorted(p.name for p in out.iterdir() if p.name not in OURS)
        if theirs:
            shown = ", ".join(theirs[:3]) + (", ..." if len(theirs) > 3 else "")
            raise ConfigError(f"--out {out} also holds {shown}, which distsgd did not write, and --overwrite never "
                              f"deletes those: move them, or choose another --out")
        for child in out.iterdir():
            shutil.rmtree(child) if child.is_dir() and not child.is_symlink() else child.unlink()
    out.mkdir(parents=True, exist_ok=True)
    (out / MARKER).write_text(f"{kind} directory written by distsgd\n")
    return out


__all__ = ["MARKER", "OURS", "is_ours", "prepare"]
