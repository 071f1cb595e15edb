"""hogwild++'s token ring against the authors' code (huanzhang12/hogwildpp), in float64; and its runs."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch
from torch import nn

import distsgd
from distsgd.train.context import Start
from helpers import flat_params, torchrun
from quadratics import config

# -- HogWild++ (Zhang, Hsieh, Akella, ICDM 2016) -------------------------------------------------


def authors_model_update(
    vals: list[float],
    old_vals: list[float],
    next_vals: list[float],
    beta: float,
    lam: float,
    step_size: float = 1.0,
    tolerance: float = 0.0,
) -> None:
    """The exchange in the authors' code (huanzhang12/hogwildpp @ 6aaf9ef, src/numasvm/svm_exec.hxx,
    ModelUpdate), coordinate by coordinate, in place on Python floats (float64):

        delta = (wi - old_vals[i]) * params.step_size; next = next_vals[i];
        if (fabs(delta) > tolerance) {
          new_wi = next * lambda + wi * (1 - lambda) + (beta + lambda - 1) * delta;
          next_vals[i] = next + beta * delta; vals[i] = new_wi; old_vals[i] = new_wi;
        } else {
          new_wi = next * lambda + wi * (1 - lambda) + lambda * delta;
          vals[i] = new_wi; old_vals[i] = new_wi - delta;
        }

    where step_size is their SVM's SGD step size of the current epoch (stepinitial 0.05, times
    step_decay 0.8 after each epoch, in their driver's defaults) and tolerance 1e-2 there."""
    for i in range(len(vals)):
        wi, nxt = vals[i], next_vals[i]
        delta = (wi - old_vals[i]) * step_size
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
        beta -= (beta**n + beta - 1) / (n * beta ** (n - 1) + 1)
    return beta, 1 - beta ** (n - 1)


class AuthorsRing:
    """n clusters' models, w_i_old and the token as the authors' code keeps them, in float64."""

    def __init__(self, n: int, size: int) -> None:
        self.n = n
        self.beta, self.lam = beta_lambda(n)
        self.vals = [[0.0] * size for _ in range(n)]
        self.old = [[0.0] * size for _ in range(n)]

    def exchange(self, i: int, step_size: float, tolerance: float = 0.0) -> None:
        authors_model_update(
            self.vals[i], self.old[i], self.vals[(i + 1) % self.n], self.beta, self.lam, step_size, tolerance
        )


def _ring(n: int, size: int = 1, options: dict | None = None, **settings):
    """n hogwild++ clusters (one worker each) whose models (``size`` weights, all 0) live in shared
    memory, as the launcher sets them up, each worker with its optimiser; returns (each cluster's
    algorithm, the shared weights, each worker's optimiser)."""
    import multiprocessing as mp

    from distsgd.algorithms.base import SharedSeat
    from distsgd.algorithms.hogwildpp import HogwildPP

    cfg = config("hogwild++", n, {"cluster_size": 1, "update_delay": 1, **(options or {})}, **settings)
    models = [nn.Linear(size, 1, bias=False) for _ in range(n)]
    for m in models:
        nn.init.zeros_(m.weight)
        m.share_memory()
    states = [m.state_dict() for m in models]
    seat = SharedSeat(
        states=states,
        counts=torch.zeros(n, dtype=torch.int64).share_memory_(),
        stop=torch.zeros(1, dtype=torch.int8).share_memory_(),
        extras=HogwildPP.topology.extras(cfg, mp.get_context("fork"), models),
    )
    algos, optimizers = [], []
    for rank in range(n):
        algo = HogwildPP(cfg, dataclasses.replace(seat, slot=rank))
        ctx = _context(rank)
        model = algo.setup(ctx, nn.Linear(size, 1, bias=False), Start.FRESH)
        optimizers.append(algo.make_optimizer(ctx, model))
        algo.optimizers_ready(ctx, optimizers[-1:])  # as the run does
        algos.append(algo)
    return algos, [m.weight for m in models], optimizers


def _context(rank: int) -> SimpleNamespace:
    return SimpleNamespace(
        rank=rank,
        dataset=SimpleNamespace(is_shared=lambda: True),
        device=torch.device("cpu"),
        job=SimpleNamespace(optimizer=None, param_groups=None),
    )


