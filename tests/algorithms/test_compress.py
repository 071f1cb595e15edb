"""Gradient compression (--compress): PowerSGD with error feedback, our compressors against torch's own
DDP hooks, and where the option applies."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import distsgd
from distsgd.algorithms import compress
from distsgd.data import load_dataset

pytest.importorskip("sklearn")


def test_powersgd_error_feedback_sends_later_what_it_did_not_send(group_of_one) -> None:
    """Vogels et al. 2019: with error feedback e, what a step leaves out is added to the next, so
    what K steps transmit sums to K G - e_K, and e stays bounded (it grows until the left-out
    directions dominate, and then they are sent): the relative shortfall shrinks as 1/K. A rank-1
    step alone misses most of a full-rank G."""
    torch.manual_seed(1)
    g = torch.randn(20, 30)
    c = compress.PowerSGD(rank=1)
    sent = torch.zeros_like(g)
    errors = []
    for step in range(compress.START_ITER + 400):
        grad = [g.clone()]
        c.allreduce_mean_(grad, 1)
        if step >= compress.START_ITER:  # the first steps are not compressed
            sent += grad[0]
            k = step - compress.START_ITER + 1
            torch.testing.assert_close(sent, k * g - c.error.view_as(g), rtol=1e-4, atol=1e-3)
            errors.append(float(c.error.norm() / g.norm()))
    assert max(errors[200:]) < 1.2 * max(errors[100:200])  # bounded, not growing with K
    assert float((400 * g - sent).norm() / (400 * g).norm()) < 0.05
    svd = torch.linalg.svd(g)
    best = svd.S[0] * torch.outer(svd.U[:, 0], svd.Vh[0])
    assert float((g - best).norm() / g.norm()) > 0.5  # without feedback, each step would miss that much


@pytest.mark.parametrize("rank", [1, 2, 4])
def test_powersgd_sends_zero_for_a_zero_gradient(group_of_one, rank: int) -> None:
    """An all-zero gradient matrix (a layer that got no gradient) is sent as zero, not NaN. With P
    = M Q = 0, Gram-Schmidt divided P's columns by their zero norms (Vogels et al. 2019, Alg. 1,
    orthogonalise P) and the NaN reached every worker's weights."""
    torch.manual_seed(2)
    c = compress.PowerSGD(rank=rank)
    for _ in range(compress.START_ITER + 3):
        grads = [torch.zeros(20, 30), torch.randn(20, 30)]
        c.allreduce_mean_(grads, 1)
        assert torch.equal(grads[0], torch.zeros(20, 30))
        assert bool(torch.isfinite(grads[1]).all())


STEPS = 20


@pytest.mark.parametrize("kind", ["powersgd:2", "powersgd:1", "fp16"])
def test_our_compression_takes_the_steps_of_torchs_ddp_hook(kind: str) -> None:
    """``allreduce --compress`` (ours) and ``ddp --compress`` (torch's fp16_compress_hook and
    powerSGD_hook, error feedback, warm start) on the same data end with the same weights."""
    digits = load_dataset("digits")
    # (20 steps: the two agree to rounding, 1e-7; PowerSGD's power iteration and momentum amplify
    # rounding differences, to 5e-5 after 40 steps.)
    common = dict(
        model="mlp",
        data=digits,
        workers=2,
        batch_size=16,
        max_samples=STEPS * 32,
        lr=0.1,
        momentum=0.9,
        seed=3,
        compress=kind,
        quiet=True,
    )
    ours = distsgd.train(algo="allreduce", **common)
    torchs = distsgd.train(algo="ddp", **common)
    a = torch.cat([p.detach().reshape(-1) for p in ours.model.parameters()])
    b = torch.cat([p.detach().reshape(-1) for p in torchs.model.parameters()])
    start = torch.cat(
        [p.detach().reshape(-1) for p in distsgd.models.build_model("mlp", (1, 8, 8), 10, seed=3).parameters()]
    )
    assert float((a - start).norm()) > 0.1  # it trained
    assert float((a - b).norm() / a.norm()) < 1e-5
    # ours also all-reduces one float32 flag per parameter each step (which had a gradient on any
    # worker; DDP's find_unused_parameters all-reduces such a map too), by 2 workers
    tensors = len(list(distsgd.models.build_model("mlp", (1, 8, 8), 10).parameters()))
    flags = STEPS * 4 * tensors * 2
    assert ours.summary["bytes_sent"] - flags == torchs.summary["bytes_sent"]
    plain = distsgd.train(algo="allreduce", **{**common, "compress": "none"}).summary["bytes_sent"] - flags
    steps_compressed = STEPS - compress.START_ITER
    if kind == "fp16":
        assert ours.summary["bytes_sent"] - flags == plain / 2
    else:  # all but the first steps send P and Q instead of the matrices
        assert ours.summary["bytes_sent"] - flags < plain * (compress.START_ITER + steps_compressed / 5) / STEPS


def test_ddp_powersgd_with_several_buckets_trains_and_resumes(tmp_path: Path) -> None:
    """torch 2.13's powerSGD_hook aborts on gloo with two or more DDP buckets (gloo::EnforceNotMet):
    on gloo, ddp --compress powersgd uses one bucket whatever --bucket-mb says. A resumed run
    starts with start_powerSGD_iter (2) uncompressed steps, as torch requires of a new DDP (its
    buckets are rebuilt after the first step): so it sends more than the uninterrupted run."""
    common = dict(
        model="mlp",
        data="digits",
        algo="ddp",
        workers=2,
        lr=0.05,
        checkpoint_every="300",
        quiet=True,
        compress="powersgd:1",
        bucket_mb=0.001,
        timeout_s=60,
    )
    full = distsgd.train(max_samples=1436, out=str(tmp_path / "full"), **common).summary
    distsgd.train(max_samples=718, out=str(tmp_path / "part"), **common)
    resumed = distsgd.train(resume=str(tmp_path / "part"), max_samples=1436).summary
    assert resumed["samples"] == full["samples"] == 1436
    assert resumed["final_test_accuracy"] > 0.2 and full["final_test_accuracy"] > 0.2  # it learnt (chance: 0.1)
    assert resumed["bytes_sent"] > full["bytes_sent"]


