"""distsgd compare: two small real runs side by side, the files it writes, and its bad input."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from distsgd import cli, rundir
from distsgd.bench.compare import _labels, compare_runs
from distsgd.errors import ConfigError
from helpers import cli_here, run_cli

pytest.importorskip("sklearn")

PNG = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def two_runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A single-process run and a two-worker all-reduce run of the same job (through the API: the
    run directories are what compare reads, and no interpreter starts for them)."""
    import distsgd

    root = tmp_path_factory.mktemp("runs")
    common = dict(data="digits", model="mlp", epochs=2, lr=0.05, log_every=5, target_accuracy=0.3, quiet=True)
    distsgd.train(algo="single", out=str(root / "base"), **common)
    distsgd.train(algo="allreduce", workers=2, out=str(root / "two"), **common)
    return root / "base", root / "two"


@pytest.mark.slow
def test_compare_two_runs(two_runs: tuple[Path, Path], tmp_path: Path) -> None:
    base, two = two_runs
    out = tmp_path / "cmp"
    out.mkdir()
    (out / "notes.txt").write_text("mine")  # an existing --out keeps what it had
    res = cli_here("compare", str(base), str(two), "--out", str(out))
    assert res.returncode == 0, res.stderr
    s_base, s_two = (json.loads((d / "summary.json").read_text()) for d in two_runs)
    # the terminal table: a header, a rule, one row a run
    lines = res.stdout.splitlines()
    assert lines[0].split()[:2] == ["run", "workers"] and set(lines[1]) <= {"-", " "}
    assert lines[2].split()[:4] == ["base", "(single)", "1", str(s_base["threads_per_worker"])]
    assert lines[3].split()[:3] == ["two", "(allreduce)", "2"]
    assert lines[-1].startswith(f"wrote {out / 'compare.md'}")
    md = (out / "compare.md").read_text()
    assert "time to 30% (s)" in md and "Settings all runs share: dataset=digits, model=mlp, epochs=2" in md
    assert f"| base (single) | 1 | {s_base['threads_per_worker']} | {s_base['samples_per_s']:.0f} | 1.00 |" in md
    row_two = next(line for line in md.splitlines() if line.startswith("| two (allreduce) | 2 |"))
    assert f"| {s_two['final_test_accuracy']:.4f} | {s_two['bytes_sent_per_sample']:.0f} |" in row_two
    report = json.loads((out / "compare.json").read_text())
    assert [r["algo"] for r in report["rows"]] == ["base (single)", "two (allreduce)"]
    assert report["rows"][1]["scaling_efficiency"] == pytest.approx(
        s_two["samples_per_s"] / (2 * s_base["samples_per_s"])
    )
    assert report["plots"] == ["accuracy_vs_time.png", "accuracy_vs_samples.png", "throughput_vs_time.png"]
    for png in report["plots"]:
        assert (out / png).read_bytes()[:8] == PNG
    assert (out / "notes.txt").read_text() == "mine"
    again = cli_here("compare", str(base), "--out", str(out))  # its own report's files it replaces
    assert (
        again.returncode == 0 and json.loads((out / "compare.json").read_text())["rows"][0]["algo"] == "base (single)"
    )
    # a file of the report's names that distsgd did not write is refused, the folder as it was (until
    # 2026-12-01 the user's compare.md was replaced, an audit's)
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    (theirs / "compare.md").write_text("mine")
    refused = cli_here("compare", str(base), "--out", str(theirs))
    assert refused.returncode == 2 and refused.stderr == (
        f"error: --out {theirs} holds compare.md, which distsgd did not write, and a compare writes files of those "
        "names: choose another --out\n"
    )
    assert [p.name for p in theirs.iterdir()] == ["compare.md"] and (theirs / "compare.md").read_text() == "mine"
    # the throughput curve is the run's progress events
    progress = [json.loads(line) for line in (two / "metrics.jsonl").read_text().splitlines()]
    progress = [e for e in progress if e["event"] == "progress"]
    assert [p[1] for p in report["runs"][1]["throughput"]] == [e["samples_per_s"] for e in progress]


