"""Where dataset files come from.

For a built-in dataset the files are looked for, in order, in:

1. ``--data-dir`` (the files directly in it, or in ``<data-dir>/<name>``),
2. ``$DISTSGD_DATA`` (likewise),
3. the user cache ``~/.cache/distsgd/<name>`` (``$XDG_CACHE_HOME`` is honoured),
4. system folders ``/usr/share/datasets/<name>`` (Debian's ``dataset-fashion-mnist`` installs
   there; ``$DISTSGD_SYSTEM_DATASETS``, a ``:``-separated list, replaces these roots),
5. the copy shipped inside distsgd (Fashion-MNIST only, so that the default job trains on a
   machine with no network; its files' contents are checked against their published MD5s),

and, if none has them, downloaded from the dataset's public mirrors into the cache, each file
checked against its published MD5. ``DISTSGD_OFFLINE=1`` skips the download. When nothing works
the error lists every place tried and how to get the files.
"""

from __future__ import annotations

import hashlib
import logging
import os
import tarfile
import tempfile
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from distsgd.errors import DataError

log = logging.getLogger(__name__)

_IDX_FILES = ("train-images-idx3-ubyte", "train-labels-idx1-ubyte", "t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte")
CIFAR_BATCHES = tuple(f"data_batch_{i}" for i in range(1, 6)) + ("test_batch",)


@dataclass(frozen=True)
class Remote:
    """A file to download: its name, the mirrors that serve it, and its MD5."""

    name: str
    md5: str
    mirrors: tuple[str, ...]


@dataclass(frozen=True)
class Source:
    """A built-in dataset: the files it needs and where they can be downloaded from."""

    name: str
    needed: tuple[str, ...]  # file names (a ``.gz`` twin is accepted for IDX files)
    remotes: tuple[Remote, ...] = ()
    archive_dir: str | None = None  # folder an archive unpacks into (CIFAR)
    system_names: tuple[str, ...] = field(default_factory=tuple)
    homepage: str = ""
    content_md5: tuple[str, ...] = ()  # published MD5s of the uncompressed ``needed`` files (the bundled copy)


def _idx_remotes(mirrors: tuple[str, ...], md5s: tuple[str, str, str, str]) -> tuple[Remote, ...]:
    return tuple(Remote(f"{n}.gz", m, mirrors) for n, m in zip(_IDX_FILES, md5s))


SOURCES: dict[str, Source] = {
    "mnist": Source(
        "mnist",
        _IDX_FILES,
        _idx_remotes(
            ("https://ossci-datasets.s3.amazonaws.com/mnist/", "http://yann.lecun.com/exdb/mnist/"),
            (
                "f68b3c2dcbeaaa9fbdd348bbdeb94873",
                "d53e105ee54ea40749a09fcbcd1e9432",
                "9fb629c4189551a2d022fa330f9573f3",
                "ec29112dd5afa0611ce80d1b7f02629c",
            ),
        ),
        homepage="http://yann.lecun.com/exdb/mnist/",
    ),
    "fashion-mnist": Source(
        "fashion-mnist",
        _IDX_FILES,
        _idx_remotes(
            ("http://fashion-mnist.s3-website.eu-central-1.amazonaws.com/",),
            (
                "8d4fb7e6c68d591d4c3dfef9ec88bf0d",
                "25c81989df183df01b3e8a0aad5dffbe",
                "bef4ecab320f06d8554ea6380940ec79",
                "bb300cfdad3c16e7a12a480ee83cd310",
            ),
        ),
        system_names=("fashion-mnist",),
        homepage="https://github.com/zalandoresearch/fashion-mnist (Debian: apt-get install dataset-fashion-mnist)",
        content_md5=(
            "f4a8712d7a061bf5bd6d2ca38dc4d50a",
            "9018921c3c673c538a1fc5bad174d6f9",
            "8181f5470baa50b63fa0f6fddb340f0a",
            "15d484375f8d13e6eb1aabb0c3f46965",
        ),
    ),
    "kmnist": Source(
        "kmnist",
        _IDX_FILES,
        _idx_remotes(
            ("http://codh.rois.ac.jp/kmnist/dataset/kmnist/",),
            (
                "bdb82020997e1d708af4cf47b453dcf7",
                "e144d726b3acfaa3e44228e80efcd344",
                "5c965bf0a639b31b8f53240b1b52f4d7",
                "7320c461ea6c1c855c0b718fb2a4b134",
            ),
        ),
        homepage="https://github.com/rois-codh/kmnist",
    ),
    "cifar10": Source(
        "cifar10",
        CIFAR_BATCHES,
        (Remote("cifar-10-python.tar.gz", "c58f30108f718f92721af3b95e74349a", ("https://www.cs.toronto.edu/~kriz/",)),),
        archive_dir="cifar-10-batches-py",
        homepage="https://www.cs.toronto.edu/~kriz/cifar.html",
    ),
}


