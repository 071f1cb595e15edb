"""Partitions: disjoint, covering, equal, deterministic, reshuffled every epoch."""

from __future__ import annotations

import pytest
import torch

from distsgd.data.partition import epoch_indices, shard_size


@pytest.mark.parametrize("n, world", [(100, 1), (100, 4), (103, 4), (7, 3)])
def test_sharded_disjoint_equal_and_covering(n: int, world: int) -> None:
    shards = [epoch_indices(n, 0, r, world, seed=5) for r in range(world)]
    sizes = {len(s) for s in shards}
    assert sizes == {n // world} == {shard_size(n, world, "sharded")}
    together = torch.cat(shards)
    assert len(set(together.tolist())) == len(together)  # disjoint
    assert len(together) == n - n % world  # covers all but the remainder
    if n % world == 0:
        assert sorted(together.tolist()) == list(range(n))


def test_deterministic_and_reshuffled_each_epoch() -> None:
    a = epoch_indices(1000, 3, 1, 2, seed=11)
    assert torch.equal(a, epoch_indices(1000, 3, 1, 2, seed=11))
    assert not torch.equal(a, epoch_indices(1000, 4, 1, 2, seed=11))
    assert not torch.equal(a, epoch_indices(1000, 3, 1, 2, seed=12))
    # Every sample is visited over the epochs, not only the first shard's.
    assert set(epoch_indices(1000, 4, 1, 2, seed=11).tolist()) != set(a.tolist())


def test_worker_batches_are_slices_of_the_global_batch() -> None:
    n, world, batch = 64, 2, 4
    single = epoch_indices(n, 0, 0, 1, seed=3)
    shards = [epoch_indices(n, 0, r, world, seed=3) for r in range(world)]
    for k in range(n // (batch * world)):
        global_batch = set(single[k * batch * world : (k + 1) * batch * world].tolist())
        assert set().union(*(set(s[k * batch : (k + 1) * batch].tolist()) for s in shards)) == global_batch


def test_replicated_every_worker_sees_everything_in_its_own_order() -> None:
    a, b = (epoch_indices(50, 0, r, 2, seed=0, mode="replicated") for r in range(2))
    assert sorted(a.tolist()) == sorted(b.tolist()) == list(range(50))
    assert not torch.equal(a, b)
    assert shard_size(50, 2, "replicated") == 50


def test_bad_rank() -> None:
    with pytest.raises(ValueError):
        epoch_indices(10, 0, 2, 2)
