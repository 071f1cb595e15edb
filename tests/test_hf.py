"""Hugging Face models and datasets: a tiny ``transformers`` GPT-2 built from a config (random
weights, nothing downloaded) and a tokenised ``datasets.Dataset``, trained by 2 workers under
allreduce, Hogwild! and the asynchronous parameter server; ``hf:PATH`` folders of every kind."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch

import distsgd
from distsgd.data import load_dataset, text
from distsgd.errors import DataError
from distsgd.train.evaluate import evaluate
from distsgd.train.objective import loss_function

transformers = pytest.importorskip("transformers")
datasets = pytest.importorskip("datasets")


def tiny_gpt2(num_classes: int, input_shape: tuple[int, ...]) -> torch.nn.Module:
    """GPT-2's architecture at a toy size, from a config: its forward returns an output object
    whose .logits are the scores."""
    cfg = transformers.GPT2Config(
        vocab_size=num_classes,
        n_positions=input_shape[0],
        n_embd=32,
        n_layer=1,
        n_head=2,
        bos_token_id=0,
        eos_token_id=0,
    )
    return transformers.GPT2LMHeadModel(cfg)


@pytest.fixture(scope="module")
def tokenised() -> object:
    """Lines of Python source as rows of byte token ids (variable lengths), as a tokeniser's
    ``map`` leaves them."""
    lines = text.stdlib_text(1 << 16).decode("utf-8", "replace").splitlines(keepends=True)
    rows = [list(line.encode()) for line in lines if line.strip()]
    return datasets.Dataset.from_dict({"input_ids": rows})


@pytest.mark.slow
@pytest.mark.parametrize("algo", ["allreduce", "hogwild", "asgd"])
def test_a_transformers_gpt2_trains_on_a_tokenised_dataset(tmp_path: Path, tokenised: object, algo: str) -> None:
    res = distsgd.train(
        model=tiny_gpt2,
        data=tokenised,
        algo=algo,
        workers=2,
        context=32,
        batch_size=16,
        max_samples=768,
        eval_every=384,
        optimizer="adamw",
        lr=0.003,
        lr_warmup_steps=4,
        clip_grad_norm=1.0,
        out=str(tmp_path / "run"),
        quiet=True,
    )
    s = res.summary
    assert s["task"] == "lm" and s["vocab"] == max(max(r) for r in tokenised["input_ids"]) + 1  # the largest id + 1
    assert s["final_test_loss"] < math.log(256) - 1.0, s["final_test_loss"]
    # the model returned (and saved) is the one the figures describe
    data = distsgd.api._dataset_from(tokenised, 32)
    acc, loss = evaluate(res.model, data, 1000, loss_function("auto", None, "lm"))
    assert loss == pytest.approx(s["final_test_loss"], abs=1e-5) and acc == pytest.approx(s["final_test_accuracy"])
    saved = torch.load(tmp_path / "run" / "model.pt", weights_only=True)["state_dict"]
    assert torch.equal(saved["transformer.wte.weight"], res.model.state_dict()["transformer.wte.weight"])


def test_hf_folders_of_every_kind(tmp_path: Path, tokenised: object) -> None:
    saved = tmp_path / "saved"
    tokenised.save_to_disk(str(saved))
    a = load_dataset(f"hf:{saved}", context=32)
    parquet = tmp_path / "parquet"
    parquet.mkdir()
    tokenised.to_parquet(str(parquet / "part-0.parquet"))
    b = load_dataset(f"hf:{parquet}", context=32)
    assert a.task == b.task == "lm" and torch.equal(a.x_train, b.x_train) and a.num_classes <= 256
    jsonl = tmp_path / "docs.jsonl"
    jsonl.write_text('{"text": "def f(x):\\n    return x"}\n' * 200)
    c = load_dataset(f"hf:{jsonl}", context=16)
    assert c.num_classes == 256 and bytes(c.x_train[0].tolist()).startswith(b"def f(x):")
    splits = datasets.DatasetDict(train=tokenised.select(range(400)), test=tokenised.select(range(400, 500)))
    d = distsgd.api._dataset_from(splits, 16)
    assert d.n_test > 0 and d.n_train > d.n_test
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(DataError, match="parquet, arrow or jsonl"):
        load_dataset(f"hf:{empty}", context=16)
    wrong = datasets.Dataset.from_dict({"label": [1, 2]})
    with pytest.raises(DataError, match="input_ids"):
        distsgd.api._dataset_from(wrong, 16)


def test_without_the_datasets_package_one_clear_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "datasets", None)  # import datasets now fails
    with pytest.raises(DataError, match=r"pip install 'distsgd\[hf\]'"):
        load_dataset(f"hf:{tmp_path}", context=16)


@pytest.mark.slow
def test_a_pair_of_datasets_is_the_train_and_test_splits(tokenised: object) -> None:
    """``data=(train_ds, test_ds)``, two ``datasets.Dataset`` objects, as a user holding two splits
    passes them (it stopped with "a Dataset item must be (input, target); item 0 is dict")."""
    n = len(tokenised)
    train_ds, test_ds = tokenised.select(range(n * 9 // 10)), tokenised.select(range(n * 9 // 10, n))
    s = distsgd.train(
        model=tiny_gpt2,
        data=(train_ds, test_ds),
        context=32,
        batch_size=16,
        max_samples=256,
        optimizer="adamw",
        lr=0.003,
        quiet=True,
    ).summary
    splits = distsgd.api._dataset_from(datasets.DatasetDict({"train": train_ds, "test": test_ds}), 32)
    pair = distsgd.api._dataset_from((train_ds, test_ds), 32)
    assert s["task"] == "lm" and s["samples"] >= 256
    assert torch.equal(pair.x_test, splits.x_test) and torch.equal(pair.x_train, splits.x_train)


def test_dict_items_are_refused_in_one_line_that_says_what_to_do() -> None:
    class Dicts(torch.utils.data.Dataset):
        def __len__(self) -> int:
            return 8

        def __getitem__(self, i: int) -> dict:
            return {"input_ids": torch.zeros(4, dtype=torch.long), "labels": torch.zeros(4, dtype=torch.long)}

    with pytest.raises(distsgd.DataError, match=r"is a dict \(keys input_ids, labels\).*distsgd.spawn"):
        distsgd.train(model="mlp", data=(Dicts(), Dicts()), quiet=True)


@pytest.mark.slow
def test_a_transformers_model_saved_as_hf_is_what_from_pretrained_scores(tmp_path: Path) -> None:
    """--save-format hf: the run's model as its own save_pretrained folder; from_pretrained of it
    scores on the held-out text the test loss the run reported (examples/hf_diloco.py's loop and
    evaluation, 2 workers under allreduce)."""
    transformers = pytest.importorskip("transformers")
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))
    import hf_diloco

    out = tmp_path / "run"
    result = distsgd.spawn(
        hf_diloco.main,
        model=hf_diloco.tiny_gpt2,
        algo="allreduce",
        workers=2,
        optimizer="adamw",
        lr=1e-3,
        max_samples=256,
        train_size=hf_diloco.TRAIN_BYTES // hf_diloco.CONTEXT,
        out=str(out),
        save_format="pt,hf",
        quiet=True,
    )
    assert (out / "hf" / "config.json").is_file() and (out / "model.pt").is_file()
    loaded = transformers.GPT2LMHeadModel.from_pretrained(out / "hf")
    _, test_set = hf_diloco.corpus()
    assert hf_diloco.test_loss(loaded, test_set) == pytest.approx(result.summary["final_test_loss"], abs=1e-6)
    assert all(torch.equal(v, loaded.state_dict()[k]) for k, v in result.model.state_dict().items())


def test_hf_format_of_a_model_without_save_pretrained_is_one_line(tmp_path: Path) -> None:
    with pytest.raises(distsgd.ConfigError, match="has no save_pretrained: save it as pt or safetensors"):
        distsgd.train(model="mlp", data="digits", out=str(tmp_path / "run"), save_format="hf", quiet=True)
    assert not (tmp_path / "run").exists()
