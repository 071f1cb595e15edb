"""A user's loop's samples in a lockstep group, where its workers' batches may differ.

A lockstep worker counts the run's samples as its own times the workers (and what workers the
group lost had trained): exact, and known at once, while every worker's batches are alike, as
``run.loader``'s are. A loop of its own may give its workers batches of different sizes (a
DataLoader over each worker's own slice, a collate that drops samples): the run's samples were
then the first worker's times the workers (192 for 256 trained), and the workers' stop at
``--max-samples`` came at different steps. So the loop's periodic check of its workers (see
``Run._check_lr_alike``: the first step, every 16th, a resumed loop's first, the end) also
compares their counts (and, resumed, each worker's offset from the checkpoint's count); once they
differ, every step's count is summed over the workers, begun at the step and read when a
figure needs it (by then done: the step's update ran meanwhile). Every worker then reads the same
sum, so they stop at the same step, and every figure is the run's.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:
    from distsgd.algorithms.base import Algorithm
    from distsgd.train.context import WorkerContext


class Sums:
    """The correction to ``local x workers`` (the samples all workers trained, less that)."""

    even: bool  # every look found the workers' counts alike (no correction: none is summed)
    offset: int  # the run's samples less algo.global_samples(local), as of the last sum read
    _pending: tuple[Callable[[], list[int]], int] | None  # a sum in flight and the count it sums

    def __init__(self) -> None:
        self.even, self.offset, self._pending = True, 0, None

    def resumed(self, samples: int, known: int) -> None:
        """A resumed run: its checkpoint's ``samples`` against what this worker's count makes of it,
        until the resumed loop's first step looks at every worker's count (each worker's offset is
        its own: whether the counts differ is decided there, by all of them alike)."""
        self.offset = samples - known

    def step(self, algo: Algorithm, ctx: WorkerContext, local: int, parted: bool) -> None:
        """A step (this worker's ``local`` samples with it): sum the counts once they differ
        (``parted``: the check of this step found them apart)."""
        if parted:
            self.even = False
        if not self.even:
            self.read(algo, ctx)
            self._pending = (algo.sum_started(ctx, [local]), local)

    def read(self, algo: Algorithm, ctx: WorkerContext) -> None:
        """The sum in flight, waited for: the correction as of its step."""
        if self._pending is None:
            return
        done, local = self._pending
        self._pending = None
        (total,) = done()
        self.offset = total + ctx.departed_samples - algo.global_samples(ctx, local)

    def forget(self) -> None:
        """The step in flight is abandoned (its group lost a worker): a sum of the old group's."""
        self._pending = None
