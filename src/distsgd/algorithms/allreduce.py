"""allreduce: synchronous data parallel SGD with our own bucketed gradient all-reduce.

Update rule (every worker, every step): g = (1/W) sum_r grad L(w; batch_r), then w <- w - lr * g
with the chosen optimiser. Every replica applies the same averaged gradient to the same weights,
so they stay identical; W workers with batch B equal one process with batch W*B.

How the gradients travel: parameters are packed, in reverse order (the order backward produces
their gradients), into buckets of at most ``--bucket-mb``. A hook on each parameter notes when
its gradient is accumulated; once every gradient of a bucket is ready, the bucket is flattened
into one buffer and its all-reduce starts asynchronously, while backward carries on with the
earlier layers. Buckets start strictly in order, so every rank issues the same collectives in the
same order. After backward, the loop waits for the buckets, divides by W and copies the averages
back into ``.grad``. A parameter with no gradient on a rank (unused in its forward, or frozen after
setup) counts as zero there, and each bucket carries one flag per parameter, summed with the
gradients: a parameter no rank had a gradient for keeps ``.grad`` None, so the optimiser leaves
it alone (no weight decay, no momentum), as in one process and as DDP does. One that was frozen at
setup and has a gradient later is refused (its gradient would stay each replica's own). One collective per bucket, not one per tensor (Li et al., "PyTorch
Distributed", VLDB 2020, describe the same scheme for DDP).

``--compress fp16|powersgd[:R]`` (:mod:`distsgd.algorithms.compress`): the gradients are
averaged after backward by the compressor, all at once, instead of bucket by bucket during it.

Buffers (BatchNorm statistics): each replica's forward updates its own; after every step the
floating-point buffers are averaged with one all-reduce (so the running statistics are those of
the global batch, as SyncBatchNorm's would be for the running mean), and at the end rank 0's
integer buffers (``num_batches_tracked``, equal anyway in lockstep) are copied to all. Replicas
thus hold equal parameters and buffers after every step.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from distsgd.algorithms import compress
from distsgd.algorithms.averaging import (
    allreduce_mean_,
    broadcast_,
    flagged_grads,
    float_buffers,
    int_buffers,
    refuse_sparse,
    take_flagged,
)
from distsgd.algorithms.base import GroupAlgorithm, GroupFigures, register
from distsgd.config import RunConfig
from distsgd.errors import ConfigError
from distsgd.options import option
from distsgd.train import membership
from distsgd.train.context import Start, Step, WorkerContext


@dataclass
class Bucket:
    params: list[nn.Parameter]
    buffer: torch.Tensor  # the gradients, flat, then one "has a gradient" flag per parameter
    ready: int = 0
    handle: dist.Work | None = None  # its all-reduce, while in flight
    offsets: list[int] = field(default_factory=list)

    @property
    def flags(self) -> torch.Tensor:
        """The buffer's last ``len(params)`` values: 1 where this rank's parameter has a gradient;
        reduced with the gradients, then > 0 where any rank's had one."""
        return self.buffer[self.buffer.numel() - len(self.params) :]


def make_buckets(params: list[nn.Parameter], cap_bytes: int) -> list[Bucket]:
    """Group ``params`` (in the given order) into buckets of at most ``cap_bytes`` (one param at least)."""
    buckets: list[Bucket] = []
    current: list[nn.Parameter] = []
    size = 0
    for p in params:
        nbytes = p.numel() * p.element_size()
        if current and (size + nbytes > cap_bytes or p.dtype != current[0].dtype):  # (a bucket: one dtype)
            buckets.append(_bucket(current))
            current, size = [], 0
        current.append(p)
        size += nbytes
    if current:
        buckets.append(_bucket(current))
    return buckets


def _bucket(params: list[nn.Parameter]) -> Bucket:
    offsets, total = [], 0
    for p in params:
        offsets.append(total)
        total += p.numel()
    return Bucket(
        params=params,
        buffer=torch.zeros(total + len(params), dtype=params[0].dtype, device=params[0].device),
        offsets=offsets,
    )


