"""Configuration: TOML files, precedence, and one-line errors for impossible settings."""

from __future__ import annotations

from pathlib import Path

import pytest

from distsgd import config
from distsgd.config import RunConfig
from distsgd.errors import ConfigError
from distsgd.train import device


def test_toml_round_trip(tmp_path: Path) -> None:
    cfg = RunConfig(
        lr=0.05,
        epochs=3,
        dataset="digits",
        stop_at_target=True,
        target_accuracy=0.9,
        checkpoint_every="640",
        options={"sync_every": "epoch", "tau": 4},
    )
    path = tmp_path / "c.toml"
    path.write_text(config.to_toml(cfg))
    assert config.load_toml(path, option_names={"sync_every", "tau"}) == cfg


def test_a_run_config_never_names_its_own_directory(tmp_path: Path) -> None:
    """A run's config.toml leaves out --out, --overwrite and --resume, and reading one ignores
    those keys where an older version wrote them, so re-running it cannot replace the run."""
    cfg = RunConfig(dataset="digits", out="runs/x", overwrite=True, resume="runs/w")
    text = config.to_toml(cfg, rerun="runs/x/config.toml")
    assert text.splitlines()[0].endswith("Re-run with: distsgd train --config runs/x/config.toml")
    assert not [ln for ln in text.splitlines() if ln.split(" = ")[0] in ("out", "overwrite", "resume")]
    old = tmp_path / "config.toml"
    old.write_text(text + 'out = "runs/x"\noverwrite = true\nresume = "runs/w"\n')
    assert config.load_toml(old) == RunConfig(dataset="digits")
    mine = tmp_path / "mine.toml"  # a file the user wrote may choose its run directory
    mine.write_text('out = "runs/y"\noverwrite = true\n')
    assert (config.load_toml(mine).out, config.load_toml(mine).overwrite) == ("runs/y", True)


def test_a_python_run_says_what_its_config_cannot_hold(tmp_path: Path) -> None:
    import numpy as np
    from torch import nn

    import distsgd

    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(64, 5)).astype("float32"), rng.integers(0, 3, 64)
    distsgd.train(
        model=nn.Linear(5, 3), data=(x, y, x[:16], y[:16]), max_samples=64, out=str(tmp_path / "run"), quiet=True
    )
    head = [ln for ln in (tmp_path / "run" / "config.toml").read_text().splitlines() if ln.startswith("#")]
    assert "Re-run with" not in " ".join(head)
    assert "the data (arrays) and the model (Linear) came from Python" in head[0]
    assert "cannot re-run that run by itself" in " ".join(head)


def test_train_table_and_dashes(tmp_path: Path) -> None:
    path = tmp_path / "c.toml"
    path.write_text("[train]\nbatch-size = 32\nlr = 1\n")
    cfg = config.load_toml(path)
    assert cfg.batch_size == 32 and cfg.lr == 1.0 and isinstance(cfg.lr, float)


def test_a_flag_is_a_key_of_a_config_file_and_of_train(tmp_path: Path) -> None:
    """The README: a setting's name in a TOML file and in ``distsgd.train`` is its flag's. On
    0a3bbc7 ``--timeout`` alone (the field ``timeout_s``) was not: ``timeout = 60`` was refused in
    a file and ``train(timeout=60)`` in Python. A setting given twice, under either name or with
    a dash, is one line (before: the last one taken)."""
    path = tmp_path / "c.toml"
    path.write_text("timeout = 60\n")
    assert config.load_toml(path).timeout_s == 60.0
    assert config.from_mapping({"timeout": 7}, source="train()").timeout_s == 7.0
    assert config.from_mapping({"timeout_s": 8}).timeout_s == 8.0  # the field's own name, as config.toml writes it
    for twice in ({"timeout": 5, "timeout_s": 60}, {"batch-size": 3, "batch_size": 4}):
        with pytest.raises(ConfigError, match=r"'.*' and '.*' in train\(\) are one setting: give one"):
            config.from_mapping(twice, source="train()")


