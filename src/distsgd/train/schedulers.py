"""A resumed user's loop's LR schedulers: what PyTorch's order of loading gives, in distsgd's.

``run.setup()`` restores a resumed run's optimisers before the loop builds its scheduler on them
and loads the scheduler's state from ``run.resumed``: the other way round from PyTorch's order
(scheduler built, then both loaded). Two things went wrong silently (on 30aa15c):

- the scheduler's construction set the lr, and loading its state does not set it back:
  ``LinearLR`` multiplies the lr it finds by ``start_factor``, and its later steps scale on from
  there, so a warm-up resumed past its end stepped at 0.1x the lr for the rest of the run;
  ``LambdaLR`` and ``OneCycleLR`` stepped once at their start's lr. :func:`take_up` sets the
  restored lr (and the momentum or betas a cyclic schedule sets) back.
- docs/OWN_LOOP.md's loop starts again at epoch 0, the epochs trained before passes with no
  batches, and steps a per-epoch scheduler after each: steps the loaded state has taken already
  (a ``StepLR`` halved each epoch ended 4x below a run never stopped). :class:`Replay` holds them.

The first was mended at the first pass at first (on a17af78), which set an lr the loop set by hand
after loading its scheduler back to the scheduler's. :class:`Loads` mends it where PyTorch's order
does: loading a scheduler built since ``run.setup()`` sets its optimiser's lr (and momentum, betas)
back to what they were before it was built (the checkpoint's, or one set by hand before), and an lr
set after stands. :func:`take_up` remains for a scheduler whose own ``load_state_dict`` skips its
base class's.

Schedulers are found among Python's objects (``gc.get_objects()``: nothing of an optimiser's
refers to its scheduler), once at a resumed run's first pass, and again at its first step only
where a scheduler was built after the first pass: about 0.1 s with torch imported, more with a
large heap of Python objects (1 s with 5 million lists).
"""

from __future__ import annotations

import functools
import gc
import threading
import weakref
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch.optim.lr_scheduler import LRScheduler

# what a cyclic or one-cycle scheduler's construction sets in a parameter group, besides the lr
SET_BY_SCHEDULERS = ("lr", "momentum", "betas")


def found_on(optimizers: Iterable[torch.optim.Optimizer]) -> list[LRScheduler]:
    """The LR schedulers built on ``optimizers`` (a ``SequentialLR`` or ``ChainedScheduler``, not the
    ones inside it), wherever the loop keeps them."""
    opts = list(optimizers)
    found = [
        s  # (type(): isinstance() asks some objects' __class__, and deprecated ones warn)
        for s in gc.get_objects()
        if issubclass(type(s), LRScheduler) and any(getattr(s, "optimizer", None) is o for o in opts)
    ]
    inner = {id(x) for s in found for x in getattr(s, "_schedulers", ())}
    return [s for s in found if id(s) not in inner]


def steps_taken(sched: LRScheduler) -> int | None:
    """The steps a scheduler has taken (``last_epoch``; a ``ChainedScheduler``'s, its first one's):
    0 for one built anew; None where it does not say."""
    last = getattr(sched, "last_epoch", None)
    if last is None:
        inner = getattr(sched, "_schedulers", None)
        last = getattr(inner[0], "last_epoch", None) if inner else None
    return last if isinstance(last, int) else None


def built_after(opt: torch.optim.Optimizer, routed: Any) -> bool:
    """A scheduler was built on ``opt`` since ``run.setup()`` gave it the step ``routed``: a scheduler's
    construction wraps the optimiser's ``step`` (torch marks the wrapper)."""
    step = opt.__dict__.get("step")
    return step is not routed and hasattr(step, "_wrapped_by_lr_sched")


def take_up(opt: torch.optim.Optimizer, restored: list[dict[str, Any]], found: list[LRScheduler]) -> None:
    """``opt``'s lr as its scheduler last set it, where one built on it since ``run.setup()`` loaded
    its state (it has taken steps: the checkpoint's) and the lr is not the one it set: the
    scheduler's construction set another, which its ``load_state_dict()`` leaves. A scheduler's last
    lr is the checkpoint's (or, stepped since, the one that step set); with two on one optimiser,
    the lr ``run.setup()`` restored. The momentum or betas a cyclic schedule's construction set go
    back to the restored ones too. A scheduler built anew keeps the lr it set, and so does an
    optimiser with none. One whose loading :class:`Loads` saw is left alone: its loading set the lr
    back, and an lr set by hand since stands. (With one it did not see, an lr set by hand after
    ``run.setup()`` goes back too.)"""
    mine = [s for s in found if s.optimizer is opt and s not in _SEEN]
    now = [float(g["lr"]) for g in opt.param_groups]
    loaded = [s for s in mine if (steps_taken(s) or 0) != 0 and [float(x) for x in s.get_last_lr()] != now]
    if not loaded:
        return
    last = loaded[0].get_last_lr() if len(mine) == 1 else [settings["lr"] for settings in restored]
    for group, settings, lr in zip(opt.param_groups, restored, last):
        put(group, "lr", lr)
        for key in SET_BY_SCHEDULERS[1:]:
            if key in settings and key in group:
                put(group, key, settings[key])


