"""diloco's update rule against its paper (Douillard et al. 2023, Algorithm 1), in float64, with
two workers; and its runs."""

from __future__ import annotations

import json

import pytest
import torch

import distsgd
from distsgd.data import load_dataset
from distsgd.train.context import Start
from helpers import in_group, run_cli
from quadratics import config, context, far, flat, model_and_grad, quadratic, start_weights, take_step

# -- DiLoCo (Douillard et al. 2023) -------------------------------------------------------------

H, ROUNDS, TAIL = 3, 3, 2  # 3 full rounds of 3 inner steps, then a partial round of 2
INNER_LR, DECAY, OUTER_LR, OUTER_MU = 0.05, 0.1, 0.7, 0.9


def _diloco_worker(rank: int, world: int, rule: str) -> dict:
    from distsgd.algorithms.diloco import DiLoCo

    cfg = config(
        "diloco",
        world,
        {"sync_every": H, "outer_lr": OUTER_LR, "outer_momentum": OUTER_MU, "partial_round": rule},
        lr=INNER_LR,
        weight_decay=DECAY,
    )
    model, set_grad = model_and_grad(rank)
    algo = DiLoCo(cfg)
    ctx = context(rank, world)
    model = algo.setup(ctx, model, Start.FRESH)
    opt = algo.make_optimizer(ctx, model)
    thetas = []
    for step in range(1, H * ROUNDS + TAIL + 1):
        take_step(algo, ctx, model, opt, set_grad, step)
        if step % H == 0:
            thetas.append(flat(algo.global_model))
    evaluated = flat(algo.evaluation_model(ctx, model))  # inside the partial round, on copies
    final = algo.finish(ctx, model)
    return {
        "thetas": thetas,
        "final": flat(final),
        "evaluated": evaluated,
        "bytes": algo.bytes_sent,
        "rounds": algo.rounds,
    }