@pytest.mark.parametrize(
    "text, message",
    [
        ("batchsize = 8\n", r"unknown setting 'batchsize' .*did you mean 'batch_size'\?"),
        ("epochs = 'ten'\n", "'epochs' must be a whole number"),
        ("quiet = 1\n", "'quiet' must be true or false"),
        ("lr = [1]\n", "'lr' must be a number"),
        ("lr = \n", "not valid TOML"),
    ],
)
def test_bad_toml(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "c.toml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=message):
        config.load_toml(path)


def test_missing_config_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="config file not found"):
        config.load_toml(tmp_path / "none.toml")


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"workers": 0}, "--workers must be at least 1"),
        ({"batch_size": -4}, "--batch-size must be at least 1"),
        ({"lr": 0.0}, "--lr must be a positive number"),
        ({"momentum": 1.0}, r"--momentum must be in \[0, 1\)"),
        ({"optimizer": "lbfgs"}, "unknown optimizer 'lbfgs'"),
        ({"optimizer": "\n"}, r"^unknown optimizer '\\n' \(choose"),  # one line (the fuzzer's find of 2026-11-29)
        ({"schedule": "linear"}, "unknown schedule"),
        ({"partition": "random"}, "unknown partition"),
        ({"stop_at_target": True}, "--stop-at-target needs --target-accuracy"),
        ({"target_accuracy": 85.0}, r"--target-accuracy must be in \(0, 1\]"),
        (
            {"target_accuracy": 0.99, "target_loss": 0.9},
            "--target-accuracy 0.99 and --target-loss 0.9: a run times one",
        ),
        ({"checkpoint_every": "often", "out": "x"}, "--checkpoint-every must be a positive number of samples"),
        ({"checkpoint_every": "100"}, "--checkpoint-every needs a run directory"),
        ({"straggler": "1"}, "--straggler must be RANK:FACTOR"),
        ({"straggler": "3:2"}, "--straggler names worker 3, but there are only 1 workers"),
        ({"nesterov": True, "momentum": 0.0}, "--nesterov needs a --momentum"),
    ],
)
def test_validation(changes: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        config.validate(RunConfig(**changes))


def test_threads_per_worker_default() -> None:
    assert device.threads_per_worker(RunConfig(workers=1)) == max(1, config.cores())
    assert device.threads_per_worker(RunConfig(workers=64)) == 1
    assert device.threads_per_worker(RunConfig(threads_per_worker=3)) == 3


def test_structured_strings_are_parsed_once_into_typed_values() -> None:
    cfg = RunConfig(checkpoint_every="epoch", straggler="1:2.5", workers=2)
    assert cfg.checkpoint_period == config.Period(None) and cfg.checkpoint_period.each_epoch
    assert cfg.straggler_spec == config.Straggler(1, 2.5)
    assert RunConfig().checkpoint_period is None and RunConfig().straggler_spec is None


def test_every_setting_and_option_has_its_help_beside_it() -> None:
    import dataclasses

    from distsgd.algorithms import registry

    missing = [f.name for f in dataclasses.fields(RunConfig) if not f.metadata.get("help") and f.name != "options"]
    for name in registry.names():
        missing += [
            f"{name}: {f.name}" for f in dataclasses.fields(registry.get(name).Options) if not f.metadata.get("help")
        ]
    assert missing == []


def test_sync_every_parsing() -> None:
    from distsgd.algorithms.local_sgd import LocalSGDOptions

    assert LocalSGDOptions.from_mapping({"sync_every": "epoch"}).sync_every.each_epoch
    assert LocalSGDOptions.from_mapping({"sync_every": 8}).sync_every == config.Period(8)
    for bad in ("0", "-2", "often"):
        with pytest.raises(ConfigError, match="--sync-every"):
            LocalSGDOptions.from_mapping({"sync_every": bad})


@pytest.mark.parametrize(
    "settings, message",
    [
        ({"algo": "local-sgd", "workers": 2, "tau": 4}, "--tau is an option of easgd, not of local-sgd"),
        ({"workers": 1, "tau": 4}, "--tau is an option of easgd, not of single: run it with --algo easgd"),  # (chosen)
        (
            {"algo": "allreduce", "workers": 2, "synch_every": 4},
            r"unknown setting 'synch_every'.*did you mean 'sync_every'",
        ),
        ({"algo": "easgd", "workers": 2, "tau": "often"}, "'tau' must be a whole number"),
    ],
)
def test_an_option_of_another_algorithm_or_none_is_one_error(settings: dict, message: str) -> None:
    import distsgd

    with pytest.raises(ConfigError, match=message):
        distsgd.train(model="mlp", data="digits", quiet=True, **settings)


def test_the_resolved_options_are_recorded(tmp_path: Path) -> None:
    """config.toml holds every option of the run's algorithm, defaults included, so a resumed or
    re-run run uses the same ones whatever a later version's defaults are."""
    import distsgd

    distsgd.train(
        model="logreg",
        data="digits",
        algo="local-sgd",
        workers=2,
        max_samples=256,
        sync_every=4,
        out=str(tmp_path / "run"),
        quiet=True,
    )
    text = (tmp_path / "run" / "config.toml").read_text()
    assert "sync_every = 4" in text and "warmup_steps = 0" in text and 'compress = "none"' in text


def test_an_unknown_algorithm_is_one_error() -> None:
    import distsgd

    with pytest.raises(ConfigError, match="unknown algorithm 'sgd9000'"):
        distsgd.train(model="mlp", data="digits", algo="sgd9000", quiet=True)


def test_settle_resolves_every_setting_once() -> None:
    """After settle no setting whose default is settled with the run is None: the user's value,
    else the model's, else the algorithm's (diloco: its paper's weight decay), else the field's."""
    from distsgd.api import settle

    cfg, _ = settle(RunConfig(algo="diloco", workers=2, lr=0.2), torchrun=False)
    assert [name for name in config.SETTLED if getattr(cfg, name) is None] == []
    assert (cfg.lr, cfg.optimizer, cfg.weight_decay, cfg.clip_grad_norm) == (0.2, "adamw", 0.1, 0.0)  # what it steps
    gpt, _ = settle(RunConfig(model="gpt"), torchrun=False)
    assert (gpt.dataset, gpt.optimizer, gpt.weight_decay_on) == ("python-stdlib", "adamw", "weights")
    assert config.resolve(RunConfig()).lr == 0.01 and RunConfig().lr is None  # unset until settled


def test_an_optimizer_diloco_would_ignore_is_refused() -> None:
    """`--algo diloco --optimizer sgd` trained AdamW (its inner optimiser) at SGD's lr, silently: on
    Fashion-MNIST 0.40 where the same script's SGD scored 0.75 (benchmarks/converted.py)."""
    from distsgd.api import settle

    for algo in ("diloco", "streaming-diloco"):
        with pytest.raises(ConfigError, match="use --inner-optimizer sgd, not --optimizer sgd"):
            settle(RunConfig(algo=algo, workers=2, optimizer="sgd"), torchrun=False)
        cfg, _ = settle(
            RunConfig(algo=algo, workers=2, optimizer="sgd", options={"inner_optimizer": "sgd"}), torchrun=False
        )
        assert cfg.optimizer == "sgd" and cfg.weight_decay == 0.0