@dataclass(frozen=True)
class BucketOptions(compress.CompressOptions):
    """allreduce's and ddp's options."""

    bucket_mb: float = option(
        25.0,
        "gradient bucket size in MB",
        default_help="{default} (allreduce --compress refuses it: no buckets; ddp --compress powersgd on gloo: one bucket)",
        metavar="MB",
    )

    def check(self, cfg: RunConfig) -> None:
        super().check(cfg)
        if not self.bucket_mb > 0:
            raise ConfigError(f"--bucket-mb must be positive, got {self.bucket_mb}")


def dtype_changed(p: torch.Tensor, was: torch.dtype, algo: str) -> ConfigError:
    """A parameter converted after run.setup() to a finer dtype (``model.double()``): its gradients
    would be averaged in the coarser dtype its bucket has (an audit's: float64 training averaged in
    float32, 6.9e-09 from one process in 16 steps, exit 0; under ddp nothing averaged at all)."""
    return ConfigError(
        f"a parameter's dtype changed after run.setup() ({str(was).removeprefix('torch.')} to "
        f"{str(p.dtype).removeprefix('torch.')}: model.double()?): {algo} averages the "
        f"gradients in buckets of the dtypes it found, and would round these; convert the model before "
        f"run.setup() (in its constructor or the model factory)"
    )


def refuse_powersgd_resync(algo: str, spec: str) -> None:
    """PowerSGD compresses a step's gradient once (its error feedback and warm start assume it): a
    step whose gradients were synchronised by several backward passes is refused. (fp16 and plain
    all-reduces add up: the sum of averages is the average of the sum.)"""
    if compress.parse(spec)[0] == "powersgd":
        raise ConfigError(
            f"{algo} --compress {spec} compresses each step's gradient once: accumulate with "
            f"run.no_sync() round all but the last micro-batch's run.backward()"
        )


class Frozen:
    """The parameters frozen (``requires_grad=False``) when the model was set up, and the gradient
    each had then (a stale one a user's loop never cleared: left as it is, clipped or zeroed)."""

    def __init__(self, model: nn.Module) -> None:
        self.params = [p for p in model.parameters() if not p.requires_grad]
        # the tensors themselves (held: an id alone could be another's once one is freed) and versions
        self.grads = [(p.grad, p.grad._version if p.grad is not None else 0) for p in self.params]

    def gained(self) -> bool:
        """Whether one of them, trainable now, has a gradient it did not have at setup: autograd
        gives one only to a parameter that takes gradients (unfrozen), so a stale gradient clipped
        or zeroed in place while the parameter stays frozen is not one."""
        return any(
            p.requires_grad and p.grad is not None and (p.grad is not old or p.grad._version != version)
            for p, (old, version) in zip(self.params, self.grads)
        )


def refuse_unfrozen(algo: str, frozen: Frozen) -> None:
    """A parameter frozen when the model was set up, which has a gradient now: the algorithm
    synchronises the gradients of the parameters that took them then, so this one's would stay
    each replica's own, and the replicas would part."""
    if frozen.params and frozen.gained():
        raise ConfigError(
            f"{algo} synchronises the gradients of the parameters that had requires_grad=True at "
            f"run.setup(), and one frozen then has a gradient now: set requires_grad before run.setup()"
            f"{'' if algo == 'ddp' else ' (freezing later is fine: a parameter with no gradient is left alone)'}; to unfreeze layers "
            f"later, keep them requires_grad=True and out of the optimiser until opt.add_param_group(), "
            f"zeroing every gradient with model.zero_grad()"
        )


@dataclass
class AllReduceFigures(GroupFigures):
    buckets: int | None = None  # gradient buckets (none with --compress: reduced all at once)


