"""Checkpoints and exact resume; a torchrun restart after a SIGKILL resumes by itself."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import distsgd
from distsgd import checkpoint
from distsgd.errors import CheckpointError, WorkerError
from helpers import cli_here, run_cli, torchrun

pytest.importorskip("sklearn")

DROPOUT_MODEL = '''
import os, signal
import torch.nn as nn

class Net(nn.Module):
    """A small MLP with dropout, so resuming must restore the random state too. Under torchrun,
    worker KILL_RANK is SIGKILLed at its KILL_STEP-th step: KILL_STEP a step for each attempt
    (TORCHELASTIC_RESTART_COUNT) from the first, comma-separated ("15": the first attempt only),
    marked by the file KILL_MARKER.ATTEMPT where KILL_MARKER is set."""
    def __init__(self, num_classes, input_shape):
        super().__init__()
        self.net = nn.Sequential(nn.Flatten(), nn.Linear(64, 64), nn.ReLU(), nn.Dropout(0.3), nn.Linear(64, num_classes))
        self.calls = 0

    def forward(self, x):
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT")
        steps = os.environ.get("KILL_STEP", "").split(",")
        if self.training and attempt is not None and int(attempt) < len(steps):
            self.calls += 1
            if os.environ.get("RANK") == os.environ.get("KILL_RANK") and self.calls == int(steps[int(attempt)]):
                if os.environ.get("KILL_MARKER"):
                    open(os.environ["KILL_MARKER"] + "." + attempt, "w").close()
                os.kill(os.getpid(), signal.SIGKILL)
        return self.net(x)
'''


@pytest.fixture
def dropout_model(tmp_path: Path) -> str:
    path = tmp_path / "dropnet.py"
    path.write_text(DROPOUT_MODEL)
    return f"{path}:Net"


def _params(model: torch.nn.Module) -> list[torch.Tensor]:
    return [p.detach() for p in model.parameters()]


@pytest.mark.parametrize(
    "algo, workers, every, extra",
    [
        ("single", 1, "300", {}),
        ("allreduce", 2, "epoch", {}),
        ("local-sgd", 2, "500", {}),
        ("ddp", 2, "epoch", {}),
        ("diloco", 2, "500", {"lr": 0.002}),
        ("allreduce", 2, "500", {"compress": "powersgd:2"}),
        ("local-sgd", 2, "500", {"compress": "powersgd"}),
        ("ddp", 2, "epoch", {"compress": "fp16"}),
    ],
)
@pytest.mark.slow
def test_resumed_run_ends_exactly_like_an_uninterrupted_one(
    tmp_path, dropout_model, algo, workers, every, extra
) -> None:
    # --eval-every: by default a run's evaluations spread over its own budget, which the first part's is not
    common = dict(
        model=dropout_model,
        data="digits",
        algo=algo,
        workers=workers,
        lr=0.05,
        checkpoint_every=every,
        eval_every=500,
        quiet=True,
        **({"sync_every": "4"} if algo in ("local-sgd", "diloco") else {}),
    )
    common.update(extra)
    full = distsgd.train(max_samples=2872, out=str(tmp_path / "full"), **common)
    distsgd.train(max_samples=1436, out=str(tmp_path / "part"), **common)
    resumed = distsgd.train(resume=str(tmp_path / "part"), max_samples=2872)
    assert resumed.summary["samples"] == full.summary["samples"]
    assert resumed.summary["final_test_loss"] == full.summary["final_test_loss"]
    assert all(torch.equal(a, b) for a, b in zip(_params(full.model), _params(resumed.model)))
    # Evaluations made before the checkpoint come back, and the first part's final one where its last
    # checkpoint is where it ended (an epoch's end, 1436): made after that checkpoint, which could not
    # hold it, it is of the model the resumed part starts from, and in the directory's metrics.jsonl
    # (until 2026-11-29 it was left out, and with it a target it reached: the summary and
    # metrics.jsonl disagreed)
    ended = {1436} if every == "epoch" else set()
    kept = {e["samples"] for e in resumed.summary["evals"]}
    assert ended <= kept <= {e["samples"] for e in full.summary["evals"]} | ended
    assert resumed.summary["evals"][-1] == full.summary["evals"][-1] | {
        "train_wall_s": resumed.summary["evals"][-1]["train_wall_s"]
    }
    saved = json.loads((tmp_path / "part" / "summary.json").read_text())
    assert saved["samples"] == full.summary["samples"]  # written back into the resumed directory


@pytest.mark.slow
def test_sync_ps_stops_when_a_worker_dies_and_resumes_exactly(tmp_path, dropout_model, monkeypatch) -> None:
    common = dict(
        model=dropout_model, data="digits", algo="sync-ps", workers=2, lr=0.05, checkpoint_every="500", quiet=True
    )
    full = distsgd.train(max_samples=2872, out=str(tmp_path / "full"), **common)
    # Worker 1 (RANK 1) is SIGKILLed at its 15th step, after the third checkpoint (about 1500 samples).
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    monkeypatch.setenv("KILL_RANK", "1")
    monkeypatch.setenv("KILL_STEP", "15")
    out = str(tmp_path / "killed")
    with pytest.raises(WorkerError, match=rf"worker 1 failed: killed by SIGKILL; .* --resume {out}$"):
        distsgd.train(max_samples=2872, out=out, **common)
    assert checkpoint.read_manifest(Path(out))["samples"] >= 1500
    monkeypatch.delenv("KILL_RANK")
    resumed = distsgd.train(resume=out)
    assert resumed.summary["samples"] == full.summary["samples"] == 2872
    assert resumed.summary["final_test_loss"] == full.summary["final_test_loss"]
    assert all(torch.equal(a, b) for a, b in zip(_params(full.model), _params(resumed.model)))
    assert resumed.summary["server_updates"] == full.summary["server_updates"]


@pytest.mark.slow
def test_resume_elsewhere_and_continue_training_in_epochs(tmp_path) -> None:
    distsgd.train(model="mlp", data="digits", epochs=1, checkpoint_every="epoch", out=str(tmp_path / "a"), quiet=True)
    s = distsgd.train(resume=str(tmp_path / "a"), epochs=3, out=str(tmp_path / "b")).summary
    assert s["samples"] == 3 * 1437 and s["evals"][-1]["samples"] == 3 * 1437
    assert len([e for e in s["evals"] if e["samples"] > 1437]) >= 3  # the 3 epochs' evaluations go on
    assert (tmp_path / "b" / "model.pt").exists() and (tmp_path / "b" / "summary.json").exists()
    assert json.loads((tmp_path / "a" / "summary.json").read_text())["samples"] == 1437  # untouched


def test_previous_checkpoint_stays_until_the_new_one_is_whole(tmp_path) -> None:
    ckpt = tmp_path / "checkpoint"
    for rank in range(2):
        checkpoint.save_worker_state(ckpt, 1, rank, {"x": torch.ones(2) * rank})
    checkpoint.commit_checkpoint(ckpt, 1, 2, {})
    checkpoint.save_worker_state(ckpt, 2, 0, {"x": torch.zeros(2)})  # worker 1 dies before writing seq 2
    with pytest.raises(CheckpointError, match=r"missing the files of workers \[1\]"):
        checkpoint.commit_checkpoint(ckpt, 2, 2, {})
    assert checkpoint.read_manifest(tmp_path)["seq"] == 1
    assert torch.equal(checkpoint.load_worker_state(tmp_path, 1)["x"], torch.ones(2))
    assert not list(tmp_path.glob("checkpoint/*.tmp"))


def test_a_saved_piece_without_a_key_it_reads_is_one_checkpoint_error() -> None:
    """A checkpoint whose pieces lack what this version reads (an older version's layout: a period
    that kept "pending" but not its "next" point) is one CheckpointError naming what is missing, not a KeyError."""
    from distsgd.schedule import Periodic

    with pytest.raises(CheckpointError, match=r"no 'next' in its 'period' part: it was written by an older"):
        checkpoint.scatter({"period": Periodic(4)}, {"period": {"pending": True}})
    with pytest.raises(CheckpointError, match=r"no 'period' part: it was written by an older distsgd"):
        checkpoint.scatter({"period": Periodic(4)}, {})


@pytest.mark.slow
def test_resuming_a_checkpoint_of_an_older_layout_is_one_error_line(tmp_path) -> None:
    """local-sgd's checkpoints of an older version kept "dirty" where they now keep "period"; this
    version does not read that layout: the resume stops with one error line and exit 2, and leaves
    the checkpoint's files as they were. (Before, a fallback read "dirty".)"""
    run = tmp_path / "old"
    distsgd.train(
        data="digits",
        model="mlp",
        algo="local-sgd",
        workers=2,
        max_samples=256,
        checkpoint_every="128",
        out=str(run),
        quiet=True,
    )
    files = sorted((run / checkpoint.CHECKPOINT_DIR).glob("ckpt-*-rank*.pt"))
    for path in files:
        state = torch.load(path, weights_only=True)
        state["algo"]["dirty"] = state["algo"].pop("period")["pending"]
        state.pop("format")  # an older version's file carries no format (or an older one)
        torch.save(state, path)
    before = {path: path.read_bytes() for path in files}
    r = run_cli("train", "--resume", str(run), "--max-samples", "512", "--quiet", timeout=180)
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert r.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: "), r.stderr[-3000:]
    assert "the checkpoint has no 'period' in its 'algo' part: it was written by an older distsgd" in lines[0]
    assert {path: path.read_bytes() for path in files} == before


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (
            {"algo": "hogwild", "workers": 2, "checkpoint_every": "epoch", "restart_workers": -1},
            "--restart-workers must be >= 0",
        ),
        ({"checkpoint_every": "often"}, "--checkpoint-every must be"),
    ],
)
def test_bad_checkpoint_settings(tmp_path, kwargs, message) -> None:
    with pytest.raises(distsgd.ConfigError, match=message):
        distsgd.train(model="mlp", data="digits", out=str(tmp_path / "r"), quiet=True, **kwargs)