def test_progress_events_carry_all_workers_bytes(two_runs: tuple[Path, Path]) -> None:
    """All-reduce sends the same bytes every step from every worker: a progress event's bytes_sent
    is the run's total so far, in proportion to the steps taken."""
    _, two = two_runs
    summary = json.loads((two / "summary.json").read_text())
    events = [json.loads(line) for line in (two / "metrics.jsonl").read_text().splitlines()]
    progress = [e for e in events if e["event"] == "progress"]
    assert progress and all("bytes_sent" in e for e in progress)
    steps_total = 2 * -(-718 // 64)  # 2 epochs of ceil(718 / 64) steps per worker
    per_step = summary["bytes_sent"] / steps_total
    for e in progress:
        steps = 5 * (progress.index(e) + 1)
        assert e["bytes_sent"] == pytest.approx(per_step * steps)


def test_bad_run_directories_are_one_error_line(
    two_runs: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    base, _ = two_runs
    empty = tmp_path / "empty"
    empty.mkdir()
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "summary.json").write_text('{"algo": "single"')
    partial = tmp_path / "partial"
    partial.mkdir()
    (partial / "summary.json").write_text('{"algo": "single", "workers": 1}')
    cases = {
        str(empty): "has no summary.json",
        str(tmp_path / "nowhere"): "is not a directory",
        str(broken): "cannot read",
        str(partial): "is not a distsgd summary (no samples, samples_per_s",
    }
    for bad, message in cases.items():
        out = tmp_path / "out"
        code = cli.main(["compare", str(base), bad, "--out", str(out)])
        err = capsys.readouterr().err
        assert code == 2, err
        assert len(err.strip().splitlines()) == 1 and err.startswith("error: ") and message in err, err
        assert not (out / "compare.md").exists()


def _variant(base: Path, where: Path, changes: dict) -> Path:
    """A copy of run ``base`` (its summary.json alone) with ``changes`` made to its summary."""
    where.mkdir()
    summary = json.loads((base / "summary.json").read_text())
    (where / "summary.json").write_text(json.dumps({**summary, **changes}))
    return where


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"algo": 5}, '"algo" is 5, not text'),
        ({"evals": "x"}, '"evals" is "x", not a list of evaluations'),
        ({"evals": [1, 2]}, '"evals[0]" is 1, not an evaluation (an object)'),
        ({"evals": [{"samples": 128, "test_accuracy": 0.1}]}, '"evals[0]" has no "train_wall_s"'),
        ({"evals": [{"samples": 128, "train_wall_s": 0.1, "test_loss": "low"}]}, '"evals[0].test_loss" is "low"'),
        ({"final_test_accuracy": "high"}, '"final_test_accuracy" is "high", not a number or null'),
        ({"samples": "x"}, '"samples" is "x", not a number'),
        ({"workers": None}, '"workers" is null, not a whole number of at least 1'),
        ({"workers": [1]}, '"workers" is [1], not a whole number'),
        ({"workers": 0}, '"workers" is 0, not a whole number'),
        ({"workers": True}, '"workers" is true, not a whole number'),
        ({"samples_per_s": 10**400}, '"samples_per_s" is 1000000'),
        ({"target_loss": "low"}, '"target_loss" is "low", not a number or null'),
        ({"failed_workers": None}, '"failed_workers" is null, not a list of whole numbers'),
        ({"staleness": {"mean": 1.0}}, '"staleness" is {"mean": 1.0}, not'),
        ({"hosts": "vm"}, '"hosts" is "vm", not a list of hosts'),
    ],
    ids=lambda v: "-".join(v) if isinstance(v, dict) else None,
)
def test_a_summary_field_of_the_wrong_type_is_one_error_line(
    two_runs: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture, changes: dict, message: str
) -> None:
    base, _ = two_runs
    bad = _variant(base, tmp_path / "bad", changes)
    out = tmp_path / "out"
    code = cli.main(["compare", str(base), str(bad), "--out", str(out)])
    err = capsys.readouterr().err
    assert code == 2, err
    assert err.splitlines() == [err.strip()] and err.startswith(f"error: {bad / 'summary.json'}: "), err
    assert message in err, err
    assert not (out / "compare.md").exists()
    with pytest.raises(ConfigError, match="summary.json"):  # the Python API: the user's error, no other
        compare_runs([base, bad], out)


def test_a_summary_with_nan_figures_and_evaluations_without_accuracy_compares(
    two_runs: tuple[Path, Path], tmp_path: Path
) -> None:
    base, _ = two_runs
    evals = [{"samples": 128, "train_wall_s": 0.1}, {"samples": 256, "train_wall_s": 0.2, "test_accuracy": None}]
    odd = _variant(
        base, tmp_path / "odd", {"final_test_accuracy": float("nan"), "samples_per_s": float("nan"), "evals": evals}
    )
    result = compare_runs([base, odd], tmp_path / "out")
    assert [r["workers"] for r in result["rows"]] == [1, 1] and (tmp_path / "out" / "compare.md").is_file()


@pytest.mark.slow
def test_no_arguments_and_a_subprocess_have_no_traceback(tmp_path: Path) -> None:
    res = run_cli("compare")
    assert res.returncode == 2 and res.stderr.strip().splitlines() == [
        "error: the following arguments are required: RUN_DIR (see `distsgd compare --help`)"
    ]
    res = run_cli("compare", str(tmp_path), "--out", str(tmp_path / "cmp"))
    assert res.returncode == 2 and "Traceback" not in res.stderr
    assert res.stderr == f"error: {tmp_path} has no summary.json: not a finished distsgd run\n"


def test_labels_name_each_run_once() -> None:
    def entry(path: str, algo: str) -> dict:
        return {"run_dir": path, "summary": {"algo": algo}}

    assert _labels([entry("runs/20260101-asgd", "asgd"), entry("runs/b", "single")]) == ["20260101-asgd", "b (single)"]
    assert _labels([entry("x/run", "asgd"), entry("y/run", "asgd")]) == ["x/run (asgd)", "y/run (asgd)"]
    assert _labels([entry("a", "ssp"), entry("a", "ssp")]) == ["a (ssp)", "a (ssp) #2"]


