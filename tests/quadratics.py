"""Deterministic per-worker gradients for the update-rule tests of tests/algorithms/.

Each worker i follows the gradient of its own quadratic, L_i(w) = 1/2 sum_k a_ik (w_k - b_ik)^2,
so g_i(w) = a_i * (w - b_i): deterministic, different per worker, and easy to write twice (once
through the algorithm, once in a float64 reference written from its paper). Tests also compute
what a plausible wrong rule would give and check that the implementation is far from it
(:func:`far`): agreement with the reference is then not an accident of the numbers.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any, Callable

import torch
from torch import nn

from distsgd.config import RunConfig, resolve
from distsgd.train.context import Step

N_PARAMS = 2 * 3 + 2  # nn.Linear(3, 2)


def start_weights() -> torch.Tensor:
    torch.manual_seed(0)
    return torch.cat([p.detach().reshape(-1) for p in nn.Linear(3, 2).parameters()]).double()


def quadratic(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(10 + rank)
    return 0.5 + torch.rand(N_PARAMS, generator=g, dtype=torch.float64), torch.randn(
        N_PARAMS, generator=g, dtype=torch.float64
    )


def model_and_grad(rank: int) -> tuple[nn.Module, Callable[[], None]]:
    """A Linear(3, 2) at start_weights() and a function that sets its .grad to g_rank(w)."""
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    a, b = (t.float() for t in quadratic(rank))

    def set_grad() -> None:
        w = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
        g, offset = a * (w - b), 0
        for p in model.parameters():
            p.grad = g[offset : offset + p.numel()].view_as(p).clone()
            offset += p.numel()

    return model, set_grad


def flat(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).double()


def far(a: torch.Tensor, b: torch.Tensor, by: float = 1e-3) -> bool:
    return float((a - b).abs().max()) > by


def config(algo: str, world: int, options: dict[str, Any] | None = None, **settings: Any) -> RunConfig:
    return resolve(RunConfig(algo=algo, workers=world, options=options or {}, **settings))


def context(rank: int, world: int) -> SimpleNamespace:
    """What the hooks read of a WorkerContext, for a worker driven by hand."""
    return SimpleNamespace(world=world, rank=rank, job=SimpleNamespace(optimizer=None, param_groups=None, main=None))


def take_step(
    algo: Any, ctx: Any, model: nn.Module, optimizer: torch.optim.Optimizer, set_grad: Callable, number: int
) -> None:
    """One step as the loop takes it: gradients, after_backward, apply_step, after_step."""
    set_grad()
    step = Step(number=number, samples=0)
    algo.after_backward(ctx, model, step)
    algo.apply_step(ctx, optimizer, step)
    algo.after_step(ctx, model, step)
