"""Parameters without a gradient under the parameter server: frozen (``requires_grad=False`` in the
model's constructor, or after ``run.setup``) or unused in the forward. In plain PyTorch their
``.grad`` is None and the optimiser skips them: no weight decay, no momentum. Before each push said
which parameters have a gradient, the worker sent zeros for them and the server's optimiser moved
them by weight decay and momentum (sync-ps by ~3e-3, asgd by ~1e-2 in four steps). Two workers each
time; the reference is one plain PyTorch process taking the global batch, in float64.
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import distsgd
from distsgd.data.partition import epoch_indices
from helpers import initial_weights, toy_dataset, weights_of

N, B, SEED, STEPS = 256, 16, 0, 4  # samples, the batch of each worker, the run's seed, steps
LR, MOMENTUM, DECAY = 0.1, 0.9, 0.01
FROZEN, UNUSED = ["body.0.weight", "body.0.bias"], ["aux.weight", "aux.bias"]


class Net(nn.Module):
    """A body, a head, and an auxiliary head the forward never uses."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(12, 8), nn.Tanh())
        self.head = nn.Linear(8, 3)
        self.aux = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))


class FrozenNet(Net):
    """Its body frozen in the constructor."""

    def __init__(self) -> None:
        super().__init__()
        self.body.requires_grad_(False)


def reference(cls: type[Net], after: bool) -> dict[str, torch.Tensor]:
    """Plain PyTorch in one process: SGD with momentum and weight decay over every parameter, the
    body frozen (``after``: once the optimiser is built), step k on the global batch k (the two
    workers' batches side by side: the sharded partition)."""
    model = cls().double()
    model.load_state_dict(initial_weights(cls))
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM, weight_decay=DECAY)
    if after:
        model.body.requires_grad_(False)
    x, y = toy_dataset().tensors
    order = epoch_indices(N, 0, 0, 1, SEED)
    for k in range(STEPS):
        idx = order[2 * B * k : 2 * B * (k + 1)]
        opt.zero_grad()
        F.cross_entropy(model(x[idx].double()), y[idx]).backward()
        opt.step()
    return weights_of(model)


def loop(run: distsgd.Run, after: bool) -> nn.Module:
    model, opt = run.setup()
    if after:
        getattr(model, "module", model).body.requires_grad_(False)
    for x, y in run.loader(toy_dataset(), batch_size=B):
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
    return run.final_model()


@pytest.mark.parametrize("when", ["constructor", "after setup"])
@pytest.mark.parametrize("algo", ["sync-ps", "asgd"])
def test_parameters_without_a_gradient_stay_where_plain_pytorch_leaves_them(algo: str, when: str) -> None:
    """The frozen body and the unused aux head end exactly at their initial values, as in plain
    PyTorch (weight decay and momentum > 0), while the head trains: under sync-ps as one process
    with the global batch does, under asgd (no deterministic reference) away from its start."""
    after = when == "after setup"
    cls = Net if after else FrozenNet
    result = distsgd.spawn(
        functools.partial(loop, after=after),
        model=cls,
        algo=algo,
        workers=2,
        batch_size=B,
        lr=LR,
        momentum=MOMENTUM,
        weight_decay=DECAY,
        max_samples=STEPS * 2 * B,
        quiet=True,
    )
    assert result.model is not None and result.summary["samples"] >= STEPS * 2 * B  # asgd's workers may step on
    got, start, expected = weights_of(result.model), initial_weights(cls), reference(cls, after)
    for k in FROZEN + UNUSED:
        assert torch.equal(expected[k], start[k]), k  # plain PyTorch leaves them
        assert torch.equal(got[k], start[k]), (k, (got[k] - start[k]).abs().max().item())
    assert (got["head.weight"] - start["head.weight"]).abs().max() > 1e-3  # the others train
    if algo == "sync-ps":
        assert result.summary["server_updates"] == STEPS
        assert max((got[k] - expected[k]).abs().max().item() for k in got) < 1e-5
