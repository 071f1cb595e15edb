"""Training through a lost worker (``--min-workers``): a lockstep group that loses a worker goes
on with the others, without a restart and without a checkpoint.

How it works, in a local run:

- The launcher holds the group's store (a ``TCPStore`` on 127.0.0.1 that no worker's death takes
  down) and watches its workers. When one dies (a process gone without a word: killed, out of
  memory), it writes the next *generation*'s members to the store, ``gen/<g>``.
- Every collective a worker waits on is waited on here (:func:`wait`, :func:`call`), in short
  slices: the wait ends when the collective does, or raises :class:`Lost` when the collective
  failed (a peer's connection closed) or the launcher announced a new generation. (A collective
  waiting on a survivor that has itself given up would otherwise wait out ``--timeout``: gloo
  closes no connection when one of its collectives fails.)
- The loop then calls :meth:`Membership.regroup`: the survivors form the next generation's group
  on the same store, under keys of its own, and every one takes the whole state (model,
  optimiser, algorithm, counters) of the most advanced of them. A death can leave one survivor a
  step ahead of another, never two (the next step's collective needs them all), and a step is
  applied only after all its collectives completed, so no replica steps on a partial average and
  the replicas are identical again. Each survivor keeps the data shard it had.

Only the waits of a worker in such a run go through here; everywhere else :func:`wait` is
``work.wait()``.
"""

from __future__ import annotations

import datetime
import io
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)

SLICE = datetime.timedelta(milliseconds=20)  # how often a wait looks whether the launcher announced a loss
PREFIX = "gen"


class Lost(RuntimeError):
    """The group lost a worker while this one waited on a collective: the loop regroups."""


def _first_line(exc: BaseException, otherwise: str) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else otherwise


def generation_key(gen: int) -> str:
    return f"{PREFIX}/{gen}"


LATEST = f"{PREFIX}/latest"


def announce(store: dist.Store, gen: int, members: list[int]) -> None:
    """The launcher's word: generation ``gen`` is ``members`` (the workers' first ranks, in order)."""
    store.set(generation_key(gen), ",".join(str(r) for r in members))
    store.set(LATEST, str(gen))


def _latest(store: dist.Store) -> int:
    """The last generation the launcher announced (0: none yet)."""
    return int(store.get(LATEST).decode()) if store.check([LATEST]) else 0


def _members(store: dist.Store, gen: int) -> list[int]:
    return [int(r) for r in store.get(generation_key(gen)).decode().split(",")]


def arrived_key(gen: int, rank: int) -> str:
    """Where worker ``rank`` says it has come to form generation ``gen``'s group."""
    return f"arrived/{gen}/{rank}"


_GATHER_SLICE = datetime.timedelta(milliseconds=100)


def joining_key(rank: int) -> str:
    """Where a replacement for worker ``rank`` says it is ready to join (its value: a token of its own)."""
    return f"joining/{rank}"


def admitted_key(token: str) -> str:
    """Where the launcher tells the replacement with ``token`` the generation it joins."""
    return f"admitted/{token}"


def ready_to_join(store: dist.Store, rank: int) -> str | None:
    """The launcher's look: the token of a replacement for ``rank`` that is ready to join, if one is."""
    key = joining_key(rank)
    if not store.check([key]):
        return None
    token = store.get(key).decode()
    store.delete_key(key)
    return token


def admit(store: dist.Store, token: str, gen: int) -> None:
    store.set(admitted_key(token), str(gen))


@dataclass(frozen=True)
class StoreAt:
    """Where a group that trains through losses keeps its generations: a ``TCPStore`` at
    ``host:port`` (a local launcher's; under torchrun, its agent's), under ``prefix``."""

    host: str
    port: int
    prefix: str = ""

    def connect(self, world: int, timeout: datetime.timedelta) -> dist.Store:
        """A connection of its own to the store (a client's)."""
        store = dist.TCPStore(self.host, self.port, world, is_master=False, timeout=timeout)
        return dist.PrefixStore(self.prefix, store) if self.prefix else store


