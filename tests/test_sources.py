"""Where dataset files are looked for, the offline error, and checksummed downloads."""

from __future__ import annotations

import functools
import hashlib
import http.server
import threading
from pathlib import Path

import pytest

from distsgd.data import sources
from distsgd.errors import DataError
from helpers import make_idx_dataset


def test_search_order(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    explicit = make_idx_dataset(tmp_path / "explicit")
    env = make_idx_dataset(tmp_path / "env" / "kmnist")
    cache = make_idx_dataset(sources.cache_root() / "kmnist")
    assert sources.locate("kmnist") == cache
    monkeypatch.setenv("DISTSGD_DATA", str(tmp_path / "env"))
    assert sources.locate("kmnist") == env
    assert sources.locate("kmnist", data_dir=str(explicit)) == explicit


def test_offline_error_lists_places_and_how(tmp_path: Path) -> None:
    with pytest.raises(DataError) as info:
        sources.locate("kmnist", data_dir=str(tmp_path / "mine"))
    message = str(info.value)
    assert "\n" not in message
    assert str(tmp_path / "mine") in message
    assert str(sources.cache_root() / "kmnist") in message
    assert "/usr/share/datasets/kmnist" in message
    assert "DISTSGD_OFFLINE" in message and "--data-dir" in message and "train-images-idx3-ubyte.gz" in message


def test_partial_folder_is_not_used(tmp_path: Path) -> None:
    folder = make_idx_dataset(tmp_path / "partial")
    (folder / "t10k-labels-idx1-ubyte.gz").unlink()
    with pytest.raises(DataError, match="not found"):
        sources.locate("mnist", data_dir=str(folder))


@pytest.fixture
def file_server(tmp_path: Path):
    root = tmp_path / "mirror"
    root.mkdir()
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(root))
    handler.log_message = lambda *a, **k: None  # type: ignore[attr-defined]
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield root, f"http://127.0.0.1:{server.server_address[1]}/"
    server.shutdown()
    server.server_close()


def _source_served_by(root: Path, url: str, corrupt: str | None = None) -> sources.Source:
    make_idx_dataset(root)
    remotes = []
    for name in sources._IDX_FILES:
        data = (root / f"{name}.gz").read_bytes()
        md5 = hashlib.md5(data).hexdigest()
        if name == corrupt:
            md5 = "0" * 32
        remotes.append(sources.Remote(f"{name}.gz", md5, ("http://127.0.0.1:9/", url)))
    return sources.Source("testset", sources._IDX_FILES, tuple(remotes), homepage="https://example.invalid")


def test_download_checks_md5_and_falls_back_to_next_mirror(file_server, monkeypatch: pytest.MonkeyPatch) -> None:
    root, url = file_server
    monkeypatch.setitem(sources.SOURCES, "testset", _source_served_by(root, url))
    folder = sources.locate("testset", download=True)
    assert folder == sources.cache_root() / "testset"
    assert (folder / "train-images-idx3-ubyte.gz").read_bytes() == (root / "train-images-idx3-ubyte.gz").read_bytes()


def test_download_checksum_mismatch_is_an_error(file_server, monkeypatch: pytest.MonkeyPatch) -> None:
    root, url = file_server
    monkeypatch.setitem(sources.SOURCES, "testset", _source_served_by(root, url, corrupt="t10k-images-idx3-ubyte"))
    with pytest.raises(DataError, match="checksum mismatch"):
        sources.locate("testset", download=True)
    assert not (sources.cache_root() / "testset" / "t10k-images-idx3-ubyte.gz").exists()
