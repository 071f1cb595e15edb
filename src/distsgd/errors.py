"""Errors that are the user's to fix.

Every mistake a user can make (a missing file, an impossible setting, a model that does not fit the
data) raises a :class:`DistsgdError`. The CLI prints it as one ``error: ...`` line on stderr and
exits with status 2; Python users catch it like any exception.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator
from types import FrameType


class DistsgdError(Exception):
    """Base class: a problem the user can fix. The message is one line."""

    exit_code = 2


class ConfigError(DistsgdError):
    """An unknown, mistyped or impossible setting."""


class DataError(DistsgdError):
    """A dataset that cannot be found, read or trusted."""


class ModelError(DistsgdError):
    """A model that cannot be built or does not fit the data."""


class CheckpointError(DistsgdError):
    """A checkpoint that cannot be read."""


class BadField(CheckpointError):
    """A field of a checkpoint's piece whose value distsgd never writes there (``what``: what it
    writes, in words); the loader names the file and the piece."""

    def __init__(self, key: str, value: object, what: str) -> None:
        text = repr(value)
        shown = text if len(text) <= 40 else f"a {type(value).__name__} ({text[:30]}...)"
        if hasattr(value, "shape") and hasattr(value, "dtype"):  # a tensor (errors knows no torch)
            shown = f"a {str(value.dtype).removeprefix('torch.')} tensor of shape {list(value.shape)}"
        super().__init__(f"'{key}' is {shown}, not {what}")


class OutputError(DistsgdError):
    """A file distsgd must write cannot be: a full disk, an unwritable or impossible path."""

    @classmethod
    def of(cls, exc: OSError, what: str = "write") -> "OutputError":
        path = exc.filename or "the run directory"
        return cls(f"cannot {what} {path}: {exc.strerror or type(exc).__name__}")


class WorkerError(DistsgdError):
    """A worker process failed (it raised, or died); the message names it and its error. Exit 2
    like every other failure the CLI reports in one line."""


class PeerFailed(WorkerError):
    """This rank of a launcher's group (torchrun's, srun's) stopped because another process of the
    group failed or could not be reached: the failure is the other's, said there."""


class Terminated(KeyboardInterrupt):
    """SIGTERM (a scheduler, ``kill``, a container runtime) arrived, or SIGUSR1 (SLURM's
    ``--signal``, a preemption notice): stop as Ctrl-C stops a run."""

    signal_name = "SIGTERM"
    signal_number = 15

    def __init__(self, signal_name: str = "SIGTERM", signal_number: int = 15) -> None:
        super().__init__(signal_name)
        self.signal_name, self.signal_number = signal_name, signal_number


class StopRequest:
    """A stop asked for by a signal, for a loop that can end at its next step with a final
    checkpoint (distsgd's loop, for an algorithm whose workers step in lockstep). While a loop
    listens (:meth:`listen`), SIGTERM and SIGUSR1 set :attr:`requested` (the signal's name)
    instead of raising :class:`Terminated`, however often they come: the loop stops at its next
    step, writes a checkpoint and raises it then; a launcher or scheduler that will not wait sends
    SIGKILL. Outside, they raise at once, as before."""

    def __init__(self) -> None:
        self.listening = False
        self.requested: tuple[str, int] | None = None  # (the signal's name, its number) once one came

    @contextlib.contextmanager
    def listen(self) -> Iterator["StopRequest"]:
        if not self.listening:  # a run's: a request of an earlier run in this process is not its own
            self.requested = None
        was, self.listening = self.listening, True
        try:
            yield self
        finally:
            self.listening = was


STOP = StopRequest()  # this process's; the handler on_sigterm installs reads it


