"""Gradient compression for the averaging all-reduce: ``--compress none|fp16|powersgd[:RANK]``.

A :class:`Compressor` averages a list of tensors across the process group in place and returns
the bytes it handed to all-reduce (the caller turns them into bytes sent).

- ``none``: one flat all-reduce of float32 values.
- ``fp16``: the flat tensor cast to float16, divided by the world size, all-reduced and cast
  back: half the bytes (torch's ``fp16_compress_hook`` does the same for DDP).
- ``powersgd[:R]`` (Vogels, Karimireddy, Jaggi, "PowerSGD: Practical Low-Rank Gradient
  Compression for Distributed Optimization", NeurIPS 2019; rank R, default 2): every tensor of
  two or more dimensions, seen as a matrix M (n x m), is sent as two thin matrices. With error
  feedback, M <- M + e; P = M Q; all-reduce P and orthogonalise it; Q = M^T P; all-reduce Q and
  divide by W; the average is approximated by P Q^T, and e <- M - P Q^T is added next time, so
  what is not sent this step is sent later. Q is kept from step to step (warm start); tensors of
  one dimension, and matrices whose approximation would not save at least half, are all-reduced
  as they are. This follows torch's ``powerSGD_hook`` step for step (the tensors in reverse order,
  as a DDP bucket holds them; the same random start for Q; the first 2 steps uncompressed), so
  that ``allreduce --compress powersgd`` and ``ddp --compress powersgd`` (torch's own hook) take the
  same steps; a test checks it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from distsgd.algorithms.averaging import flatten, unflatten_into
from distsgd.config import RunConfig
from distsgd.errors import ConfigError
from distsgd.options import Options, option
from distsgd.train import membership

START_ITER = 2  # steps all-reduced as they are before compressing (torch's hook needs at least 2)
MIN_COMPRESSION_RATE = 2.0  # torch's default: compress a matrix only if it saves at least half


def parse(text: str) -> tuple[str, int]:
    """A ``--compress`` value (a method of :data:`METHODS`, ``:N`` after it where the method takes
    a number) -> (method, its number: the method's default where not given, 0 where it takes none)."""
    kind, colon, number_text = text.partition(":")
    method = METHODS.get(kind)
    if method is None or (colon and method.number is None):
        raise ConfigError(f"--compress must be {_spelled()}, got '{text}'")
    if method.number is None:
        return kind, 0
    try:
        number = int(number_text) if colon else method.default
    except ValueError:
        number = 0
    if number < 1:
        raise ConfigError(
            f"--compress {kind}:{method.number} needs a {method.number.lower()} of at least 1, got '{number_text}'"
        )
    return kind, number


def _spelled() -> str:
    """The methods as --compress takes them: ``none, fp16 or powersgd[:RANK]``."""
    names = [f"{k}[:{m.number}]" if m.number else k for k, m in METHODS.items()]
    return ", ".join(names[:-1]) + " or " + names[-1]


def _checked(text: str | int | float) -> str:
    parse(str(text))
    return str(text)


@dataclass(frozen=True)
class CompressOptions(Options):
    """The option of every algorithm whose all-reduce can be compressed."""

    compress: str = option(
        "none",
        "none, fp16 or powersgd[:RANK] (PowerSGD with error feedback, rank 2 by default) for what is all-reduced",
        parse=_checked,
        metavar="KIND",
    )

    def check(self, cfg: RunConfig) -> None:
        if parse(self.compress)[0] == "powersgd" and cfg.precision == "fp16":
            # fp16's loss scaling overflows on purpose now and then: an inf gradient would enter
            # PowerSGD's error feedback and its warm-started Q, and never leave
            raise ConfigError(
                "--compress powersgd does not go with --precision fp16 (an overflowed step would "
                "poison its error feedback); use --precision bf16"
            )
        if parse(self.compress)[0] == "powersgd" and cfg.trains_through:
            # its error feedback is each worker's own residual: a regrouped group takes one worker's
            raise ConfigError(
                "--compress powersgd keeps each worker's own error feedback, which a group that lost "
                "a worker cannot share yet: use --compress fp16 or none with --min-workers"
            )


class Compressor:
    """``none``: average with one flat float32 all-reduce."""

    def allreduce_mean_(self, tensors: list[torch.Tensor], world: int) -> int:
        """Average ``tensors`` across the group in place; return the bytes given to all-reduce."""
        flat = flatten(tensors)
        if world > 1:
            membership.call(dist.all_reduce, flat)
        unflatten_into(flat / world, tensors)
        return flat.numel() * flat.element_size()

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any], device: torch.device) -> None:
        """Restore :meth:`state_dict`'s state, its tensors on ``device`` (the gradients'): a
        checkpoint is loaded on the CPU."""


