"""``--min-workers`` under torchrun (or srun): a group that trains through a lost worker, or a lost
host, when no launcher of distsgd's watches the workers.

torchrun's agent stops every process of its node when one fails (and, with ``--max-restarts``,
starts the whole group again). So here the process torchrun starts does not train: it *keeps* one
worker, a child it starts and watches as a local launcher watches its N, and lives on when that
child dies. The children form the group's generations (:mod:`distsgd.train.membership`) on the
rendezvous store the launcher named (the agent's under torchrun; under srun, rank 0's process
holds it at ``MASTER_ADDR:MASTER_PORT``), under keys of this attempt's own: no new service.

The keepers talk on that store, each on keys of its own:

- ``state/<r>``: keeper r's word that its worker failed (JSON: the how-many-th of its workers,
  why, whether it raised, whether a replacement starts);
- ``alive/<r>``: a counter keeper r adds to every :data:`HEARTBEAT_S`; one whose count stands
  still for :data:`~distsgd.train.membership.SILENT_S` is lost (its host killed or cut off);
- ``ev/<r>/<i>``, ``ev/<r>/n``: the events its worker sent (any worker may come to report: the
  lowest rank left), for keeper 0, which writes the run;
- ``result/<r>``: its worker's result (JSON); ``model/<r>`` the model's state (``torch.save``
  bytes, loaded with ``weights_only``), sent when keeper 0 asks (``send/<r>``) for the first
  member's;
- keeper 0's words to all: ``done`` (the run has every result), ``end`` (the run failed: the
  error line), ``stop/<r>`` (a replacement too late: stop it), ``silent/<r>`` (taken as lost).

Keeper 0 also does what the local launcher does (:class:`~distsgd.launch.group.Generations`):
it announces each generation, over :class:`_Keepers`, the store's view of the workers. The store's
host (torchrun's ``--rdzv-endpoint``, or rank 0's) is the one host whose loss ends the run.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

import torch.distributed as dist

from distsgd.algorithms.base import Algorithm
from distsgd.errors import WorkerError
from distsgd.launch import environment, procs
from distsgd.launch.group import Generations, Seat, _entry
from distsgd.launch.rendezvous import launcher_store, place, rendezvous_errors
from distsgd.metrics import Sink
from distsgd.train import membership
from distsgd.train.context import Attendance, Figures, Job, WorkerResult

log = logging.getLogger(__name__)

HEARTBEAT_S = 0.5  # how often a keeper says it lives


def run(job: Job, algo_cls: type[Algorithm], sink: Sink) -> list[WorkerResult]:
    """This process's part of a group that trains through losses under torchrun: it keeps one
    worker. Rank 0 gets every member's result, the first member's first (with the model); another
    rank its own worker's (an empty one where it was lost)."""
    cfg = job.cfg
    here = environment.current()
    rank, world = place()
    assert here.address is not None and here.port is not None  # a launched environment's contract
    with rendezvous_errors(cfg, "the store", "answer"):  # (rank 0's own, where no agent holds it)
        host = launcher_store(cfg, rank, world, wait_for_workers=False)
    at = membership.StoreAt(here.address, here.port, f"distsgd/through/attempt-{here.attempt}")
    store = dist.PrefixStore(at.prefix, host)
    seat = Seat(
        rank,
        world,
        through=at,
        slot=0,
        local_rank=here.local_rank,
        loopback=False,
        grace_s=membership.LOSS_GRACE_S + membership.SILENT_S,  # a host's silence is a loss after SILENT_S
    )
    job.data.share_memory_()  # a replacement reads the same copy
    keeper = _Keeper(job, store, at, rank, world, sink, hosts=not here.agent_store and rank == 0)
    keeper.beating(store.clone())  # type: ignore[attr-defined]  # (not in torch's stubs)
    try:
        with procs.spawned(
            cfg.replace(out=None),  # (no workers.json: each process would write its own one worker over the others')
            _entry,
            [("worker", rank)],
            lambda _, out, replacement: (seat, job, algo_cls, replacement, out),
            signalled_grace_s=cfg.timeout_s if cfg.out else procs.STOP_GRACE_S,  # for a final checkpoint
            leave_s=2.0,  # the worker ends by itself once it sent its result
        ) as team:
            try:
                return keeper.keep(team)
            except BaseException as exc:
                keeper.end(exc)  # before this process stops its worker (seconds, for a final checkpoint)
                raise
    except BaseException as exc:
        keeper.end(exc)
        raise
    finally:
        keeper.beats = False