def adamw(state: dict, w: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """AdamW (Loshchilov and Hutter, ICLR 2019, Algorithm 2; Kingma and Ba's bias correction),
    beta 0.9 / 0.999, eps 1e-8: w <- w - lr (decay w + m^ / (sqrt(v^) + eps))."""
    state["t"] += 1
    state["m"] = 0.9 * state["m"] + 0.1 * g
    state["v"] = 0.999 * state["v"] + 0.001 * g * g
    m_hat, v_hat = state["m"] / (1 - 0.9 ** state["t"]), state["v"] / (1 - 0.999 ** state["t"])
    return w - INNER_LR * (DECAY * w + m_hat / (v_hat.sqrt() + 1e-8))


def diloco_reference(world: int, wrong: str = "", rule: str = "average") -> tuple[list[torch.Tensor], torch.Tensor]:
    """DiLoCo's Algorithm 1: each outer step t, every worker i starts from theta^(t-1), takes H
    inner AdamW steps (its AdamW state carried from round to round), reaching theta_i^(t); then
    Delta^(t) = (1/k) sum_i (theta^(t-1) - theta_i^(t)) and theta^(t) = OuterOpt(theta^(t-1),
    Delta^(t)), Nesterov momentum (Sutskever et al. 2013, in PyTorch's form: b <- mu b + Delta,
    theta <- theta - lr (Delta + mu b)). The paper has no partial round; the last one here (TAIL < H
    steps) ends as ``rule`` says: "average" (theta <- the mean of the theta_i), "step" (an outer
    step on it as on a full round) or "theta" (theta of the last full round, its steps dropped).
    ``wrong``: "sum" (no 1/k), "sign" (theta_i - theta), "average" (theta <- mean of theta_i,
    local SGD's rule), "reset" (a fresh AdamW every round)."""
    theta = start_weights()
    quads = [quadratic(r) for r in range(world)]
    states = [{"t": 0, "m": torch.zeros_like(theta), "v": torch.zeros_like(theta)} for _ in range(world)]
    buf, thetas = None, []
    for rnd, steps in enumerate([H] * ROUNDS + [TAIL]):
        partial = rnd == ROUNDS
        local = []
        for i, (a, b) in enumerate(quads):
            if wrong == "reset":
                states[i] = {"t": 0, "m": torch.zeros_like(theta), "v": torch.zeros_like(theta)}
            w = theta.clone()
            for _ in range(steps):
                w = adamw(states[i], w, a * (w - b))
            local.append(w)
        if partial and rule == "theta":
            continue
        if wrong == "average" or (partial and rule == "average"):
            theta = sum(local) / world
        else:
            delta = sum((lo - theta) if wrong == "sign" else (theta - lo) for lo in local) / (
                1 if wrong == "sum" else world
            )
            buf = delta if buf is None else OUTER_MU * buf + delta
            theta = theta - OUTER_LR * (delta + OUTER_MU * buf)
        thetas.append(theta)
    return thetas, theta


@pytest.mark.parametrize("rule", ["average", "step", "theta"])
def test_diloco_with_two_workers_follows_the_paper(tmp_path, rule: str) -> None:
    got = in_group(_diloco_worker, 2, tmp_path, rule)
    thetas, final = diloco_reference(2, rule=rule)
    for r in range(2):
        for a, b in zip(got[r]["thetas"], thetas[:ROUNDS]):  # full rounds: the paper's outer steps
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(got[r]["final"], final, rtol=1e-5, atol=1e-6)
        # an evaluation inside the partial round measures what would be returned there
        torch.testing.assert_close(got[r]["evaluated"], got[r]["final"], rtol=0, atol=0)
        assert got[r]["rounds"] == ROUNDS + (rule == "step")  # only full rounds are outer steps
    for wrong in ("sum", "sign", "average", "reset"):
        assert far(got[0]["final"], diloco_reference(2, wrong, rule)[1]), wrong
    for other in {"average", "step", "theta"} - {rule}:
        assert far(got[0]["final"], diloco_reference(2, rule=other)[1]), other


def test_diloco_learns_and_sends_a_fraction_of_allreduce() -> None:
    digits = load_dataset("digits")
    common = dict(model="mlp", data=digits, workers=2, epochs=6, batch_size=16, quiet=True)
    ar = distsgd.train(algo="allreduce", lr=0.05, **common).summary
    di = distsgd.train(algo="diloco", lr=0.003, sync_every="16", **common).summary
    assert di["final_test_accuracy"] > 0.85, di["final_test_accuracy"]
    steps = 6 * -(-718 // 16)
    assert di["outer_steps"] == steps // 16  # every 16 steps; the last, partial round is averaged
    assert di["bytes_sent_per_sample"] <= ar["bytes_sent_per_sample"] / 16 * (1 + 16 / steps)
    assert di["replica_max_abs_diff"] == 0.0


def test_the_clock_and_the_bytes_include_the_last_sync(digits) -> None:
    """The run's end is part of training: the partial round's average is inside train_wall_s (the
    final evaluation, of the returned model, is stamped with it) and in bytes_sent; the replica
    check after it (two float64 all-reduces of the state) is in eval_bytes_sent."""
    common = dict(
        model="mlp", data=digits, algo="diloco", workers=2, batch_size=16, lr=0.003, sync_every="8", quiet=True
    )
    full = distsgd.train(max_samples=2 * 16 * 16, **common).summary  # 16 steps a worker: 2 rounds
    cut = distsgd.train(max_samples=2 * 16 * 20, **common).summary  # 2 rounds and 4 steps, averaged
    for s in (full, cut):  # the last evaluation is of the returned model, measured at or before its end
        assert s["train_wall_s"] >= s["evals"][-1]["train_wall_s"]
    assert cut["outer_steps"] == full["outer_steps"] == 2
    assert cut["bytes_sent"] == pytest.approx(1.5 * full["bytes_sent"], rel=1e-3)
    state = sum(
        p.numel() for p in distsgd.models.build_model("mlp", digits.input_shape, digits.num_classes).parameters()
    )
    assert cut["eval_bytes_sent"] >= 2 * (2 * 8 * state)  # both workers' share of the two checks


@pytest.mark.slow
@pytest.mark.parametrize("algo", ["diloco", "streaming-diloco"])
def test_a_run_shorter_than_a_round_under_theta_says_its_model_is_the_initial_one(tmp_path, algo: str) -> None:
    """--partial-round theta drops the round cut short; a run that ends before its first outer step
    returned the model it started from, and said only "of the model returned, as it was at N
    samples" (8f65d93: no word). Now worker 0 says so in one warning; average keeps the steps (and
    says no outer step ran). (A
    subprocess: its workers' lines are what a user sees.)"""
    common = ["train", "--model", "mlp", "--dataset", "digits", "--algo", algo, "--workers", "2"]
    common += ["--batch-size", "16", "--sync-every", "64", "--max-samples", str(2 * 16 * 5)]
    r = run_cli(*common, "--partial-round", "theta", "--out", str(tmp_path / "theta"))
    assert r.returncode == 0 and r.stderr.count("trained on none of its samples") == 1, r.stderr[-3000:]
    # and the run's last line and summary.json say it too (until 2026-11-30: "of the model returned, as it
    # was at 128 samples: the 32 trained after never reached it", as though the 128 had)
    assert "(of the model returned: the one the run started from, which none of the 160 samples" in r.stdout
    assert json.loads((tmp_path / "theta" / "summary.json").read_text())["untrained"] is True
    model = torch.load(tmp_path / "theta" / "model.pt", weights_only=True)
    digits = load_dataset("digits")
    start = distsgd.models.build_model("mlp", digits.input_shape, digits.num_classes, seed=0).state_dict()
    assert all(torch.equal(model["state_dict"][k], v) for k, v in start.items())
    r = run_cli(*common, "--partial-round", "average", "--out", str(tmp_path / "average"))
    assert r.returncode == 0 and "trained on none" not in r.stderr, r.stderr[-3000:]
    # 5 steps of a round of 64: no outer step, the workers averaged once at the end, which worker 0
    # says (until 2026-12-01 nothing: the default diloco job, 469 steps against H = 500, an audit's)
    assert r.stderr.count("no outer step ran: the model returned is the workers' models averaged once") == 1, r.stderr
    assert "started from" not in r.stdout and "untrained" not in json.loads(
        (tmp_path / "average" / "summary.json").read_text()
    )