def _models(weights) -> list[list[float]]:
    return [w.detach().reshape(-1).tolist() for w in weights]


# (n, --ring-scale, the first pass's models, where one update settles): the authors' rule in float64
# (AuthorsRing) gives these; 1.0 / 0.871 / 0.778 of the update for 2 / 3 / 4 clusters at eta = 1 (never
# more than the update: it is not amplified), 0.394 / 0.122 at the authors' first step size, 0.05.
LONE_UPDATE = [
    (2, 1.0, [0.618034, 0.618034], 1.0),
    (3, 1.0, [0.682328, 0.682328, 0.0], 0.871157),
    (4, 1.0, [0.724492, 0.724492, 0.0, 0.0], 0.777941),
    (2, 0.05, [0.618034, 0.030902], 0.394146),
    (4, 0.05, [0.397488, 0.036225, 0.0, 0.0], 0.122010),
]


@pytest.mark.parametrize("n, scale, first, settles", LONE_UPDATE)
def test_hogwildpp_ring_follows_the_authors_code(n: int, scale: float, first: list[float], settles: float) -> None:
    """Every cluster's model starts at 0; cluster 0 makes one local update of +1; the token goes
    round the ring 60 times with no other updates, each holder exchanging with the next as the
    authors' code does, delta scaled by eta = --ring-scale. Our shared-memory exchange
    (HogwildPP._exchange) gives the same models at every pass, never more than the update itself,
    and the models settle together. Mixing with the next model *after* it received beta * delta,
    a plausible slip, settles at 1.38 for n = 2 and eta = 1 (checked); leaving eta out settles at
    1.0, not 0.394, for eta = 0.05."""
    ref = AuthorsRing(n, 1)
    algos, weights, _ = _ring(n, options={"ring_scale": scale})
    assert algos[0].beta == pytest.approx(ref.beta, abs=1e-12) and algos[0].lam == pytest.approx(ref.lam, abs=1e-12)
    with torch.no_grad():
        weights[0].fill_(1.0)
    ref.vals[0][0] = 1.0
    slip = [1.0] + [0.0] * (n - 1)
    slip_old = [0.0] * n
    for k in range(60 * n):
        i, j = k % n, (k + 1) % n
        algos[i]._exchange()
        ref.exchange(i, scale)
        vals = [v[0] for v in ref.vals]
        got = [m[0] for m in _models(weights)]  # float32 models, a float64 reference
        assert got == pytest.approx(vals, abs=1e-5), (k, got, vals)
        assert max(got) <= 1.0 + 1e-5
        if k == 0:
            assert vals == pytest.approx(first, abs=1e-6)
        delta = slip[i] - slip_old[i]
        slip[j] = slip[j] + beta_lambda(n)[0] * delta
        slip[i] = ref.lam * slip[j] + (1 - ref.lam) * slip[i] + (ref.beta + ref.lam - 1) * delta
        slip_old[i] = slip[i]
    assert vals == pytest.approx([settles] * n, abs=1e-6)
    if n == 2 and scale == 1.0:
        assert slip[0] == pytest.approx(1.38, abs=0.01)
    assert int(algos[0].ring.passes) == 60 * n


@pytest.mark.parametrize("n, settles", [(2, 0.785794), (4, 0.242061)])
def test_ring_scale_lr_decays_with_the_schedule_as_the_authors_step_size(n: int, settles: float) -> None:
    """--ring-scale lr takes the holder's learning rate at the exchange. With the authors' step
    size, 0.05 decayed by 0.8 after each epoch (--schedule step --lr-gamma 0.8 --lr-step-epochs 1),
    two epochs, each starting with a +1 on cluster 0 and 60 rounds of the ring: their rule gives
    0.785794 (n = 2) and 0.242061 (n = 4) in every model; a constant factor 0.05 would give 0.788."""
    from distsgd.train.optim import schedule_lr

    ref = AuthorsRing(n, 1)
    algos, weights, optimizers = _ring(
        n, options={"ring_scale": "lr"}, lr=0.05, schedule="step", lr_gamma=0.8, lr_step_epochs=1
    )
    for epoch, step_size in enumerate([0.05, 0.05 * 0.8]):
        for opt in optimizers:  # as the loop sets it at each step
            schedule_lr(opt, algos[0].cfg, epoch_progress=epoch + 0.5, total_epochs=2)
        with torch.no_grad():
            weights[0].add_(1.0)
        ref.vals[0][0] += 1.0
        for k in range(60 * n):
            algos[k % n]._exchange()
            ref.exchange(k % n, step_size)
            assert [m[0] for m in _models(weights)] == pytest.approx([v[0] for v in ref.vals], abs=1e-5)
    assert [v[0] for v in ref.vals] == pytest.approx([settles] * n, abs=1e-6)