@pytest.mark.slow
def test_bad_resume(tmp_path) -> None:
    with pytest.raises(distsgd.ConfigError, match="not a distsgd run directory"):
        distsgd.train(resume=str(tmp_path / "nothing"))
    distsgd.train(model="mlp", data="digits", epochs=1, out=str(tmp_path / "plain"), quiet=True)
    with pytest.raises(CheckpointError, match="no checkpoint in"):
        distsgd.train(resume=str(tmp_path / "plain"), epochs=2)
    distsgd.train(
        model="mlp",
        data="digits",
        algo="allreduce",
        workers=2,
        epochs=1,
        checkpoint_every="epoch",
        out=str(tmp_path / "two"),
        quiet=True,
    )
    with pytest.raises(distsgd.ConfigError, match="has 2 workers; resume it with --workers 2"):
        distsgd.train(resume=str(tmp_path / "two"), workers=1, algo="single", epochs=2)


@pytest.fixture(scope="module")
def restarted_twice(tmp_path_factory) -> tuple[subprocess.CompletedProcess, Path, dict]:
    """allreduce under torchrun --max-restarts 2 with an --out of the user's (checkpoints every 400
    samples, a model with dropout): rank 1 SIGKILLed at its 3rd step of the first attempt, before
    any checkpoint, and at its 15th of the second (23 steps each; checkpoints every ~3), after
    some. One torchrun for the two tests below (each restart is a group's processes started
    again: 3 s of CPU each); what it said, its --out, and the summary of an unkilled run (distsgd's
    own launcher's, in this process: the same group, ranks and seeds)."""
    folder = tmp_path_factory.mktemp("restarted")
    (folder / "dropnet.py").write_text(DROPOUT_MODEL)
    args = [
        *"--algo allreduce --dataset digits --model".split(),
        f"{folder / 'dropnet.py'}:Net",
        *"--max-samples 2872 --lr 0.05 --checkpoint-every 400".split(),
    ]  # not --quiet: it would hide the warnings looked for
    out = folder / "restarted"
    env = {"KILL_RANK": "1", "KILL_STEP": "3,15", "KILL_MARKER": str(folder / "killed")}
    res = torchrun(*args, "--out", str(out), restarts=2, timeout=240, env=env)
    assert res.returncode == 0, res.stderr[-3000:]
    assert (folder / "killed.0").exists() and (folder / "killed.1").exists() and "exitcode: -9" in res.stderr
    clean = cli_here("train", *args, "--workers", "2", "--out", str(folder / "clean"), "--quiet")
    assert clean.returncode == 0, clean.stderr[-3000:]
    return res, out, json.loads((folder / "clean" / "summary.json").read_text())


