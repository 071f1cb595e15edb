"""Configuration: TOML files, precedence, and one-line errors for impossible settings."""

from __future__ import annotations

from pathlib import Path

import pytest

from distsgd import config
from distsgd.config import RunConfig
from distsgd.errors import ConfigError


def test_toml_round_trip(tmp_path: Path) -> None:
    cfg = RunConfig(lr=0.05, epochs=3, dataset="digits", stop_at_target=True, target_accuracy=0.9,
                    extra={"note": "x"})
    path = tmp_path / "c.toml"
    path.write_text(config.to_toml(cfg))
    assert config.load_toml(path) == cfg


def test_train_table_and_dashes(tmp_path: Path) -> None:
    path = tmp_path / "c.toml"
    path.write_text('[train]\nbatch-size = 32\nlr = 1\n')
    cfg = config.load_toml(path)
    assert cfg.batch_size == 32 and cfg.lr == 1.0 and isinstance(cfg.lr, float)


@pytest.mark.parametrize("text, message", [
    ("batchsize = 8\n", r"unknown setting 'batchsize' .*did you mean 'batch_size'\?"),
    ("epochs = 'ten'\n", "'epochs' must be a whole number"),
    ("quiet = 1\n", "'quiet' must be true or false"),
    ("lr = [1]\n", "'lr' must be a number"),
    ("lr = \n", "not valid TOML"),
])
def test_bad_toml(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "c.toml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=message):
        config.load_toml(path)


def test_missing_config_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="config file not found"):
        config.load_toml(tmp_path / "none.toml")


@pytest.mark.parametrize("changes, message", [
    ({"workers": 0}, "--workers must be at least 1"),
    ({"batch_size": -4}, "--batch-size must be at least 1"),
    ({"lr": 0.0}, "--lr must be a positive number"),
    ({"momentum": 1.0}, r"--momentum must be in \[0, 1\)"),
    ({"optimizer": "lbfgs"}, "unknown optimizer 'lbfgs'"),
    ({"schedule": "linear"}, "unknown schedule"),
    ({"partition": "random"}, "unknown partition"),
    ({"stop_at_target": True}, "--stop-at-target needs --target-accuracy"),
    ({"target_accuracy": 85.0}, r"--target-accuracy must be in \(0, 1\]"),
    ({"algo": "sgd9000"}, "unknown algorithm 'sgd9000'"),
    ({"nesterov": True, "momentum": 0.0}, "--nesterov needs a --momentum"),
])
def test_validation(changes: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        config.validate(RunConfig(**changes))


def test_threads_per_worker_default() -> None:
    assert config.threads_per_worker(RunConfig(workers=1)) == max(1, config.cores())
    assert config.threads_per_worker(RunConfig(workers=64)) == 1
    assert config.threads_per_worker(RunConfig(threads_per_worker=3)) == 3
