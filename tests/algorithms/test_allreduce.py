"""allreduce and ddp: two workers take the steps of one process with the global batch; the buckets."""

from __future__ import annotations

import pytest
import torch

import distsgd
from distsgd.algorithms.allreduce import make_buckets
from helpers import flat_params

pytest.importorskip("sklearn")

B = 16
STEPS = 20


@pytest.fixture(scope="module")
def single_reference(digits):
    result = distsgd.train(
        model="mlp",
        data=digits,
        algo="single",
        batch_size=2 * B,
        max_samples=STEPS * 2 * B,
        lr=0.1,
        momentum=0.9,
        seed=7,
        quiet=True,
    )
    assert result.summary["samples"] == STEPS * 2 * B
    return flat_params(result.model)


@pytest.mark.slow
@pytest.mark.parametrize("algo, bucket_mb", [("allreduce", 25.0), ("allreduce", 0.02), ("ddp", 25.0)])
def test_two_workers_equal_single_with_the_global_batch(digits, single_reference, algo, bucket_mb) -> None:
    result = distsgd.train(
        model="mlp",
        data=digits,
        algo=algo,
        workers=2,
        batch_size=B,
        max_samples=STEPS * 2 * B,
        lr=0.1,
        momentum=0.9,
        seed=7,
        bucket_mb=bucket_mb,
        quiet=True,
    )
    s = result.summary
    assert s["samples"] == STEPS * 2 * B and s["global_batch_size"] == 2 * B and s["workers"] == 2
    ours = flat_params(result.model)
    assert not torch.equal(ours, flat_params(distsgd.models.build_model("mlp", (1, 8, 8), 10, seed=7)))  # it trained
    rel = float((ours - single_reference).norm() / single_reference.norm())
    assert rel < 1e-5, rel
    assert (ours - single_reference).abs().max() < 1e-4
    per_worker = s["bytes_sent_per_worker"]
    n_params = ours.numel()
    # ours: and one flag a parameter tensor (which had a gradient on any worker)
    flags = len(list(result.model.parameters())) if algo == "allreduce" else 0
    assert (
        per_worker == [STEPS * (n_params + flags) * 4] * 2
    )  # ring all-reduce of 2 workers: 2(W-1)/W = 1x the gradient
    if algo == "allreduce":
        assert s["buckets"] == (1 if bucket_mb == 25.0 else 4)


def test_buckets_keep_order_and_cap() -> None:
    params = [torch.nn.Parameter(torch.zeros(n)) for n in (10, 300, 5, 5, 200)]
    buckets = make_buckets(params, cap_bytes=1200)
    assert [[p.numel() for p in b.params] for b in buckets] == [[10], [300], [5, 5, 200]]
    # each bucket's gradients, then one "has a gradient" flag per parameter
    assert [b.buffer.numel() for b in buckets] == [10 + 1, 300 + 1, 210 + 3]
    assert [b.flags.numel() for b in buckets] == [1, 1, 3]
    assert [p for b in buckets for p in b.params] == params
