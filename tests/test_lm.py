"""Language models: the GPT, token data, the per-token objective and its figures, warm-up,
gradient clipping and AdamW's decay groups.

References: GPT-2's architecture as Hugging Face's port of OpenAI's code computes it (the same
weights must give the same scores), the causal mask's definition (a position never sees a later
one), the cross-entropy's definition computed by hand in float64, and the entropy of a
distribution of counts.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import distsgd
from distsgd.api import evaluate_checkpoint
from distsgd.config import RunConfig
from distsgd.data import load_dataset, text
from distsgd.errors import ConfigError, DataError, ModelError
from distsgd.models import GPT, build_model, check_fits
from distsgd.train.evaluate import evaluate
from distsgd.train.objective import loss_function
from distsgd.train.optim import build_optimizer, schedule_lr, warmup_factor
from helpers import cli_here

TINY = "gpt[layers=1,heads=2,width=32]"


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """64 KB of the standard library's sources as one text file."""
    path = tmp_path_factory.mktemp("text") / "corpus.txt"
    path.write_bytes(text.stdlib_text(1 << 16))
    return path


def test_gpt_sees_no_later_token() -> None:
    """Masked self-attention: the scores at position t depend on tokens 0..t only."""
    torch.manual_seed(0)
    model = GPT(vocab=50, context=16, layers=2, heads=2, width=32).eval()
    x = torch.randint(0, 50, (3, 16))
    changed = x.clone()
    changed[:, 9:] = torch.randint(0, 50, (3, 7))
    with torch.no_grad():
        a, b = model(x), model(changed)
    assert torch.allclose(a[:, :9], b[:, :9], atol=1e-6)
    assert not torch.allclose(a[:, 9:], b[:, 9:], atol=1e-3)


def test_gpt_counts_gpt2s_parameters() -> None:
    """GPT-2's parameters: V x W + T x W embeddings; per layer 12 W^2 + 13 W (attention 4 W^2 +
    4 W, MLP 8 W^2 + 5 W, two LayerNorms 4 W); a final LayerNorm 2 W; the output tied to the embedding."""
    v, t, layers, w = 256, 64, 3, 48
    model = build_model(f"gpt[layers={layers},heads=4,width={w}]", (t,), v)
    assert sum(p.numel() for p in model.parameters()) == v * w + t * w + layers * (12 * w * w + 13 * w) + 2 * w


def test_gpt_computes_what_gpt2_computes() -> None:
    """The same weights in Hugging Face's GPT-2 (a port of OpenAI's code) give the same scores."""
    transformers = pytest.importorskip("transformers")
    v, t, layers, heads, w = 64, 16, 2, 4, 32
    hf_cfg = transformers.GPT2Config(
        vocab_size=v,
        n_positions=t,
        n_embd=w,
        n_layer=layers,
        n_head=heads,
        activation_function="gelu",
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=0,
        eos_token_id=0,
    )
    torch.manual_seed(1)
    hf = transformers.GPT2LMHeadModel(hf_cfg).eval()
    ours = GPT(v, t, layers, heads, w).eval()
    sd = hf.state_dict()
    mine = {
        "tok.weight": sd["transformer.wte.weight"],
        "pos.weight": sd["transformer.wpe.weight"],
        "ln.weight": sd["transformer.ln_f.weight"],
        "ln.bias": sd["transformer.ln_f.bias"],
    }
    for i in range(layers):
        h = f"transformer.h.{i}."
        pairs = {"ln1": "ln_1", "ln2": "ln_2"}
        for a, b in pairs.items():
            mine[f"blocks.{i}.{a}.weight"], mine[f"blocks.{i}.{a}.bias"] = sd[h + b + ".weight"], sd[h + b + ".bias"]
        conv = {"attn.qkv": "attn.c_attn", "attn.proj": "attn.c_proj", "fc": "mlp.c_fc", "out": "mlp.c_proj"}
        for a, b in conv.items():  # GPT-2's Conv1D keeps its weight as (in, out)
            mine[f"blocks.{i}.{a}.weight"] = sd[h + b + ".weight"].t()
            mine[f"blocks.{i}.{a}.bias"] = sd[h + b + ".bias"]
    ours.load_state_dict(mine)
    x = torch.randint(0, v, (2, t))
    with torch.no_grad():
        assert torch.allclose(ours(x), hf(x).logits, atol=1e-4)


def test_gpt_size_options_are_checked() -> None:
    assert len(build_model("gpt[layers=1;width=16,heads=2]", (8,), 20).blocks) == 1
    for bad in (
        *"gpt[depth=2] gpt[layers=0] gpt[layers=x] gpt[width=30,heads=4] mlp[layers=2] gpt[dropout=1.5]".split(),
    ):
        with pytest.raises(ModelError):
            build_model(bad, (8,), 20)
    with pytest.raises(ModelError, match="token sequences"):
        build_model("gpt", (1, 28, 28), 10)
    model = build_model(TINY, (8,), 20)
    check_fits(model, (8,), 20, TINY, "text", "lm")
    with pytest.raises(ModelError, match="longer than the model's context|cannot take"):
        check_fits(model, (9,), 20, TINY, "text", "lm")


