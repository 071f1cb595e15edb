"""distsgd bench: a tiny real bench, the files it writes, and its bad input."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import distsgd
from distsgd.bench import parse_algos
from distsgd.config import RunConfig, validate
from helpers import cli_here

pytest.importorskip("sklearn")


@pytest.mark.slow
def test_tiny_bench_writes_json_table_and_plots(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    out = tmp_path / "bench"
    res = cli_here(
        *"bench --algos single,local-sgd[sync_every=4] --workers 1,2 --dataset digits --model mlp --epochs 1".split(),
        *"--lr 0.05 --target-accuracy 0.3 --eval-every 400 --out".split(),
        str(out),
    )
    assert res.returncode == 0, res.stderr
    assert "skipping single with 2 workers" in caplog.text  # (a warning: pytest's logging takes it here)
    assert "[3/3]" in res.stdout and "wrote" in res.stdout  # 3 runs: single with 2 workers was skipped
    bench = json.loads((out / "bench.json").read_text())
    rows = {(r["algo"], r["workers"]): r for r in bench["rows"]}
    assert set(rows) == {("single", 1), ("local-sgd[sync_every=4]", 1), ("local-sgd[sync_every=4]", 2)}
    assert rows[("single", 1)]["scaling_efficiency"] == pytest.approx(1.0)
    two = rows[("local-sgd[sync_every=4]", 2)]
    assert two["samples"]["median"] == 1436 and two["bytes_sent_per_sample"]["median"] > 0
    assert bench["machine"]["cores"] >= 1 and bench["machine"]["torch_version"]
    for entry in bench["runs"]:
        assert (out / entry["run_dir"] / "summary.json").is_file()
    table = (out / "bench.md").read_text()
    assert "| local-sgd[sync_every=4] | 2 |" in table and "time to 30%" in table
    for png in ("accuracy_vs_time.png", "accuracy_vs_samples.png", "throughput_vs_workers.png"):
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow
def test_bench_bad_input(tmp_path: Path) -> None:
    res = cli_here("bench", "--algos", "single,gossip", "--dataset", "digits", "--out", str(tmp_path / "b"))
    assert (
        res.returncode == 2
        and res.stderr.strip()
        == "error: unknown algorithm 'gossip' (choose from " + ", ".join(distsgd.algorithms.registry.names()) + ")"
    )
    res = cli_here("bench", "--algos", "local-sgd[sync_every]", "--dataset", "digits", "--out", str(tmp_path / "b"))
    assert res.returncode == 2 and "needs key=value" in res.stderr


@pytest.mark.parametrize(
    "algos, message",
    [
        ("allreduce,local-sgd[sync_every=abc]", "--algos local-sgd[sync_every=abc]: --sync-every must be"),
        ("single,allreduce[sync_every=4]", "--algos allreduce[sync_every=4]: "),
    ],
)
def test_a_bench_label_whose_settings_cannot_run_anywhere_is_one_line(tmp_path: Path, algos: str, message: str) -> None:
    """A bad value, or an option of another algorithm, in one configuration's label: one line and
    nothing run. On c2b328c a warning skipped it, the others ran and the bench exited 0, its
    report silent about the configuration left out. (One that cannot run at a worker count, as
    single with 2, is still skipped with a warning.)"""
    out = tmp_path / "b"
    res = cli_here("bench", "--algos", algos, "--workers", "1,2", "--dataset", "digits", "--out", str(out))
    assert res.returncode == 2 and res.stderr.startswith("error: " + message), res.stderr
    assert not out.exists()


def test_bench_takes_no_resume(tmp_path: Path) -> None:
    """Each configuration of a bench runs afresh: on c2b328c --resume resumed the first one's run from
    the directory given, then failed at the second (another algorithm's checkpoint), with no report."""
    res = cli_here("bench", "--algos", "allreduce", "--resume", str(tmp_path), "--out", str(tmp_path / "b"))
    assert res.returncode == 2 and "unrecognized arguments: --resume" in res.stderr, res.stderr


def test_parse_algos() -> None:
    specs = parse_algos("allreduce,local-sgd[sync_every=8;warmup_steps=100],easgd[easgd_mode=async]")
    assert [s.label for s in specs] == [
        "allreduce",
        "local-sgd[sync_every=8;warmup_steps=100]",  # as --algos takes it (on c2b328c with ",")
        "easgd[easgd_mode=async]",
    ]
    assert specs[1].options == (("sync_every", 8), ("warmup_steps", 100))


@pytest.mark.parametrize("text", ["3", "a:2", "1:0.5", "-1:3"])
def test_bad_straggler(text: str) -> None:
    with pytest.raises(distsgd.ConfigError, match="--straggler"):
        validate(RunConfig(workers=4, straggler=text))
    with pytest.raises(distsgd.ConfigError, match="only 2 workers"):
        validate(RunConfig(workers=2, straggler="2:3"))


def test_the_settings_line_gives_each_repeats_seed() -> None:
    from distsgd.bench import report

    machine = {"host": "h", "cpu": "c", "cores": 2, "torch_version": "t", "python": "p"}
    three = report.markdown(report.derive([], machine, RunConfig(seed=3), repeats=3))
    assert "seed=3..5 (repeat r: 3 + r)" in three and "seed=3," not in three
    assert "seed=3," in report.markdown(report.derive([], machine, RunConfig(seed=3), repeats=1))


def _help_of(command: str, dest: str) -> str:
    from distsgd import cli

    parser = cli.build_parser()._subparsers._group_actions[0].choices[command]
    return next(a.help for a in parser._actions if a.dest == dest) or ""


def test_bench_writes_where_its_out_help_says(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``bench --help``'s ``--out`` default is where a bench without ``--out`` writes (it said
    train's runs/<timestamp>-<algo>; the bench wrote runs/bench-<timestamp>)."""
    import re

    from distsgd import cli

    said = re.search(r"default (\S+)$", _help_of("bench", "out")).group(1)
    pattern = re.escape(said).replace(re.escape("<timestamp>"), r"\d{8}-\d{6}")
    monkeypatch.chdir(tmp_path)
    args = ["bench", "--algos", "single", "--workers", "1", "--dataset", "digits", "--model", "logreg"]
    args += ["--max-samples", "64", "--quiet"]
    assert cli.main(args) == 0
    made = [str(p.relative_to(tmp_path)) for p in (tmp_path / "runs").iterdir()]
    assert len(made) == 1 and re.fullmatch(pattern, made[0]), (said, made)
    assert (tmp_path / made[0] / "bench.json").is_file()


def test_bench_says_which_configuration_runs_as_each_starts_and_ends(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """A configuration may train for minutes: a line as each starts (which, where) and one as it
    ends (its figures), numbered out of the runs that will really run (a skipped configuration
    is not counted: single with 2 workers here)."""
    from distsgd import cli

    out = tmp_path / "b"
    args = ["bench", "--algos", "single,allreduce", "--workers", "1,2", "--repeats", "2", "--dataset", "digits"]
    args += ["--model", "logreg", "--max-samples", "64", "--out", str(out)]
    assert cli.main(args) == 0
    lines = capsys.readouterr().out.splitlines()
    runs = [("single", 1, r) for r in (0, 1)] + [("allreduce", w, r) for w in (1, 2) for r in (0, 1)]
    expected = []
    for n, (algo, w, r) in enumerate(runs, 1):
        head = f"[{n}/6] {algo} x{w} repeat {r}: "
        expected += [(head, "running, in " + str(out / "runs" / f"{algo}-w{w}-r{r}")), (head, "samples/s")]
    assert len(lines) == len(expected) + 1 and lines[-1].startswith("wrote "), lines
    for line, (head, said) in zip(lines, expected):
        assert line.startswith(head) and said in line, (line, head, said)


def test_bench_says_how_far_a_configuration_is_while_it_trains(
    tmp_path: Path, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Between a configuration's first and last line, every HEARTBEAT_S seconds a line of how far
    it is (its samples and speed so far, from its metrics.jsonl): a bench printed nothing for
    minutes while one configuration trained (issue 50)."""
    import re

    from distsgd import cli

    monkeypatch.setattr(cli, "HEARTBEAT_S", 0.05)
    out = tmp_path / "b"
    args = ["bench", "--algos", "single", "--workers", "1", "--dataset", "digits", "--model", "mlp"]
    args += ["--max-samples", "40000", "--log-every", "2", "--out", str(out)]
    assert cli.main(args) == 0
    lines = capsys.readouterr().out.splitlines()
    beats = [
        line
        for line in lines[1:-2]
        if re.fullmatch(r"\[1/1\] single x1 repeat 0: \d+ samples, \d+ samples/s, \d+ s so far", line)
    ]
    assert lines[0].startswith("[1/1] single x1 repeat 0: running") and "samples/s" in lines[-2], lines
    assert beats and len(beats) == len(lines) - 3, lines
    seen = [int(line.split(": ")[1].split()[0]) for line in beats]
    assert seen == sorted(seen) and 0 < seen[-1] < 40000 + 64, seen  # the last step crosses the budget by < a batch


@pytest.mark.parametrize(
    "text, message",
    [
        ("single[lr=0.1;lr=0.2]", "sets lr twice"),
        ("single[out=/tmp/x]", r"the bench sets out for each run"),
        ("single[seed=5]", r"the bench sets seed for each run"),
    ],
)
def test_a_spec_that_sets_an_option_twice_or_the_benchs_own_is_refused(text: str, message: str) -> None:
    """Before: the last lr was taken silently; out= made folders named single_out=/tmp/x-w1-r0."""
    with pytest.raises(distsgd.ConfigError, match=message):
        parse_algos(text)


@pytest.mark.slow
def test_a_bench_of_a_regression_reports_its_loss(tmp_path: Path) -> None:
    """An npz of float targets is a regression (its figure is the test loss; no accuracy): the bench
    says each run's loss as it ends and its table has the loss column. On c2b328c the bench
    raised a TypeError after its first run (exit 1, no report), and the table had no loss."""
    import numpy as np

    g = np.random.default_rng(0)
    x = g.standard_normal((300, 6)).astype(np.float32)
    np.savez(tmp_path / "reg.npz", x=x, y=(x @ g.standard_normal(6)).astype(np.float32))
    out = tmp_path / "bench"
    res = cli_here(
        "bench", "--algos", "single,allreduce", "--workers", "1,2", "--dataset", f"npz:{tmp_path / 'reg.npz'}",
        "--model", "mlp", "--epochs", "2", "--out", str(out),
    )  # fmt: skip
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stdout.count("test loss ") == 3, res.stdout  # single x1, allreduce x1 and x2
    bench = json.loads((out / "bench.json").read_text())
    loss = {(r["algo"], r["workers"]): r["final_test_loss"]["median"] for r in bench["rows"]}
    table = (out / "bench.md").read_text()
    assert "| final acc | final loss |" in table
    assert f"| - | {loss[('allreduce', 2)]:.4f} |" in table, table


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--model", "nosuch"], "unknown model 'nosuch'"),
        (["--dataset", "digitz"], "unknown dataset 'digitz'"),
        (["--algos", "single,allreduce[model=nosuch]"], "unknown model 'nosuch'"),
    ],
)
def test_a_bench_naming_a_model_or_dataset_that_is_not_is_one_line_and_leaves_nothing(
    tmp_path: Path, flags: list[str], message: str
) -> None:
    """Checked before the bench's directory is made: on c2b328c the directory came first, so the
    rerun with the name mended was refused ("already exists"); a bad name in a later label ended
    the bench after the runs before it, with no report."""
    args = {"--algos": "single", "--dataset": "digits", "--model": "mlp", **dict(zip(flags[::2], flags[1::2]))}
    out = tmp_path / "b"
    res = cli_here("bench", *(x for kv in args.items() for x in kv), "--workers", "1", "--out", str(out))
    assert res.returncode == 2 and res.stderr.startswith("error: " + message), res.stderr
    assert not out.exists()
