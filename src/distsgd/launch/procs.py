"""Process plumbing for every topology; it knows no algorithm.

Worker processes are forked from a fork server that has imported torch once (:func:`mp_context`);
each has its own pipe to the launcher (:class:`Outbox` / :class:`Inbox`), sends its metrics events
and, at the end, its result or its error in one line (:func:`report`). A :class:`Supervisor`
watches them: it files what they send, notices the ones that die without a word, and names the
worker that caused a failure (:meth:`Supervisor.blame`). No worker outlives the run: they are
reaped on success, failure and Ctrl-C (:func:`spawned`), and exit by themselves when their
launcher is killed.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import pickle
import queue
import signal
import sys
import threading
import time
import warnings
from collections.abc import Iterator
from multiprocessing.connection import Connection
from multiprocessing.context import ForkServerContext, SpawnContext
from multiprocessing.process import BaseProcess
from multiprocessing.reduction import ForkingPickler
from pathlib import Path
from typing import Any, Callable, NoReturn, cast

import torch
import torch.multiprocessing as mp
from torch import nn

from distsgd.config import RunConfig
from distsgd.errors import (
    ConfigError,
    DistsgdError,
    LoopError,
    MainGuardError,
    Terminated,
    WorkerError,
    WorkerInputError,
    failure_text,
    on_sigterm,
    peer_symptom,
)
from distsgd.launch import environment
from distsgd.metrics import Sink
from distsgd.models import build_model
from distsgd.train.context import Attendance, Job, WorkerResult

log = logging.getLogger(__name__)

STOP_GRACE_S = 5.0


@contextlib.contextmanager
def child_env(values: dict[str, str], override: bool = False) -> Iterator[None]:
    """Environment variables for the block (and the processes it spawns), unless already set (with
    ``override``, whatever was set); as they were after."""
    saved = {k: os.environ.get(k) for k in values}
    for k, v in values.items():
        if override:
            os.environ[k] = v
        else:
            os.environ.setdefault(k, v)
    try:
        yield
    finally:
        for k, old in saved.items():
            if old is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = old


# A worker started by the fork server (or spawn) imports the launcher's main script again, as
# ``__mp_main__``. A script that trains at module level, without ``if __name__ == "__main__":``,
# would then train again inside each worker; such a worker exits at once with this status.
MAIN_GUARD_STATUS = 86
MAIN_GUARD = (
    "this script calls distsgd at module level, and each worker process imports the script again: "
    'put the call under  if __name__ == "__main__":'
)


def refuse_if_importing_main() -> None:
    """In a worker process that is importing the launcher's script (it is not done starting),
    exit at once with :data:`MAIN_GUARD_STATUS`, silently: the launcher says why, in one line."""
    if getattr(mp.current_process(), "_inheriting", False):
        os._exit(MAIN_GUARD_STATUS)


def mp_context() -> SpawnContext | ForkServerContext:
    """How worker processes start: forked from a fork server on Linux, spawned elsewhere.

    The fork server (one per launching process, started on first use and kept until it exits)
    has imported torch and distsgd once, so each worker starts in a fraction of a second instead
    of importing them again (3.5 s of CPU each). Like spawn, and unlike a plain fork, no worker
    inherits the launcher's threads or state; each gets the launcher's environment as it is when
    the worker starts (``_bootstrap``).
    """
    if not sys.platform.startswith("linux") or "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")  # macOS: forking after system frameworks load is unsafe
    from multiprocessing import forkserver

    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload([PRELOAD])
    # The server starts ignoring Ctrl-C (the launcher handles it and stops the workers; otherwise
    # a Ctrl-C while the server imports torch prints its traceback). Workers restore the handler.
    with child_env({"TORCH_CPP_LOG_LEVEL": "ERROR"}), _sigint_ignored(), _main_only_if_readable():
        forkserver.ensure_running()
    global _WARM_SERVER
    server = getattr(forkserver._forkserver, "_forkserver_pid", None)
    if server != _WARM_SERVER:
        # Wait until the server has imported everything: a worker asked for before then would be
        # forked later, and a Ctrl-C meanwhile would leave it to start after the launcher is gone.
        p = ctx.Process(target=_nothing, name="distsgd-warmup")
        with _main_only_if_readable():
            p.start()
        p.join()
        if p.exitcode == MAIN_GUARD_STATUS:
            raise MainGuardError(MAIN_GUARD)
        _WARM_SERVER = server
    return ctx


_WARM_SERVER: int | None = None
PRELOAD = "distsgd._preload"
_FILTERS = warnings.filters[:]  # Python's warning filters before the command changed them (--quiet)


def _nothing() -> None:
    pass


def prefork_server() -> bool:
    """Start the fork server now, by forking this process, rather than as a new interpreter that
    imports torch again (1.8 s of CPU, and the run's start waited for it). Only from a process
    that has done nothing yet but import distsgd and read its settings (the ``distsgd`` command,
    before it loads any data: no torch operation has run, no thread of its own started, no CUDA),
    and only where torch has no CUDA (finding a GPU initialises the driver, which a forked child
    cannot use: there the server is a new interpreter, as elsewhere). The server imports the rest
    (:data:`PRELOAD`: torch._dynamo, 1.2 s) while this process loads the data. Python's
    ``multiprocessing.forkserver`` is then handed this server, where its internals are the ones
    known (3.10 to 3.13; 3.14 authenticates its clients); False where nothing was started."""
    import inspect
    import signal
    import socket
    from multiprocessing import connection, forkserver, util

    server: Any = forkserver._forkserver  # Python's own internals, checked below
    known = ("_forkserver_address", "_forkserver_alive_fd", "_forkserver_pid", "_lock")
    if (
        not sys.platform.startswith("linux")
        or "forkserver" not in mp.get_all_start_methods()
        or torch.backends.cuda.is_built()
        or threading.active_count() > 1
        or not all(hasattr(server, name) for name in known)
        or list(inspect.signature(forkserver.main).parameters)
        != ["listener_fd", "alive_r", "preload", "main_path", "sys_path"]
        or server._forkserver_pid is not None
    ):
        return False
    mp.get_context("forkserver").set_forkserver_preload([PRELOAD])
    stops = {signal.SIGINT, signal.SIGTERM, signal.SIGUSR1}
    with server._lock, socket.socket(socket.AF_UNIX) as listener:
        address = cast(Any, connection).arbitrary_address("AF_UNIX")
        listener.bind(address)
        if not util.is_abstract_socket_namespace(address):
            os.chmod(address, 0o600)
        listener.listen()
        alive_r, alive_w = os.pipe()  # the server ends when its write end closes: this process has ended
        sys.stdout.flush()
        sys.stderr.flush()  # nothing written and unflushed is written again by a worker
        # a Ctrl-C or SIGTERM now waits: the child must not run this process's handlers, nor this
        # process leave the child unrecorded
        blocked = signal.pthread_sigmask(signal.SIG_BLOCK, stops)
        try:
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore", DeprecationWarning)  # 3.12's word on forking with threads
                    pid = os.fork()
            except OSError:  # no memory or processes left for it: a new interpreter, later
                os.close(alive_r)
                os.close(alive_w)
                return False
            if pid == 0:
                _serve_forked(listener.fileno(), alive_r, alive_w, blocked)
            os.close(alive_r)
            server._forkserver_address, server._forkserver_alive_fd, server._forkserver_pid = address, alive_w, pid
            # after the workers are joined at this process's exit (the server may still be importing
            # if this process ends early, on an error)
            util.Finalize(None, _end_server, (pid,), exitpriority=-100)
            global _FORKED_SERVER
            _FORKED_SERVER = pid
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
    return True


_FORKED_SERVER: int | None = None


def forked_server() -> list[int]:
    """The fork server :func:`prefork_server` forked from this process ([] if none): its CPU is the
    run's own, not another process's load (``cores.look``)."""
    return [] if _FORKED_SERVER is None else [_FORKED_SERVER]


def _serve_forked(listener_fd: int, alive_r: int, alive_w: int, mask: set[int | signal.Signals]) -> NoReturn:
    """The forked fork server: what a new interpreter would have been (the command's logging, its
    ``--quiet`` warning filters and its signal handlers undone: the fork server ignores Ctrl-C and
    SIGTERM, as :func:`_sigint_ignored` makes a new one do; the fork server's lock, held by the
    parent as it forked, a new one), then Python's fork server. Never returns."""
    import traceback
    from multiprocessing import forkserver

    status = 0
    try:
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1):
            signal.signal(sig, signal.SIG_IGN)
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)  # what came meanwhile is ignored
        os.close(alive_w)
        cast(Any, forkserver)._forkserver._lock = threading.Lock()  # a worker that starts a process takes it
        root = logging.getLogger()
        root.handlers.clear()
        root.setLevel(logging.WARNING)
        warnings.filters[:] = _FILTERS  # type: ignore[index]  # a list, typed as a Sequence
        warnings._filters_mutated()  # type: ignore[attr-defined]
        forkserver.main(listener_fd, alive_r, [PRELOAD])
    except SystemExit:  # its launcher has ended
        pass
    except BaseException:
        traceback.print_exc()
        status = 1
    finally:
        os._exit(status)