def cache_root() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "distsgd"


SYSTEM_ROOTS = (Path("/usr/share/datasets"), Path("/usr/local/share/datasets"))
BUNDLED = Path(__file__).resolve().parent / "bundled"  # shipped with the package (Fashion-MNIST)


def system_roots() -> list[Path]:
    env = os.environ.get("DISTSGD_SYSTEM_DATASETS")
    if env is not None:
        return [Path(p) for p in env.split(":") if p]
    return list(SYSTEM_ROOTS)


def candidate_dirs(source: Source, data_dir: str | None) -> list[Path]:
    """The folders searched for ``source``'s files, in order."""
    roots: list[Path] = []
    if data_dir:
        roots += [Path(data_dir), Path(data_dir) / source.name]
    env = os.environ.get("DISTSGD_DATA")
    if env:
        roots += [Path(env), Path(env) / source.name]
    roots.append(cache_root() / source.name)
    for system in system_roots():
        roots += [system / n for n in (source.system_names or (source.name,))]
    if source.content_md5:
        roots.append(BUNDLED / source.name)
    if source.archive_dir:
        roots = [r for root in roots for r in (root, root / source.archive_dir)]
    seen: list[Path] = []
    for r in roots:
        if r not in seen:
            seen.append(r)
    return seen


def resolve_file(folder: Path, name: str) -> Path | None:
    for candidate in (folder / name, folder / f"{name}.gz"):
        if candidate.is_file():
            return candidate
    return None


def found_file(folder: Path, name: str) -> Path:
    """The path of a file :func:`locate` has found in ``folder``: ``name``, plain or gzipped."""
    path = resolve_file(folder, name)
    assert path is not None, f"{folder / name} vanished after locate found it"
    return path


def has_all(folder: Path, source: Source) -> bool:
    return all(resolve_file(folder, n) is not None for n in source.needed)


def locate(name: str, data_dir: str | None = None, download: bool | None = None) -> Path:
    """The folder that holds every file of built-in dataset ``name``, downloading if need be."""
    source = SOURCES[name]
    tried = candidate_dirs(source, data_dir)
    for folder in tried:
        if has_all(folder, source):
            if folder == BUNDLED / source.name:
                _check_bundled(folder, source)
            log.info("dataset %s: using files in %s", name, folder)
            return folder
    if download is None:
        download = os.environ.get("DISTSGD_OFFLINE", "") not in ("1", "true", "yes")
    problem = "download disabled by DISTSGD_OFFLINE=1"
    if download:
        target = cache_root() / name
        try:
            fetch(source, target)
            folder = target / source.archive_dir if source.archive_dir else target
            if has_all(folder, source):
                return folder
            problem = f"the download into {target} did not produce {', '.join(source.needed)}"
        except DataError as exc:
            problem = str(exc)
    places = ", ".join(str(p) for p in tried)
    wanted = ", ".join(r.name for r in source.remotes)
    raise DataError(
        f"dataset '{name}' not found; looked in: {places}; {problem}. "
        f"Get {wanted} from {source.homepage} and put them in {cache_root() / name} "
        f"(or pass --data-dir DIR, or set DISTSGD_DATA)"
    )