def test_compare_without_matplotlib_says_in_one_line_which_extra_draws_plots(
    two_runs: tuple[Path, Path], tmp_path: Path, capsys, caplog, monkeypatch
) -> None:
    """After the quick start's install (no extras) compare prints its table, writes its files, and
    says once which extra its plots need, instead of plots."""
    import sys

    from distsgd.bench.report import NO_PLOTS

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib: ImportError
    caplog.set_level("WARNING")  # (an earlier in-process command's --quiet may have left the root at ERROR)
    out = tmp_path / "cmp"
    assert cli.main(["compare", *map(str, two_runs), "--out", str(out)]) == 0
    said = [r.getMessage() for r in caplog.records if "plots" in r.getMessage()]
    assert said == [NO_PLOTS] and "pip install 'distsgd[bench]'" in NO_PLOTS
    assert capsys.readouterr().out.splitlines()[-1] == f"wrote {out / 'compare.md'}, {out / 'compare.json'}"
    assert not list(out.glob("*.png")) and json.loads((out / "compare.json").read_text())["plots"] == []


def test_a_target_is_named_with_the_digits_it_was_given() -> None:
    """8f65d93 rounded a 0.755 target to "time to 76%" in compare's header."""
    from distsgd.bench.report import _goal

    assert [_goal({"target_accuracy": a}) for a in (0.755, 0.85, 0.9)] == ["75.5%", "85%", "90%"]
    assert _goal({"target_accuracy": None, "target_loss": 0.35}) == "loss 0.35"


@pytest.mark.slow
def test_scaling_and_targets_are_each_runs_own(two_runs: tuple[Path, Path], tmp_path: Path) -> None:
    """Runs of other jobs side by side: a single run of another dataset is not the scaling baseline
    of this one's (on cb98bd8 the baseline was the median of every 1-worker single run: 1.16 for a
    single run against itself, 0.06 for Hogwild!); a run given no target reads "-" where it read
    "reached 0/1"; and a run whose target is not the header's names it."""
    base, two = two_runs
    s_base = json.loads((base / "summary.json").read_text())
    other = _variant(
        base, tmp_path / "other", {"dataset": "fashion-mnist", "samples_per_s": 3 * s_base["samples_per_s"]}
    )
    none = _variant(
        two, tmp_path / "none", {"target_accuracy": None, "time_to_target_s": None, "samples_to_target": None}
    )
    higher = _variant(two, tmp_path / "higher", {"target_accuracy": 0.6})
    report = compare_runs([base, other, two, none, higher], tmp_path / "cmp")
    rows = {r["algo"]: r for r in report["rows"]}
    assert rows["base (single)"]["scaling_efficiency"] == pytest.approx(1.0)
    assert rows["other (single)"]["scaling_efficiency"] == pytest.approx(1.0)
    s_two = json.loads((two / "summary.json").read_text())
    assert rows["two (allreduce)"]["scaling_efficiency"] == pytest.approx(
        s_two["samples_per_s"] / (2 * s_base["samples_per_s"])
    )
    assert rows["none (allreduce)"]["reached_target"] == "-"
    md = (tmp_path / "cmp" / "compare.md").read_text()
    table = [line.split(" | ") for line in md.splitlines() if "(allreduce) | 2 |" in line]
    reached = {cells[0].removeprefix("| "): cells[7] for cells in table}
    assert reached == {"two (allreduce)": "1/1 of 30%", "none (allreduce)": "-", "higher (allreduce)": "1/1 of 60%"}


def test_a_benchs_directory_stands_for_its_finished_runs(
    two_runs: tuple[Path, Path], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """``distsgd compare BENCH`` (or ``runs/*``, where a bench writes by default) takes the bench's
    runs that finished, saying which it skipped (an interrupted bench's last); on 74fbf75 it was
    "has no summary.json: not a finished distsgd run"."""
    import shutil

    bench = tmp_path / "bench"
    for run in two_runs:
        shutil.copytree(run, bench / "runs" / run.name)
    (bench / "runs" / "cut").mkdir()
    (bench / "runs" / "cut" / "config.toml").write_text((two_runs[0] / "config.toml").read_text())
    # a plain directory holding runs/ (the one a user trains from) is no bench: until 2026-12-01 its
    # runs were compared, a bench among them called unfinished, exit 0 (an audit's)
    with pytest.raises(ConfigError, match="has no summary.json: not a finished distsgd run"):
        compare_runs([bench], tmp_path / "cmp0")
    (bench / rundir.MARKER).write_text("")  # what `distsgd bench` made (bench.json comes at its end)
    report = compare_runs([bench], tmp_path / "cmp")
    assert [Path(e["run_dir"]).name for e in report["runs"]] == ["base", "two"]
    assert f"skipping {bench / 'runs' / 'cut'}: it did not finish" in caplog.text
    (bench / "runs" / "base" / "summary.json").unlink()
    (bench / "runs" / "two" / "summary.json").unlink()
    with pytest.raises(ConfigError, match="a bench whose runs in .* have not finished"):
        compare_runs([bench], tmp_path / "cmp2")
