"""ddp: synchronous data parallel through PyTorch's DistributedDataParallel, the reference.

Same update rule as ``allreduce``: g = (1/W) sum_r grad L(w; batch_r), w <- w - lr * g. DDP
averages the gradients with bucketed all-reduces during backward (``--bucket-mb`` sets its
``bucket_cap_mb``), and broadcasts rank 0's weights at construction.

``--compress fp16|powersgd[:R]`` registers torch's own communication hooks (``fp16_compress_hook``;
``powerSGD_hook`` with error feedback, warm start and rank R, compressing from the 3rd step:
``start_powerSGD_iter`` 2); ``bytes_sent`` counts what each hook all-reduces, bucket by bucket.
On gloo (CPU), ``--compress powersgd`` puts every gradient in one bucket, whatever ``--bucket-mb``:
with two or more, torch's hook aborts the process (``gloo::EnforceNotMet``: any model over 25 MB at
the default bucket size; docs/BENCHMARKS.md).

Buffers (BatchNorm statistics): DDP's own rule, ``broadcast_buffers=True``: before every forward
rank 0's buffers are broadcast to the others, so each step's statistics are rank 0's. After the
last step rank 0's buffers are broadcast once more, so every replica ends equal to the model
that is returned, evaluated and saved (rank 0's).
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable

import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
from torch.nn.parallel import DistributedDataParallel

from distsgd.algorithms import compress
from distsgd.algorithms.allreduce import BucketOptions, refuse_powersgd_resync
from distsgd.algorithms.averaging import broadcast_
from distsgd.algorithms.base import GroupAlgorithm, register
from distsgd.config import RunConfig
from distsgd.train.context import Start, Step, WorkerContext


@register
class DDP(GroupAlgorithm[BucketOptions]):
    name = "ddp"
    kind = "data parallel"
    summary_line = "the same through PyTorch's DistributedDataParallel, the reference"

    hooked: bool  # --compress: a communication hook of torch's counts what it sends
    # built by setup:
    grad_bytes: int  # what DDP all-reduces a step without a hook
    buffer_bytes: int  # what rank 0 broadcasts before every forward

    def __init__(self, cfg: RunConfig, seat: object = None) -> None:
        super().__init__(cfg, seat)
        self.hooked = self.opts.compress != "none"

    def setup(self, ctx: WorkerContext, model: nn.Module, start: Start) -> nn.Module:
        model = super().setup(ctx, model, start)
        self.grad_bytes = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
        self.buffer_bytes = sum(b.numel() * b.element_size() for b in model.buffers())
        how, rank = compress.parse(self.opts.compress)
        bucket_mb = self.opts.bucket_mb
        if how == "powersgd" and dist.get_backend() == "gloo":
            bucket_mb = max(bucket_mb, self.grad_bytes / 2**20 + 1)  # one bucket: see the module's docstring
        ddp = DistributedDataParallel(
            model, bucket_cap_mb=bucket_mb, device_ids=[ctx.device] if ctx.device.type == "cuda" else None
        )
        if how == "fp16":
            ddp.register_comm_hook(
                None, self._counting(default_hooks.fp16_compress_hook, lambda b: b.buffer().numel() * 2)
            )
        elif how == "powersgd":
            state = powerSGD_hook.PowerSGDState(
                process_group=None,
                matrix_approximation_rank=rank,
                start_powerSGD_iter=compress.START_ITER,
                min_compression_rate=compress.MIN_COMPRESSION_RATE,
                use_error_feedback=True,
                warm_start=True,
            )
            ddp.register_comm_hook(
                state,
                self._counting(
                    powerSGD_hook.powerSGD_hook,
                    lambda b: (
                        b.buffer().numel() * 4
                        if state.iter < state.start_powerSGD_iter
                        else compress.powersgd_bytes(b.gradients(), rank)
                    ),
                ),
            )
        return ddp

    def _counting(self, hook: Callable, nbytes: Callable[[dist.GradBucket], int]) -> Callable:
        """torch's ``hook``, and the bytes it all-reduces for each bucket counted first. (No
        annotations: DDP checks a hook's, and under postponed evaluation they would be strings.)"""

        def counted(state, bucket):
            self.sent(nbytes(bucket), self.world)
            return hook(state, bucket)

        return counted

    def no_sync(self, ctx: WorkerContext, model: nn.Module) -> contextlib.AbstractContextManager:
        assert isinstance(model, DistributedDataParallel)  # the model setup returned
        return model.no_sync()  # DDP's own: accumulate, reduce at the last micro-batch

    def check_resynced(self, ctx: WorkerContext) -> None:
        refuse_powersgd_resync(self.name, self.opts.compress)

    def after_backward(self, ctx: WorkerContext, model: nn.Module, step: Step) -> None:
        # DDP has already averaged the gradients during backward; count what it sent (a hook counts
        # its own), and, on rank 0, the buffers it broadcast before the forward.
        if not self.hooked:
            self.sent(self.grad_bytes, self.world)
        if ctx.rank == 0:
            self.bytes_sent += self.buffer_bytes * (self.world - 1)

    def unwrap(self, model: nn.Module) -> nn.Module:
        # Evaluating through the wrapper would run DDP's forward (and its collectives) on rank 0 alone.
        return model.module if isinstance(model, DistributedDataParallel) else model

    def final_model(self, ctx: WorkerContext, model: nn.Module) -> nn.Module:
        module = self.unwrap(model)
        sent = broadcast_(list(module.buffers()))
        if ctx.rank == 0:
            self.bytes_sent += sent * (self.world - 1)
        return module

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """A resumed ``ddp --compress powersgd`` starts like a new run: ``start_powerSGD_iter`` (2)
        uncompressed steps, then compression with fresh error feedback and warm-start memory.
        torch's hook keeps those flat in DDP's bucket layout, which a new DDP rebuilds after its
        first step (hence torch's start_powerSGD_iter > 1): compressing at once would add the
        saved or first step's memory to the wrong gradients, or, with several buckets, fail on
        their sizes. (So a resumed run is not bit-exact; ``allreduce --compress powersgd`` is.)"""
        super().load_state_dict(state)