@pytest.mark.parametrize("n, scale, tolerance", [(2, 0.05, 1e-2), (4, 0.05, 1e-2), (4, 1.0, 0.0), (2, 0.5, 0.2)])
def test_the_exchange_with_local_updates_and_a_tolerance_is_the_authors(n: int, scale: float, tolerance: float) -> None:
    """Models of 16 weights; before each exchange the holder makes a random local update (as its
    SGD would), of a size that puts some coordinates' scaled delta above the tolerance and some
    below (the authors' else-branch: not passed on, kept waiting in w_i_old). Every model after
    every pass is the authors' rule's, for 2 and 4 clusters."""
    ref = AuthorsRing(n, 16)
    algos, weights, _ = _ring(n, 16, options={"ring_scale": scale, "ring_tolerance": tolerance})
    g = torch.Generator().manual_seed(n)
    below, spread = 0, 2 * tolerance / scale if tolerance else 0.1
    for k in range(20 * n):
        i = k % n
        update = (torch.randn(16, generator=g, dtype=torch.float64) * spread).tolist()
        with torch.no_grad():
            weights[i].add_(torch.tensor(update, dtype=torch.float32).reshape(1, -1))
        ref.vals[i] = [v + u for v, u in zip(ref.vals[i], update)]
        below += sum(abs((v - o) * scale) <= tolerance for v, o in zip(ref.vals[i], ref.old[i]))
        algos[i]._exchange()
        ref.exchange(i, scale, tolerance)
        for got, want in zip(_models(weights), ref.vals):
            assert got == pytest.approx(want, abs=1e-5), k
        torch.testing.assert_close(algos[i].old, torch.tensor(ref.old[i], dtype=torch.float32), atol=1e-5, rtol=0)
    assert (below > 0) == (tolerance > 0), below  # the else-branch was taken (only with a tolerance)


@pytest.mark.parametrize("n", [2, 4])
def test_the_exchange_across_machines_is_the_authors_rule(n: int) -> None:
    """Under torchrun the holder sends the delta it passes on, gets the next cluster's model as it
    was before adding beta * that, and adds an increment to its own (TokenRing._exchange): the same
    new models and w_i_old as the authors', factor and tolerance included."""
    from distsgd.algorithms.hogwildpp import holder_increment, split_delta

    beta, lam = beta_lambda(n)
    g = torch.Generator().manual_seed(n)
    w_i, w_next, w_old = (torch.randn(64, generator=g, dtype=torch.float64) for _ in range(3))
    vals, old, nxt = w_i.tolist(), w_old.tolist(), w_next.tolist()
    authors_model_update(vals, old, nxt, beta, lam, 0.05, 0.05)
    delta, sent = split_delta(w_i, w_old, 0.05, 0.05)
    assert 0 < int((sent == 0).sum()) < 64  # both branches
    new_i = w_i + holder_increment(w_i, w_next, delta, sent, beta, lam)
    torch.testing.assert_close(new_i, torch.tensor(vals, dtype=torch.float64))
    torch.testing.assert_close(w_next + beta * sent, torch.tensor(nxt, dtype=torch.float64))
    torch.testing.assert_close(new_i - (delta - sent), torch.tensor(old, dtype=torch.float64))


def test_update_delay_counts_optimizer_steps_with_accumulate() -> None:
    """tau0 = --update-delay counts optimiser steps: with --accumulate 4 (a step is 4 micro-batches
    of 8), the holder (cluster 0 of 2) exchanges at its first step and passes the token 3 steps
    later, not 3 micro-batches later (at its second step)."""
    from distsgd.train.context import Step

    algos, weights, _ = _ring(2, options={"update_delay": 3}, batch_size=8, accumulate=4)
    ring = algos[0].ring
    holder = []
    for number in range(1, 7):
        algos[0].after_step(_context(0), None, Step(number=number, samples=number * 8 * 4))
        holder.append(int(ring.token))
    assert int(ring.passes) == 1  # the exchange, at step 1
    assert holder == [0, 0, 0, 1, 1, 1]  # passed at step 4


