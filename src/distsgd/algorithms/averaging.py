"""Flat views of a model's state and their collectives: the one helper every algorithm uses.

A model's state is its parameters, its floating-point buffers (BatchNorm's running mean and
variance) and its integer buffers (BatchNorm's ``num_batches_tracked``). Averaging algorithms
average the first two and *copy* the integer ones (the mean of two counters is no counter, and
``mean()`` of an integer tensor fails), the way DDP broadcasts buffers rather than reducing them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn

from distsgd.errors import ConfigError
from distsgd.train import membership

if TYPE_CHECKING:
    from distsgd.algorithms.easgd import EASGDOptions


def params(model: nn.Module) -> list[torch.Tensor]:
    return list(model.parameters())


def float_buffers(model: nn.Module) -> list[torch.Tensor]:
    """The floating-point buffers the workers share (averaged, pushed), in ``model.buffers()``'s
    order. A non-persistent one, not in the model's state (a rotary cache, a truncated-BPTT hidden
    state carried in ``register_buffer(..., persistent=False)``), is each worker's own, as under
    Hogwild!: averaged, a carried state mixed the workers' sequences (an audit's: 0.077 from each
    worker keeping its own under allreduce, 0.033 under local-sgd, exit 0)."""
    seen: set[int] = set()
    shared = []
    for module in model.modules():
        for name, b in module._buffers.items():
            if b is None or id(b) in seen or name in module._non_persistent_buffers_set:
                continue
            seen.add(id(b))
            if b.dtype.is_floating_point:
                shared.append(b)
    return shared


def int_buffers(model: nn.Module) -> list[torch.Tensor]:
    return [b for b in model.buffers() if not b.dtype.is_floating_point]


def averaged(model: nn.Module) -> list[torch.Tensor]:
    """What averaging algorithms average: parameters, then floating-point buffers."""
    return params(model) + float_buffers(model)


def flatten(tensors: list[torch.Tensor]) -> torch.Tensor:
    """One new contiguous 1-D tensor holding ``tensors`` in order."""
    if not tensors:
        return torch.zeros(0)
    return torch.cat([t.detach().reshape(-1) for t in tensors])


def unflatten_into(flat: torch.Tensor, tensors: list[torch.Tensor], add: bool = False) -> None:
    """Copy (or, with ``add``, add) consecutive pieces of ``flat`` into ``tensors``, in place."""
    offset = 0
    with torch.no_grad():
        for t in tensors:
            n = t.numel()
            piece = flat[offset : offset + n].view_as(t)
            t.add_(piece) if add else t.copy_(piece)
            offset += n


def flat_view_(tensors: list[torch.Tensor]) -> torch.Tensor:
    """Move ``tensors`` (parameters) into one new flat buffer and make each a view of its piece;
    return the buffer. Writing the buffer then writes them all, with one copy. They must share a
    dtype (one buffer has one)."""
    dtypes = {t.dtype for t in tensors}
    if len(dtypes) > 1:
        raise ConfigError(
            f"this algorithm keeps the parameters as one flat tensor, and this model's have several "
            f"dtypes ({', '.join(sorted(str(d) for d in dtypes))}): give them one"
        )
    flat = flatten(tensors).clone()
    offset = 0
    for t in tensors:
        n = t.numel()
        t.data = flat[offset : offset + n].view_as(t)
        offset += n
    return flat


def add_into(flat: torch.Tensor, tensors: list[torch.Tensor]) -> None:
    """Add consecutive pieces of ``flat`` to ``tensors`` in place."""
    unflatten_into(flat, tensors, add=True)


def allreduce_mean_(tensors: list[torch.Tensor], world: int) -> int:
    """Average ``tensors`` across the group in place with one all-reduce; return the bytes reduced."""
    if not tensors:
        return 0
    flat = flatten(tensors)
    membership.call(dist.all_reduce, flat)
    flat.div_(world)
    unflatten_into(flat, tensors)
    return flat.numel() * flat.element_size()


def refuse_sparse(p: torch.Tensor, algo: str, into: str) -> None:
    """A sparse gradient (``nn.Embedding(sparse=True)``) where ``algo`` flattens gradients
    ``into`` dense buffers: one line (it was torch's "reshape is not implemented for sparse
    tensors", a traceback)."""
    if p.grad is not None and p.grad.is_sparse:
        raise ConfigError(
            f"a parameter of shape {tuple(p.shape)} has a sparse gradient (nn.Embedding(sparse=True)?), which "
            f"{algo} cannot put into {into}: train it under ddp or local-sgd, or make it dense (sparse=False)"
        )


def flagged_grads(params: Sequence[torch.Tensor], flags: torch.Tensor) -> tuple[list[torch.Tensor], bool]:
    """Each parameter's gradient to all-reduce, zeros where it has none here (frozen, or unused in
    this forward), and ``flags`` (one element a parameter, reduced with them) 1 where it has one,
    0 where not; and whether any has none."""
    grads = [torch.zeros_like(p) if p.grad is None else p.grad for p in params]
    absent = [i for i, p in enumerate(params) if p.grad is None]
    flags.fill_(1)
    for i in absent:
        flags[i] = 0
    return grads, bool(absent)


def take_flagged(params: Sequence[torch.Tensor], grads: list[torch.Tensor], flags: torch.Tensor, absent: bool) -> None:
    """After :func:`flagged_grads`' gradients and flags were reduced: a parameter's gradient is the
    reduced one where any rank had one (DDP's mean, zeros counted), and stays None where no rank
    had one, so that the optimiser leaves it alone, as in one process. The flags are read (a GPU's
    wait) only where this rank had a parameter without a gradient."""
    anywhere = flags.tolist() if absent else []
    for i, (p, g) in enumerate(zip(params, grads)):
        if p.grad is not None or anywhere[i] > 0:
            p.grad = g


def broadcast_(tensors: list[torch.Tensor], src: int = 0) -> int:
    """Make ``tensors`` rank ``src``'s, with one broadcast a dtype; return the bytes of the messages.
    (One flat tensor of them all took the dtype torch.cat promotes to: an int64 buffer among fp16
    parameters, a transformer's position ids, came back rounded, 2999 as 3000; in bf16 as 2992.)"""
    sent = 0
    for dtype in dict.fromkeys(t.dtype for t in tensors):
        alike = [t for t in tensors if t.dtype == dtype]
        flat = flatten(alike)
        membership.call(dist.broadcast, flat, src=src)
        unflatten_into(flat, alike)
        sent += flat.numel() * flat.element_size()
    return sent


def average_buffers_(model: nn.Module, world: int) -> int:
    """Average floating-point buffers across the group; copy rank 0's integer ones. Returns the
    bytes all-reduced."""
    sent = allreduce_mean_(float_buffers(model), world)
    broadcast_(int_buffers(model))
    return sent


class BufferVersions:
    """The in-place versions of a model's buffers at the last :meth:`mark` (a step): whether a
    user's loop changed them since (BatchNorm statistics recomputed after training), found
    without a look at their values."""

    buffers: list[torch.Tensor]
    seen: list[int]

    def __init__(self, model: nn.Module) -> None:
        self.buffers = list(model.buffers())
        self.mark()

    def mark(self) -> None:
        self.seen = [b._version for b in self.buffers]

    def changed(self) -> bool:
        return [b._version for b in self.buffers] != self.seen


def adopt_buffers_(target: nn.Module, model: nn.Module, changed: bool, world: int) -> int:
    """Where any worker's ``model`` has ``changed`` its buffers since the algorithm last took them
    (BatchNorm statistics recomputed after the last step, SWA's ``update_bn``), ``target`` (the
    model returned: theta, the centre) takes the workers' buffers as an averaging does; else it is
    left alone. Every worker calls it: one all-reduce of a flag (and of the buffers). Returns the
    bytes all-reduced; a model without buffers (the same on every worker) makes no call."""
    buffers = list(model.buffers())
    if not buffers:
        return 0
    flag = torch.tensor([float(changed)], device=buffers[0].device)  # (NCCL's collectives take CUDA tensors)
    sent = allreduce_mean_([flag], world)
    if flag.item() > 0:
        with torch.no_grad():
            for mine, theirs in zip(model.buffers(), target.buffers()):
                theirs.copy_(mine)
        sent += average_buffers_(target, world)
    return sent


def average_model_(model: nn.Module, world: int) -> int:
    """Average parameters and floating-point buffers across the group; copy rank 0's integer
    buffers. Returns the bytes all-reduced (the integer buffers' broadcast is a few bytes)."""
    sent = allreduce_mean_(averaged(model), world)
    broadcast_(int_buffers(model))
    return sent


def elastic_alpha(opts: EASGDOptions, workers: int) -> float:
    """EASGD's elastic strength: ``--alpha`` (``opts.alpha``), by default beta / N with beta = N alpha = 0.9."""
    return opts.alpha if opts.alpha is not None else 0.9 / workers


def mean_state(states: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """The average of several state dicts of one architecture: floating-point entries are
    averaged, integer ones (counters) are taken from the first."""
    return {
        k: (
            torch.stack([s[k].detach() for s in states]).mean(dim=0)
            if v.dtype.is_floating_point
            else v.detach().clone()
        )
        for k, v in states[0].items()
    }


def max_abs_diff(model: nn.Module, world: int) -> float:
    """How far the replicas of ``model`` are apart: max over its state (parameters and all buffers)
    of (max over ranks - min over ranks). 0.0 when every replica holds the same values."""
    flat = flatten([t.double() for t in list(model.parameters()) + list(model.buffers())])
    if world == 1 or flat.numel() == 0:
        return 0.0
    hi, lo = flat.clone(), flat.clone()
    membership.call(dist.all_reduce, hi, op=dist.ReduceOp.MAX)
    membership.call(dist.all_reduce, lo, op=dist.ReduceOp.MIN)
    return float((hi - lo).max())