@pytest.mark.slow
def test_torchrun_restart_resumes_from_the_last_checkpoint(restarted_twice) -> None:
    """The second restart of :func:`restarted_twice` (rank 1 killed at its 15th step, after
    checkpoints): the restarted group resumes from its last checkpoint and ends where an unkilled
    run ends, bit for bit."""
    res, out, clean = restarted_twice
    assert "resuming from the checkpoint" in res.stderr
    restarted = json.loads((out / "summary.json").read_text())
    assert restarted["samples"] == clean["samples"] == 2872
    assert restarted["final_test_loss"] == clean["final_test_loss"]


@pytest.mark.slow
def test_a_torchrun_restart_before_any_checkpoint_trains_again_in_the_out_it_was_given(restarted_twice) -> None:
    """The first restart of :func:`restarted_twice`: rank 1 SIGKILLed at its 3rd step, before any
    checkpoint. The restart finds no checkpoint in the directory its first attempt made (that
    attempt wrote the launch's name there) and trains again from the start in its place. Until
    2026-11-28 rank 0 refused it ("run directory ... already exists", exit 2) and the others
    waited for it until torchrun killed them: 3 of 7 DiLoCo restarts of
    `benchmarks/train_through.py --torchrun`. A directory that this launch did not make stays
    refused (test_kubeflow's and test_cli's)."""
    res, out, _ = restarted_twice
    assert "no checkpoint in" in res.stderr and "training again from the start" in res.stderr
    s = json.loads((out / "summary.json").read_text())
    assert s["samples"] >= 1436 and s["workers"] == 2


@pytest.mark.slow
def test_torchrun_restart_of_an_asynchronous_run_resumes_from_its_checkpoint(tmp_path, dropout_model) -> None:
    """asgd under torchrun --max-restarts 1: worker 1 (torchrun's rank 2; its RANK says 1, as
    run.rank, since 2026-12-01) SIGKILLed at its 10th step,
    after a few checkpoints; torchrun stops the group before the survivor finishes the budget and
    restarts the server and both workers, which resume from the server's last checkpoint (not from
    scratch) and finish it. (With a 5,744-sample budget the survivor used to finish the whole run
    before torchrun noticed: the test passed without anything being resumed mid-run.) Rank 0
    serves: 2 workers of 3 processes (test_param_server_runs' test_torchrun_rank_zero_serves until
    2026-11-28, a torchrun run of its own that this one's checks cover)."""
    out = tmp_path / "restarted"
    res = torchrun(
        *"--algo asgd --dataset digits --model".split(),
        dropout_model,
        *"--max-samples 14360 --lr 0.05 --checkpoint-every 400 --out".split(),
        str(out),  # not --quiet: its warnings are looked for
        nproc=3,
        restarts=1,
        timeout=240,
        env={"KILL_RANK": "1", "KILL_STEP": "10"},
    )
    assert res.returncode == 0, res.stderr[-3000:]
    assert "exitcode: -9" in res.stderr and "resuming from the checkpoint" in res.stderr
    s = json.loads((out / "summary.json").read_text())
    assert s["samples"] >= 14360 and s["final_test_accuracy"] > 0.8
    assert s["workers"] == 2 and len(s["samples_per_worker"]) == 2 and all(n > 0 for n in s["samples_per_worker"])
    assert s["algo"] == "asgd" and s["staleness"]["histogram"]
    events = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    seqs = [e["seq"] for e in events if e["event"] == "checkpoint"]
    assert seqs[0] < 14360 // 400 // 2 and seqs == sorted(set(seqs))  # checkpoints from early on, none again:
    # the second attempt took up where the first one's last checkpoint was
    assert [e["samples"] for e in events if e["event"] == "eval"] == [e["samples"] for e in s["evals"]]  # one end