def test_the_ring_across_machines_counts_steps_and_reads_the_workers_lr() -> None:
    """Under torchrun the ring (TokenRing, in each cluster's launching process) counts the
    cluster's optimiser steps as the shared-memory ring does, and --ring-scale lr takes the lr that
    the cluster's workers (ClusterWorker) last stepped at, as the schedule set it."""
    from distsgd.algorithms.base import SharedSeat
    from distsgd.algorithms.hogwildpp import ClusterMemory, ClusterWorker, TokenRing
    from distsgd.train.context import Step
    from distsgd.train.optim import schedule_lr

    step_samples = 8 * 4
    settings = dict(batch_size=8, accumulate=4, lr=0.05, schedule="step", lr_gamma=0.8)
    cfg = config("hogwild++", 4, {"cluster_size": 2, "ring_scale": "lr"}, **settings)
    model = nn.Linear(3, 1)
    model.share_memory()
    seat = SharedSeat(
        states=[model.state_dict()],
        counts=torch.zeros(2, dtype=torch.int64).share_memory_(),
        stop=torch.zeros(1, dtype=torch.int8).share_memory_(),
        extras=ClusterMemory().extras(cfg, None, [model]),
    )
    worker = ClusterWorker(config("hogwild++", 2, {}, **settings), dataclasses.replace(seat, slot=1))  # as launched
    bound = worker.setup(_context(1), nn.Linear(3, 1), Start.FRESH)
    optimizer = worker.make_optimizer(_context(1), bound)
    worker.optimizers_ready(_context(1), [optimizer])  # as the run does
    schedule_lr(optimizer, cfg, epoch_progress=1.5, total_epochs=2)  # epoch 2: 0.05 * 0.8
    worker.after_step(_context(1), bound, Step(number=5, samples=5 * step_samples))
    seat.counts[0] = 3 * step_samples
    token_ring = TokenRing(cfg, 0, 2, model, seat.counts, seat.stop, seat.extras)
    assert token_ring.steps() == 8
    assert token_ring.scale() == pytest.approx(0.04)


def test_learns_digits(digits) -> None:
    s = distsgd.train(
        model="mlp",
        data=digits,
        algo="hogwild++",
        workers=2,
        epochs=5,
        lr=0.05,
        quiet=True,
        cluster_size=1,
        update_delay=4,
    ).summary
    assert s["final_test_accuracy"] >= 0.8, s["final_test_accuracy"]
    assert s["bytes_sent"] > 0 and s["samples"] >= 5 * 1436
    assert s["clusters"] == 2 and s["token_passes"] > 0
    assert s["ring_beta"] == pytest.approx((5**0.5 - 1) / 2)


def test_bad_settings() -> None:
    with pytest.raises(distsgd.ConfigError, match="not a multiple of --cluster-size"):
        distsgd.train(model="mlp", data="digits", algo="hogwild++", workers=3, cluster_size=2, quiet=True)
    with pytest.raises(distsgd.ConfigError, match="--ring-scale must be 'lr' or a positive number, got 'fast'"):
        distsgd.train(model="mlp", data="digits", algo="hogwild++", workers=2, ring_scale="fast", quiet=True)
    with pytest.raises(distsgd.ConfigError, match="--ring-scale must be 'lr' or a positive number"):
        distsgd.train(model="mlp", data="digits", algo="hogwild++", workers=2, ring_scale=0, quiet=True)
    with pytest.raises(distsgd.ConfigError, match="--ring-tolerance must be a number >= 0"):
        distsgd.train(model="mlp", data="digits", algo="hogwild++", workers=2, ring_tolerance=-0.1, quiet=True)


