"""single: one process, plain minibatch SGD. The baseline every other algorithm is measured against.

Update rule: w <- w - lr * grad L(w; batch) (with the chosen optimiser's momentum or moments).
"""

from __future__ import annotations

from distsgd.algorithms.base import SINGLE, Algorithm, register
from distsgd.config import RunConfig
from distsgd.errors import ConfigError


@register
class Single(Algorithm):
    name = "single"
    topology = SINGLE
    summary_line = "one process; the baseline"

    @classmethod
    def check(cls, cfg: RunConfig) -> None:
        if cfg.workers != 1:
            raise ConfigError(f"--algo single runs one worker, got --workers {cfg.workers}")
