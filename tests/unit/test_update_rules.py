"""The averaging algorithms' update rules against references written from their papers (or the
authors' code, or torch's own implementation), in float64, with two or more workers so that the
collective is real.

Each worker i follows the gradient of its own quadratic, L_i(w) = 1/2 sum_k a_ik (w_k - b_ik)^2,
so g_i(w) = a_i * (w - b_i): deterministic, different per worker, and easy to write twice. Every
test also computes what a plausible wrong rule would give and checks that the implementation is
far from it: agreement with the reference is then not an accident of the numbers.
"""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from distsgd.algorithms.averaging import elastic_alpha
from distsgd.config import RunConfig

from helpers import in_group

N_PARAMS = 2 * 3 + 2  # nn.Linear(3, 2)


def start_weights() -> torch.Tensor:
    torch.manual_seed(0)
    return torch.cat([p.detach().reshape(-1) for p in nn.Linear(3, 2).parameters()]).double()


def quadratic(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(10 + rank)
    return 0.5 + torch.rand(N_PARAMS, generator=g, dtype=torch.float64), torch.randn(N_PARAMS, generator=g,
                                                                                    dtype=torch.float64)


def model_and_grad(rank: int) -> tuple[nn.Module, callable]:
    """A Linear(3, 2) at start_weights() and a function that sets its .grad to g_rank(w)."""
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    a, b = (t.float() for t in quadratic(rank))

    def set_grad() -> None:
        w = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
        g, offset = a * (w - b), 0
        for p in model.parameters():
            p.grad = g[offset:offset + p.numel()].view_as(p).clone()
            offset += p.numel()

    return model, set_grad


def flat(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).double()


def far(a: torch.Tensor, b: torch.Tensor, by: float = 1e-3) -> bool:
    return float((a - b).abs().max()) > by


# -- EASGD (Zhang, Choromanska, LeCun, NIPS 2015) ---------------------------------------------

def _easgd_worker(rank: int, world: int, steps: int, tau: int) -> dict:
    from distsgd.algorithms.easgd import EASGD

    cfg = RunConfig(algo="easgd", workers=world, tau=tau, alpha=0.3, lr=0.1, momentum=0.0)
    model, set_grad = model_and_grad(rank)
    algo = EASGD(cfg)
    ctx = SimpleNamespace(world=world, rank=rank, resumed=False)
    model = algo.setup(ctx, model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(steps):
        set_grad()
        algo.apply_step(ctx, opt)
        algo.after_step(ctx, model, 0)
    return {"x": flat(model), "centre": flat(algo.center_model)}


def easgd_reference(world: int, steps: int, tau: int, lr: float, alpha: float, wrong: str = "") -> tuple:
    """Synchronous EASGD, the paper's equations (5)-(6) with a communication period tau: at every
    step t that tau divides, from the same x_i^t,
        x_i^{t+1} = x_i^t - lr g_i(x_i^t) - alpha (x_i^t - x~^t)
        x~^{t+1}  = x~^t + alpha sum_i (x_i^t - x~^t)
    and x_i^{t+1} = x_i^t - lr g_i(x_i^t) at the others. ``wrong``: "mean" moves the centre by
    the mean elastic difference; "after" takes the elastic difference after the gradient step."""
    w0 = start_weights()
    xs, centre = [w0.clone() for _ in range(world)], w0.clone()
    quads = [quadratic(r) for r in range(world)]
    for t in range(steps):
        grads = [a * (x - b) for x, (a, b) in zip(xs, quads)]
        if wrong == "after":
            xs = [x - lr * g for x, g in zip(xs, grads)]
            grads = [torch.zeros_like(g) for g in grads]
        if t % tau == 0:
            diffs = [x - centre for x in xs]
            total = sum(diffs) / (world if wrong == "mean" else 1)
            xs = [x - alpha * d for x, d in zip(xs, diffs)]
            centre = centre + alpha * total
        xs = [x - lr * g for x, g in zip(xs, grads)]
    return xs, centre


def test_sync_easgd_with_two_workers_follows_the_paper(tmp_path) -> None:
    steps, tau = 9, 2
    got = in_group(_easgd_worker, 2, tmp_path, steps, tau)
    xs, centre = easgd_reference(2, steps, tau, lr=0.1, alpha=0.3)
    for r in range(2):
        torch.testing.assert_close(got[r]["x"], xs[r], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(got[r]["centre"], centre, rtol=1e-5, atol=1e-6)  # every copy of x~ alike
    for wrong in ("mean", "after"):
        _, c = easgd_reference(2, steps, tau, lr=0.1, alpha=0.3, wrong=wrong)
        assert far(got[0]["centre"], c), wrong


def test_easgd_alpha_default_gives_beta_point_nine() -> None:
    assert elastic_alpha(RunConfig(), 4) * 4 == pytest.approx(0.9)
    assert elastic_alpha(RunConfig(alpha=0.1), 4) == 0.1


def test_async_easgd_exchanges_of_two_workers_follow_the_paper() -> None:
    """Algorithm 1 of the paper (asynchronous EASGD), the master's side of two workers exchanging
    in an arbitrary order: worker i sends x = x^i; the master does x~ <- x~ + alpha (x - x~) and
    the worker x^i <- x^i - alpha (x - x~), both with the x~ the master held when x arrived. A
    BatchNorm's running mean is part of x (a float buffer), its counter is copied. Wrong rules
    checked: the worker moving by the difference from the centre *after* the master moved it,
    and a centre that moves by alpha / N."""
    from distsgd.algorithms.param_server import ParameterServer

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 2), nn.BatchNorm1d(2))
    ps = ParameterServer(RunConfig(alpha=0.25, lr=0.1), model, 2, "easgd", samples_per_epoch=100)
    centre = flat(model)
    centre_bn = model[1].running_mean.detach().double().clone()
    g = torch.Generator().manual_seed(3)
    xs = {1: centre + torch.randn(centre.shape, generator=g, dtype=torch.float64),
          2: centre - torch.randn(centre.shape, generator=g, dtype=torch.float64)}
    bn = {1: torch.randn(2, generator=g, dtype=torch.float64), 2: torch.randn(2, generator=g, dtype=torch.float64)}
    wrong_mean = centre.clone()
    for k, rank in enumerate([1, 2, 2, 1, 2]):
        ints = [torch.tensor([7 + k])]
        (d, (d_bn,)), version, _, _ = ps.exchange(rank, xs[rank].float(), [bn[rank].float()], ints, 10 * k)
        x, x_bn = xs[rank], bn[rank]
        torch.testing.assert_close(d.double(), x - centre, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(d_bn.double(), x_bn - centre_bn, rtol=1e-5, atol=1e-6)
        wrong_mean = wrong_mean + 0.25 / 2 * (x - wrong_mean)
        moved = centre + 0.25 * (x - centre)
        wrong_after_worker = x - 0.25 * (x - moved)
        xs[rank] = x - 0.25 * (x - centre)  # the worker's move
        bn[rank] = x_bn - 0.25 * (x_bn - centre_bn)
        centre, centre_bn = moved, centre_bn + 0.25 * (x_bn - centre_bn)
        torch.testing.assert_close(flat(model), centre, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(model[1].running_mean.double(), centre_bn, rtol=1e-5, atol=1e-6)
        assert int(model[1].num_batches_tracked) == 7 + k and version == k + 1
        assert far(xs[rank], wrong_after_worker)
    assert far(centre, wrong_mean)


# -- DiLoCo (Douillard et al. 2023) -------------------------------------------------------------

H, ROUNDS, TAIL = 3, 3, 2  # 3 full rounds of 3 inner steps, then a partial round of 2
INNER_LR, DECAY, OUTER_LR, OUTER_MU = 0.05, 0.1, 0.7, 0.9


def _diloco_worker(rank: int, world: int) -> dict:
    from distsgd.algorithms.diloco import DiLoCo

    cfg = RunConfig(algo="diloco", workers=world, sync_every=str(H), lr=INNER_LR, weight_decay=DECAY,
                    outer_lr=OUTER_LR, outer_momentum=OUTER_MU)
    model, set_grad = model_and_grad(rank)
    algo = DiLoCo(cfg)
    ctx = SimpleNamespace(world=world, rank=rank, resumed=False, job=SimpleNamespace(optimizer=None,
                                                                                     param_groups=None))
    model = algo.setup(ctx, model)
    opt = algo.make_optimizer(ctx, model)
    thetas = []
    for step in range(1, H * ROUNDS + TAIL + 1):
        set_grad()
        algo.apply_step(ctx, opt)
        algo.after_step(ctx, model, 0)
        if step % H == 0:
            thetas.append(flat(algo.global_model))
    final = algo.finish(ctx, model)
    return {"thetas": thetas, "final": flat(final), "local": flat(model)}


def adamw(state: dict, w: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """AdamW (Loshchilov and Hutter, ICLR 2019, Algorithm 2; Kingma and Ba's bias correction),
    beta 0.9 / 0.999, eps 1e-8: w <- w - lr (decay w + m^ / (sqrt(v^) + eps))."""
    state["t"] += 1
    state["m"] = 0.9 * state["m"] + 0.1 * g
    state["v"] = 0.999 * state["v"] + 0.001 * g * g
    m_hat, v_hat = state["m"] / (1 - 0.9 ** state["t"]), state["v"] / (1 - 0.999 ** state["t"])
    return w - INNER_LR * (DECAY * w + m_hat / (v_hat.sqrt() + 1e-8))


def diloco_reference(world: int, wrong: str = "") -> tuple[list[torch.Tensor], torch.Tensor]:
    """DiLoCo's Algorithm 1: each outer step t, every worker i starts from theta^(t-1), takes H
    inner AdamW steps (its AdamW state carried from round to round), reaching theta_i^(t); then
    Delta^(t) = (1/k) sum_i (theta^(t-1) - theta_i^(t)) and theta^(t) = OuterOpt(theta^(t-1),
    Delta^(t)), Nesterov momentum (Sutskever et al. 2013, in PyTorch's form: b <- mu b + Delta,
    theta <- theta - lr (Delta + mu b)). The last, partial round ends with an outer step too.
    ``wrong``: "sum" (no 1/k), "sign" (theta_i - theta), "average" (theta <- mean of theta_i,
    local SGD's rule), "reset" (a fresh AdamW every round)."""
    theta = start_weights()
    quads = [quadratic(r) for r in range(world)]
    states = [{"t": 0, "m": torch.zeros_like(theta), "v": torch.zeros_like(theta)} for _ in range(world)]
    buf, thetas = None, []
    for steps in [H] * ROUNDS + [TAIL]:
        local = []
        for i, (a, b) in enumerate(quads):
            if wrong == "reset":
                states[i] = {"t": 0, "m": torch.zeros_like(theta), "v": torch.zeros_like(theta)}
            w = theta.clone()
            for _ in range(steps):
                w = adamw(states[i], w, a * (w - b))
            local.append(w)
        if wrong == "average":
            theta = sum(local) / world
        else:
            delta = sum((lo - theta) if wrong == "sign" else (theta - lo) for lo in local) / (1 if wrong == "sum" else world)
            buf = delta if buf is None else OUTER_MU * buf + delta
            theta = theta - OUTER_LR * (delta + OUTER_MU * buf)
        thetas.append(theta)
    return thetas, theta


def test_diloco_with_two_workers_follows_the_paper(tmp_path) -> None:
    got = in_group(_diloco_worker, 2, tmp_path)
    thetas, final = diloco_reference(2)
    for r in range(2):
        for a, b in zip(got[r]["thetas"], thetas):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(got[r]["final"], final, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(got[r]["local"], final, rtol=1e-5, atol=1e-6)  # the next round starts there
    for wrong in ("sum", "sign", "average", "reset"):
        assert far(got[0]["final"], diloco_reference(2, wrong)[1]), wrong


# -- local SGD against torch's PeriodicModelAverager -------------------------------------------

def _local_sgd_pair(rank: int, world: int, steps: int, every: int, warmup: int) -> dict:
    """Our local-sgd, and the same training with torch.distributed.algorithms.model_averaging."""
    import torch.distributed as dist
    from torch.distributed.algorithms.model_averaging.averagers import PeriodicModelAverager

    from distsgd.algorithms.local_sgd import LocalSGD

    cfg = RunConfig(algo="local-sgd", workers=world, sync_every=str(every), warmup_steps=warmup, lr=0.1,
                    momentum=0.5)
    ours, set_ours = model_and_grad(rank)
    algo = LocalSGD(cfg)
    ctx = SimpleNamespace(world=world, rank=rank, resumed=False)
    ours = algo.setup(ctx, ours)
    opt = torch.optim.SGD(ours.parameters(), lr=0.1, momentum=0.5)
    theirs, set_theirs = model_and_grad(rank)
    topt = torch.optim.SGD(theirs.parameters(), lr=0.1, momentum=0.5)
    # torch averages after the step whose 0-based index i has i >= warmup_steps and (i - warmup_steps)
    # % period == 0; ours after step s (1-based) with s > K and (s - K) % H == 0: the same steps for
    # warmup_steps = K + H - 1. Before that, post-local SGD all-reduces the gradients (torch:
    # post_localSGD_hook's allreduce until start_localSGD_iter = K).
    averager = PeriodicModelAverager(period=every, warmup_steps=warmup + every - 1)
    for step in range(steps):
        set_ours()
        algo.after_backward(ctx, ours)
        algo.apply_step(ctx, opt)
        algo.after_step(ctx, ours, 0)
        set_theirs()
        if step < warmup:
            for p in theirs.parameters():
                dist.all_reduce(p.grad)
                p.grad /= world
        topt.step()
        averager.average_parameters(theirs.parameters())
    return {"ours": flat(ours), "theirs": flat(theirs), "final": flat(algo.finish(ctx, ours))}


@pytest.mark.parametrize("steps, every, warmup", [(13, 3, 0), (14, 4, 5)])
def test_local_sgd_takes_the_steps_of_torchs_periodic_model_averager(tmp_path, steps: int, every: int,
                                                                     warmup: int) -> None:
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


# -- HogWild++ (Zhang, Hsieh, Akella, ICDM 2016) -------------------------------------------------

def authors_model_update(vals: list[float], old_vals: list[float], next_vals: list[float], beta: float,
                         lam: float, tolerance: float = 0.0) -> None:
    """The exchange in the authors' code (huanzhang12/hogwildpp, src/numasvm/svm_exec.hxx,
    ModelUpdate), coordinate by coordinate, in place on Python floats (float64):

        delta = wi - old_vals[i]; next = next_vals[i];
        if (fabs(delta) > tolerance) {
          new_wi = next * lambda + wi * (1 - lambda) + (beta + lambda - 1) * delta;
          next_vals[i] = next + beta * delta; vals[i] = new_wi; old_vals[i] = new_wi;
        } else {
          new_wi = next * lambda + wi * (1 - lambda) + lambda * delta;
          vals[i] = new_wi; old_vals[i] = new_wi - delta;
        }

    (without its step-size factor on delta, which the paper does not describe)."""
    for i in range(len(vals)):
        wi, nxt = vals[i], next_vals[i]
        delta = wi - old_vals[i]
        if abs(delta) > tolerance:
            new_wi = nxt * lam + wi * (1 - lam) + (beta + lam - 1) * delta
            next_vals[i] = nxt + beta * delta
            vals[i] = new_wi
            old_vals[i] = new_wi
        else:
            new_wi = nxt * lam + wi * (1 - lam) + lam * delta
            vals[i] = new_wi
            old_vals[i] = new_wi - delta


def beta_lambda(n: int) -> tuple[float, float]:
    """The paper's constants: beta^n + beta - 1 = 0 (solved here by Newton's method), lambda =
    1 - beta^(n - 1)."""
    beta = 0.6
    for _ in range(60):
        beta -= (beta ** n + beta - 1) / (n * beta ** (n - 1) + 1)
    return beta, 1 - beta ** (n - 1)


def _ring(n: int):
    """n hogwild++ clusters (one worker each) whose models live in shared memory, as the launcher
    sets them up; returns (each cluster's algorithm, the shared models)."""
    import multiprocessing as mp

    from distsgd.algorithms.hogwildpp import HogwildPP
    from distsgd.train.context import SharedHandles

    cfg = RunConfig(algo="hogwild++", workers=n, cluster_size=1, update_delay=1)
    models = [nn.Linear(1, 1, bias=False) for _ in range(n)]
    for m in models:
        nn.init.zeros_(m.weight)
        m.share_memory()
    states = [m.state_dict() for m in models]
    handles = SharedHandles(states=states, counts=torch.zeros(n, dtype=torch.int64).share_memory_(),
                            stop=torch.zeros(1, dtype=torch.int8).share_memory_(),
                            extras=HogwildPP.shared_extras(cfg, mp.get_context("fork"), models))
    algos = []
    for rank in range(n):
        algo = HogwildPP(cfg)
        ctx = SimpleNamespace(shared=copy.copy(handles), rank=rank, dataset=SimpleNamespace(is_shared=lambda: True))
        ctx.shared.slot = rank
        algo.setup(ctx, nn.Linear(1, 1, bias=False))
        algos.append(algo)
    return algos, [m.weight for m in models]


@pytest.mark.parametrize("n", [2, 3, 4])
def test_hogwildpp_ring_follows_the_authors_code(n: int) -> None:
    """Every cluster's model starts at 0; cluster 0 makes one local update of +1; the token goes
    round the ring 60 times with no other updates, each holder exchanging with the next as the
    authors' code does. Our shared-memory exchange (HogwildPP._exchange) gives the same models at
    every pass, never more than the update itself (one update is not amplified), and the models
    settle together (at 1.0 for n = 2, 0.871 for n = 3). Mixing with the next model *after* it
    received beta * delta, a plausible slip, settles at 1.38 for n = 2 (checked)."""
    beta, lam = beta_lambda(n)
    algos, weights = _ring(n)
    assert algos[0].beta == pytest.approx(beta, abs=1e-12) and algos[0].lam == pytest.approx(lam, abs=1e-12)
    vals, old = [0.0] * n, [0.0] * n
    with torch.no_grad():
        weights[0].fill_(1.0)
    vals[0] = 1.0
    slip = [1.0] + [0.0] * (n - 1)
    slip_old = [0.0] * n
    for k in range(60 * n):
        i, j = k % n, (k + 1) % n
        algos[i]._exchange()
        mine, nxt, mine_old = [vals[i]], [vals[j]], [old[i]]
        authors_model_update(mine, mine_old, nxt, beta, lam)
        vals[i], vals[j], old[i] = mine[0], nxt[0], mine_old[0]
        got = [float(w.detach()) for w in weights]  # float32 models, a float64 reference
        assert got == pytest.approx(vals, abs=1e-5), (k, got, vals)
        assert max(got) <= 1.0 + 1e-5
        delta = slip[i] - slip_old[i]
        slip[j] = slip[j] + beta * delta
        slip[i] = lam * slip[j] + (1 - lam) * slip[i] + (beta + lam - 1) * delta
        slip_old[i] = slip[i]
    assert max(vals) - min(vals) < 1e-4
    if n == 2:
        assert vals[0] == pytest.approx(1.0, abs=1e-3) and slip[0] == pytest.approx(1.38, abs=0.01)
    if n == 3:
        assert vals[0] == pytest.approx(0.8712, abs=1e-3)
    assert int(algos[0].ring.passes) == 60 * n


@pytest.mark.parametrize("n", [2, 3])
def test_the_exchange_across_machines_is_the_authors_rule(n: int) -> None:
    """Under torchrun the holder gets the next cluster's model as it was before adding beta *
    delta, and adds an increment to its own (TokenRing): the same new models as the authors'."""
    from distsgd.algorithms.hogwildpp import holder_increment

    beta, lam = beta_lambda(n)
    g = torch.Generator().manual_seed(n)
    w_i, w_next, w_old = (torch.randn(7, generator=g, dtype=torch.float64) for _ in range(3))
    vals, old, nxt = w_i.tolist(), w_old.tolist(), w_next.tolist()
    authors_model_update(vals, old, nxt, beta, lam)
    new_i = w_i + holder_increment(w_i, w_next, w_i - w_old, beta, lam)
    torch.testing.assert_close(new_i, torch.tensor(vals, dtype=torch.float64))
    torch.testing.assert_close(w_next + beta * (w_i - w_old), torch.tensor(nxt, dtype=torch.float64))


def test_sync_every_parsing() -> None:
    from distsgd.errors import ConfigError

    assert RunConfig(sync_every="epoch").sync_period.each_epoch and RunConfig(sync_every="8").sync_period.count == 8
    for bad in ("0", "-2", "often"):
        with pytest.raises(ConfigError, match="--sync-every"):
            RunConfig(sync_every=bad).sync_period