class Hold:
    """Code a signal must not cut midway: handing one event to every sink (cut there, the sinks
    after the one interrupted missed it, 4 SIGTERMs of 5 in the audit, and once MLflow's SQLite
    transaction stayed locked: 934 lines of tracebacks). While :meth:`held` runs in the main
    thread, the :class:`Terminated` of a SIGTERM (SIGUSR1) waits, and is raised as it ends."""

    def __init__(self) -> None:
        self.depth = 0
        self.pending: tuple[str, int] | None = None

    @contextlib.contextmanager
    def held(self) -> Iterator[None]:
        import threading

        if threading.current_thread() is not threading.main_thread():  # (where no signal lands)
            yield
            return
        self.depth += 1
        try:
            yield
        finally:
            self.depth -= 1
        if self.depth == 0 and self.pending is not None:  # (after an exception of its own: raised at the next)
            name, number = self.pending
            self.pending = None
            raise Terminated(name, number)


HOLD = Hold()  # this process's; the handler on_sigterm installs reads it


def on_sigterm() -> Callable[[], None]:
    """From now on, SIGTERM (and SIGUSR1) raises :class:`Terminated` in this process's main thread
    (as SIGINT raises KeyboardInterrupt), so every clean-up on the way out runs; later ones are
    ignored while it does. While a loop listens to :data:`STOP`, they only ask it to stop. Returns
    what puts the previous handlers back. No-op off the main thread."""
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():
        return lambda: None

    def handler(signum: int, frame: object) -> None:
        name = signal.Signals(signum).name
        if STOP.listening:  # the loop stops at its next step, with a final checkpoint
            STOP.requested = STOP.requested or (name, signum)
            return
        # once: a second SIGTERM (a process group's and then the launcher's, say) must not break the
        # clean-up the first one started; the launcher still ends a worker that will not stop
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.signal(signal.SIGUSR1, signal.SIG_IGN)
        if HOLD.depth > 0:  # an event on its way to the sinks: raised once every sink has it
            HOLD.pending = (name, signum)
            return
        raise Terminated(name, signum)

    previous = {sig: signal.signal(sig, handler) for sig in (signal.SIGTERM, signal.SIGUSR1)}

    def restore() -> None:
        for sig, was in previous.items():
            signal.signal(sig, was)

    return restore


def ended_by_sigterm_within(seconds: float, asked: bool = False) -> None:
    """Wait ``seconds`` for a SIGTERM that ends this process at once, silently (its default
    action: no clean-up of the caller's runs after it; stdout and stderr are flushed first), or
    end so now where one was ``asked`` for already (a loop that listened took it as a stop
    request). In the main thread only; elsewhere returns at once."""
    import logging
    import os
    import signal
    import threading
    import time

    if threading.current_thread() is not threading.main_thread():
        return
    for handler in logging.getLogger().handlers:
        handler.flush()
    sys.stdout.flush()
    sys.stderr.flush()
    previous = signal.signal(signal.SIGTERM, signal.SIG_DFL)
    try:
        if asked:
            os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(seconds)
    finally:
        signal.signal(signal.SIGTERM, previous if previous is not None else signal.SIG_DFL)


class WorkerInputError(WorkerError):
    """A worker stopped on a user's mistake it found (an unreadable image, a bad sample): no
    restart (``--restart-workers``) can mend it."""


class LoopError(WorkerInputError):
    """A worker's own loop (``main(run)``, :func:`distsgd.spawn`) failed: it raised, or it took no
    step for ``--timeout`` seconds. The user's code to mend, so it stops the run under every
    algorithm, with no restart (a worker process that dies is a fault the asynchronous algorithms
    survive; this is not). The message names the worker and the line of the user's code."""


class MainGuardError(WorkerInputError):
    """The launching script calls distsgd at its module level, without ``if __name__ ==
    "__main__":``: a worker process, importing the script again as it starts, reached the call
    (it would train again), so no worker can start. The script's to mend: no restart."""


# What a worker says when a peer, not itself, went wrong.
PEER_SYMPTOMS = (
    "Connection reset by peer",
    "Connection closed by peer",
    "Socket closed",
    "Broken pipe",
    "Timed out",
    "timed out",
    "NCCL communicator was aborted",
)


