"""streaming-diloco against its paper (Douillard et al. 2025, "Streaming DiLoCo with overlapping
communication"), in float64, with two workers; against DiLoCo when it has one fragment, no overlap
and no merge; and its runs: reported = saved, exact resume with a fragment in flight, the peak
transfer divided by the fragments, quantised outer gradients.

The rule, as the module states it: fragment p of P (a contiguous 1/P slice of the flat parameters)
sends at steps t = (p + 1) H / P - tau + k H its pseudo-gradient Delta_p = theta_p - x_p, averaged
over the workers; tau steps later theta_p <- Nesterov-SGD_p(theta_p, mean Delta_p) and the worker
merges x_p <- alpha x_p + (1 - alpha) theta_p. At the end the fragment in flight lands and every
fragment with steps since its send ends as --partial-round says (average: the workers' values
averaged; step: a last outer step; theta: its global values kept); the global model is returned.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import distsgd
from distsgd.train.context import Start
from helpers import in_group
from quadratics import config, context, far, flat, model_and_grad, quadratic, start_weights, take_step

INNER_LR, OUTER_LR, OUTER_MU = 0.05, 0.7, 0.9


def _worker(rank: int, world: int, algo: str, options: dict, steps: int) -> dict:
    from distsgd.algorithms import registry

    cfg = config(
        algo,
        world,
        {"outer_lr": OUTER_LR, "outer_momentum": OUTER_MU, "inner_optimizer": "sgd", **options},
        lr=INNER_LR,
        momentum=0.0,
    )
    model, set_grad = model_and_grad(rank)
    algo_obj = registry.get(algo)(cfg)
    ctx = context(rank, world)
    model = algo_obj.setup(ctx, model, Start.FRESH)
    opt = algo_obj.make_optimizer(ctx, model)
    seen = []
    for number in range(1, steps + 1):
        take_step(algo_obj, ctx, model, opt, set_grad, number)
        seen.append(flat(model))
    evaluated = flat(algo_obj.evaluation_model(ctx, model))  # what an evaluation now measures
    final = algo_obj.finish(ctx, model)
    return {"locals": seen, "final": flat(final), "evaluated": evaluated, "figures": vars(algo_obj.figures())}


def reference(
    world: int, steps: int, h: int, p: int, tau: int, alpha: float, wrong: str = "", rule: str = "average"
) -> dict:
    """The paper's Algorithm 2 in float64 with inner SGD: x_i (each worker's values), theta (the
    global values, per fragment), one Nesterov momentum per fragment (PyTorch's form: b <- mu b +
    Delta, theta <- theta - lr (Delta + mu b)). ``wrong``: "late" takes Delta when the average is
    used instead of when it is sent; "swap" merges with alpha and 1 - alpha exchanged; "shared"
    gives all fragments one momentum. ``rule``: how a fragment with steps since its send ends."""
    w0 = start_weights()
    n = w0.numel()
    bounds = [(n * i // p, n * (i + 1) // p) for i in range(p)]
    quads = [quadratic(r) for r in range(world)]
    xs = [w0.clone() for _ in range(world)]
    theta = w0.clone()
    bufs: dict[int, torch.Tensor] = {}
    flights: list[tuple[int, int, torch.Tensor]] = []  # (fragment, lands, mean delta)
    last_send = [0] * p
    seen = []

    def outer(q: int, delta: torch.Tensor) -> None:
        a, b = bounds[q]
        if wrong == "shared":  # one momentum for the whole model, decayed at every fragment's step
            whole = bufs.get(-1, torch.zeros_like(w0))
            whole = OUTER_MU * whole
            whole[a:b] += delta
            bufs[-1] = whole
            buf = whole[a:b]
        else:
            prev = bufs.get(q)
            buf = delta if prev is None else OUTER_MU * prev + delta
            bufs[q] = buf
        theta[a:b] = theta[a:b] - OUTER_LR * (delta + OUTER_MU * buf)

    def land(q: int, mean: torch.Tensor) -> None:
        a, b = bounds[q]
        if wrong == "late":
            mean = sum(theta[a:b] - x[a:b] for x in xs) / world
        outer(q, mean)
        keep = 1 - alpha if wrong == "swap" else alpha
        for x in xs:
            x[a:b] = keep * x[a:b] + (1 - keep) * theta[a:b]

    for t in range(1, steps + 1):
        for i, (a_, b_) in enumerate(quads):
            xs[i] = xs[i] - INNER_LR * a_ * (xs[i] - b_)
        for flight in [f for f in flights if f[1] == t]:
            flights.remove(flight)
            land(flight[0], flight[2])
        for q in range(p):
            first = (q + 1) * h // p - tau
            if t >= first and (t - first) % h == 0:
                a, b = bounds[q]
                mean = sum(theta[a:b] - x[a:b] for x in xs) / world
                last_send[q] = t
                if tau == 0:
                    land(q, mean)
                else:
                    flights.append((q, t + tau, mean))
        seen.append([x.clone() for x in xs])
    for flight in flights:
        land(flight[0], flight[2])
    for q in range(p):
        if last_send[q] < steps:
            a, b = bounds[q]
            if rule == "step":
                outer(q, sum(theta[a:b] - x[a:b] for x in xs) / world)
            elif rule == "average":
                theta[a:b] = sum(x[a:b] for x in xs) / world
    return {"locals": seen, "final": theta}


@pytest.mark.parametrize(
    "p, tau, alpha, rule",
    [(2, 1, 0.5, "average"), (3, 2, 0.0, "average"), (1, 1, 1.0, "average"), (2, 1, 0.5, "step"), (2, 1, 0.5, "theta")],
)
def test_two_workers_follow_the_paper(tmp_path, p: int, tau: int, alpha: float, rule: str) -> None:
    steps, h = 23, 6
    got = in_group(
        _worker,
        2,
        tmp_path,
        "streaming-diloco",
        {"sync_every": h, "fragments": p, "overlap": tau, "merge": alpha, "partial_round": rule},
        steps,
    )
    ref = reference(2, steps, h, p, tau, alpha, rule=rule)
    for r in range(2):
        for t in (4, 11, steps - 1):
            torch.testing.assert_close(got[r]["locals"][t], ref["locals"][t][r], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(got[r]["final"], ref["final"], rtol=1e-5, atol=1e-6)
        # an evaluation measures what would be returned there (made on copies): the same values
        torch.testing.assert_close(got[r]["evaluated"], got[r]["final"], rtol=0, atol=0)
    for wrong in ("late", "swap", "shared"):
        if (wrong == "late" and tau == 0) or (wrong == "swap" and alpha == 0.5) or (wrong == "shared" and p == 1):
            continue  # the same rule then
        assert far(got[0]["final"], reference(2, steps, h, p, tau, alpha, wrong, rule)["final"]), wrong
    if p == 2:  # (with one fragment, tau 1 and H 6, step 23 is a send: no fragment is cut short)
        for other in {"average", "step", "theta"} - {rule}:
            assert far(got[0]["final"], reference(2, steps, h, p, tau, alpha, rule=other)["final"]), other


def test_one_fragment_without_overlap_or_merge_is_diloco(tmp_path) -> None:
    steps, h = 17, 5
    stream = in_group(
        _worker, 2, tmp_path, "streaming-diloco", {"sync_every": h, "fragments": 1, "overlap": 0, "merge": 0.0}, steps
    )
    diloco = in_group(_worker, 2, tmp_path, "diloco", {"sync_every": h}, steps)
    for r in range(2):
        for a, b in zip(stream[r]["locals"], diloco[r]["locals"]):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(stream[r]["final"], diloco[r]["final"], rtol=1e-6, atol=1e-7)
    assert stream[0]["figures"]["bytes_sent"] == diloco[0]["figures"]["bytes_sent"]


def test_the_peak_transfer_is_a_fragment_and_fp16_halves_the_bytes(digits) -> None:
    common = dict(model="mlp", data=digits, workers=2, epochs=2, batch_size=16, lr=0.003, sync_every="12", quiet=True)
    diloco = distsgd.train(algo="diloco", **common).summary
    four = distsgd.train(algo="streaming-diloco", fragments=4, overlap=2, **common).summary
    half = distsgd.train(algo="streaming-diloco", fragments=4, overlap=2, outer_dtype="fp16", **common).summary
    for s in (diloco, four, half):
        assert s["final_test_accuracy"] > 0.6, s
    # about the same bytes (plus each fragment's last step at the end), a quarter of the peak
    assert four["largest_transfer_bytes"] <= diloco["largest_transfer_bytes"] / 4 + 64
    assert 0.9 < four["bytes_sent"] / diloco["bytes_sent"] < 1.4
    assert half["bytes_sent"] < 0.6 * four["bytes_sent"]  # fp16: half, but the buffers' float32 (none here)
    assert four["fragments"] == 4 and four["outer_steps"] >= 4 * (2 * 45 // 12)


def test_reported_is_saved_and_resume_is_exact_with_a_fragment_in_flight(tmp_path: Path, digits) -> None:
    """Checkpoints every 96 samples (3 steps of 2 x 16): with H = 8, P = 2, tau = 2 a fragment is
    often in flight then; the resumed run must end with the uninterrupted one's weights."""
    common = dict(
        model="mlp",
        data="digits",
        algo="streaming-diloco",
        workers=2,
        batch_size=16,
        lr=0.003,
        sync_every="8",
        fragments=2,
        overlap=2,
        quiet=True,
    )
    full = distsgd.train(max_samples=1440, out=str(tmp_path / "full"), **common)
    distsgd.train(max_samples=800, checkpoint_every="96", out=str(tmp_path / "part"), **common)
    resumed = distsgd.train(resume=str(tmp_path / "part"), max_samples=1440)
    a = torch.cat([p.detach().reshape(-1) for p in full.model.parameters()])
    b = torch.cat([p.detach().reshape(-1) for p in resumed.model.parameters()])
    assert torch.equal(a, b)
    from distsgd.api import evaluate_checkpoint

    for run, s in ((tmp_path / "full", full.summary), (tmp_path / "part", resumed.summary)):
        saved = evaluate_checkpoint(run / "model.pt")
        assert s["final_test_accuracy"] == pytest.approx(saved["test_accuracy"], abs=1e-6)
        assert json.loads((run / "summary.json").read_text())["final_test_loss"] == pytest.approx(
            saved["test_loss"], abs=1e-6
        )