class Membership:
    """One worker's place in a group that trains through losses: its first rank (that of its data
    shard), the current generation and its members, and the store the launcher announces on.
    ``grace_s``: how long a collective that failed outside its waits looks for the launcher's word
    of a loss (:func:`as_loss`; under torchrun longer: a host gone silent is a loss only after
    :data:`SILENT_S`)."""

    def __init__(self, at: StoreAt, rank: int, world: int, timeout_s: float, grace_s: float | None = None) -> None:
        self.first_rank, self.first_world = rank, world
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self.grace_s = LOSS_GRACE_S if grace_s is None else grace_s
        self.store = at.connect(world, self.timeout)
        self.gen = 0
        self.members = list(range(world))
        self._latest = 0  # the last generation the launcher announced, as the watcher saw it
        self._watching = True
        self._watch_store = at.connect(world, self.timeout)
        self._watcher = threading.Thread(target=self._watch, name="distsgd-membership", daemon=True)
        self.entered_at = 0.0  # a replacement's: when it said it was ready (perf_counter)
        self._stores: list[_Forming] = []  # the stores its groups formed on (see _Forming)

    @property
    def rank(self) -> int:
        """This worker's rank in the current generation's group."""
        return self.members.index(self.first_rank)

    @property
    def world(self) -> int:
        return len(self.members)

    def join(self, backend: str) -> None:
        """Form generation 0's group, as the default group, and start watching for the next."""
        self._init(backend)
        self._watcher.start()

    def enter(self, backend: str) -> None:
        """A replacement's way in: say it is ready, wait (up to ``--timeout``) for the generation
        the launcher admits it to, form that generation's group with the others (who see it
        announced at their next step), and start watching for the next."""
        import secrets

        token = secrets.token_hex(8)
        self.entered_at = time.perf_counter()
        self.store.set(joining_key(self.first_rank), token)
        self.store.wait([admitted_key(token)], self.timeout)
        self.gen = int(self.store.get(admitted_key(token)).decode())
        self.members = _members(self.store, self.gen)
        self._init(backend)
        self._watcher.start()

    def _init(self, backend: str) -> None:
        """Form the current generation's group, once all its members have come to form it (see
        :meth:`_gather`). A member lost while the group forms (it came, then died before it gave
        the others its address, or before they connected to it) fails the forming on every other
        member: each forms the launcher's next generation instead. The forming's waits on the store
        end as soon as the launcher announces such a loss (:class:`_Forming`; they would wait out
        ``--timeout``); a failure the launcher announces no loss for (within its ``grace_s``)
        is this worker's own, and raised."""
        from torch.distributed import distributed_c10d as c10d

        while True:
            self._gather()
            c10d._world.group_count = 0  # (a failed forming counted a group: the next is named as a first)
            try:
                dist.init_process_group(
                    backend=backend,
                    store=dist.PrefixStore(f"distsgd/{generation_key(self.gen)}", _Forming(self)),
                    rank=self.rank,
                    world_size=self.world,
                    timeout=self.timeout,
                )
                return
            except RuntimeError as exc:  # (a Lost, gloo's refused connection, a store's timeout)
                failed = exc
            if dist.is_initialized():  # (formed, and failed after: TORCH_DIST_INIT_BARRIER's barrier)
                _abandon_default_group()
            # a failure that is not a loss the launcher announces (within a few seconds of a
            # death) is this worker's own: raised, not waited on
            if not isinstance(failed, Lost) and not _announced_soon(self, self.store):
                raise failed
            log.info("worker %d: generation %d's group did not form (%s)", self.first_rank, self.gen, failed)
            self._follow(_latest(self.store))

    def _follow(self, latest: int) -> None:
        """Take generation ``latest`` as this worker's, and say it came to form it."""
        self.gen, self.members = latest, _members(self.store, latest)
        if self.first_rank not in self.members:  # (the launcher leaves out only the dead and the finished)
            raise RuntimeError(f"generation {latest} of the group goes on without worker {self.first_rank}")
        self.store.set(arrived_key(self.gen, self.first_rank), "1")

    def _gather(self) -> None:
        """Wait, up to ``--timeout``, until every member of the current generation has come to
        form its group, moving on to a newer generation where the launcher announces one meanwhile
        (a member lost before it came, or while the others regrouped: forming a group with it would
        wait out ``--timeout``). A member lost once it came is waited for by the group's forming
        (that window is the group's own few milliseconds)."""
        deadline = time.monotonic() + self.timeout.total_seconds()
        self.store.set(arrived_key(self.gen, self.first_rank), "1")
        while not _arrived(self.store, [arrived_key(self.gen, r) for r in self.members]):
            latest = _latest(self.store)
            if latest > self.gen:
                self._follow(latest)
            elif time.monotonic() > deadline:
                missing = [r for r in self.members if not self.store.check([arrived_key(self.gen, r)])]
                raise RuntimeError(
                    f"workers {missing} did not come to form the group within --timeout "
                    f"({self.timeout.total_seconds():g} s)"
                )

    def _watch(self) -> None:
        """Keep ``_latest``, the last generation the launcher announced (a thread of its own, on a
        store connection of its own: a blocked wait does not stop the worker)."""
        self._latest = self.gen
        while self._watching:
            try:
                self._watch_store.wait([generation_key(self._latest + 1)], datetime.timedelta(seconds=1))
            except Exception:  # not yet (a timeout), or the store went away with the launcher
                continue
            self._latest += 1

    def stop(self) -> None:
        self._watching = False

    def announced(self) -> bool:
        """Whether the launcher announced a generation after this worker's (a loss, or a
        replacement ready to join: the workers agree on when to take one in, see the loop)."""
        return self._latest > self.gen

    def loss_announced(self, store: dist.Store | None = None) -> bool:
        """Whether the launcher announced, since this worker's generation, one without a member
        of it (a later one may have a replacement in its place): as this worker's watcher saw it,
        or read on ``store`` (a connection to the launcher's: the watcher may not have seen it yet)."""
        on = self.store if store is None else store
        latest = self._latest if store is None else _latest(on)
        return any(not set(self.members) <= set(_members(on, g)) for g in range(self.gen + 1, latest + 1))

    def wait(self, work: Any) -> None:
        """Wait for ``work``; :class:`Lost` if it failed, or if the launcher announced a loss
        while it waited."""
        while True:
            try:
                work.wait(SLICE)
                return
            except RuntimeError:  # the slice ended ("Operation timed out!"), or the collective failed
                if work.is_completed():
                    # It failed (a peer is gone), or it completed just after the slice ended: a
                    # worker preempted between the two saw that once in every few DiLoCo runs on 2
                    # cores, took its completed collective for a loss and left the others waiting
                    # in the next one. The completed work's own wait says which.
                    try:
                        work.wait()
                    except RuntimeError as exc:
                        raise Lost(_first_line(exc, "a collective failed")) from None
                    return
                if self.loss_announced():  # (a survivor waits on another that gave up)
                    raise Lost("the launcher announced a lost worker") from None

    def regroup(self, backend: str) -> tuple[list[int], list[int]]:
        """Leave the group and join the next generation's (the launcher's word, waited for up to
        ``--timeout``). Returns the first ranks lost and those that joined since the last one."""
        before = set(self.members)
        deadline = time.monotonic() + self.timeout.total_seconds()
        while not _arrived(self.store, [generation_key(self.gen + 1)]):  # (a stop asked for ends it)
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"the launcher announced no next generation of the group within --timeout "
                    f"({self.timeout.total_seconds():g} s)"
                )
        self.gen = int(self.store.get(LATEST).decode())  # the newest, where several came at once
        self.members = _members(self.store, self.gen)
        _abandon_default_group()
        self._init(backend)
        return sorted(before - set(self.members)), sorted(set(self.members) - before)


