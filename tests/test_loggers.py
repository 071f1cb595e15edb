"""--logger csv (and tensorboard) and --save-format safetensors (issue 48): what each writes, read
back with the format's own reader (Python's csv module, safetensors' load_file), against what the
run reports in metrics.jsonl and summary.json."""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
from importlib.util import find_spec
from pathlib import Path

import pytest
import torch

from distsgd import cli
from helpers import cli_here, run_cli

pytest.importorskip("sklearn")  # the digits dataset
needs_safetensors = pytest.mark.skipif(find_spec("safetensors") is None, reason="pip install 'distsgd[safetensors]'")
needs_wandb_mlflow = pytest.mark.skipif(
    find_spec("wandb") is None or find_spec("mlflow") is None, reason="pip install 'distsgd[wandb,mlflow]'"
)


@pytest.fixture
def default_stores(monkeypatch: pytest.MonkeyPatch) -> None:
    """The loggers' defaults: W&B offline, MLflow's store in the run directory, whatever is set here."""
    for name in ("WANDB_MODE", "WANDB_PROJECT", "MLFLOW_TRACKING_URI", "MLFLOW_EXPERIMENT_NAME"):
        monkeypatch.delenv(name, raising=False)


DIGITS = ["--dataset", "digits", "--model", "mlp", "--lr", "0.05"]