def test_text_becomes_next_token_sequences(corpus: Path, tmp_path: Path) -> None:
    ds = load_dataset(f"text:{corpus}", context=32)
    assert ds.task == "lm" and ds.num_classes == 256 and ds.input_shape == (32,)
    raw = torch.tensor(list(corpus.read_bytes() + b"\n"))  # a file is followed by a newline
    # every target is the next byte of the text; sequences follow each other without overlap
    assert torch.equal(ds.x_train.flatten()[1:], ds.y_train.flatten()[:-1])
    assert torch.equal(ds.x_train[0], raw[:32]) and torch.equal(ds.y_train[0], raw[1:33])
    # the test set is the last tenth of the text: no training sequence (nor its last target) reaches it
    cut = len(raw) - len(raw) // 10
    assert torch.equal(ds.x_test[0], raw[cut : cut + 32]) and torch.equal(
        ds.y_test[-1, -1:], raw[cut + ds.n_test * 32 :][:1]
    )
    assert ds.n_train * 32 + 1 <= cut and ds.n_test == (len(raw) - cut - 1) // 32
    folder = tmp_path / "docs"
    (folder / "sub").mkdir(parents=True)
    (folder / "b.txt").write_text("second " * 40)
    (folder / "a.txt").write_text("first " * 40)
    (folder / "sub" / "c.md").write_text("third " * 40)
    (folder / ".hidden").write_text("never")
    joined = text.read_text(folder)
    assert joined.startswith(b"first ") and b"never" not in joined and b"third" in joined
    for spec, match in ((f"text:{tmp_path / 'absent'}", "no such"), (f"text:{tmp_path / 'docs' / 'a.txt'}", "too few")):
        with pytest.raises(DataError, match=match):
            load_dataset(spec, context=256)


def test_token_cross_entropy_is_the_mean_over_every_token() -> None:
    torch.manual_seed(0)
    scores, target = torch.randn(3, 5, 7), torch.randint(0, 7, (3, 5))
    by_hand = -np.mean(
        [
            math.log(math.exp(scores[b, t, target[b, t]].double()) / float(scores[b, t].double().exp().sum()))
            for b in range(3)
            for t in range(5)
        ]
    )
    loss = loss_function("auto", None, "lm")
    assert float(loss(scores, target)) == pytest.approx(by_hand, rel=1e-6)

    class Out:  # a Hugging Face model's output: the scores are its .logits
        logits = scores

    assert float(loss(Out(), target)) == pytest.approx(by_hand, rel=1e-6)
    with pytest.raises(ConfigError):
        loss_function("mse", None, "lm")


def test_evaluation_of_a_language_model_is_per_token(corpus: Path) -> None:
    ds = load_dataset(f"text:{corpus}", context=16)
    model = build_model(TINY, (16,), 256, seed=0)
    acc, loss = evaluate(model, ds, 100, loss_function("auto", None, "lm"))
    with torch.no_grad():
        scores = model(ds.x_test).double()
    expect = F.cross_entropy(scores.reshape(-1, 256), ds.y_test.reshape(-1))
    assert loss == pytest.approx(float(expect), rel=1e-5)
    assert acc == pytest.approx(float((scores.argmax(-1) == ds.y_test).double().mean()), abs=1e-9)


def test_unigram_entropy() -> None:
    tokens = torch.tensor([0, 0, 1, 2, 2, 2])
    p = np.array([2, 1, 3]) / 6
    assert text.unigram_entropy(tokens, 5) == pytest.approx(float(-(p * np.log(p)).sum()))


def test_warmup_then_schedule() -> None:
    cfg = RunConfig(lr=0.1, lr_warmup_steps=4, schedule="cosine")
    assert [warmup_factor(cfg, s) for s in (1, 2, 4, 9)] == [0.25, 0.5, 1.0, 1.0]
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    opt.param_groups[0]["base_lr"] = 0.1
    schedule_lr(opt, cfg, 0.5, 1.0, step=2)  # half-way through the cosine, half-way through the warm-up
    assert opt.param_groups[0]["lr"] == pytest.approx(0.1 * 0.5 * 0.5)


def test_weight_decay_on_weights_not_biases_or_norms() -> None:
    model = build_model(TINY, (8,), 20)
    opt = build_optimizer(RunConfig(optimizer="adamw", lr=1e-3, weight_decay=0.1, weight_decay_on="weights"), model)
    decayed = {id(p) for g in opt.param_groups if g["weight_decay"] > 0 for p in g["params"]}
    for name, p in model.named_parameters():
        assert (id(p) in decayed) == (p.dim() >= 2), name
    assert sum(len(g["params"]) for g in opt.param_groups) == len(list(model.parameters()))
    every = build_optimizer(RunConfig(optimizer="adamw", lr=0.1, weight_decay=0.1), model)  # torch's default: all
    assert len(every.param_groups) == 1 and every.param_groups[0]["weight_decay"] == 0.1