def saves_a_scheduler(value: Any) -> bool:
    """``run.resumed`` holds a scheduler's ``state_dict()`` (a dict with its ``last_epoch``, or a
    ``ChainedScheduler``'s list of them) somewhere."""
    if isinstance(value, dict):
        if "last_epoch" in value or "_schedulers" in value:
            return True
        return any(saves_a_scheduler(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return any(saves_a_scheduler(v) for v in value)
    return False


class Replay:
    """A resumed loop that starts again at epoch 0 runs its epochs trained before the checkpoint as
    passes with no batches, and steps its per-epoch scheduler after each, in the order the run
    before it did: the first ``last_epoch`` of them (the loaded state's steps: those taken before
    the checkpoint, wherever in the loop it was) are held, the ones after taken. A loop that starts
    again at the checkpoint's epoch e (``range(run.resumed["epoch"], E)``) replays that one alone:
    ``last_epoch - e`` are held (a scheduler stepped once an epoch took e before it). The replay lasts
    from the resumed run's first pass to its first batch (a run that resumes at the epoch after its
    checkpoint steps nothing in it). A scheduler built anew (``last_epoch`` 0) takes every step.

    The scheduler's class is given a holding ``step()`` meanwhile (it is put back at the end): its
    objects stay what they are (their ``state_dict()``, pickling, ``type()``)."""

    def __init__(self, found: list[LRScheduler], epoch: int = 0) -> None:
        self._classes: list[type] = []
        for sched in found:
            if steps_taken(sched) is None:
                continue
            _HELD[sched] = [-1, epoch]  # its steps to hold (decided at its first step in it), the replay's first epoch
            _patch(type(sched), "step", _holding_step)
            self._classes.append(type(sched))
        self._held = [s for s in found if s in _HELD]

    def end(self) -> None:
        for sched in self._held:
            _HELD.pop(sched, None)
        for cls in self._classes:
            _unpatch(cls, "step")
        self._held, self._classes = [], []


class Loads:
    """From a resumed user's loop's ``run.setup()`` to its first step: a scheduler built since on one
    of ``optimizers`` and loaded (``load_state_dict``) leaves its optimiser's lr, momentum and betas
    as they were before the first scheduler was built on it (as ``run.setup()`` restored them, or as
    the loop set them by hand since): what loading the optimiser after building the scheduler, PyTorch's
    order, leaves. An lr set by hand after the load stands (a second load sets back only what a
    construction since changed).

    The scheduler classes torch has (and those a loop defined by then) get a watching ``__init__``
    and ``load_state_dict`` meanwhile, put back at :meth:`end`; their objects stay what they are.
    A class whose own ``__init__`` is not watched (defined since) may set the lr before the watch
    sees it: its optimiser is left to :func:`take_up`."""

    def __init__(self, optimizers: Iterable[torch.optim.Optimizer]) -> None:
        self._opts = list(optimizers)
        with _LOCK:
            for opt in self._opts:
                _BEFORE[opt] = [threading.get_ident(), None]
        self._keys: list[tuple[type, str]] = []
        try:
            for cls in _classes(LRScheduler):
                for name, wrap in (("__init__", _watching_init), ("load_state_dict", _watching_load)):
                    if name in cls.__dict__:
                        _patch(cls, name, wrap)
                        self._keys.append((cls, name))
        except BaseException:  # (a class that takes no new method: the others as torch made them)
            self.end()
            raise

    def end(self) -> None:
        with _LOCK:
            for opt in self._opts:
                _BEFORE.pop(opt, None)
        for cls, name in self._keys:
            _unpatch(cls, name)
        self._opts, self._keys = [], []


def _classes(root: type) -> list[type]:
    out = [root]
    sub: type
    for sub in root.__subclasses__():
        out += [c for c in _classes(sub) if c not in out]
    return out


def settings_of(opt: torch.optim.Optimizer) -> list[dict[str, Any]]:
    """Each parameter group's lr, momentum and betas, a copy (a tensor lr is changed in place)."""
    return [{k: _copy(group[k]) for k in SET_BY_SCHEDULERS if k in group} for group in opt.param_groups]


def _copy(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, tuple):
        return tuple(_copy(v) for v in value)
    return value


def put(group: dict[str, Any], key: str, value: Any) -> None:
    """``group[key] = value``; into the tensor it holds, where it holds one (a compiled optimiser's)."""
    now = group.get(key)
    if isinstance(now, torch.Tensor) and isinstance(value, torch.Tensor) and now.shape == value.shape:
        now.copy_(value)
    elif isinstance(now, torch.Tensor) and not isinstance(value, torch.Tensor):
        now.fill_(value)
    else:
        group[key] = value


def _outermost() -> bool:
    return getattr(_DEPTH, "n", 0) == 0


def _watching_init(impl: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(impl)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        taken: list[tuple[torch.optim.Optimizer, list[Any], list[dict[str, Any]]]] = []
        outermost = _outermost()
        if outermost:  # this thread's optimisers with no construction on them yet, before this one sets anything
            with _LOCK:
                me = threading.get_ident()
                taken = [(o, e, settings_of(o)) for o, e in list(_BEFORE.items()) if e[0] == me and e[1] is None]
        _DEPTH.n = getattr(_DEPTH, "n", 0) + 1
        try:
            impl(self, *args, **kwargs)
        finally:
            _DEPTH.n -= 1
            # code of the class's own, unwatched, ran before this: it may have set the lr already
            sure = getattr(type(self).__init__, "_distsgd_wraps", None) is not None
            for opt, entry, settings in taken:
                if opt is getattr(self, "optimizer", None):
                    entry[1] = settings if sure else _UNSURE

    return __init__


def _watching_load(impl: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(impl)
    def load_state_dict(self: Any, *args: Any, **kwargs: Any) -> None:
        outermost = _outermost()  # (a SequentialLR's loads its schedulers' inside it)
        _DEPTH.n = getattr(_DEPTH, "n", 0) + 1
        try:
            impl(self, *args, **kwargs)
        finally:
            _DEPTH.n -= 1
        opt = getattr(self, "optimizer", None)
        entry = _BEFORE.get(opt) if outermost and isinstance(opt, torch.optim.Optimizer) else None
        if opt is None or entry is None or entry[1] is _UNSURE:
            return
        if entry[1] is not None:
            for group, settings in zip(opt.param_groups, entry[1]):
                for key, value in settings.items():
                    put(group, key, value)
            entry[1] = None  # (set back: a later load sets back only what a construction since set)
        _SEEN.add(self)

    return load_state_dict


# Loads' optimisers: each one's thread and its lr, momentum and betas before the first scheduler
# built on it since run.setup() or its last load (None: none built since; _UNSURE: a class's own
# unwatched code ran first); the schedulers loaded under the watch (take_up leaves them); the
# watching methods' depth of calls in this thread (the outermost one acts)
_BEFORE: weakref.WeakKeyDictionary[torch.optim.Optimizer, list[Any]] = weakref.WeakKeyDictionary()
_UNSURE = object()
_SEEN: weakref.WeakSet[LRScheduler] = weakref.WeakSet()
_DEPTH = threading.local()


# the schedulers replays hold: each with the steps it has left to hold (-1: not yet stepped) and the
# epoch its replay began at
_HELD: weakref.WeakKeyDictionary[LRScheduler, list[int]] = weakref.WeakKeyDictionary()
# each (class, method) patched: its own method (None: inherited) and the patches on it
_PATCHED: dict[tuple[type, str], tuple[Any, int]] = {}
_LOCK = threading.Lock()  # (the workers of Hogwild! on one GPU are threads of one process)


def _holding_step(impl: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(impl)
    def step(self: Any, *args: Any, **kwargs: Any) -> Any:
        left = _HELD.get(self)
        if left is not None:
            if left[0] < 0:  # (a replay from epoch e: a scheduler stepped once an epoch took e before it)
                left[0] = max(0, (steps_taken(self) or 0) - left[1])
            if left[0] > 0:
                left[0] -= 1
                return None
        return impl(self, *args, **kwargs)

    return step


def _patch(cls: type, name: str, wrap: Callable[[Callable[..., Any]], Callable[..., Any]]) -> None:
    with _LOCK:
        if (cls, name) in _PATCHED:
            own, n = _PATCHED[cls, name]
            _PATCHED[cls, name] = (own, n + 1)
            return
        own = cls.__dict__.get(name)
        impl = getattr(cls, name)
        impl = getattr(impl, "_distsgd_wraps", impl)  # (a base class's, patched too: its own)
        new = wrap(impl)
        new._distsgd_wraps = impl  # type: ignore[attr-defined]
        setattr(cls, name, new)
        _PATCHED[cls, name] = (own, 1)


def _unpatch(cls: type, name: str) -> None:
    with _LOCK:
        own, n = _PATCHED[cls, name]
        if n > 1:
            _PATCHED[cls, name] = (own, n - 1)
            return
        del _PATCHED[cls, name]
        if own is None:
            delattr(cls, name)
        else:
            setattr(cls, name, own)