def peer_symptom(text: str) -> bool:
    """``text`` (an error) is what a worker says when a peer, not itself, went wrong."""
    return any(s in text for s in PEER_SYMPTOMS)


# what str.splitlines() splits at: a user's text (a path, a name read from a damaged file) that holds
# one would make an ``error:`` line two
_BREAKS = str.maketrans({c: repr(c)[1:-1] for c in "\n\r\x0b\x0c\x1c\x1d\x1e\x85\u2028\u2029"})


def one_line(text: object) -> str:
    """``text`` as one line: every line break in it written as its escape (``\\n``), as repr does."""
    return str(text).translate(_BREAKS)


def error_text(exc: BaseException) -> str:
    """An exception in one line: its type and the first line of its message."""
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__


def failure_text(exc: BaseException) -> str:
    """:func:`error_text`, then the innermost line of the user's code in ``exc``'s traceback where
    it has one: ``ValueError: bad forward (my_model.py:52)``, what a worker that failed says of it
    (it prints no traceback: the line is where to look)."""
    import traceback

    code = _Code()
    place = code.user_place([(frame.f_code.co_filename, line) for frame, line in traceback.walk_tb(exc.__traceback__)])
    return error_text(exc) + (f" ({place})" if place else "")


Stack = list[tuple[str, int]]  # (file, line) of each frame, outermost first


class _Code:
    """Whose code a frame is in: the user's; distsgd's at a sync point (its algorithms and
    launchers, and torch.distributed: where a worker waits for its peers or talks to them);
    distsgd's elsewhere; or a library's (torch, the standard library, installed packages).
    ``watch``: for :func:`stall_watch`, a backward pass (DDP all-reduces inside it) and
    torch.compile compiling count as sync points too: the watch leaves them alone."""

    USER, SYNC, OURS, LIBRARY = "user", "sync", "distsgd", "library"

    def __init__(self, watch: bool = False) -> None:
        import os
        import sysconfig

        sep = os.sep
        self.ours = os.path.dirname(os.path.abspath(__file__)) + sep
        torch = sys.modules.get("torch")
        torch_dir = os.path.dirname(os.path.abspath(torch.__file__)) + sep if torch and torch.__file__ else None
        # (membership.py: where every collective of the algorithms is waited for)
        sync = [self.ours + "algorithms" + sep, self.ours + "launch" + sep, self.ours + f"train{sep}membership.py"]
        if torch_dir:
            parts = ["distributed"] + (["autograd", "_dynamo", "_inductor"] if watch else [])
            sync += [torch_dir + part + sep for part in parts]
        paths = sysconfig.get_paths()
        libraries = {
            os.path.abspath(paths[k]) + sep for k in ("stdlib", "platstdlib", "purelib", "platlib") if k in paths
        }
        libraries |= {
            os.path.abspath(p) + sep for p in sys.path if p.rstrip(sep).endswith(("site-packages", "dist-packages"))
        }
        if torch_dir:
            libraries.add(torch_dir)
        self.sync, self.libraries = tuple(sync), tuple(sorted(libraries))

    def zone(self, filename: str) -> str:
        import os

        if filename.startswith("<frozen"):  # importlib's
            return self.LIBRARY
        path = filename if filename.startswith("<") else os.path.abspath(filename)
        if path.startswith(self.sync):
            return self.SYNC
        if path.startswith(self.ours):
            return self.OURS
        return self.LIBRARY if path.startswith(self.libraries) else self.USER

    def inner(self, stack: Stack) -> str | None:
        """The zone of the innermost frame that is not a library's."""
        return next((z for z in (self.zone(name) for name, _ in reversed(stack)) if z != self.LIBRARY), None)

    def called_by_user(self, stack: Stack) -> bool:
        """Whether the innermost frame outside the libraries (torch.distributed's included) is the
        user's: a library call the loop made, not one of distsgd's synchronisations."""
        import os

        for name, _ in reversed(stack):
            zone = self.zone(name)
            if zone == self.LIBRARY or (zone == self.SYNC and not os.path.abspath(name).startswith(self.ours)):
                continue
            return zone == self.USER
        return False

    def user_place(self, stack: Stack) -> str | None:
        """``file:line`` of the innermost frame in the user's code (the file relative to the working
        directory when it lies under it)."""
        import os

        for filename, line in reversed(stack):
            if self.zone(filename) == self.USER:
                if not filename.startswith("<"):
                    path, here = os.path.abspath(filename), os.getcwd() + os.sep
                    filename = path[len(here) :] if path.startswith(here) else path
                return f"{filename}:{line}"
        return None


