"""Optimisers and learning-rate schedules, built from the run configuration."""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch

from distsgd.config import RunConfig


def build_optimizer(cfg: RunConfig, params: Iterable[torch.nn.Parameter]) -> torch.optim.Optimizer:
    """``sgd`` (momentum, nesterov, weight decay), ``adam`` or ``adamw`` at ``cfg.lr``."""
    params = list(params)
    if cfg.optimizer == "sgd":
        return torch.optim.SGD(params, lr=cfg.lr, momentum=cfg.momentum, nesterov=cfg.nesterov,
                               weight_decay=cfg.weight_decay)
    if cfg.optimizer == "adam":
        return torch.optim.Adam(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
    if cfg.optimizer == "adamw":
        return torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
    raise ValueError(f"unknown optimizer {cfg.optimizer!r}")


def lr_at(cfg: RunConfig, epoch_progress: float, total_epochs: float) -> float:
    """The learning rate after ``epoch_progress`` epochs (fractional) of ``total_epochs``.

    ``constant``: lr. ``step``: lr * gamma^floor(epoch / lr_step_epochs).
    ``cosine``: lr * (1 + cos(pi * epoch / total_epochs)) / 2, annealed to 0 at the end.
    """
    if cfg.schedule == "constant":
        return cfg.lr
    if cfg.schedule == "step":
        return cfg.lr * cfg.lr_gamma ** math.floor(epoch_progress / cfg.lr_step_epochs)
    if cfg.schedule == "cosine":
        fraction = min(1.0, epoch_progress / total_epochs) if total_epochs > 0 else 1.0
        return cfg.lr * 0.5 * (1.0 + math.cos(math.pi * fraction))
    raise ValueError(f"unknown schedule {cfg.schedule!r}")


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr
