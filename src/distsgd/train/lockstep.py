"""The end of a user's loop in a lockstep group (allreduce, ddp, local-sgd, EASGD, DiLoCo): every
worker there, after as many steps.

A worker that leaves its loop on its own criterion (``if loss < x: break``) while the others go
on leaves them waiting at a synchronisation it never joins. Checked with a collective, its
check would pair with the others' next gradient all-reduce or average (gloo aborts on the other
size, NCCL may not notice), so it is made on the group's store instead:

- :func:`arrive`, at ``run.final_model()``: the worker writes its step count and waits until
  every worker has written one; counts that differ are refused in one line. While it waits it
  makes no collective.
- :func:`stranded`, from the loop's watch (``errors.stall_watch``) while this worker has waited
  at one of its synchronisations for a second: a peer that has arrived will never join it, so
  the worker writes why on the store, where the one that arrived reads it and fails the run
  with that line (its exit then ends the wait of the one stranded).

Nothing here runs while the group trains (one store read a quarter second, only in a wait that
has lasted a second)."""

from __future__ import annotations

import time

import torch.distributed as dist

from distsgd.errors import ConfigError

FINALS = "distsgd/finals"  # how many workers have arrived at run.final_model()
STRANDED = "distsgd/stranded"  # why a worker waits for ever: the line the run fails with


def _final(rank: int) -> str:
    return f"distsgd/final/{rank}"


def _advice(algo: str) -> str:
    return (
        f"under {algo} every worker takes as many steps and makes the same synchronising calls; stop them "
        f"together (run.should_stop(), or a decision shared with run.all_reduce)"
    )


def arrive(store: dist.Store, rank: int, world: int, steps: int, algo: str, timeout_s: float) -> None:
    """This worker has reached ``run.final_model()`` after ``steps`` steps: wait for every worker
    to, then refuse counts that differ. Raises :class:`ConfigError` with the line a stranded peer
    wrote, or once ``timeout_s`` passed without every worker."""
    store.set(_final(rank), str(steps))
    store.add(FINALS, 1)
    keys = [_final(r) for r in range(world)]
    deadline = time.monotonic() + timeout_s
    while not store.check(keys):
        if store.check([STRANDED]):
            raise ConfigError(store.get(STRANDED).decode())
        if time.monotonic() > deadline:
            missing = [r for r in range(world) if not store.check([keys[r]])]
            raise ConfigError(
                f"worker {rank} reached run.final_model() after {steps} steps and worker "
                f"{', '.join(map(str, missing))} did not within --timeout {timeout_s:g} s: {_advice(algo)}"
            )
        time.sleep(0.02)
    counts = [int(v) for v in store.multi_get(keys)]
    if min(counts) != max(counts):
        raise ConfigError(
            f"the workers took from {min(counts)} to {max(counts)} steps (worker {rank}: {steps}): {_advice(algo)}"
        )


def stranded(store: dist.Store, rank: int, world: int, steps: int, algo: str) -> str | None:
    """Called while this worker (not yet at ``run.final_model()``) has waited at a
    synchronisation for a while: if a peer has arrived at its final model, that synchronisation
    never completes. Says why on the store (for the peer to fail the run with) and returns it."""
    if int(store.add(FINALS, 0)) == 0:
        return None
    peer = next((r for r in range(world) if r != rank and store.check([_final(r)])), None)
    if peer is None:
        return None
    theirs = int(store.get(_final(peer)))
    why = (
        f"worker {peer} reached run.final_model() after {theirs} steps while worker {rank} ({steps} steps) "
        f"waits for it at a synchronisation (its next step, run.evaluation_model() or run.all_reduce()): "
        f"{_advice(algo)}"
    )
    store.set(STRANDED, why)
    return why