@pytest.mark.slow
def test_a_missing_manifest_gives_way_to_the_one_before(tmp_path, caplog) -> None:
    """manifest.json deleted, manifest.prev.json and the checkpoints whole: on 486a73c the resume
    said "no checkpoint in ... (train with --checkpoint-every to make one)", an audit's."""
    run = tmp_path / "run"
    common = ["--dataset", "digits", "--model", "logreg", "--algo", "allreduce", "--workers", "2", "--quiet"]
    assert (
        cli_here("train", *common, "--max-samples", "256", "--checkpoint-every", "64", "--out", str(run)).returncode
        == 0
    )
    (run / "checkpoint" / "manifest.json").unlink()
    res = cli_here("train", "--resume", str(run), "--max-samples", "384")
    assert res.returncode == 0, res.stderr
    assert "manifest.json is missing; resuming from the checkpoint before it (" in caplog.text, caplog.text
    assert json.loads((run / "summary.json").read_text())["samples"] == 384


@pytest.mark.slow
@pytest.mark.parametrize("damage", ["ranks []", "ranks [0, 0]", "torn"])
def test_a_damaged_manifest_gives_way_to_the_one_before_or_is_one_error_line(tmp_path, caplog, damage: str) -> None:
    """A lockstep group's newest manifest (hand-edited: no worker's part listed, or one twice; or
    torn): the resume goes on from the generation before (manifest.prev.json), saying so, and
    without one is refused in one line. (With no part listed, every worker would have gone on
    without a part of its own and with no peer's to take.) Before 2026-11-29 the resume was refused
    even with a whole checkpoint before it."""
    run = tmp_path / "run"
    common = ["--dataset", "digits", "--model", "logreg", "--algo", "allreduce", "--workers", "2", "--quiet"]
    res = cli_here("train", *common, "--max-samples", "256", "--checkpoint-every", "64", "--out", str(run))
    assert res.returncode == 0, res.stderr
    ckpt = run / "checkpoint"
    manifest = json.loads((ckpt / "manifest.json").read_text())
    assert manifest["ranks"] == [0, 1] and not manifest.get("coordinator") and manifest["samples"] == 256
    edited = {"ranks []": {**manifest, "ranks": []}, "ranks [0, 0]": {**manifest, "ranks": [0, 0]}}
    damaged = json.dumps(edited[damage]) if damage in edited else json.dumps(manifest)[:40]
    (ckpt / "manifest.json").write_text(damaged)
    previous = (ckpt / "manifest.prev.json").read_bytes()
    (ckpt / "manifest.prev.json").unlink()
    res = cli_here("train", "--resume", str(run), "--max-samples", "384")
    lines = res.stderr.strip().splitlines()
    assert res.returncode == 2 and len(lines) == 1, res.stderr
    assert lines[0].startswith("error: ") and ("ranks" in lines[0] or "cannot read" in lines[0]), lines[0]
    assert (ckpt / "manifest.json").read_text() == damaged and sorted(ckpt.glob("ckpt-*")), "a file was touched"

    (ckpt / "manifest.prev.json").write_bytes(previous)
    older = json.loads(previous)
    res = cli_here("train", "--resume", str(run), "--max-samples", "384")
    assert res.returncode == 0, res.stderr
    said = f"resuming from the checkpoint before it ({older['seq']}, at {older['samples']} samples)"
    assert said in caplog.text and older["samples"] == 128, caplog.text
    assert json.loads((run / "summary.json").read_text())["samples"] == 384
    for name in ("manifest.json", "manifest.prev.json"):  # whole again, their files there
        if (ckpt / name).exists():
            m = json.loads((ckpt / name).read_text())
            assert all((ckpt / f"ckpt-{m['seq']:06d}-rank{r}.pt").is_file() for r in m["ranks"]), name


def test_only_distsgds_own_checkpoint_files_are_rotated_or_tidied(tmp_path) -> None:
    """Files of the user's in checkpoint/ that merely look like distsgd's stay: before, rotation
    deleted ``ckpt-000001-rank0 (copy).pt`` and crashed on ``ckpt-best-rank0.pt`` (int('best')),
    and every hidden ``*.tmp`` went. A killed writer's own temporary still goes."""
    ckpt = tmp_path / "checkpoint"
    ckpt.mkdir()
    theirs = ["ckpt-best-rank0.pt", "ckpt-000001-rank0 (copy).pt", "ckpt-000001-rank0-mine.pt", ".notes.tmp"]
    theirs += [".ckpt-000001-rank0.pt.mine.tmp", "ckpt-000099-rank0 (copy).pt"]
    for name in theirs:
        (ckpt / name).write_bytes(b"mine")
    killed = ckpt / ".ckpt-000001-rank0.pt.0123456789ab.tmp"  # atomic_write's name: a writer killed
    killed.write_bytes(b"torn")
    for seq in (1, 2, 3):
        checkpoint.save_worker_state(ckpt, seq, 0, {"x": torch.ones(1) * seq})
        checkpoint.commit_checkpoint(ckpt, seq, 1, {})
    checkpoint.remove_uncommitted(tmp_path)  # (files past the manifest's checkpoint: distsgd's only)
    assert sorted(p.name for p in ckpt.glob("ckpt-*.pt") if p.name not in theirs) == [
        "ckpt-000002-rank0.pt",
        "ckpt-000003-rank0.pt",
    ]
    assert all((ckpt / name).read_bytes() == b"mine" for name in theirs)
    assert not killed.exists()


class SummaryWatch:
    """Whether the run directory held a summary.json at each checkpoint (in the launching process)."""

    def __init__(self, run: Path) -> None:
        self.run = run
        self.seen: list[bool] = []

    def on_checkpoint(self, event: dict) -> None:
        self.seen.append((self.run / "summary.json").exists())