@pytest.mark.slow
def test_hogwildpp_across_processes_passes_the_token_by_point_to_point(tmp_path) -> None:
    """Under torchrun each process is a cluster (here 2 of 2 local Hogwild! workers each) and the
    token travels between the processes over gloo, as it would between nodes. The lr schedule
    follows the whole run's progress, as it does on one machine (each cluster used to divide its
    own samples by the run's samples per epoch: cosine ended at half the lr with 2 clusters)."""
    import json

    res = torchrun(
        *"--algo hogwild++ --cluster-size 2 --update-delay 4 --dataset digits --model mlp --epochs 3".split(),
        *"--lr 0.05 --schedule cosine --log-every 1 --out".split(),
        str(tmp_path / "run"),
        "--quiet",
        timeout=180,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    s = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert s["workers"] == 4 and s["clusters"] == 2 and s["failed_workers"] == []
    assert s["samples"] == 3 * 1436 and s["samples_per_worker"] == [3 * 359] * 4  # 1436 / 4 a shard
    assert s["token_passes"] > 0
    # Each exchange: the holder sends a SYNC header of 3 + 2n int64 and delta, the next cluster answers
    # with its weights; then the holder sends a TOKEN header, except after the last exchange, when a
    # STOP header goes round the ring of n = 2 (sent once, not forwarded back to its origin).
    n_params = flat_params(distsgd.models.build_model("mlp", (1, 8, 8), 10)).numel()
    passes, header = s["token_passes"], 8 * (3 + 2 * 2)
    assert s["bytes_sent"] == passes * 2 * 4 * n_params + (2 * passes - 1 + 1) * header
    # the average of the two clusters learnt (chance: 0.1); it varies from run to run (0.78 seen once)
    assert s["final_test_accuracy"] >= 0.6, s["final_test_accuracy"]
    events = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    lrs = [e["lr"] for e in events if e["event"] == "progress"]
    # cosine: 0.05 * (1 + cos(pi * progress)) / 2, 0 at the end; at half the run (the old bug) 0.025.
    assert lrs[-1] < 0.1 * 0.05, lrs[-5:]


SLOW_MODEL = '''
import math
import os
import time

from torch import nn

STEP_S, EVAL_S = {step_s}, {eval_s}


class Slow(nn.Module):
    """Linear, but a training step takes at least STEP_S and an evaluation batch EVAL_S, and rank
    0's workers take START_S to build theirs: rank 0's launcher notes its pid at its first model,
    and the workers it starts inherit it (their RANK is their slot: 0 on both machines)."""

    def __init__(self, input_shape, num_classes):
        super().__init__()
        self.fc = nn.Linear(math.prod(input_shape), num_classes)
        if os.environ.get("RANK") == "0":
            os.environ.setdefault("SLOW_LAUNCHER", str(os.getpid()))
            if os.environ["SLOW_LAUNCHER"] != str(os.getpid()):
                time.sleep({start_s})

    def forward(self, x):
        time.sleep(STEP_S if self.training else EVAL_S)
        return self.fc(x.flatten(1))
'''


@pytest.mark.slow
def test_the_training_clock_across_machines_covers_every_clusters_samples(tmp_path) -> None:
    """Under torchrun with --stop-at-target, rank 0 measures a copy while every cluster trains on
    (nothing holds another machine's), and rank 1 is ready before rank 0: the run's clock must
    count that time, and start when every cluster does. Each step of a worker sleeps STEP_S for
    its batch, so no run of 2 workers trains faster than 2 * batch / STEP_S samples a second; a
    clock that pauses for evaluations, or starts after a cluster that started early, reports more."""
    import json

    step_s, batch = 0.02, 32
    (tmp_path / "slow.py").write_text(SLOW_MODEL.format(step_s=step_s, eval_s=0.3, start_s=2.0))
    res = torchrun(
        *"--algo hogwild++ --dataset digits --model".split(),
        f"{tmp_path / 'slow.py'}:Slow",
        "--batch-size",
        str(batch),
        *"--max-samples 2872 --eval-every 256 --target-accuracy 1.0 --stop-at-target --out".split(),
        str(tmp_path / "run"),
        "--quiet",
        timeout=180,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    fastest = 2 * batch / step_s  # samples/s
    s = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert s["workers"] == 2 and s["samples"] >= 2872
    assert s["train_wall_s"] >= s["samples"] / fastest, (s["samples"], s["train_wall_s"])
    events = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    evals = [e for e in events if e["event"] == "eval"]
    assert len(evals) >= 2
    for e in evals:  # the copies measured while the clusters trained on
        assert e["train_wall_s"] >= e["samples"] / fastest, e
