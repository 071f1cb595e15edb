"""ddp: synchronous data parallel through PyTorch's DistributedDataParallel, the reference.

Same update rule as ``allreduce``: g = (1/W) sum_r grad L(w; batch_r), w <- w - lr * g. DDP
averages the gradients with bucketed all-reduces during backward (``--bucket-mb`` sets its
``bucket_cap_mb``), and broadcasts rank 0's weights at construction.
"""

from __future__ import annotations

from torch import nn
from torch.nn.parallel import DistributedDataParallel

from distsgd.algorithms.base import GroupAlgorithm, register
from distsgd.train.loop import WorkerContext


@register
class DDP(GroupAlgorithm):
    name = "ddp"
    summary_line = "synchronous data parallel through torch DistributedDataParallel (the reference)"

    def setup(self, ctx: WorkerContext, model: nn.Module) -> nn.Module:
        self.world = ctx.world
        self._grad_bytes = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
        return DistributedDataParallel(model, bucket_cap_mb=self.cfg.bucket_mb)

    def after_backward(self, ctx: WorkerContext, model: nn.Module) -> None:
        # DDP has already averaged the gradients during backward; count what it sent.
        self.sent(self._grad_bytes, self.world)

    def evaluation_model(self, model: nn.Module) -> nn.Module:
        # Evaluating through the wrapper would run DDP's forward (and its collectives) on rank 0 alone.
        return model.module if isinstance(model, DistributedDataParallel) else model

    def local_module(self, model: nn.Module) -> nn.Module:
        return self.evaluation_model(model)

    def finish(self, ctx: WorkerContext, model: nn.Module) -> nn.Module:
        return self.evaluation_model(model)