class _Keeper:
    """One torchrun process's part: its worker, its heartbeat and, for rank 0, the generations."""

    def __init__(
        self, job: Job, store: dist.Store, at: membership.StoreAt, rank: int, world: int, sink: Sink, hosts: bool
    ) -> None:
        self.job, self.store, self.rank, self.world = job, store, rank, world
        self.hosts = hosts  # this process holds the store (no torchrun agent does: srun's tasks)
        self.gens = Generations(job.cfg, sink, store, at, restarts_heard=True) if rank == 0 else None
        # what this keeper's worker says (its events, a restart) goes to the run's writer: rank 0
        self.say: Sink = _Gathered(self.gens) if self.gens is not None else _Forward(store, rank)
        self.peers = _Keepers(store, world) if rank == 0 else None
        self.lives = 0  # this rank's workers that failed
        self.gone = False  # its worker died and none replaces it
        self.restarts: list[dict[str, Any]] = []
        self.beats = True
        self.posted = False
        self.zero = (0, time.monotonic())  # keeper 0's heartbeat: its count, and since when
        self.ended = False

    def beating(self, store: dist.Store) -> None:
        """Say that this process lives every HEARTBEAT_S, from a thread of its own on a store
        connection of its own (whatever the keeper waits on meanwhile), until the keeper ends."""

        def beat() -> None:
            while self.beats:
                with contextlib.suppress(RuntimeError):  # (the store gone: the others judge)
                    store.add(f"alive/{self.rank}", 1)
                time.sleep(HEARTBEAT_S)

        threading.Thread(target=beat, name="distsgd-keeper-heartbeat", daemon=True).start()

    def end(self, exc: BaseException) -> None:
        """Rank 0: the run failed; the others stop too, with the same line (where the store is
        still there to say it)."""
        if self.rank != 0 or self.ended:
            return
        self.ended = True
        with contextlib.suppress(RuntimeError):
            self.store.set("end", str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__)

    def keep(self, team: procs.Team) -> list[WorkerResult]:
        sup = procs.Supervisor(team.procs, team.inbox, self.say.emit, own=False)
        while True:
            sup.poll(0.2)
            if 0 in sup.results and not self.posted:
                self.store.set(f"result/{self.rank}", _light(sup.results[0]))
                self.posted = True
            if 0 in sup.failed() and not self.gone:
                self._failed(team, sup)
            if self.store.check([f"stop/{self.rank}"]) and team.procs[0].is_alive():
                team.procs[0].kill()  # a replacement the others finished before
            if self.gens is not None:
                assert self.peers is not None
                self.peers.read_events(self.gens.on_event)
                self.gens.admit_ready()
                self.gens.leave_behind(self.peers)
                if self.gens.finished(self.peers):
                    return self._finish(sup)
            elif self._told_to_end(team, sup):
                return [self._mine(sup)]

    def _failed(self, team: procs.Team, sup: procs.Supervisor) -> None:
        """This keeper's worker died or raised: say so (with whether a replacement starts); a
        worker that raised ends the run, once keeper 0 has had a moment to hear why."""
        self.lives += 1
        name = f"worker {self.rank}"
        for message in team.inbox.finish(team.pipes[0], 2.0):  # what it still said: why it ended
            sup.file(*message)
        if self.store.check([f"silent/{self.rank}"]) or self.store.check([f"stop/{self.rank}"]):
            # keeper 0 took it for lost, or stopped it (a replacement too late): its end is no news
            log.info("%s ended after the group went on without it (%s)", name, sup.reason(0))
            self.gone = True
            return
        raised = 0 in sup.said
        error = sup.blame(lambda _: name) if raised else None
        reason = sup.reason(0)
        # --restart-workers N: N replacements in the whole run, as in a local one (claimed on the store)
        claimed = not raised and self.store.add("restarts", 1) <= self.job.cfg.restart_workers
        replaced = claimed and procs.replace(team, sup, 0, name, self.say, self.restarts)
        self.gone = not replaced
        state = {"life": self.lives, "reason": reason, "replaced": replaced, "error": str(error) if error else None}
        self.store.set(f"state/{self.rank}", json.dumps(state))
        if error is not None:
            if self.rank != 0:  # keeper 0 hears it and ends the run with this line
                _wait_for(self.store, ["end"], 5.0)
            raise error

    def _told_to_end(self, team: procs.Team, sup: procs.Supervisor) -> bool:
        """A keeper but rank 0's: whether keeper 0 says the run has finished (having asked for
        this worker's model first, where it is the first member's); raises where keeper 0 says the
        run failed, or went silent."""
        if self.store.check(["end"]):
            raise WorkerError(self.store.get("end").decode())
        if self.store.check([f"send/{self.rank}"]) and not self.store.check([f"model/{self.rank}"]):
            state: bytes = sup.results[0]["model_state"] or b""
            self.store.set(f"model/{self.rank}", state)  # type: ignore[arg-type]  # (bytes go as they are)
        if self.store.check(["done"]):
            self.store.set(f"bye/{self.rank}", "1")
            return True
        count = self.store.add("alive/0", 0)
        if count != self.zero[0]:
            self.zero = (count, time.monotonic())
        elif count > 0 and time.monotonic() - self.zero[1] > membership.SILENT_S:  # (not before its first)
            raise WorkerError(
                f"process 0, which writes the run, went silent for {membership.SILENT_S:g} s (its host lost?)"
            )
        return False

    def _mine(self, sup: procs.Supervisor) -> WorkerResult:
        if 0 in sup.results:
            return procs.unpack(sup.results[0], self.job)
        return WorkerResult(
            rank=self.rank,
            samples=0,
            global_samples=0,
            train_wall_s=0.0,
            evals=[],
            final_test_accuracy=None,
            final_test_loss=None,
            model=None,
            attendance=Attendance(failed_workers=[self.rank]),
        )

    def _finish(self, sup: procs.Supervisor) -> list[WorkerResult]:
        """Rank 0: every member's result, the first member's with its model (from its keeper,
        asked for on the store, where it is not this one's), then ``done``."""
        assert self.gens is not None and self.peers is not None
        # the events a worker sent before its result (its keeper passed them on first), read since
        self.peers.read_events(self.gens.on_event)
        members = self.gens.members
        results = []
        for r in members:
            if r == self.rank:
                results.append(procs.unpack(sup.results[0], self.job))
                continue
            payload = _heavy(self.peers.results[r])
            if r == members[0]:
                self.store.set(f"send/{r}", "1")
                if not _wait_for(self.store, [f"model/{r}"], self.job.cfg.timeout_s):
                    raise WorkerError(f"worker {r}'s process did not send its model within --timeout")
                payload["model_state"] = self.store.get(f"model/{r}") or None
            results.append(procs.unpack(payload, self.job))
        self.store.set("done", "1")
        if self.hosts:  # the store ends with this process: the others first hear that the run is done
            live = [r for r in range(1, self.world) if r not in self.peers.silent]
            _wait_for(self.store, [f"bye/{r}" for r in live], membership.SILENT_S)
        return self.gens.results(results)


