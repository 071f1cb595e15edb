"""Which samples each worker trains on, epoch by epoch. Deterministic given the seed.

``sharded`` (what ``DistributedSampler`` does): one permutation of the dataset per epoch, shared by
all workers; worker ``r`` of ``W`` takes every W-th index from position ``r``. The shards are
disjoint and equal-sized (the last ``N mod W`` samples of the permutation sit the epoch out), and
the permutation changes every epoch. Batch ``k`` of worker ``r`` is a strided slice of global
batch ``k`` (``W * B`` consecutive samples of the permutation), so averaging the workers'
gradients gives exactly the gradient of one process that takes the global batch.

``replicated`` (what pytorch/examples' ``mnist_hogwild`` does): every worker shuffles the whole
dataset with its own seed, so one epoch is ``W * N`` samples in all.
"""

from __future__ import annotations

import torch

MODES = ("sharded", "replicated")


def epoch_indices(
    n: int, epoch: int, rank: int = 0, world: int = 1, seed: int = 0, mode: str = "sharded", shuffle: bool = True
) -> torch.Tensor:
    """The sample indices worker ``rank`` visits in ``epoch``, in order (``shuffle`` False: the
    dataset's order, the same shard of it)."""
    if not 0 <= rank < world:
        raise ValueError(f"rank {rank} is outside a world of {world}")
    if mode == "sharded":
        gen = torch.Generator().manual_seed(mix_seed(seed, epoch))
        perm = torch.randperm(n, generator=gen) if shuffle else torch.arange(n)
        usable = n - n % world
        return perm[:usable][rank::world]
    if mode == "replicated":
        gen = torch.Generator().manual_seed(mix_seed(seed, epoch, rank + 1))
        return torch.randperm(n, generator=gen) if shuffle else torch.arange(n)
    raise ValueError(f"unknown partition mode {mode!r}")


def shard_size(n: int, world: int, mode: str) -> int:
    """Samples one worker visits per epoch."""
    return n // world if mode == "sharded" else n


def samples_per_epoch(n: int, world: int, mode: str) -> int:
    """Samples all ``world`` workers visit together in one epoch."""
    return shard_size(n, world, mode) * world


def mix_seed(*values: int) -> int:
    """A 63-bit seed from several integers (splitmix64-style), so nearby seeds do not collide."""
    h = 0x9E3779B97F4A7C15
    for v in values:
        h = (h ^ (v & 0xFFFFFFFFFFFFFFFF)) * 0xBF58476D1CE4E5B9 & 0xFFFFFFFFFFFFFFFF
        h ^= h >> 31
    return h & 0x7FFFFFFFFFFFFFFF
