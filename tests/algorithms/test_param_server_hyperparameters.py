"""A parameter server steps with the worker's optimiser settings: each push carries the lr (and
momentum, betas, weight decay) the worker's optimiser holds at that step, as a user's LR scheduler
set them, and the server's optimiser takes them before it steps on that push's gradient.

The loops build their schedulers on the optimiser ``run.setup()`` returns (the torch optimiser
itself, its step routed through the algorithm), as a script does."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

import distsgd
from distsgd.data import load_dataset

K = 5  # steps at the base lr before a schedule drives it to 0
BASE_LR = 0.1


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Flatten(), nn.Linear(64, 16), nn.ReLU(), nn.Linear(16, 10))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


def _flat(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).clone()


def _wait_for(path: Path, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} never appeared")
        time.sleep(0.01)


def lr_to_zero_loop(run: distsgd.Run) -> nn.Module:
    """K steps at the base lr, then LambdaLR's 0. After its K-th step a worker waits until the
    other has taken its K-th too (a marker file each): the answer to its next push (at lr 0) then
    holds every gradient pushed at a positive lr, and it saves those weights."""
    out = Path(os.environ["HYPER_OUT"])
    data = load_dataset("digits")
    model, opt = run.setup()
    scheduler = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 if s < K else 0.0)
    torch.save(_flat(model), out / f"start{run.rank}.pt")
    steps = 0
    for x, y in run.loader(TensorDataset(data.x_train, data.y_train)):
        opt.zero_grad()
        run.backward(F.cross_entropy(model(x), y))
        opt.step()
        scheduler.step()
        steps += 1
        if steps == K:
            (out / f"stepped{run.rank}").touch()
            _wait_for(out / f"stepped{1 - run.rank}")
        elif steps == K + 1:
            torch.save(_flat(model), out / f"after{run.rank}.pt")
    return run.final_model()


@pytest.mark.slow
@pytest.mark.parametrize("algo", ["asgd", "sync-ps"])
def test_a_schedule_that_drives_the_lr_to_zero_stops_the_weights(tmp_path, monkeypatch, algo: str) -> None:
    """SGD at lr 0 is w <- w - 0 * (momentum buffer): every push after a worker's K-th leaves the
    server's weights as they were once both workers' first K gradients were applied. (The server
    used to step at the base lr: the weights went on moving.)"""
    monkeypatch.setenv("HYPER_OUT", str(tmp_path))
    result = distsgd.spawn(
        lr_to_zero_loop, model=Net, algo=algo, workers=2, epochs=1, batch_size=32, lr=BASE_LR, quiet=True
    )
    final = _flat(result.model)
    start = torch.load(tmp_path / "start0.pt")
    for rank in (0, 1):
        after = torch.load(tmp_path / f"after{rank}.pt")
        assert not torch.equal(after, start)  # the first K steps moved them
        moved = float((final - after).abs().max())
        assert moved == 0.0, f"worker {rank}: the weights moved {moved} at lr 0"
    assert result.summary["samples"] == pytest.approx(1437, abs=64)  # the whole epoch went on at lr 0


STEPS = 6


def recording_loop(run: distsgd.Run) -> nn.Module:
    """STEPS steps under the scheduler HYPER_SCHEDULE names (built on ``opt``); each
    worker saves the weights it held before each step and after the last, and the gradient it
    pushed at each."""
    out = Path(os.environ["HYPER_OUT"])
    data = load_dataset("digits")
    model, opt = run.setup()
    if os.environ["HYPER_SCHEDULE"] == "halving":  # lr, lr, lr / 2, lr / 2, lr / 4, lr / 4
        scheduler: torch.optim.lr_scheduler.LRScheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    else:  # OneCycleLR, cycling the lr and SGD's momentum
        scheduler = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=BASE_LR, total_steps=STEPS)
    weights, grads = [_flat(model)], []
    for x, y in run.loader(TensorDataset(data.x_train, data.y_train)):
        opt.zero_grad()
        run.backward(F.cross_entropy(model(x), y))
        grads.append(torch.cat([p.grad.reshape(-1) for p in model.parameters()]).clone())
        opt.step()
        scheduler.step()
        weights.append(_flat(model))
        if len(grads) == STEPS:
            break
    torch.save({"weights": weights, "grads": grads}, out / f"record{run.rank}.pt")
    return run.final_model()


def _recorded(tmp_path, monkeypatch, schedule: str, **settings) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Under sync-ps with 2 workers: the weights before each step (the same on both workers) and the
    mean of the two gradients pushed at each, in float64."""
    monkeypatch.setenv("HYPER_OUT", str(tmp_path))
    monkeypatch.setenv("HYPER_SCHEDULE", schedule)
    common = dict(model=Net, algo="sync-ps", workers=2, epochs=1, batch_size=32, lr=BASE_LR, quiet=True)
    distsgd.spawn(recording_loop, **common, **settings)
    a, b = (torch.load(tmp_path / f"record{rank}.pt") for rank in (0, 1))
    assert len(a["grads"]) == len(b["grads"]) == STEPS
    for wa, wb in zip(a["weights"], b["weights"]):
        assert torch.equal(wa, wb)  # one round, one answer
    mean = [(ga.double() + gb.double()) / 2 for ga, gb in zip(a["grads"], b["grads"])]
    return [w.double() for w in a["weights"]], mean