@pytest.mark.slow
def test_a_resume_past_its_budget_or_into_a_taken_out_leaves_the_run_it_reads_as_it_was(tmp_path) -> None:
    """Before: a resume whose checkpoint was past --max-samples (or --epochs) trained nothing, exit 0,
    and replaced the finished model and summary with the checkpoint's; one with another --seed
    went on in another order of the data; one into an --out that was refused had already fallen
    back in the run it read (rewriting its manifest), and one into another directory removed the
    temporaries of the run it read; a run resumed in place kept its old summary.json while it
    trained, so that a kill left a finished-looking run (distsgd compare read it)."""
    run = tmp_path / "a"
    distsgd.train(model="mlp", data="digits", epochs=2, checkpoint_every="300", out=str(run), quiet=True)
    ckpt = run / checkpoint.CHECKPOINT_DIR
    before = {p: p.read_bytes() for p in run.rglob("*") if p.is_file() and p.name != ".distsgd"}
    for settings, message in (
        ({"max_samples": 1000}, r"its checkpoint is at 2717 samples, past --max-samples 1000: nothing would train"),
        ({"epochs": 1}, r"past --epochs 1 \(1437 samples\)"),
        ({"seed": 5, "epochs": 3}, r"written with --seed 0, not 5"),
    ):
        with pytest.raises(distsgd.ConfigError, match=message):
            distsgd.train(resume=str(run), quiet=True, **settings)
    taken = tmp_path / "taken"
    taken.mkdir()
    (taken / "notes.txt").write_text("mine")
    newest = checkpoint.worker_file(ckpt, checkpoint.read_manifest(run)["seq"], 0)
    newest.write_bytes(newest.read_bytes()[:1000])  # torn: a resume falls back to the one before
    with pytest.raises(distsgd.ConfigError, match="already exists"):
        distsgd.train(resume=str(run), out=str(taken), quiet=True)
    assert json.loads((ckpt / "manifest.json").read_text())["seq"] == 9 and not list(ckpt.glob("*damaged*"))
    newest.write_bytes(before[newest])
    stale = ckpt / ".ckpt-000010-rank0.pt.0123456789ab.tmp"
    stale.write_bytes(b"torn")
    distsgd.train(resume=str(run), out=str(tmp_path / "elsewhere"), quiet=True)
    assert stale.exists()
    assert {p: p.read_bytes() for p in before} == before
    watch = SummaryWatch(run)
    distsgd.train(resume=str(run), epochs=3, quiet=True, callbacks=[watch])
    assert watch.seen and not any(watch.seen)
    assert json.loads((run / "summary.json").read_text())["samples"] == 3 * 1437


SIGNALLED_IN_AN_EVALUATION = """
import os, signal, sys
import torch
from torch import nn
import distsgd

class Net(nn.Module):
    \"\"\"An MLP that sends its own process SIGTERM at its KILL_AT-th evaluation batch.\"\"\"
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Flatten(), nn.Linear(64, 16), nn.ReLU(), nn.Linear(16, 10))
        self.batches = 0
    def forward(self, x):
        if not self.training and not torch.is_grad_enabled():
            self.batches += 1
            if self.batches == int(os.environ.get("KILL_AT", "0")):
                os.kill(os.getpid(), signal.SIGTERM)
        return self.body(x)

if __name__ == "__main__":
    out, algo, workers = sys.argv[1], sys.argv[2], int(sys.argv[3])
    common = dict(model=Net, data="digits", algo=algo, workers=workers, epochs=3, eval_batch_size=64,
                  checkpoint_every="epoch", quiet=True)
    r = distsgd.train(resume=out, **common) if len(sys.argv) > 4 else distsgd.train(out=out, **common)
    print("EVALS", [e["samples"] for e in r.summary["evals"]])
"""


@pytest.mark.slow
@pytest.mark.parametrize("algo, workers", [("single", 1), ("allreduce", 2)])
def test_a_signal_during_an_evaluation_stops_there_and_the_resume_makes_it(tmp_path, algo, workers) -> None:
    """SIGTERM in worker 0's second evaluation (its second batch of 64): the run stops at that
    step, its checkpoint owing the evaluation, which the resumed run makes first. On 87969bd the
    workers took another step first and the resume never made it: 4 evaluations for 5, an audit's
    (its time and samples to a target, and with --stop-at-target its model, another run's)."""
    script = tmp_path / "signalled.py"
    script.write_text(SIGNALLED_IN_AN_EVALUATION)

    def evals(out: str, *resume: str, kill: int = 0) -> str:
        env = {**os.environ, "KILL_AT": str(kill), "PYTHONPATH": str(Path(distsgd.__file__).parents[1])}
        r = subprocess.run(
            [sys.executable, str(script), out, algo, str(workers), *resume], env=env, capture_output=True, text=True
        )
        return r.stdout.strip().splitlines()[-1] if r.returncode == 0 else f"exit {r.returncode}"

    straight = evals(str(tmp_path / "a"))
    assert straight.startswith("EVALS [") and straight.count(",") == 4, straight
    assert evals(str(tmp_path / "b"), kill=8) != straight  # stopped by the signal
    assert evals(str(tmp_path / "b"), "resume") == straight


