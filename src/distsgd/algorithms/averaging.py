"""Helpers shared by the model-averaging algorithms: flat views of parameters and their all-reduce."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn


def flatten(tensors: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat([t.detach().reshape(-1) for t in tensors])


def unflatten_into(flat: torch.Tensor, tensors: list[torch.Tensor]) -> None:
    offset = 0
    with torch.no_grad():
        for t in tensors:
            n = t.numel()
            t.copy_(flat[offset:offset + n].view_as(t))
            offset += n


def allreduce_mean_(tensors: list[torch.Tensor], world: int) -> int:
    """Average ``tensors`` across the group in place with one all-reduce; return the bytes reduced."""
    flat = flatten(tensors)
    dist.all_reduce(flat)
    flat.div_(world)
    unflatten_into(flat, tensors)
    return flat.numel() * flat.element_size()


def params(model: nn.Module) -> list[torch.Tensor]:
    return [p for p in model.parameters()]