@pytest.mark.slow
def test_sync_ps_steps_at_the_lr_a_halving_schedule_set(tmp_path, monkeypatch) -> None:
    """SGD's definition, w <- w - lr_t (g1 + g2) / 2, with StepLR's lr_t = 0.1 * 0.5 ** (t // 2), in
    float64 from the two gradients the workers pushed: the server's update is that one. (It used to
    take every step at 0.1.)"""
    weights, mean = _recorded(tmp_path, monkeypatch, "halving", momentum=0.0, weight_decay=0.0)
    for t in range(STEPS):
        lr = BASE_LR * 0.5 ** (t // 2)
        reference = weights[t] - lr * mean[t]
        torch.testing.assert_close(weights[t + 1], reference, rtol=0, atol=1e-6, msg=lambda m, t=t: f"step {t}: {m}")
        wrong = weights[t] - BASE_LR * mean[t]
        if t >= 2:  # the base lr is another update
            assert float((wrong - weights[t + 1]).abs().max()) > 1e-4


@pytest.mark.slow
def test_sync_ps_steps_with_the_momentum_onecyclelr_set(tmp_path, monkeypatch) -> None:
    """OneCycleLR cycles SGD's momentum with its lr. Its values, from torch's OneCycleLR on an
    optimiser of one parameter, in SGD's definition with momentum (buf <- m_t buf + g, the first
    buf = g; w <- w - lr_t buf) in float64 from the pushed gradients: the server's updates."""
    weights, mean = _recorded(tmp_path, monkeypatch, "onecycle", momentum=0.9, weight_decay=0.0)
    probe = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=BASE_LR, momentum=0.9)
    schedule = torch.optim.lr_scheduler.OneCycleLR(probe, max_lr=BASE_LR, total_steps=STEPS)
    w, buf = weights[0], None
    momenta = []
    for t in range(STEPS):
        lr, m = probe.param_groups[0]["lr"], probe.param_groups[0]["momentum"]
        momenta.append(m)
        buf = mean[t].clone() if buf is None else m * buf + mean[t]
        w = w - lr * buf
        torch.testing.assert_close(weights[t + 1], w, rtol=0, atol=1e-6, msg=lambda m, t=t: f"step {t}: {m}")
        w = weights[t + 1]  # each step from the server's weights (float32), its buffer in float64
        probe.step()
        schedule.step()
    assert len(set(momenta)) > 2  # the momentum did cycle


# --- The core, driven directly: each push's values, and how they compose with the rules ----------


def _server(algo: str, optimizer=None, **settings):
    """The core of ``algo``'s server on a Linear(3, 2) (lr 0.1, no momentum unless ``settings``)."""
    from distsgd.algorithms import registry
    from distsgd.algorithms.param_server import ParameterServer
    from distsgd.config import RunConfig, resolve

    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    algo_cls = registry.get(algo)
    names = algo_cls.Options.names()
    options = {k: v for k, v in settings.items() if k in names}
    common = {"lr": BASE_LR, "momentum": 0.0, "batch_size": 8, **{k: v for k, v in settings.items() if k not in names}}
    cfg = resolve(RunConfig(**common, options=options))
    rule = algo_cls.topology.rule(cfg, algo_cls.Options.from_mapping(options))
    return ParameterServer(cfg, model, 2, rule, optimizer=optimizer(model) if optimizer else None)


def _grad(seed: int) -> torch.Tensor:
    return torch.randn(8, generator=torch.Generator().manual_seed(seed))


def _weights(ps) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in ps.model.parameters()]).double()