def _end_server(pid: int) -> None:
    """At this process's end, after its workers are joined: the fork server forked from it ends
    too, if it is still the one multiprocessing uses (a server that died was replaced, and its
    pid may be another process's now)."""
    from multiprocessing import forkserver

    if cast(Any, forkserver)._forkserver._forkserver_pid != pid:
        return
    with contextlib.suppress(OSError):
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)


@contextlib.contextmanager
def _sigint_ignored() -> Iterator[None]:
    """Ctrl-C and SIGTERM (SIGUSR1) ignored by what starts meanwhile: the fork server, which a
    signal to the whole process group would otherwise end at once, and with it every worker
    (their watch on their parent) before they could stop at a step with a final checkpoint. The
    fork server ends with its launcher; the workers set their own handlers."""
    import signal

    stops = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)
    try:
        old = {sig: signal.signal(sig, signal.SIG_IGN) for sig in stops}
    except ValueError:  # not the main thread: leave the handlers alone
        yield
        return
    try:
        yield
    finally:
        for sig, was in old.items():
            signal.signal(sig, was)


class _Later:
    """A worker's arguments, pickled with its process but unpickled by :func:`_bootstrap` once the
    launcher's environment is the worker's: unpickling a tensor in GPU memory (CUDA IPC) initialises
    CUDA, which reads ``CUDA_VISIBLE_DEVICES`` there and then."""

    def __init__(self, args: tuple | None = None, data: bytes = b"") -> None:
        self.args, self.data = args, data

    def __reduce__(self) -> tuple:
        # pickled while the process starts, by its own pickler: pipes and shared memory travel as usual
        return _Later, (None, bytes(ForkingPickler.dumps(self.args)))

    def load(self) -> tuple:
        # kept, as a process keeps its arguments, to its end: its pipe must not close (and be
        # collected) while a SIGTERM may arrive
        self.args = pickle.loads(self.data)
        return self.args