def _arrived(store: dist.Store, keys: list[str]) -> bool:
    """Whether every one of ``keys`` is set, waited for one slice; a stop asked for meanwhile
    raises (:func:`_stop_if_asked`)."""
    try:
        store.wait(keys, _GATHER_SLICE)
        return True
    except RuntimeError:  # DistStoreError: not yet
        _stop_if_asked()
        return False


def _stop_if_asked() -> None:
    """Raise :class:`~distsgd.errors.Terminated` where a signal asked this worker to stop while it
    waits for the next generation, or for its group to form: no step comes that it could stop at.
    The launcher that ends a run below --min-workers announces no generation and stops its
    survivors with SIGTERM; a survivor waiting here held on until its SIGKILL, 5 s later (a wait
    that the announcement ends first returns: a stop asked for then comes at the next step, as
    usual). A launcher stopped by a signal announces nothing more either."""
    from distsgd.errors import STOP, Terminated

    if STOP.requested is not None:
        raise Terminated(*STOP.requested)


class _Forming(dist.Store):
    """The store a generation's group forms on: the launcher's, whose waits (gloo waits there for
    every member's address) end with :class:`Lost` as soon as the launcher announces that a
    member of the generation was lost, rather than after ``--timeout``."""

    def __init__(self, member: Membership, store: dist.Store | None = None) -> None:
        super().__init__()
        self.member, self.store = member, store if store is not None else member.store
        # torch calls a Python store's methods through the Python object, which it does not keep
        # alive: the member does, as long as it lives
        member._stores.append(self)

    def clone(self) -> "_Forming":  # (gloo's connections take a store connection of their own)
        return _Forming(self.member, self.store.clone())  # type: ignore[attr-defined]  # (not in torch's stubs)

    def _wait(self, keys: list[str], timeout: datetime.timedelta | None = None) -> None:
        limit = (timeout or self.member.timeout).total_seconds()
        deadline = time.monotonic() + limit
        while not _arrived(self.store, keys):
            if self.member.loss_announced(self.store):
                raise Lost(f"a member of generation {self.member.gen} was lost while its group formed")
            if time.monotonic() > deadline:
                raise dist.DistStoreError(f"wait timeout after {limit:g} s, keys: {keys}")

    def set(self, key: str, value: Any) -> None:
        self.store.set(key, value)

    def get(self, key: str) -> bytes:
        self._wait([key])
        return self.store.get(key)

    def wait(self, keys: list[str], timeout: datetime.timedelta | None = None) -> None:
        self._wait(keys, timeout)

    def check(self, keys: list[str]) -> bool:
        return self.store.check(keys)

    def add(self, key: str, value: int) -> int:
        return self.store.add(key, value)

    def compare_set(self, key: str, expected: Any, desired: Any) -> bytes:
        return self.store.compare_set(key, expected, desired)

    def delete_key(self, key: str) -> bool:
        return self.store.delete_key(key)

    def num_keys(self) -> int:
        return self.store.num_keys()