def test_a_second_resume_in_place_while_one_trains_is_refused(tmp_path) -> None:
    """A run resumed in place holds its directory's lock: a second resume of it meanwhile (here the
    lock held as the first one holds it) is refused in one line, the run as it was. Until 2026-12-01
    two at once each rotated the other's checkpoints, and the one that failed left its config.toml
    beside the other's model (an audit's)."""
    import fcntl

    run = tmp_path / "a"
    common = dict(model="logreg", data="digits", quiet=True)
    distsgd.train(max_samples=400, checkpoint_every="128", out=str(run), **common)
    before = {p: p.read_bytes() for p in run.rglob("*") if p.is_file()}
    fd = os.open(run / ".distsgd", os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        with pytest.raises(distsgd.ConfigError, match="another distsgd run is training in it now"):
            distsgd.train(resume=str(run), max_samples=800, **common)
        assert {p: p.read_bytes() for p in run.rglob("*") if p.is_file()} == before
    finally:
        os.close(fd)
    assert distsgd.train(resume=str(run), max_samples=800, **common).summary["samples"] >= 800


@pytest.mark.slow
@pytest.mark.parametrize("algo, workers", [("single", 1), ("hogwild", 2), ("asgd", 2)])
def test_a_resume_on_data_of_another_size_is_refused(tmp_path, algo, workers) -> None:
    """The data given again under the same name with other samples: on ad5499d the resume trained
    on, its epoch's positions indexing another set, summary.json's epochs 5.33 for 4 (an audit's);
    not given again, it is asked for. The parameter server's checkpoints record the size too (until
    2026-12-01 they did not, and its resume trained on)."""
    g = torch.Generator().manual_seed(0)

    def data(n: int) -> tuple[torch.Tensor, ...]:
        return (
            torch.randn(n, 8, generator=g),
            torch.randint(0, 3, (n,), generator=g),
            torch.randn(60, 8),
            torch.zeros(60, dtype=torch.long),
        )

    common = dict(model="logreg", algo=algo, workers=workers, batch_size=16, quiet=True)
    run = tmp_path / "a"
    distsgd.train(data=data(500), epochs=2, checkpoint_every="200", out=str(run), **common)
    before = {p: p.read_bytes() for p in run.rglob("*") if p.is_file()}
    with pytest.raises(
        distsgd.ConfigError, match=r"written on 500 training samples of arrays, and the data now has 300"
    ):
        distsgd.train(data=data(300), resume=str(run), epochs=4, **common)
    with pytest.raises(distsgd.ConfigError, match=r"its data \(arrays\) came from Python.*: pass it again"):
        distsgd.train(resume=str(run), epochs=4, **common)  # (on ad5499d: "unknown dataset 'arrays'")
    assert {p: p.read_bytes() for p in run.rglob("*") if p.is_file()} == before
    assert distsgd.train(data=data(500), resume=str(run), epochs=3, **common).summary["epochs"] == 3


@pytest.mark.slow
@pytest.mark.parametrize("algo, settings", [("hogwild", {}), ("allreduce", {"lr": 2.0})])
def test_a_finished_run_resumed_in_place_within_its_budget_is_refused_and_kept(tmp_path, algo, settings) -> None:
    """A plain --resume of a finished Hogwild! run replaced its model with its last checkpoint's
    (taken before the final model), re-evaluated (0.7694 became 0.7944); an allreduce run whose
    last checkpoint came before its end trained those samples again with the --lr given (0.525
    became 0.369), exit 0 both (an audit's, 2026-12-01). Refused now, the run left byte for byte;
    a larger budget resumes."""
    run = tmp_path / "a"
    common = dict(model="logreg", data="digits", algo=algo, workers=2, quiet=True)
    distsgd.train(epochs=2, checkpoint_every="500", out=str(run), **common)
    before = {p: p.read_bytes() for p in run.rglob("*") if p.is_file()}
    with pytest.raises(
        distsgd.ConfigError, match=r"the run finished at \d+ samples, within --epochs 2 \(2872 samples\)"
    ):
        distsgd.train(resume=str(run), quiet=True, **settings)
    assert {p: p.read_bytes() for p in run.rglob("*") if p.is_file()} == before
    result = distsgd.train(resume=str(run), epochs=3, quiet=True)
    assert result.summary["samples"] >= 3 * 1436


@pytest.mark.slow
@pytest.mark.parametrize("algo, workers", [("single", 1), ("hogwild", 2), ("asgd", 2)])
def test_a_run_with_a_torn_newest_checkpoint_resumes_elsewhere_and_is_only_read(
    tmp_path, algo, workers, caplog
) -> None:
    """On 08b62e3 a resume into another --out whose newest checkpoint was torn fell back by rewriting
    the manifest of the run it read (so a run on a read-only mount could not be resumed elsewhere):
    the workers read that manifest. Now the launcher hands them the one it chose (Job.resume_from),
    and the run read is left byte for byte; single's resume from the older checkpoint ends as the
    run trained straight through."""
    common = dict(model="mlp", data="digits", algo=algo, workers=workers, batch_size=32, quiet=True)
    run = tmp_path / "a"
    distsgd.train(max_samples=640, checkpoint_every="256", out=str(run), **common)
    ckpt = run / checkpoint.CHECKPOINT_DIR
    newest = checkpoint.read_manifest(run)
    assert (ckpt / checkpoint.PREVIOUS).is_file()
    torn = checkpoint.worker_file(ckpt, newest["seq"], "coordinator" if newest["coordinator"] else 0)
    torn.write_bytes(torn.read_bytes()[:1000])
    before = {p: p.read_bytes() for p in run.rglob("*") if p.is_file()}
    with caplog.at_level("WARNING"):
        result = distsgd.train(max_samples=1280, resume=str(run), out=str(tmp_path / "b"), **common)
    assert f"checkpoint {newest['seq']} in {run} is damaged" in caplog.text
    assert {p: p.read_bytes() for p in run.rglob("*") if p.is_file()} == before  # only read
    assert result.summary["samples"] >= 1280
    if algo == "single":
        straight = distsgd.train(max_samples=1280, out=str(tmp_path / "c"), **common)
        assert all(torch.equal(a, b) for a, b in zip(_params(result.model), _params(straight.model)))


@pytest.mark.slow
@pytest.mark.parametrize("algo, workers", [("single", 1), ("allreduce", 2)])
def test_a_finished_run_resumed_keeps_its_final_evaluation(tmp_path: Path, algo: str, workers: int) -> None:
    """A run of 2 epochs (checkpoints each epoch, its one evaluation the final one) resumed to 3: the
    resumed summary's evaluations are the first part's and the resumed part's final ones, and its
    time and samples to a target the first part's evaluation reached are that evaluation's. On
    6e91d68 the final evaluation, made after the last checkpoint, was lost: one evaluation, and
    samples_to_target at the resumed part's end."""
    flags = ["--dataset", "digits", "--model", "mlp", "--lr", "0.05", "--algo", algo, "--workers", str(workers)]
    flags += ["--eval-every", "1000000"]  # no evaluation but the final one
    out = tmp_path / "run"
    r = cli_here("train", *flags, "--epochs", "2", "--checkpoint-every", "epoch", "--out", str(out), "--quiet")
    assert r.returncode == 0, r.stderr[-3000:]
    first = json.loads((out / "summary.json").read_text())
    assert len(first["evals"]) == 1, first["evals"]
    target = first["final_test_accuracy"]
    r = cli_here("train", "--resume", str(out), "--epochs", "3", "--target-accuracy", str(target), "--quiet")
    assert r.returncode == 0, r.stderr[-3000:]
    resumed = json.loads((out / "summary.json").read_text())
    assert resumed["evals"][0] == first["evals"][0] and len(resumed["evals"]) == 2, resumed["evals"]
    assert resumed["samples_to_target"] == first["samples"] and resumed["time_to_target_s"] == first["train_wall_s"]
    logged = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [e["samples"] for e in logged if e["event"] == "eval"] == [e["samples"] for e in resumed["evals"]]


@pytest.mark.slow
@pytest.mark.parametrize("algo", ["asgd", "hogwild"])
def test_a_chain_of_resumes_keeps_every_parts_final_evaluation(tmp_path: Path, algo: str) -> None:
    """A parameter server's or Hogwild!'s run of 2 epochs resumed to 3, then to 4 (checkpoints
    each epoch): the summary's evaluations are every evaluation metrics.jsonl logged, each part's
    final one among them in its place, with the same figures. Their copies of the model are
    measured after training (their checkpoints file copies not yet measured), and the final
    evaluation of each part comes after its last checkpoint: on cb98bd8 asgd's summary lost both
    earlier parts' (2,872 and 4,308 samples); Hogwild!'s lost the first part's in a run by hand,
    where no copy filed at that checkpoint measured the same model again (not in every run)."""
    flags = ["--dataset", "digits", "--model", "mlp", "--lr", "0.05", "--algo", algo, "--workers", "2", "--quiet"]
    out = tmp_path / "run"
    r = cli_here("train", *flags, "--epochs", "2", "--checkpoint-every", "epoch", "--out", str(out))
    assert r.returncode == 0, r.stderr[-3000:]
    finals = [json.loads((out / "summary.json").read_text())["evals"][-1]]
    for epochs in ("3", "4"):
        r = cli_here("train", *flags, "--resume", str(out), "--epochs", epochs)
        assert r.returncode == 0, r.stderr[-3000:]
        finals.append(json.loads((out / "summary.json").read_text())["evals"][-1])
    summary = json.loads((out / "summary.json").read_text())
    logged = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    figures = ("samples", "test_accuracy", "test_loss")
    evals = [tuple(e[k] for k in figures) for e in summary["evals"]]
    assert evals == [tuple(e[k] for k in figures) for e in logged if e["event"] == "eval"]
    assert all(tuple(f[k] for k in figures) in evals for f in finals), (finals, evals)
    assert [s for s, *_ in evals] == sorted({s for s, *_ in evals})


@pytest.mark.slow
def test_a_resumed_parameter_servers_bytes_per_worker_add_up_to_what_it_received(tmp_path: Path) -> None:
    """asgd with checkpoints every 500 samples, resumed to train on: ``bytes_sent_per_worker``
    still adds up to the server's ``server_bytes_received`` (every byte a worker sent, the server
    received), and no worker's count falls below what it had sent by the first part's end. On
    cb98bd8 a worker that had finished before the last checkpoint (the manifest's ranks [1]) saved
    no part of it, came back counting from 0, and the split was 86,104 and 169,520 B of 341,728."""
    flags = ["--dataset", "digits", "--model", "logreg", "--lr", "0.05", "--algo", "asgd", "--workers", "2", "--quiet"]
    out = tmp_path / "run"
    r = cli_here("train", *flags, "--epochs", "2", "--checkpoint-every", "500", "--out", str(out))
    assert r.returncode == 0, r.stderr[-3000:]
    first = json.loads((out / "summary.json").read_text())
    assert sum(first["bytes_sent_per_worker"]) == first["server_bytes_received"]
    r = cli_here("train", "--resume", str(out), "--epochs", "4", "--quiet")
    assert r.returncode == 0, r.stderr[-3000:]
    s = json.loads((out / "summary.json").read_text())
    assert sum(s["bytes_sent_per_worker"]) == s["server_bytes_received"], s["bytes_sent_per_worker"]
    assert s["bytes_sent"] == s["server_bytes_sent"] + s["server_bytes_received"]
    assert min(s["bytes_sent_per_worker"]) > max(first["bytes_sent_per_worker"]), s["bytes_sent_per_worker"]


@pytest.mark.slow
def test_a_max_samples_run_resumed_with_epochs_trains_to_them_and_alone_trains_nothing(tmp_path: Path) -> None:
    """A run of --max-samples 2000 (its last step ends at 2,013) resumed: with nothing changed it
    is refused, the run as it was (nothing more would train: until 2026-12-01 it trained nothing,
    exit 0, and saved its last checkpoint's model as the run's, which under Hogwild! or an earlier
    checkpoint was another); with a smaller --max-samples it is refused; with --epochs 4 it trains
    to 4 epochs, the saved --max-samples no longer overriding the budget asked for now. On c2b328c
    the last was refused ("past --max-samples 2000 ... resume with a larger budget"), and a killed
    run would have ignored the --epochs."""
    out = tmp_path / "run"
    flags = ["--dataset", "digits", "--model", "mlp", "--quiet"]
    r = cli_here("train", *flags, "--max-samples", "2000", "--checkpoint-every", "500", "--out", str(out))
    assert r.returncode == 0, r.stderr[-3000:]
    first = json.loads((out / "summary.json").read_text())
    assert first["samples"] > 2000
    r = cli_here("train", "--resume", str(out), "--quiet")
    assert r.returncode == 2 and "the run finished at 2013 samples, within --max-samples 2000" in r.stderr, r.stderr
    again = json.loads((out / "summary.json").read_text())
    assert again == first
    r = cli_here("train", "--resume", str(out), "--max-samples", "1500", "--quiet")
    assert r.returncode == 2 and "past --max-samples 1500" in r.stderr, r.stderr
    r = cli_here("train", "--resume", str(out), "--epochs", "4", "--quiet")
    assert r.returncode == 0, r.stderr[-3000:]
    s = json.loads((out / "summary.json").read_text())
    assert s["max_samples"] is None and s["samples"] == 4 * 1437 and s["epochs"] == 4


def test_a_run_finished_at_its_checkpoint_resumed_with_fewer_epochs_is_refused(tmp_path: Path) -> None:
    """2 epochs checkpointed at each epoch's end (the last checkpoint is the run's end), resumed
    with --epochs 1: refused as a run whose last checkpoint came before its end is, its records as
    they were. On b728f3c it trained nothing, exit 0, and wrote epochs = 1 into config.toml beside
    the 2 passes trained (a finished run's last step past --max-samples was let through for any
    budget but --max-samples)."""
    out = tmp_path / "run"
    distsgd.train(model="logreg", data="digits", epochs=2, checkpoint_every="epoch", out=str(out), quiet=True)
    assert checkpoint.read_manifest(out)["samples"] == 2 * 1437
    kept = {name: (out / name).read_bytes() for name in ("config.toml", "summary.json")}
    r = cli_here("train", "--resume", str(out), "--epochs", "1", "--quiet")
    assert r.returncode == 2 and "past --epochs 1 (1437 samples)" in r.stderr, r.stderr
    assert {name: (out / name).read_bytes() for name in kept} == kept


@pytest.mark.slow
def test_a_finished_torchrun_run_resumed_in_place_is_refused_and_kept(tmp_path: Path) -> None:
    """Under torchrun each rank reads the checkpoint's manifest itself, and until 2026-12-01 none of
    a resume's checks ran there: a finished run resumed in place with nothing changed trained its
    last samples again and saved that model as the run's, exit 0; one with a budget below its
    checkpoint's went on. Each rank refuses both now, as distsgd's own launcher does; the run is
    left byte for byte."""
    out = tmp_path / "run"
    flags = [*"--algo allreduce --dataset digits --model logreg --quiet".split()]
    # the run itself from distsgd's own launcher, as a torchrun of 2 would write it (the same group, ranks
    # and seeds; 10 s less of the suite than a torchrun)
    r = cli_here(
        "train", *flags, "--workers", "2", "--max-samples", "2000", "--checkpoint-every", "500", "--out", str(out)
    )
    assert r.returncode == 0, r.stderr[-3000:]
    before = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    r = torchrun("--resume", str(out), "--quiet")
    assert r.returncode != 0 and "error: --resume" in r.stderr, r.stderr[-3000:]
    assert re.search(r"the run finished at \d+ samples, within --max-samples 2000", r.stderr), r.stderr[-3000:]
    r = torchrun("--resume", str(out), "--max-samples", "1000", "--quiet")
    assert r.returncode != 0 and "past --max-samples 1000" in r.stderr, r.stderr[-3000:]
    assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file()} == before


