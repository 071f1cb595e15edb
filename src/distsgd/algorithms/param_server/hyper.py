"""The worker optimiser's hyperparameters that travel with each push, and what the server does with them.

What travels: for each parameter group of the worker's optimiser, in order, those of :data:`KEYS`
the group has (``lr``; ``momentum`` (SGD, RMSprop); ``betas`` (Adam, AdamW: two values);
``weight_decay``), as float64: what torch's LR schedulers change (every one changes ``lr``;
OneCycleLR and CyclicLR cycle ``momentum`` or the first beta), and weight decay, which a user may
schedule by hand. The optimiser's other settings (eps, nesterov, dampening, amsgrad) are the
factory's, the same on both ends.

The server builds its optimiser with the same factory on the same model, so its groups correspond
to the worker's one to one. That is checked once, when a worker connects: its HELLO describes each
group (:meth:`Hyperparameters.describe`: which keys, how many tensors, which of the model's
parameters), and the server refuses a worker whose description is not its own. Every push is then
checked for values the server can step with (finite in the parameters' dtype, as the optimiser's
kernels take them; lr, momentum and weight decay >= 0; each beta in [0, 1)), on the worker (a
user's schedule gone wrong: one line) and on the server (a forged push: that connection is dropped).
"""

from __future__ import annotations

import copy
import hashlib
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from distsgd.errors import ConfigError

KEYS: tuple[tuple[str, int], ...] = (("lr", 1), ("momentum", 1), ("betas", 2), ("weight_decay", 1))


def _number(value: Any) -> bool:
    if isinstance(value, torch.Tensor):
        return value.numel() == 1
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _has(group: dict[str, Any], key: str, size: int) -> bool:
    value = group.get(key)
    if size == 1:
        return _number(value)
    return isinstance(value, (tuple, list)) and len(value) == size and all(_number(v) for v in value)