NO_GROUP = "Default process group has not been initialized"  # torch.distributed's, called with no group
TWICE = "trying to initialize the default process group twice"  # its init_process_group, called with one


def loop_failure(exc: BaseException, worker: str) -> LoopError | None:
    """What ``exc``, raised out of a user's ``main(run)`` in ``worker``, means: a :class:`LoopError`
    naming the worker and the innermost line of the user's code in its traceback; None when it is
    not the loop's failure but the symptom of a fault elsewhere (raised where the worker waits for
    its peers or talks to them, or a library's "connection reset": the launcher blames the worker
    that failed), or distsgd's own one-line refusal of a call (:class:`DistsgdError`, raised as it is)."""
    if isinstance(exc, DistsgdError):
        return None
    import traceback

    code = _Code()
    stack = [(frame.f_code.co_filename, line) for frame, line in traceback.walk_tb(exc.__traceback__)]
    # (torch.distributed's words for a call the loop made with no process group are its mistake, not a peer's fault)
    mistake = NO_GROUP in str(exc) or TWICE in str(exc)
    if code.inner(stack) == code.SYNC and not (mistake and code.called_by_user(stack)):
        return None
    if stack and code.zone(stack[-1][0]) != code.USER and peer_symptom(str(exc)):  # gloo's or NCCL's words
        return None
    # no frame of the user's (their code installed as a package): main's own, the one run_own_loop called
    where = code.user_place(stack) or (f"{stack[1][0]}:{stack[1][1]}" if len(stack) > 1 else "?")
    return LoopError(f"{worker} failed in main ({where}): {error_text(exc)}")


def waited_too_long(exc: BaseException, timeout_s: float) -> RuntimeError | None:
    """A collective of a user's loop that timed out (gloo's or NCCL's words), said as what it
    means: this worker waited --timeout for a peer that was elsewhere (an evaluation or a save on
    one worker, inside ``run.paused()`` too, where that worker's own watch leaves it be); None for
    any other error. Its words stay a peer symptom: a peer whose loop stopped names itself."""
    if not any(s in str(exc) for s in ("Timed out", "timed out")):
        return None
    import traceback

    code = _Code()
    stack = [(frame.f_code.co_filename, line) for frame, line in traceback.walk_tb(exc.__traceback__)]
    if code.inner(stack) != code.SYNC:  # (a DataLoader's timeout, a download's: their own words)
        return None
    place = code.user_place(stack)
    return RuntimeError(
        f"waited --timeout ({timeout_s:g} s) for the other workers at a synchronisation"
        f"{f' ({place})' if place else ''} and timed out: one of them stopped, or was elsewhere that long (a "
        f"worker that evaluates or saves alone, inside run.paused() too, needs a longer --timeout: timeout= in spawn)"
    )


def _stack_of(frame: FrameType | None) -> Stack:
    """The (file, line) of ``frame`` and its callers, outermost first."""
    stack: Stack = []
    while frame is not None:
        stack.append((frame.f_code.co_filename, frame.f_lineno))
        frame = frame.f_back
    stack.reverse()
    return stack


