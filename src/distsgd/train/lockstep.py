"""Where the workers of a user's loop in a lockstep group (allreduce, ddp, local-sgd, EASGD, DiLoCo)
must all arrive: ``run.final_model()`` after as many steps, and the calls every worker makes at
one point (``run.evaluation_model()`` where it averages, ``run.log`` of test figures under
``--stop-at-target``).

A worker that leaves its loop on its own criterion (``if loss < x: break``), or makes such a call
alone (an evaluation on rank 0 only), leaves the others waiting at a synchronisation it never
joins. Checked with a collective, its check would pair with the others' next gradient
all-reduce or average (gloo aborts on the other size, NCCL may not notice), so it is made on the
group's store instead:

- :func:`barrier` (:func:`arrive` at the end): the worker says on the store where it waits and
  waits there, making no collective, until every worker has come (or ``--timeout``).
- :func:`stranded`, from the loop's watch (``errors.stall_watch``) while this worker has waited
  at one of its synchronisations for a second: a peer that waits on the store will never join
  it, so the worker writes why on the store, where that peer reads it and fails the run with the
  line (its exit then ends the wait of the one stranded).

Nothing here runs while the group trains (one store read a quarter second, only in a wait that
has lasted a second)."""

from __future__ import annotations

import time

import torch.distributed as dist

from distsgd.errors import ConfigError

AWAY = "distsgd/away"  # how many workers wait on the store, each at what its distsgd/at/<rank> says
STRANDED = "distsgd/stranded"  # why a worker waits for ever: the line the run fails with


def _at(rank: int) -> str:
    return f"distsgd/at/{rank}"


def _final(rank: int) -> str:
    return f"distsgd/final/{rank}"


def advice(algo: str, backward: bool = False) -> str:
    """What to do, in words; ``backward``: the algorithm averages gradients in each backward pass,
    which is then one of those calls (a gradient on one worker alone, a saliency map for a log,
    ran it out of step: the audit found it blamed on an early stop)."""
    each = (
        ", every backward pass one of them (a gradient to inspect on one worker alone: torch.autograd.grad(out, "
        "inputs), which averages nothing, of a forward that makes none either: DDP's .module, whose forward "
        "broadcasts no buffers)"
        if backward
        # (a GradScaler of the loop's skips opt.step() on an inf in one worker's gradients alone: the
        # audit of 2026-11-30 found it blamed on an early stop; one of 2026-12-01 a scaler blamed in
        # loops that had none, a `continue` past a non-finite step on one worker)
        else ", a step skipped on one worker alone being none (a `continue` past opt.step() on one worker's "
        "non-finite loss or gradient norm, a loop left early there, or a step a GradScaler of the loop's skipped "
        "on an inf in that worker's own gradients: precision='fp16' with run.backward(loss) counts the steps its "
        "scaler skips)"
    )
    return (
        f"under {algo} every worker takes as many steps and makes the same synchronising calls{each}; stop them "
        f"together (run.should_stop(), or a decision shared with run.all_reduce)"
    )


def barrier(store: dist.Store, rank: int, keys: list[str], doing: str, timeout_s: float, late: str) -> None:
    """Wait, saying on the store that this worker ``doing`` (``reached run.final_model() after 5
    steps``), until every one of ``keys`` is there. Raises :class:`ConfigError` with the line a
    stranded peer wrote, or ``late`` (the ranks missing filled in for ``{missing}``) once
    ``timeout_s`` passed."""
    store.set(_at(rank), doing)
    store.add(AWAY, 1)
    deadline, pause = time.monotonic() + timeout_s, 0.005
    try:
        while not store.check(keys):
            if store.check([STRANDED]):
                raise ConfigError(store.get(STRANDED).decode())
            if time.monotonic() > deadline:
                missing = ", ".join(str(r) for r, key in enumerate(keys) if not store.check([key]))
                raise ConfigError(late.format(missing=missing))
            time.sleep(pause)
            pause = min(0.1, pause * 2)  # (a few looks at once; a long wait reads the store ten times a second)
    finally:
        store.add(AWAY, -1)
        store.delete_key(_at(rank))


def arrive(
    store: dist.Store, rank: int, world: int, steps: int, algo: str, timeout_s: float, backward: bool = False
) -> None:
    """This worker has reached ``run.final_model()`` after ``steps`` steps: wait for every worker
    to, then refuse counts that differ. ``backward``: as :func:`advice`'s."""
    store.set(_final(rank), str(steps))
    keys = [_final(r) for r in range(world)]
    late = (
        f"worker {rank} reached run.final_model() after {steps} steps and worker {{missing}} did not within "
        f"--timeout {timeout_s:g} s: {advice(algo, backward)}"
    )
    barrier(store, rank, keys, f"reached run.final_model() after {steps} steps", timeout_s, late)
    counts = [int(v) for v in store.multi_get(keys)]
    if min(counts) != max(counts):
        raise ConfigError(
            f"the workers took from {min(counts)} to {max(counts)} steps (worker {rank}: {steps}): {advice(algo, backward)}"
        )


def stranded(store: dist.Store, rank: int, world: int, steps: int, algo: str, backward: bool = False) -> str | None:
    """Called while this worker has waited at a synchronisation for a while: if a peer waits on
    the store (:func:`barrier`), that synchronisation never completes. Says why on the store (for
    the peer to fail the run with) and returns it. ``backward``: as :func:`advice`'s."""
    if int(store.add(AWAY, 0)) <= 0:
        return None
    for peer in range(world):
        if peer != rank and store.check([_at(peer)]):
            doing = store.get(_at(peer)).decode()
            why = (
                f"worker {peer} {doing} while worker {rank} ({steps} steps) waits for it at a synchronisation "
                f"(its next step, run.evaluation_model() or run.all_reduce()): {advice(algo, backward)}"
            )
            if doing.startswith("called "):  # a call every worker makes (Run._all_here), made by one alone
                why = (
                    f"worker {peer} {doing} and worker {rank} did not (it went on to a synchronisation after "
                    f"{steps} steps): every worker calls it at the same point of the loop"
                )
            store.set(STRANDED, why)
            return why
    return None