def _sgd(lr: float, momentum: float = 0.0, weight_decay: float = 0.0) -> list[float]:
    return [lr, momentum, weight_decay]  # SGD's group: lr, momentum, weight_decay (hyper.KEYS' order)


def test_asgd_steps_each_push_at_its_own_lr() -> None:
    """Two workers at two points of their schedules: w <- w - lr_r g_r, push by push (float64)."""
    ps = _server("asgd")
    w = _weights(ps)
    ps.push(1, _grad(1), 0, 8, hypers=_sgd(0.1)).wait()
    ps.push(2, _grad(2), 1, 8, hypers=_sgd(0.025)).wait()
    ps.push(1, _grad(3), 2, 16, hypers=_sgd(0.0)).wait()
    reference = w - 0.1 * _grad(1).double() - 0.025 * _grad(2).double()
    torch.testing.assert_close(_weights(ps), reference, rtol=0, atol=1e-7)


def test_staleness_scaling_divides_the_pushed_lr_step() -> None:
    """--staleness-lr with a pushed lr: plain SGD moves by (lr_r / tau) g_r for a push tau stale."""
    ps = _server("asgd", staleness_lr=True)
    ps.push(2, _grad(9), 0, 8, hypers=_sgd(0.1)).wait()
    ps.push(2, _grad(8), 1, 16, hypers=_sgd(0.1)).wait()
    before = _weights(ps)
    ps.push(1, _grad(1), 0, 8, hypers=_sgd(0.04)).wait()  # read version 0, server at 2: tau = 2
    torch.testing.assert_close(_weights(ps), before - (0.04 / 2) * _grad(1).double(), rtol=0, atol=1e-7)


def test_dcasgd_compensates_then_steps_at_the_pushed_lr() -> None:
    """Zheng et al.'s update with a pushed lr: w <- w - lr_r (g + lambda g * g * (w - w_read))."""
    lam = 0.5
    ps = _server("dcasgd", dc_lambda=lam)
    read = _weights(ps)
    ps.pull(1)
    ps.pull(2)
    ps.push(2, _grad(2), 0, 8, hypers=_sgd(0.1)).wait()  # worker 2 moves the weights on
    w = _weights(ps)
    ps.push(1, _grad(1), 0, 8, hypers=_sgd(0.02)).wait()
    g = _grad(1).double()
    torch.testing.assert_close(_weights(ps), w - 0.02 * (g + lam * g * g * (w - read)), rtol=0, atol=1e-7)


def test_adams_betas_and_weight_decay_are_the_pushed_ones() -> None:
    """An Adam server takes each push's lr, betas and weight decay: the group holds them when it
    steps, and the step is Adam's with them (torch's Adam on a copy, given them from the start)."""
    ps = _server("asgd", optimizer=lambda m: torch.optim.Adam(m.parameters(), lr=0.01))
    assert ps.hypers.count == 4  # lr, betas (2), weight_decay
    twin = nn.Linear(3, 2)
    twin.load_state_dict(ps.model.state_dict())
    reference = torch.optim.Adam(twin.parameters(), lr=0.003, betas=(0.8, 0.99), weight_decay=0.1)
    for step, seed in enumerate((1, 2)):
        ps.push(1, _grad(seed), step, 8 * (step + 1), hypers=[0.003, 0.8, 0.99, 0.1]).wait()
        for p, g in zip(twin.parameters(), _grad(seed).split([6, 2])):
            p.grad = g.view_as(p)
        reference.step()
    group = ps.optimizer.param_groups[0]
    assert (group["lr"], group["betas"], group["weight_decay"]) == (0.003, (0.8, 0.99), 0.1)
    assert torch.equal(_weights(ps), torch.cat([p.detach().reshape(-1) for p in twin.parameters()]).double())


def test_sync_ps_steps_with_the_lowest_ranks_values_when_they_differ(caplog) -> None:
    ps = _server("sync-ps")
    w = _weights(ps)
    first = ps.push(2, _grad(2), 0, 8, hypers=_sgd(0.05))
    ps.push(1, _grad(1), 0, 8, hypers=_sgd(0.1))
    first.wait()
    mean = (_grad(1).double() + _grad(2).double()) / 2
    torch.testing.assert_close(_weights(ps), w - 0.1 * mean, rtol=0, atol=1e-7)
    assert sum("pushed different optimiser settings" in r.getMessage() for r in caplog.records) == 1