def test_compression_is_refused_where_it_does_not_apply() -> None:
    with pytest.raises(
        distsgd.ConfigError, match="--compress is an option of allreduce, ddp, local-sgd, diloco, not of hogwild"
    ):
        distsgd.train(model="mlp", data="digits", algo="hogwild", workers=2, compress="fp16", quiet=True)
    with pytest.raises(distsgd.ConfigError, match="--compress must be none, fp16 or powersgd"):
        distsgd.train(model="mlp", data="digits", algo="allreduce", workers=2, compress="zip", quiet=True)
    with pytest.raises(
        distsgd.ConfigError,
        match="allreduce --compress fp16 reduces every gradient at once, after "
        "backward, in no buckets: --bucket-mb does not apply",
    ):
        distsgd.train(model="mlp", data="digits", algo="allreduce", workers=2, compress="fp16", bucket_mb=5, quiet=True)


@pytest.mark.parametrize(
    "algo, options",
    [
        ("local-sgd", {"sync_every": 1, "compress": "powersgd:1"}),
        ("diloco", {"sync_every": 1, "compress": "powersgd:1"}),
        ("allreduce", {"compress": "powersgd:1"}),
        ("streaming-diloco", {"sync_every": 4, "fragments": 2, "overlap": 1}),  # stops with fragment 0 in flight
    ],
)
@pytest.mark.filterwarnings("ignore:.*to a meta parameter")  # Module.load_state_dict into the meta model
def test_resumed_state_follows_the_model_to_its_device(group_of_one, algo: str, options: dict) -> None:
    """A checkpoint is loaded on the CPU; every tensor of the algorithm's state (PowerSGD's error
    feedback and Q, local SGD's anchor, Streaming DiLoCo's average in flight) must then live where
    the model does (a GPU: here the meta device, which the CPU allows)."""
    from distsgd.algorithms import registry
    from distsgd.config import RunConfig, resolve
    from distsgd.train.context import Start, Step
    from quadratics import context

    cfg = resolve(RunConfig(algo=algo, workers=1, options=options))
    cls = registry.class_for(algo, cfg)
    ctx = context(0, 1)
    torch.manual_seed(0)
    model = torch.nn.Linear(30, 20)
    trained = cls(cfg)
    model = trained.setup(ctx, model, Start.FRESH)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for number in range(1, 6):
        for p in model.parameters():
            p.grad = torch.randn_like(p)
        step = Step(number=number, samples=number)
        trained.after_backward(ctx, model, step)
        trained.apply_step(ctx, opt, step)
        trained.after_step(ctx, model, step)
    saved = trained.state_dict()
    if algo == "streaming-diloco":
        assert saved["flight"] is not None
    if algo != "streaming-diloco":
        assert saved["compressor"]["error"] is not None and saved["compressor"]["qs"]

    resumed = cls(cfg)
    if algo == "allreduce":  # its setup broadcasts rank 0's weights, which the meta device cannot
        resumed.setup(ctx, torch.nn.Linear(30, 20), Start.RESUMED)
        resumed.params = [p.to("meta") for p in resumed.params]
    else:
        resumed.setup(ctx, torch.nn.Linear(30, 20, device="meta"), Start.RESUMED)
    resumed.load_state_dict(saved)

    def tensors(state: object) -> list[torch.Tensor]:
        if isinstance(state, torch.Tensor):
            return [state]
        if isinstance(state, dict):
            return [t for v in state.values() for t in tensors(v)]
        if isinstance(state, (list, tuple)):
            return [t for v in state for t in tensors(v)]
        return []

    floats = [t for t in tensors(resumed.state_dict()) if t.is_floating_point()]
    assert floats and all(t.device.type == "meta" for t in floats), [t.device for t in floats]


class BF16(compress.Compressor):
    """docs/ARCHITECTURE.md's "Adding a compressor": bfloat16 on the wire, as fp16 is."""

    def allreduce_mean_(self, tensors: list[torch.Tensor], world: int) -> int:
        from distsgd.algorithms.averaging import flatten, unflatten_into

        flat = flatten(tensors).to(torch.bfloat16).div_(world)
        if world > 1:
            torch.distributed.all_reduce(flat)
        unflatten_into(flat.to(tensors[0].dtype), tensors)
        return flat.numel() * flat.element_size()


def test_a_compressor_is_one_entry_of_the_table(monkeypatch: pytest.MonkeyPatch, group_of_one) -> None:
    """The walk-through in docs/ARCHITECTURE.md, kept true: one entry makes --compress take it,
    its errors name it, and make() builds it."""
    monkeypatch.setitem(compress.METHODS, "bf16", compress.Method(lambda _: BF16()))
    assert compress.parse("bf16") == ("bf16", 0)
    with pytest.raises(distsgd.ConfigError, match=r"must be none, fp16, powersgd\[:RANK\] or bf16, got 'bf16:2'"):
        compress.parse("bf16:2")
    tensors = [torch.ones(3, 4), torch.full((5,), 2.0)]
    sent = compress.make("bf16").allreduce_mean_(tensors, world=1)
    assert sent == 17 * 2 and torch.equal(tensors[1], torch.full((5,), 2.0))
