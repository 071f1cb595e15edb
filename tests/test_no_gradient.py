"""Parameters with no gradient in a step (unused in the forward, frozen before or during the run)
under the process-group algorithms: in one process their ``.grad`` is None and the optimiser leaves
them alone (no weight decay, no momentum), and synchronous data parallel over two workers must do
the same as one process with the global batch; what DDP cannot synchronise is refused in one line.
References are plain single-process PyTorch in float64 (``torch.optim.SGD``), never distsgd's code.
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

N, B, SEED, STEPS, FREEZE_AT = 256, 16, 0, 6, 2
SGD = {"lr": 0.1, "momentum": 0.9, "weight_decay": 0.01}


class Net(nn.Module):
    """``aux`` joins the output only for a batch holding a sample with x[0] > 1.2 (on a batch
    without one it is unused: no gradient)."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(12, 8), nn.Tanh())
        self.head = nn.Linear(8, 3)
        self.aux = nn.Linear(8, 3)
        self.never = nn.Linear(8, 3)  # in no forward at all

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.body(x)
        out = self.head(h)
        rare = (x[:, 0] > 1.2).to(h.dtype)[:, None]
        if bool(rare.any()):
            out = out + self.aux(h) * rare
        return out


def halves(k: int) -> list[torch.Tensor]:
    """Step k's batches of the two workers: their ``B`` samples each, consecutive in the epoch's
    permutation (the sharded partition's global batch)."""
    order = epoch_indices(N, 0, 0, 1, SEED)
    return [order[2 * B * k + B * r : 2 * B * k + B * (r + 1)] for r in range(2)]


def reference(freeze_body: bool) -> dict[str, torch.Tensor]:
    """One process, float64: step k's loss is the mean over the global batch, each worker's half
    through its own forward (the definition of synchronous data parallel: the gradient is the
    mean of the workers'); ``body`` frozen after ``FREEZE_AT`` steps if asked."""
    model = Net().double()
    model.load_state_dict(initial_weights(Net))
    opt = torch.optim.SGD(model.parameters(), **SGD)
    x, y = toy_dataset().tensors
    for k in range(STEPS):
        if freeze_body and k == FREEZE_AT:
            model.body.requires_grad_(False)
        opt.zero_grad()
        loss = sum(F.cross_entropy(model(x[i].double()), y[i]) for i in halves(k)) / 2
        loss.backward()
        opt.step()
    return weights_of(model)


def loop(run: distsgd.Run, freeze_body: bool) -> nn.Module:
    model, opt = run.setup()
    module = getattr(model, "module", model)
    for x, y in run.loader(toy_dataset(), batch_size=B):
        if freeze_body and run.steps == FREEZE_AT:
            module.body.requires_grad_(False)
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
    return run.final_model()


def test_the_data_has_steps_where_one_worker_uses_aux_and_the_other_does_not() -> None:
    """(What the next test relies on.)"""
    x = toy_dataset().tensors[0]
    used = [[bool((x[i, 0] > 1.2).any()) for i in halves(k)] for k in range(STEPS)]
    assert [True, False] in used or [False, True] in used, used
    assert [False, False] in used or [True, True] in used, used


SYNCHRONOUS = [
    ("allreduce", {"compress": "none"}),
    ("allreduce", {"compress": "fp16"}),
    ("local-sgd", {"warmup_steps": 100}),  # post-local SGD's first steps: allreduce's
]


@pytest.mark.parametrize("algo, extra", SYNCHRONOUS, ids=["allreduce", "allreduce-fp16", "local-sgd-warmup"])
@pytest.mark.parametrize("freeze_body", [False, True], ids=["unused", "unused-and-frozen"])
def test_a_parameter_no_worker_had_a_gradient_for_is_left_alone(algo: str, extra: dict, freeze_body: bool) -> None:
    """With weight decay and momentum: ``never`` (no forward) and the frozen ``body`` stay exactly as
    one process leaves them, and ``aux``, used by one worker's batch in some steps, moves by the
    mean gradient. Before: allreduce all-reduced every parameter without a gradient as zeros and
    gave it ``.grad`` = 0, so weight decay and momentum moved it (``never`` by 0.003 in 4 steps);
    local-sgd's warm-up all-reduced only the gradients each worker had (of other lengths where
    one worker used ``aux`` and the other did not)."""
    compress = extra.get("compress", "none")
    result = distsgd.spawn(
        functools.partial(loop, freeze_body=freeze_body),
        model=Net,
        algo=algo,
        workers=2,
        batch_size=B,
        max_samples=STEPS * 2 * B,
        quiet=True,
        **extra,
        **SGD,
    )
    assert result.model is not None
    got, ref, start = weights_of(result.model), reference(freeze_body), initial_weights(Net)
    for key in ("never.weight", "never.bias"):
        assert torch.equal(got[key], start[key]), key
    tolerance = 1e-5 if compress == "none" else 2e-3
    assert max((got[k] - ref[k]).abs().max().item() for k in got) < tolerance
    assert (got["aux.weight"] - start["aux.weight"]).abs().max() > 1e-3  # aux trained


def unfreezes(run: distsgd.Run) -> nn.Module:
    model, opt = run.setup()
    module = getattr(model, "module", model)
    for x, y in run.loader(toy_dataset(), batch_size=B):
        if run.steps == 1:
            module.never.requires_grad_(True)
            module.never.weight.grad = None
        opt.zero_grad()
        out = model(x)
        (F.cross_entropy(out, y) + module.never(module.body(x)).sum() * 0.0).backward()
        opt.step()
    return run.final_model()


def never_frozen() -> Net:
    net = Net()
    net.never.requires_grad_(False)
    return net


def extras_frozen() -> Net:
    net = never_frozen()
    net.aux.requires_grad_(False)
    return net


