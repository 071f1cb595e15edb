"""Optimisers and learning-rate schedules, built from the run's settled configuration (``api.settle``
has set ``lr``, ``optimizer``, ``weight_decay``, ... : a config built in code goes through
``config.resolve`` first)."""

from __future__ import annotations

import math
from typing import Any, Callable

import torch

from distsgd.config import RunConfig
from distsgd.errors import ConfigError


def internal(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """Mark an optimiser an algorithm builds for itself (DiLoCo's outer SGD over its own copy of
    the weights): a user's loop that steps parameters not the model's is refused (own_loop), its
    updates kept on one worker alone; this one's are the algorithm's."""
    optimizer.__dict__["_distsgd_internal"] = True
    return optimizer


def is_internal(optimizer: torch.optim.Optimizer) -> bool:
    return bool(optimizer.__dict__.get("_distsgd_internal"))


def build_optimizer(
    cfg: RunConfig, model: torch.nn.Module, custom: Callable | None = None, groups: Callable | None = None
) -> torch.optim.Optimizer:
    """``custom(model)`` if given; else ``--optimizer`` (``sgd`` with momentum, nesterov and weight
    decay, ``adam``, ``adamw``) at ``cfg.lr`` over ``groups(model)`` (per-group options such as
    their own lr) or all parameters. With ``--weight-decay-on weights`` only the weights of layers
    and embeddings (parameters of 2 or more dimensions) decay, not biases nor the scales of
    LayerNorm and BatchNorm (:func:`decay_groups`). Each group remembers its lr as ``base_lr``:
    the schedule scales every group's own."""
    if custom is not None:
        optimizer = custom(model)
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise ConfigError(f"optimizer= returned {type(optimizer).__name__}, not a torch.optim.Optimizer")
    else:
        kind, lr, decay = cfg.optimizer, settled_lr(cfg), cfg.weight_decay
        assert decay is not None, "a settled configuration"
        params: Any = (
            groups(model)
            if groups is not None
            else decay_groups(model, decay)
            if cfg.weight_decay_on == "weights" and decay > 0
            else list(model.parameters())
        )
        # --cuda-graphs on a GPU: Adam's step count stays on the GPU, so that its update can be captured
        capturable = cfg.cuda_graphs and any(p.is_cuda for p in model.parameters())
        if kind == "sgd":
            optimizer = torch.optim.SGD(params, lr=lr, momentum=cfg.momentum, nesterov=cfg.nesterov, weight_decay=decay)
        elif kind == "adam":
            optimizer = torch.optim.Adam(params, lr=lr, weight_decay=decay, capturable=capturable)
        elif kind == "adamw":
            optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=decay, capturable=capturable)
        else:
            raise ValueError(f"unknown optimizer {kind!r}")
    for group in optimizer.param_groups:
        group.setdefault("base_lr", group["lr"])
    return optimizer


def settled_lr(cfg: RunConfig) -> float:
    """The run's --lr (the schedule scales it), which ``api.settle`` (or ``config.resolve``) set."""
    assert cfg.lr is not None, "a settled configuration"
    return cfg.lr


def decay_groups(model: torch.nn.Module, decay: float) -> list[dict[str, Any]]:
    """Two parameter groups: the weights of layers and embeddings (2 or more dimensions) with
    weight decay, biases and normalisation scales (1 dimension) without it (as GPT-2's and BERT's
    training code do: decaying a LayerNorm's scale towards 0 only fights the normalisation)."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    return [g for g in groups if g["params"]]


def warmup_factor(cfg: RunConfig, step: int) -> float:
    """``--lr-warmup-steps W``: the lr of step ``step`` (from 1) is scaled by step / W up to W."""
    warm = cfg.lr_warmup_steps
    return min(1.0, max(step, 1) / warm) if warm else 1.0


def lr_at(cfg: RunConfig, epoch_progress: float, total_epochs: float) -> float:
    """The learning rate after ``epoch_progress`` epochs (fractional) of ``total_epochs``.

    ``constant``: lr. ``step``: lr * gamma^floor(epoch / lr_step_epochs).
    ``cosine``: lr * (1 + cos(pi * epoch / total_epochs)) / 2, annealed to 0 at the end.
    """
    lr = settled_lr(cfg)
    if cfg.schedule == "constant":
        return lr
    if cfg.schedule == "step":
        return lr * cfg.lr_gamma ** math.floor(epoch_progress / cfg.lr_step_epochs)
    if cfg.schedule == "cosine":
        fraction = min(1.0, epoch_progress / total_epochs) if total_epochs > 0 else 1.0
        return lr * 0.5 * (1.0 + math.cos(math.pi * fraction))
    raise ValueError(f"unknown schedule {cfg.schedule!r}")


def schedule_needs_epochs(schedule: str, own_loop: bool) -> str:
    """The one line refusing ``--schedule`` where an epoch's length is not known (a stream's)."""
    way = "give spawn(train_size=N), or " if own_loop else ""
    return (
        f"--schedule {schedule} moves with the epochs, and a stream's epoch has no known length: "
        f"{way}use --schedule constant (--lr-warmup-steps still warms up)"
    )


def scheduled(cfg: RunConfig) -> bool:
    """Whether the lr changes during the run (a schedule or a warm-up)."""
    return cfg.schedule != "constant" or bool(cfg.lr_warmup_steps)


def schedule_lr(
    optimizer: torch.optim.Optimizer,
    cfg: RunConfig,
    epoch_progress: float,
    total_epochs: float,
    step: int | None = None,
) -> None:
    """Every group's lr at this point of the schedule: its own ``base_lr`` times lr_at / lr, times
    the warm-up's factor at update ``step`` (from 1; None: no warm-up)."""
    factor = lr_at(cfg, epoch_progress, total_epochs) / settled_lr(cfg)
    if step is not None:
        factor *= warmup_factor(cfg, step)
    for group in optimizer.param_groups:  # (a group added since the last step: its lr is its base, as a new one's)
        group["lr"] = group.setdefault("base_lr", group["lr"]) * factor
