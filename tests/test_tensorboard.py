"""--tensorboard: event files read back with tensorboard's own reader, the optional flag, the
missing-package error; and the progress display's bytes sent and staleness."""

from __future__ import annotations

import io
import json
import sys
from importlib.util import find_spec
from pathlib import Path
from typing import Any

import pytest

import distsgd
from distsgd import cli
from distsgd.config import from_mapping
from distsgd.metrics import BarProgress, LineProgress
from helpers import cli_here

pytest.importorskip("sklearn")
needs_tensorboard = pytest.mark.skipif(
    find_spec("tensorboard") is None, reason="tensorboard is not installed (pip install 'distsgd[tensorboard]')"
)


def read_scalars(logdir: Path) -> dict[str, list[Any]]:
    """Every scalar in ``logdir``, by tag, read by TensorBoard's own EventAccumulator."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(logdir), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: acc.Scalars(tag) for tag in acc.Tags()["scalars"]}


@pytest.mark.slow
@needs_tensorboard
def test_a_run_writes_scalars_tensorboard_reads_back(tmp_path: Path) -> None:
    out = tmp_path / "run"
    res = cli_here(
        *"train --dataset digits --model mlp --epochs 2 --lr 0.05 --log-every 5 --target-accuracy 0.3 --out".split(),
        str(out),
        "--tensorboard",
    )
    assert res.returncode == 0, res.stderr
    summary = json.loads((out / "summary.json").read_text())
    scalars = read_scalars(out / "tb")  # the flag alone: <out>/tb
    for tag in (
        *"train/loss train/lr train/samples_per_s test/accuracy test/loss summary/final_test_accuracy".split(),
        *"summary/samples_per_s summary/time_to_target_s".split(),
    ):
        assert scalars.get(tag), f"no {tag} in {sorted(scalars)}"
    assert "server/staleness_mean" not in scalars and "comm/bytes_sent" not in scalars  # single: neither
    # against samples: the evaluations' steps and values are summary.json's
    acc = scalars["test/accuracy"]
    assert [e.step for e in acc] == [v["samples"] for v in summary["evals"]] and len(acc) == 5
    assert [e.value for e in acc] == pytest.approx([v["test_accuracy"] for v in summary["evals"]], abs=1e-6)
    # against training time: wall times are apart by what the training clock says
    gap = acc[1].wall_time - acc[0].wall_time
    assert gap == pytest.approx(summary["evals"][1]["train_wall_s"] - summary["evals"][0]["train_wall_s"], abs=1e-3)
    loss = scalars["train/loss"]
    assert [e.step for e in loss] == sorted(e.step for e in loss) and len(loss) == 2 * 23 // 5  # 23 steps an epoch
    assert scalars["train/lr"][0].value == pytest.approx(0.05)
    assert scalars["summary/final_test_accuracy"][0].value == pytest.approx(summary["final_test_accuracy"], abs=1e-6)


@pytest.mark.slow
@needs_tensorboard
def test_a_parameter_server_run_logs_staleness_and_bytes(tmp_path: Path) -> None:
    out = tmp_path / "ps"
    res = cli_here(
        *"train --algo asgd --workers 2 --dataset digits --model mlp --epochs 1 --log-every 3 --out".split(),
        str(out),
        "--tensorboard",
        str(tmp_path / "tb"),
    )
    assert res.returncode == 0, res.stderr
    summary = json.loads((out / "summary.json").read_text())
    assert not (out / "tb").exists()
    scalars = read_scalars(tmp_path / "tb")
    for tag in ("server/staleness_mean", "server/staleness_max", "server/updates", "comm/bytes_sent"):
        assert scalars.get(tag), f"no {tag} in {sorted(scalars)}"
    # the server's last report is the run's end: what summary.json says
    assert scalars["comm/bytes_sent"][-1].value == pytest.approx(summary["bytes_sent"], rel=1e-6)
    assert scalars["comm/bytes_sent"][-1].step == summary["samples"]
    assert scalars["server/updates"][-1].value == summary["server_updates"]
    assert scalars["server/staleness_mean"][-1].value == pytest.approx(summary["staleness"]["mean"], abs=1e-6)
    assert scalars["server/staleness_max"][-1].value == summary["staleness"]["max"]
    events = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    server = [e for e in events if e["event"] == "server"]
    assert len(server) >= 2 and [e["samples"] for e in server] == sorted(e["samples"] for e in server)


@needs_tensorboard
def test_python_api_takes_true_or_a_path(tmp_path: Path) -> None:
    s = distsgd.train(model="logreg", data="digits", epochs=1, quiet=True, tensorboard=str(tmp_path / "tb")).summary
    assert [e.step for e in read_scalars(tmp_path / "tb")["test/accuracy"]] == [e["samples"] for e in s["evals"]]
    distsgd.train(model="logreg", data="digits", epochs=1, quiet=True, out=str(tmp_path / "run"), tensorboard=True)
    assert read_scalars(tmp_path / "run" / "tb")["test/loss"]
    with pytest.raises(distsgd.ConfigError, match="give --out"):
        distsgd.train(model="logreg", data="digits", epochs=1, quiet=True, tensorboard=True)


def test_the_flag_takes_an_optional_directory() -> None:
    parser = cli.build_parser()
    assert parser.parse_args(["train", "--tensorboard", "--epochs", "2"]).tensorboard == "{out}/tb"
    assert parser.parse_args(["train", "--tensorboard", "logs/x"]).tensorboard == "logs/x"
    assert parser.parse_args(["train"]).tensorboard is None
    cfg = cli.config_from_args(parser.parse_args(["train", "--tensorboard", "--out", "runs/a"]))
    assert cfg.tensorboard_dir == Path("runs/a/tb")
    assert from_mapping({"tensorboard": False}).tensorboard is None
    assert from_mapping({"tensorboard": True}).tensorboard == "{out}/tb"


def test_without_the_package_one_error_line_and_nothing_runs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # import fails as if not installed
    monkeypatch.setitem(sys.modules, "tensorboard", None)
    out = tmp_path / "run"
    code = cli.main(["train", "--dataset", "digits", "--model", "mlp", "--out", str(out), "--tensorboard"])
    err = capsys.readouterr().err
    assert code == 2, err
    assert err.strip().splitlines() == [
        "error: --tensorboard needs the tensorboard package: pip install 'distsgd[tensorboard]'"
    ]
    assert not out.exists()  # raised before the run directory, the data or any process


def test_line_progress_shows_bytes_sent_and_staleness() -> None:
    stream = io.StringIO()
    lines = LineProgress(stream, every_s=0.0)
    progress = {
        "event": "progress",
        "samples": 640,
        "epoch": 0.5,
        "rank": 0,
        "loss": 2.0,
        "lr": 0.01,
        "train_wall_s": 1.0,
        "samples_per_s": 640.0,
    }
    lines.emit(progress)
    assert "sent=" not in stream.getvalue() and "staleness" not in stream.getvalue()
    lines.emit(
        {
            "event": "server",
            "samples": 640,
            "train_wall_s": 1.0,
            "server_updates": 10,
            "bytes_sent": 2_500_000,
            "staleness_mean": 0.75,
            "staleness_max": 2,
        }
    )
    lines.emit({**progress, "samples": 1280})
    assert stream.getvalue().splitlines()[-1] == (
        "train samples=1280 epoch=0.50 loss=2.0000 samples/s=640 sent=2.5MB staleness=0.75"
    )
    lines.emit({**progress, "samples": 1920, "bytes_sent": 4_000})  # a group algorithm's own figure
    assert stream.getvalue().splitlines()[-1].endswith("sent=4.0kB staleness=0.75")


def test_bar_progress_shows_bytes_sent_and_staleness() -> None:
    bar = BarProgress(total=2000, desc="test")
    try:
        bar.emit({"event": "progress", "samples": 640, "loss": 1.5, "bytes_sent": 123})
        bar.emit({"event": "server", "samples": 700, "bytes_sent": 2_000_000, "staleness_mean": 1.25})
        bar.emit({"event": "eval", "samples": 700, "test_accuracy": 0.5, "test_loss": 1.0})
        assert bar.postfix() == {"loss": "1.5000", "test_acc": "0.5000", "sent": "2.0MB", "staleness": "1.25"}
        assert bar.bar.n == 700
    finally:
        bar.close()