def through_a_method(run: distsgd.Run) -> nn.Module:
    model, opt = run.setup()
    for x, y in run.loader(toy_dataset(), batch_size=B):
        opt.zero_grad()
        inner = getattr(model, "module", model)  # as a siamese loop reaches its embedding
        F.cross_entropy(inner.head(inner.body(x)), y).backward()
        opt.step()
    return run.final_model()


def twice_through_one_forward(run: distsgd.Run) -> nn.Module:
    model, opt = run.setup()
    for x, y in run.loader(toy_dataset(), batch_size=B):
        opt.zero_grad()
        out = model(x)
        F.cross_entropy(out, y).backward(retain_graph=True)
        out.pow(2).mean().backward()
        opt.step()
    return run.final_model()


def freezes_keeping_zeros(run: distsgd.Run) -> nn.Module:
    """extras_frozen's model; after the second step its head is frozen too, and the loop's
    zero_grad(set_to_none=False) keeps zeroed gradients (not None) for it."""
    model, opt = run.setup()
    for x, y in run.loader(toy_dataset(), batch_size=B):
        if run.steps == 2:
            getattr(model, "module", model).head.requires_grad_(False)
        opt.zero_grad(set_to_none=False)
        F.cross_entropy(model(x), y).backward()
        opt.step()
    return run.final_model()


def plain(run: distsgd.Run) -> nn.Module:
    model, opt = run.setup()
    for x, y in run.loader(toy_dataset(), batch_size=B):
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
    return run.final_model()


@pytest.mark.slow
def test_what_would_leave_gradients_unsynchronised_is_refused_in_one_line() -> None:
    """Each of these trained each worker on its own gradients, exit 0 (ddp's unused parameter
    raised torch's multi-line error at the next forward, after a step on unsynchronised gradients)."""
    cases = [
        (unfreezes, never_frozen, "allreduce", "one frozen then has a gradient now"),
        (unfreezes, never_frozen, "ddp", "one frozen then has a gradient now"),
        (plain, Net, "ddp", r"\.weight has no gradient in this one"),
        (freezes_keeping_zeros, extras_frozen, "ddp", r"head\.weight has no gradient in this one"),
        (through_a_method, extras_frozen, "ddp", "followed none"),
        (twice_through_one_forward, extras_frozen, "ddp", "followed none"),
    ]
    for main, model, algo, match in cases:
        with pytest.raises(distsgd.DistsgdError, match=match) as info:
            distsgd.spawn(main, model=model, algo=algo, workers=2, batch_size=B, max_samples=4 * 2 * B, quiet=True)
        assert "\n" not in str(info.value), (main.__name__, algo)


def test_ddp_trains_as_one_process_when_every_parameter_takes_a_gradient() -> None:
    """(The checks above refuse nothing that DDP synchronises.) ``never`` and ``aux`` frozen in the
    model: DDP leaves them out; the rest is one process's global-batch SGD."""
    result = distsgd.spawn(
        plain, model=extras_frozen, algo="ddp", workers=2, batch_size=B, max_samples=STEPS * 2 * B, quiet=True, **SGD
    )
    assert result.model is not None
    model = Net().double()
    model.load_state_dict(initial_weights(Net))
    model.never.requires_grad_(False)
    model.aux.requires_grad_(False)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], **SGD)
    x, y = toy_dataset().tensors
    for k in range(STEPS):
        opt.zero_grad()
        (sum(F.cross_entropy(model(x[i].double()), y[i]) for i in halves(k)) / 2).backward()
        opt.step()
    got, ref = weights_of(result.model), weights_of(model)
    assert max((got[k] - ref[k]).abs().max().item() for k in got) < 1e-5


def stale_frozen() -> Net:
    """``never`` frozen with a gradient of an earlier pass left on it (a loop that never clears it)."""
    net = never_frozen()
    net.never.weight.grad = torch.ones_like(net.never.weight)
    return net


def trainable_only(run: distsgd.Run) -> nn.Module:
    """An optimiser of the trainable parameters alone: its zero_grad never clears ``never``'s."""
    model, opt = run.setup(lambda m: torch.optim.SGD([p for p in m.parameters() if p.requires_grad], lr=0.1))
    for x, y in run.loader(toy_dataset(), batch_size=B):
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # the stale gradient too, in place
        opt.step()
    assert getattr(model, "module", model).never.weight.grad is not None
    return run.final_model()


def test_a_frozen_parameters_old_gradient_is_not_taken_for_an_unfreezing() -> None:
    result = distsgd.spawn(
        trainable_only, model=stale_frozen, algo="allreduce", workers=2, batch_size=B, max_samples=2 * 2 * B, quiet=True
    )
    assert result.model is not None


def freezes_at_a_round(run: distsgd.Run) -> nn.Module:
    """``body`` frozen after the first round (2 steps): it must end as it was then."""
    model, opt = run.setup()
    module = getattr(model, "module", model)
    then = None
    for x, y in run.loader(toy_dataset(), batch_size=B):
        if run.steps == 2:
            module.body.requires_grad_(False)
            then = module.body[0].weight.detach().clone()
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
    final = run.final_model()
    assert then is not None and torch.equal(final.body[0].weight, then), "the frozen body moved"
    return final


def test_diloco_leaves_a_parameter_frozen_during_the_run_alone() -> None:
    """Its pseudo-gradient is zero from then on, but was given to the outer Nesterov SGD, whose
    momentum moved it on for rounds (before)."""
    result = distsgd.spawn(
        freezes_at_a_round,
        model=Net,
        algo="diloco",
        workers=2,
        batch_size=B,
        max_samples=STEPS * 2 * B,
        sync_every="2",
        quiet=True,
    )
    assert result.model is not None