def test_the_csv_has_a_row_per_event_of_metrics_jsonl(tmp_path: Path) -> None:
    """A parameter server's run (progress, eval and server events, with their own figures): each
    row of metrics.csv is that event of metrics.jsonl, every figure in its column."""
    out = tmp_path / "run"
    res = cli_here(
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


def test_the_epoch_column_is_the_epochs_trained_in_every_row(tmp_path: Path) -> None:
    """A checkpoint's row of metrics.csv (its event in metrics.jsonl) says the epochs trained, as
    the evaluation at the same samples does. Until 2026-12-01 it said the index of the epoch a
    resume goes on in (an audit's: ('eval', 8064, 0.1344), ('checkpoint', 8064, 0)), one column
    of two meanings."""
    out = tmp_path / "run"
    every = ["--checkpoint-every", "600", "--eval-every", "600", "--max-samples", "2400"]
    res = cli_here(
        "train", *DIGITS, "--algo", "allreduce", "--workers", "2", *every, "--out", str(out), "--logger", "csv"
    )
    assert res.returncode == 0, res.stderr
    with (out / "metrics.csv").open(newline="") as f:
        rows = list(csv.DictReader(f))
    evals = {r["samples"]: float(r["epoch"]) for r in rows if r["event"] == "eval"}
    checkpoints = [(r["samples"], float(r["epoch"])) for r in rows if r["event"] == "checkpoint"]
    assert len(checkpoints) >= 3 and all(samples in evals for samples, _ in checkpoints), (checkpoints, evals)
    assert all(epoch == evals[samples] for samples, epoch in checkpoints), (checkpoints, evals)
    assert checkpoints[-1][1] > 1.0, checkpoints  # (past the first epoch: an index said 1 there, a fraction more)


@pytest.mark.slow
@pytest.mark.skipif(find_spec("tensorboard") is None, reason="pip install 'distsgd[tensorboard]'")
def test_logger_tensorboard_is_the_tensorboard_flag(tmp_path: Path) -> None:
    out = tmp_path / "run"
    res = cli_here("train", *DIGITS, "--max-samples", "400", "--out", str(out), "--logger", "csv,tensorboard")
    assert res.returncode == 0, res.stderr
    assert (out / "metrics.csv").is_file() and any((out / "tb").iterdir())


@pytest.mark.parametrize(
    "args, line",
    [
        (
            ["--logger", "csv,comet"],
            "error: unknown --logger 'comet' (choose from csv, tensorboard, wandb, mlflow, comma-separated)",
        ),
        (
            ["--save-format", "onnx"],
            "error: unknown --save-format 'onnx' (choose from pt, safetensors, hf, comma-separated)",
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


@pytest.mark.slow
@needs_safetensors
def test_model_safetensors_holds_the_model_pt_weights_and_eval_reads_it(tmp_path: Path) -> None:
    from safetensors import safe_open
    from safetensors.torch import load_file

    out = tmp_path / "run"
    res = cli_here("train", *DIGITS, "--max-samples", "2000", "--out", str(out), "--save-format", "pt,safetensors")
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
    res = cli_here("eval", "--checkpoint", str(out / "model.safetensors"), "--json")
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout)["test_accuracy"] == pytest.approx(summary["final_test_accuracy"], abs=1e-9)


@pytest.mark.slow
@needs_safetensors
def test_a_run_saved_as_safetensors_alone_is_evaluated_from_its_directory(tmp_path: Path) -> None:
    out = tmp_path / "run"
    res = cli_here("train", *DIGITS, "--max-samples", "1000", "--out", str(out), "--save-format", "safetensors")
    assert res.returncode == 0, res.stderr
    assert (out / "model.safetensors").is_file() and not (out / "model.pt").exists()
    summary = json.loads((out / "summary.json").read_text())
    res = cli_here("eval", "--checkpoint", str(out), "--json")
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout)["test_accuracy"] == pytest.approx(summary["final_test_accuracy"], abs=1e-9)
    (out / "model.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{}garbage")
    res = run_cli("eval", "--checkpoint", str(out))
    assert res.returncode == 2 and res.stderr.strip().count("\n") == 0, res.stderr
    assert res.stderr.startswith("error: ") and "Traceback" not in res.stderr


@pytest.mark.slow
@needs_safetensors
def test_a_run_resumed_in_place_with_another_save_format_leaves_no_older_model(tmp_path: Path) -> None:
    """Saved as model.pt, resumed in place with --save-format safetensors: the first part's
    model.pt goes (distsgd wrote it), so ``distsgd eval DIR`` reads the run's model, and a file of
    the user's stays. On 98b67c4 model.pt stayed, and eval of the directory measured it: 0.722
    against the summary's 0.928 in the audit's run."""
    out = tmp_path / "run"
    res = cli_here("train", *DIGITS, "--epochs", "1", "--checkpoint-every", "epoch", "--out", str(out), "--quiet")
    assert res.returncode == 0, res.stderr
    (out / "model.pt.mine").write_bytes(b"the user's")
    res = cli_here("train", "--resume", str(out), "--epochs", "3", "--save-format", "safetensors", "--quiet")
    assert res.returncode == 0, res.stderr
    assert not (out / "model.pt").exists() and (out / "model.pt.mine").read_bytes() == b"the user's"
    summary = json.loads((out / "summary.json").read_text())
    res = cli_here("eval", "--checkpoint", str(out), "--json")
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout)["test_accuracy"] == pytest.approx(summary["final_test_accuracy"], abs=1e-9)


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


def wandb_records(path: Path) -> list:
    """The records of a W&B run file (``run-<id>.wandb``), parsed as W&B's own protobuf Record:
    the file is a header (``:W&B``, magic, version: 7 bytes) then LevelDB's log framing (32 KiB
    blocks of chunks, each a 7-byte header: crc32, length, kind; full=1, first=2, middle=3, last=4)."""
    import struct

    from wandb.proto import wandb_internal_pb2 as pb

    data = path.read_bytes()
    assert data[:4] == b":W&B"
    pos, block, pending, out = 7, 32768, b"", []
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:  # a block's tail too short for a header is padding
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        pending += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            record = pb.Record()
            record.ParseFromString(pending)
            out.append(record)
            pending = b""
    return out


def _items(items) -> dict[str, object]:
    return {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in items}


@pytest.mark.slow
@needs_wandb_mlflow
def test_wandb_offline_and_mlflow_record_the_run_as_summary_json_says(tmp_path: Path, default_stores) -> None:
    """A parameter server's run logged to W&B (offline: no network) and MLflow (SQLite in the run
    directory), read back with W&B's own record format and MLflow's client: the run's settings,
    each evaluation at its samples, the summary's figures; then --overwrite replaces the run."""
    from mlflow.tracking import MlflowClient

    out = tmp_path / "run"
    args = ["train", *DIGITS, "--algo", "asgd", "--workers", "2", "--out", str(out), "--logger", "wandb,mlflow"]
    res = run_cli(*args)
    assert res.returncode == 0, res.stderr
    summary = json.loads((out / "summary.json").read_text())
    evals = [(e["samples"], e["test_accuracy"]) for e in summary["evals"]]

    (run_file,) = (out / "wandb").glob("offline-run-*/run-*.wandb")
    records = wandb_records(run_file)
    kinds = [r.WhichOneof("record_type") for r in records]
    config = _items(next(r for r in records if r.WhichOneof("record_type") == "run").run.config.update)
    assert config["algo"] == "asgd" and config["workers"] == 2 and config["dataset"] == "digits"
    history = [_items(r.history.item) for r, k in zip(records, kinds) if k == "history"]
    logged = [(h["samples"], h["test/accuracy"]) for h in history if "test/accuracy" in h]
    assert logged == [(s, pytest.approx(a)) for s, a in evals]
    assert any("server/staleness_mean" in h for h in history)
    final: dict[str, object] = {}
    for r, k in zip(records, kinds):
        if k == "summary":
            final.update(_items(r.summary.update))
    assert final["summary/final_test_accuracy"] == pytest.approx(summary["final_test_accuracy"])
    assert "exit" in kinds

    client = MlflowClient(tracking_uri=f"sqlite:///{out / 'mlflow.db'}")
    (found,) = client.search_runs([client.get_experiment_by_name("distsgd").experiment_id])
    assert found.info.status == "FINISHED" and found.info.run_name == "run"
    assert found.data.params["algo"] == "asgd" and found.data.params["workers"] == "2"
    history = client.get_metric_history(found.info.run_id, "test/accuracy")
    assert [(m.step, m.value) for m in sorted(history, key=lambda m: m.step)] == [
        (s, pytest.approx(a)) for s, a in evals
    ]
    assert found.data.metrics["summary/final_test_accuracy"] == pytest.approx(summary["final_test_accuracy"])

    res = run_cli(*args, "--overwrite")
    assert res.returncode == 0, res.stderr  # every file the loggers wrote was recorded, so replaced
    assert len(list((out / "wandb").glob("offline-run-*/run-*.wandb"))) == 1


def test_without_wandb_one_error_line_and_nothing_runs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    monkeypatch.setitem(sys.modules, "wandb", None)
    out = tmp_path / "run"
    code = cli.main(["train", *DIGITS, "--out", str(out), "--logger", "csv,wandb"])
    assert code == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        "error: --logger wandb needs the wandb package: pip install 'distsgd[wandb]'"
    ]
    assert not out.exists()