_GRAVE: list[Any] = []  # groups abandoned with a collective maybe still waiting in them: never freed
# (freeing one joins its threads, which wait out --timeout)


def _abandon_default_group() -> None:
    """Forget the default group without waiting for what is in flight in it (destroying it
    joins its threads: a collective left waiting there would hold the survivors for --timeout).
    torch has no public way to do this for gloo: where its private registry is not as expected,
    the group is destroyed, which may wait."""
    from torch.distributed import distributed_c10d as c10d

    try:
        _forget(c10d)
    except AttributeError:  # pragma: no cover - another torch's registry
        log.warning("this torch's process-group registry is not the one distsgd knows: the old group is destroyed")
        dist.destroy_process_group()


def _forget(c10d: Any) -> None:
    """What ``destroy_process_group`` does to torch's registry of groups, for the default group,
    without shutting it down. The group's name is what its store keys start with: the next
    default group is named as a first one is (its counter back to 0), so that a replacement's
    first group and the survivors' next meet under the same keys."""
    pg = c10d._get_default_group()
    _GRAVE.append(pg)
    name = c10d._world.pg_names.get(pg)
    if name is not None:
        c10d._unregister_process_group(name)
    c10d._world.group_count = 0
    c10d._world.pg_map.pop(pg, None)
    c10d._world.pg_names.pop(pg, None)
    c10d._world.pg_group_ranks.pop(pg, None)
    c10d._world.pg_backend_config.pop(pg, None)
    c10d._world.pg_to_tag.pop(pg, None)
    c10d._world.tags_to_pg.clear()
    c10d._world.pg_coalesce_state.pop(pg, None)
    c10d._update_default_pg(None)


_current: Membership | None = None


def current() -> Membership | None:
    """This worker's membership when its run trains through losses; None otherwise."""
    return _current


def set_current(membership: Membership | None) -> None:
    global _current
    _current = membership


def wait(work: Any) -> None:
    """Wait for a collective's ``work`` (see :meth:`Membership.wait`)."""
    if _current is None:
        work.wait()
    else:
        _current.wait(work)