def _members(model: torch.nn.Module, group: dict[str, Any]) -> int:
    """Which of the model's parameters a group holds: a 63-bit digest of their positions in
    ``model.parameters()`` (-1 for one that is not the model's)."""
    where = {id(p): i for i, p in enumerate(model.parameters())}
    positions = torch.tensor([where.get(id(p), -1) for p in group["params"]], dtype=torch.int64)
    digest = hashlib.blake2b(positions.numpy().tobytes(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


@dataclass(frozen=True)
class Group:
    """One parameter group as a HELLO describes it: which of :data:`KEYS` it has (a bit each, in
    order), how many tensors it holds, and which (:func:`_members`)."""

    keys: int
    tensors: int
    members: int

    def names(self) -> list[str]:
        return [key for i, (key, _) in enumerate(KEYS) if self.keys >> i & 1]

    def __str__(self) -> str:
        return f"{', '.join(self.names()) or 'nothing'} over {self.tensors} tensors"


class Hyperparameters:
    """The hyperparameters an optimiser's groups carry in a push: their layout (one :class:`Group`
    each), read from the worker's optimiser, checked, and set on the server's."""

    def __init__(self, groups: Sequence[Group], dtype: torch.dtype = torch.float32) -> None:
        self.groups = tuple(groups)
        self.largest = torch.finfo(dtype).max  # a value past this is inf where the optimiser uses it
        self.fields = [(g, key, size) for g, group in enumerate(self.groups) for key, size in _fields(group)]
        self.count = sum(size for _, _, size in self.fields)  # float64 values a push carries

    @classmethod
    def of(cls, optimizer: torch.optim.Optimizer, model: torch.nn.Module) -> Hyperparameters:
        groups = []
        for group in optimizer.param_groups:
            keys = sum(1 << i for i, (key, size) in enumerate(KEYS) if _has(group, key, size))
            groups.append(Group(keys, len(group["params"]), _members(model, group)))
        dtype = next((p.dtype for p in model.parameters() if p.dtype.is_floating_point), torch.float32)
        return cls(groups, dtype)

    @classmethod
    def none(cls) -> Hyperparameters:
        """Nothing travels (async EASGD: the server's optimiser never steps)."""
        return cls(())

    def describe(self) -> list[tuple[int, int, int]]:
        """Three int64 a group, as a HELLO carries them."""
        return [(g.keys, g.tensors, g.members) for g in self.groups]

    @classmethod
    def described(cls, ints: Sequence[tuple[int, int, int]]) -> Hyperparameters:
        return cls([Group(*t) for t in ints])

    def mismatch(self, theirs: Hyperparameters) -> str | None:
        """Why a worker whose optimiser is ``theirs`` cannot push to a server whose is this (None: it can)."""
        if len(theirs.groups) != len(self.groups):
            return f"it has {len(theirs.groups)} parameter groups, the server's optimiser {len(self.groups)}"
        for i, (a, b) in enumerate(zip(theirs.groups, self.groups)):
            if a.keys != b.keys or a.tensors != b.tensors:
                return f"its parameter group {i} has {a}, the server's {b}"
            if a.members != b.members:
                return f"its parameter group {i} holds other parameters of the model than the server's"
        return None

    def read(self, optimizer: torch.optim.Optimizer, step: int = 0) -> list[float]:
        """The values this optimiser's groups hold at ``step``, in order; a ConfigError if its
        groups are no longer those it had when the worker connected, or a value is one the server
        refuses."""
        groups = optimizer.param_groups
        if len(groups) != len(self.groups) or any(
            not all(_has(group, key, size) for key, size in _fields(g)) for group, g in zip(groups, self.groups)
        ):
            raise ConfigError(
                f"the optimiser's parameter groups changed after run.setup() ({len(groups)} now, "
                f"{len(self.groups)} when the worker joined the parameter server): the server's optimiser "
                f"has the groups the factory made; add parameter groups in the optimizer factory instead"
            )
        values: list[float] = []
        for g, key, size in self.fields:
            value = groups[g][key]
            if size == 1:
                values.append(float(value))
            else:
                values.extend(float(v) for v in value)
        problem = self.invalid(values)
        if problem is not None:
            raise ConfigError(f"at step {step}, the optimiser's {problem}: the parameter server cannot step with it")
        return values

    def invalid(self, values: Sequence[float]) -> str | None:
        """What is wrong with pushed ``values`` (None: nothing): each finite in the parameters'
        dtype; lr, momentum and weight decay >= 0; a beta in [0, 1)."""
        if len(values) != self.count:
            return f"{len(values)} hyperparameters where the optimiser has {self.count}"
        at = 0
        for g, key, size in self.fields:
            for j in range(size):
                v = values[at + j]
                ok = math.isfinite(v) and abs(v) <= self.largest and (0.0 <= v < 1.0 if key == "betas" else v >= 0.0)
                if not ok:
                    name = f"betas[{j}]" if key == "betas" else key
                    bound = "in [0, 1)" if key == "betas" else ">= 0"
                    return f"{name} of parameter group {g} is {v!r} (it must be finite and {bound})"
            at += size
        return None

    def apply(self, optimizer: torch.optim.Optimizer, values: Sequence[float]) -> None:
        """Set the server's optimiser's groups to ``values`` (checked by :meth:`invalid`). A value
        the optimiser keeps as a tensor (a tensor lr) is filled in place."""
        at = 0
        for g, key, size in self.fields:
            group = optimizer.param_groups[g]
            if size == 1:
                group[key] = _set(group[key], values[at])
            else:
                group[key] = type(group[key])(_set(old, v) for old, v in zip(group[key], values[at : at + size]))
            at += size


# what a parameter group holds that is not a setting of the update: its tensors, the lr an LR
# scheduler or distsgd's --schedule started from
_NOT_SETTINGS = {"params", "initial_lr", "base_lr"}


def describe_optimizer(opt: torch.optim.Optimizer) -> str:
    return f"{type(opt).__name__}, {len(opt.param_groups)} parameter group(s)"


def optimizer_difference(theirs: torch.optim.Optimizer, server: torch.optim.Optimizer) -> str | None:
    """How an optimiser a user's loop built differs from the one the server steps with, in what
    does not travel with a push (None: in nothing): its class, its parameter groups and the
    tensors each holds, and the settings other than :data:`KEYS` (eps, nesterov, dampening, ...)."""
    if theirs is server:
        return None
    name = type(theirs).__name__
    if type(theirs) is not type(server):
        return f"yours is {name}"
    if len(theirs.param_groups) != len(server.param_groups):
        return f"your {name} has {len(theirs.param_groups)} parameter group(s)"
    travel = {key for key, _ in KEYS}
    for i, (a, b) in enumerate(zip(theirs.param_groups, server.param_groups)):
        if [id(p) for p in a["params"]] != [id(p) for p in b["params"]]:
            return f"parameter group {i} of your {name} holds other parameters of the model"
        for key in sorted((set(a) | set(b)) - _NOT_SETTINGS - travel):
            if not _same(a.get(key), b.get(key)):
                return f"your {name} has {key}={a.get(key)!r} in parameter group {i}, the server's {b.get(key)!r}"
    return None


def settings_of(opt: torch.optim.Optimizer) -> list[dict[str, Any]]:
    """A copy of each parameter group's settings that do not travel with a push (eps, nesterov,
    ...), to hold the optimiser to (:func:`settings_change`)."""
    travel = {key for key, _ in KEYS}
    return [{k: copy.deepcopy(v) for k, v in g.items() if k not in _NOT_SETTINGS | travel} for g in opt.param_groups]


def settings_change(opt: torch.optim.Optimizer, before: list[dict[str, Any]]) -> str | None:
    """How ``opt``'s settings that do not travel with a push differ from ``before``
    (:func:`settings_of`'s), in one phrase; None: in nothing. A key a group gained since (an LR
    scheduler's bookkeeping, OneCycleLR's ``max_lr``) is no setting of the optimiser's."""
    name = type(opt).__name__
    for i, (group, old) in enumerate(zip(opt.param_groups, before)):
        for key in sorted(old):
            if not _same(group.get(key), old[key]):
                return f"your {name} has {key}={group.get(key)!r} in parameter group {i}, {old[key]!r} at run.setup()"
    return None


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return bool(a == b)


def _fields(group: Group) -> list[tuple[str, int]]:
    return [(key, size) for i, (key, size) in enumerate(KEYS) if group.keys >> i & 1]


def _set(old: Any, value: float) -> Any:
    if isinstance(old, torch.Tensor):
        return old.fill_(value)
    return value


__all__ = [
    "KEYS",
    "Group",
    "Hyperparameters",
    "describe_optimizer",
    "optimizer_difference",
    "settings_change",
    "settings_of",
]
