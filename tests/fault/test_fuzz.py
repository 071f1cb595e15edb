"""Fuzzed bad input (Hypothesis): TOML settings, npz arrays, IDX files, CIFAR batches, image
folders, model files, checkpoint manifests and the parameter server's wire. Whatever is
generated, the command ends with exit status 2 and one ``error:`` line, or works; never a
traceback, and a failed run leaves no run directory behind; the server keeps serving."""

from __future__ import annotations

import io
import json
import shutil
import socket
import struct
import time
import uuid
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path

import numpy as np
import pytest
import tomllib
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from distsgd import cli, config
from distsgd.config import RunConfig
from distsgd.errors import DistsgdError
from helpers import write_idx

FIELDS = [f for f in RunConfig.__dataclass_fields__]
FUZZ = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])

scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(10**12), 10**12),
    st.floats(allow_nan=True),
    st.text(max_size=12),
    st.lists(st.integers(), max_size=3),
)


def _cli(tmp: Path, *args: str) -> tuple[int, str, Path]:
    """Run the CLI in this process; (exit status, stderr, the run directory it was given)."""
    out = tmp / f"run-{uuid.uuid4().hex[:8]}"
    err = io.StringIO()
    with redirect_stderr(err):
        code = cli.main([*args, "--out", str(out), "--quiet"])
    return code, err.getvalue(), out


def _one_error_line(code: int, err: str, out: Path) -> None:
    lines = err.strip().splitlines()
    assert code == 2, err
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert "Traceback" not in err
    assert not out.exists(), "a failed run left its directory behind"


@pytest.mark.slow
@FUZZ
@given(st.dictionaries(st.sampled_from(FIELDS + ["lr_", "batchsize", "train"]), scalars, max_size=6))
def test_any_settings_table_is_valid_or_one_config_error(values: dict) -> None:
    """Typed and range checks reject every bad value with a ConfigError (never another exception)."""
    try:
        cfg = config.from_mapping(values, RunConfig(), source="fuzz")
        config.validate(cfg)
        cfg.checkpoint_period, cfg.checkpoint_period, cfg.straggler_spec  # the parsed strings too
    except DistsgdError as exc:
        assert type(exc).__name__ == "ConfigError" and "\n" not in str(exc)


@pytest.mark.slow
@FUZZ
@given(st.text(max_size=200))
def test_any_toml_text_is_one_error_line_or_a_config(tmp_path_factory, text: str) -> None:
    tmp = tmp_path_factory.mktemp("toml")
    path = tmp / "c.toml"
    path.write_text(text)
    try:
        tomllib.loads(text)
    except (tomllib.TOMLDecodeError, ValueError):
        # not TOML at all: the command says so in one line, before anything is made
        code, err, out = _cli(tmp, "train", "--config", str(path))
        _one_error_line(code, err, out)
        return
    try:
        config.load_toml(path)
    except DistsgdError as exc:
        assert "\n" not in str(exc)


def _npz(tmp: Path, arrays: dict) -> Path:
    path = tmp / "data.npz"
    np.savez(path, **arrays)
    return path


arrays = hnp.arrays(
    dtype=st.sampled_from([np.float32, np.float64, np.int64, np.uint8, np.bool_, np.int8]),
    shape=hnp.array_shapes(min_dims=0, max_dims=4, min_side=0, max_side=4),
)  # NaN and inf too


@FUZZ
@given(st.dictionaries(st.sampled_from(["x", "y", "x_test", "y_test", "z"]), arrays, max_size=4))
def test_any_npz_is_one_error_line_or_trains(tmp_path_factory, data: dict) -> None:
    tmp = tmp_path_factory.mktemp("npz")
    path = _npz(tmp, data)
    from distsgd.data import load_dataset

    try:
        ds = load_dataset(f"npz:{path}")
    except DistsgdError as exc:
        assert type(exc).__name__ == "DataError" and "\n" not in str(exc)
        code, err, out = _cli(tmp, "train", "--dataset", f"npz:{path}", "--model", "logreg", "--max-samples", "4")
        _one_error_line(code, err, out)
        return
    assert ds.n_train >= 1 and ds.n_test >= 1
    import distsgd  # arrays that load also train, or are refused with one line (in-process: fast)

    try:
        distsgd.train(model="logreg", data=f"npz:{path}", max_samples=4, quiet=True, out=str(tmp / "run"))
    except DistsgdError as exc:
        assert "\n" not in str(exc)