class _Keepers:
    """The workers as keeper 0 sees them on the store (:class:`~distsgd.launch.group.Workers`)."""

    def __init__(self, store: dist.Store, world: int) -> None:
        self.store, self.world = store, world
        self.taken = [0] * world  # per rank: the how-many-th of its workers whose failure was taken
        self.states: dict[int, dict[str, Any]] = {}
        self.silent: set[int] = set()  # keepers taken for lost (silent/<r> said)
        self.quiet: set[int] = set()  # of those, the ones not yet taken by the generations
        self.beats: dict[int, tuple[int, float]] = {}
        self._results: dict[int, dict[str, Any]] = {}
        self.seen = [0] * world  # events read, per rank

    @property
    def results(self) -> Mapping[int, dict[str, Any]]:
        for r in range(self.world):
            if r not in self._results and self.store.check([f"result/{r}"]):
                self._results[r] = json.loads(self.store.get(f"result/{r}"))
        return self._results

    def failed(self) -> set[int]:
        failed = set()
        for r in range(self.world):
            if self.store.check([f"state/{r}"]):
                self.states[r] = json.loads(self.store.get(f"state/{r}"))
            if r not in self._results and self._silent(r):
                # said before the generation without it is announced: its worker's end (at that
                # announcement, or a lost collective) is then no news to its keeper, if it lives
                self.store.set(f"silent/{r}", "1")
                self.silent.add(r)
                self.quiet.add(r)
            if self.states.get(r, {}).get("life", 0) > self.taken[r] or r in self.quiet:
                failed.add(r)
        return failed

    def _silent(self, rank: int) -> bool:
        """Whether keeper ``rank``'s heartbeat stood still for SILENT_S (not before its first)."""
        if rank in self.silent:
            return False  # taken already
        count, now = self.store.add(f"alive/{rank}", 0), time.monotonic()
        last = self.beats.get(rank)
        if last is None or last[0] != count:
            self.beats[rank] = (count, now)
            return False
        return count > 0 and now - last[1] > membership.SILENT_S

    def raised(self) -> set[int]:
        return {r for r, s in self.states.items() if s.get("error") and s["life"] > self.taken[r]}

    def blame(self) -> WorkerError:
        failed = sorted(self.failed())
        for r in failed:
            if r in self.raised():
                return WorkerError(self.states[r]["error"])
        return WorkerError(f"worker {failed[0]} failed: {self.reason(failed[0])}")

    def reason(self, rank: int) -> str:
        state = self.states.get(rank)
        if state is not None and state["life"] > self.taken[rank]:
            return str(state["reason"])
        return f"its process went silent for {membership.SILENT_S:g} s (its host lost?)"

    def replace(self, rank: int) -> bool:
        state = self.states.get(rank)
        if state is not None and state["life"] > self.taken[rank]:
            self.taken[rank] = state["life"]
            return bool(state["replaced"])
        self.quiet.discard(rank)
        return False

    def kill(self, rank: int) -> None:
        self.store.set(f"stop/{rank}", "1")

    def read_events(self, emit: Callable[[dict[str, Any]], None]) -> None:
        """Pass on the events the other keepers' workers sent, in each one's order."""
        for r in range(1, self.world):
            count = self.store.add(f"ev/{r}/n", 0)
            for i in range(self.seen[r], count):
                key = f"ev/{r}/{i}"
                emit(json.loads(self.store.get(key)))
                self.store.delete_key(key)
            self.seen[r] = count


