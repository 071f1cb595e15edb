"""--logger csv (and tensorboard) and --save-format safetensors (issue 48): what each writes, read
back with the format's own reader (Python's csv module, safetensors' load_file), against what the
run reports in metrics.jsonl and summary.json."""

from __future__ import annotations

import csv
import json
import sys
from importlib.util import find_spec
from pathlib import Path

import pytest
import torch

from distsgd import cli
from helpers import run_cli

pytest.importorskip("sklearn")  # the digits dataset
needs_safetensors = pytest.mark.skipif(find_spec("safetensors") is None, reason="pip install 'distsgd[safetensors]'")

DIGITS = ["--dataset", "digits", "--model", "mlp", "--lr", "0.05"]


def test_the_csv_has_a_row_per_event_of_metrics_jsonl(tmp_path: Path) -> None:
    """A parameter server's run (progress, eval and server events, with their own figures): each
    row of metrics.csv is that event of metrics.jsonl, every figure in its column."""
    out = tmp_path / "run"
    res = run_cli(
        "train", *DIGITS, "--algo", "asgd", "--workers", "2", "--log-every", "3", "--out", str(out), "--logger", "csv"
    )
    assert res.returncode == 0, res.stderr
    events = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    with (out / "metrics.csv").open(newline="") as f:
        reader = csv.DictReader(f)
        rows = list(reader)
        header = reader.fieldnames
    assert header is not None and header[:4] == ["event", "samples", "epoch", "train_wall_s"]
    assert len(rows) == len(events) and {e["event"] for e in events} >= {"progress", "eval", "server"}
    for row, event in zip(rows, events):
        for key, value in event.items():
            cell = row[key]
            if value is None:
                assert cell == ""
            elif isinstance(value, (list, dict)):
                assert json.loads(cell) == value
            elif isinstance(value, bool) or isinstance(value, str):
                assert cell == str(value)
            else:
                assert float(cell) == pytest.approx(value, rel=1e-12), key
        assert all(row[k] == "" for k in header if k not in event)
    summary = json.loads((out / "summary.json").read_text())
    evals = [r for r in rows if r["event"] == "eval"]
    assert float(evals[-1]["test_accuracy"]) == pytest.approx(summary["evals"][-1]["test_accuracy"])


@pytest.mark.skipif(find_spec("tensorboard") is None, reason="pip install 'distsgd[tensorboard]'")
def test_logger_tensorboard_is_the_tensorboard_flag(tmp_path: Path) -> None:
    out = tmp_path / "run"
    res = run_cli("train", *DIGITS, "--max-samples", "400", "--out", str(out), "--logger", "csv,tensorboard")
    assert res.returncode == 0, res.stderr
    assert (out / "metrics.csv").is_file() and any((out / "tb").iterdir())


@pytest.mark.parametrize(
    "args, line",
    [
        (["--logger", "csv,wandb"], "error: unknown --logger 'wandb' (choose from csv, tensorboard, comma-separated)"),
        (
            ["--save-format", "onnx"],
            "error: unknown --save-format 'onnx' (choose from pt, safetensors, comma-separated)",
        ),
    ],
)
def test_impossible_logger_and_format_settings_are_one_line(
    args: list[str], line: str, capsys: pytest.CaptureFixture
) -> None:
    code = cli.main(["train", *DIGITS, *args])
    assert code == 2
    assert capsys.readouterr().err.strip().splitlines() == [line]


def test_csv_without_a_run_directory_is_one_line() -> None:
    import distsgd

    with pytest.raises(distsgd.ConfigError) as info:
        distsgd.train(model="mlp", data="digits", logger="csv", quiet=True)
    assert str(info.value) == "--logger csv writes <out>/metrics.csv: give a run directory (--out; out= in Python)"


@needs_safetensors
def test_model_safetensors_holds_the_model_pt_weights_and_eval_reads_it(tmp_path: Path) -> None:
    from safetensors import safe_open
    from safetensors.torch import load_file

    out = tmp_path / "run"
    res = run_cli("train", *DIGITS, "--max-samples", "2000", "--out", str(out), "--save-format", "pt,safetensors")
    assert res.returncode == 0, res.stderr
    pt = torch.load(out / "model.pt", weights_only=True)
    tensors = load_file(out / "model.safetensors")  # safetensors' own reader
    assert set(tensors) == set(pt["state_dict"]) and all(
        torch.equal(tensors[k], v) for k, v in pt["state_dict"].items()
    )
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        described = json.loads(f.metadata()["distsgd"])
    assert described["model"] == "mlp" and described["dataset"] == pt["dataset"]
    summary = json.loads((out / "summary.json").read_text())
    res = run_cli("eval", "--checkpoint", str(out / "model.safetensors"), "--json")
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout)["test_accuracy"] == pytest.approx(summary["final_test_accuracy"], abs=1e-9)


@needs_safetensors
def test_a_run_saved_as_safetensors_alone_is_evaluated_from_its_directory(tmp_path: Path) -> None:
    out = tmp_path / "run"
    res = run_cli("train", *DIGITS, "--max-samples", "1000", "--out", str(out), "--save-format", "safetensors")
    assert res.returncode == 0, res.stderr
    assert (out / "model.safetensors").is_file() and not (out / "model.pt").exists()
    summary = json.loads((out / "summary.json").read_text())
    res = run_cli("eval", "--checkpoint", str(out), "--json")
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout)["test_accuracy"] == pytest.approx(summary["final_test_accuracy"], abs=1e-9)
    (out / "model.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{}garbage")
    res = run_cli("eval", "--checkpoint", str(out))
    assert res.returncode == 2 and res.stderr.strip().count("\n") == 0, res.stderr
    assert res.stderr.startswith("error: ") and "Traceback" not in res.stderr


def test_without_safetensors_one_error_line_and_nothing_runs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    monkeypatch.setitem(sys.modules, "safetensors", None)  # import fails as if not installed
    monkeypatch.setitem(sys.modules, "safetensors.torch", None)
    out = tmp_path / "run"
    code = cli.main(["train", *DIGITS, "--out", str(out), "--save-format", "safetensors"])
    assert code == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        "error: --save-format safetensors needs the safetensors package: pip install 'distsgd[safetensors]'"
    ]
    assert not out.exists()