def _check_bundled(folder: Path, source: Source) -> None:
    """The shipped copy's contents against the published MD5s of the uncompressed files."""
    import gzip

    for name, expected in zip(source.needed, source.content_md5):
        path = resolve_file(folder, name)
        assert path is not None
        digest = hashlib.md5()  # noqa: S324 - the published checksums are MD5s
        with gzip.open(path, "rb") if path.suffix == ".gz" else path.open("rb") as fh:
            for block in iter(lambda: fh.read(1 << 20), b""):
                digest.update(block)
        if digest.hexdigest() != expected:
            raise DataError(
                f"the copy of {source.name} shipped with distsgd is damaged ({path}: md5 "
                f"{digest.hexdigest()}, published {expected}); reinstall distsgd"
            )


def md5sum(path: Path) -> str:
    digest = hashlib.md5()  # noqa: S324 - the datasets publish MD5s; this checks integrity
    with path.open("rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def fetch(source: Source, target: Path) -> None:
    """Download every remote file of ``source`` into ``target``, checking MD5s, then unpack."""
    target.mkdir(parents=True, exist_ok=True)
    for remote in source.remotes:
        dest = target / remote.name
        if dest.is_file() and md5sum(dest) == remote.md5:
            continue
        errors = []
        for mirror in remote.mirrors:
            url = mirror + remote.name
            try:
                _download(url, dest)
            except (urllib.error.URLError, OSError, TimeoutError) as exc:
                errors.append(f"{url}: {getattr(exc, 'reason', exc)}")
                continue
            got = md5sum(dest)
            if got != remote.md5:
                dest.unlink()
                errors.append(f"{url}: checksum mismatch (md5 {got}, expected {remote.md5})")
                continue
            break
        else:
            raise DataError("download failed: " + "; ".join(errors))
        if remote.name.endswith(".tar.gz"):
            _unpack(dest, target)


def _download(url: str, dest: Path) -> None:
    from tqdm import tqdm

    log.info("downloading %s", url)
    with urllib.request.urlopen(url, timeout=30) as response:  # noqa: S310 - fixed https/http mirrors
        total = int(response.headers.get("Content-Length") or 0) or None
        fd, tmp = tempfile.mkstemp(dir=dest.parent, prefix=f".{dest.name}.")
        try:
            with (
                os.fdopen(fd, "wb") as out,
                tqdm(total=total, unit="B", unit_scale=True, desc=dest.name, disable=None, leave=False) as bar,
            ):
                for block in iter(lambda: response.read(1 << 16), b""):
                    out.write(block)
                    bar.update(len(block))
            os.replace(tmp, dest)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise


def _unpack(archive: Path, target: Path) -> None:
    try:
        with tarfile.open(archive, "r:gz") as tar:
            members = [m for m in tar.getmembers() if m.isfile() and not os.path.isabs(m.name) and ".." not in m.name]
            tar.extractall(target, members=members)  # noqa: S202 - members filtered above
    except (tarfile.TarError, OSError) as exc:
        raise DataError(f"cannot unpack {archive}: {exc}") from None


def describe(name: str, data_dir: str | None = None) -> tuple[str, str]:
    """(status, where) of a built-in dataset, for ``distsgd datasets``; never downloads."""
    source = SOURCES[name]
    for folder in candidate_dirs(source, data_dir):
        if has_all(folder, source):
            return "available", str(folder)
    if os.environ.get("DISTSGD_OFFLINE", "") in ("1", "true", "yes"):  # as the download reads it
        return "not here (downloads off: DISTSGD_OFFLINE)", ""
    return "downloadable", ", ".join(r.mirrors[0] + r.name for r in source.remotes[:1]) + (
        " ..." if len(source.remotes) > 1 else ""
    )