@pytest.mark.skipif(find_spec("wandb") is None, reason="pip install 'distsgd[wandb]'")
def test_a_logger_that_cannot_start_is_one_error_line(tmp_path: Path) -> None:
    res = run_cli("train", *DIGITS, "--out", str(tmp_path / "run"), "--logger", "wandb", env={"WANDB_MODE": "sideways"})
    assert res.returncode == 2 and res.stderr.count("\n") == 1, res.stderr
    assert res.stderr.startswith("error: --logger wandb could not start its run: ") and "sideways" in res.stderr


@pytest.mark.slow
@needs_wandb_mlflow
def test_a_logger_that_cannot_start_after_another_did_leaves_a_directory_a_rerun_replaces(tmp_path: Path) -> None:
    """W&B starts, then MLflow cannot (a store it refuses): one line, and W&B's run ends as a
    failed one with its files in the run directory's ledger, so the rerun with --overwrite
    replaces the directory. On 98b67c4 W&B's files were not in the ledger: --overwrite refused
    ("also holds wandb/debug-internal.log ... which distsgd did not write")."""
    out = tmp_path / "run"
    bad = {"MLFLOW_TRACKING_URI": "sideways://nowhere", "WANDB_MODE": "offline"}
    res = run_cli("train", *DIGITS, "--epochs", "1", "--out", str(out), "--logger", "wandb,mlflow", env=bad)
    assert res.returncode == 2 and res.stderr.startswith("error: --logger mlflow could not start its run"), res.stderr
    res = cli_here("train", *DIGITS, "--epochs", "1", "--out", str(out), "--overwrite", "--quiet")  # no logger
    assert res.returncode == 0, res.stderr[-3000:]


@pytest.mark.slow
@needs_wandb_mlflow
@pytest.mark.skipif(find_spec("tensorboard") is None, reason="pip install 'distsgd[tensorboard]'")
def test_a_logger_that_cannot_end_its_run_leaves_the_others_closed_and_the_model_saved(
    tmp_path: Path, default_stores, monkeypatch: pytest.MonkeyPatch
) -> None:
    """MLflow's tracking server gone when the run ends (its set_terminated raises, as MLflow's REST
    client does once its retries are spent): one error line, exit 2, and the sinks after it still
    closed (TensorBoard's last events, summary/, are in its file) and the model saved. Before
    (cb98bd8) the exception went up through the command as a traceback, skipping the other
    sinks' close and the model's save."""
    from mlflow.exceptions import MlflowException

    from distsgd import metrics
    from test_tensorboard import read_scalars

    def gone(self) -> None:
        raise MlflowException("API request to endpoint /api/2.0/mlflow/runs/update failed:\nConnection refused")

    monkeypatch.setattr(metrics.MlflowWriter, "close", gone)
    out = tmp_path / "run"
    res = cli_here("train", *DIGITS, "--max-samples", "600", "--out", str(out), "--logger", "mlflow", "--tensorboard")
    assert res.returncode == 2 and res.stderr.count("error:") == 1 and "Traceback" not in res.stderr, res.stderr
    last = res.stderr.splitlines()[-1]  # after MLflow's own INFO lines and the progress
    assert last.startswith("error: --logger mlflow could not end its run: API request to endpoint"), res.stderr
    summary = json.loads((out / "summary.json").read_text())
    assert torch.load(out / "model.pt", weights_only=True)  # saved
    scalars = read_scalars(out / "tb")
    assert scalars["summary/final_test_accuracy"][0].value == pytest.approx(summary["final_test_accuracy"], abs=1e-6)