def _bootstrap(env: dict[str, str], target: Callable[..., None], args: _Later) -> None:
    """A worker's first step: take the launcher's environment as of now and Python's usual Ctrl-C
    handler (the fork server ignores Ctrl-C), then unpickle its arguments and run ``target``."""
    import signal

    signal.signal(signal.SIGINT, signal.default_int_handler)
    on_sigterm()  # SIGTERM (a scheduler's, a whole process group's) stops a worker as Ctrl-C does
    sys.unraisablehook = _stopped_where_it_cannot_raise
    os.environ.clear()
    os.environ.update(env)
    # the platform's default start method again, not the fork server this process came from: a
    # user's DataLoader(num_workers=2) forks its loader processes as in a plain script, where under
    # the fork server's each started a server of its own and imported torch again (4 s an epoch)
    mp.set_start_method(None, force=True)
    _exit_with_launcher()
    try:
        target(*args.load())
    except KeyboardInterrupt as exc:  # Ctrl-C or SIGTERM after its body had reported (the launcher stops a
        # worker still leaving its process group once every result is in): nothing more to say
        raise SystemExit(143 if isinstance(exc, Terminated) else 130) from None
    finally:
        # From here on a SIGTERM ends the worker (its body is done, or failed and said so). The
        # launcher's SIGTERM may land here, as the handler's Terminated, anywhere from the call on
        # (a slow exit, CUDA's or NCCL's, made that common: a traceback printed after a run that had
        # succeeded): its work is what this does, so it is swallowed, and the second call, the
        # handler having set SIG_IGN as it raised, runs to its end.
        try:
            _stop_just_ends_it()
        except Terminated:
            _stop_just_ends_it()
        _end_compile_workers()


def _end_compile_workers() -> None:
    """torch.compile's compile workers (inductor's sidecar process and its pool), where this worker
    compiled, shut down before it ends. A worker process ends with ``os._exit``, past the atexit
    hook inductor shuts them down with; torch since pytorch#185070 (2026-05) also registers a
    multiprocessing finalizer for them, but earlier ones (2.11, the GPU machine's) left the sidecar
    behind its worker while anything else held its pipe (a child the worker forked)."""
    compiling = sys.modules.get("torch._inductor.async_compile")
    if compiling is not None:
        with contextlib.suppress(Exception):  # (a pool already gone, or broken: nothing left to end)
            compiling.shutdown_compile_workers()


def _stopped_where_it_cannot_raise(unraisable: Any) -> None:
    """A worker's hook for an exception Python can only print: the launcher's SIGTERM (the
    handler's Terminated) that landed in a generator being closed or an object being collected (a
    DataLoader's iterator as another worker's failure ends this one) would be printed, "Exception
    ignored in ...", and lost: the handler, raised once, then ignores SIGTERM, and the worker ran
    on to the launcher's SIGKILL. It ends the worker, quietly, as the stop asked; anything else is
    Python's to print."""
    if isinstance(unraisable.exc_value, Terminated):
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        os._exit(143)
    sys.__unraisablehook__(unraisable)


def _stop_just_ends_it() -> None:
    """SIGTERM's default action from now on (see :func:`_bootstrap`'s last lines)."""
    import signal

    signal.signal(signal.SIGTERM, signal.SIG_DFL)


def _exit_with_launcher() -> None:
    """End this worker when its launcher dies (SIGKILL, OOM killer): no one would collect its
    result, and it would otherwise train on alone."""
    import threading

    launcher = mp.parent_process()
    if launcher is None:
        return

    def watch() -> None:
        launcher.join()
        os._exit(1)

    threading.Thread(target=watch, name="distsgd-launcher-watch", daemon=True).start()


