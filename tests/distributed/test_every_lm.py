"""Every algorithm trains a language model: the built-in GPT on byte tokens, 2 workers, a short run.

What a user who brings a transformer needs to trust: every way of cooperating takes token
sequences of shape (B, T), trains on the per-token objective (its test loss falls well below the
untrained model's ln 256 and the corpus's unigram entropy is what it is compared with), and what
it reports is what ``distsgd eval`` measures of the model.pt it saved (loss and perplexity).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

import distsgd
from distsgd.algorithms import registry
from distsgd.api import evaluate_checkpoint
from distsgd.data import text

MODEL = "gpt[layers=1,heads=2,width=32]"
# Settings that make each algorithm do its work in a run of 24 steps a worker.
SETTINGS = {
    "ssp": {"staleness": 1},
    "local-sgd": {"sync_every": "5"},
    "easgd": {"tau": 4},
    "hogwild++": {"update_delay": 4},
    "diloco": {"sync_every": "6", "lr": 0.003, "outer_lr": 0.7},
    "streaming-diloco": {"sync_every": "6", "fragments": 2, "lr": 0.003, "outer_lr": 0.7},
    "dcasgd": {"lr": 0.05, "momentum": 0.9},  # SGD (its compensation is of SGD's gradients): 3.1-3.6 in 8 seeds
}
CASES = [(name, 1 if name == registry.baseline() else 2, SETTINGS.get(name, {})) for name in registry.names()]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = tmp_path_factory.mktemp("text") / "corpus.txt"
    path.write_bytes(text.stdlib_text(1 << 16))
    return f"text:{path}"


@pytest.mark.slow
@pytest.mark.parametrize("algo, workers, extra", CASES, ids=[c[0] for c in CASES])
def test_every_algorithm_trains_a_gpt(tmp_path: Path, corpus: str, algo: str, workers: int, extra: dict) -> None:
    run = tmp_path / "run"
    settings = {"lr": 0.003, "lr_warmup_steps": 4, **extra}
    s = distsgd.train(
        model=MODEL,
        data=corpus,
        algo=algo,
        workers=workers,
        context=32,
        batch_size=16,
        max_samples=768,
        eval_every=384,
        out=str(run),
        quiet=True,
        **settings,
    ).summary
    assert s["task"] == "lm" and s["tokens"] == s["samples"] * 32
    assert s["final_test_loss"] < math.log(256) - 1.0, s["final_test_loss"]
    saved = evaluate_checkpoint(run / "model.pt")
    assert s["final_test_loss"] == pytest.approx(saved["test_loss"], abs=1e-6)
    assert s["final_test_accuracy"] == pytest.approx(saved["test_accuracy"], abs=1e-6)
    assert s["final_test_perplexity"] == pytest.approx(saved["test_perplexity"], rel=1e-6)
    on_disk = json.loads((run / "summary.json").read_text())
    assert on_disk["final_test_perplexity"] == s["final_test_perplexity"]


@pytest.mark.slow
@pytest.mark.parametrize("algo", ["dcasgd", "diloco"])
def test_every_default_trains_the_gpt(algo: str) -> None:
    """`distsgd train --model gpt --algo A --workers 2` with nothing else set but the model's depth
    (width, for dcasgd: a smaller model for the suite's time) trains: the model's
    own settings (AdamW, lr 1e-3, warm-up, clipping) come before the algorithm's paper defaults
    (DiLoCo's inner lr 4e-4), and dcasgd's corrected gradient goes to that AdamW (with SGD at the
    model's lr it ended at 4.50 nats/token, above the unigram entropy)."""
    # one evaluation, at the end (eval_every = the run): the claim is about training's defaults.
    # dcasgd is asynchronous, its loss spread by the workers' interleaving: at 4,000 samples it
    # ended at 2.97-3.00 in five runs and once at 3.168, above the entropy (3.145); at 6,000,
    # 2.88-2.96 (2026-11-26). Its gpt is a smaller one (its own settings are the same: the defaults
    # are the name's): 2.89-2.97 in five runs at 6,000, 12 s against the default size's 107 s in
    # the suite (2026-11-27). DiLoCo's needs the default width (the smaller: 3.51 at 4,000); with 2
    # of the default 4 layers it ends where the default size did, 2.86 at 4,000 (3.13 at 3,000), in
    # 22 s against 59 s in the suite (2026-11-27, next session); with 1 layer, 2.947 at 4,000, and
    # 2.956-2.990 with seeds 1-3, in 19-24 s against 47 s for 2 layers on one core (2026-11-30).
    n, model = (6000, "gpt[layers=2,heads=2,width=64]") if algo == "dcasgd" else (4000, "gpt[layers=1]")
    s = distsgd.train(model=model, algo=algo, workers=2, max_samples=n, eval_every=n, quiet=True).summary
    assert s["final_test_loss"] < s["unigram_entropy"], (s["final_test_loss"], s["unigram_entropy"])