def test_a_csv_reopened_keeps_its_rows(tmp_path: Path) -> None:
    """A run resumed in place reopens metrics.csv: the first attempt's rows stay, as metrics.jsonl's do."""
    from distsgd.metrics import CsvWriter

    path = tmp_path / "metrics.csv"
    first = CsvWriter(path)
    first.emit({"event": "eval", "samples": 10, "test_accuracy": 0.5})
    first.close()
    again = CsvWriter(path)
    again.emit({"event": "progress", "samples": 20, "loss": 1.5})
    again.close()
    with path.open(newline="") as f:
        rows = list(csv.DictReader(f))
    assert [(r["event"], r["samples"], r["test_accuracy"], r["loss"]) for r in rows] == [
        ("eval", "10", "0.5", ""),
        ("progress", "20", "", "1.5"),
    ]


@pytest.mark.slow
@needs_wandb_mlflow
def test_a_run_resumed_in_place_goes_on_in_its_wandb_and_mlflow_runs(tmp_path: Path, default_stores) -> None:
    """--resume into the run's own directory: one W&B run (a second offline folder of the same id,
    its config's epochs updated, its history past the first part's) and one MLflow run (FINISHED
    again, every evaluation of summary.json in its history, the changed setting a tag, as
    MLflow's params cannot change); before, each resume started a run of its own."""
    from mlflow.tracking import MlflowClient

    out = tmp_path / "run"
    args = ["train", *DIGITS, "--algo", "allreduce", "--workers", "2", "--out", str(out), "--logger", "wandb,mlflow"]
    res = run_cli(*args, "--epochs", "1", "--checkpoint-every", "epoch")
    assert res.returncode == 0, res.stderr
    first = json.loads((out / "summary.json").read_text())["samples"]
    res = run_cli(*args, "--epochs", "2", "--resume", str(out))
    assert res.returncode == 0, res.stderr
    summary = json.loads((out / "summary.json").read_text())

    folders = sorted((out / "wandb").glob("offline-run-*"))
    assert len(folders) == 2
    runs = [wandb_records(next(f.glob("run-*.wandb"))) for f in folders]
    starts = [next(r for r in records if r.WhichOneof("record_type") == "run").run for records in runs]
    assert starts[0].run_id == starts[1].run_id
    updates = [_items(r.config.update) for r in runs[1] if r.WhichOneof("record_type") == "config"]
    assert any(u.get("epochs") == 2 for u in updates), updates
    later = [_items(r.history.item)["samples"] for r in runs[1] if r.WhichOneof("record_type") == "history"]
    assert later and min(later) > first and max(later) == summary["samples"]

    client = MlflowClient(tracking_uri=f"sqlite:///{out / 'mlflow.db'}")
    (found,) = client.search_runs([client.get_experiment_by_name("distsgd").experiment_id])
    assert found.info.status == "FINISHED"
    assert found.data.params["epochs"] == "1" and found.data.tags["distsgd.resumed.epochs"] == "2"
    steps = {m.step for m in client.get_metric_history(found.info.run_id, "test/accuracy")}
    assert {e["samples"] for e in summary["evals"]} <= steps and max(steps) == summary["samples"]


def two_classes() -> torch.nn.Module:
    return torch.nn.Linear(12, 2)


def logging_loop(run) -> torch.nn.Module:
    """A user's loop that logs a figure of its own each step and an evaluation with one more."""
    import torch.nn.functional as F
    from torch.utils.data import TensorDataset

    g = torch.Generator().manual_seed(0)
    x = torch.randn(128, 12, generator=g)
    data = TensorDataset(x, (x[:, 0] > 0).long())
    model, opt = run.setup()
    for xb, yb in run.loader(data, batch_size=16):
        opt.zero_grad()
        F.cross_entropy(model(xb), yb).backward()
        run.log(grad_norm=float(torch.nn.utils.clip_grad_norm_(model.parameters(), 100.0)))
        opt.step()
    final = run.final_model()
    with torch.no_grad():
        accuracy = float((final(x).argmax(1) == data.tensors[1]).float().mean())
    run.log(test_accuracy=accuracy, test_f1=accuracy / 2)
    return final