def begin_worker(label: str, rank: int, world: int, quiet: bool = False) -> None:
    """A worker process's logging prefix and torchrun-style environment. ``quiet`` (--quiet): it
    says nothing but errors, neither warnings logged nor Python's (torch's) warnings."""
    logging.basicConfig(
        level=logging.ERROR if quiet else logging.WARNING, format=f"{label}: %(levelname)s: %(message)s"
    )
    if quiet:
        warnings.simplefilter("ignore")
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world))
    environment.become(environment.Spawned(rank, world))


def record_workers(cfg: RunConfig, procs: list[BaseProcess], roles: list[tuple[str, int]]) -> None:
    """While the run is live, ``<out>/workers.json`` lists every process: {role, rank, pid, host}."""
    if not cfg.out:
        return
    import json
    import socket

    from distsgd.checkpoint import atomic_write_bytes

    entries = [
        {"role": role, "rank": rank, "pid": p.pid, "host": socket.gethostname()}
        for (role, rank), p in zip(roles, procs)
    ]
    entries.insert(0, {"role": "launcher", "rank": None, "pid": os.getpid(), "host": socket.gethostname()})
    atomic_write_bytes(Path(cfg.out) / "workers.json", (json.dumps(entries, indent=2) + "\n").encode())


class Outbox:
    """A worker's end of its own pipe to the launcher (one writer per pipe).

    With one multiprocessing.Queue shared by all workers, a worker killed while writing keeps the
    queue's write lock forever, and every other worker blocks on its next message: the run hangs.
    A pipe per worker breaks only the dead worker's own channel.
    """

    def __init__(self, conn: Connection) -> None:
        import threading

        self.conn = conn
        self.lock = threading.Lock()  # threads of this process (the server's serving threads) take turns

    def put(self, message: tuple[str, int, object]) -> None:  # (kind, the sender's rank, body)
        with self.lock:
            self.conn.send(message)


class Inbox:
    """The launcher's ends of the workers' pipes, read as one queue: ``get(timeout)`` returns the
    next message from any worker or raises ``queue.Empty``. A pipe whose worker died is dropped."""

    def __init__(self) -> None:
        self.conns: list[Connection] = []
        # who files what :meth:`drain` reads (the run's Supervisor, once it exists); else it is dropped
        self.filer: Callable[[str, int, Any], None] | None = None

    def add(self, conn: Connection) -> None:
        self.conns.append(conn)

    def get(self, timeout: float) -> tuple[str, int, Any]:
        from multiprocessing.connection import wait

        if not self.conns:
            time.sleep(timeout)
            raise queue.Empty
        for conn in cast("list[Connection]", wait(self.conns, timeout)):  # the very objects it was given
            try:
                return conn.recv()
            except Exception:  # EOF or a message cut short: its writer is gone
                self.conns.remove(conn)
                conn.close()
        raise queue.Empty

    def drain(self, timeout: float) -> None:
        """Read what comes within ``timeout`` and hand it to :attr:`filer`: while the launcher waits
        for workers to end, a worker still writing (its result: the model, more than a pipe holds)
        must not block on a pipe nobody reads, nor the launcher wait on it for its grace."""
        deadline = time.monotonic() + timeout
        while (left := deadline - time.monotonic()) > 0:
            try:
                message = self.get(left)
            except queue.Empty:
                return
            if self.filer is not None:
                self.filer(*message)

    def finish(self, conn: Connection, timeout: float) -> list[tuple[str, int, Any]]:
        """Every message still in ``conn``'s pipe (its writer is dead), up to its end or ``timeout``;
        the pipe is then dropped."""
        messages: list[tuple[str, int, Any]] = []
        deadline = time.monotonic() + timeout
        while conn in self.conns and conn.poll(max(0.0, deadline - time.monotonic())):
            try:
                messages.append(conn.recv())
            except Exception:  # its end: every message is read
                break
        if conn in self.conns:
            self.conns.remove(conn)
        conn.close()
        return messages

    def close(self) -> None:
        for conn in self.conns:
            conn.close()
        self.conns = []


class QueueSink:
    """Forwards a worker's metrics events to the collector in the launching process."""

    def __init__(self, q: Outbox, rank: int = 0) -> None:
        self.q = q
        self.rank = rank

    def emit(self, event: dict[str, Any]) -> None:
        self.q.put(("event", self.rank, event))


def pack(result: WorkerResult) -> dict[str, Any]:
    """A WorkerResult as plain data; the model travels as torch.save bytes."""
    state = None
    if result.model is not None:
        buffer = io.BytesIO()
        torch.save({k: v.detach().cpu() for k, v in result.model.state_dict().items()}, buffer)  # the launcher
        # never touches CUDA
        state = buffer.getvalue()
    fields = {k: v for k, v in vars(result).items() if k != "model"}
    return {**fields, "model_state": state}