def test_bad_settings() -> None:
    for settings, message in (
        ({"sync_every": "epoch"}, "give --sync-every a number"),
        ({"fragments": 0}, "--fragments must be between 1"),
        ({"sync_every": "8", "fragments": 2, "overlap": 4}, "--overlap must be"),
        ({"merge": 1.5}, r"--merge must be in \[0, 1\]"),
        ({"outer_dtype": "int8"}, "--outer-dtype must be one of"),
    ):
        with pytest.raises(distsgd.ConfigError, match=message):
            distsgd.train(model="mlp", data="digits", algo="streaming-diloco", workers=2, quiet=True, **settings)


def _evaluating_worker(rank: int, world: int, steps: int, evaluate_at: tuple[int, ...]) -> torch.Tensor:
    """As ``_worker``, with torch's foreach SGD, which PyTorch picks for CUDA tensors (its Nesterov
    step adds the momentum into the gradient in place), evaluating after the steps ``evaluate_at``."""
    import functools

    from distsgd.algorithms import registry

    torch.optim.SGD = functools.partial(torch.optim.SGD, foreach=True)  # type: ignore[misc]
    cfg = config(
        "streaming-diloco",
        world,
        {
            "outer_lr": OUTER_LR,
            "outer_momentum": OUTER_MU,
            "inner_optimizer": "sgd",
            "sync_every": 6,
            "fragments": 2,
            "overlap": 2,
        },
        lr=INNER_LR,
        momentum=0.0,
    )
    model, set_grad = model_and_grad(rank)
    algo_obj = registry.get("streaming-diloco")(cfg)
    ctx = context(rank, world)
    model = algo_obj.setup(ctx, model, Start.FRESH)
    opt = algo_obj.make_optimizer(ctx, model)
    for number in range(1, steps + 1):
        take_step(algo_obj, ctx, model, opt, set_grad, number)
        if number in evaluate_at:
            assert algo_obj.flight is not None  # an outer gradient in flight: evaluated from its average
            algo_obj.evaluation_model(ctx, model)
    return flat(algo_obj.finish(ctx, model))


def test_an_evaluation_with_a_fragment_in_flight_leaves_its_average_alone(tmp_path) -> None:
    """On a GPU an evaluation in flight corrupted the run: the outer step made on the evaluation's
    copies was given the flight's average itself as its gradient, and CUDA's foreach SGD adds the
    momentum into a gradient in place, so the real outer step then used that sum (the first GPU
    run: a resumed run ended at test loss 1.3432 against 1.2026, as their evaluations fell at
    other steps). With foreach SGD on the CPU, evaluating changes nothing of the run."""
    plain = in_group(_evaluating_worker, 2, tmp_path, 10, ())
    evaluated = in_group(_evaluating_worker, 2, tmp_path, 10, (2, 8))
    for r in range(2):
        torch.testing.assert_close(evaluated[r], plain[r], rtol=0, atol=0)