# what a loop that takes no step for --timeout is told (an evaluation, a save)
LONGER = (
    "an evaluation or a save that long between steps goes inside run.paused(), or needs a longer --timeout "
    "(timeout= in spawn)"
)

WAITING_S = 1.0  # a wait for peers this long, with no progress, is reported to stall_watch's ``waiting``


@contextlib.contextmanager
def stall_watch(
    worker: str,
    progress: Callable[[], object],
    timeout_s: float,
    waiting: Callable[[bool], None] | None = None,
    paused: Callable[[], bool] | None = None,
) -> Iterator[None]:
    """While the body (a user's ``main(run)``) runs in this process's main thread: once
    ``progress()`` has kept one value for ``timeout_s`` seconds (None: the loop is not training,
    and is not watched) while the main thread is in the user's code, the main thread raises a
    :class:`LoopError` where it is, naming ``worker`` and that line; not while ``paused()`` (an
    evaluation in ``run.paused()``), nor at one of distsgd's sync points (the peer that stopped
    is the one to name; that wait has its own deadline), off the main thread, or where its signal is taken.
    ``waiting(in_backward)`` is called (from the watch's thread, at most four times a second) while
    the main thread, training, has waited for its peers (in a collective; ``in_backward``: or in a
    backward pass, where DDP's all-reduces wait) for :data:`WAITING_S` with no progress: see
    :func:`distsgd.train.lockstep.stranded`."""
    import signal
    import threading
    import time

    sig = getattr(signal, "SIGRTMAX", None)  # a real signal: it interrupts a sleep or a blocking read
    if sig is None or threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.getsignal(sig)
    if previous is not signal.SIG_DFL:
        yield
        return
    code, main_thread = _Code(watch=True), threading.get_ident()
    peers = _Code()  # where the main thread waits for its peers: a backward's computing is not
    done, armed = threading.Event(), threading.Event()

    def stuck_at(frame: FrameType | None) -> str | None:
        """The line of the user's code the main thread is at, if it is in the user's code."""
        stack = _stack_of(frame)
        return code.user_place(stack) if code.inner(stack) == code.USER else None

    def at_a_wait() -> bool | None:
        """Whether the main thread waits for its peers: True in a collective, False in a backward
        pass (or compiling), None elsewhere."""
        stack = _stack_of(sys._current_frames().get(main_thread))
        return True if peers.inner(stack) == peers.SYNC else False if code.inner(stack) == code.SYNC else None

    def interrupted(signum: int, frame: FrameType | None) -> None:
        if done.is_set() or not armed.is_set():
            return
        armed.clear()
        where = stuck_at(frame)
        if where is not None:  # else it has moved on into distsgd meanwhile: the watch goes on
            raise LoopError(f"{worker} made no progress for {timeout_s:g} s (--timeout), in main ({where}); {LONGER}")

    def watch() -> None:
        last, since = progress(), time.monotonic()
        waited: float | None = None  # since when the main thread has waited for its peers, with no progress
        while not done.wait(min(timeout_s / 8, 0.25)):
            now, value = time.monotonic(), progress()
            if waiting is not None:
                at = None if value is None or value != last else at_a_wait()
                waited = None if at is None else waited if waited is not None else now
                if at is not None and waited is not None and now - waited >= WAITING_S:
                    with contextlib.suppress(Exception):  # the store gone with the run: nothing to say
                        waiting(not at)
            if value is None or value != last or (paused is not None and paused()):
                last, since = value, now
            elif now - since >= timeout_s and not armed.is_set():
                frame = sys._current_frames().get(main_thread)
                if frame is not None and stuck_at(frame) is not None:
                    armed.set()
                    signal.pthread_kill(main_thread, sig)

    signal.signal(sig, interrupted)
    watcher = threading.Thread(target=watch, name="distsgd-loop-watch", daemon=True)
    watcher.start()
    try:
        yield
    finally:
        done.set()
        watcher.join()
        signal.signal(sig, previous)  # after the watcher's last signal: it finds done set