@pytest.mark.parametrize(
    "values, said",
    [
        (_sgd(float("nan")), "lr of parameter group 0 is nan"),
        (_sgd(-0.1), "lr of parameter group 0 is -0.1"),
        (_sgd(1e300), "lr of parameter group 0 is 1e[+]300"),  # inf in float32, as the kernels take it
        (_sgd(0.1, momentum=float("inf")), "momentum of parameter group 0 is inf"),
        (_sgd(0.1, weight_decay=-1.0), "weight_decay of parameter group 0 is -1.0"),
        ([0.1, 0.0], "2 hyperparameters where the optimiser has 3"),
    ],
)
def test_values_the_optimiser_cannot_step_with_change_nothing(values: list[float], said: str) -> None:
    ps = _server("asgd")
    before = _weights(ps)
    with pytest.raises(ConnectionError, match=said):
        ps.push(1, _grad(1), 0, 8, hypers=values)
    assert torch.equal(_weights(ps), before) and ps.version == 0 and ps.counts[1] == 0
    assert ps.optimizer.param_groups[0]["lr"] == BASE_LR


# --- What a worker's optimiser may be, checked on the worker ---------------------------------------


def test_the_workers_values_are_read_in_order_and_checked() -> None:
    from distsgd.algorithms.param_server.hyper import Hyperparameters
    from distsgd.errors import ConfigError

    model = nn.Linear(3, 2)
    opt = torch.optim.SGD(
        [{"params": [model.weight], "weight_decay": 0.01}, {"params": [model.bias]}], lr=0.1, momentum=0.9
    )
    hypers = Hyperparameters.of(opt, model)
    assert [g.names() for g in hypers.groups] == [["lr", "momentum", "weight_decay"]] * 2
    assert hypers.read(opt) == [0.1, 0.9, 0.01, 0.1, 0.9, 0.0]
    opt.param_groups[1]["lr"] = -0.5  # a linear decay past its end
    with pytest.raises(ConfigError, match=r"at step 7, the optimiser's lr of parameter group 1 is -0.5 \(it must be"):
        hypers.read(opt, 7)
    opt.param_groups[1]["lr"] = 0.1
    opt.add_param_group({"params": [nn.Parameter(torch.zeros(1))]})
    with pytest.raises(ConfigError, match=r"parameter groups changed after run.setup\(\) \(3 now, 2 when"):
        hypers.read(opt)


def test_groups_that_hold_other_parameters_do_not_match() -> None:
    from distsgd.algorithms.param_server.hyper import Hyperparameters

    model = nn.Linear(3, 2)
    split = Hyperparameters.of(torch.optim.SGD([{"params": [model.weight]}, {"params": [model.bias]}], lr=0.1), model)
    swapped = Hyperparameters.of(torch.optim.SGD([{"params": [model.bias]}, {"params": [model.weight]}], lr=0.1), model)
    adam = Hyperparameters.of(torch.optim.Adam([{"params": [model.weight]}, {"params": [model.bias]}]), model)
    assert split.mismatch(split) is None
    assert split.mismatch(swapped) == "its parameter group 0 holds other parameters of the model than the server's"
    assert split.mismatch(adam) == (
        "its parameter group 0 has lr, betas, weight_decay over 1 tensors, the server's lr, momentum, weight_decay over 1 tensors"
    )
    whole = Hyperparameters.of(torch.optim.SGD(model.parameters(), lr=0.1), model)
    assert split.mismatch(whole) == "it has 1 parameter groups, the server's optimiser 2"


def past_its_end_loop(run: distsgd.Run) -> nn.Module:
    """A linear decay to 0 over 3 steps that goes on past its end: a negative lr at the 5th step."""
    data = load_dataset("digits")
    model, opt = run.setup()
    scheduler = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1 - s / 3)
    for x, y in run.loader(TensorDataset(data.x_train, data.y_train)):
        opt.zero_grad()
        run.backward(F.cross_entropy(model(x), y))
        opt.step()
        scheduler.step()
    return run.final_model()


@pytest.mark.slow
def test_a_negative_lr_is_refused_in_one_line() -> None:
    from distsgd.errors import DistsgdError

    with pytest.raises(DistsgdError) as refused:
        distsgd.spawn(
            past_its_end_loop, model=Net, algo="asgd", workers=2, epochs=1, batch_size=32, lr=BASE_LR, quiet=True
        )
    message = str(refused.value)
    assert "\n" not in message
    assert "at step 5, the optimiser's lr of parameter group 0 is -0.0333" in message, message
    assert "the parameter server cannot step with it" in message