class FP16(Compressor):
    """``fp16``: divide by W, cast to float16, all-reduce, cast back."""

    def allreduce_mean_(self, tensors: list[torch.Tensor], world: int) -> int:
        flat = flatten(tensors).to(torch.float16).div_(world)  # as torch's fp16_compress_hook: cast, divide
        if world > 1:
            membership.call(dist.all_reduce, flat)
        unflatten_into(flat.to(tensors[0].dtype), tensors)
        return flat.numel() * flat.element_size()


class PowerSGD(Compressor):
    """``powersgd[:R]``, with error feedback and warm start; see the module docstring."""

    def __init__(self, rank: int = 2, seed: int = 0) -> None:
        self.rank, self.seed = rank, seed
        self.rng = np.random.RandomState(seed)
        self.iter = 0
        self.error: torch.Tensor | None = None
        self.qs: list[torch.Tensor] | None = None

    def allreduce_mean_(self, tensors: list[torch.Tensor], world: int) -> int:
        tensors = list(reversed(tensors))  # a DDP bucket's order
        if self.iter < START_ITER:  # as torch's default all-reduce hook: divide, then sum
            self.iter += 1
            flat = flatten(tensors) / world
            if world > 1:
                membership.call(dist.all_reduce, flat)
            unflatten_into(flat, tensors)
            return flat.numel() * flat.element_size()
        flat = flatten(tensors)
        if self.error is not None:
            flat += self.error
        unflatten_into(flat, tensors)
        before = flat.clone()
        compress, plain = self._split(tensors)
        sent = self._allreduce_plain(plain, world)
        ps, qs = self._start(compress)
        for m, p, q in zip(compress, ps, qs):  # batches of one, as torch's hook computes them
            torch.bmm(m, q, out=p)
        sent += _allreduce_all(ps, world, divide=False)
        for p in ps:
            _orthogonalize(p)
        for m, p, q in zip(compress, ps, qs):
            torch.bmm(m.transpose(1, 2), p, out=q)
        sent += _allreduce_all(qs, world, divide=True)
        for m, p, q in zip(compress, ps, qs):
            torch.bmm(p, q.transpose(1, 2), out=m)
        self.error = before - flatten(tensors)
        self.iter += 1
        return sent

    def _split(self, tensors: list[torch.Tensor]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """(matrices worth compressing, grouped by shape in order of first appearance; tensors sent as
        they are), as torch's hook decides and orders them."""
        by_shape: dict[torch.Size, list[torch.Tensor]] = {}
        plain = []
        for t in tensors:
            m = t.view(t.shape[0], -1) if t.dim() > 0 else t.view(1, 1)
            n, k = m.shape
            r = min(n, k, self.rank)
            if (n + k) * r * MIN_COMPRESSION_RATE < n * k:
                by_shape.setdefault(m.shape, []).append(m.unsqueeze(0))  # (1, n, k)
            else:
                plain.append(t)
        return [m for group in by_shape.values() for m in group], plain

    def _allreduce_plain(self, plain: list[torch.Tensor], world: int) -> int:
        if not plain:
            return 0
        return Compressor().allreduce_mean_(plain, world)

    def _start(self, compress: list[torch.Tensor]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Empty Ps, and the Qs: kept from the last step and orthogonalised, or (the first time) random."""
        ranks = [min(m.shape[1], m.shape[2], self.rank) for m in compress]
        ps = [torch.empty(1, m.shape[1], r, dtype=m.dtype, device=m.device) for m, r in zip(compress, ranks)]
        if self.qs is not None:
            for q in self.qs:
                _orthogonalize(q)
            return ps, self.qs
        generator = torch.Generator().manual_seed(int(self.rng.randint(1_000_000_000)))
        self.qs = [
            torch.randn(1, m.shape[2], r, generator=generator, dtype=m.dtype).to(m.device)  # the same draws
            for m, r in zip(compress, ranks)
        ]  # on any device: made on the CPU
        for q in self.qs:
            _orthogonalize(q)
        return ps, self.qs

    def state_dict(self) -> dict[str, Any]:
        return {"iter": self.iter, "error": self.error, "qs": self.qs, "rng": rng_state(self.rng)}

    def load_state_dict(self, state: dict[str, Any], device: torch.device) -> None:
        self.iter = state["iter"]
        self.error = state["error"].to(device) if state["error"] is not None else None
        self.qs = [q.to(device) for q in state["qs"]] if state["qs"] is not None else None
        set_rng_state(self.rng, state["rng"])


def rng_state(rng: np.random.RandomState) -> dict[str, Any]:
    """A numpy RandomState's state as tensors and numbers (a checkpoint holds no numpy objects)."""
    state = rng.get_state(legacy=True)  # legacy (the default): a tuple, for a RandomState of MT19937 as ours
    assert isinstance(state, tuple)
    _, keys, pos, has_gauss, gauss = state
    return {
        "keys": torch.from_numpy(keys.astype(np.int64)),
        "pos": int(pos),
        "has_gauss": int(has_gauss),
        "gauss": float(gauss),
    }


def set_rng_state(rng: np.random.RandomState, state: dict[str, Any]) -> None:
    rng.set_state(
        ("MT19937", state["keys"].numpy().astype(np.uint32), state["pos"], state["has_gauss"], state["gauss"])
    )


def powersgd_bytes(tensors: list[torch.Tensor], rank: int) -> int:
    """What torch's ``powerSGD_hook`` all-reduces for a bucket of these gradients once it
    compresses: the tensors it sends as they are, and P (n x r) and Q (m x r) of the others."""
    total = 0
    for t in tensors:
        n, m = (t.shape[0], t.numel() // t.shape[0]) if t.dim() > 0 else (1, 1)
        r = min(n, m, rank)
        total += (n + m) * r if (n + m) * r * MIN_COMPRESSION_RATE < n * m else n * m
    return total * tensors[0].element_size()


def _allreduce_all(mats: list[torch.Tensor], world: int, divide: bool) -> int:
    """Sum ``mats`` across the group in one flat all-reduce (and divide by W): torch's hook keeps
    every P (every Q) of a bucket in one contiguous buffer and all-reduces it once."""
    if not mats:
        return 0
    flat = flatten(mats)
    if world > 1:
        membership.call(dist.all_reduce, flat)
    if divide:
        flat /= world
    unflatten_into(flat, mats)
    return flat.numel() * flat.element_size()


def _orthogonalize(m: torch.Tensor) -> None:
    """Orthonormalise the columns of ``m`` (a batch of one, (1, n, r)) in place, as torch's hook
    does: Gram-Schmidt for rank <= 2, QR beyond. A zero column (an all-zero gradient matrix, a
    layer that got no gradient) stays zero: torch's hook, with its default epsilon 0, divides
    it by its zero norm and sends NaN to every worker."""
    if m.shape[2] > 2:
        torch.linalg.qr(m, out=(m, torch.empty(1, m.shape[2], m.shape[2], dtype=m.dtype, device=m.device)))
        return
    for i in range(m.shape[2]):
        col = m[:, :, i : i + 1]
        norm = torch.norm(col, dim=1, keepdim=True)
        col /= torch.where(norm > 0, norm, torch.ones_like(norm))
        if i + 1 < m.shape[2]:
            rest = m[:, :, i + 1 :]
            rest -= torch.sum(col * rest, dim=1, keepdim=True) * col


@dataclass(frozen=True)
class Method:
    """A ``--compress`` method: how to make its :class:`Compressor` from its number (a rank, say;
    0 where it takes none), the number's name in the flag (``RANK``: ``powersgd:RANK``) and default."""

    make: Callable[[int], Compressor]
    number: str | None = None
    default: int = 0


# --compress's methods: adding one is a Compressor subclass and one entry (docs/ARCHITECTURE.md)
METHODS: dict[str, Method] = {
    "none": Method(lambda _: Compressor()),
    "fp16": Method(lambda _: FP16()),
    "powersgd": Method(PowerSGD, number="RANK", default=2),
}


def make(text: str) -> Compressor:
    """The compressor a ``--compress`` value names."""
    kind, number = parse(text)
    return METHODS[kind].make(number)
