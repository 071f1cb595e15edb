"""Optimisers and learning-rate schedules, built from the run configuration."""

from __future__ import annotations

import math
from typing import Any, Callable

import torch

from distsgd.config import RunConfig, value
from distsgd.errors import ConfigError


def build_optimizer(cfg: RunConfig, model: torch.nn.Module, custom: Callable | None = None,
                    groups: Callable | None = None) -> torch.optim.Optimizer:
    """``custom(model)`` if given; else ``--optimizer`` (``sgd`` with momentum, nesterov and weight
    decay, ``adam``, ``adamw``) at ``cfg.lr`` over ``groups(model)`` (per-group options such as
    their own lr) or all parameters. Each group remembers its lr as ``base_lr``: the schedule
    scales every group's own."""
    if custom is not None:
        optimizer = custom(model)
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise ConfigError(f"optimizer= returned {type(optimizer).__name__}, not a torch.optim.Optimizer")
    else:
        params: Any = groups(model) if groups is not None else list(model.parameters())
        lr, decay = value(cfg, "lr"), value(cfg, "weight_decay")
        if cfg.optimizer == "sgd":
            optimizer = torch.optim.SGD(params, lr=lr, momentum=cfg.momentum, nesterov=cfg.nesterov,
                                        weight_decay=decay)
        elif cfg.optimizer == "adam":
            optimizer = torch.optim.Adam(params, lr=lr, weight_decay=decay)
        elif cfg.optimizer == "adamw":
            optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=decay)
        else:
            raise ValueError(f"unknown optimizer {cfg.optimizer!r}")
    for group in optimizer.param_groups:
        group.setdefault("base_lr", group["lr"])
    return optimizer


def lr_at(cfg: RunConfig, epoch_progress: float, total_epochs: float) -> float:
    """The learning rate after ``epoch_progress`` epochs (fractional) of ``total_epochs``.

    ``constant``: lr. ``step``: lr * gamma^floor(epoch / lr_step_epochs).
    ``cosine``: lr * (1 + cos(pi * epoch / total_epochs)) / 2, annealed to 0 at the end.
    """
    lr = value(cfg, "lr")
    if cfg.schedule == "constant":
        return lr
    if cfg.schedule == "step":
        return lr * cfg.lr_gamma ** math.floor(epoch_progress / cfg.lr_step_epochs)
    if cfg.schedule == "cosine":
        fraction = min(1.0, epoch_progress / total_epochs) if total_epochs > 0 else 1.0
        return lr * 0.5 * (1.0 + math.cos(math.pi * fraction))
    raise ValueError(f"unknown schedule {cfg.schedule!r}")


def schedule_lr(optimizer: torch.optim.Optimizer, cfg: RunConfig, epoch_progress: float, total_epochs: float) -> None:
    """Every group's lr at this point of the schedule: its own ``base_lr`` times lr_at / lr."""
    factor = lr_at(cfg, epoch_progress, total_epochs) / value(cfg, "lr")
    for group in optimizer.param_groups:
        group["lr"] = group.get("base_lr", group["lr"]) * factor