@pytest.mark.slow
@needs_wandb_mlflow
def test_the_figures_a_users_loop_logs_reach_every_logger(tmp_path: Path, default_stores) -> None:
    """``run.log(grad_norm=...)`` each step and an evaluation's own ``test_f1``: in W&B (offline),
    MLflow and TensorBoard under ``log/grad_norm`` and ``test/f1``, at their samples, as in
    metrics.jsonl. On 98b67c4 they reached metrics.jsonl and metrics.csv alone (the loggers took a
    fixed table of distsgd's own figures), where docs/RUNS.md promised W&B every figure."""
    from mlflow.tracking import MlflowClient

    from test_tensorboard import read_scalars

    out = tmp_path / "run"
    script = tmp_path / "loop.py"  # in a process of its own: W&B's service process ends with it
    script.write_text(
        "import sys\nimport distsgd\nfrom test_loggers import logging_loop, two_classes\n\n"
        "if __name__ == '__main__':\n"
        "    distsgd.spawn(logging_loop, model=two_classes, algo='allreduce', workers=2, out=sys.argv[1],\n"
        "                  logger='wandb,mlflow,tensorboard', quiet=True)\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [os.environ.get("PYTHONPATH"), "src", "tests"]))}
    done = subprocess.run([sys.executable, str(script), str(out)], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    events = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    norms = [(e["samples"], e["grad_norm"]) for e in events if e["event"] == "log"]
    (f1,) = [(e["samples"], e["test_f1"]) for e in events if e["event"] == "eval"]
    assert len(norms) == 4, norms  # rank 0's, a step each

    (run_file,) = (out / "wandb").glob("offline-run-*/run-*.wandb")
    history = [_items(r.history.item) for r in wandb_records(run_file) if r.WhichOneof("record_type") == "history"]
    assert [(h["samples"], h["log/grad_norm"]) for h in history if "log/grad_norm" in h] == norms
    assert [(h["samples"], h["test/f1"]) for h in history if "test/f1" in h] == [f1]

    client = MlflowClient(tracking_uri=f"sqlite:///{out / 'mlflow.db'}")
    (found,) = client.search_runs([client.get_experiment_by_name("distsgd").experiment_id])
    logged = sorted((m.step, m.value) for m in client.get_metric_history(found.info.run_id, "log/grad_norm"))
    assert logged == [(s, pytest.approx(v)) for s, v in norms]
    assert [(m.step, m.value) for m in client.get_metric_history(found.info.run_id, "test/f1")] == [
        (f1[0], pytest.approx(f1[1]))
    ]

    scalars = read_scalars(out / "tb")
    assert [(s.step, s.value) for s in scalars["log/grad_norm"]] == [(s, pytest.approx(v)) for s, v in norms]
    assert [(s.step, s.value) for s in scalars["test/f1"]] == [(f1[0], pytest.approx(f1[1]))]


def test_a_signal_while_an_event_goes_to_the_sinks_stops_the_run_once_every_sink_has_it() -> None:
    """SIGTERM landing in one sink's write (the launcher hands each event to metrics.jsonl, the
    loggers, the progress display in turn): the Terminated comes once the event is in every sink.
    On 98b67c4 it came out of the write it landed in: the sinks after it missed the event (4 runs
    of 5 in the audit), and once MLflow's SQLite transaction, cut, stayed locked."""
    import os
    import signal

    from distsgd.errors import Terminated, on_sigterm
    from distsgd.metrics import Fanout

    class Signalling:
        def emit(self, event: dict) -> None:
            os.kill(os.getpid(), signal.SIGTERM)  # delivered here, between two bytecodes of this write
            self.seen = event

    class Recording:
        def __init__(self) -> None:
            self.events: list[dict] = []

        def emit(self, event: dict) -> None:
            self.events.append(event)

    first, last = Signalling(), Recording()
    restore = on_sigterm()
    try:
        with pytest.raises(Terminated):
            Fanout(first, last).emit({"event": "progress", "samples": 64})
    finally:
        restore()
    assert first.seen and last.events == [{"event": "progress", "samples": 64}]