def fit_returned(model: nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Load the state of the model a worker returned into ``spawn(model=...)``'s, or one line: a
    module of another structure given to run.setup() (a DDP wrapper's keys start 'module.') ended
    a whole run in load_state_dict's traceback."""
    try:
        result = model.load_state_dict(state, strict=False)
        odd = [f"missing {k!r}" for k in result.missing_keys[:1]] + [
            f"unexpected {k!r}" for k in result.unexpected_keys[:1]
        ]
    except RuntimeError as exc:  # a shape that differs
        odd = [" ".join(str(exc).split())[:300]]
    if odd:
        raise ConfigError(
            f"the model main(run) returned does not fit spawn(model=...)'s {type(model).__name__} "
            f"({'; '.join(odd)}), which the run returns and saves: give run.setup() a model of that structure, "
            f"not wrapped (a DistributedDataParallel's keys start 'module.'), or pass yours as spawn(model=...)"
        )


def _say_rounded(model: nn.Module, trained: dict[str, torch.Tensor]) -> None:
    """One warning where the workers trained another floating dtype than the model built here, in
    the launcher, which the run returns, saves and evaluates (``evaluate=`` is written for it):
    ``torch.set_default_dtype(torch.float64)`` in main, which the launcher does not run, trained
    float64 weights and the model returned was them rounded to float32, without a word (an
    audit's; returning the float64 model instead broke an ``evaluate=`` fed float32 data)."""
    dtypes = {k: t.dtype for k, t in model.state_dict().items() if t.is_floating_point()}
    other = next(  # a value the built tensor cannot hold exactly (float16 trained into float32 is exact)
        (
            (k, t.dtype)
            for k, t in trained.items()
            if k in dtypes and t.is_floating_point() and torch.promote_types(t.dtype, dtypes[k]) != dtypes[k]
        ),
        None,
    )
    if other is not None:
        name, dtype = other
        log.warning(
            "the workers trained %s in %s and the model returned and saved is %s (built in the launcher, where "
            "main does not run: torch.set_default_dtype in main?): the trained weights, rounded; set the default "
            "dtype at the script's top level (every process runs it), or make the dtype the model's",
            name,
            str(dtype).removeprefix("torch."),
            str(dtypes[name]).removeprefix("torch."),
        )


def unpack(payload: dict[str, Any], job: Job) -> WorkerResult:
    payload = dict(payload)
    state = payload.pop("model_state")
    model = None
    if state is not None:
        model = build_model(job.model, job.data.input_shape, job.data.num_classes, job.cfg.init)
        trained = torch.load(io.BytesIO(state), map_location="cpu", weights_only=True)
        _say_rounded(model, trained)
        fit_returned(model, trained)
    return WorkerResult(model=model, **payload)


def report(q: Outbox, rank: int, body: Callable[[], WorkerResult]) -> None:
    """Run a worker's body; send its result, or its error in one line, to the launcher (a user's
    mistake found in the worker, such as an unreadable image, as ``user-error``; a user's own loop
    that failed, as ``fatal``: a whole line that names the worker). A launcher already gone (it
    ended the run, and said why) cannot be told anything: the worker exits, with no traceback."""
    try:
        _report(q, rank, body)
    except BrokenPipeError:
        raise SystemExit(1) from None


def _report(q: Outbox, rank: int, body: Callable[[], WorkerResult]) -> None:
    try:
        q.put(("result", rank, pack(body())))
    except KeyboardInterrupt:
        q.put(("error", rank, "interrupted"))
        raise SystemExit(130) from None
    except LoopError as exc:
        q.put(("fatal", rank, str(exc).strip().splitlines()[0]))
        # The launcher stops the run now. Gone before then, this worker would be a departure its
        # peers and its server report as a fault of their own ("connection reset", "worker gone").
        time.sleep(STOP_GRACE_S)
        raise SystemExit(1) from None
    except DistsgdError as exc:
        q.put(("user-error", rank, str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__))
        raise SystemExit(1) from None
    except BaseException as exc:  # report anything, in one line, then exit non-zero
        q.put(("error", rank, failure_text(exc)))
        raise SystemExit(1) from None


class Team:
    """The processes of a run, one per role: ``procs[i]`` is role i's current process, and every
    one has a pipe into ``inbox``. ``args(i, out, replacement)`` gives role i's arguments, ``out``
    the writing end of its pipe."""

    def __init__(
        self, cfg: RunConfig, target: Callable[..., None], roles: list[tuple[str, int]], args: Callable[..., tuple]
    ) -> None:
        self.cfg, self.target, self.roles, self.args = cfg, target, roles, args
        self.inbox = Inbox()
        self.procs: list[BaseProcess] = []
        self.pipes: list[Connection] = []  # pipes[i]: the reading end of procs[i]'s pipe
        self.mpc: SpawnContext | ForkServerContext | None = None

    def start(self, i: int, replacement: bool = False) -> BaseProcess:
        """Start role i's process (again, with ``replacement``, after the last one died)."""
        role, rank = self.roles[i]
        refuse_if_importing_main()
        with _main_only_if_readable():
            if self.mpc is None:
                self.mpc = mp_context()
            read, write = self.mpc.Pipe(duplex=False)
            self.inbox.add(read)
            p = self.mpc.Process(
                target=_bootstrap,
                name=f"distsgd-{role}-{rank}",
                args=(dict(os.environ), self.target, _Later(self.args(i, write, replacement))),
            )
            p.start()
            write.close()  # the worker holds it now
        if i < len(self.procs):
            self.procs[i], self.pipes[i] = p, read
        else:
            self.procs.append(p)
            self.pipes.append(read)
        record_workers(self.cfg, self.procs, self.roles)
        return p


class _WorkerThread(threading.Thread):
    """A worker run as a thread of the launching process (Hogwild! on one GPU): what the Supervisor
    and :func:`stop_all` ask of a worker process. A thread cannot be killed: ``terminate`` and
    ``kill`` call ``stop``, which raises the workers' shared stop flag, and the thread ends at its
    next step."""

    def __init__(self, name: str, body: Callable[..., None], args: tuple, out: Connection, stop: Callable[[], None]):
        super().__init__(name=name, daemon=True)
        self.body, self.body_args, self.out, self.stop = body, args, out, stop
        self.exitcode: int | None = None
        self.pid = os.getpid()

    def run(self) -> None:
        code = 1
        try:
            self.body(*self.body_args)
            code = 0
        except SystemExit as exc:  # report() ends a failed worker so
            code = exc.code if isinstance(exc.code, int) else 1
        except BaseException:  # noqa: BLE001 - said by report() already, in one line
            code = 1
        finally:
            self.out.close()
            self.exitcode = code

    def terminate(self) -> None:
        self.stop()

    def kill(self) -> None:
        self.stop()


class ThreadTeam(Team):
    """A :class:`Team` whose members are threads of this process, each with its own pipe to the
    inbox as a process has; ``stop()`` asks them all to stop."""

    def __init__(
        self,
        cfg: RunConfig,
        target: Callable[..., None],
        roles: list[tuple[str, int]],
        args: Callable[..., tuple],
        stop: Callable[[], None],
    ) -> None:
        super().__init__(cfg, target, roles, args)
        self.stop = stop

    def start(self, i: int, replacement: bool = False) -> BaseProcess:
        role, rank = self.roles[i]
        read, write = mp.Pipe(duplex=False)
        self.inbox.add(read)
        member = _WorkerThread(
            f"distsgd-{role}-{rank}", self.target, self.args(i, write, replacement), write, self.stop
        )
        member.start()
        as_process = cast(BaseProcess, member)  # it answers what the Supervisor and stop_all ask of one
        if i < len(self.procs):
            self.procs[i], self.pipes[i] = as_process, read
        else:
            self.procs.append(as_process)
            self.pipes.append(read)
        record_workers(self.cfg, self.procs, self.roles)
        return as_process


def with_restarts(job: Job, sink: Sink, attempt: Callable[[Job], list[WorkerResult]]) -> list[WorkerResult]:
    """Run ``attempt``; when a worker fails, up to ``--restart-workers`` times start the whole group
    again, from the last checkpoint in ``--out`` if there is one (else from the start), the way
    torchrun's ``--max-restarts`` does. Each restart is a ``restart`` event and is listed in the
    chief's ``restarts``."""
    from distsgd.callbacks import started as callbacks_started
    from distsgd.checkpoint import read_manifest

    restarts: list[dict[str, Any]] = []
    while True:
        try:
            results = attempt(job)
        except WorkerError as exc:
            if len(restarts) >= job.cfg.restart_workers or isinstance(exc, WorkerInputError):
                raise
            out = job.cfg.out
            manifest = read_manifest(Path(out)) if out else None
            resume = out if manifest is not None else None
            record = {
                "worker": str(exc).split(" failed")[0],
                "reason": str(exc),
                "at": time.time(),
                "from_checkpoint": resume is not None,
            }
            log.warning("%s; restarting the group from %s", exc, "the last checkpoint" if resume else "the start")
            sink.emit({"event": "restart", **record})
            restarts.append(record)
            if resume and manifest is not None:  # (the callbacks' counters: as a resume's, see callbacks.resumed)
                callbacks_started(job.callbacks, Path(resume), manifest.get("samples"))
                job = job.replace(cfg=job.cfg.replace(resume=resume))
            continue
        results[0].attendance = results[0].attendance or Attendance()
        results[0].attendance.restarts = restarts
        return results


def replace(team: Team, sup: Supervisor, rank: int, name: str, sink: Sink, restarts: list[dict[str, Any]]) -> bool:
    """Start role ``rank`` again after its process died, if ``--restart-workers`` has a restart
    left (``restarts``: those made so far) and it did not fail on the user's input (its
    replacement would fail again). The restart is a ``restart`` event and joins ``restarts``.
    False: no replacement; the run goes on without it."""
    for message in team.inbox.finish(team.pipes[rank], 2.0):  # what the dead one still had to say is
        sup.file(*message)  # its own (its replacement must not be blamed for it): read before deciding
    if len(restarts) >= team.cfg.restart_workers or rank in sup.users:
        return False
    record = {"worker": name, "reason": sup.reason(rank), "at": time.time()}
    sup.forget(rank)
    team.start(rank, replacement=True)
    log.warning("%s failed (%s); started a replacement", name, record["reason"])
    sink.emit({"event": "restart", **record})
    restarts.append(record)
    return True


@contextlib.contextmanager
def spawned(
    cfg: RunConfig,
    target: Callable[..., None],
    roles: list[tuple[str, int]],
    args: Callable[..., tuple],
    leave_s: float = 0.0,
    threads: Callable[[], None] | None = None,
    signalled_grace_s: float = STOP_GRACE_S,
) -> Iterator[Team]:
    """Start one process per role; yield the :class:`Team`; reap every process on the way out,
    after up to ``leave_s`` for them to end by themselves once the team's work is done. Stopped by
    SIGTERM (SIGUSR1), the processes are given ``signalled_grace_s`` to stop by themselves
    (lockstep workers: at their next step, with a final checkpoint) before SIGKILL. With
    ``threads`` (what stops them), threads of this process instead (:class:`ThreadTeam`)."""
    team = Team(cfg, target, roles, args) if threads is None else ThreadTeam(cfg, target, roles, args, threads)
    done = False
    try:
        for i in range(len(roles)):
            team.start(i)
        yield team
        done = True
    except Terminated:
        stop_all(team.procs, grace_s=signalled_grace_s, inbox=team.inbox)
        raise
    finally:
        # what comes now is read (a writer must not block) but not filed: the run has been judged,
        # and a worker's "interrupted" as it is stopped (one the server dropped, say) is no failure
        team.inbox.filer = None
        stop_all(team.procs, leave_s=leave_s if done else 0.0, inbox=team.inbox)
        if cfg.out:
            (Path(cfg.out) / "workers.json").unlink(missing_ok=True)
        team.inbox.close()


@contextlib.contextmanager
def _main_only_if_readable() -> Iterator[None]:
    """A worker started by spawn or the fork server first runs the launcher's main script again,
    from its ``__file__``; for a script read from stdin (``python -``) there is no file to run, and
    the worker would die at once. Hide such a ``__file__`` while workers start."""
    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None)
    if main is None or path is None or os.path.exists(path):
        yield
        return
    del main.__file__
    try:
        yield
    finally:
        main.__file__ = path


# After a collective timed out in a user's loop, how long the launcher waits for the worker whose
# loop stopped to say so (its own watch fires at about the same time: see errors.stall_watch).
LOOP_GRACE_S = 3.0


class Supervisor:
    """Watches worker processes through their pipes: files each one's result, the first error it
    said and its events (to ``on_event``), and notices a process that ended without a result.

    ``own``: the workers run a user's own loop (``distsgd.spawn``), where an error that is the
    user's to fix (a ``fatal`` failure of the loop, or a ``user-error``: a call distsgd refused)
    ends the run under every algorithm (:meth:`fatal_error`); a process that dies, or a worker that
    lost its peers, is a fault as in distsgd's loop."""

    def __init__(
        self, procs: list[BaseProcess], inbox: Inbox, on_event: Callable[[dict[str, Any]], None], own: bool = False
    ) -> None:
        self.procs, self.inbox, self.on_event, self.own = procs, inbox, on_event, own
        inbox.filer = self.file  # what comes while the launcher stops the workers is filed too
        self.results: dict[int, dict[str, Any]] = {}
        self.said: dict[int, str] = {}  # each worker's first error, in its own words
        self.users: set[int] = set()  # workers whose error was the user's to fix (bad data, ...)
        self.ended: set[int] = set()  # processes gone without a result
        self.fatal: list[int] = []  # workers whose failure ends the run under any algorithm, in the order heard
        self.whole: set[int] = set()  # workers whose error is a whole line that names them (a LoopError's)

    def poll(self, timeout: float) -> tuple[str, int, Any] | None:
        """File the next message, if one comes within ``timeout``. A process that exited non-zero
        has ended; one that exited 0 without a result has too, once its pipe is drained (no message
        came). Returns the message."""
        try:
            kind, rank, body = self.inbox.get(timeout)
        except queue.Empty:
            self.ended |= {r for r, p in enumerate(self.procs) if p.exitcode is not None and r not in self.results}
            return None
        finally:
            self.ended |= {r for r, p in enumerate(self.procs) if p.exitcode not in (None, 0) and r not in self.results}
            for r, p in enumerate(self.procs):
                if p.exitcode == MAIN_GUARD_STATUS:  # the user's script to mend; no restart will do
                    self.said.setdefault(r, MAIN_GUARD)
                    self.users.add(r)
        self.file(kind, rank, body)
        return kind, rank, body

    def file(self, kind: str, rank: int, body: Any) -> None:
        """Take note of one message from worker ``rank``."""
        if kind == "result":
            self.results[rank] = body
        elif kind in ("error", "user-error", "fatal"):
            if rank not in self.said and kind != "error":
                self.users.add(rank)
                if kind == "fatal" or self.own:
                    self.fatal.append(rank)
                if kind == "fatal":
                    self.whole.add(rank)
            self.said.setdefault(rank, body)
        elif kind == "event":
            self.on_event(body)

    def failed(self) -> set[int]:
        return (set(self.said) | self.ended) - set(self.results)

    def forget(self, rank: int) -> None:
        """Rank ``rank`` has a new process (a replacement): its predecessor's failure is history."""
        self.said.pop(rank, None)
        self.users.discard(rank)
        self.ended.discard(rank)
        self.whole.discard(rank)
        if rank in self.fatal:
            self.fatal.remove(rank)

    def reason(self, rank: int) -> str:
        return self.said.get(rank) or describe_exit(self.procs[rank].exitcode)

    def drain(self, seconds: float) -> None:
        """Keep filing messages for ``seconds`` (the others' news after a failure)."""
        self.drain_until(lambda: False, seconds)

    def drain_until(self, done: Callable[[], bool], seconds: float) -> None:
        """Keep filing messages until ``done()`` or ``seconds`` have passed (late results)."""
        deadline = time.monotonic() + seconds
        while not done() and time.monotonic() < deadline:
            self.poll(0.05)

    def blame(self, name: Callable[[int], str] = lambda rank: f"worker {rank}") -> WorkerError:
        """Name the worker that caused a failure, not one that merely lost its connection to it.

        When one worker dies, its peers soon fail too, with "connection reset" errors that may
        arrive first. So: listen a moment longer, then blame, in order, a worker that died without
        saying why (killed), a worker whose own loop failed (:meth:`fatal_error`), a worker whose
        error is not a peer symptom, and the first error heard. In a user's loop a collective that
        timed out is a peer symptom too: the worker whose loop stopped says so itself, a moment
        later (see ``errors.stall_watch``), so then it listens up to :data:`LOOP_GRACE_S` longer.
        """
        self.drain(1.0)

        def silent() -> list[int]:
            return sorted(r for r in self.ended - set(self.said) if self.procs[r].exitcode != 0)

        def causes() -> list[int]:
            return [r for r, text in self.said.items() if not peer_symptom(text)]

        if self.own and not (silent() or causes()):
            self.drain_until(lambda: bool(self.fatal or silent()), LOOP_GRACE_S)
        rank = (silent() or self.fatal or causes() or list(self.said) or sorted(self.failed()))[0]
        return self._error(rank, name)

    def fatal_error(self, name: Callable[[int], str] = lambda rank: f"worker {rank}") -> WorkerError | None:
        """The error that ends the run whatever the algorithm survives (a user's own loop failed in
        a worker: it raised, stopped, or distsgd refused one of its calls), if there is one: the
        first heard."""
        return self._error(self.fatal[0], name) if self.fatal else None

    def _error(self, rank: int, name: Callable[[int], str]) -> WorkerError:
        if rank in self.whole:  # the worker named itself, and the line of the user's code
            return LoopError(self.said[rank])
        if self.said.get(rank) == MAIN_GUARD:  # the script, not the worker: said as the warm-up says it
            return MainGuardError(MAIN_GUARD)
        error = WorkerInputError if rank in self.users else WorkerError
        return error(f"{name(rank)} failed: {self.reason(rank)}")


def describe_exit(code: int | None) -> str:
    if code is None:
        return "stopped"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exited with status {code}"


def stop_all(
    procs: list[BaseProcess], grace_s: float = STOP_GRACE_S, leave_s: float = 0.0, inbox: Inbox | None = None
) -> None:
    """Terminate, then kill, every process still running; reap them all. ``leave_s``: first wait
    that long for them to end by themselves (a worker holding CUDA tensors it was lent must free
    them, which a SIGTERM's default action skips: the lender then warns at its exit). ``inbox``:
    their pipes, read meanwhile (see :meth:`Inbox.drain`)."""
    _wait(procs, leave_s, inbox)
    for p in procs:
        if p.is_alive() and p.pid is not None:
            p.terminate()
            with contextlib.suppress(ProcessLookupError):  # a stopped process acts on SIGTERM once continued
                os.kill(p.pid, signal.SIGCONT)
    _wait(procs, grace_s, inbox)
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join(1.0)


def _wait(procs: list[BaseProcess], timeout: float, inbox: Inbox | None) -> None:
    """Up to ``timeout`` for every process to end, reading ``inbox`` meanwhile if given."""
    deadline = time.monotonic() + timeout
    while (left := deadline - time.monotonic()) > 0 and any(p.is_alive() for p in procs):
        if inbox is None:
            next(p for p in procs if p.is_alive()).join(left)
        else:
            inbox.drain(min(0.05, left))