@pytest.mark.slow
@pytest.mark.parametrize("algo", ["hogwild", "asgd"])
def test_an_asynchronous_checkpoint_says_the_samples_its_resume_goes_on_from(tmp_path: Path, algo: str) -> None:
    """An asynchronous run's checkpoint holds each worker's samples when it saved its part, which a
    resume goes on from; its manifest said the count when the coordinator committed it, later (an
    audit's, 2026-12-01: a short Hogwild! run's checkpoints all said its final 2,872 samples, so
    that one taken before the end passed for the finished run's). The manifest's samples are now
    its workers' (the sum a resume starts its count from), and below the run's end."""
    out = tmp_path / "run"
    distsgd.train(
        model="logreg", data="digits", algo=algo, workers=2, epochs=2, checkpoint_every="500", out=str(out), quiet=True
    )
    manifest = checkpoint.read_manifest(out)
    assert manifest is not None and manifest["coordinator"]
    state = torch.load(
        checkpoint.worker_file(out / checkpoint.CHECKPOINT_DIR, manifest["seq"], checkpoint.COORDINATOR),
        weights_only=True,
    )
    counts = state["counts"] if algo == "hogwild" else state["server"]["counts"]
    assert manifest["samples"] == int(sum(int(c) for c in counts)), (manifest["samples"], counts)
    assert manifest["samples"] < json.loads((out / "summary.json").read_text())["samples"]
