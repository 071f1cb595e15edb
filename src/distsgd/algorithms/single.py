"""single: one process, plain minibatch SGD. The baseline every other algorithm is measured against.

Update rule: w <- w - lr * grad L(w; batch) (with the chosen optimiser's momentum or moments).
"""

from __future__ import annotations

from distsgd.algorithms.base import Algorithm, NoOptions, register
from distsgd.config import RunConfig
from distsgd.errors import ConfigError


@register
class SingleProcess(Algorithm[NoOptions]):
    name = "single"
    kind = "baseline"
    summary_line = "one process; the baseline every other algorithm is measured against"
    graphable = True

    @classmethod
    def check(cls, cfg: RunConfig) -> None:
        super().check(cfg)
        if cfg.workers != 1:
            raise ConfigError(
                f"--algo single runs one worker, got --workers {cfg.workers}: leave out --algo (allreduce then) "
                f"or choose another"
            )
