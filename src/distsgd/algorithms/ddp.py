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

Training through a lost worker (``--min-workers``): every bucket's all-reduce goes through a
communication hook that waits on it through the membership (a wait DDP's reducer makes itself
cannot see a loss announced, and would wait out ``--timeout``), so the all-reduce no longer
overlaps the rest of backward. A loss seen there is raised after backward, with DDP's reducer left
whole; the survivors then move DDP onto the new group. Buffers are
broadcast from rank 0 after each step, through the membership, in place of DDP's own broadcast
before each forward (the same statistics at the next forward; with ``--accumulate``, a step's
later micro-batches run on each worker's own). DDP's initial broadcast is made through the
membership before DDP is built (a loss there: the survivors build again, see the loop), and a
replacement's DDP is built on the group it entered without one (it takes a live member's state); at every
regroup each member's DDP builds its reducer anew, so that all have the same buckets. Not covered: a loss
during DDP's bucket rebuild (its first forward, and the first after a regroup: a broadcast DDP
waits on itself); ``--compress`` (torch's hooks wait on their own collectives).
"""

from __future__ import annotations

import contextlib
import copy
import inspect
from collections.abc import Mapping
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
from torch.nn.parallel import DistributedDataParallel

from distsgd.algorithms import compress
from distsgd.algorithms.allreduce import BucketOptions, Frozen, refuse_powersgd_resync, refuse_unfrozen
from distsgd.algorithms.averaging import broadcast_
from distsgd.algorithms.base import GroupAlgorithm, register
from distsgd.config import RunConfig
from distsgd.errors import ConfigError
from distsgd.train import membership
from distsgd.train.context import Start, Step, WorkerContext
from distsgd.train.own_loop import parameters_changed

# torch 2.13 names DDP's broadcast before each forward forward_sync_buffers (broadcast_buffers before)
_NO_FORWARD_SYNC = (
    {"forward_sync_buffers": False}
    if "forward_sync_buffers" in inspect.signature(DistributedDataParallel.__init__).parameters
    else {"broadcast_buffers": False}
)


class _Wrapper(DistributedDataParallel):
    """torch's DistributedDataParallel, whose deep copy is a copy of the module inside it, as a
    copy of the model run.setup() returns is under every other algorithm: an EMA of it
    (``AveragedModel(model)``, timm's ``ModelEmaV2(model)``, both a ``copy.deepcopy``) was a second
    DDP on the workers' group, whose forward on one worker alone (the EMA evaluated on rank 0) waited
    for the others at its broadcast of buffers for --timeout, and then said that a longer one was
    needed (an audit's, 2026-12-01). Plain torch DDP scripts build the EMA before wrapping."""

    def __deepcopy__(self, memo: dict[int, Any]) -> nn.Module:
        return copy.deepcopy(self.module, memo)

    def load_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False) -> Any:
        """A state of the model itself (no key ``module.``-prefixed: a pretrained model's, a plain
        checkpoint's) loads into the module inside, as it does into the model run.setup() returns
        under every other algorithm; one of DDP's own keys as DDP loads it. Under torch's DDP a
        ``strict=False`` load of a plain state loaded nothing, every key unexpected (an audit's:
        the model returned 0.77 from one process's that loaded it), and a strict one failed in
        torch's list of keys."""
        if state_dict and not any(str(k).startswith("module.") for k in state_dict):
            return self.module.load_state_dict(state_dict, strict=strict, assign=assign)
        return super().load_state_dict(state_dict, strict=strict, assign=assign)


@register
class DDP(GroupAlgorithm[BucketOptions]):
    name = "ddp"
    kind = "data parallel"
    summary_line = "the same through PyTorch's DistributedDataParallel, the reference"
    trains_through = True  # (see the module's docstring for what it covers)

    hooked: bool  # --compress, or training through losses: a communication hook counts what it sends
    through: bool  # --min-workers: collectives waited on through the membership
    lost: membership.Lost | None  # a loss the hook saw during backward, raised after it
    # built by setup:
    ddp: DistributedDataParallel
    synced: list[nn.Parameter]  # the parameters DDP synchronises (those with requires_grad at setup)
    frozen: Frozen  # the others
    forwards: int  # forwards through DDP that prepared its reducer for a backward, since the last sync
    grad_bytes: int  # what DDP all-reduces a step without a hook
    strides: list[
        tuple[torch.dtype, tuple[int, ...]]
    ]  # each synced parameter's dtype and layout (_layout) when DDP laid out its buckets
    buffer_bytes: int  # what rank 0 broadcasts before every forward

    def __init__(self, cfg: RunConfig, seat: object = None) -> None:
        super().__init__(cfg, seat)
        self.hooked = self.opts.compress != "none"
        self.through, self.lost = False, None
        self.forwards = 0

    @classmethod
    def check(cls, cfg: RunConfig) -> None:
        super().check(cfg)
        if cfg.trains_through and cls.parse_options(cfg).compress != "none":
            raise ConfigError(
                "ddp --compress with --min-workers: torch's compression hooks wait on their own "
                "all-reduces, where a lost worker cannot be seen; use allreduce --compress fp16"
            )

    def setup(self, ctx: WorkerContext, model: nn.Module, start: Start) -> nn.Module:
        model = super().setup(ctx, model, start)
        self.synced = [p for p in model.parameters() if p.requires_grad]
        self.frozen = Frozen(model)
        self.grad_bytes = sum(p.numel() * p.element_size() for p in self.synced)
        self.buffer_bytes = sum(b.numel() * b.element_size() for b in model.buffers())
        how, rank = compress.parse(self.opts.compress)
        bucket_mb = self.opts.bucket_mb
        if how == "powersgd" and dist.get_backend() == "gloo":
            bucket_mb = max(bucket_mb, self.grad_bytes / 2**20 + 1)  # one bucket: see the module's docstring
        self.through = membership.current() is not None
        through: dict[str, Any] = {}  # buffers broadcast after each step instead (after_step);
        if self.through:  # DDP's own first broadcast cannot be left when a worker is lost: ours, through the
            # membership (a replacement's state comes from a live member instead)
            through = {**_NO_FORWARD_SYNC, "init_sync": False}
            if start is not Start.REPLACEMENT:
                broadcast_(list(model.parameters()) + list(model.buffers()))
        ddp = _Wrapper(
            model, bucket_cap_mb=bucket_mb, device_ids=[ctx.device] if ctx.device.type == "cuda" else None, **through
        )
        self.ddp = ddp
        self.strides = [(p.dtype, _layout(p)) for p in self.synced]
        ddp.register_forward_pre_hook(self._forward)
        if self.through:
            self.hooked = True
            ddp.register_comm_hook(None, self._through_membership)
        elif how == "fp16":
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

    def check_untouched(self, ctx: WorkerContext) -> None:
        """No parameter's memory layout or dtype changed since DDP was built: its buckets are views
        laid out by the strides it found, and the averaged gradient copied back into a parameter of
        another layout is scrambled (``model.to(memory_format=torch.channels_last)`` after
        run.setup(): 0.09 from DDP's own result in 2 epochs, exit 0; torch says "This is not an
        error" in a warning); a parameter of another dtype (``model.double()``) kept its worker's own
        gradient (0.11 from one process, the model returned worker 0's trained alone, exit 0; plain
        torch DDP the same, without a word)."""
        for p, (dtype, stride) in zip(self.synced, self.strides):
            if p.dtype == dtype and _layout(p) == stride:
                continue
            name = next((n for n, q in self.ddp.module.named_parameters() if q is p), "of the model")
            if p.dtype != dtype:
                raise ConfigError(
                    f"parameter {name}'s dtype changed after run.setup() ({str(dtype).removeprefix('torch.')} to "
                    f"{str(p.dtype).removeprefix('torch.')}: model.double(), .half(), .to(dtype)?): torch's "
                    f"DistributedDataParallel averages the gradients in buckets of the dtype it found, and leaves "
                    f"a parameter of another dtype its worker's own gradient; convert the model before "
                    f"run.setup() (in its constructor or the model factory), use --precision for mixed "
                    f"precision{', or --algo allreduce' if p.dtype.itemsize < dtype.itemsize else ''}"
                )
            raise ConfigError(
                f"parameter {name}'s memory layout changed after run.setup() (model.to(memory_format="
                f"torch.channels_last)?): torch's DistributedDataParallel laid out its gradient buckets by "
                f"the layout it found, and copies the averaged gradient back into the new one scrambled; "
                f"convert the model before run.setup() (in its constructor or the model factory), or use "
                f"--algo allreduce"
            )

    def _forward(self, ddp: nn.Module, args: Any) -> None:
        # (DDP's forward prepares its reducer for a backward in the same case)
        if torch.is_grad_enabled() and self.ddp.require_backward_grad_sync:
            self.forwards += 1

    def _counting(self, hook: Callable, nbytes: Callable[[dist.GradBucket], int]) -> Callable:
        """torch's ``hook``, and the bytes it all-reduces for each bucket counted first. (No
        annotations: DDP checks a hook's, and under postponed evaluation they would be strings.)"""

        def counted(state, bucket):
            self.sent(nbytes(bucket), self.world)
            return hook(state, bucket)

        return counted

    def _through_membership(self, state, bucket):
        """Training through losses: a bucket's average, waited on through the membership. A loss
        is kept for ``after_backward`` (raised inside backward, it would leave DDP's reducer half
        way through), and the buckets after it are left as they are."""
        buffer = bucket.buffer()
        if self.lost is None:
            try:
                membership.call(dist.all_reduce, buffer)
                buffer.div_(self.world)
                self.sent(buffer.numel() * buffer.element_size(), self.world)
            except membership.Lost as lost:
                self.lost = lost
        done: torch.futures.Future = torch.futures.Future()
        done.set_result(buffer)
        return done

    def no_sync(self, ctx: WorkerContext, model: nn.Module) -> contextlib.AbstractContextManager:
        assert isinstance(model, DistributedDataParallel)  # the model setup returned
        return model.no_sync()  # DDP's own: accumulate, reduce at the last micro-batch

    def check_resynced(self, ctx: WorkerContext) -> None:
        refuse_powersgd_resync(self.name, self.opts.compress)

    def after_backward(self, ctx: WorkerContext, model: nn.Module, step: Step) -> None:
        # DDP has already averaged the gradients during backward; count what it sent (a hook counts
        # its own), and, on rank 0, the buffers it broadcast before the forward.
        if self.lost is not None:  # the group lost a worker during backward: the loop regroups
            lost, self.lost = self.lost, None
            raise lost
        self._check_synced()
        if not self.hooked:
            self.sent(self.grad_bytes, self.world)
        if ctx.rank == 0 and not self.through:
            self.sent(self.buffer_bytes, self.world, "broadcast")

    def _check_synced(self) -> None:
        """What DDP leaves unsynchronised, without a word (it would raise, if at all, at the next
        forward, after this step applied its replica's own gradients): refused in one line."""
        refuse_unfrozen(self.name, self.frozen)
        forwards, self.forwards = self.forwards, 0
        if not forwards and getattr(self.ddp, "require_backward_grad_sync", True) is False:
            raise ConfigError(
                "model.require_backward_grad_sync = False (nanoGPT's accumulation) is DDP's no_sync() by hand, "
                "which distsgd does not see: take the micro-batches before the last inside run.no_sync()"
            )
        if not forwards:
            raise ConfigError(
                "ddp synchronises a backward pass through a forward of the model run.setup() returned, and "
                "this one followed none (a forward through model.module or one of its methods, or a second "
                "backward through one forward): its gradients are this worker's own; call the model "
                "run.setup() returned, once a backward, or use --algo allreduce, which synchronises any backward"
            )
        # (frozen after setup: its .grad may still be a tensor, zeroed by zero_grad(set_to_none=False))
        missing = next((p for p in self.synced if p.grad is None or not p.requires_grad), None)
        if missing is not None:
            name = next((n for n, p in self.ddp.module.named_parameters() if p is missing), None)
            if name is None:  # (a parametrization registered after setup took its place: spectral_norm)
                raise parameters_changed(
                    f"a parameter of shape {list(missing.shape)} that DDP synchronises is no longer the model's",
                    self.name,
                )
            raise ConfigError(
                f"ddp synchronises every parameter that trains, every step, and {name} has no gradient in "
                f"this one (unused in the forward, or frozen after run.setup()): DDP then leaves its bucket's "
                f"gradients unsynchronised; use --algo allreduce, which takes such parameters (and leaves "
                f"them alone)"
            )

    def after_step(self, ctx: WorkerContext, model: nn.Module, step: Step) -> None:
        if self.through and self.buffer_bytes:  # rank 0's buffers, as DDP's broadcast would give the next forward
            sent = broadcast_(list(self.ddp.module.buffers()))
            if ctx.rank == 0:
                self.sent(sent, self.world, "broadcast")

    def regrouped(self, ctx: WorkerContext) -> None:
        super().regrouped(ctx)
        self.lost, self.forwards = None, 0
        self._fresh_reducer()

    def _fresh_reducer(self) -> None:
        """DDP's reducer built anew on the new default group, on every member alike: its buckets
        as at construction, rebuilt after the first step. (torch's ``_update_process_group`` keeps
        a member's rebuilt buckets, and a replacement's new DDP has a constructor's: their first
        all-reduces would add up different parameters.) The wrapper stays the one the loop and a
        user's own loop hold."""
        ddp = self.ddp
        ddp.process_group = dist.distributed_c10d._get_default_group()
        parameters, sparse = ddp._build_params_for_reducer()
        ddp._ddp_init_helper(parameters, sparse, ddp._build_debug_param_to_name_mapping(parameters), ddp.static_graph)
        ddp._has_rebuilt_buckets = False
        self.strides = [(p.dtype, _layout(p)) for p in self.synced]  # (the new buckets' layouts)
        ddp._comm_hooks = []
        ddp.register_comm_hook(None, self._through_membership)

    def loop_failure_why(self, exc: BaseException) -> str | None:
        """torch's paragraph of how to set up its DDP (``find_unused_parameters``), which the loop
        did not build: a parameter had no gradient in a step that distsgd's own check could not see
        (``zero_grad(set_to_none=False)`` leaves zeros, not None)."""
        if "Expected to have finished reduction in the prior iteration" not in str(exc):
            return None
        return (
            "a parameter of the model had no gradient in a step (unused in the forward, frozen after "
            "run.setup(), or a forward with gradients on and no backward), and under ddp torch's "
            "DistributedDataParallel synchronises every parameter it took, every step: use --algo allreduce, "
            "which leaves such a parameter alone"
        )

    def unwrap(self, model: nn.Module) -> nn.Module:
        # Evaluating through the wrapper would run DDP's forward (and its collectives) on rank 0 alone.
        return model.module if isinstance(model, DistributedDataParallel) else model

    def final_model(self, ctx: WorkerContext, model: nn.Module) -> nn.Module:
        module = self.unwrap(model)
        sent = broadcast_(list(module.buffers()))
        if ctx.rank == 0:
            self.sent(sent, self.world, "broadcast")
        return module

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """A resumed ``ddp --compress powersgd`` starts like a new run: ``start_powerSGD_iter`` (2)
        uncompressed steps, then compression with fresh error feedback and warm-start memory.
        torch's hook keeps those flat in DDP's bucket layout, which a new DDP rebuilds after its
        first step (hence torch's start_powerSGD_iter > 1): compressing at once would add the
        saved or first step's memory to the wrong gradients, or, with several buckets, fail on
        their sizes. (So a resumed run is not bit-exact; ``allreduce --compress powersgd`` is.)"""
        super().load_state_dict(state)


def _layout(p: torch.Tensor) -> tuple[int, ...]:
    """A tensor's order in memory: the strides of its dimensions longer than 1 (a 1x1 kernel's
    channels_last strides differ in the others alone, the same memory)."""
    return tuple(stride for stride, size in zip(p.stride(), p.shape) if size > 1)
