"""local-sgd against torch's own model averaging (PeriodicModelAverager), with two workers; and its
runs."""

from __future__ import annotations

import pytest
import torch

import distsgd
from distsgd.train.context import Start
from helpers import flat_params, in_group
from quadratics import config, context, far, flat, model_and_grad, take_step

# -- local SGD against torch's PeriodicModelAverager -------------------------------------------


def _local_sgd_pair(rank: int, world: int, steps: int, every: int, warmup: int) -> dict:
    """Our local-sgd, and the same training with torch.distributed.algorithms.model_averaging."""
    import torch.distributed as dist
    from torch.distributed.algorithms.model_averaging.averagers import PeriodicModelAverager

    from distsgd.algorithms.local_sgd import LocalSGD

    cfg = config("local-sgd", world, {"sync_every": every, "warmup_steps": warmup}, lr=0.1, momentum=0.5)
    ours, set_ours = model_and_grad(rank)
    algo = LocalSGD(cfg)
    ctx = context(rank, world)
    ours = algo.setup(ctx, ours, Start.FRESH)
    opt = torch.optim.SGD(ours.parameters(), lr=0.1, momentum=0.5)
    theirs, set_theirs = model_and_grad(rank)
    topt = torch.optim.SGD(theirs.parameters(), lr=0.1, momentum=0.5)
    # torch averages after the step whose 0-based index i has i >= warmup_steps and (i - warmup_steps)
    # % period == 0; ours after step s (1-based) with s > K and (s - K) % H == 0: the same steps for
    # warmup_steps = K + H - 1. Before that, post-local SGD all-reduces the gradients (torch:
    # post_localSGD_hook's allreduce until start_localSGD_iter = K).
    averager = PeriodicModelAverager(period=every, warmup_steps=warmup + every - 1)
    for step in range(steps):
        take_step(algo, ctx, ours, opt, set_ours, step + 1)
        set_theirs()
        if step < warmup:
            for p in theirs.parameters():
                dist.all_reduce(p.grad)
                p.grad /= world
        topt.step()
        averager.average_parameters(theirs.parameters())
    return {"ours": flat(ours), "theirs": flat(theirs), "final": flat(algo.finish(ctx, ours))}


@pytest.mark.parametrize("steps, every, warmup", [(13, 3, 0), (14, 4, 5)])
def test_local_sgd_takes_the_steps_of_torchs_periodic_model_averager(
    tmp_path, steps: int, every: int, warmup: int
) -> None:
    """In the middle of a period the two agree (momentum local to each worker, as in both); a
    wrong phase (torch's warmup_steps = K, which averages right after the first local step) would
    not."""
    got = in_group(_local_sgd_pair, 2, tmp_path, steps, every, warmup)
    for r in range(2):
        torch.testing.assert_close(got[r]["ours"], got[r]["theirs"], rtol=1e-6, atol=1e-7)
    assert far(got[0]["ours"], got[1]["ours"])  # mid-period: the workers differ
    torch.testing.assert_close(got[0]["final"], got[1]["final"])  # the last partial period is averaged
    wrong = in_group(_local_sgd_wrong_phase, 2, tmp_path, steps, every, warmup)
    assert far(got[0]["ours"], wrong[0])


def _local_sgd_wrong_phase(rank: int, world: int, steps: int, every: int, warmup: int) -> torch.Tensor:
    import torch.distributed as dist
    from torch.distributed.algorithms.model_averaging.averagers import PeriodicModelAverager

    theirs, set_theirs = model_and_grad(rank)
    topt = torch.optim.SGD(theirs.parameters(), lr=0.1, momentum=0.5)
    averager = PeriodicModelAverager(period=every, warmup_steps=warmup)
    for step in range(steps):
        set_theirs()
        if step < warmup:
            for p in theirs.parameters():
                dist.all_reduce(p.grad)
                p.grad /= world
        topt.step()
        averager.average_parameters(theirs.parameters())
    return flat(theirs)


def test_local_sgd_every_step_equals_allreduce_without_momentum(digits) -> None:
    common = dict(
        model="mlp", data=digits, workers=2, batch_size=16, max_samples=640, lr=0.1, momentum=0.0, seed=2, quiet=True
    )
    ar = distsgd.train(algo="allreduce", **common)
    local = distsgd.train(algo="local-sgd", sync_every="1", **common)
    a, b = flat_params(ar.model), flat_params(local.model)
    assert float((a - b).norm() / a.norm()) < 1e-5


def test_local_sgd_h8_sends_an_eighth_of_allreduce(digits) -> None:
    common = dict(model="mlp", data=digits, workers=2, batch_size=16, epochs=2, lr=0.05, quiet=True)
    ar = distsgd.train(algo="allreduce", **common).summary
    local = distsgd.train(algo="local-sgd", sync_every="8", **common).summary
    steps = 2 * -(-718 // 16)  # 90 steps per worker
    assert local["samples"] == ar["samples"]
    assert local["averagings"] == -(-steps // 8)  # every 8 steps, the last (partial) period at the end
    model = distsgd.models.build_model("mlp", (1, 8, 8), 10).parameters()
    per_model = sum(p.numel() * p.element_size() for p in model)  # (allreduce's steps: this and a flag a parameter)
    assert local["bytes_sent_per_worker"] == [local["averagings"] * per_model] * 2  # one model each time
    assert local["bytes_sent_per_sample"] <= ar["bytes_sent_per_sample"] / 8 * (1 + 8 / steps)


@pytest.mark.parametrize("extra", [{"sync_every": "epoch"}, {"sync_every": "4", "warmup_steps": 10}])
def test_learns_digits(digits, extra: dict) -> None:
    s = distsgd.train(
        model="mlp", data=digits, algo="local-sgd", workers=2, epochs=5, lr=0.05, quiet=True, **extra
    ).summary
    assert s["final_test_accuracy"] >= 0.8, s["final_test_accuracy"]
    assert s["bytes_sent"] > 0 and s["samples"] >= 5 * 1436


def test_bad_settings() -> None:
    with pytest.raises(distsgd.ConfigError, match="--sync-every"):
        distsgd.train(model="mlp", data="digits", algo="local-sgd", workers=2, sync_every="sometimes", quiet=True)