@register
class AllReduce(GroupAlgorithm[BucketOptions]):
    name = "allreduce"
    kind = "data parallel"
    trains_through = True
    summary_line = "synchronous data parallel: gradients averaged by our bucketed all-reduce, overlapped with backward"

    compressor: compress.Compressor | None  # --compress: averages every gradient at once, after backward
    flags: torch.Tensor  # --compress: 1 where a parameter has a gradient, reduced after backward
    accumulating: bool  # inside no_sync: a micro-batch's gradients stay local
    next_bucket: int  # the next bucket to start, in order (every rank starts them in the same order)
    # built by setup:
    params: list[nn.Parameter]  # those that take gradients
    frozen: Frozen  # those that did not, at setup (their gradients are not synchronised)
    float_buffers: list[torch.Tensor]  # averaged after every step (the model's as they are then)
    buffer_slots: list[tuple[dict[str, torch.Tensor | None], str]]  # where the model holds each buffer
    buckets: list[Bucket]  # the gradients' buckets, in backward's order (none used with a compressor)
    bucket_of: dict[int, Bucket]  # id(param) -> its bucket
    # the parameters whose gradient's layout is not yet seen (refuse_sparse looks at each one's first)
    unseen: set[int]

    def __init__(self, cfg: RunConfig, seat: object = None) -> None:
        super().__init__(cfg, seat)
        self.compressor = compress.make(self.opts.compress) if self.opts.compress != "none" else None
        self.accumulating = False
        self.next_bucket = 0
        self.unseen = set()  # (filled at setup)

    @classmethod
    def check(cls, cfg: RunConfig) -> None:
        super().check(cfg)
        opts = cls.parse_options(cfg)
        if opts.compress != "none" and opts.bucket_mb != BucketOptions().bucket_mb:
            raise ConfigError(
                f"allreduce --compress {opts.compress} reduces every gradient at once, after backward, "
                f"in no buckets: --bucket-mb does not apply (leave it out)"
            )

    def setup(self, ctx: WorkerContext, model: nn.Module, start: Start) -> nn.Module:
        model = super().setup(ctx, model, start)
        params = [p for p in model.parameters() if p.requires_grad]
        self.frozen = Frozen(model)
        # --compress: which parameters had a gradient on any rank, reduced with the buffers (one
        # tensor made here: a new one a step would be a copy from host memory, a wait on a GPU)
        self.flags = torch.ones(len(params), device=params[0].device if params else ctx.device)
        # Start from rank 0's weights and buffers, whatever the model's constructor did (a
        # replacement joining a group that trains through losses takes a live member's state instead)
        if not (start is Start.REPLACEMENT and membership.current() is not None):
            broadcast_(params + list(model.buffers()))
        self.params = params
        self.unseen = {id(p) for p in params}
        self.float_buffers = float_buffers(model)
        # where each is held (a module's buffers, its name there): read again each step, so a buffer
        # the loop replaced (DINO's centre, prune's new mask) is the one averaged, with no walk of the modules
        self.buffer_slots = [
            (mod._buffers, name)
            for mod in model.modules()
            for name, b in mod._buffers.items()
            if b is not None and name not in mod._non_persistent_buffers_set  # (each worker's own: float_buffers)
        ]
        self.buckets = make_buckets(list(reversed(params)), int(self.opts.bucket_mb * 1024 * 1024))
        self.bucket_of = {id(p): b for b in self.buckets for p in b.params}
        if self.compressor is None:  # compressed gradients are reduced after backward, all at once
            for p in params:
                p.register_post_accumulate_grad_hook(self._grad_ready)
        return model

    @contextlib.contextmanager
    def no_sync(self, ctx: WorkerContext, model: nn.Module) -> Iterator[None]:
        """A micro-batch that is not the step's last: its gradients stay local."""
        self.accumulating = True
        try:
            yield
        finally:
            self.accumulating = False

    def check_resynced(self, ctx: WorkerContext) -> None:
        refuse_powersgd_resync(self.name, self.opts.compress)

    def _grad_ready(self, p: torch.Tensor) -> None:
        if self.accumulating:
            return
        bucket = self.bucket_of[id(p)]
        bucket.ready += 1
        if bucket.ready == len(bucket.params):
            self._launch_in_order()

    @torch.no_grad()  # (a backward with create_graph=True: the copies record no history into the buffers)
    def _launch_in_order(self, force: bool = False) -> None:
        while self.next_bucket < len(self.buckets):
            bucket = self.buckets[self.next_bucket]
            if not force and bucket.ready < len(bucket.params):
                return
            flags = bucket.flags
            flags.fill_(1)
            for i, (p, offset) in enumerate(zip(bucket.params, bucket.offsets)):
                view = bucket.buffer[offset : offset + p.numel()]
                if self.unseen and p.grad is not None and id(p) in self.unseen:  # (a sparse one: its first is enough)
                    refuse_sparse(p, self.name, "its flat buckets")
                    self.unseen.discard(id(p))
                if p.grad is None:  # no gradient here (unused in this forward, or frozen): zero, flagged
                    view.zero_()
                    flags[i] = 0
                elif p.grad.dtype != view.dtype and torch.finfo(view.dtype).eps > torch.finfo(p.grad.dtype).eps:
                    raise dtype_changed(p, view.dtype, self.name)  # (into a finer bucket, a half's: exact)
                else:
                    view.copy_(p.grad.reshape(-1))
            bucket.handle = dist.all_reduce(bucket.buffer, async_op=True)
            self.sent(bucket.buffer.numel() * bucket.buffer.element_size(), self.world)
            self.next_bucket += 1

    def after_backward(self, ctx: WorkerContext, model: nn.Module, step: Step) -> None:
        refuse_unfrozen(self.name, self.frozen)
        held = (slots.get(name) for slots, name in self.buffer_slots)
        self.float_buffers = [b for b in held if b is not None and b.dtype.is_floating_point]
        if self.compressor is not None:
            if not self.params:
                return
            for p in [p for p in self.params if id(p) in self.unseen and p.grad is not None] if self.unseen else []:
                refuse_sparse(p, self.name, "the compressor's flat buffers")
                self.unseen.discard(id(p))
            grads, absent = flagged_grads(self.params, self.flags)
            self.sent(self.compressor.allreduce_mean_(grads, self.world), self.world)
            # which parameters had a gradient on any rank, reduced with the buffers (the compressor's
            # error feedback would carry flags over into the next step's)
            self.sent(allreduce_mean_([*self.float_buffers, self.flags], self.world), self.world)
            take_flagged(self.params, grads, self.flags, absent)
            return
        self._reduce_buckets()
        if self.float_buffers:
            self.sent(allreduce_mean_(self.float_buffers, self.world), self.world)

    @torch.no_grad()
    def _reduce_buckets(self) -> None:
        self._launch_in_order(force=True)
        for bucket in self.buckets:
            assert bucket.handle is not None  # every bucket was started above
            membership.wait(bucket.handle)
            bucket.buffer.div_(self.world)
            # the reduced flags, read at this rank's first parameter without a gradient (a GPU's wait: only then)
            anywhere: list[float] | None = None
            for i, (p, offset) in enumerate(zip(bucket.params, bucket.offsets)):
                averaged = bucket.buffer[offset : offset + p.numel()].view_as(p)
                if p.grad is not None:
                    p.grad.copy_(averaged)
                    continue
                anywhere = bucket.flags.tolist() if anywhere is None else anywhere
                if anywhere[i] > 0:  # another rank's had one
                    p.grad = averaged.clone()
                # else no rank's had one: it stays None, and the optimiser leaves the parameter alone
            bucket.ready = 0
            bucket.handle = None
        self.next_bucket = 0

    def regrouped(self, ctx: WorkerContext) -> None:
        super().regrouped(ctx)
        for bucket in self.buckets:  # what was in flight went with the old group: a collective left
            # waiting there may still write into its buffer, so each bucket takes a new one
            bucket.ready, bucket.handle, bucket.buffer = 0, None, torch.zeros_like(bucket.buffer)
        self.next_bucket, self.accumulating = 0, False

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), **({"compressor": self.compressor.state_dict()} if self.compressor else {})}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        if self.compressor is not None:
            self.compressor.load_state_dict(state["compressor"], self.params[0].device)

    def final_model(self, ctx: WorkerContext, model: nn.Module) -> nn.Module:
        broadcast_(int_buffers(model))
        return model

    def figures(self) -> AllReduceFigures:
        return AllReduceFigures(
            **vars(super().figures()), buckets=len(self.buckets) if self.compressor is None else None
        )
