"""Update rules of the averaging algorithms against hand-written float64 references."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from distsgd.algorithms.easgd import elastic_alpha, sync_elastic_step
from distsgd.algorithms.hogwildpp import holder_increment, ring_constants, token_pass
from distsgd.algorithms.averaging import flatten
from distsgd.algorithms.param_server import ParameterServer
from distsgd.config import RunConfig
from distsgd.errors import ConfigError


def vec(seed: int, n: int = 6) -> torch.Tensor:
    return torch.randn(n, generator=torch.Generator().manual_seed(seed))


def test_sync_easgd_step_single_worker() -> None:
    x, c = [vec(1), vec(2, 3)], [vec(3), vec(4, 3)]
    x64, c64 = [t.double() for t in x], [t.double() for t in c]
    sync_elastic_step(x, c, alpha=0.3, world=1)
    for xa, ca, xb, cb in zip(x, c, x64, c64):
        torch.testing.assert_close(xa.double(), xb - 0.3 * (xb - cb))
        torch.testing.assert_close(ca.double(), cb + 0.3 * (xb - cb))


def test_easgd_alpha_default_gives_beta_point_nine() -> None:
    assert elastic_alpha(RunConfig(), 4) * 4 == pytest.approx(0.9)
    assert elastic_alpha(RunConfig(alpha=0.1), 4) == 0.1


def test_async_easgd_server_exchange() -> None:
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    ps = ParameterServer(RunConfig(alpha=0.25), model, 2, "easgd", samples_per_epoch=100)
    c = flatten(list(model.parameters())).double()
    x = vec(7, 8)
    diff, version, total, stop = ps.exchange(1, x, torch.zeros(0, dtype=torch.int64), 64)
    torch.testing.assert_close(diff.double(), x.double() - c)
    torch.testing.assert_close(flatten(list(model.parameters())).double(), c + 0.25 * (x.double() - c))
    assert (version, total, stop) == (1, 64, False)
    # the worker then moves: x - alpha d
    torch.testing.assert_close((x - 0.25 * diff).double(), x.double() - 0.25 * (x.double() - c))


@pytest.mark.parametrize("n", [2, 3, 4])
def test_ring_constants(n: int) -> None:
    beta, lam = ring_constants(n)
    assert 0 < beta < 1 and abs(beta ** n + beta - 1) < 1e-12
    assert lam == pytest.approx(1 - beta ** (n - 1))
    if n == 2:
        assert beta == pytest.approx((5 ** 0.5 - 1) / 2)


def _authors_exchange(w_i, w_next, w_old, beta, lam):
    """One exchange as the authors' code makes it (huanzhang12/hogwildpp, src/numasvm/svm_exec.hxx,
    ModelUpdate; without its step-size factor and tolerance branch), per coordinate, in float64:

        delta = wi - old_vals[i]; next = next_vals[i];
        new_wi = next * lambda + wi * (1 - lambda) + (beta + lambda - 1) * delta;
        next_vals[i] = next + beta * delta; vals[i] = new_wi; old_vals[i] = new_wi;

    ``next`` is read before next_vals[i] is written. Returns (new w_i, new w_next)."""
    out_i, out_next = [], []
    for wi, nxt, old in zip(*(t.double().tolist() for t in (w_i, w_next, w_old))):
        delta = wi - old
        out_i.append(nxt * lam + wi * (1 - lam) + (beta + lam - 1) * delta)
        out_next.append(nxt + beta * delta)
    return torch.tensor(out_i, dtype=torch.float64), torch.tensor(out_next, dtype=torch.float64)


@pytest.mark.parametrize("n", [2, 3])
def test_token_pass_matches_the_authors_rule(n: int) -> None:
    beta, lam = ring_constants(n)
    w_i, w_next, w_old = vec(1), vec(2), vec(3)
    i_ref, next_ref = _authors_exchange(w_i, w_next, w_old, beta, lam)
    # One machine: the holder updates both models in shared memory.
    new_i, new_next = token_pass(w_i, w_next, w_old, beta, lam)
    torch.testing.assert_close(new_next.double(), next_ref, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(new_i.double(), i_ref, rtol=1e-6, atol=1e-6)
    # Across processes: the next cluster answers with its model from before it adds beta * delta;
    # the holder adds an increment to its own.
    new_i = w_i + holder_increment(w_i, w_next, w_i - w_old, beta, lam)
    torch.testing.assert_close(new_i.double(), i_ref, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("n, settles_at", [(2, 1.0), (3, 0.8712), (4, None)])
def test_one_local_update_is_not_amplified_by_the_ring(n: int, settles_at: float | None) -> None:
    """Every model starts at 0; cluster 0 makes one local update of +1; the token then goes round
    the ring with no other updates. With the authors' rule every model settles at 1.0 (n = 2) or
    below; mixing with the next model *after* it received beta * delta settles at 1.38 (n = 2)."""
    beta, lam = ring_constants(n)
    w = [torch.zeros(1) for _ in range(n)]
    old = [torch.zeros(1) for _ in range(n)]
    w[0] = torch.ones(1)
    for k in range(60 * n):
        i, j = k % n, (k + 1) % n
        w[i], w[j] = token_pass(w[i], w[j], old[i], beta, lam)
        old[i] = w[i].clone()
        ref_models = [float(x) for x in w]
        assert max(ref_models) <= 1.0 + 1e-5, (k, ref_models)  # never more than the update itself
    final = [float(x) for x in w]
    assert max(final) - min(final) < 1e-4  # the models agree
    if settles_at is not None:
        assert final[0] == pytest.approx(settles_at, abs=1e-3)


def test_sync_every_parsing() -> None:
    assert RunConfig(sync_every="epoch").sync_period.each_epoch and RunConfig(sync_every="8").sync_period.count == 8
    for bad in ("0", "-2", "often"):
        with pytest.raises(ConfigError, match="--sync-every"):
            RunConfig(sync_every=bad).sync_period