class _Forward:
    """A keeper's (not rank 0's) sink: its worker's events, and its own, go on the store to keeper 0."""

    def __init__(self, store: dist.Store, rank: int) -> None:
        self.store, self.rank, self.count = store, rank, 0

    def emit(self, event: dict[str, Any]) -> None:
        self.store.set(f"ev/{self.rank}/{self.count}", json.dumps(event, separators=(",", ":")))
        self.count += 1
        self.store.add(f"ev/{self.rank}/n", 1)


class _Gathered:
    """Keeper 0's sink for its own worker's and its own events: the generations' (which keep the
    evaluations, the recoveries and the restarts, and write the run)."""

    def __init__(self, gens: Generations) -> None:
        self.gens = gens

    def emit(self, event: dict[str, Any]) -> None:
        self.gens.on_event(event)


def _wait_for(store: dist.Store, keys: list[str], seconds: float) -> bool:
    """Whether every one of ``keys`` is set within ``seconds``."""
    deadline = time.monotonic() + seconds
    while not store.check(keys):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def _light(payload: dict[str, Any]) -> str:
    """A worker's result (as :func:`procs.pack` makes it) as JSON, without the model."""
    fields = {k: v for k, v in payload.items() if k != "model_state"}
    figures = fields.pop("figures")
    attendance = fields.pop("attendance")
    return json.dumps(
        {
            **fields,
            "figures": {"type": f"{type(figures).__module__}:{type(figures).__qualname__}", **vars(figures)},
            "attendance": None if attendance is None else dataclasses.asdict(attendance),
        }
    )


def _heavy(light: Mapping[str, Any]) -> dict[str, Any]:
    """:func:`_light`'s JSON back as :func:`procs.unpack` takes it (no model). The figures' class
    is one of the ``Figures`` classes this process has loaded, by name (no other is made, and
    nothing is imported: a name on the store is anybody's who can reach it)."""
    payload = dict(light)
    figures = dict(payload.pop("figures"))
    named = figures.pop("type")
    loaded, todo = {}, [Figures]  # the classes of figures this process has (nothing is imported)
    while todo:
        for sub in todo.pop().__subclasses__():
            loaded[f"{sub.__module__}:{sub.__qualname__}"] = sub
            todo.append(sub)
    payload["figures"] = loaded.get(named, Figures)(**figures)
    attendance = payload.pop("attendance")
    payload["attendance"] = None if attendance is None else Attendance(**attendance)
    payload["model_state"] = None
    return payload