@FUZZ
@given(st.binary(max_size=40), st.sampled_from([0, 1, 2, 3]))
def test_any_idx_header_is_one_error_line(tmp_path_factory, header: bytes, which: int) -> None:
    """One of the four IDX files replaced by arbitrary bytes, or by a header that lies about its sizes."""
    tmp = tmp_path_factory.mktemp("idx")
    rng = np.random.default_rng(0)
    names = ["train-images-idx3-ubyte", "train-labels-idx1-ubyte", "t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"]
    for i, name in enumerate(names):
        shape = (6, 28, 28) if "images" in name else (6,)
        write_idx(tmp / name, rng.integers(0, 10, shape))
    (tmp / names[which]).write_bytes(header + (tmp / names[which]).read_bytes()[len(header) :])
    from distsgd.data import load_dataset

    try:
        load_dataset("mnist", data_dir=str(tmp), download=False)
    except DistsgdError as exc:
        assert type(exc).__name__ == "DataError" and "\n" not in str(exc)
        code, err, out = _cli(tmp, "train", "--dataset", "mnist", "--data-dir", str(tmp), "--max-samples", "4")
        _one_error_line(code, err, out)


def test_a_header_promising_more_than_the_file_has(tmp_path: Path) -> None:
    """A classic: dimensions in the header larger than the data."""
    from distsgd.data.formats import read_idx
    from distsgd.errors import DataError

    path = tmp_path / "labels"
    path.write_bytes(struct.pack(">HBB", 0, 0x08, 1) + struct.pack(">I", 10**9) + b"\x00" * 4)
    with pytest.raises(DataError, match="truncated"):
        read_idx(path)


# --- issue 27: every other reader, and the parameter server's frame decoder --------------------

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**40), 2**40) | st.floats() | st.text(max_size=6),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4),
    max_leaves=12,
)
pickled = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=6) | st.binary(max_size=8) | arrays,
    lambda inner: (
        st.lists(inner, max_size=4)
        | st.dictionaries(st.sampled_from([b"data", b"labels", b"batch_label", "data"]), inner, max_size=3)
    ),
    max_leaves=8,
)


@FUZZ
@given(
    st.one_of(
        st.binary(max_size=400),
        pickled,
        st.fixed_dictionaries({b"data": arrays | pickled, b"labels": arrays | pickled}),
    )
)
def test_any_cifar_batch_is_a_data_error_or_reads(tmp_path_factory, obj) -> None:
    """Arbitrary bytes, or any pickle of data and labels (of any type and shape)."""
    import pickle

    from distsgd.data import formats

    path = tmp_path_factory.mktemp("cifar") / "data_batch_1"
    path.write_bytes(obj if isinstance(obj, bytes) else pickle.dumps(obj, protocol=2))
    try:
        x, y = formats.read_cifar_batch(path)
    except DistsgdError as exc:
        assert type(exc).__name__ == "DataError" and "\n" not in str(exc)
        return
    assert x.shape[1:] == (3, 32, 32) and len(x) == len(y)


def _png(shape: tuple[int, ...], seed: int) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(np.random.default_rng(seed).integers(0, 256, shape, dtype=np.uint8)).save(buf, format="PNG")
    return buf.getvalue()


@FUZZ
@given(
    st.lists(st.tuples(st.integers(0, 3), st.integers(0, 10**6), st.binary(min_size=1, max_size=8)), max_size=4),
    st.integers(0, 3),
    st.one_of(st.none(), st.integers(0, 200)),
)
def test_any_damaged_image_folder_is_a_data_error_or_reads(tmp_path_factory, edits, which, cut) -> None:
    """Four PNGs in two classes; one is overwritten at random places, or cut short, or has
    another size. Reading the whole set either works or raises one DataError."""
    pytest.importorskip("PIL")
    from distsgd.data import load_dataset

    tmp = tmp_path_factory.mktemp("folder")
    files = []
    for i in range(4):
        folder = tmp / "train" / f"c{i % 2}"
        folder.mkdir(parents=True, exist_ok=True)
        files.append(folder / f"{i}.png")
        files[-1].write_bytes(_png((8, 8) if i != 3 or cut != 0 else (9, 8), i))
    data = bytearray(files[which].read_bytes())
    for _, at, patch in edits:
        at %= len(data)
        data[at : at + len(patch)] = patch
    files[which].write_bytes(bytes(data[:cut]) if cut else bytes(data))
    try:
        ds = load_dataset(f"folder:{tmp}")
        for split in (ds.train, ds.test):
            for i in range(len(split)):
                split[i]
    except DistsgdError as exc:
        assert type(exc).__name__ == "DataError" and "\n" not in str(exc)


@pytest.fixture(scope="module")
def small_run(tmp_path_factory) -> Path:
    """A finished single run on digits with a checkpoint (its model.pt and its manifest are fuzzed)."""
    pytest.importorskip("sklearn")
    import distsgd

    out = tmp_path_factory.mktemp("small") / "run"
    distsgd.train(model="logreg", data="digits", max_samples=64, checkpoint_every="32", quiet=True, out=str(out))
    return out