def test_clipping_clips_the_synchronised_gradient(tmp_path: Path) -> None:
    """allreduce, 2 workers, one step each on its whole shard: the step is plain SGD on the mean
    gradient over all the data, scaled to norm c when it is longer (computed here in float64)."""
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(64, 6)).astype(np.float32), rng.integers(0, 3, 64)
    c, lr = 0.05, 0.5
    res = distsgd.train(
        model="logreg",
        data=(x, y, x[:8], y[:8]),
        algo="allreduce",
        workers=2,
        batch_size=32,
        max_samples=64,
        lr=lr,
        momentum=0.0,
        clip_grad_norm=c,
        quiet=True,
        partition="sharded",
    )
    start = build_model("logreg", (6,), 3, seed=0).double()
    from distsgd.data import from_arrays

    ds = from_arrays("arrays", x, y, x[:8], y[:8])
    loss = F.cross_entropy(start(ds.x_train.double()), ds.y_train)
    grads = torch.autograd.grad(loss, list(start.parameters()))
    norm = torch.sqrt(sum((g**2).sum() for g in grads))
    assert norm > c  # the clip acts
    expect = [p - lr * g * (c / norm) for p, g in zip(start.parameters(), grads)]
    for got, want in zip(res.model.parameters(), expect):
        assert torch.allclose(got.double(), want, atol=1e-5)


def test_settings_are_checked() -> None:
    for bad in ({"context": 0}, {"lr_warmup_steps": -1}, {"clip_grad_norm": -1.0}):
        with pytest.raises(ConfigError):
            distsgd.train(model=TINY, data="python-stdlib", quiet=True, max_samples=8, **bad)


@pytest.mark.slow
def test_gpt_trains_on_pythons_own_sources_and_eval_agrees(tmp_path: Path) -> None:
    """`distsgd train --model gpt` needs no dataset: Python's standard library as text. What it
    reports is what `distsgd eval` measures of model.pt."""
    run = tmp_path / "run"
    res = cli_here(
        "train",
        "--model",
        TINY,
        *"--context 32 --max-samples 512 --batch-size 32 --eval-every 256 --lr 0.003 --lr-warmup-steps 4".split(),
        *"--out".split(),
        str(run),
    )
    assert res.returncode == 0, res.stderr[-2000:]
    assert "perplexity" in res.stdout and "unigram entropy" in res.stdout
    s = json.loads((run / "summary.json").read_text())
    assert s["dataset"] == "python-stdlib" and s["task"] == "lm" and s["vocab"] == 256 and s["context"] == 32
    assert s["tokens"] == s["samples"] * 32
    assert s["final_test_perplexity"] == pytest.approx(math.exp(s["final_test_loss"]))
    assert s["final_test_bits_per_token"] == pytest.approx(s["final_test_loss"] / math.log(2))
    assert 2.0 < s["unigram_entropy"] < math.log(256)
    assert s["final_test_loss"] < math.log(256) - 1.0  # it learnt something in 16 steps
    cfg = (run / "config.toml").read_text()
    assert 'optimizer = "adamw"' in cfg and "clip_grad_norm = 1.0" in cfg and 'weight_decay_on = "weights"' in cfg
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert all("test_perplexity" in e for e in metrics if e["event"] == "eval")
    saved = evaluate_checkpoint(run / "model.pt")
    assert saved["test_loss"] == pytest.approx(s["final_test_loss"], abs=1e-6)
    assert saved["test_perplexity"] == pytest.approx(s["final_test_perplexity"], rel=1e-6)


@pytest.mark.slow
def test_bench_and_compare_show_a_language_models_loss_and_perplexity(tmp_path: Path) -> None:
    """compare's table names the target loss and shows loss and perplexity; its plots are of the
    test loss per token."""
    corpus = tmp_path / "c.txt"
    corpus.write_bytes(text.stdlib_text(1 << 15))
    runs = []
    for algo in ("single", "allreduce"):
        run = tmp_path / algo
        distsgd.train(
            model=TINY,
            data=f"text:{corpus}",
            algo=algo,
            workers=1 if algo == "single" else 2,
            context=32,
            batch_size=16,
            max_samples=256,
            eval_every=128,
            target_loss=5.0,
            lr=0.003,
            out=str(run),
            quiet=True,
        )
        runs.append(str(run))
    out = tmp_path / "cmp"
    res = cli_here("compare", *runs, "--out", str(out))
    assert res.returncode == 0, res.stderr
    table = (out / "compare.md").read_text()
    assert "time to loss 5 (s)" in table and "final perplexity" in table
    report = json.loads((out / "compare.json").read_text())
    assert report["rows"][0]["final_test_perplexity"]["median"] == pytest.approx(
        math.exp(report["rows"][0]["final_test_loss"]["median"])
    )
    assert {"loss_vs_time.png", "loss_vs_samples.png"} <= set(report["plots"])