def call(collective: Callable[..., Any], /, *args: Any, **kwargs: Any) -> None:
    """Run ``collective`` (``dist.all_reduce``, ``dist.broadcast``, ...) to its end."""
    if _current is None:
        collective(*args, **kwargs)
        return
    try:
        work = collective(*args, async_op=True, **kwargs)
    except RuntimeError as exc:  # the group is broken already
        raise Lost(_first_line(exc, "a collective failed")) from None
    _current.wait(work)


def share_state(
    states: dict[str, Any], steps: int, device: torch.device, done: bool = False
) -> tuple[dict[str, Any] | None, int, bool]:
    """In a group just formed: the state of the most advanced member (the most ``steps``; of
    those, the lowest rank), for every other member to load (None for that member itself), that
    member's rank, and whether any member's loop had ended (``done``: all then go to the end).
    ``states`` is this worker's, as a checkpoint holds it (tensors, numbers, strings, lists and
    dicts: loaded back with ``weights_only``)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    # gloo on the host: these small tensors, and the state's bytes, stay on the CPU (a GPU
    # worker's state is moved there by _to_cpu and back by map_location)
    t = torch.tensor([steps, -rank, int(done)], dtype=torch.int64, device="cpu")
    call(dist.all_reduce, t, op=dist.ReduceOp.MAX)  # the most steps; of those who have them, the lowest rank
    any_done = bool(t[2])
    top = torch.tensor([steps, -rank if steps == int(t[0]) else -world], dtype=torch.int64, device="cpu")
    call(dist.all_reduce, top, op=dist.ReduceOp.MAX)
    source = -int(top[1])
    size = torch.zeros(1, dtype=torch.int64, device="cpu")
    payload = torch.zeros(0, dtype=torch.uint8, device="cpu")
    if rank == source:
        buf = io.BytesIO()
        torch.save(_to_cpu(states), buf)
        payload = torch.frombuffer(bytearray(buf.getvalue()), dtype=torch.uint8)
        size[0] = payload.numel()
    call(dist.broadcast, size, src=source)
    if rank != source:
        payload = torch.empty(int(size[0]), dtype=torch.uint8, device="cpu")
    call(dist.broadcast, payload, src=source)
    if rank == source:
        return None, source, any_done
    loaded = torch.load(io.BytesIO(payload.numpy().tobytes()), map_location=device, weights_only=True)
    return loaded, source, any_done


LOSS_GRACE_S = 5.0  # how long a collective that failed outside these waits looks for the launcher's word of a loss
SILENT_S = 10.0  # under torchrun: a process whose heartbeat stops this long is lost (its host, killed)


def as_loss(exc: RuntimeError) -> Lost | None:
    """A collective that failed outside these waits (one of torch's own: DDP's reducer broadcasts
    its buckets' order in the second step's forward) as a :class:`Lost`, where the launcher
    announces a lost worker within :data:`LOSS_GRACE_S` (it sees a death within a fraction of a
    second; under torchrun, a host's silence within :data:`SILENT_S`); None where it does not, or
    where this worker's run does not train through losses:
    the error is then the worker's own."""
    if isinstance(exc, Lost):
        return exc
    if _current is None or not _announced_soon(_current, _current.store):
        return None
    log.info("a collective failed with a lost worker: %s", exc)
    lost = Lost(_first_line(exc, "a collective failed"))
    lost.__cause__ = exc
    return lost


def _announced_soon(member: Membership, store: dist.Store) -> bool:
    """Whether the launcher announces, within its ``grace_s``, a generation without a member
    of ``member``'s (read on ``store``)."""
    deadline = time.monotonic() + member.grace_s
    while not member.loss_announced(store):
        if time.monotonic() > deadline:
            return False
        _stop_if_asked()
        time.sleep(0.05)
    return True


def total(value: int) -> int:
    """The sum of every member's ``value`` in a group just formed (small numbers, on the host)."""
    t = torch.tensor([value], dtype=torch.int64, device="cpu")
    call(dist.all_reduce, t)
    return int(t[0])


def _to_cpu(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu()
    if isinstance(obj, dict):
        return {k: _to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to_cpu(v) for v in obj)
    return obj