@FUZZ
@pytest.mark.slow
@given(
    st.lists(st.tuples(st.integers(0, 10**6), st.binary(min_size=1, max_size=4)), min_size=1, max_size=3),
    st.one_of(st.none(), st.integers(0, 10**6)),
)
def test_any_damaged_model_file_is_one_error_line_or_evaluates(tmp_path_factory, small_run, edits, cut) -> None:
    """``distsgd eval`` on a model.pt overwritten at random places or cut short."""
    tmp = tmp_path_factory.mktemp("model")
    data = bytearray((small_run / "model.pt").read_bytes())
    for at, patch in edits:
        at %= len(data)
        data[at : at + len(patch)] = patch
    path = tmp / "model.pt"
    path.write_bytes(bytes(data[: cut % len(data)]) if cut is not None else bytes(data))
    err = io.StringIO()
    with redirect_stderr(err), redirect_stdout(io.StringIO()):
        code = cli.main(["eval", "--checkpoint", str(path)])
    if code != 0:
        lines = err.getvalue().strip().splitlines()
        assert code == 2 and len(lines) == 1 and lines[0].startswith("error: "), err.getvalue()


@FUZZ
@given(
    st.one_of(
        json_values,
        st.fixed_dictionaries(
            {},
            optional={
                k: json_values | st.integers(-3, 3)
                for k in ("seq", "world", "ranks", "coordinator", "samples", "epoch")
            },
        ),
    )
)
def test_any_manifest_is_one_error_line_or_resumes(tmp_path_factory, small_run, manifest) -> None:
    """``distsgd train --resume`` of a run whose checkpoint manifest says anything at all."""
    tmp = tmp_path_factory.mktemp("manifest")
    run = tmp / "run"
    shutil.copytree(small_run, run)
    (run / "checkpoint" / "manifest.json").write_text(json.dumps(manifest))
    code, err, out = _cli(tmp, "train", "--resume", str(run), "--max-samples", "96")
    if code != 0:
        _one_error_line(code, err, out)


class _Role:
    def worker_hello(self, rank: int, rejoining: bool) -> None: ...
    def worker_done(self, rank: int, samples: int) -> None: ...
    def worker_gone(self, rank: int, why: str) -> None: ...
    def leave(self, rank: int, why: str) -> None: ...
    def commit_after(self, taken: None) -> None: ...
    def checkpointed(self, rank: int, seq: int, samples: int) -> None: ...


@pytest.fixture(scope="module")
def served():
    """A live parameter server (asgd's core, one worker) and its run's secret."""
    import torch

    from distsgd.algorithms import registry
    from distsgd.algorithms.param_server import ParameterServer, transport, wire

    cfg = config.resolve(RunConfig(lr=0.1, batch_size=8))
    algo = registry.get("asgd")
    rule = algo.topology.rule(cfg, algo.Options.from_mapping({}))
    ps = ParameterServer(cfg, torch.nn.Linear(3, 2), 1, rule)
    secret = bytes(range(32))
    service = transport.Service(
        ps, _Role(), wire.Layout.of(ps.model, ps.hypers.count), "127.0.0.1:0", silence_s=0.5, secret=secret
    )
    service.start()
    yield ps, service, secret
    service.close()


ops = st.one_of(st.integers(0, 7), st.integers(-(2**63), 2**63 - 1))
frames = st.lists(
    st.tuples(
        ops,
        st.integers(-(2**63), 2**63 - 1),
        st.integers(-(2**63), 2**63 - 1) | st.integers(0, 64),
        st.integers(-(2**63), 2**63 - 1),
        st.binary(max_size=96),
    ),
    max_size=4,
)


@pytest.mark.slow
@FUZZ
@given(st.booleans(), st.binary(max_size=80), frames)
def test_any_bytes_on_the_server_port_leave_it_serving(served, hello_first: bool, opening: bytes, requests) -> None:
    """Arbitrary bytes, or a proper HELLO followed by arbitrary requests (any op, version, sample
    count, flag and payload): the server drops what is wrong, its model stays finite, its sample
    count grows only as a worker can train, and the real worker still gets in."""
    import torch

    from distsgd.algorithms.averaging import flatten
    from distsgd.algorithms.param_server import transport, wire

    ps, service, secret = served
    before = ps.counts[1]
    host, port = service.address.rsplit(":", 1)
    with socket.create_connection((host, int(port))) as sock:
        sock.settimeout(0.2)
        try:
            sock.sendall(wire.hello_message(1, secret, groups=ps.hypers.describe()) if hello_first else opening)
            for op, a, b, c, payload in requests:
                sock.sendall(struct.pack("4q", op, a, b, c) + payload)
        except OSError:
            pass  # dropped already
        try:
            while sock.recv(65536):
                pass
        except OSError:
            pass
    deadline = time.monotonic() + 5
    while service.open and time.monotonic() < deadline:
        time.sleep(0.01)
    assert service.open == 0 and service.acceptor.is_alive()
    assert bool(torch.isfinite(flatten(list(ps.model.parameters()))).all())
    assert before <= ps.counts[1] <= before + 8 * len(requests)  # at most a batch a message
    weights = torch.zeros(sum(p.numel() for p in ps.model.parameters()))
    client = transport.Client(
        1,
        weights,
        wire.Layout.of(ps.model, ps.hypers.count),
        service.address,
        timeout_s=5,
        secret=secret,
        hypers=ps.hypers,
    )
    assert client.pull() == ps.version
    client.done(ps.counts[1])
