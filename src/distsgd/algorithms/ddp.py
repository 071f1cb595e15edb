"""ddp: synchronous data parallel through PyTorch's DistributedDataParallel, the reference.

Same update rule as ``allreduce``: g = (1/W) sum_r grad L(w; batch_r), w <- w - lr * g. DDP
averages the gradients with bucketed all-reduces during backward (``--bucket-mb`` sets its
``bucket_cap_mb``), and broadcasts rank 0's weights at construction.

Buffers (BatchNorm statistics): DDP's own rule, ``broadcast_buffers=True``: before every forward
rank 0's buffers are broadcast to the others, so each step's statistics are rank 0's. After the
last step rank 0's buffers are broadcast once more, so every replica ends equal to the model
that is returned, evaluated and saved (rank 0's).
"""

from __future__ import annotations

import contextlib

from torch import nn
from torch.nn.parallel import DistributedDataParallel

from distsgd.algorithms.allreduce import check_bucket
from distsgd.algorithms.averaging import broadcast_
from distsgd.algorithms.base import GroupAlgorithm, register
from distsgd.config import RunConfig
from distsgd.train.context import WorkerContext


@register
class DDP(GroupAlgorithm):
    name = "ddp"
    summary_line = "synchronous data parallel through torch DistributedDataParallel (the reference)"

    @classmethod
    def check(cls, cfg: RunConfig) -> None:
        check_bucket(cfg)

    def setup(self, ctx: WorkerContext, model: nn.Module) -> nn.Module:
        self.world = ctx.world
        self._grad_bytes = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
        self._buffer_bytes = sum(b.numel() * b.element_size() for b in model.buffers())
        return DistributedDataParallel(model, bucket_cap_mb=self.cfg.bucket_mb)

    def no_sync(self, ctx: WorkerContext, model: nn.Module) -> contextlib.AbstractContextManager:
        return model.no_sync()  # DDP's own: accumulate, reduce at the last micro-batch

    def after_backward(self, ctx: WorkerContext, model: nn.Module) -> None:
        # DDP has already averaged the gradients during backward; count what it sent (and, on
        # rank 0, the buffers it broadcast before the forward).
        self.sent(self._grad_bytes, self.world)
        if ctx.rank == 0:
            self.bytes_sent += self._buffer_bytes * (self.world - 1)

    def unwrap(self, model: nn.Module) -> nn.Module:
        # Evaluating through the wrapper would run DDP's forward (and its collectives) on rank 0 alone.
        return model.module if isinstance(model, DistributedDataParallel) else model

    def final_model(self, ctx: WorkerContext, model: nn.Module) -> nn.Module:
        module = self.unwrap(model)
        sent = broadcast_(list(module.buffers()))
        if ctx.rank == 0:
            self.bytes_sent += sent * (self.world - 1)
        return module
