"""Fuzzed bad input (Hypothesis): TOML settings, npz arrays and IDX files. Whatever is generated,
the command ends with exit status 2 and one ``error:`` line, or trains; never a traceback, and a
failed run leaves no run directory behind."""

from __future__ import annotations

import io
import struct
import tomllib
import uuid
from contextlib import redirect_stderr
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from distsgd import cli, config
from distsgd.config import RunConfig
from distsgd.errors import DistsgdError

from helpers import write_idx

FIELDS = [f for f in RunConfig.__dataclass_fields__]
FUZZ = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])

scalars = st.one_of(st.none(), st.booleans(), st.integers(-10 ** 12, 10 ** 12), st.floats(allow_nan=True),
                    st.text(max_size=12), st.lists(st.integers(), max_size=3))


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


arrays = hnp.arrays(dtype=st.sampled_from([np.float32, np.float64, np.int64, np.uint8, np.bool_, np.int8]),
                    shape=hnp.array_shapes(min_dims=0, max_dims=4, min_side=0, max_side=4))  # NaN and inf too


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
    (tmp / names[which]).write_bytes(header + (tmp / names[which]).read_bytes()[len(header):])
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
    path.write_bytes(struct.pack(">HBB", 0, 0x08, 1) + struct.pack(">I", 10 ** 9) + b"\x00" * 4)
    with pytest.raises(DataError, match="truncated"):
        read_idx(path)
